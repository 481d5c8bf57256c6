"""Per-stage costs for one micro-batch: compute, tensor-parallel communication, parameters.

`StageCoster` keeps the explicit memo tables the search relies on: per-block compute keyed by
(block hash, device type, dtype, tp, samples, sharding), per-block TP communication keyed by
(block hash, TP group, samples, sharding). Equal blocks on equal meshes are costed once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property

from tagplan.cost.calibration import Calibration
from tagplan.cost.comm import CommModel
from tagplan.cost.compute import (
    BlockTime,
    block_time,
    local_param_count,
    multiplied_param_count,
    op_time,
    profiled_block_time,
    shared_param_count,
)
from tagplan.cost.sharding import ShardedBlock, collective_bytes, divides, shard_block
from tagplan.ir.cluster import Cluster, DeviceSpec
from tagplan.ir.model import CHECKPOINT_SKIPPED, Block, ModelGraph, OpKind
from tagplan.ir.plan import ShardStrategy, Stage
from tagplan.ir.workload import Workload

TP_OVERLAP_SKIPPED = frozenset({"embedding", "head"})
"""Block kinds whose tensor-parallel collectives `Workload.tp_comm_overlap` leaves exposed: Megatron-LM's
`--tp-comm-overlap` runs Transformer Engine's userbuffer overlap inside the transformer blocks' linear
layers (QKV, projection, FC1, FC2); the vocabulary-parallel embedding and output layer are Megatron's
own layers, whose all-reduce / gathers run as plain collectives."""

ShardingKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class GroupCost:
    """One tensor-parallel group's per-micro-batch seconds (compute, and the tensor- and context-parallel
    communication inside its tasks: `*_tp_s`), forward and backward."""

    forward_compute_s: float
    backward_compute_s: float
    forward_tp_s: float
    backward_tp_s: float

    @property
    def forward_s(self) -> float:
        """Forward task seconds."""
        return self.forward_compute_s + self.forward_tp_s

    @property
    def backward_s(self) -> float:
        """Backward task seconds."""
        return self.backward_compute_s + self.backward_tp_s


class StageCoster:
    """Costs stages of plans for one (model, cluster, workload), with keyed memo tables."""

    def __init__(self, model: ModelGraph, cluster: Cluster, workload: Workload, calibration: Calibration,
                 comm: CommModel, *, fold: bool = True) -> None:
        self.model, self.cluster, self.workload = model, cluster, workload
        self.fold = fold
        self.calibration, self.comm = calibration, comm
        self.block_memo: dict[tuple[object, ...], BlockTime] = {}
        self.source_memo: dict[tuple[object, ...], str] = {}  # same keys: "ops" or how a layer profile applied
        self.tp_memo: dict[tuple[object, ...], tuple[float, float]] = {}
        self.shard_memo: dict[tuple[str, ShardingKey], ShardedBlock] = {}
        self.memory_memo: dict[tuple[object, ...], tuple[float, float]] = {}
        self.recomputable_memo: dict[str, dict[str, float]] = {}  # block hash -> pointwise ops keeping their inputs
        self.params_memo: dict[tuple[object, ...], float] = {}
        self.spec_memo: dict[tuple[int, ...], DeviceSpec] = {}
        self.spec_intern: dict[DeviceSpec, DeviceSpec] = {}
        self.counts_memo: dict[tuple[int, int], Counter[str]] = {}
        self.class_memo: dict[tuple[int, ...], tuple[object, ...]] = {}
        self.shared_class_memo: dict[tuple[tuple[int, ...], int, int], tuple[object, ...] | None] = {}
        self.cut_memo: dict[int, float] = {}
        self.replay_memo: dict[tuple[tuple[int, int], int | None], Counter[str]] = {}

    def sharded(self, block_hash: str, overrides: dict[str, ShardStrategy] | None) -> ShardedBlock:
        """The block's strategies and all-reduces under the plan's overrides (memoised)."""
        key = (block_hash, sharding_key(overrides))
        hit = self.shard_memo.get(key)
        if hit is None:
            hit = self.shard_memo[key] = shard_block(self.model.block_by_hash[block_hash], overrides)
        return hit

    def block_counts(self, stage: Stage) -> Counter[str]:
        """How many layers of each block hash the stage holds (prefix counts: O(unique blocks))."""
        hit = self.counts_memo.get(stage.layers)
        if hit is None:
            start, end = stage.layers
            hit = Counter({h: p[end] - p[start] for h, p in self._prefix_counts.items() if p[end] > p[start]})
            self.counts_memo[stage.layers] = hit
        return hit

    @cached_property
    def _prefix_counts(self) -> dict[str, list[int]]:
        """Per block hash, how many of the first i layers instantiate it."""
        out: dict[str, list[int]] = {}
        for i, layer in enumerate(self.model.layers):
            if layer.block not in out:
                out[layer.block] = [0] * (i + 1)
            for h, p in out.items():
                p.append(p[-1] + (1 if h == layer.block else 0))
        return out

    @cached_property
    def _prefix_inputs(self) -> list[float]:
        """Cumulative bytes per sample entering layers 0..i-1 (what recomputation keeps)."""
        acc, out = 0.0, [0.0]
        for i in range(len(self.model.layers)):
            acc += self.model.block_of(i - 1).output_bytes if i > 0 else 0.0
            out.append(acc)
        return out

    def cut_bytes(self, cut: int) -> float:
        """Bytes per sample crossing a pipeline cut before layer `cut`: every earlier layer's output
        that a later layer reads (T5's decoder blocks also read the encoder's output)."""
        hit = self.cut_memo.get(cut)
        if hit is None:
            sources = {j for i in range(cut, len(self.model.layers)) for j in self.model.layer_inputs(i) if j < cut}
            hit = self.cut_memo[cut] = sum(self.model.block_of(j).output_bytes for j in sources)
        return hit

    def input_bytes(self, stage: Stage) -> float:
        """Bytes per sample entering the stage's layers, summed over its layers."""
        start, end = stage.layers
        return self._prefix_inputs[end] - self._prefix_inputs[start]

    def units(self, stage: Stage) -> list[tuple[str, int]]:
        """(block hash, layers) to cost: one entry per unique block when folding, per layer otherwise."""
        if self.fold:
            return list(self.block_counts(stage).items())
        start, end = stage.layers
        return [(self.model.layers[i].block, 1) for i in range(start, end)]

    def clear(self) -> None:
        """Forget every memoised cost (what the search does without folding)."""
        self.replay_memo.clear()
        for table in (self.block_memo, self.source_memo, self.tp_memo, self.shard_memo, self.memory_memo,
                      self.params_memo):
            table.clear()

    def group_cost(self, stage: Stage, group_index: int, samples: float) -> GroupCost:
        """Per-micro-batch seconds of tensor-parallel group `group_index` (`Stage.tp_group`) processing `samples`
        samples (under context parallelism its share of its replica's tokens: samples / cp)."""
        group = stage.tp_group(group_index)
        spec = self.slowest(group)
        ring = _ring_next(stage, group_index)
        fwd = bwd = tp_f = tp_b = 0.0
        overlap = self.workload.tp_comm_overlap and stage.tp > 1
        replayed = self.replayed_counts(stage)
        counts = self.block_counts(stage) if replayed else None
        for block_hash, count in self.units(stage):
            sharded = self.sharded(block_hash, stage.sharding)
            t = self._block(block_hash, sharded, spec, stage.tp, samples, stage.sharding)
            comm_f, comm_b = self._tp(block_hash, sharded, group, samples, stage.sharding)
            kind = self.model.block_by_hash[block_hash].kind
            if overlap and kind not in TP_OVERLAP_SKIPPED:
                comm_f = exposed_tp_s(comm_f, t.forward_s, stage.tp)
                comm_b = exposed_tp_s(comm_b, t.backward_s, stage.tp)
            if ring is not None:
                ring_f, ring_b = self._cp(block_hash, sharded, spec, group, ring, samples, stage)
                comm_f, comm_b = comm_f + ring_f, comm_b + ring_b
            # the recomputed share of this block's layers replays its forward (and its TP collectives) backward
            replay = replayed[block_hash] / counts[block_hash] if counts is not None and block_hash in replayed else 0.0
            fwd += count * t.forward_s
            bwd += count * (t.backward_s + replay * t.forward_s)
            tp_f += count * comm_f
            tp_b += count * (comm_b + replay * comm_f)
        return GroupCost(fwd, bwd, tp_f, tp_b)

    def group_costs(self, stage: Stage, samples: tuple[float, ...]) -> list[GroupCost]:
        """`group_cost(stage, g, samples[g])` for every tensor-parallel group, each distinct one costed once: a
        group's cost depends only on its slowest device's figures, its link class, its samples and, under context
        parallelism, the ring link to its neighbour."""
        if self._shared_class(stage) is not None:  # every group alike: only the samples differ
            by_samples: dict[float, GroupCost] = {}
            for g, n in enumerate(samples):
                if n not in by_samples:
                    by_samples[n] = self.group_cost(stage, g, n)
            return [by_samples[n] for n in samples]
        seen: dict[tuple[object, ...], GroupCost] = {}
        out = []
        for g, n in enumerate(samples):
            key = (*self._group_class(stage, g), n)
            hit = seen.get(key)
            if hit is None:
                hit = seen[key] = self.group_cost(stage, g, n)
            out.append(hit)
        return out

    def _group_class(self, stage: Stage, g: int) -> tuple[object, ...]:
        """What group `g`'s cost depends on besides its samples (`group_costs`)."""
        group = stage.tp_group(g)
        ring = _ring_next(stage, g)
        return (id(self.slowest(group)), self.link_class(group) if len(group) > 1 else None,
                None if ring is None else (group, ring))

    def _shared_class(self, stage: Stage) -> tuple[object, ...] | None:
        """The class every tensor-parallel group of the stage shares (`_group_class`), or None where they differ
        (mixed device types or links, or a context-parallel ring, whose neighbours differ per group); memoised
        per (devices, tp, cp): on 1024 GPUs a stage has up to 1024 groups and a grid costs it many times."""
        key = (stage.devices, stage.tp, stage.cp)
        if key in self.shared_class_memo:
            return self.shared_class_memo[key]
        classes = {self._group_class(stage, g) for g in range(stage.dp_cp)} if stage.cp < 2 else set()
        hit = self.shared_class_memo[key] = next(iter(classes)) if len(classes) == 1 else None
        return hit

    def _cp(self, block_hash: str, sharded: ShardedBlock, spec: DeviceSpec, group: tuple[int, ...],
            ring: tuple[int, ...], samples: float, stage: Stage) -> tuple[float, float]:
        """(forward, backward) exposed seconds of the block's context-parallel ring (Megatron's ring attention):
        each attention op passes its rank's key/value chunk (`samples` of the replica's tokens: the op's bytes
        read beyond its query) to the next rank cp - 1 times forward, and the chunk with its gradient backward;
        each send overlaps one chunk's share (1 / cp) of the op's compute, and what a send takes beyond that
        share is exposed."""
        key = ("cp", block_hash, _spec_key(spec), group, ring, samples, stage.cp, stage.tp,
               sharding_key(stage.sharding))
        hit = self.tp_memo.get(key)
        if hit is None:
            forward = backward = 0.0
            for op in self.model.block_by_hash[block_hash].ops:
                if op.kind is not OpKind.ATTENTION:
                    continue
                strategy = sharded.strategies[op.name]
                split = stage.tp if stage.tp > 1 and divides(strategy) else 1
                chunk = max(op.bytes_read - op.bytes_written, 0.0) * samples * len(group) / split
                t = op_time(op, samples=samples, tp=stage.tp, strategy=strategy, spec=spec, dtype=self.workload.dtype,
                            calibration=self.calibration)
                send_f = self.comm.p2p_groups(group, ring, chunk).time_s
                send_b = self.comm.p2p_groups(group, ring, 2.0 * chunk).time_s
                forward += (stage.cp - 1) * max(0.0, send_f - t.forward_s / stage.cp)
                backward += (stage.cp - 1) * max(0.0, send_b - t.backward_s / stage.cp)
            hit = self.tp_memo[key] = (forward, backward)
        return hit

    def local_params(self, stage: Stage) -> float:
        """Parameters one device of the stage holds (before ZeRO)."""
        key = (stage.layers, stage.tp, sharding_key(stage.sharding))
        hit = self.params_memo.get(key)
        if hit is None:
            hit = self.params_memo[key] = self._local_params(stage)
        return hit

    def _local_params(self, stage: Stage) -> float:
        nbytes = self.model.dtype.nbytes
        own = sum(count * local_param_count(self.model.block_by_hash[h], self.sharded(h, stage.sharding).strategies,
                                            stage.tp, nbytes)
                  for h, count in self.block_counts(stage).items())
        return own + self.tied_copy_params(stage)  # a tied head away from the embedding keeps (and trains) a copy

    def multiplied_params(self, stage: Stage, *, recomputed: bool | None = None) -> float:
        """Parameters one device of the stage multiplies in its GEMMs (`compute.multiplied_param_count`): all of
        them, or (`recomputed` True / False) those of the layers that recompute / that keep their activations."""
        key = ("multiplied", recomputed, stage.layers, stage.tp, stage.recompute, stage.recompute_layers,
               sharding_key(stage.sharding))
        hit = self.params_memo.get(key)
        if hit is None:
            counts = self.block_counts(stage)
            if recomputed is not None:
                replayed = self.replayed_counts(stage)
                counts = replayed if recomputed else counts - replayed
            nbytes = self.model.dtype.nbytes
            hit = self.params_memo[key] = sum(
                count * multiplied_param_count(self.model.block_by_hash[h], self.sharded(h, stage.sharding).strategies,
                                               stage.tp, nbytes)
                for h, count in counts.items())
        return hit

    def replayed_counts(self, stage: Stage) -> Counter[str]:
        """Per block hash, how many of the stage's layers recompute (`Stage.recomputed`); empty without
        recompute. Full recompute counts come from the prefix counts; partial ones walk the layers once."""
        if not stage.recompute:
            return Counter()
        key = (stage.layers, stage.recompute_layers)
        hit = self.replay_memo.get(key)
        if hit is None:
            if stage.recompute_layers is None:
                hit = Counter({h: n for h, n in self.block_counts(stage).items()
                               if self.model.block_by_hash[h].kind not in CHECKPOINT_SKIPPED})
            else:
                hit = Counter(self.model.layers[i].block for i in stage.recomputed(self.model))
            self.replay_memo[key] = hit
        return hit

    def kept_activations(self, stage: Stage) -> tuple[float, list[tuple[Block, int]]]:
        """With recomputation: (input bytes per sample of the stage's recomputed layers, the blocks of its other
        layers with their counts: embeddings, heads and the layers a partial recompute leaves out), which keep
        every activation they save."""
        replayed = self.replayed_counts(stage)
        kept = self.block_counts(stage) - replayed
        if stage.recompute_layers is None:
            start, end = stage.layers
            skipped = [i for i in range(start, end) if self.model.block_of(i).kind in CHECKPOINT_SKIPPED]
            inputs = self.input_bytes(stage) - sum(self.model.block_of(i - 1).output_bytes for i in skipped if i > 0)
        else:
            inputs = sum(self.model.block_of(i - 1).output_bytes for i in stage.recomputed(self.model) if i > 0)
        return inputs, [(self.model.block_by_hash[h], n) for h, n in kept.items()]

    def checkpointed_layers(self, stage: Stage) -> int:
        """Layers of `stage` that recompute (`Stage.recomputed`): each pays a checkpoint call per micro-batch."""
        return sum(self.replayed_counts(stage).values())

    def tied_copy_params(self, stage: Stage) -> float:
        """Parameters of one device of `stage` that copy the first layer's (0 where the stage holds it)."""
        if stage.layers[0] == 0:
            return 0.0
        key = ("tied", stage.layers, stage.tp, sharding_key(stage.sharding))
        hit = self.params_memo.get(key)
        if hit is None:
            hit = self.params_memo[key] = self._tied_copy_params(stage)
        return hit

    def tied_table_params(self, stage: Stage) -> float:
        """Parameters of the whole tied table `stage` copies (as `tied_copy_params`, before any tp split)."""
        if stage.layers[0] == 0:
            return 0.0
        return max((shared_param_count(self.model.block_by_hash[h], {}, 1, self.model.dtype.nbytes)
                    for h in self.block_counts(stage)), default=0.0)

    def _tied_copy_params(self, stage: Stage) -> float:
        # one copy of the table per stage, however many of its ops use it (T5's decoder input and head)
        return max((shared_param_count(self.model.block_by_hash[h], self.sharded(h, stage.sharding).strategies,
                                       stage.tp, self.model.dtype.nbytes) for h in self.block_counts(stage)),
                   default=0.0)

    def slowest(self, group: tuple[int, ...]) -> DeviceSpec:
        """What paces a synchronous group: its lowest peak and its lowest memory bandwidth.

        A group of one type returns that type; a mixed group a combined spec named after the
        lowest-peak type (whose calibration applies) with the smallest figure of each kind.
        """
        hit = self.spec_memo.get(group)
        if hit is None:
            specs = list({self.cluster.devices[d].spec.name: self.cluster.devices[d].spec for d in group}.values())
            hit = min(specs, key=lambda s: s.peak_flops(self.workload.dtype))
            if len(specs) > 1:
                bf16 = [s.peak_flops_bf16 for s in specs]
                fp8 = [s.peak_flops_fp8 for s in specs]
                hit = hit.model_copy(update={
                    "peak_flops_bf16": None if None in bf16 else min(b for b in bf16 if b is not None),
                    "peak_flops_fp8": None if None in fp8 else min(b for b in fp8 if b is not None),
                    "peak_flops_fp16": min(s.peak_flops_fp16 for s in specs),
                    "peak_flops_fp32": min(s.peak_flops_fp32 for s in specs),
                    "mem_bytes": min(s.mem_bytes for s in specs),
                    "mem_bandwidth_Bps": min(s.mem_bandwidth_Bps for s in specs)})
            # equal figures, one object (the cluster keeps a spec per node): `group_costs` keys on identity
            hit = self.spec_memo[group] = self.spec_intern.setdefault(hit, hit)
        return hit

    def _block(self, block_hash: str, sharded: ShardedBlock, spec: DeviceSpec, tp: int, samples: float,
               overrides: dict[str, ShardStrategy] | None) -> BlockTime:
        """Compute seconds of one block per micro-batch: its layer profile where one covers the point
        (and the plan keeps the default sharding), else the op model; times the device's compute scale
        (the op model's blocks also at least the host's time to issue their kernels, `compute.block_time`)."""
        key = (block_hash, _spec_key(spec), self.workload.dtype, tp, samples, sharding_key(overrides))
        hit = self.block_memo.get(key)
        if hit is None:
            measured, source = None, "ops"
            profiles = self.calibration.layer_profiles(block_hash, spec.name, self.workload.dtype, self.model.seq_len)
            if profiles and not overrides:
                measured, why = profiled_block_time(profiles, tp=tp, samples=samples)
                source = why if measured is not None else f"ops ({why})"
            if measured is not None:
                scale = self.calibration.compute_factor(spec.name)
                hit = BlockTime(measured.forward_s * scale, measured.backward_s * scale)
            else:  # the compute scale per op, the host's issue floor per block
                hit = block_time(self.model.block_by_hash[block_hash], sharded.strategies, samples=samples,
                                 tp=tp, spec=spec, dtype=self.workload.dtype, calibration=self.calibration,
                                 eager=self.workload.eager, autocast=self.workload.autocast,
                                 sixteen_bit_weights=self.workload.eager_16bit_weights)
                if hit.host_bound:
                    source += ", host-bound (the host issues its kernels slower than the device runs them)"
            self.block_memo[key] = hit
            self.source_memo[key] = source
        return hit

    def compute_source(self, stage: Stage, samples: float) -> str:
        """Where the stage's compute times come from, per block kind: "block: layer profile; head: ops"."""
        spec = self.slowest(stage.tp_group(0))
        sources = set()
        for block_hash, _ in self.units(stage):
            key = (block_hash, _spec_key(spec), self.workload.dtype, stage.tp, samples, sharding_key(stage.sharding))
            if key not in self.source_memo:
                self._block(block_hash, self.sharded(block_hash, stage.sharding), spec, stage.tp, samples,
                            stage.sharding)
            sources.add(f"{self.model.block_by_hash[block_hash].kind}: {self.source_memo[key]}")
        return "; ".join(sorted(sources))

    def _tp(self, block_hash: str, sharded: ShardedBlock, group: tuple[int, ...], samples: float,
            overrides: dict[str, ShardStrategy] | None) -> tuple[float, float]:
        """(forward, backward) seconds of the block's per-micro-batch collectives on `group`."""
        if len(group) < 2 or not sharded.comms:
            return 0.0, 0.0
        # Keyed by the group's link class, not its device ids: equal meshes on equal links share it.
        key = (block_hash, self.link_class(group), samples, sharding_key(overrides))
        hit = self.tp_memo.get(key)
        if hit is None:
            forward = backward = 0.0
            for c in sharded.comms:
                if c.per_iteration:
                    continue
                nbytes = collective_bytes(c.collective, c.bytes_per_sample * samples, len(group))
                t = self.comm.collective(c.collective, group, nbytes).time_s
                if c.backward:
                    backward += t
                else:
                    forward += t
            hit = self.tp_memo[key] = (forward, backward)
        return hit

    def link_class(self, group: tuple[int, ...]) -> tuple[object, ...]:
        """What a collective's time depends on: size, node spread, the group's link figures and its
        fitted per-call overhead (which depends on its device types)."""
        hit = self.class_memo.get(group)
        if hit is None:
            hit = self.class_memo[group] = self._link_class(group)
        return hit

    def _link_class(self, group: tuple[int, ...]) -> tuple[object, ...]:
        topo = self.comm.topology(group)
        return (topo.size, topo.num_nodes, topo.k, topo.k_min, topo.ring_bandwidth_Bps, topo.ring_latency_s,
                topo.slowest_intra_bandwidth_Bps, topo.slowest_intra_latency_s, topo.inter_bandwidth_Bps,
                topo.inter_latency_s, topo.alltoall_intra_s_per_B, self.comm.collective_overhead_s(group))

    def per_iteration_tp_s(self, stage: Stage) -> float:
        """Seconds of once-per-iteration TP collectives (weight gradients of token-split matmuls)."""
        if stage.tp < 2:
            return 0.0
        group = stage.tp_group(0)
        total = 0.0
        for block_hash, count in self.block_counts(stage).items():
            for c in self.sharded(block_hash, stage.sharding).comms:
                if c.per_iteration:
                    total += count * self.comm.collective(c.collective, group, c.bytes_per_sample).time_s
        return total


