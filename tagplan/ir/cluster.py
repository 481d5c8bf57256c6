"""Cluster: devices grouped into nodes, the links inside each node, NICs, and the network.

Bandwidths are unidirectional bytes/s as NCCL models them (see reference/hardware.md); a device
pair's bandwidth and latency, and the bottleneck of a group, are queries of this object.
Devices are numbered node-major: node 0's GPUs first, in local order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

from pydantic import Field, model_validator

from tagplan.ir.base import Record
from tagplan.ir.workload import DType


class LinkKind(StrEnum):
    """Physical class of a link between two devices."""

    NVSWITCH = "nvswitch"
    NVLINK = "nvlink"
    XGMI = "xgmi"
    PCIE = "pcie"  # through PCIe switches (PIX/PXB)
    PCIE_HOST = "pcie_host"  # through a host bridge (PHB/NODE)
    SMP = "smp"  # across CPU sockets (SYS)
    NETWORK = "network"  # between nodes, through NICs
    LOCAL = "local"  # a device with itself


def is_cpu_name(name: str) -> bool:
    """Whether a device name is a CPU's: tagplan's 'cpu-...' device types, or a processor name a trace
    file carries (AMD EPYC, Intel Xeon)."""
    lowered = name.lower()
    return lowered.startswith("cpu") or "epyc" in lowered or "xeon" in lowered


class TensorFormat(StrEnum):
    """The number format a device's GEMMs run in (`DeviceSpec.costed_format`)."""

    FP4 = "fp4"
    FP8 = "fp8"
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class DeviceSpec(Record):
    """One accelerator type: vendor datasheet figures (dense, no sparsity)."""

    name: str = Field(min_length=1)
    peak_flops_bf16: float | None = Field(gt=0, description="dense FLOP/s; None where unsupported")
    peak_flops_fp16: float = Field(gt=0, description="dense FLOP/s")
    peak_flops_fp32: float = Field(gt=0, description="dense FLOP/s (non-tensor-core)")
    mem_bytes: int = Field(gt=0, description="bytes a process can allocate: the total capacity CUDA reports "
                           "(torch.cuda.get_device_properties().total_memory), not the datasheet's GB")
    mem_bandwidth_Bps: float = Field(gt=0)
    peak_flops_fp8: float | None = Field(default=None, gt=0, description="dense FLOP/s of fp8 GEMMs; None where "
                                         "unsupported")
    peak_flops_fp4: float | None = Field(default=None, gt=0, description="dense FLOP/s of block-scaled fp4 "
                                         "(nvfp4) GEMMs; None where unsupported (before Blackwell)")
    sustained_peak_fraction: float = Field(
        default=1.0, gt=0, le=1, description="clock a continuous training load sustains over the boost clock the "
        "datasheet peak assumes, where the board's power cap binds (T4; H100/H200 SXM and GB200/B200, fitted); "
        "scales all tensor-core work; 1 where none binds")
    fused_attention: bool = Field(default=True, description="a fused attention kernel (FlashAttention-2, cuDNN) runs "
                                  "here; False on NVIDIA GPUs before sm80 (V100, T4), where attention materialises "
                                  "its score matrix")

    @property
    def queued(self) -> bool:
        """Whether a host issues this device's kernels into a queue the device works through (a GPU), so that
        a kernel shorter than its issue leaves the device idle; False for a CPU, which runs its kernels itself
        (`is_cpu_name`: 'cpu-...' as `profiling.device.cpu_device_name` names it)."""
        return not is_cpu_name(self.name)

    def peak_flops(self, dtype: DType) -> float:
        """Peak dense FLOP/s in `dtype`. A device without the dtype's tensor cores runs the next wider
        format it has: nvfp4 as fp8, the fp8 recipes (fp8, fp8-cs, mxfp8) as bf16, bf16 as fp16
        (`costed_format`)."""
        rates = {TensorFormat.FP4: self.peak_flops_fp4, TensorFormat.FP8: self.peak_flops_fp8,
                 TensorFormat.BF16: self.peak_flops_bf16, TensorFormat.FP16: self.peak_flops_fp16,
                 TensorFormat.FP32: self.peak_flops_fp32}
        rate = rates[self.costed_format(dtype)]
        assert rate is not None  # `costed_format` names a format the device has
        return rate

    def costed_format(self, dtype: DType) -> TensorFormat:
        """The format `peak_flops(dtype)` costs `dtype` at on this device: the dtype's own tensor cores where the
        device has them, else the next wider format it has."""
        if dtype is DType.FP32:
            return TensorFormat.FP32
        if dtype is DType.NVFP4 and self.peak_flops_fp4 is not None:
            return TensorFormat.FP4
        if dtype.quantized and self.peak_flops_fp8 is not None:
            return TensorFormat.FP8
        if (dtype is DType.BF16 or dtype.quantized) and self.peak_flops_bf16 is not None:
            return TensorFormat.BF16
        return TensorFormat.FP16

    def has_tensor_cores_for(self, dtype: DType) -> bool:
        """Whether this device computes `dtype`'s GEMMs on tensor cores of their own, as a runtime needs them:
        block-scaled recipes (mxfp8, nvfp4) on Blackwell's block-scaled cores (marked by an fp4 rate), per-tensor
        fp8 (fp8, fp8-cs) on fp8 cores (sm89+), bf16 on bf16 cores (sm80+); fp16 and fp32 everywhere. Where not,
        `costed_format` is the fallback the cost model takes."""
        if dtype.block_scaled:
            return self.peak_flops_fp4 is not None
        if dtype.quantized:
            return self.peak_flops_fp8 is not None
        if dtype is DType.BF16:
            return self.peak_flops_bf16 is not None
        return True

    def sustained_peak_flops(self, dtype: DType) -> float:
        """`peak_flops(dtype)` at the clock a continuous training load sustains (`sustained_peak_fraction`):
        what comparisons of device speed use."""
        return self.peak_flops(dtype) * self.sustained_peak_fraction


