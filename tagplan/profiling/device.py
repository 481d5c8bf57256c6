"""The device being profiled: its `DeviceSpec` (the figures op efficiencies are relative to) and fingerprint.

CPU figures are estimates from what Linux reports, except the memory bandwidth, which is measured:

- peak FLOP/s = physical cores (those this process may run on) x clock x FLOPs per cycle per core.
  FLOPs per cycle assume two vector FMA units per core, as server x86 cores since Haswell/Zen 2
  have: AVX-512 with FMA does 16 fp32 lanes x 2 (multiply and add) x 2 units = 64; AVX2 with FMA
  8 x 2 x 2 = 32; AVX without FMA 8 lanes x (1 add + 1 multiply unit) = 16; SSE 8. Cores with a
  single 512-bit FMA unit (some Xeon Silver/Bronze) reach half the AVX-512 figure. bf16 uses the
  fp32 figure unless the CPU has AMX (`amx_bf16`: 1024 FLOPs per cycle per core) or `avx512_bf16`
  (VDPBF16PS: twice fp32); fp16 likewise with `amx_fp16` or `avx512_fp16`.
- clock: the maximum from cpufreq (`cpuinfo_max_freq`), else `cpu MHz` from /proc/cpuinfo (under
  a hypervisor, the nominal clock), else BogoMIPS / 2 MHz (BogoMIPS counts two per cycle on x86),
  else 2.0 GHz. Under a hypervisor the clock is often the base clock and a core boosts above it,
  so `profile` raises a peak to the best rate its GEMMs reached when that is higher
  (`with_peaks_at_least`), keeping measured efficiencies at or below 1.
- memory: MemTotal from /proc/meminfo (the host's, not a container's limit).
- memory bandwidth: `measure_memory_bandwidth_Bps`, a STREAM-like copy of a 256 MiB tensor,
  counting the bytes read plus the bytes written, best of five.

GPU figures come from the catalog when the driver's name matches a catalog device; otherwise see
`cuda_device_spec`.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from tagplan.datasets.traces.bundle import Fingerprint, host_fingerprint
from tagplan.errors import SpecError
from tagplan.frontends.catalog import find_device
from tagplan.ir.cluster import DeviceSpec
from tagplan.ir.workload import DType

log = logging.getLogger(__name__)

DEFAULT_CLOCK_HZ = 2.0e9
BANDWIDTH_PROBE_BYTES = 256 * 2**20
# Dense tensor-core FLOPs per cycle per SM (fp16/bf16 inputs, fp32 accumulate), from the datasheet
# peaks of the catalog parts divided by SMs x boost clock: V100/T4 1024, A100 2048, A10/L40S 1024,
# H100 4096. Used only for GPUs outside the catalog.
_TENSOR_FLOPS_PER_SM_CYCLE = {(7, 0): 1024, (7, 5): 1024, (8, 0): 2048, (8, 6): 1024, (8, 9): 1024, (9, 0): 4096}
_FP32_FLOPS_PER_SM_CYCLE = {7: 128, 8: 256, 9: 256}  # FP32 lanes x 2; sm80 (A100) has 64 lanes, so 128
_DEFAULT_GPU_CLOCK_HZ = 1.5e9


def parse_cpuinfo(text: str) -> list[dict[str, str]]:
    """/proc/cpuinfo text as one `{field: value}` dict per logical processor."""
    processors: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in [*text.splitlines(), ""]:
        if not line.strip():
            if current:
                processors.append(current)
            current = {}
            continue
        key, _, value = line.partition(":")
        current[key.strip()] = value.strip()
    return processors


def _cpuinfo() -> list[dict[str, str]]:
    path = Path("/proc/cpuinfo")
    return parse_cpuinfo(path.read_text()) if path.is_file() else []


def cpu_model_name(cpuinfo: list[dict[str, str]] | None = None) -> str:
    """The CPU's model name as the OS reports it, e.g. 'AMD EPYC 7763 64-Core Processor'."""
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    for proc in info:
        if proc.get("model name"):
            return proc["model name"]
    return platform.processor() or platform.machine() or "unknown"


def cpu_device_name(model_name: str) -> str:
    """A stable device type for a CPU model name.

    'Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz' -> 'cpu-intel-xeon-gold-6338'; 'AMD EPYC' -> 'cpu-amd-epyc'.
    """
    text = re.sub(r"\((r|tm)\)|@.*$|\bcpu\b|\bprocessor\b|\b\d+-core\b", " ", model_name.lower())
    slug = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    return f"cpu-{slug or 'unknown'}"


