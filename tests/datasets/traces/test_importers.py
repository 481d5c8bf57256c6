"""Importers of what machines print: Kineto traces, nccl-tests logs, iteration records, bundles."""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from tagplan.datasets.traces.bundle import IterationRecord, read_bundle, write_bundle
from tagplan.datasets.traces.importing import detect_kind, import_file, import_to_bundle
from tagplan.datasets.traces.iterations import import_iterations
from tagplan.datasets.traces.kineto import import_kineto, read_kineto
from tagplan.datasets.traces.nccl import import_nccl_tests
from tagplan.errors import SpecError
from tagplan.frontends.nccl_tests import load_nccl_tests
from tagplan.ir.model import OpKind
from tagplan.ir.workload import DType

FIXTURES = Path(__file__).parent / "fixtures"
KINETO_CPU = FIXTURES / "kineto_cpu.json"
KINETO_GPU = FIXTURES / "kineto_gpu_snippet.json"
ITERATIONS_JSONL = FIXTURES / "iterations.jsonl"
ITERATIONS_CSV = FIXTURES / "iterations.csv"
NCCL_FIXTURES = Path(__file__).parents[2] / "frontends" / "fixtures"
NCCL_1NODE = NCCL_FIXTURES / "all_reduce_perf_1node.log"
NCCL_2NODES = NCCL_FIXTURES / "nccl_tests_2nodes.log"


def _cpu_ops(path: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "cpu_op" and e["name"] == name]


def _write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


# --- Kineto, CPU (a real torch.profiler trace) -------------------------------------------------------------


def test_cpu_trace_linear_flops_are_2mkn_of_the_recorded_shapes() -> None:
    records = import_kineto(KINETO_CPU, device="cpu")
    linears = [r for r in records if r.name == "aten::linear"]
    raw = _cpu_ops(KINETO_CPU, "aten::linear")
    expected = {}
    for e in raw:
        x, w = e["args"]["Input Dims"][:2]
        expected[(math.prod(x[:-1]), x[-1], w[0])] = 2.0 * math.prod(x[:-1]) * x[-1] * w[0]
    assert len(linears) == len(expected) == 2  # the projection and the vocabulary head
    for r in linears:
        assert (r.kind, r.phase, r.dtype, r.device) == (OpKind.MATMUL, "forward", DType.FP32, "cpu")
        assert r.flops == expected[(r.shape["m"], r.shape["k"], r.shape["n"])]
        assert r.repeats == sum(1 for e in raw if e["args"]["Input Dims"][1][0] == r.shape["n"]) == 2
        assert r.param_bytes == (r.shape["n"] * r.shape["k"] + r.shape["n"]) * 4  # weight and bias, fp32
        assert r.bytes_written == r.shape["m"] * r.shape["n"] * 4


def test_cpu_trace_backward_matmuls_are_each_addmm_backwards_two_gemms_as_one_call_of_the_forwards_size() -> None:
    """The bundle's convention: a backward record is the forward op's figures and its whole backward's time. A
    linear's backward runs two GEMMs of its size (the input's and the weight's gradients) in one autograd node:
    one record per node kind and size, their summed seconds (the median over the node's calls)."""
    records = import_kineto(KINETO_CPU, device="cpu")
    backward = {r.flops: r for r in records if r.kind is OpKind.MATMUL and r.phase == "backward"}
    events = json.loads(KINETO_CPU.read_text())["traceEvents"]
    nodes = [e for e in events if e.get("name", "").startswith("autograd::engine::evaluate_function: AddmmBackward0")]
    pairs: dict[float, list[float]] = {}
    for node in nodes:
        gemms = [e for e in events if e.get("name") == "aten::mm" and node["ts"] <= e["ts"] < node["ts"] + node["dur"]]
        assert len(gemms) == 2
        flops = {2.0 * a[0] * a[1] * b[1] for a, b in (e["args"]["Input Dims"] for e in gemms)}
        assert len(flops) == 1  # the two gradients of one linear do the same work
        pairs.setdefault(flops.pop(), []).append(sum(e["dur"] for e in gemms) / 1e6)
    assert set(backward) == set(pairs) and len(pairs) == 2
    for flops, r in backward.items():
        assert r.name == "AddmmBackward0 (2 GEMMs)" and r.repeats == len(pairs[flops])
        assert r.time_s == pytest.approx(statistics.median(pairs[flops]))
    forward = {r.flops for r in records if r.name == "aten::linear"}
    assert set(backward) == forward  # the forward op's figures


