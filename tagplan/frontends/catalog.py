"""The shipped device catalog: datasheet figures from reference/hardware.md as `DeviceSpec` values.

Units follow the IR: FLOP/s (datasheet TFLOP/s x 1e12, dense, no sparsity) and bytes/s (GB/s x
1e9). Memory (`mem_bytes`) is what the driver lets a process allocate, the figure
`torch.cuda.get_device_properties(i).total_memory` reports (and `profiling.device` records for a
measured device), not the datasheet's number read as decimal: see `usable_memory_bytes`.
`peak_flops_fp8` is the dense fp8 tensor rate where the device has one (Hopper, Ada,
Blackwell, MI300); `peak_flops_fp4` the dense nvfp4 rate (Blackwell only: B200 9, GB200 10, B300 13.5,
GB300 15 PFLOP/s, the HGX/NVL72 datasheets' dense figures divided by their GPU counts). V100 and T4 have
no BF16 (`peak_flops_bf16=None`; the IR then runs bf16 as fp16).
The RTX 4090's fp16 figure is 165 TFLOP/s with fp16 accumulate; with fp32 accumulate, which
mixed-precision training uses, it is 82.6, so plans for it may be optimistic by up to 2x.
MI250X figures are per GCD (one MI250X package is two devices to the software).

Besides the datasheet, each device carries the figures the front-ends need to turn a topology
into bandwidths (`DeviceLinks`): the host PCIe link and NVLink count and per-link rate, as NCCL
models them (PCIe x16 Gen3/4/5 = 12/24/48 GB/s; NVLink 20 GB/s sm70/sm80, 20.6 GB/s sm90).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from pydantic import ValidationError

from tagplan.errors import SpecError, unknown
from tagplan.ir.cluster import DeviceSpec, LinkKind

_TFLOPS = 1e12
_GB = 1e9  # decimal, as datasheets state bandwidths
_GiB = 2**30

DRIVER_RESERVED_FRACTION = 0.01
"""Share of a GPU's memory the driver keeps for itself. DRAM comes in binary sizes: an "80 GB" part
has 80 GiB, and CUDA reports about 1% less as total capacity, as out-of-memory messages print it:
A100 40GB 39.59 GiB, A100/H100 80GB 79.15-79.33 GiB, V100 16GB 15.78 GiB, 24 GB GeForce cards
23.57-23.69 GiB."""
GDDR_ECC_FRACTION = 15 / 16
"""GDDR memory with ECC on (the default on data-centre GDDR cards: T4, A10, L4, L40/L40S, A40) keeps
the check bits in the same DRAM: one sixteenth of it (an L40's 48 GiB reports 44.39 GiB)."""
_ECC_GDDR = frozenset({"T4", "A10", "L4", "L40", "L40S", "A40"})


def usable_memory_bytes(name: str, mem_GB: float) -> int:
    """Bytes a process can allocate on device `name` whose datasheet states `mem_GB` GB of memory."""
    fraction = (1 - DRIVER_RESERVED_FRACTION) * (GDDR_ECC_FRACTION if name in _ECC_GDDR else 1.0)
    return int(mem_GB * _GiB * fraction)

PCIE_GEN3_BPS = 12e9
PCIE_GEN4_BPS = 24e9
PCIE_GEN5_BPS = 48e9
PCIE_GEN6_BPS = 96e9  # Blackwell Ultra's host link (ConnectX-8 on PCIe Gen6)
NVLINK_SM80_BPS = 20e9  # per link, unidirectional; also V100 (sm70)
NVLINK_SM90_BPS = 20.6e9
NVLINK_SM100_BPS = 50e9  # NVLink 5: 1.8 TB/s bidirectional over 18 links (datasheet; no NCCL-measured figure yet)
# Peer traffic through a CPU host bridge (nvidia-smi PHB/NODE) is split into 64 B TLPs and costs
# 20% more PCIe bandwidth (NCCL's INTEL_P2P_OVERHEAD), so it gets 5/6 of the host link.
HOST_BRIDGE_FACTOR = 5 / 6
# Across CPU sockets (nvidia-smi SYS): NCCL's Skylake UPI figure (SKL_QPI_BW in NCCL's topo.h),
# below every PCIe x16 rate, so SYS pairs always rank below PHB/PIX pairs.
SMP_BPS = 10e9

# One-way latency per link class: rough orders of magnitude that only have to rank the classes
# (NVLink < PCIe switch < host bridge < socket crossing); calibration replaces them.
NVLINK_LATENCY_S = 2e-6
PCIE_LATENCY_S = 3e-6
PCIE_HOST_LATENCY_S = 4e-6
SMP_LATENCY_S = 6e-6


class DeviceLinks(NamedTuple):
    """How a device attaches to its node: host link, NVLink/xGMI figures (unidirectional bytes/s)."""

    host_link_Bps: float
    nvlinks: int = 0  # NVLink links per GPU (0: none)
    nvlink_rate_Bps: float = NVLINK_SM80_BPS
    xgmi_pair_Bps: float = 0.0  # per GPU pair on a full xGMI mesh (0: none)
    default_fabric: LinkKind = LinkKind.PCIE


SUSTAINED_PEAK_FRACTION: dict[str, float] = {
    # A continuous 4096^3 fp16 cuBLAS GEMM runs at ~24 TFLOP/s on a T4 because its 70 W cap lowers
    # the clock (NVIDIA developer forum, "About GPU peak performance", 2023). The shipped GEMM curve
    # gives 0.728 of peak at that size, so the capped clock leaves (24 / 65) / 0.728 = 0.51 of it.
    "T4": 0.51,
    # The H100 SXM's 700 W cap binds under bf16/fp8 training (the clock falls with the switching the
    # data causes; Horace He, "Strangely, matrix multiplications on GPUs run faster when given
    # predictable data", 2024). No datasheet states the sustained clock, so this is an end-to-end factor
    # on the tensor-core peak, fitted by bench/fit_sustained_clock.py to the nine Megatron-Core H100
    # bf16 runs (leave-one-out |error| median 4.9%, worst 7.4%; bench/results/sustained_clock.json);
    # it also absorbs what else the op model misses on H100 kernels. The NeMo fp8 runs are held out.
    # The H200 SXM is the same GH100 die under the same 700 W cap.
    "H100-SXM": 0.816,
    "H200-SXM": 0.816,
    # Blackwell under its 1200 W (GB200) cap: fitted by the same script to the NeMo / Megatron-Bridge GB200
    # per-tensor fp8 runs whose presets run without full recompute (four presets: Llama 3 8B and 70B
    # pre-training, 70B SFT, Llama 3.1 405B pre-training); leave-one-preset-out |error| median 2.6%, worst
    # 8.5%. Those rows are in-sample for this figure; the mxfp8 and nvfp4 rows are not. The B200 is the same
    # die under a lower cap (1000 W): no table row measures it, and it takes the GB200's figure, an upper
    # bound on its clock.
    "GB200": 0.722,
    "B200": 0.722,
    # Blackwell Ultra under its 1400 W (GB300) cap, fitted the same way to the GB300 rows of the same four
    # presets (leave-one-preset-out median 2.2%, worst 14.4%): it sustains 1.24x the GB200's fraction of the
    # same bf16/fp8 datasheet rates (its larger power budget; the fit also absorbs its doubled exponent
    # throughput in attention). The B300 (1100 W) takes it as an upper bound, as the B200 does the GB200's.
    "GB300": 0.894,
    "B300": 0.894,
}
"""Devices whose power cap holds the clock below the boost clock the datasheet peak assumes, under a
continuous load such as a training loop (the cap acts on the board's average power, so every
kernel of the loop runs at the lowered clock); on the others no cap binds (fraction 1)."""


def _spec(name: str, bf16: float | None, fp16: float, fp32: float, mem_GB: float, bw_GBps: float,
          fp8: float | None = None, fp4: float | None = None) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        peak_flops_bf16=None if bf16 is None else bf16 * _TFLOPS,
        peak_flops_fp16=fp16 * _TFLOPS,
        peak_flops_fp32=fp32 * _TFLOPS,
        mem_bytes=usable_memory_bytes(name, mem_GB),
        mem_bandwidth_Bps=bw_GBps * _GB,
        peak_flops_fp8=None if fp8 is None else fp8 * _TFLOPS,
        peak_flops_fp4=None if fp4 is None else fp4 * _TFLOPS,
        sustained_peak_fraction=SUSTAINED_PEAK_FRACTION.get(name, 1.0),
        fused_attention=bf16 is not None,  # bf16 and FlashAttention-2 both need sm80+ (AMD's CDNA has both)
    )


