"""Calibration: achieved fraction of peak per device type, op kind and op size.

The shipped defaults are one table for every device, justified from public measurements
(not fitted to any benchmark row); `tagplan calibrate` (traces work) writes a measured table
in the same JSON shape and it replaces them.

- Tensor-core GEMMs (bf16/fp16): cuBLAS reaches 75-80% of dense peak on large square GEMMs
  on A100 and H100 (NVIDIA's cuBLAS and Megatron-LM reports; 8192^3 bf16 on H100 SXM runs near
  750-800 TFLOP/s in short benchmarks), about 60% for a few GFLOP, and falls off steeply below 100
  MFLOP where launch and tail effects dominate. The curve is piecewise-linear in log10(FLOPs per
  call). A device's `sustained_peak_fraction` scales the peak it applies to (T4, H100/H200 SXM: see
  `frontends.catalog.SUSTAINED_PEAK_FRACTION`).
- Fused attention (FlashAttention-2): 50-70% of peak forward and lower backward (Dao 2023); we
  use 0.85 x the GEMM curve, and the backward pass does 2.5x the forward FLOPs.
- Memory-bound kernels (norms, pointwise, softmax): 80% of datasheet HBM bandwidth, as STREAM-
  like copies reach 85-90% and PyTorch pointwise kernels somewhat less.
- Launch overhead: 4 us per kernel (CUDA launch plus framework dispatch, as profiles show).

Named physical parameters fitted from measured iterations (`tagplan calibrate`; defaults keep the
datasheet model: scales 1, overheads 0): an achieved-compute scale per device type (compute time
x scale), per link class an achieved-bandwidth scale and an added latency per step, a fixed
overhead per stage per micro-batch, per iteration, per pipeline send, per collective call (the
ranks' synchronisation, which a send does not pay) and per recomputed layer and micro-batch, and an
optimizer-step scale, and for ZeRO-3 stages a scale of their per-micro-batch fetches' seconds and the
fraction of them hidden under compute. Measured layer times (`LayerTime`) replace the op model
for the blocks they cover.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from functools import cached_property

from pydantic import Field, model_validator

from tagplan.cost.object_memo import object_memo
from tagplan.ir.base import Record
from tagplan.ir.cluster import Cluster, Node
from tagplan.ir.model import OpKind
from tagplan.ir.workload import DType

ANY_DEVICE = "*"
EAGER_HOST_DISPATCH_S = 3.95e-05
"""Seconds the host takes to issue one kernel under an eager runtime (`Workload.eager`) where no calibration
names the device: fitted by `bench/fit_eager_host.py` to the 30 GPT iterations of the H200 bundle
(`bench/data/gpu/h200/iterations`, the shipped defaults otherwise), the one figure from measured runs; a
property of the host's Python and dispatcher more than of the GPU."""


class EfficiencyCurve(Record):
    """Fraction of peak FLOP/s reached as a function of FLOPs per kernel call."""

    flops: tuple[float, ...] = Field(min_length=1, description="increasing FLOPs per call")
    efficiency: tuple[float, ...] = Field(min_length=1, description="fraction of peak at each point, (0, 1]")

    @model_validator(mode="after")
    def _check(self) -> EfficiencyCurve:
        if len(self.flops) != len(self.efficiency):
            raise ValueError(f"{len(self.flops)} flops points but {len(self.efficiency)} efficiencies")
        if any(b <= a for a, b in zip(self.flops, self.flops[1:], strict=False)) or min(self.flops) <= 0:
            raise ValueError(f"flops points must be positive and increasing, got {list(self.flops)}")
        if any(not 0 < e <= 1 for e in self.efficiency):
            raise ValueError(f"efficiencies must be in (0, 1], got {list(self.efficiency)}")
        return self

    @cached_property
    def _logs(self) -> list[float]:
        return [math.log10(f) for f in self.flops]

    def at(self, flops: float) -> float:
        """Efficiency for a call of `flops` FLOPs (clamped at the curve's ends)."""
        if flops <= self.flops[0]:
            return self.efficiency[0]
        if flops >= self.flops[-1]:
            return self.efficiency[-1]
        x = math.log10(flops)
        i = bisect.bisect_right(self._logs, x)
        x0, x1 = self._logs[i - 1], self._logs[i]
        e0, e1 = self.efficiency[i - 1], self.efficiency[i]
        return e0 + (e1 - e0) * (x - x0) / (x1 - x0)