def test_cpu_trace_records_outermost_ops_only() -> None:
    result = read_kineto(KINETO_CPU, device="cpu")
    names = {r.name for r in result.records}
    # implementations of recorded ops: counted inside their parent, never again
    assert names.isdisjoint({"aten::addmm", "aten::native_layer_norm", "aten::_softmax", "aten::index_select",
                             "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::embedding_dense_backward"})
    linear = next(r for r in result.records if r.name == "aten::linear" and r.shape["n"] == 32)
    inclusive_us = [e["dur"] for e in _cpu_ops(KINETO_CPU, "aten::linear") if e["args"]["Input Dims"][1][0] == 32]
    assert linear.time_s == pytest.approx(statistics.median(inclusive_us) / 1e6)
    # every forward kind of the model, and a backward record for each but the lookup's (its dense backward, a sort
    # and a scatter over the table, is skipped and counted)
    forward = {r.kind for r in result.records if r.phase == "forward"}
    backward = {r.kind for r in result.records if r.phase == "backward"}
    kinds = {OpKind.MATMUL, OpKind.ATTENTION, OpKind.LAYERNORM, OpKind.SOFTMAX, OpKind.ELEMENTWISE, OpKind.EMBEDDING}
    assert forward == kinds and backward == kinds - {OpKind.EMBEDDING}
    assert any(name.startswith("aten::embedding_backward (the dense embedding backward") for name in result.skipped)
    # skipped: unmapped aten ops (views and reductions) and the lookup's backward, none of the mapped forward names
    assert result.skipped and all(name.startswith("aten::") for name in result.skipped)
    assert {"aten::view", "aten::t", "aten::sum"} <= set(result.skipped)
    assert "aten::addmm" not in result.skipped


def test_cpu_trace_attention_and_softmax_costs() -> None:
    records = import_kineto(KINETO_CPU, device="cpu")
    sdpa = next(r for r in records if r.name == "aten::scaled_dot_product_attention")
    q = _cpu_ops(KINETO_CPU, "aten::scaled_dot_product_attention")[0]["args"]["Input Dims"][0]
    heads, s, d = q[0] * q[1], q[2], q[3]
    assert sdpa.flops == 4.0 * heads * s * s * d + 5.0 * heads * s * s
    assert sdpa.bytes_read == 3 * math.prod(q) * 4 and sdpa.bytes_written == math.prod(q) * 4
    softmax = next(r for r in records if r.name == "aten::softmax")
    assert softmax.flops == 5.0 * softmax.shape["rows"] * softmax.shape["cols"]
    embedding = next(r for r in records if r.name == "aten::embedding")
    assert embedding.flops == 0 and embedding.param_bytes == embedding.shape["vocab"] * embedding.shape["hidden"] * 4


# --- Kineto, GPU (hand-written to the documented format) ----------------------------------------------------


def test_gpu_trace_sums_the_kernels_of_each_op() -> None:
    result = read_kineto(KINETO_GPU, device="h100-sxm")
    by_time = {round(r.time_s * 1e6, 3): r for r in result.records}
    # 120.5 + 9.5 us for the linear; its backward's two GEMMs, 250 + 240 us; the stray fill kernel is nobody's
    assert set(by_time) == {130.0, 490.0}
    linear = by_time[130.0]
    assert (linear.name, linear.phase, linear.dtype) == ("aten::linear", "forward", DType.BF16)
    assert linear.flops == 2.0 * 1024 * 1024 * 4096
    assert linear.param_bytes == (4096 * 1024 + 4096) * 2
    backward = by_time[490.0]
    assert (backward.name, backward.phase, backward.flops) == ("AddmmBackward0 (2 GEMMs)", "backward", linear.flops)
    assert result.skipped == {}  # aten::t sits inside the linear


def test_gpu_trace_leaves_autocasts_casts_out_of_an_ops_time(tmp_path: Path) -> None:
    """The cost model charges an eager runtime's casts apart (`compute.eager_extra_s`): under autocast the op
    casts its inputs, then calls itself again on them, and the casts' kernels are not the op's. A conversion
    inside an op that does not call itself again is the op's own work and stays in its time."""
    base = json.loads(KINETO_GPU.read_text())
    linear = next(e for e in base["traceEvents"] if e.get("name") == "aten::linear")
    where = {"pid": linear["pid"], "tid": linear["tid"]}
    cast = [{"ph": "X", "cat": "cpu_op", "name": "aten::_to_copy", **where, "ts": 1005.5, "dur": 1.5,
             "args": {"External id": 13, "Input Dims": [[4096, 1024]], "Input type": ["float"]}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", **where, "ts": 1006.0, "dur": 0.5,
             "args": {"External id": 13, "correlation": 502}},
            {"ph": "X", "cat": "kernel", "name": "bfloat16_copy_kernel", "pid": 0, "tid": 7, "ts": 1040.0,
             "dur": 30.0, "args": {"External id": 13, "correlation": 502}}]
    recall = {**linear, "ts": 1007.5, "dur": 50.0, "args": {**linear["args"], "External id": 14}}
    for events, expected_us in (([*cast, recall], 130.0), (cast, 160.0)):
        trace = copy.deepcopy(base)
        trace["traceEvents"] += copy.deepcopy(events)
        records = import_kineto(_write_json(tmp_path / f"cast{len(events)}.json", trace), device="h100-sxm")
        assert next(r for r in records if r.name == "aten::linear").time_s == pytest.approx(expected_us * 1e-6)