def cpu_flags(cpuinfo: list[dict[str, str]]) -> frozenset[str]:
    """ISA flags of the first processor (x86 `flags`, Arm `Features`)."""
    first = cpuinfo[0] if cpuinfo else {}
    return frozenset((first.get("flags") or first.get("Features") or "").split())


def cpu_cores(cpuinfo: list[dict[str, str]], allowed: set[int] | None = None) -> int:
    """Physical cores among the logical processors in `allowed` (all when None); SMT siblings count once."""
    chosen = [p for p in cpuinfo if allowed is None or int(p.get("processor", -1)) in allowed]
    if not chosen:
        return len(allowed) if allowed else (os.cpu_count() or 1)
    if all("core id" in p for p in chosen):
        return len({(p.get("physical id", "0"), p["core id"]) for p in chosen})
    return len(chosen)


def cpu_clock_hz(cpuinfo: list[dict[str, str]]) -> float:
    """Clock in Hz: cpufreq maximum, else 'cpu MHz', else BogoMIPS / 2, else 2.0 GHz (module docstring)."""
    max_freq = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    if max_freq.is_file():
        return float(max_freq.read_text().strip()) * 1e3  # kHz
    first: Mapping[str, str] = cpuinfo[0] if cpuinfo else {}
    if _positive(first.get("cpu MHz")):
        return float(first["cpu MHz"]) * 1e6
    bogomips = first.get("bogomips") or first.get("BogoMIPS")
    if _positive(bogomips):
        return float(bogomips or 0) / 2 * 1e6
    return DEFAULT_CLOCK_HZ


def _positive(value: str | None) -> bool:
    try:
        return value is not None and float(value) > 0
    except ValueError:
        return False


def fp32_flops_per_cycle(flags: frozenset[str]) -> int:
    """fp32 FLOPs per cycle per core from the ISA flags, assuming two vector FMA units (module docstring)."""
    if "avx512f" in flags and "fma" in flags:
        return 64
    if "avx2" in flags and "fma" in flags:
        return 32
    if "avx" in flags:
        return 16
    if "asimd" in flags:  # Arm NEON: 4 lanes x 2 x 2 pipes (SVE widths vary; this is the floor)
        return 16
    return 8


def half_flops_per_cycle(flags: frozenset[str], fp32: int, *, amx: str, avx512: str) -> int:
    """bf16 or fp16 FLOPs per cycle per core: AMX, then the AVX-512 half-precision extension, else fp32's."""
    if amx in flags:
        return 1024
    if avx512 in flags:
        return 2 * fp32
    return fp32