def scaled(curve: EfficiencyCurve, factor: float) -> EfficiencyCurve:
    """The curve with every efficiency multiplied by `factor` (capped at 1)."""
    return EfficiencyCurve(flops=curve.flops, efficiency=tuple(min(1.0, e * factor) for e in curve.efficiency))


GEMM_CURVE = EfficiencyCurve(
    flops=(1e6, 1e8, 1e9, 1e10, 1e11, 1e12),
    efficiency=(0.02, 0.25, 0.45, 0.62, 0.72, 0.78),
)


class LinkFit(Record):
    """Measured alpha-beta figures of one link class: what collectives over it actually reach."""

    bandwidth_Bps: float = Field(gt=0, description="unidirectional per-link bandwidth the ring model needs")
    latency_s: float = Field(ge=0, description="per-step latency (alpha)")
    samples: int = Field(default=0, ge=0, description="collective records the fit is over")


INTRA = "intra"
INTER = "inter"


def link_key(device: str, scope: str) -> str:
    """The `Calibration.links` key of device type `device`'s links inside a node (`intra`) or between nodes."""
    return f"{device}/{scope}"


class LinkScale(Record):
    """A link class's achieved bandwidth relative to the model's figure, and latency it adds per step."""

    bandwidth_scale: float = Field(default=1.0, gt=0, description="multiplies the link's bandwidth")
    latency_s: float = Field(default=0.0, ge=0, description="added to the link's per-step latency")


class LayerTime(Record):
    """One block's measured seconds per micro-batch on one device of a `tp`-way group (communication
    excluded), from a `layer` trace record."""

    block_hash: str = Field(min_length=1, description="the model's structural block hash")
    block_name: str = ""
    device: str = Field(min_length=1)
    dtype: DType
    seq_len: int = Field(gt=0)
    tp: int = Field(default=1, ge=1)
    micro_batch: float = Field(gt=0, description="samples per micro-batch")
    forward_s: float = Field(gt=0)
    backward_s: float = Field(gt=0)


MEASURED_CAUSAL_TIME_FRACTION = 0.534
MEASURED_CAUSAL_DIAGONAL_TOKENS = 171.0
"""What a causal mask saves the flash-attention kernels of the H100 and H200 bundles (bench/data/gpu/*/ops: 16 pairs
of causal and unmasked calls, forward and backward, 1,024-8,192 tokens; bench/fit_causal_attention.py,
bench/results/causal_attention.json): a causal call over s keys takes 0.534 + 171 / s of the unmasked call's time
(half the tiles, the diagonal's, at the masked kernel's efficiency; leave-one-out worst 7.2%). Not the shipped
default: with it the published end-to-end runs come out 10-25% optimistic (docs/FIDELITY.md, "Causal attention"),
so the defaults charge a causal call its unmasked time, which stands in for per-token costs the op model lacks.
`tagplan calibrate` fits both figures where a bundle's op records time causal and unmasked calls of one shape."""

BLOCK_SCALED_GEMM_FRACTION: dict[DType, float] = {DType.MXFP8: 0.913, DType.NVFP4: 0.678}
"""Shipped `Calibration.block_scaled_gemm_fraction`: fitted by bench/fit_sustained_clock.py to the NeMo /
Megatron-Bridge Blackwell rows of each format (docs/FIDELITY.md)."""


MAX_FIGURE_S = 3600.0
"""The longest per-call or per-step overhead a calibration may hold: an hour is no device's figure."""