def test_gpu_join_falls_back_to_external_id(tmp_path: Path) -> None:
    trace = json.loads(KINETO_GPU.read_text())
    launch = next(e for e in trace["traceEvents"] if e.get("args", {}).get("correlation") == 501
                  and e["cat"] == "cuda_runtime")
    launch["ts"] = 9000.0  # outside every cpu_op; its External id (12, the addmm) still names the op
    records = import_kineto(_write_json(tmp_path / "moved.json", trace), device="h100-sxm")
    assert any(r.name == "aten::linear" and r.time_s == pytest.approx(130e-6) for r in records)


def test_gpu_repeated_calls_become_one_record_with_the_median(tmp_path: Path) -> None:
    trace = json.loads(KINETO_GPU.read_text())
    events = trace["traceEvents"]
    call = [e for e in events if e.get("ph") == "X" and 1000 <= e["ts"] < 1300 and e["cat"] != "kernel"]
    kernels = [e for e in events if e.get("cat") == "kernel" and e["args"]["correlation"] == 501]
    for n, gemm_us in ((1, 190.5), (2, 990.5)):  # two more calls: 200 and 1000 us with the 9.5 us reduction
        for e in call:
            events.append({**copy.deepcopy(e), "ts": e["ts"] + 10000 * n})
            if e["cat"] == "cuda_runtime":
                events[-1]["args"]["correlation"] = 501 + 1000 * n
        for e, dur in zip(kernels, (gemm_us, 9.5), strict=True):
            events.append({**copy.deepcopy(e), "ts": e["ts"] + 10000 * n, "dur": dur})
            events[-1]["args"]["correlation"] = 501 + 1000 * n
    linear = [r for r in import_kineto(_write_json(tmp_path / "three.json", trace), device="h100-sxm")
              if r.name == "aten::linear"]
    assert len(linear) == 1 and linear[0].repeats == 3
    assert linear[0].time_s == pytest.approx(200e-6)  # the median of 130, 200 and 1000 us


def test_dtype_falls_back_to_the_argument(tmp_path: Path) -> None:
    trace = json.loads(KINETO_GPU.read_text())
    for e in trace["traceEvents"]:
        if e.get("cat") == "cpu_op" and "Input type" in e["args"]:
            e["args"]["Input type"] = ["double" if t == "c10::BFloat16" else t for t in e["args"]["Input type"]]
    path = _write_json(tmp_path / "double.json", trace)
    without = read_kineto(path, device="h100-sxm")
    assert without.records == [] and without.skipped["aten::linear (dtype double)"] == 1
    with_fallback = import_kineto(path, device="h100-sxm", dtype=DType.FP32)
    assert {r.dtype for r in with_fallback} == {DType.FP32} and len(with_fallback) == 2


def test_conv_costs_follow_stride_and_padding(tmp_path: Path) -> None:
    # argument layout and Concrete Inputs as torch 2.13 writes them for Conv2d(3, 8, 3, stride=2, padding=1)
    def op(name: str, ts: float, dims: list[Any], types: list[str], concrete: list[str]) -> dict[str, Any]:
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": 10.0,
                "args": {"Input Dims": dims, "Input type": types, "Concrete Inputs": concrete}}

    forward = op("aten::conv2d", 0.0, [[2, 3, 16, 16], [8, 3, 3, 3], [8], [], [], [], []],
                 ["float", "float", "float", "ScalarList", "ScalarList", "ScalarList", "Scalar"],
                 ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "1"])
    backward = op("aten::convolution_backward", 20.0,
                  [[2, 8, 8, 8], [2, 3, 16, 16], [8, 3, 3, 3], [], [], [], [], [], [], [], []],
                  ["float", "float", "float", "ScalarList", "ScalarList", "ScalarList", "ScalarList", "Scalar",
                   "ScalarList", "Scalar", "ScalarList"],
                  ["", "", "", "[8]", "[2, 2]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1", "[True, True, True]"])
    path = _write_json(tmp_path / "conv.json", {"traceEvents": [forward, backward]})
    fwd, bwd = import_kineto(path, device="cpu")
    macs = 2 * 8 * (8 * 8) * 3 * 9  # batch x out channels x output positions x (in channels x kernel)
    assert (fwd.kind, fwd.phase, fwd.flops, fwd.shape["out_positions"]) == (OpKind.CONV, "forward", 2.0 * macs, 64)
    # the backward (both gradients) is recorded as its forward's figures, as the bundle's convention has it
    assert (bwd.phase, bwd.flops, bwd.bytes_written, bwd.param_bytes) == (
        "backward", fwd.flops, fwd.bytes_written, 8 * 3 * 9 * 4)