_NVL, _NVS, _XGMI = LinkKind.NVLINK, LinkKind.NVSWITCH, LinkKind.XGMI
_MI300_LINKS = DeviceLinks(PCIE_GEN5_BPS, xgmi_pair_Bps=64e9, default_fabric=_XGMI)

# name: (bf16, fp16, fp32 TFLOP/s, memory GB, memory GB/s[, fp8 TFLOP/s[, fp4 TFLOP/s]]), links; dense figures
_Figures = (tuple[float | None, float, float, float, float] | tuple[float | None, float, float, float, float, float]
            | tuple[float | None, float, float, float, float, float, float])
_TABLE: dict[str, tuple[_Figures, DeviceLinks]] = {
    "V100-SXM2-16GB": ((None, 125, 15.7, 16, 900), DeviceLinks(PCIE_GEN3_BPS, 6, default_fabric=_NVL)),
    "V100-SXM2-32GB": ((None, 125, 15.7, 32, 900), DeviceLinks(PCIE_GEN3_BPS, 6, default_fabric=_NVL)),
    "V100-PCIe-16GB": ((None, 112, 14, 16, 900), DeviceLinks(PCIE_GEN3_BPS)),
    "V100-PCIe-32GB": ((None, 112, 14, 32, 900), DeviceLinks(PCIE_GEN3_BPS)),
    "A100-SXM-40GB": ((312, 312, 19.5, 40, 1555), DeviceLinks(PCIE_GEN4_BPS, 12, default_fabric=_NVS)),
    "A100-SXM-80GB": ((312, 312, 19.5, 80, 2039), DeviceLinks(PCIE_GEN4_BPS, 12, default_fabric=_NVS)),
    # NVLink bridges join pairs only; the default fabric stays PCIe.
    "A100-PCIe-80GB": ((312, 312, 19.5, 80, 1935), DeviceLinks(PCIE_GEN4_BPS, 12)),
    "H100-SXM": ((989, 989, 67, 80, 3350, 1979), DeviceLinks(PCIE_GEN5_BPS, 18, NVLINK_SM90_BPS, default_fabric=_NVS)),
    "H100-PCIe": ((756, 756, 51, 80, 2000, 1513), DeviceLinks(PCIE_GEN5_BPS, 12, NVLINK_SM90_BPS)),
    "H200-SXM": ((989, 989, 67, 141, 4800, 1979), DeviceLinks(PCIE_GEN5_BPS, 18, NVLINK_SM90_BPS, default_fabric=_NVS)),
    "L40S": ((362, 362, 91.6, 48, 864, 733), DeviceLinks(PCIE_GEN4_BPS)),
    "L4": ((121, 121, 30.3, 24, 300, 242), DeviceLinks(PCIE_GEN4_BPS)),
    "T4": ((None, 65, 8.1, 16, 320), DeviceLinks(PCIE_GEN3_BPS)),
    "A10": ((125, 125, 31.2, 24, 600), DeviceLinks(PCIE_GEN4_BPS)),
    "RTX4090": ((165, 165, 82.6, 24, 1008, 330), DeviceLinks(PCIE_GEN4_BPS)),
    # xGMI: one Infinity Fabric link per pair; MI300X ~128 GB/s bidirectional -> 64 GB/s one way.
    "MI250X": ((191.5, 191.5, 47.9, 64, 1600), DeviceLinks(PCIE_GEN4_BPS, xgmi_pair_Bps=50e9, default_fabric=_XGMI)),
    "MI300X": ((1307, 1307, 163.4, 192, 5300, 2615), _MI300_LINKS),
    "MI325X": ((1307, 1307, 163.4, 256, 6000, 2615), _MI300_LINKS),
    # Blackwell (per GPU; NVLink 5: 18 links of 50 GB/s each way). B200 as in DGX/HGX B200; GB200 as in NVL72.
    "B200": ((2250, 2250, 75, 180, 7700, 4500, 9000),
             DeviceLinks(PCIE_GEN5_BPS, 18, NVLINK_SM100_BPS, default_fabric=_NVS)),
    "GB200": ((2500, 2500, 80, 186, 8000, 5000, 10000),
              DeviceLinks(PCIE_GEN5_BPS, 18, NVLINK_SM100_BPS, default_fabric=_NVS)),
    # Blackwell Ultra: bf16/fp8 as Blackwell, 1.5x its fp4 rate, 288 GB of HBM3e at 8 TB/s (HGX B300 and
    # GB300 NVL72 datasheets, per GPU).
    "B300": ((2250, 2250, 75, 288, 8000, 4500, 13500),
             DeviceLinks(PCIE_GEN6_BPS, 18, NVLINK_SM100_BPS, default_fabric=_NVS)),
    "GB300": ((2500, 2500, 80, 288, 8000, 5000, 15000),
              DeviceLinks(PCIE_GEN6_BPS, 18, NVLINK_SM100_BPS, default_fabric=_NVS)),
    "GH200": ((989, 989, 67, 96, 4000, 1979), DeviceLinks(PCIE_GEN5_BPS, 18, NVLINK_SM90_BPS, default_fabric=_NVS)),
    "H20": ((148, 148, 44, 96, 4000, 296), DeviceLinks(PCIE_GEN5_BPS, 18, NVLINK_SM90_BPS, default_fabric=_NVS)),
    "L40": ((181, 181, 90.5, 48, 864, 362), DeviceLinks(PCIE_GEN4_BPS)),
    "A40": ((149.7, 149.7, 37.4, 48, 696), DeviceLinks(PCIE_GEN4_BPS)),
    "RTX-A6000": ((154.8, 154.8, 38.7, 48, 768), DeviceLinks(PCIE_GEN4_BPS)),
    "RTX3090": ((71, 71, 35.6, 24, 936), DeviceLinks(PCIE_GEN4_BPS)),
    "RTX2080Ti": ((None, 53.8, 13.4, 11, 616), DeviceLinks(PCIE_GEN3_BPS)),
    "TitanRTX": ((None, 130.5, 16.3, 24, 672), DeviceLinks(PCIE_GEN3_BPS)),
}