class PairLink(Record):
    """An explicit link between two GPUs of one node (local indices), overriding the fabric."""

    a: int = Field(ge=0)
    b: int = Field(ge=0)
    kind: LinkKind
    bandwidth_Bps: float = Field(gt=0)
    latency_s: float = Field(ge=0)


class Node(Record):
    """One machine: `gpus` devices of one type on an intra-node fabric, with NICs."""

    name: str = Field(min_length=1)
    device: DeviceSpec
    gpus: int = Field(gt=0)
    fabric: LinkKind = LinkKind.PCIE
    fabric_bandwidth_Bps: float = Field(gt=0, description="per GPU pair, unidirectional")
    fabric_latency_s: float = Field(default=2e-6, ge=0)
    pair_links: tuple[PairLink, ...] = Field(default=(), description="overrides for some pairs")
    nics: int = Field(default=1, ge=0)
    nic_bandwidth_Bps: float = Field(default=1.25e9, gt=0, description="per NIC, unidirectional")

    @model_validator(mode="after")
    def _check_pairs(self) -> Node:
        for i, p in enumerate(self.pair_links):
            if p.a >= self.gpus or p.b >= self.gpus or p.a == p.b:
                raise ValueError(
                    f"node {self.name!r}: pair_links[{i}] ({p.a}, {p.b}) must name two different "
                    f"GPUs in 0..{self.gpus - 1}"
                )
        return self

    @cached_property
    def _pairs(self) -> dict[tuple[int, int], PairLink]:
        return {(min(p.a, p.b), max(p.a, p.b)): p for p in self.pair_links}

    @property
    def nic_bandwidth_per_gpu_Bps(self) -> float:
        """Network bandwidth a GPU gets when all GPUs of the node send at once."""
        return self.nics * self.nic_bandwidth_Bps / self.gpus


class Network(Record):
    """The network between nodes."""

    latency_s: float = Field(default=5e-6, ge=0, description="per hop, one way")
    oversubscription: float = Field(default=1.0, ge=1.0, description="core:edge bandwidth ratio")


@dataclass(frozen=True, slots=True)
class Device:
    """A device of the cluster, by global index."""

    index: int
    node: int
    local: int
    spec: DeviceSpec


@dataclass(frozen=True, slots=True)
class Link:
    """A device pair's connection: unidirectional bandwidth (bytes/s) and latency (s)."""

    kind: LinkKind
    bandwidth_Bps: float
    latency_s: float