def test_malformed_traces_name_the_file(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.json"
    truncated.write_text(KINETO_GPU.read_text()[:500])
    with pytest.raises(SpecError, match=r"truncated\.json: malformed JSON at line \d+"):
        import_kineto(truncated, device="cpu")
    no_events = _write_json(tmp_path / "no_events.json", {"schemaVersion": 1})
    with pytest.raises(SpecError, match=r"no_events\.json: no 'traceEvents'"):
        import_kineto(no_events, device="cpu")
    trace = json.loads(KINETO_GPU.read_text())
    for e in trace["traceEvents"]:
        e.get("args", {}).pop("Input Dims", None)
    with pytest.raises(SpecError, match=r"no_shapes\.json: .*record_shapes=True"):
        import_kineto(_write_json(tmp_path / "no_shapes.json", trace), device="cpu")


# --- nccl-tests -------------------------------------------------------------------------------------------------


def test_nccl_rows_become_records_with_the_log_figures() -> None:
    records = import_nccl_tests(NCCL_1NODE, device="a100-sxm4-80gb")
    rows = load_nccl_tests(NCCL_1NODE).rows
    assert len(records) == len(rows) == 14
    for record, row in zip(records, rows, strict=True):
        assert record.bytes == row.size_bytes
        assert record.time_s == row.out_of_place.time_s
        assert record.bus_bandwidth_Bps == row.out_of_place.busbw_Bps
    first, last = records[0], records[-1]
    assert (first.bytes, first.time_s, first.bus_bandwidth_Bps) == (1048576, pytest.approx(35.85e-6), 51.19e9)
    assert (last.bytes, last.bus_bandwidth_Bps) == (8589934592, 233.55e9)
    assert {(r.collective, r.backend, r.ranks, r.nodes, r.repeats) for r in records} == {
        ("all_reduce", "nccl", 8, 1, 20)}


def test_nccl_ranks_and_nodes_from_header_or_arguments() -> None:
    records = import_nccl_tests(NCCL_2NODES, device="a100-sxm4-80gb")
    assert {(r.ranks, r.nodes) for r in records} == {(16, 2)}
    records = import_nccl_tests(NCCL_2NODES, device="a100-sxm4-80gb", ranks=32, nodes=4)
    assert {(r.ranks, r.nodes) for r in records} == {(32, 4)}


@pytest.mark.parametrize(("stem", "collective"), [("alltoall_perf", "all_to_all"), ("sendrecv_perf", "p2p"),
                                                  ("all_gather_perf", "all_gather")])
def test_nccl_collective_names(tmp_path: Path, stem: str, collective: str) -> None:
    text = NCCL_1NODE.read_text().replace("all_reduce_perf", stem)
    path = tmp_path / f"{stem}.log"
    path.write_text(text)
    assert {r.collective for r in import_nccl_tests(path, device="a100-sxm4-80gb")} == {collective}


def test_nccl_errors_name_the_file(tmp_path: Path) -> None:
    reduce_log = tmp_path / "reduce_perf.log"
    reduce_log.write_text(NCCL_1NODE.read_text())
    with pytest.raises(SpecError, match=r"reduce_perf\.log: collective 'reduce' .* accepted: all_reduce"):
        import_nccl_tests(reduce_log, device="a100-sxm4-80gb")
    lines = NCCL_1NODE.read_text().splitlines()
    lines[16] = "     2097152        524288     float     sum      -1     fast   48.00   84.00      0"
    broken = tmp_path / "all_reduce_broken.log"
    broken.write_text("\n".join(lines))
    with pytest.raises(SpecError, match=r"all_reduce_broken\.log.*line 17"):
        import_nccl_tests(broken, device="a100-sxm4-80gb")


def test_nccl_log_with_a_generic_name_says_how_to_name_its_collective(tmp_path: Path) -> None:
    """No '# Collective test starting' line and a name like README's `nccl.log`: the error says both ways out."""
    generic = tmp_path / "nccl.log"
    generic.write_text(NCCL_1NODE.read_text())  # this fixture has no starting line; its name told the collective
    with pytest.raises(SpecError, match=r"nccl\.log: cannot tell which collective .* rename the file after the "
                                        r"nccl-tests binary that wrote it \(all_reduce_perf\.log, .*\), or add the "
                                        r"line '# Collective test starting: all_reduce_perf'"):
        import_nccl_tests(generic, device="a100-sxm4-80gb")
    generic.write_text("# Collective test starting: all_gather_perf\n" + NCCL_1NODE.read_text())
    assert {r.collective for r in import_nccl_tests(generic, device="a100-sxm4-80gb")} == {"all_gather"}


# --- iteration records ----------------------------------------------------------------------------------------------


def test_iterations_jsonl_and_csv_agree_and_round_trip(tmp_path: Path) -> None:
    from_jsonl, from_csv = import_iterations(ITERATIONS_JSONL), import_iterations(ITERATIONS_CSV)
    assert from_jsonl == from_csv and len(from_jsonl) == 3
    pipeline = from_csv[1]  # its plan came from plan_pipeline.json
    assert pipeline.plan == json.loads(json.dumps(pipeline.plan))
    assert [s["layers"] for s in pipeline.plan["stages"]] == [[0, 2], [2, 4]]
    assert pipeline.plan["stages"][1]["recompute"] is False  # stored canonical, defaults filled in
    assert (pipeline.measured_s, pipeline.repeats, pipeline.workload.seq_len) == (0.0211, 10, 32)
    assert from_csv[2].repeats == 1 and from_csv[2].source == ""
    write_bundle(tmp_path / "b", _manifest(), from_jsonl)
    assert list(read_bundle(tmp_path / "b").iterations()) == from_jsonl


def test_iteration_fixtures_are_valid_plans_for_their_models() -> None:
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.frontends.model_spec import load_model
    from tagplan.ir.plan import Plan, check_plan

    for record in import_iterations(ITERATIONS_JSONL):
        assert isinstance(record.model, str) and isinstance(record.cluster, str)
        model = load_model(record.model, seq_len=record.workload.seq_len)
        check_plan(Plan.model_validate(record.plan), model, load_cluster(record.cluster))


def _bad_jsonl(tmp_path: Path, line3: str) -> Path:
    lines = ITERATIONS_JSONL.read_text().splitlines()
    lines[2] = line3  # the fixture's third line is blank: the bad record goes on line 3 of the file
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_iterations_errors_name_file_line_and_field(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"bad\.jsonl:3: not JSON"):
        import_iterations(_bad_jsonl(tmp_path, '{"model": "gpt", "cluster": '))
    record = json.loads(ITERATIONS_JSONL.read_text().splitlines()[0])
    record["plan"]["stages"][0]["dp"] = 2  # 2 x 1 != 4 devices
    with pytest.raises(SpecError, match=r"bad\.jsonl:3: plan\.stages\.0: .*dp \* tp = 2 \* 1 = 2 but the stage has 4"):
        import_iterations(_bad_jsonl(tmp_path, json.dumps(record)))
    record = json.loads(ITERATIONS_JSONL.read_text().splitlines()[0]) | {"measured_s": -1}
    with pytest.raises(SpecError, match=r"bad\.jsonl:3: measured_s: .*greater than 0"):
        import_iterations(_bad_jsonl(tmp_path, json.dumps(record)))
    record = json.loads(ITERATIONS_JSONL.read_text().splitlines()[0])
    record["workload"]["dtype"] = "fp4"
    with pytest.raises(SpecError, match=r"bad\.jsonl:3: workload\.dtype: .*'bf16'"):
        import_iterations(_bad_jsonl(tmp_path, json.dumps(record)))
    with pytest.raises(SpecError, match=r"bad\.jsonl:3: unknown field\(s\) measured_ms"):
        import_iterations(_bad_jsonl(tmp_path, json.dumps(record | {"measured_ms": 3})))


def test_csv_errors_name_file_line_and_column(tmp_path: Path) -> None:
    header, *rows = ITERATIONS_CSV.read_text().splitlines()
    no_time = tmp_path / "no_time.csv"
    no_time.write_text("\n".join([header.replace(",measured_s", ""), *rows]))
    with pytest.raises(SpecError, match=r"no_time\.csv:1: missing column\(s\) measured_s"):
        import_iterations(no_time)
    bad_row = tmp_path / "bad_row.csv"
    bad_row.write_text("\n".join([header, rows[0], rows[1].replace(",0.0211,", ",fast,")]))
    with pytest.raises(SpecError, match=r"bad_row\.csv:3: measured_s 'fast' is not a number"):
        import_iterations(bad_row)
    missing_plan = tmp_path / "missing_plan.csv"
    missing_plan.write_text("\n".join([header, rows[1].replace("plan_pipeline.json", "nowhere.json")]))
    with pytest.raises(SpecError, match=r"missing_plan\.csv:2: plan 'nowhere\.json' is neither JSON text nor a file"):
        import_iterations(missing_plan)


# --- detection and bundles -------------------------------------------------------------------------------------------


def _manifest() -> Any:
    from tagplan.datasets.traces.bundle import Fingerprint, Manifest

    return Manifest(created="2026-01-01T00:00:00+00:00", source="test", fingerprint=Fingerprint(device_type="cpu"))


def test_detect_kind_by_content(tmp_path: Path) -> None:
    assert detect_kind(KINETO_CPU) == detect_kind(KINETO_GPU) == "kineto"
    assert detect_kind(NCCL_1NODE) == detect_kind(NCCL_2NODES) == "nccl-tests"
    assert detect_kind(ITERATIONS_JSONL) == detect_kind(ITERATIONS_CSV) == "iterations"
    renamed = tmp_path / "run.txt"  # nccl-tests output under any name
    renamed.write_text(NCCL_1NODE.read_text())
    assert detect_kind(renamed) == "nccl-tests"
    other = tmp_path / "notes.txt"
    other.write_text("just some notes\n")
    with pytest.raises(SpecError, match=r"notes\.txt: cannot tell what this file is"):
        detect_kind(other)


def test_import_file_needs_a_device_for_measurements() -> None:
    with pytest.raises(SpecError, match=r"all_reduce_perf_1node\.log: a nccl-tests file .* pass device="):
        import_file(NCCL_1NODE)
    kind, records = import_file(ITERATIONS_CSV)
    assert kind == "iterations" and all(isinstance(r, IterationRecord) for r in records)
    with pytest.raises(SpecError, match="unknown import kind 'chakra'"):
        import_file(KINETO_CPU, device="cpu", kind="chakra")


def test_import_to_bundle_appends_and_keeps_records(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    import_to_bundle([KINETO_CPU, NCCL_1NODE], out, device="cpu", source="tagplan traces import")
    first = read_bundle(out)
    assert first.manifest.fingerprint.device_type == "cpu" and first.manifest.source == "tagplan traces import"
    assert len(first.ops()) == len(import_kineto(KINETO_CPU, device="cpu")) and len(first.collectives()) == 14
    import_to_bundle([ITERATIONS_JSONL], out, device="cpu", source="another import")
    second = read_bundle(out)
    assert second.records[: len(first.records)] == first.records
    assert second.iterations() == import_iterations(ITERATIONS_JSONL)
    assert second.manifest == first.manifest


def test_import_to_bundle_writes_nothing_when_a_file_is_bad(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    import_to_bundle([NCCL_1NODE], out, device="cpu", source="test")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = _bad_jsonl(tmp_path, "{not json")
    with pytest.raises(SpecError, match=r"bad\.jsonl:3"):
        import_to_bundle([ITERATIONS_CSV, bad], out, device="cpu", source="test")
    with pytest.raises(SpecError, match=r"measured device 'cpu'.* 'H100-SXM'"):
        import_to_bundle([ITERATIONS_CSV], out, device="h100-sxm", source="test")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    fresh = tmp_path / "fresh"
    with pytest.raises(SpecError):
        import_to_bundle([ITERATIONS_CSV, bad], fresh, device="cpu", source="test")
    assert not fresh.exists()


class _CheckpointedBlock(torch.nn.Module):
    """A post-norm block with attention written out in `bmm`s (as Hugging Face's older models run it)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc, self.norm = torch.nn.Linear(hidden, 2 * hidden), torch.nn.LayerNorm(2 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.reshape(b * self.heads, s, h // self.heads) for t in self.qkv(x).chunk(3, dim=-1))
        y = torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)), -1), v).reshape(b, s, h)
        return self.norm(self.fc(x + self.out(y)))[..., :h]


def _checkpointed_trace(tmp_path: Path, *, reentrant: bool) -> Path:
    """A real CPU torch.profiler trace of one step of two checkpointed `_CheckpointedBlock`s."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_CheckpointedBlock(32, 4) for _ in range(2))
    x0 = torch.randn(2, 8, 32, requires_grad=True)

    def step() -> None:
        x = x0
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        x.sum().backward()

    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    path = tmp_path / f"checkpointed-{reentrant}.json"
    prof.export_chrome_trace(str(path))
    return path


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_steps_recomputation_is_forward_and_its_backwards_carry_their_forwards_figures(
        tmp_path: Path, reentrant: bool) -> None:
    """A real CPU trace of two checkpointed blocks: the recomputed forward runs inside the backward's autograd
    nodes. Its calls build graph (a sequence number), so they are forward records, the GEMMs among them too,
    never paired as some node's backward; and each backward record, linked to the forward call that made its
    node, carries that call's figures exactly (reentrant: the recomputed calls made the nodes the backward
    runs, and they are the ones linked)."""
    result = read_kineto(_checkpointed_trace(tmp_path, reentrant=reentrant), device="cpu")
    forward = [r for r in result.records if r.phase == "forward"]
    backward = [r for r in result.records if r.phase == "backward"]
    linears = [r for r in forward if r.name == "aten::linear"]
    assert len(linears) == 3 and all(r.repeats == 4 for r in linears)  # 2 blocks, run and recomputed
    assert sum(r.repeats for r in forward if r.name == "aten::bmm") == 8  # two per block, each twice
    figures = {(r.kind, r.flops, r.bytes_read, r.bytes_written, r.param_bytes) for r in forward}
    gemm_backwards = [r for r in backward if r.kind is OpKind.MATMUL]
    assert {r.name for r in gemm_backwards} <= {"AddmmBackward0 (2 GEMMs)", "MmBackward0 (2 GEMMs)",
                                                "BmmBackward0 (2 GEMMs)"}
    assert sum(r.repeats for r in gemm_backwards if not r.name.startswith("Bmm")) == 6  # every linear's backward
    assert sum(r.repeats for r in gemm_backwards if r.name.startswith("Bmm")) == 4  # and every bmm's
    for r in backward:  # the forward call's figures, exactly
        assert (r.kind, r.flops, r.bytes_read, r.bytes_written, r.param_bytes) in figures
    assert {r.kind for r in backward} >= {OpKind.MATMUL, OpKind.SOFTMAX, OpKind.LAYERNORM}


def test_without_sequence_numbers_a_gemm_outside_a_gemms_node_is_skipped_not_paired(tmp_path: Path) -> None:
    """A trace without sequence numbers cannot tell a recomputed GEMM from a gradient's: a raw GEMM inside another
    op's node (the recomputed attention `bmm`s under a norm's backward) is skipped and counted, never joined into a
    fake backward record; the GEMM nodes' own pairs still are."""
    path = _checkpointed_trace(tmp_path, reentrant=False)
    trace = json.loads(path.read_text())
    for event in trace["traceEvents"]:
        (event.get("args") or {}).pop("Sequence number", None)
    result = read_kineto(_write_json(tmp_path / "unsequenced.json", trace), device="cpu")
    gemm_backwards = [r for r in result.records if r.kind is OpKind.MATMUL and r.phase == "backward"]
    assert gemm_backwards and all(r.name.startswith(("AddmmBackward", "MmBackward", "BmmBackward"))
                                  for r in gemm_backwards)
    assert sum(r.repeats for r in result.records if r.name == "aten::bmm" and r.phase == "forward") == 4
    assert sum(n for name, n in result.skipped.items() if name.startswith("aten::bmm (an op inside a backward")) == 4


def _one_run(**changes: Any) -> dict[str, Any]:
    run = json.loads(ITERATIONS_JSONL.read_text().splitlines()[0])
    return {**run, **changes}


def test_an_iteration_record_that_cannot_be_a_run_of_its_plan_is_refused_at_import(tmp_path: Path) -> None:
    """A cluster SPEC that does not load, a plan that does not cover the model, or a time faster than the plan's
    GPUs can multiply the model's matrices at their peak: refused naming the file and line, not by every later fit."""
    cases = {"cluster": ({"cluster": "dgx-a100:nodes=1"}, r"runs\.jsonl:1: .*unknown cluster preset 'dgx-a100'"),
             "layers": ({"plan": {"stages": [{"layers": [0, 100], "devices": [0]}]}}, r"runs\.jsonl:1: .*\[0, 100\)"),
             "fast": ({"measured_s": 1e-9}, r"runs\.jsonl:1: measured_s 1e-09 s is shorter than the .* s this model's "
                                            r"matrix multiplications alone take on the plan's 4 device\(s\)")}
    for name, (changes, message) in cases.items():
        path = tmp_path / name / "runs.jsonl"
        path.parent.mkdir()
        path.write_text(json.dumps(_one_run(**changes)) + "\n")
        with pytest.raises(SpecError, match=message):
            import_iterations(path)
    assert import_iterations(ITERATIONS_JSONL)  # the fixture's real runs pass


def test_a_known_gpu_declared_faster_is_held_to_the_catalog_s_peak(tmp_path: Path) -> None:
    """A record cannot make an impossible time possible by declaring a catalog GPU's figures itself."""
    def gpu(name: str) -> dict[str, Any]:
        return {"name": "forged", "node_groups": [{"gpus_per_node": 4, "gpu": {
            "base": "V100-SXM2-16GB", "name": name, "peak_flops_fp16": 1e40, "peak_flops_bf16": 1e40}}]}

    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(_one_run(cluster=gpu("V100-SXM2-16GB"), measured_s=1e-9)) + "\n")
    with pytest.raises(SpecError, match=r"runs\.jsonl:1: measured_s 1e-09 s is shorter than"):
        import_iterations(path)
    path.write_text(json.dumps(_one_run(cluster=gpu("lab-gpu-x"), measured_s=1e-9)) + "\n")
    assert import_iterations(path)  # a GPU of its own name: its own figures, applied to clusters of that name only


def test_import_names_devices_as_the_catalog_does_and_skips_records_it_already_holds(tmp_path: Path) -> None:
    out, warnings = tmp_path / "bundle", []
    once = tmp_path / "once.jsonl"
    once.write_text(json.dumps(_one_run()) + "\n" + json.dumps(_one_run()) + "\n")  # the same run twice
    import_to_bundle([once], out, device="v100", source="t", warn=warnings.append)
    assert read_bundle(out).manifest.fingerprint.device_type == "V100-SXM2-16GB"  # how clusters name it
    assert "imported as the catalog's 'V100-SXM2-16GB'" in warnings[-1]  # one of several V100s
    assert len(read_bundle(out).iterations()) == 2  # two runs may print equal rows: a file is taken whole
    import_to_bundle([once], out, device="V100-SXM2-16GB", source="t", warn=warnings.append)
    assert len(read_bundle(out).iterations()) == 2 and "already holds 2 of its 2 record(s)" in warnings[-1]
    grown = json.loads(once.read_text().splitlines()[0]) | {"measured_s": 0.0125}
    once.write_text(once.read_text() + json.dumps(grown) + "\n")  # a log grown by a run since
    import_to_bundle([once], out, device="V100-SXM2-16GB", source="t", warn=warnings.append)
    assert [r.measured_s for r in read_bundle(out).iterations()] == [0.0123, 0.0123, 0.0125]  # only the new line
    from tagplan.datasets.traces.importing import catalog_name

    for exact in ("a10", "A10", "l4", "l40", "H100-SXM"):  # a catalog name is no alias of a longer one
        warnings.clear()
        catalog_name(exact, warnings.append)
        assert warnings == [], exact
    import_to_bundle([ITERATIONS_JSONL], tmp_path / "own", device="my-gpu", source="t", warn=warnings.append)
    assert "'my-gpu' is not in the catalog" in warnings[-1]
    table = tmp_path / "layers.csv"
    table.write_text("layer,device,micro_batch,seq_len,forward_s,backward_s\nblock,h100,1,32,0.001,0.002\n")
    import_to_bundle([table], tmp_path / "named", device="H100-SXM", source="t",
                     model="gpt?layers=2&hidden=64&heads=4&vocab=100")
    assert [r.device for r in read_bundle(tmp_path / "named").layers()] == ["H100-SXM"]  # as clusters name it
    table.write_text("layer,device,micro_batch,seq_len,forward_s,backward_s\nblock,A100-SXM-80GB,1,32,0.001,0.002\n")
    with pytest.raises(SpecError, match=r"measured device 'A100-SXM-80GB', but the files are imported as 'H100-SXM'"):
        import_to_bundle([table], tmp_path / "h100", device="h100", source="t",
                         model="gpt?layers=2&hidden=64&heads=4&vocab=100")


def test_a_file_of_another_variant_of_the_gpu_is_named_in_a_warning() -> None:
    """An A100 80 GB's nccl-tests log imported as `a100` (the 40 GB SXM) was filed under the wrong variant in
    silence: the tokens `a100` agreed."""
    from tagplan.datasets.traces.importing import device_disagrees

    assert device_disagrees("NVIDIA A100-SXM4-80GB", "A100-SXM-40GB")
    assert not device_disagrees("NVIDIA A100-SXM4-80GB", "A100-SXM-80GB")
    assert not device_disagrees("NVIDIA H100 80GB HBM3", "H100-SXM")
    assert device_disagrees("NVIDIA H100 80GB HBM3", "A100-SXM-80GB")
    assert device_disagrees("cpu-amd-epyc", "H100-SXM") and not device_disagrees("lab-gpu", "lab-gpu")