class Calibration(Record):
    """Efficiencies by device type (`*` for any) and op kind; memory and launch figures; measured links.

    `links` maps `link_key(device type, "intra" | "inter")` to measured alpha-beta figures; where
    present they replace the datasheet figures of that device type's nodes (`calibrated_cluster`).
    """

    name: str = "defaults"
    compute: dict[str, dict[OpKind, EfficiencyCurve]] = Field(
        default_factory=lambda: {ANY_DEVICE: {OpKind.MATMUL: GEMM_CURVE, OpKind.CONV: scaled(GEMM_CURVE, 0.9),
                                              OpKind.ATTENTION: scaled(GEMM_CURVE, 0.85)}})
    memory_efficiency: dict[str, float] = Field(default_factory=lambda: {ANY_DEVICE: 0.8})
    launch_overhead_s: float = Field(default=4e-6, ge=0)
    attention_backward_factor: float = Field(default=2.5, gt=0, description="backward / forward FLOPs")
    causal_time_fraction: float = Field(
        default=1.0, gt=0, le=1, description="a fused causal attention's time over long sequences as a fraction of "
        "the same kernel's unmasked time (half the tiles, at the masked kernel's efficiency); 1 with "
        "`causal_diagonal_tokens` 0, the default, charges a causal call its unmasked time "
        "(`MEASURED_CAUSAL_TIME_FRACTION` says why)")
    causal_diagonal_tokens: float = Field(
        default=0.0, ge=0, description="tokens: a fused causal attention over s keys takes "
        "min(1, causal_time_fraction + causal_diagonal_tokens / s) of its unmasked time (the diagonal's tiles, "
        "computed whole)")
    block_scaled_gemm_fraction: dict[DType, float] = Field(
        default_factory=lambda: dict(BLOCK_SCALED_GEMM_FRACTION), description="per block-scaled dtype (mxfp8, "
        "nvfp4): the fraction of its datasheet rate its GEMMs reach beside what the GEMM curve gives, on devices "
        "with block-scaled tensor cores (`DeviceSpec.peak_flops_fp4`)")
    links: dict[str, LinkFit] = Field(default_factory=dict)
    launch_by_device: dict[str, float] = Field(default_factory=dict, description="measured per device type, s")
    compute_scale: dict[str, float] = Field(default_factory=dict,
                                            description="per device type (or *): multiplies compute time")
    link_scales: dict[str, LinkScale] = Field(default_factory=dict,
                                              description="link_key(device type or *, intra | inter) -> scale")
    micro_batch_overhead_s: dict[str, float] = Field(default_factory=dict,
                                                     description="per device type (or *): s per stage per micro-batch")
    iteration_overhead_s: dict[str, float] = Field(default_factory=dict, description="per device type (or *): s")
    p2p_overhead_s: dict[str, float] = Field(default_factory=dict, description="per device type (or *): s per send")
    collective_overhead_s: dict[str, float] = Field(
        default_factory=dict, description="per device type (or *): s per collective call (every rank must enter "
        "it before any leaves: the synchronisation a pipeline send, which only waits for its data, does not pay)")
    recompute_overhead_s: dict[str, float] = Field(
        default_factory=dict, description="per device type (or *): s per recomputed layer per micro-batch (the "
        "checkpoint call's own cost: stashing and restoring RNG state, re-entering autograd)")
    optimizer_scale: dict[str, float] = Field(default_factory=dict,
                                              description="per device type (or *): multiplies the optimizer step")
    zero3_comm_scale: dict[str, float] = Field(
        default_factory=dict, description="per device type (or *), > 0: multiplies the seconds of ZeRO-3's "
        "per-micro-batch parameter gathers and gradient reduce-scatters (what the runtime's fetches achieve against "
        "the link model)")
    zero3_hidden_fraction: dict[str, float] = Field(
        default_factory=dict, description="per device type (or *), 0-1: how much of the shorter of a ZeRO-3 task's "
        "compute and its fetches runs hidden under the other (1, the default: prefetched, the task takes the longer "
        "of the two; 0: every fetch waits, they add)")
    eager_host_dispatch_s: float = Field(
        default=EAGER_HOST_DISPATCH_S, ge=0, description="s the host takes to issue one kernel under an eager "
        "runtime (`Workload.eager`) on a device `host_dispatch_s` does not name (`host_issue_s`)")
    host_dispatch_s: dict[str, float] = Field(
        default_factory=dict, description="per device type (or *): s the host takes to issue one kernel under an "
        "eager runtime (`Workload.eager`: each op's eager kernels), fitted from eager runs; on a GPU a block whose "
        "kernels take less device time than their issue costs the issue time, on a CPU (no queue) it adds to the "
        "ops' time (`compute.block_time`). Calibrations written "
        "before 2026-11-27 (third session) held a figure per op, about 1/4 of it per kernel")
    layers: tuple[LayerTime, ...] = Field(default=(), description="measured block times (layer records)")

    def curve(self, device: str, kind: OpKind) -> EfficiencyCurve | None:
        """The curve for `kind` on `device`, else the any-device curve, else None (memory-bound)."""
        for key in (device, ANY_DEVICE):
            table = self.compute.get(key)
            if table is not None and kind in table:
                return table[kind]
        return None

    @cached_property
    def _layer_index(self) -> dict[tuple[str, str, DType, int], list[LayerTime]]:
        index: dict[tuple[str, str, DType, int], list[LayerTime]] = {}
        for layer in self.layers:
            index.setdefault((layer.block_hash, layer.device, layer.dtype, layer.seq_len), []).append(layer)
        return index

    def layer_profiles(self, block_hash: str, device: str, dtype: DType, seq_len: int) -> list[LayerTime]:
        """Measured times of block `block_hash` on `device` at that dtype and sequence length ([] if none)."""
        return self._layer_index.get((block_hash, device, dtype, seq_len), []) if self.layers else []

    def compute_factor(self, device: str) -> float:
        """Multiplier of compute time on `device`: its fitted scale, else the any-device one, else 1."""
        return self.compute_scale.get(device, self.compute_scale.get(ANY_DEVICE, 1.0))

    def overhead_s(self, name: str, device: str) -> float:
        """Fitted overhead `name` (micro_batch_overhead_s, iteration_overhead_s, p2p_overhead_s,
        collective_overhead_s, recompute_overhead_s, host_dispatch_s) on `device`:
        its own figure, else the any-device one, else 0. Keyed by device type, so a calibration
        measured on one type never changes plans on another."""
        table: dict[str, float] = getattr(self, name)
        return table.get(device, table.get(ANY_DEVICE, 0.0))

    def host_issue_s(self, device: str, *, eager: bool, queued: bool = True) -> float:
        """Seconds the host takes to issue one kernel under an eager runtime, fitted from eager runs only: on a
        device with a queue (a GPU) its own `host_dispatch_s`, else the any-device one, else
        `eager_host_dispatch_s`; on a CPU its own figure alone, else 0 (the any-device figure and the default
        come from GPU hosts, where the issue is a floor, not a cost of its own). 0 for a fused runtime: its
        issue time is not assumed."""
        if not eager:
            return 0.0
        table = self.host_dispatch_s
        if not queued:
            return table.get(device, 0.0)
        return table.get(device, table.get(ANY_DEVICE, self.eager_host_dispatch_s))

    @model_validator(mode="after")
    def _check_ranges(self) -> Calibration:
        """Every figure finite, efficiencies in (0, 1], scales above 0, seconds at least 0 and at most an hour: a
        figure outside these is no calibration of a device (a zero efficiency divided a time by zero)."""
        checks: list[tuple[str, dict[str, float], Callable[[float], bool], str]] = [
            ("memory_efficiency", self.memory_efficiency, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("compute_scale", self.compute_scale, lambda v: v > 0, "> 0"),
            ("optimizer_scale", self.optimizer_scale, lambda v: v > 0, "> 0")]
        seconds = {"launch_by_device": self.launch_by_device, "micro_batch_overhead_s": self.micro_batch_overhead_s,
                   "iteration_overhead_s": self.iteration_overhead_s, "p2p_overhead_s": self.p2p_overhead_s,
                   "collective_overhead_s": self.collective_overhead_s,
                   "recompute_overhead_s": self.recompute_overhead_s, "host_dispatch_s": self.host_dispatch_s,
                   "launch_overhead_s": {"": self.launch_overhead_s},
                   "eager_host_dispatch_s": {"": self.eager_host_dispatch_s}}
        checks += [(name, table, lambda v: 0 <= v <= MAX_FIGURE_S, f"in [0, {MAX_FIGURE_S:g}] s")
                   for name, table in seconds.items()]
        for name, table, ok, accepted in checks:
            bad = {k: v for k, v in table.items() if not (math.isfinite(v) and ok(v))}
            if bad:
                shown = bad.get("", bad) if set(bad) == {""} else bad
                raise ValueError(f"{name} must be {accepted}, got {shown}")
        return self

    @model_validator(mode="after")
    def _check_zero3(self) -> Calibration:
        bad = {k: v for k, v in self.zero3_comm_scale.items() if not v > 0}
        if bad:
            raise ValueError(f"zero3_comm_scale must be > 0 (a multiple of the fetches' seconds), got {bad}")
        bad = {k: v for k, v in self.zero3_hidden_fraction.items() if not 0 <= v <= 1}
        if bad:
            raise ValueError(f"zero3_hidden_fraction must be in [0, 1], got {bad}")
        return self

    def zero3_factors(self, device: str) -> tuple[float, float]:
        """(seconds scale, hidden fraction) of ZeRO-3's per-micro-batch collectives on `device`: its fitted
        figures, else the any-device ones, else (1, 1)."""
        scale = self.zero3_comm_scale.get(device, self.zero3_comm_scale.get(ANY_DEVICE, 1.0))
        hidden = self.zero3_hidden_fraction.get(device, self.zero3_hidden_fraction.get(ANY_DEVICE, 1.0))
        return scale, min(max(hidden, 0.0), 1.0)  # model_copy (the fit's updates) skips the validator

    def optimizer_factor(self, device: str) -> float:
        """Multiplier of the optimizer step's time on `device` (1 unless fitted)."""
        return self.optimizer_scale.get(device, self.optimizer_scale.get(ANY_DEVICE, 1.0))

    def link_scale(self, device: str, scope: str) -> LinkScale | None:
        """The fitted scale of `device`'s `scope` links (intra | inter), else the any-device one."""
        return self.link_scales.get(link_key(device, scope), self.link_scales.get(link_key(ANY_DEVICE, scope)))

    def launch_s(self, device: str) -> float:
        """Seconds of overhead per kernel on `device`: its measured figure, else `launch_overhead_s`."""
        return self.launch_by_device.get(device, self.launch_overhead_s)

    def bandwidth_fraction(self, device: str, kind: OpKind | None = None) -> float:
        """Fraction of datasheet memory bandwidth kernels of `kind` reach on `device`: the
        `device/kind` entry (measured per kind), else the device's, else the any-device one."""
        table = self.memory_efficiency
        if kind is not None and (hit := table.get(f"{device}/{kind.value}")) is not None:
            return hit
        return table.get(device, table.get(ANY_DEVICE, 0.8))


DEFAULT_CALIBRATION = Calibration()


def calibrated_cluster(cluster: Cluster, calibration: Calibration) -> Cluster:
    """`cluster` with measured link figures in place of datasheet ones, where the calibration has them.

    A node whose device type has an `intra` fit gets that bandwidth and latency as its fabric (and
    loses its per-pair overrides: the measurement already averages over the node's real links); one
    with an `inter` fit gets NICs whose per-GPU share is the fitted bandwidth, and the network the
    largest fitted latency. Link scales (`Calibration.link_scales`) then multiply the resulting
    bandwidths and add their latency. Returns `cluster` itself when nothing applies. Memoised per
    cluster object and link figures (`object_memo`): a fit's many tries that leave the links alone get
    the same calibrated cluster, and with it its memoised links and group topologies.
    """
    if not calibration.links and not calibration.link_scales:
        return cluster
    key = (tuple((k, v.bandwidth_Bps, v.latency_s) for k, v in sorted(calibration.links.items())),
           tuple((k, v.bandwidth_scale, v.latency_s) for k, v in sorted(calibration.link_scales.items())))
    memo = object_memo(cluster, "calibrated_cluster")
    hit = memo.pop(key, None)
    if hit is None:
        copy = _calibrated_cluster(cluster, calibration)
        # the memo must not hold `cluster` itself: it would keep the object its own memo is dropped with alive
        hit = _UNCHANGED if copy is cluster else copy
        if len(memo) >= CALIBRATED_VARIANTS:
            del memo[next(iter(memo))]  # the least recently used
    memo[key] = hit
    return cluster if hit is _UNCHANGED else hit


_UNCHANGED = object()
"""`calibrated_cluster`'s memo entry for link figures that change nothing on the cluster (e.g. a fit for a device
type it does not have)."""


CALIBRATED_VARIANTS = 8
"""Calibrated copies kept per cluster (least recently used dropped): a fit's tries move one link figure
at a time, so a handful covers them."""


def _calibrated_cluster(cluster: Cluster, calibration: Calibration) -> Cluster:
    nodes: list[Node] = []
    latencies: list[float] = []
    changed = False
    for node in cluster.nodes:
        update = _fitted_links(node, calibration, latencies)
        node = node.model_copy(update=update) if update else node
        scaled_update = _scaled_links(node, calibration)
        nodes.append(node.model_copy(update=scaled_update) if scaled_update else node)
        changed = changed or bool(update) or bool(scaled_update)
    if not changed:
        return cluster
    network = cluster.network
    if latencies:
        network = network.model_copy(update={"latency_s": max(latencies), "oversubscription": 1.0})
    extra = [s.latency_s for n in cluster.nodes if (s := calibration.link_scale(n.device.name, INTER)) is not None]
    if extra:
        network = network.model_copy(update={"latency_s": network.latency_s + max(extra)})
    return cluster.model_copy(update={"nodes": tuple(nodes), "network": network})


def _fitted_links(node: Node, calibration: Calibration, latencies: list[float]) -> dict[str, object]:
    """The node's fields that measured alpha-beta fits replace (appending inter-node latencies)."""
    update: dict[str, object] = {}
    intra = calibration.links.get(link_key(node.device.name, INTRA))
    if intra is not None and node.gpus > 1:
        update.update(fabric_bandwidth_Bps=intra.bandwidth_Bps, fabric_latency_s=intra.latency_s, pair_links=())
    inter = calibration.links.get(link_key(node.device.name, INTER))
    if inter is not None:
        nics = max(node.nics, 1)
        update.update(nics=nics, nic_bandwidth_Bps=inter.bandwidth_Bps * node.gpus / nics)
        latencies.append(inter.latency_s)
    return update


def _scaled_links(node: Node, calibration: Calibration) -> dict[str, object]:
    """The node's link fields under the calibration's link scales (empty when none applies)."""
    update: dict[str, object] = {}
    intra = calibration.link_scale(node.device.name, INTRA)
    if intra is not None and node.gpus > 1:
        pairs = tuple(p.model_copy(update={"bandwidth_Bps": p.bandwidth_Bps * intra.bandwidth_scale,
                                           "latency_s": p.latency_s + intra.latency_s}) for p in node.pair_links)
        update.update(fabric_bandwidth_Bps=node.fabric_bandwidth_Bps * intra.bandwidth_scale,
                      fabric_latency_s=node.fabric_latency_s + intra.latency_s, pair_links=pairs)
    inter = calibration.link_scale(node.device.name, INTER)
    if inter is not None:
        update.update(nic_bandwidth_Bps=node.nic_bandwidth_Bps * inter.bandwidth_scale)
    return update