class Cluster(Record):
    """Nodes (which may differ in GPU type and count) joined by one network."""

    name: str = Field(min_length=1)
    nodes: tuple[Node, ...] = Field(min_length=1)
    network: Network = Network()

    @cached_property
    def devices(self) -> tuple[Device, ...]:
        """All devices, node-major."""
        out: list[Device] = []
        for n, node in enumerate(self.nodes):
            out.extend(Device(len(out), n, g, node.device) for g in range(node.gpus))
        return tuple(out)

    @property
    def num_devices(self) -> int:
        """Number of devices."""
        return len(self.devices)

    @property
    def device_types(self) -> tuple[str, ...]:
        """Distinct device type names, in order of first appearance."""
        return tuple(dict.fromkeys(node.device.name for node in self.nodes))

    def device(self, index: int) -> Device:
        """The device with global index `index`; IndexError names the valid range."""
        if not 0 <= index < self.num_devices:
            raise IndexError(f"device {index} is not in cluster {self.name!r} (0..{self.num_devices - 1})")
        return self.devices[index]

    @cached_property
    def _links(self) -> dict[tuple[int, int], Link]:
        return {}

    def with_device_figures(self, device: str | None = None, **figures: object) -> Cluster:
        """This cluster with `figures` (DeviceSpec fields) replaced on every device of type `device`
        (None: on every device), validated as any DeviceSpec is; links stay as they are. ValueError
        naming a field DeviceSpec does not have, or a device type the cluster does not have (which
        would otherwise change nothing without a word)."""
        unknown = sorted(set(figures) - set(DeviceSpec.model_fields))
        if unknown:
            raise ValueError(f"with_device_figures: {', '.join(unknown)} not a DeviceSpec field; accepted: "
                             f"{', '.join(DeviceSpec.model_fields)}")
        if device is not None and device not in self.device_types:
            raise ValueError(f"with_device_figures: device={device!r} is not a device type of this cluster; "
                             f"accepted: {', '.join(self.device_types)}")
        nodes = tuple(n.model_copy(update={"device": DeviceSpec.model_validate({**n.device.model_dump(), **figures})})
                      if device is None or n.device.name == device else n for n in self.nodes)
        return self.model_copy(update={"nodes": nodes})

    def link(self, a: int, b: int) -> Link:
        """The connection between devices `a` and `b` (unidirectional bandwidth, latency); memoised
        (the collectives query the same pairs over and over)."""
        hit = self._links.get((a, b))
        if hit is None:
            hit = self._links[a, b] = self._link(a, b)
        return hit

    def _link(self, a: int, b: int) -> Link:
        da, db = self.device(a), self.device(b)
        if a == b:
            return Link(LinkKind.LOCAL, da.spec.mem_bandwidth_Bps, 0.0)
        if da.node == db.node:
            node = self.nodes[da.node]
            pair = node._pairs.get((min(da.local, db.local), max(da.local, db.local)))
            if pair is not None:
                return Link(pair.kind, pair.bandwidth_Bps, pair.latency_s)
            return Link(node.fabric, node.fabric_bandwidth_Bps, node.fabric_latency_s)
        na, nb = self.nodes[da.node], self.nodes[db.node]
        bw = min(na.nic_bandwidth_per_gpu_Bps, nb.nic_bandwidth_per_gpu_Bps) / self.network.oversubscription
        return Link(LinkKind.NETWORK, bw, self.network.latency_s)

    def bottleneck(self, devices: list[int] | tuple[int, ...]) -> Link:
        """The slowest pairwise link within a group (bandwidth minimum, latency maximum)."""
        if len(devices) < 2:
            d = devices[0] if devices else 0
            return self.link(d, d)
        links = [self.link(a, b) for i, a in enumerate(devices) for b in devices[i + 1 :]]
        slowest = min(links, key=lambda link: link.bandwidth_Bps)
        return Link(slowest.kind, slowest.bandwidth_Bps, max(link.latency_s for link in links))

    def node_devices(self, node: int) -> tuple[int, ...]:
        """Global indices of node `node`'s devices."""
        return tuple(d.index for d in self.devices if d.node == node)