CATALOG: dict[str, DeviceSpec] = {name: _spec(name, *figs) for name, (figs, _) in _TABLE.items()}

# Keys are normalised (see `_key`). Bare family names pick the smallest-memory variant, so a plan
# made for "a100" also fits an 80 GB part; nvidia-smi spellings map to the part they print.
_ALIASES: dict[str, str] = {
    "v100": "V100-SXM2-16GB", "v100sxm2": "V100-SXM2-16GB", "v10016gb": "V100-SXM2-16GB",
    "v10032gb": "V100-SXM2-32GB", "v100pcie": "V100-PCIe-16GB",
    "a100": "A100-SXM-40GB", "a100sxm440gb": "A100-SXM-40GB", "a10040gb": "A100-SXM-40GB",
    "a100sxm480gb": "A100-SXM-80GB", "a10080gb": "A100-SXM-80GB", "a100sxm80gb": "A100-SXM-80GB",
    "a10080gbpcie": "A100-PCIe-80GB", "a100pcie80gb": "A100-PCIe-80GB",
    "h100": "H100-SXM", "h100sxm5": "H100-SXM", "h10080gbhbm3": "H100-SXM", "h100sxm580gb": "H100-SXM",
    "h200": "H200-SXM", "h200141gbhbm3e": "H200-SXM",
    "rtx4090": "RTX4090", "4090": "RTX4090", "mi250": "MI250X", "mi300": "MI300X", "mi325": "MI325X",
    "b200180gb": "B200", "dgxb200": "B200", "gb200nvl72": "GB200", "b300288gb": "B300", "dgxb300": "B300",
    "gb300nvl72": "GB300", "gh200480gb": "GH200", "h20": "H20",
    "rtxa6000": "RTX-A6000", "a6000": "RTX-A6000", "3090": "RTX3090", "2080ti": "RTX2080Ti",
    "titanrtx": "TitanRTX",
}
_VENDOR_PREFIX = re.compile(r"^(nvidia|tesla|geforce|amd|instinct|\s|-|_)+", re.IGNORECASE)


