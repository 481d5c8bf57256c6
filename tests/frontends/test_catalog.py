"""Device catalog: datasheet units, name lookup, custom devices."""

from __future__ import annotations

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.catalog import (
    CATALOG,
    PCIE_GEN4_BPS,
    custom_device,
    device_links,
    device_value,
    known_devices,
    lookup_device,
)
from tagplan.ir import DType

EXPECTED = ("V100-SXM2-16GB", "V100-SXM2-32GB", "V100-PCIe-16GB", "V100-PCIe-32GB", "A100-SXM-40GB",
            "A100-SXM-80GB", "A100-PCIe-80GB", "H100-SXM", "H100-PCIe", "H200-SXM", "L40S", "L4", "T4", "A10",
            "RTX4090", "MI250X", "MI300X", "MI325X", "B200", "GB200", "B300", "GB300", "GH200", "H20", "L40", "A40",
            "RTX-A6000", "RTX3090", "RTX2080Ti", "TitanRTX")


def test_catalog_holds_every_datasheet_device() -> None:
    assert known_devices() == EXPECTED


def test_units_are_flops_and_bytes_per_second() -> None:
    a100 = CATALOG["A100-SXM-80GB"]
    assert a100.peak_flops_bf16 == 312e12
    assert a100.peak_flops_fp32 == 19.5e12
    assert a100.mem_bandwidth_Bps == 2039e9
    assert CATALOG["H100-SXM"].mem_bandwidth_Bps == pytest.approx(3.35e12)


@pytest.mark.parametrize(("name", "reported_GiB"), [
    ("A100-SXM-40GB", 39.59), ("A100-SXM-80GB", 79.15), ("H100-SXM", 79.15), ("V100-SXM2-16GB", 15.78),
    ("V100-SXM2-32GB", 31.75), ("RTX4090", 23.65), ("L40", 44.39), ("T4", 14.75)])
def test_memory_is_what_cuda_reports_as_total_capacity(name: str, reported_GiB: float) -> None:
    """Within 1% of the total capacity CUDA's out-of-memory messages print for the part: binary sizes
    less the driver's share, and a sixteenth less on GDDR cards that run with ECC (L40, T4)."""
    assert CATALOG[name].mem_bytes / 2**30 == pytest.approx(reported_GiB, rel=0.01)


@pytest.mark.parametrize("name", ["V100-SXM2-16GB", "V100-PCIe-32GB", "T4"])
def test_devices_without_bf16_run_bf16_as_fp16(name: str) -> None:
    spec = CATALOG[name]
    assert spec.peak_flops_bf16 is None
    assert spec.peak_flops(DType.BF16) == spec.peak_flops_fp16


def test_rtx4090_fp16_is_the_fp16_accumulate_figure() -> None:
    assert CATALOG["RTX4090"].peak_flops_fp16 == 165e12
    assert CATALOG["RTX4090"].peak_flops_fp32 == 82.6e12


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a100-sxm-80gb", "A100-SXM-80GB"),
        ("A100_SXM_80GB", "A100-SXM-80GB"),
        ("a100", "A100-SXM-40GB"),
        ("h100", "H100-SXM"),
        ("v100", "V100-SXM2-16GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-SXM-40GB"),
        ("Tesla V100-SXM2-16GB", "V100-SXM2-16GB"),
        ("Tesla V100-SXM2-32GB", "V100-SXM2-32GB"),
        ("Tesla T4", "T4"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
        ("NVIDIA A100 80GB PCIe", "A100-PCIe-80GB"),
        ("AMD Instinct MI300X", "MI300X"),
        ("  l40s ", "L40S"),
    ],
)
def test_lookup_is_tolerant_of_case_separators_and_nvidia_smi_names(name: str, expected: str) -> None:
    assert lookup_device(name).name == expected


def test_unknown_gpu_lists_known_names_and_suggests() -> None:
    with pytest.raises(SpecError) as err:
        lookup_device("H300-SXM")
    message = str(err.value)
    assert "'H300-SXM'" in message
    assert "Did you mean" in message and "H100-SXM" in message
    assert all(name in message for name in EXPECTED)


def test_custom_device_from_mapping_and_base() -> None:
    spec = custom_device({"base": "A100-SXM-80GB", "name": "A100-capped", "peak_flops_bf16": 250e12}, "gpu")
    assert spec.name == "A100-capped"
    assert spec.peak_flops_bf16 == 250e12
    assert spec.mem_bytes == CATALOG["A100-SXM-80GB"].mem_bytes  # inherited from the base
    plain = custom_device({"name": "npu", "peak_flops_bf16": None, "peak_flops_fp16": 1e14,
                           "peak_flops_fp32": 1e13, "mem_bytes": 32 * 10**9, "mem_bandwidth_Bps": 1e12}, "gpu")
    assert plain.peak_flops_bf16 is None
    assert device_links(plain).host_link_Bps == PCIE_GEN4_BPS
    assert device_links(plain).nvlinks == 0


