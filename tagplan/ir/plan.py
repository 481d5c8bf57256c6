"""Plan: pipeline stages, each a layer range on an ordered device group with a (dp, cp, tp) mesh.

This is the one type that passes between search, cost, GNN, service and export (Plan JSON v1,
docs/PLAN_FORMAT.md). Within a stage, devices are ordered tp-fastest, then cp, then dp (Megatron's
tp-cp-dp rank order): replica r holds `devices[r * cp * tp:(r + 1) * cp * tp]`, and its context-parallel
rank c the tensor-parallel group `tp_group(r * cp + c)`.
"""

from __future__ import annotations

import math
from enum import StrEnum
from functools import cached_property

from pydantic import Field, model_validator

from tagplan.ir.base import Record
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph

PLAN_VERSION = 1


class Schedule(StrEnum):
    """Pipeline schedule."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


class ShardStrategy(StrEnum):
    """How one op is partitioned across a stage's tensor-parallel group."""

    REPLICATE = "replicate"
    BATCH = "batch"
    SEQUENCE = "sequence"
    HEADS = "heads"
    COLUMN = "column"
    ROW = "row"
    EXPERTS = "experts"


class Stage(Record):
    """A contiguous layer range `[start, end)` on `dp * cp * tp` devices."""

    layers: tuple[int, int]
    devices: tuple[int, ...] = Field(min_length=1)
    dp: int = Field(default=1, gt=0)
    tp: int = Field(default=1, gt=0)
    cp: int = Field(
        default=1, gt=0, description="context-parallel degree: each replica's samples split by sequence over cp "
        "tensor-parallel groups, attention passing keys and values around the cp ring (Megatron's "
        "--context-parallel-size); gradients reduce over dp * cp")
    batch_shares: tuple[float, ...] | None = Field(
        default=None, description="per data-parallel replica, summing to 1; None means even"
    )
    batch_samples: tuple[int, ...] | None = Field(
        default=None, description="samples per micro-batch of each data-parallel replica (whole, >= 1); "
        "they sum to the micro-batch size; exclusive with batch_shares"
    )
    recompute: bool = False
    recompute_layers: int | None = Field(
        default=None, gt=0, description="with recompute: how many of the stage's checkpointable layers (its "
        "transformer blocks, not an embedding or head) recompute, its first ones in order; the others keep their "
        "activations. None: all of them (full recompute). Megatron's --recompute-method block "
        "--recompute-num-layers, per pipeline stage or virtual stage")
    zero: int = Field(default=0, ge=0, le=3, description="ZeRO stage 0-3")
    sharding: dict[str, ShardStrategy] | None = Field(
        default=None, description="per-op strategy by op name, filled by the intra-stage solver"
    )

    @model_validator(mode="after")
    def _check(self) -> Stage:
        start, end = self.layers
        if not 0 <= start < end:
            raise ValueError(f"layers [{start}, {end}) must satisfy 0 <= start < end")
        if self.dp * self.cp * self.tp != len(self.devices):
            mesh = (f"dp * tp = {self.dp} * {self.tp}" if self.cp == 1
                    else f"dp * cp * tp = {self.dp} * {self.cp} * {self.tp}")
            raise ValueError(f"{mesh} = {self.dp * self.cp * self.tp} but the stage has "
                             f"{len(self.devices)} devices {list(self.devices)[:16]}")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices repeat within a stage: {list(self.devices)}")
        if self.recompute_layers is not None and not self.recompute:
            raise ValueError(f"recompute_layers={self.recompute_layers} needs recompute=true: it says how many "
                             "of the stage's layers recompute")
        if self.batch_samples is not None:
            if self.batch_shares is not None:
                raise ValueError("give batch_samples or batch_shares, not both")
            if len(self.batch_samples) != self.dp:
                raise ValueError(f"batch_samples has {len(self.batch_samples)} entries; dp is {self.dp}")
            if any(n < 1 for n in self.batch_samples):
                raise ValueError(f"batch_samples must be whole samples >= 1 per replica, "
                                 f"got {list(self.batch_samples)}")
        if self.batch_shares is not None:
            shares = self.batch_shares
            if len(shares) != self.dp:
                raise ValueError(f"batch_shares has {len(shares)} entries; dp is {self.dp}")
            if any(s <= 0 for s in shares):
                raise ValueError(f"batch_shares must all be > 0, got {list(shares)}")
            if not math.isclose(sum(shares), 1.0, abs_tol=1e-6):
                raise ValueError(f"batch_shares must sum to 1, got {sum(shares):.6f}")
        return self

    @property
    def num_layers(self) -> int:
        """Number of layers in the stage."""
        return self.layers[1] - self.layers[0]

    def recomputed(self, model: ModelGraph) -> tuple[int, ...]:
        """Indices of the stage's layers that recompute their activations in the backward pass: none without
        recompute, else its checkpointable layers (`ModelGraph.checkpointable`), the first `recompute_layers`
        of them where that is set."""
        if not self.recompute:
            return ()
        layers = model.checkpointable(*self.layers)
        return layers if self.recompute_layers is None else layers[:self.recompute_layers]

    def replica(self, r: int) -> tuple[int, ...]:
        """Devices of data-parallel replica `r` (its cp tensor-parallel groups; one without context parallelism)."""
        width = self.cp * self.tp
        return self.devices[r * width : (r + 1) * width]

    @property
    def dp_cp(self) -> int:
        """Tensor-parallel groups of the stage (dp * cp): the devices that hold the same parameters, over which
        gradients reduce and ZeRO shards (Megatron's data-parallel-with-context-parallel group)."""
        return self.dp * self.cp

    def tp_group(self, g: int) -> tuple[int, ...]:
        """Devices of tensor-parallel group `g` (0 <= g < dp_cp): replica g // cp, context-parallel rank g % cp."""
        return self.tp_groups[g]

    @cached_property
    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every tensor-parallel group's devices, in group order (`tp_group`), sliced once per stage."""
        tp = self.tp
        return tuple(self.devices[g * tp : (g + 1) * tp] for g in range(len(self.devices) // tp))

    def shares(self) -> tuple[float, ...]:
        """Batch share of each replica (from `batch_samples`, `batch_shares`, else even)."""
        if self.batch_samples is not None:
            total = sum(self.batch_samples)
            return tuple(n / total for n in self.batch_samples)
        return self.batch_shares if self.batch_shares is not None else (1.0 / self.dp,) * self.dp

    def replica_samples(self, micro_batch_size: int) -> tuple[int, ...]:
        """Whole samples each replica takes of a micro-batch of `micro_batch_size` samples.

        ValueError unless every replica gets a whole number of samples, at least one: no device
        can run a fraction of a sample.
        """
        if self.batch_samples is not None:
            if sum(self.batch_samples) != micro_batch_size:
                raise ValueError(f"batch_samples {list(self.batch_samples)} sum to {sum(self.batch_samples)}, "
                                 f"not the micro-batch size {micro_batch_size}")
            return self.batch_samples
        even = self.batch_shares is None and micro_batch_size >= self.dp and micro_batch_size % self.dp == 0
        if even:  # even shares, each whole and at least one sample: no rounding
            return (micro_batch_size // self.dp,) * self.dp
        exact = [share * micro_batch_size for share in self.shares()]
        counts = tuple(round(x) for x in exact)
        if any(abs(x - n) > 1e-6 for x, n in zip(exact, counts, strict=True)) or min(counts) < 1:
            shown = ", ".join(f"{x:.3g}" for x in exact[:8])
            raise ValueError(f"a micro-batch of {micro_batch_size} samples gives the {self.dp} replicas {shown} "
                             "samples each; every replica needs a whole number, at least 1 (set batch_samples)")
        return counts


class Plan(Record):
    """A whole parallelization plan (Plan JSON v1)."""

    version: int = Field(default=PLAN_VERSION, ge=1, le=PLAN_VERSION)
    micro_batches: int = Field(default=1, gt=0, description="micro-batches per iteration")
    schedule: Schedule = Schedule.ONE_F_ONE_B
    stages: tuple[Stage, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Plan:
        for i in range(1, len(self.stages)):
            prev, cur = self.stages[i - 1].layers, self.stages[i].layers
            if cur[0] != prev[1]:
                raise ValueError(
                    f"stages[{i}].layers starts at {cur[0]} but stages[{i - 1}] ends at {prev[1]}; "
                    "stages must cover contiguous layer ranges in order"
                )
        groups = [s.devices for s in self.stages]
        if self.schedule is Schedule.INTERLEAVED_1F1B:
            self._check_interleaved(groups)
        else:
            seen: dict[int, int] = {}
            for i, group in enumerate(groups):
                for d in group:
                    if d in seen:
                        raise ValueError(
                            f"device {d} is in stages {seen[d]} and {i}; only the "
                            f"'{Schedule.INTERLEAVED_1F1B.value}' schedule may reuse devices"
                        )
                    seen[d] = i
        return self

    def _check_interleaved(self, groups: list[tuple[int, ...]]) -> None:
        distinct = list(dict.fromkeys(groups))
        chunks, rest = divmod(len(groups), len(distinct))
        pattern = distinct * chunks
        if rest or groups != pattern:
            raise ValueError(
                f"interleaved_1f1b needs the device groups to repeat round-robin "
                f"(g0, g1, ..., g0, g1, ...); got {len(groups)} stages over {len(distinct)} groups"
            )
        flat = [d for g in distinct for d in g]
        if len(set(flat)) != len(flat):
            raise ValueError("interleaved_1f1b: distinct stage groups must not share devices")

    @property
    def devices(self) -> tuple[int, ...]:
        """All devices the plan uses, in stage order, without repeats."""
        return tuple(dict.fromkeys(d for s in self.stages for d in s.devices))


def context_split_whole(seq_len: int, cp: int, tp: int) -> bool:
    """Whether `seq_len` tokens split whole over `cp` context-parallel ranks as Megatron splits them: into
    2 * cp chunks (each rank a mirrored pair, balancing causal attention), each rank's seq_len / cp tokens
    then over `tp` (sequence parallelism)."""
    return seq_len % (2 * cp) == 0 and (seq_len // cp) % tp == 0 if cp > 1 else True


def check_whole_samples(plan: Plan, global_batch: int) -> None:
    """ValueError naming the stage unless `plan` gives every replica whole samples of every micro-batch."""
    if global_batch % plan.micro_batches:
        raise ValueError(f"micro_batches={plan.micro_batches} does not divide the global batch {global_batch}: "
                         "micro-batches would hold fractions of samples")
    micro = global_batch // plan.micro_batches
    for i, stage in enumerate(plan.stages):
        try:
            stage.replica_samples(micro)
        except ValueError as err:
            raise ValueError(f"stages[{i}]: {err}") from None


def check_plan(plan: Plan, model: ModelGraph, cluster: Cluster) -> None:
    """Raise ValueError unless `plan` covers the model's layers exactly and uses real devices."""
    first, last = plan.stages[0].layers[0], plan.stages[-1].layers[1]
    if first != 0 or last != len(model.layers):
        raise ValueError(
            f"plan covers layers [{first}, {last}) but model {model.name!r} has "
            f"{len(model.layers)} layers [0, {len(model.layers)})"
        )
    for i, stage in enumerate(plan.stages):
        if stage.recompute_layers is not None:
            checkpointable = len(model.checkpointable(*stage.layers))
            if stage.recompute_layers > checkpointable:
                start, end = stage.layers
                raise ValueError(f"stages[{i}].recompute_layers = {stage.recompute_layers} but the stage holds "
                                 f"{checkpointable} checkpointable layers (layers [{start}, {end}), embeddings and "
                                 f"heads excluded); accepted: 1..{checkpointable}, or null for all")
    check_devices(plan, cluster)


def check_devices(plan: Plan, cluster: Cluster) -> None:
    """Raise ValueError naming the stage unless every device of `plan` is one of `cluster`'s."""
    n = cluster.num_devices
    for i, stage in enumerate(plan.stages):
        if min(stage.devices) >= 0 and max(stage.devices) < n:
            continue
        bad = [d for d in stage.devices if not 0 <= d < n]
        if bad:
            raise ValueError(
                f"stages[{i}].devices {bad[:8]} are not in cluster {cluster.name!r} "
                f"(0..{cluster.num_devices - 1})"
            )
