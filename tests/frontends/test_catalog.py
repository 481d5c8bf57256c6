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
            "RTX4090", "MI250X", "MI300X")


def test_catalog_holds_every_datasheet_device() -> None:
    assert known_devices() == EXPECTED


def test_units_are_flops_decimal_bytes_and_bytes_per_second() -> None:
    a100 = CATALOG["A100-SXM-80GB"]
    assert a100.peak_flops_bf16 == 312e12
    assert a100.peak_flops_fp32 == 19.5e12
    assert a100.mem_bytes == 80 * 10**9
    assert a100.mem_bandwidth_Bps == 2039e9
    assert CATALOG["H100-SXM"].mem_bandwidth_Bps == pytest.approx(3.35e12)
    assert CATALOG["MI300X"].mem_bytes == 192 * 10**9


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
    assert spec.mem_bytes == 80 * 10**9
    plain = custom_device({"name": "npu", "peak_flops_bf16": None, "peak_flops_fp16": 1e14,
                           "peak_flops_fp32": 1e13, "mem_bytes": 32 * 10**9, "mem_bandwidth_Bps": 1e12}, "gpu")
    assert plain.peak_flops_bf16 is None
    assert device_links(plain).host_link_Bps == PCIE_GEN4_BPS
    assert device_links(plain).nvlinks == 0


def test_custom_device_errors_name_the_field_path() -> None:
    with pytest.raises(SpecError, match=r"node_groups\[2\]\.gpu\.peak_flops_fp16: .*-1"):
        custom_device({"base": "T4", "peak_flops_fp16": -1}, "node_groups[2].gpu")
    with pytest.raises(SpecError, match=r"gpu\.mem_bytes: .*got nothing"):
        custom_device({"name": "x", "peak_flops_bf16": None, "peak_flops_fp16": 1.0, "peak_flops_fp32": 1.0,
                       "mem_bandwidth_Bps": 1.0}, "gpu")
    with pytest.raises(SpecError, match=r"node_groups\[0\]\.gpu: unknown GPU type 'Z9'"):
        device_value("Z9", "node_groups[0].gpu")
    with pytest.raises(SpecError, match=r"gpu: 7 is not accepted"):
        device_value(7, "gpu")
