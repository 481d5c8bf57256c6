"""tagplan.profiling: the CPU DeviceSpec, op records on a tiny grid, gloo collectives, a whole bundle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tagplan.datasets.traces.bundle import read_bundle
from tagplan.errors import SpecError
from tagplan.ir.model import OpKind
from tagplan.ir.workload import DType
from tagplan.profiling import OpCase, command_line, profile
from tagplan.profiling import ops as ops_module
from tagplan.profiling.collectives import bus_factor, measure_collectives, repeats_for
from tagplan.profiling.device import (
    cpu_device_name,
    cpu_device_spec,
    fp32_flops_per_cycle,
    half_flops_per_cycle,
    idle_cores,
    measure_memory_bandwidth_Bps,
    parse_cpuinfo,
    with_peaks_at_least,
)
from tagplan.profiling.grids import message_sizes, op_grid
from tagplan.profiling.ops import achieved_flops, measure_ops
from tagplan.profiling.timing import Timing, measure

FAST = Timing(warmup=1, budget_s=0.01, min_repeats=2, max_repeats=5)
TINY_GRID = [
    OpCase("matmul", {"m": 32, "k": 16, "n": 8}),
    OpCase("matmul", {"m": 64, "k": 64, "n": 64}),
    OpCase("bmm", {"b": 2, "m": 8, "k": 4, "n": 8}),
    OpCase("attention", {"b": 1, "h": 2, "s": 16, "d": 8, "causal": 1}),
    OpCase("layernorm", {"rows": 8, "hidden": 16}),
    OpCase("rmsnorm", {"rows": 8, "hidden": 16}),
    OpCase("softmax", {"rows": 8, "cols": 16}),
    OpCase("gelu", {"rows": 8, "cols": 16}),
    OpCase("silu", {"rows": 8, "cols": 16}),
    OpCase("embedding", {"vocab": 64, "hidden": 16, "tokens": 8}),
    OpCase("adam", {"params": 256}),
]


def test_parse_cpuinfo_and_flops_per_cycle() -> None:
    text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fma avx avx2\n\nprocessor\t: 1\nmodel name\t: AMD EPYC\n"
    procs = parse_cpuinfo(text)
    assert [p["processor"] for p in procs] == ["0", "1"]
    flags = frozenset(procs[0]["flags"].split())
    assert fp32_flops_per_cycle(flags) == 32
    assert fp32_flops_per_cycle(frozenset({"avx512f", "fma"})) == 64
    assert half_flops_per_cycle(flags, 32, amx="amx_bf16", avx512="avx512_bf16") == 32
    assert half_flops_per_cycle(frozenset({"amx_bf16"}), 64, amx="amx_bf16", avx512="avx512_bf16") == 1024


def test_cpu_device_name_is_a_stable_slug() -> None:
    assert cpu_device_name("AMD EPYC") == "cpu-amd-epyc"
    assert cpu_device_name("Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz") == "cpu-intel-xeon-gold-6338"
    assert cpu_device_name("AMD EPYC 7763 64-Core Processor") == "cpu-amd-epyc-7763"


def test_cpu_device_spec_positive_and_stable() -> None:
    spec = cpu_device_spec(mem_bandwidth_Bps=1e10)
    assert spec.name.startswith("cpu-") and spec.name == cpu_device_spec(mem_bandwidth_Bps=1e10).name
    assert spec.peak_flops_fp32 > 0 and spec.peak_flops_fp16 > 0 and (spec.peak_flops_bf16 or 0) > 0
    assert spec.mem_bytes > 0
    assert cpu_device_spec(cores=1, mem_bandwidth_Bps=1e10).peak_flops_fp32 <= spec.peak_flops_fp32
    assert measure_memory_bandwidth_Bps(nbytes=8 * 2**20, repeats=2) > 0


def test_peaks_rise_to_measured_rates() -> None:
    spec = cpu_device_spec(cores=1, mem_bandwidth_Bps=1e10)
    faster = with_peaks_at_least(spec, {DType.FP32: 2 * spec.peak_flops_fp32, DType.BF16: 1.0})
    assert faster.peak_flops_fp32 == 2 * spec.peak_flops_fp32 and faster.peak_flops_bf16 == spec.peak_flops_bf16
    assert with_peaks_at_least(spec, {DType.FP32: 1.0}) == spec
    assert idle_cores() >= 1


def test_tiny_op_grid_records_follow_op_conventions() -> None:
    records = list(measure_ops(TINY_GRID, device="cpu", device_type="cpu-test", timing=FAST))
    assert len(records) == 2 * (len(TINY_GRID) - 1) + 1
    assert all(r.time_s > 0 and r.device == "cpu-test" for r in records)
    matmuls = [r for r in records if r.name.startswith("matmul")]
    for r in matmuls:
        m, k, n = r.shape["m"], r.shape["k"], r.shape["n"]
        assert r.kind is OpKind.MATMUL and r.flops == 2 * m * k * n
        assert (r.bytes_read, r.bytes_written, r.param_bytes) == ((m * k + k * n) * 4, m * n * 4, k * n * 4)
    assert {r.phase for r in matmuls} == {"forward", "backward"}
    attention = next(r for r in records if r.kind is OpKind.ATTENTION)
    assert attention.flops == 4 * 1 * 2 * 16**2 * 8 and attention.shape["causal"] == 1
    assert [r.phase for r in records if r.name.startswith("adam")] == ["step"]
    best = achieved_flops(records)
    backward = next(r for r in matmuls if r.phase == "backward" and r.shape["m"] == 64)
    assert best[DType.FP32] >= 2 * backward.flops / backward.time_s
    kinds = {r.kind for r in records}
    assert kinds >= {OpKind.MATMUL, OpKind.ATTENTION, OpKind.LAYERNORM, OpKind.SOFTMAX, OpKind.ELEMENTWISE,
                     OpKind.EMBEDDING}


def test_unrunnable_case_is_skipped_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("not implemented for 'BFloat16'")

    monkeypatch.setitem(ops_module._POINTWISE, "gelu", (OpKind.ELEMENTWISE, 1.0, refuse))
    seen: list[str] = []
    records = list(measure_ops([OpCase("gelu", {"rows": 2, "cols": 2}, DType.BF16), TINY_GRID[0]], device="cpu",
                               device_type="cpu-test", timing=FAST, progress=seen.append))
    assert [r.name for r in records] == ["matmul 32x16x8"] * 2
    assert "skipped" in seen[0]


def test_measure_warms_up_then_repeats_within_bounds() -> None:
    calls: list[int] = []
    timed = measure(lambda: calls.append(1), device="cpu", timing=Timing(warmup=2, budget_s=0.0, min_repeats=3))
    assert timed.repeats == 3 and len(calls) == 5 and timed.median_s > 0
    capped = measure(lambda: None, device="cpu", timing=Timing(warmup=1, budget_s=10.0, max_repeats=7))
    assert capped.repeats == 7


def test_collectives_among_two_ranks() -> None:
    records = measure_collectives([4096, 65536], device_type="cpu-test", world=2, max_repeats=5)
    assert {r.collective for r in records} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    assert len(records) == 10
    for r in records:
        assert r.ranks == 2 and r.backend == "gloo" and r.bytes in (4096, 65536) and r.time_s > 0
        assert r.bus_bandwidth_Bps == pytest.approx(bus_factor(r.collective, 2) * r.bytes / r.time_s)


def test_bus_factors_and_repeats() -> None:
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("p2p", 2) == 1.0
    assert repeats_for(4096) == 30 and repeats_for(256 * 2**20) == 5


def test_grids() -> None:
    assert message_sizes(quick=True) == [4096, 65536, 1048576, 16777216]
    assert message_sizes(quick=False)[-1] == 256 * 2**20
    quick = op_grid("cpu", quick=True)
    assert {c.op for c in quick} == {"matmul", "bmm", "attention", "layernorm", "rmsnorm", "softmax", "gelu", "silu",
                                     "embedding", "adam"}
    assert len(op_grid("cpu", quick=False)) > len(quick)


def test_profile_writes_a_readable_bundle(tmp_path: Path) -> None:
    lines: list[str] = []
    out = profile(tmp_path / "bundle", quick=True, grid=TINY_GRID[:2], sizes_bytes=[4096],
                  collectives=("all_reduce", "p2p"), progress=lines.append)
    bundle = read_bundle(out)
    assert bundle.manifest.source == f"tagplan profile --device cpu --quick --out {tmp_path / 'bundle'}"
    assert bundle.manifest.device is not None and bundle.manifest.device.name.startswith("cpu-")
    assert bundle.manifest.fingerprint.device_type == bundle.manifest.device.name
    assert len(bundle.ops()) == 4 and all(r.device == bundle.manifest.device.name for r in bundle.ops())
    assert [(c.collective, c.ranks) for c in bundle.collectives()] == [("all_reduce", 2), ("p2p", 2)]
    assert lines and lines[0].startswith("device cpu-")


def test_command_line() -> None:
    assert command_line("out", device="cpu", quick=False, world=4) == "tagplan profile --device cpu --world 4 --out out"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_cuda_without_a_gpu_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="sees no CUDA GPU"):
        profile(tmp_path, device="cuda")


def test_bad_arguments_are_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="expected 'cpu' or 'cuda'"):
        profile(tmp_path, device="tpu")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="threads 0"):
        profile(tmp_path, threads=0)