def _key(name: str) -> str:
    """`name` lower-cased, without vendor prefixes and separators: 'NVIDIA A100-SXM4-80GB' -> 'a100sxm480gb'."""
    return re.sub(r"[^a-z0-9]", "", _VENDOR_PREFIX.sub("", name.strip()).lower())


_BY_KEY: dict[str, str] = {**{_key(n): n for n in CATALOG}, **_ALIASES}


def known_devices() -> tuple[str, ...]:
    """Catalog names, in catalog order."""
    return tuple(CATALOG)


def find_device(name: str) -> DeviceSpec | None:
    """The catalog device called `name` (as `lookup_device` reads names), or None where the catalog has none."""
    try:
        return lookup_device(name)
    except SpecError:
        return None


def lookup_device(name: str) -> DeviceSpec:
    """The catalog device called `name` (case and separators ignored; nvidia-smi names accepted).

    Raises SpecError naming the value and listing the known devices when none matches.
    """
    canonical = _BY_KEY.get(_key(name))
    if canonical is None:
        raise unknown("GPU type", name, known_devices())
    return CATALOG[canonical]


def device_links(device: DeviceSpec) -> DeviceLinks:
    """Link figures of a catalog device; a custom device gets PCIe Gen4 x16 and no NVLink/xGMI."""
    entry = _TABLE.get(device.name)
    return entry[1] if entry is not None else DeviceLinks(PCIE_GEN4_BPS)


