import json
import re
import subprocess
import sys

import pytest

from tagplan.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a user starts it: a separate process."""
    return subprocess.run([sys.executable, "-m", "tagplan.cli", *args], capture_output=True, text=True, timeout=120)


def test_inspect_model_json_has_the_stable_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "model", "gpt3-175b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"name", "params", "flops_per_sample", "layers", "unique_blocks"} <= set(out)
    assert out["params"] == pytest.approx(174.6e9, rel=0.01)
    assert out["unique_blocks"] == 3 and len(out["layers"]) == 98
    assert {"name", "hash", "params", "flops"} <= set(out["layers"][0])
    assert sum(layer["params"] for layer in out["layers"]) == out["params"]


def test_inspect_model_batch_and_seq(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "model", "llama2-7b", "--seq", "1024", "--batch", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seq_len"] == 1024
    assert out["flops_per_batch"] == pytest.approx(8 * out["flops_per_sample"])


def test_inspect_model_table_for_people(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "model", "gpt3-125m"]) == 0
    out = capsys.readouterr().out
    assert "gpt3-125m" in out and "x12" in out  # twelve folded blocks shown as one row


def test_inspect_cluster_mixed_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "cluster", "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"name", "devices", "nodes", "links"} <= set(out)
    assert len(out["devices"]) == 16
    assert len({d["type"] for d in out["devices"]}) == 2
    assert [d["index"] for d in out["devices"]] == list(range(16))
    assert {"index", "node", "type", "peak_flops", "mem_bytes"} <= set(out["devices"][0])
    assert out["devices"][0]["type"] != out["devices"][15]["type"]


def test_inspect_cluster_shows_a_mesh_nodes_pair_links_not_only_its_slowest() -> None:
    """A p3.16xlarge's GPUs are joined by NVLink pairs of one and two links, the rest over PCIe across sockets:
    the table shows both, where a single figure showed the slowest pair alone."""
    from rich.console import Console

    from tagplan.cli.tables import cluster_table
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.ir.summary import cluster_summary

    console = Console(width=300, record=True)
    console.print(cluster_table(cluster_summary(load_cluster("p3.16xlarge+dgx-a100-80gb"))))
    out = console.export_text()
    assert "nvlink pairs 20.00 GB/s to 40.00 GB/s, other pairs 10.00 GB/s" in out
    assert "│ 240.00 GB/s " in out  # the NVSwitch node keeps its fabric's figure


@pytest.mark.parametrize(("args", "needle"), [
    (["inspect", "model", "gpt3-17b"], "Did you mean 'gpt3-175b'"),
    (["inspect", "model", "gpt?layers=0"], "layers=0: must be positive"),
    (["inspect", "cluster", "p3.8xlarge:nodes=0"], "nodes"),
    (["inspect", "cluster", "dgx-a10"], "dgx-a100"),
    (["inspect", "model", "llama2-7b", "--seq", "-4"], "must be positive"),
])
def test_bad_input_is_one_clear_message_exit_2(args: list[str], needle: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_hf_config_offline() -> None:
    result = run_cli("inspect", "model", "hf:LlamaConfig?num_hidden_layers=2&hidden_size=256&intermediate_size=512"
                     "&num_attention_heads=4&num_key_value_heads=4&vocab_size=1000", "--seq", "64", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["unique_blocks"] >= 2


def test_inspect_cluster_from_topology_file_with_network_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    topo = Path(__file__).parents[1] / "frontends" / "fixtures" / "topo_dgx_a100.txt"
    args = ["inspect", "cluster", str(topo), "--nodes", "2", "--gpu", "A100-SXM-80GB", "--nic-gbps", "200",
            "--network-latency-us", "7", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["devices"]) == 16 and out["device_types"] == ["A100-SXM-80GB"]
    assert out["network"]["latency_s"] == pytest.approx(7e-6)
    nic = next(link for link in out["links"] if link["scope"] == "nic")
    assert nic["bandwidth_Bps"] == pytest.approx(200e9 / 8)  # 8 NICs shared by 8 GPUs


def test_simulate_megatron_gpt3_175b_on_128_dgx(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    timeline = tmp_path / "trace.json"
    args = ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb:nodes=128", "--plan", "megatron",
            "--batch", "1536", "--seq", "2048", "--json", "--timeline", str(timeline)]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert 0 < report["mfu"] < 1
    parts = report["breakdown"]
    assert set(parts) == {"compute", "tp_comm", "dp_comm", "pp_comm", "bubble", "optimizer"}
    assert sum(parts.values()) == pytest.approx(report["iteration_time_s"], rel=0.01)
    for key in ("iteration_time_s", "throughput_samples_s", "tokens_per_s", "tflops_per_device", "peak_memory_bytes",
                "fits", "memory_per_device_bytes"):
        assert key in report
    assert len(report["memory_per_device_bytes"]) == 1024
    assert report["throughput_samples_s"] == pytest.approx(1536 / report["iteration_time_s"])
    events = json.loads(timeline.read_text())["traceEvents"]
    assert any(e.get("cat") == "backward" for e in events)


def test_simulate_costs_the_attention_kernel_the_runtime_has(capsys: pytest.CaptureFixture[str]) -> None:
    """--attention unfused (a runtime before FlashAttention) on an A100 materialises the scores: slower, and more
    activation memory, than the A100's own fused kernel; fused on a V100 is faster than its default."""

    def simulate(cluster: str, attention: str) -> dict:
        assert main(["simulate", "--model", "gpt3-125m", "--cluster", cluster, "--plan", "dp", "--batch", "8",
                     "--seq", "2048", "--attention", attention, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    auto, unfused = simulate("dgx-a100-80gb", "auto"), simulate("dgx-a100-80gb", "unfused")
    assert unfused["iteration_time_s"] > 1.05 * auto["iteration_time_s"]
    assert unfused["peak_memory_bytes"] > auto["peak_memory_bytes"]
    assert simulate("dgx-a100-80gb", "fused")["iteration_time_s"] == pytest.approx(auto["iteration_time_s"])
    assert simulate("p3.8xlarge", "fused")["iteration_time_s"] < simulate("p3.8xlarge", "auto")["iteration_time_s"]


def test_simulate_costs_the_loss_kernel_the_runtime_has(capsys: pytest.CaptureFixture[str]) -> None:
    """--loss fused keeps the 16-bit logits, not an fp32 softmax: less memory, the same time."""

    def simulate(loss: str) -> dict:
        assert main(["simulate", "--model", "gpt3-125m", "--cluster", "dgx-a100-80gb", "--plan", "dp", "--batch", "64",
                     "--seq", "2048", "--loss", loss, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    eager, fused = simulate("eager"), simulate("fused")
    logits = 64 // 8 * 2048 * 50257  # per GPU: 8 samples of 2048 tokens over GPT-2's vocabulary
    assert eager["peak_memory_bytes"] - fused["peak_memory_bytes"] == pytest.approx(logits * (12 - 4), rel=0.01)
    assert fused["iteration_time_s"] == eager["iteration_time_s"]


def test_plan_says_when_the_exported_runtime_does_not_fuse_the_loss(capsys: pytest.CaptureFixture[str]) -> None:
    """--loss fused with --exportable: the exported program runs an eager loss, so the plan is costed with it, and
    the result says so rather than dropping what the user stated."""

    def plan(*extra: str) -> dict:
        main(["plan", "--model", "gpt3-125m", "--cluster", "dgx-a100-80gb", "--batch", "16", "--seq", "512",
              "--max-evaluations", "20", "--budget-s", "10", "--workers", "1", "--json", *extra])
        return json.loads(capsys.readouterr().out)

    exported = plan("--loss", "fused", "--exportable", "deepspeed")
    assert exported["workload"]["loss"] == "eager"
    assert any(note.startswith("--loss fused: deepspeed runs the eager cross-entropy (PyTorch's")
               for note in exported["notes"])
    torch_program = plan("--loss", "fused", "--exportable", "torch")  # the program runs its own fused loss
    assert torch_program["workload"]["loss"] == "fused" and not any("--loss" in n for n in torch_program["notes"])
    assert not any("--loss" in note for note in plan("--loss", "fused")["notes"])  # not exported: costed as stated
    megatron = plan("--loss", "fused", "--exportable", "megatron")  # the exporter writes Transformer Engine's
    assert megatron["workload"]["loss"] == "fused" and not any("--loss" in note for note in megatron["notes"])
    eager = plan("--exportable", "megatron")  # Megatron-Core runs its own loss: costed so, and said
    assert eager["workload"]["loss"] == "in-place"
    assert any(note.startswith("the default --loss eager: megatron runs the in-place cross-entropy (Megatron-Core's")
               for note in eager["notes"])


def test_simulate_plan_file_and_bad_plan(tmp_path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"micro_batches": 2, "schedule": "1f1b", "stages": [
        {"layers": [0, 7], "devices": [0, 1], "tp": 2}, {"layers": [7, 14], "devices": [2, 3], "dp": 2}]}))
    ok = run_cli("simulate", "--model", "gpt3-125m", "--cluster", "g4dn.12xlarge", "--plan", str(plan), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["devices_used"] == 4
    plan.write_text(json.dumps({"micro_batches": 2, "stages": [{"layers": [0, 14], "devices": [0, 9]}]}))
    bad = run_cli("simulate", "--model", "gpt3-125m", "--cluster", "g4dn.12xlarge", "--plan", str(plan))
    assert bad.returncode == 2 and "stages.0" in bad.stderr and "Traceback" not in bad.stderr


def test_plan_exits_1_and_writes_nothing_when_no_plan_fits(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    timeline = tmp_path / "timeline.json"
    args = ["plan", "--model", "gpt3-175b", "--cluster", "rtx4090x4", "--batch", "8", "--max-evaluations", "20",
            "--out", str(out), "--timeline", str(timeline)]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "no plan fits in memory: the best needs" in captured.err  # the why of exit 1, beside the table's note
    assert f"--out {out} and --timeline {timeline} not written (--allow-infeasible writes them)" in captured.err
    assert "note: no plan fits in memory" in " ".join(captured.out.split())
    assert not out.exists() and not timeline.exists()
    assert main([*args, "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["best"] and "no plan fits in memory" in captured.err  # why, beside the JSON
    assert main([*args, "--allow-infeasible"]) == 0
    assert out.exists() and timeline.exists()


def test_plan_exportable_restricts_the_answer(capsys) -> None:
    import json

    args = ["plan", "--model", "gpt?layers=4&hidden=256&heads=4&vocab=500", "--cluster", "p3.8xlarge+g4dn.12xlarge",
            "--batch", "16", "--seq", "128", "--max-evaluations", "60", "--json", "--exportable", "megatron"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    best = result["best"]["plan"]["stages"]
    assert len({(s["dp"], s["tp"]) for s in best}) == 1  # Megatron runs one (dp, tp) for every stage
    # the workload the plans were costed with, as Megatron runs bf16: gradients reduced in fp32
    assert result["workload"]["grad_reduce_dtype"] == "fp32" and result["workload"]["global_batch"] == 16
    assert all(result["reduce_overlap"].values())  # Megatron overlaps as the workload says
    assert main([a for a in args if a != "--json"]) == 0
    assert "gradients reduced in fp32 overlapped with the backward" in " ".join(capsys.readouterr().out.split())


def test_plan_exportable_refuses_a_model_the_format_cannot_build_before_it_searches(capsys, monkeypatch) -> None:
    import tagplan.search.planner

    def no_search(*args, **kwargs):
        raise AssertionError("searched plans of a model that no plan of can be exported")

    monkeypatch.setattr(tagplan.search.planner, "plan", no_search)
    args = ["plan", "--model", "t5?layers=2&hidden=64&heads=4&vocab=128", "--cluster", "p3.8xlarge", "--batch", "8",
            "--seq", "32"]
    assert main([*args, "--exportable", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "--exportable megatron" in err and "model family 't5' is not exported" in err
    assert main([*args, "--exportable", "torch"]) == 2
    assert "of family 't5'" in capsys.readouterr().err


def test_plan_says_which_export_formats_run_its_best_plan(capsys) -> None:
    import json

    args = ["plan", "--model", "gpt?layers=4&hidden=256&heads=4&vocab=500", "--cluster", "p3.8xlarge+g4dn.12xlarge",
            "--batch", "16", "--seq", "128", "--max-evaluations", "30", "--scorer", "simulator"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["exporters"]) == {"torch", "megatron", "deepspeed"}
    assert result["exporters"]["torch"] is None  # the torch program runs every plan of a GPT
    assert main(args) == 0
    assert "runs under: torch" in " ".join(capsys.readouterr().out.split())


def test_the_caption_names_the_refusals_when_no_format_runs_the_plan() -> None:
    from tagplan.cli.tables import exporters_line

    line = exporters_line({"torch": "no MoE\n  here", "megatron": "megatron: zero=3", "deepspeed": None})
    assert line == "runs under: deepspeed (not torch: no MoE here; megatron: zero=3)"
    assert exporters_line({"torch": "a", "megatron": "b"}) == "no export format runs this plan (torch: a; megatron: b)"


def test_a_refusal_many_rows_share_is_numbered_once_and_each_row_cites_it() -> None:
    from tagplan.cli.tables import formats_cell

    refusals: dict[str, int] = {}
    first = formats_cell({"torch": "no T5\n here", "megatron": "megatron: no T5"}, fits=True, refusals=refusals)
    second = formats_cell({"torch": "no T5 here", "megatron": "tp 4"}, fits=True, refusals=refusals)
    assert (first, second) == ("none: torch [1], megatron [2]", "none: torch [1], megatron [3]")
    assert refusals == {"torch: no T5 here": 1, "megatron: no T5": 2, "megatron: tp 4": 3}
    assert formats_cell({"torch": None, "megatron": "x"}, fits=True, refusals=refusals) == "torch"
    assert formats_cell({"torch": None}, fits=False, refusals=refusals) == "none: does not fit in memory"
    assert len(refusals) == 3


def test_the_caption_says_which_stages_reduce_after_the_backward() -> None:
    from tagplan.cli.tables import workload_line
    from tagplan.ir.workload import DType, LossKernel, Workload

    assert workload_line(Workload(), {0: True, 1: False}).endswith(
        "overlapped with the backward on stages [0], after it on stages [1]")
    assert workload_line(Workload(), {0: False}).endswith("after the backward")  # the runtime decided
    assert workload_line(Workload(grad_reduce_overlap=False)).endswith("after the backward")
    assert workload_line(Workload(tp_comm_overlap=True)).endswith(
        "overlapped with the backward, tensor-parallel collectives overlapped with compute")
    assert workload_line(Workload(fused_attention=False)).endswith("backward, attention scores materialised")
    assert workload_line(Workload(fused_attention=True)).endswith("backward, attention fused on every device")
    assert workload_line(Workload(loss=LossKernel.FUSED)).endswith(", the loss fused over its logits")
    assert workload_line(Workload(loss=LossKernel.IN_PLACE)).endswith(
        ", the loss's fp32 softmax turned into its gradient in place")
    assert workload_line(Workload(eager=True)).endswith(", eager PyTorch under autocast over fp32 weights")
    assert workload_line(Workload(eager=True, eager_16bit_weights=True)).endswith(", eager PyTorch over 16-bit weights")
    assert workload_line(Workload(eager=True, dtype=DType.FP32)).endswith(", eager PyTorch")
    assert "eager" not in workload_line(Workload())


def test_plan_exportable_exits_1_when_the_format_runs_no_plan_that_fits(tmp_path, capsys, monkeypatch) -> None:
    """A format that refuses every plan: no --out file, exit 1, and the output says the plan shown is not
    one that format runs (before, the planner returned a refused plan, wrote it and exited 0)."""
    import json

    import tagplan.export.capability as capability

    real = capability.exportable
    monkeypatch.setattr(capability, "exportable", lambda plan, fmt, *a, **k: (
        "deepspeed: refused here" if fmt == "deepspeed" else real(plan, fmt, *a, **k)))
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt?layers=4&hidden=256&heads=4&vocab=500", "--cluster", "p3.8xlarge", "--batch",
            "16", "--seq", "128", "--max-evaluations", "30", "--workers", "1", "--exportable", "deepspeed",
            "--out", str(out)]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "--exportable deepspeed: the search found no plan that format runs and that fits in memory" in " ".join(
        captured.err.split())
    assert "note: no plan the search simulated is admissible (deepspeed: refused here)" in " ".join(
        captured.out.split())
    assert not out.exists()
    assert main([*args, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["exporters"]["deepspeed"] == "deepspeed: refused here"
    assert main([*args, "--allow-infeasible"]) == 0 and out.exists()


def test_every_reported_plan_says_which_formats_run_it(capsys) -> None:
    """The frontier's plans and the baselines' carry their own verdicts, in the JSON and in the table."""
    import json

    from tagplan.export.capability import verdicts
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.frontends.model_spec import load_model, parse_model_spec
    from tagplan.ir.plan import Plan
    from tagplan.ir.workload import Workload

    model_spec = "t5?layers=2&hidden=64&heads=4&vocab=128"  # the torch program builds no T5: every row says so
    args = ["plan", "--model", model_spec, "--cluster", "p3.8xlarge", "--batch", "8", "--seq", "32",
            "--max-evaluations", "30", "--workers", "1"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    model = load_model(model_spec, seq_len=32)
    workload = Workload.model_validate(result["workload"])
    reported = [*result["pareto"], *(b for b in result["baselines"].values() if b is not None)]
    assert len(reported) >= 2
    for entry in reported:
        expected = verdicts(Plan.model_validate(entry["plan"]), model, workload, spec=parse_model_spec(model_spec),
                            cluster=load_cluster("p3.8xlarge"))  # as the CLI judges them
        assert entry["exporters"] == expected
        assert entry["exporters"]["torch"] is not None  # a T5 is refused by the torch program
    assert main(args) == 0
    table = " ".join(capsys.readouterr().out.split())
    refused = [e for e in [result["best"] | {"exporters": result["exporters"]}, *reported]
               if all(v is not None for v in e["exporters"].values())]
    assert refused  # Megatron builds no T5 either; DeepSpeed's config may still run some plans
    assert "runs under" in table and table.count("none:") == len(refused)  # each such row says why
    runnable = [(e["report"]["iteration_time_s"], e) for e in reported
                if e["report"]["fits"] and any(v is None for v in e["exporters"].values())]
    if all(v is not None for v in result["exporters"].values()) and runnable:
        time_s, fastest = min(runnable, key=lambda pair: pair[0])
        fmt = next(f for f, v in fastest["exporters"].items() if v is None)
        assert f"{time_s:.4g} s as costed here" in table and f"--exportable {fmt} searches" in table
    cited = set(re.findall(r"(torch|megatron|deepspeed) \[(\d+)\]", table))
    for fmt, number in cited:  # each cited refusal is written out once, below the table
        assert table.count(f"[{number}] {fmt}: ") == 1


def test_a_format_that_expresses_a_plan_but_cannot_fit_it_as_its_runtime_runs_it_does_not_run_it(capsys) -> None:
    """13B on RTX 4090s: the plan fits as the planner costs it, but not with the torch program's fp32 master
    weights and eager activations; the result says so rather than 'runs under: torch', and asking for torch
    plans agrees (exit 1: none fits)."""
    import json

    args = ["plan", "--model", "gpt3-13b", "--cluster", "rtx4090x4:nodes=2+g4dn.12xlarge", "--batch", "32", "--seq",
            "2048", "--max-evaluations", "60", "--budget-s", "20", "--workers", "1"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["best"]["report"]["fits"]
    assert "torch: the plan does not fit in memory as this runtime runs it" in result["exporters"]["torch"]
    assert main([*args, "--exportable", "torch"]) == 1
    assert "no plan that torch runs fits in memory" in " ".join(capsys.readouterr().err.split())


def test_exporting_a_plan_its_runtime_cannot_fit_warns(tmp_path, capsys) -> None:
    """The same 13B plan exported to the torch program anyway: written, with a warning naming the device, its need
    and its memory (the plan was searched for the default runtime)."""
    import json

    problem = ["--model", "gpt3-13b", "--cluster", "rtx4090x4:nodes=2+g4dn.12xlarge", "--batch", "32", "--seq", "2048"]
    out = tmp_path / "p.json"
    assert main(["plan", *problem, "--max-evaluations", "60", "--workers", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["export", *problem, "--plan", str(out), "--format", "torch", "--out", str(tmp_path / "t")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "warning: torch: the plan does not fit in memory as this runtime runs it" in said
    assert main(["export", *problem, "--plan", str(out), "--format", "torch", "--out", str(tmp_path / "t"),
                 "--json"]) == 0
    assert "does not fit" in json.loads(capsys.readouterr().out)["memory"]


def test_an_output_path_that_cannot_be_written_is_an_error_naming_it_not_a_traceback(tmp_path, capsys) -> None:
    """A missing folder or a folder given as a file is refused before the search runs (argparse, exit 2); a write
    the system refuses later (here: a file where a folder must be made) is one line naming the path, exit 2."""
    from tagplan.cli import main

    problem = ["--model", "gpt3-125m", "--cluster", "dgx-h100", "--max-evaluations", "5"]
    for out, said in ((str(tmp_path / "nodir" / "x.json"), "does not exist"), (str(tmp_path), "is a folder")):
        with pytest.raises(SystemExit) as exited:
            main(["plan", *problem, "--out", out])
        assert exited.value.code == 2 and said in capsys.readouterr().err
    plan = tmp_path / "p.json"
    assert main(["plan", *problem, "--out", str(plan)]) == 0
    blocker = tmp_path / "afile"
    blocker.write_text("")
    capsys.readouterr()
    code = main(["export", "--model", "gpt3-125m", "--cluster", "dgx-h100", "--plan", str(plan), "--format",
                 "torch", "--out", str(blocker / "program")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("tagplan: error: ") and str(blocker) in err and "Traceback" not in err


def test_simulate_exportable_costs_a_plan_as_plan_exportable_did(tmp_path, capsys) -> None:
    """`simulate --exportable torch` costs a plan as the torch program runs it (eager under autocast, fp32
    gradient reduction, the fused gated activation): the time and memory `plan --exportable torch` reported,
    which the default workload does not give; and it says whether the format runs the plan."""
    import json

    problem = ["--model", "llama?layers=4&hidden=256&heads=4&kv_heads=2&vocab=1000", "--cluster", "dgx-a100-80gb",
               "--batch", "16", "--seq", "256"]
    out = tmp_path / "p.json"
    assert main(["plan", *problem, "--exportable", "torch", "--max-evaluations", "30", "--out", str(out),
                 "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["best"]["report"]
    assert main(["simulate", *problem, "--exportable", "torch", "--plan", str(out), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    costed = answer["report"]
    assert answer["exportable"] == {"torch": None}
    assert costed["iteration_time_s"] == pytest.approx(planned["iteration_time_s"], rel=1e-9)
    assert costed["peak_memory_bytes"] == pytest.approx(planned["peak_memory_bytes"], rel=1e-9)
    assert main(["simulate", *problem, "--plan", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time_s"] < costed["iteration_time_s"]  # fused: faster
    assert main(["simulate", *problem, "--exportable", "torch", "--plan", str(out)]) == 0
    said = capsys.readouterr().out
    assert "torch runs this plan" in said and "eager PyTorch under autocast" in said


def test_simulate_exportable_says_when_the_runtime_cannot_fit_the_plan(tmp_path, capsys) -> None:
    """13B whole on every GPU of one node without ZeRO: expressible by the torch program, but out of memory as it
    runs it; simulate says so, as plan's verdict would."""
    import json

    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({"stages": [{"layers": [0, 42], "devices": list(range(8)), "dp": 8}]}))
    problem = ["--model", "gpt3-13b", "--cluster", "dgx-a100-80gb", "--batch", "8", "--seq", "2048", "--plan",
               str(plan), "--exportable", "torch"]
    assert main(["simulate", *problem]) == 0
    assert "torch does not run this plan: torch: the plan does not fit in memory" in capsys.readouterr().out
    assert main(["simulate", *problem, "--json"]) == 0
    assert "does not fit in memory" in json.loads(capsys.readouterr().out)["exportable"]["torch"]


def test_an_oserror_without_a_path_is_not_reported_as_bad_input(monkeypatch, capsys) -> None:
    """Only an error about a path is one line naming it (exit 2); another OSError (out of memory, a socket) is a
    fault and keeps its traceback."""
    import argparse
    import importlib

    cli_main = importlib.import_module("tagplan.cli.main")  # the module (the package's `main` is its function)

    def run(error: OSError) -> int:
        def command(_: object) -> int:
            raise error

        class Parser:
            def parse_args(self, argv: object) -> argparse.Namespace:
                return argparse.Namespace(func=command, verbose=False)

        monkeypatch.setattr(cli_main, "build_parser", Parser)
        return cli_main.main([])

    assert run(FileNotFoundError(2, "No such file or directory", "/nowhere/x.json")) == 2
    assert capsys.readouterr().err == "tagplan: error: /nowhere/x.json: No such file or directory\n"
    with pytest.raises(OSError, match="Cannot allocate memory"):
        run(OSError(12, "Cannot allocate memory"))


def test_times_below_a_tenth_of_a_second_print_in_milli_or_microseconds() -> None:
    from tagplan.cli.tables import duration

    assert [duration(t) for t in (1.2345, 0.1, 0.0123456, 0.000365, 4.2e-5, 0.0)] == [
        "1.234 s", "0.100 s", "12.346 ms", "0.365 ms", "42.00 us", "0.000 s"]


def test_wrong_options_name_what_is_accepted(tmp_path, capsys, monkeypatch) -> None:
    """From a reader's walkthrough: each of these was accepted and ignored, or refused without saying what is."""
    monkeypatch.setenv("TAGPLAN_HOME", str(tmp_path / "home"))
    problem = ["--model", "gpt?layers=2&hidden=64&heads=4&vocab=100", "--cluster", "p3.8xlarge", "--seq", "32"]
    with pytest.raises(SystemExit) as exited:
        main(["plan", *problem, "--exhaustive-limit", "-1"])
    assert exited.value.code == 2 and "-1 must be 0 or more" in capsys.readouterr().err
    cases = {
        ("simulate", *problem, "--plan", "foo"):
            "--plan 'foo': no such file; accepted: a Plan JSON file, dp or megatron",
        ("simulate", *problem, "--plan", "dp", "--calibration", "v9999"):
            "calibration 'v9999': no such file, nor a registry version with a calibration pinned (none registered)",
        ("simulate", *problem, "--plan", "dp", "--input-shape", "2x16"):
            "input shape '2x16': only a user module (module.py:Name) is traced on example inputs",
        ("inspect", "model", "mdir"): "a folder holding config.json written with a trailing '/': mdir/)",
    }
    for args, said in cases.items():
        assert main(list(args)) == 2
        assert said in " ".join(capsys.readouterr().err.split())


def test_simulate_says_where_it_costs_another_precision(capsys) -> None:
    """`plan` noted a V100's missing bf16 tensor cores; `simulate` of the same plan said nothing."""
    args = ["simulate", "--model", "gpt?layers=2&hidden=64&heads=4&vocab=100", "--cluster", "p3.8xlarge", "--seq",
            "32", "--plan", "dp", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "note: V100-SXM2-16GB: no bf16 tensor cores; costed at the fp16 rate" in captured.err
    assert json.loads(captured.out)["iteration_time_s"] > 0  # stdout stays the report
    assert main([*args, "--dtype", "fp16"]) == 0 and "tensor cores" not in capsys.readouterr().err