def host_memory_bytes() -> int:
    """Physical memory in bytes: MemTotal from /proc/meminfo, else the page count times the page size."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        match = re.search(r"^MemTotal:\s+(\d+)\s*kB", meminfo.read_text(), re.MULTILINE)
        if match:
            return int(match.group(1)) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure_memory_bandwidth_Bps(*, device: Literal["cpu", "cuda"] = "cpu", nbytes: int = BANDWIDTH_PROBE_BYTES,
                                 repeats: int = 5) -> float:
    """Measured memory bandwidth in bytes/s: the best of `repeats` copies of an `nbytes` fp32 tensor,
    counting bytes read plus bytes written (STREAM's copy convention)."""
    import torch

    src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    best_s = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best_s = min(best_s, time.perf_counter() - start)
    return 2.0 * src.numel() * src.element_size() / best_s


def available_cores() -> int:
    """Physical cores this process may run on (its CPU affinity; SMT siblings count once)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return cpu_cores(_cpuinfo(), allowed)


def idle_cores() -> int:
    """Available cores other processes are not keeping busy: `available_cores()` minus the
    1-minute load average (rounded), at least 1."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = available_cores()
    return max(1, min(cores, cores - int(load + 0.5)))


def cpu_device_spec(*, cores: int | None = None, mem_bandwidth_Bps: float | None = None) -> DeviceSpec:
    """This host's CPU as a DeviceSpec (FLOP/s, bytes, bytes/s), estimated as the module docstring says.

    Peaks count `cores` cores (default `available_cores()`; pass the torch thread count when fewer
    threads run the ops). The memory bandwidth is measured (about a second, with the current torch
    threads) unless `mem_bandwidth_Bps` is given.
    """
    info = _cpuinfo()
    flags = cpu_flags(info)
    cycles_per_s = (available_cores() if cores is None else cores) * cpu_clock_hz(info)
    fp32 = fp32_flops_per_cycle(flags)
    bf16 = half_flops_per_cycle(flags, fp32, amx="amx_bf16", avx512="avx512_bf16")
    fp16 = half_flops_per_cycle(flags, fp32, amx="amx_fp16", avx512="avx512_fp16")
    bandwidth = measure_memory_bandwidth_Bps() if mem_bandwidth_Bps is None else mem_bandwidth_Bps
    return DeviceSpec(name=cpu_device_name(cpu_model_name(info)), peak_flops_bf16=bf16 * cycles_per_s,
                      peak_flops_fp16=fp16 * cycles_per_s, peak_flops_fp32=fp32 * cycles_per_s,
                      mem_bytes=host_memory_bytes(), mem_bandwidth_Bps=bandwidth)


def with_peaks_at_least(spec: DeviceSpec, achieved_flops: Mapping[DType, float]) -> DeviceSpec:
    """`spec` with each dtype's peak FLOP/s raised to the rate measured in that dtype where it is higher.

    A peak below a measured rate would give efficiencies above 1. On CPUs it happens when the only
    clock known is the base clock (a VM without cpufreq) and the core boosts above it.
    """
    fields = {DType.FP32: "peak_flops_fp32", DType.FP16: "peak_flops_fp16", DType.BF16: "peak_flops_bf16"}
    update = {}
    for dtype, rate in achieved_flops.items():
        current = getattr(spec, fields[dtype])
        if current is not None and rate > current:
            update[fields[dtype]] = rate
    return spec.model_copy(update=update) if update else spec


def require_cuda() -> None:
    """Raise SpecError when torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise SpecError(f"device 'cuda': torch {torch.__version__} ({build}) sees no CUDA GPU; "
                        "profile with device 'cpu', or run on a machine with a GPU and a CUDA build of torch")


def cuda_device_spec(index: int = 0) -> DeviceSpec:
    """The catalog DeviceSpec of GPU `index`, matched by the name the driver reports.

    A GPU outside the catalog gets a spec built from `torch.cuda.get_device_properties`: memory from
    the properties, bandwidth measured (`measure_memory_bandwidth_Bps`), and peaks ESTIMATED as SMs x
    clock x FLOPs per SM per cycle of its architecture (the table above; clock from the properties
    where torch reports it, else 1.5 GHz). Such figures can be off by 2x; add the GPU to the catalog.
    """
    import torch

    require_cuda()
    name = torch.cuda.get_device_name(index)
    if (known := find_device(name)) is not None:
        return known
    log.warning("GPU %r is not in the catalog; estimating its peaks from its properties", name)
    props = torch.cuda.get_device_properties(index)
    clock_khz = getattr(props, "clock_rate", 0) or 0
    cycles_per_s = props.multi_processor_count * (clock_khz * 1e3 if clock_khz else _DEFAULT_GPU_CLOCK_HZ)
    tensor = _TENSOR_FLOPS_PER_SM_CYCLE.get((props.major, props.minor), 1024) * cycles_per_s
    fp32 = _FP32_FLOPS_PER_SM_CYCLE.get(props.major, 128) * cycles_per_s
    with torch.cuda.device(index):
        bandwidth = measure_memory_bandwidth_Bps(device="cuda", nbytes=1 << 30)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "cuda"
    return DeviceSpec(name=slug, peak_flops_bf16=tensor if props.major >= 8 else None, peak_flops_fp16=tensor,
                      peak_flops_fp32=fp32, mem_bytes=int(props.total_memory), mem_bandwidth_Bps=bandwidth,
                      fused_attention=props.major >= 8)


def device_type(device: Literal["cpu", "cuda"]) -> str:
    """The device type name records and fingerprints use: the DeviceSpec name, without measuring anything."""
    if device == "cpu":
        return cpu_device_name(cpu_model_name())
    import torch

    require_cuda()
    name = torch.cuda.get_device_name(0)
    known = find_device(name)
    return known.name if known is not None else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "cuda"


def fingerprint(device: str) -> Fingerprint:
    """The fingerprint of this host profiled on `device` ('cpu' or 'cuda'); SpecError for anything else."""
    if device == "cpu":
        model = cpu_model_name()
        return host_fingerprint(cpu_device_name(model), device_name=model, backend="cpu")
    if device != "cuda":
        raise SpecError(f"device {device!r} is not accepted; expected 'cpu' or 'cuda'")
    import torch

    require_cuda()
    return host_fingerprint(device_type("cuda"), device_name=torch.cuda.get_device_name(0),
                            device_count=torch.cuda.device_count(), backend="cuda", cuda=torch.version.cuda or "")