def custom_device(data: Mapping[str, object], field: str) -> DeviceSpec:
    """A device defined inline by the `DeviceSpec` fields (FLOP/s, bytes, bytes/s).

    With `base: <catalog name>` the catalog device's figures are the defaults the other keys
    override (and the name defaults to the base's). `field` is the path used in error messages.
    Raises SpecError naming the field, the value and what is accepted.
    """
    values = dict(data)
    base = values.pop("base", None)
    known: dict[str, object] = {}
    if base is not None:
        try:
            known = lookup_device(str(base)).model_dump()
        except SpecError as err:
            raise SpecError(f"{field}.base: {err}") from None
    try:
        device = DeviceSpec.model_validate({**known, **values})
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        got = "nothing" if first["type"] == "missing" else repr(first.get("input"))
        accepted = ", ".join(["base", *DeviceSpec.model_fields])
        raise SpecError(
            f"{field}.{where}: {first['msg']} (got {got}); a custom device takes {accepted} "
            "(FLOP/s, bytes, bytes/s)"
        ) from None
    changed = sorted(k for k, v in values.items() if k != "name" and known.get(k) != v) if known else []
    if changed and "name" not in values:  # device types are told apart, calibrated and measured by name
        raise SpecError(f"{field}: a GPU that changes {', '.join(changed)} of its base {known['name']} needs a "
                        f"name of its own (e.g. name: {known['name']}-custom): calibrations and measurements "
                        "apply by name, and the catalog's GPU of that name has other figures")
    return device


def device_value(value: object, field: str) -> DeviceSpec:
    """The device a cluster-file value names: a catalog name, or a mapping (see `custom_device`).

    SpecError messages start with `field`, the path of the value in the file.
    """
    if isinstance(value, Mapping):
        return custom_device(value, field)
    if not isinstance(value, str):
        raise SpecError(f"{field}: {value!r} is not accepted; expected a GPU name or a mapping of "
                        "DeviceSpec fields")
    try:
        return lookup_device(value)
    except SpecError as err:
        raise SpecError(f"{field}: {err}") from None