def _ring_next(stage: Stage, g: int) -> tuple[int, ...] | None:
    """The tensor-parallel group that group `g` sends its keys and values to in its replica's context-parallel
    ring (None without context parallelism)."""
    if stage.cp < 2:
        return None
    return stage.tp_group(g - g % stage.cp + (g + 1) % stage.cp)


def exposed_tp_s(comm_s: float, compute_s: float, tp: int) -> float:
    """Seconds of a block's tensor-parallel collectives left exposed when they run in `tp` chunks under the
    block's compute (`Workload.tp_comm_overlap`): what the compute cannot cover, and at least the one chunk
    that has nothing to overlap (the first gathered or the last reduced)."""
    return max(comm_s - compute_s, comm_s / tp) if comm_s > 0.0 else 0.0


def sharding_key(overrides: dict[str, ShardStrategy] | None) -> ShardingKey:
    return tuple(sorted((k, v.value) for k, v in overrides.items())) if overrides else ()


def _spec_key(spec: DeviceSpec) -> tuple[object, ...]:
    """What a block's compute time reads of a device spec. A mixed group's combined spec keeps the
    name of its lowest-peak type (whose calibration applies) with the group's smallest figures, so
    the name alone would let it share a memo entry with that type's own spec."""
    return (spec.name, spec.peak_flops_bf16, spec.peak_flops_fp16, spec.peak_flops_fp8, spec.peak_flops_fp32,
            spec.mem_bandwidth_Bps)