def test_custom_device_errors_name_the_field_path() -> None:
    with pytest.raises(SpecError, match=r"node_groups\[2\]\.gpu\.peak_flops_fp16: .*-1"):
        custom_device({"base": "T4", "name": "t4-x", "peak_flops_fp16": -1}, "node_groups[2].gpu")
    with pytest.raises(SpecError, match=r"node_groups\[0\]\.gpu\.base: unknown GPU type 'H999'"):
        custom_device({"base": "H999", "name": "h"}, "node_groups[0].gpu")
    with pytest.raises(SpecError, match=r"gpu: a GPU that changes peak_flops_bf16 of its base H100-SXM needs a name "
                                        r"of its own \(e\.g\. name: H100-SXM-custom\)"):
        custom_device({"base": "H100-SXM", "peak_flops_bf16": 1e14}, "gpu")  # two 'H100-SXM's of other figures
    with pytest.raises(SpecError, match=r"gpu\.peak_flop_bf16: Extra inputs are not permitted"):  # keys first
        custom_device({"base": "H100-SXM", "peak_flop_bf16": 1e14}, "gpu")
    assert custom_device({"base": "H100-SXM", "name": "h100-capped", "peak_flops_bf16": 1e14}, "gpu").name == (
        "h100-capped")
    assert custom_device({"base": "H100-SXM"}, "gpu") == CATALOG["H100-SXM"]  # the base as it is keeps its name
    with pytest.raises(SpecError, match=r"gpu\.mem_bytes: .*got nothing"):
        custom_device({"name": "x", "peak_flops_bf16": None, "peak_flops_fp16": 1.0, "peak_flops_fp32": 1.0,
                       "mem_bandwidth_Bps": 1.0}, "gpu")
    with pytest.raises(SpecError, match=r"node_groups\[0\]\.gpu: unknown GPU type 'Z9'"):
        device_value("Z9", "node_groups[0].gpu")
    with pytest.raises(SpecError, match=r"gpu: 7 is not accepted"):
        device_value(7, "gpu")


def test_fp8_runs_gemms_at_the_fp8_peak_and_keeps_an_fp8_weight_copy() -> None:
    """A hand calculation: one 8192 x 8192 x 8192 GEMM on an H100 at the ideal efficiency."""
    from tagplan.cost.calibration import Calibration
    from tagplan.cost.compute import op_time
    from tagplan.ir.model import Op, OpKind
    from tagplan.ir.plan import ShardStrategy
    from tagplan.ir.workload import DType, Workload

    h100 = CATALOG["H100-SXM"]
    assert h100.peak_flops(DType.FP8) == 1979e12 and h100.peak_flops(DType.BF16) == 989e12
    assert CATALOG["A100-SXM-80GB"].peak_flops(DType.FP8) == 312e12  # no fp8 tensor cores: bf16
    flops = 2 * 8192**3
    gemm = Op(name="mm", kind=OpKind.MATMUL, flops=flops, bytes_read=0, bytes_written=0)
    ideal = Calibration(name="ideal", launch_overhead_s=0.0)
    times = {d: op_time(gemm, samples=1, tp=1, strategy=ShardStrategy.REPLICATE, spec=h100, dtype=d,
                        calibration=ideal).forward_s for d in (DType.FP8, DType.BF16)}
    curve = ideal.curve("H100-SXM", OpKind.MATMUL)
    assert curve is not None
    # at the clock the 700 W cap sustains under a training load (fitted: bench/fit_sustained_clock.py)
    assert 0.5 < h100.sustained_peak_fraction < 1.0
    assert times[DType.FP8] == pytest.approx(flops / (1979e12 * h100.sustained_peak_fraction * curve.at(flops)))
    assert times[DType.BF16] / times[DType.FP8] == pytest.approx(1979 / 989)
    assert Workload(dtype=DType.FP8).weight_bytes_per_param == 3  # bf16 weight + Transformer Engine's fp8 copy
    assert DType.FP8.nbytes == 2  # activations stay bf16


def test_devices_before_sm80_have_no_fused_attention_and_the_t4_runs_at_its_capped_clock() -> None:
    assert not CATALOG["V100-SXM2-16GB"].fused_attention and not CATALOG["T4"].fused_attention
    assert CATALOG["A100-SXM-80GB"].fused_attention and CATALOG["MI300X"].fused_attention
    # 24 TFLOP/s measured on a continuous 4096^3 GEMM, over 0.728 of 65 from the shipped curve
    assert CATALOG["T4"].sustained_peak_fraction == pytest.approx(24 / 65 / 0.728, abs=0.01)
    assert CATALOG["A100-SXM-80GB"].sustained_peak_fraction == 1.0


def test_the_h100_sustained_clock_is_the_one_its_committed_fit_found() -> None:
    import json
    from pathlib import Path

    fit = json.loads((Path(__file__).parents[2] / "bench" / "results" / "sustained_clock.json").read_text())
    assert fit["device"] == "H100-SXM"
    assert CATALOG["H100-SXM"].sustained_peak_fraction == fit["sustained_peak_fraction"]
    assert CATALOG["H200-SXM"].sustained_peak_fraction == fit["sustained_peak_fraction"]  # same die, same cap
