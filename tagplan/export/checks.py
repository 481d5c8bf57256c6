"""The checks every export format shares, and `ExportError`, the refusal they raise.

A format that cannot express a plan refuses with an `ExportError` (a `SpecError`, so the CLI
exits with code 2) naming the stage, the field and the reason, instead of writing something that
would run a different plan. Shared here: the plan covers the model (and the cluster's devices),
one (dp, tp) mesh for all stages with even batch shares, a whole per-replica micro-batch, and
device placement in launcher rank order; and `GradReduce`, how each format's files reduce the
data-parallel gradients (`Workload.grad_reduce_dtype` and `grad_reduce_overlap` as written). This
module imports no other export module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tagplan.cost.sharding import sharding_problem
from tagplan.errors import SpecError, unknown
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, check_plan
from tagplan.ir.workload import REDUCE_DTYPES, DType, LossKernel


class ExportError(SpecError):
    """A plan (or model) an export format cannot express; the message says what and why."""


def refuse(fmt: str, message: str) -> ExportError:
    """An ExportError saying that format `fmt` cannot express the plan, and why."""
    return ExportError(f"{fmt}: {message}")


def reduce_dtype_note(fmt: str, dtype: DType, grad_reduce_dtype: DType | None, runs: DType, hint: str) -> str | None:
    """A note where the exported run reduces gradients in `runs` while the plan was costed with `grad_reduce_dtype`
    (None: the training `dtype`, as `plan` and `simulate` cost it by default), in a dtype of another width: the
    reduction moves that many times the bytes, and the run is slower or faster than predicted where it is exposed."""
    costed = grad_reduce_dtype or dtype
    if costed.nbytes == runs.nbytes:
        return None
    default = " (the default: the training dtype)" if grad_reduce_dtype is None else ""
    ratio = runs.nbytes / costed.nbytes
    way = f"{ratio:g}x the bytes: slower" if ratio > 1 else f"{ratio:g}x the bytes: faster"
    said = "16 bits" if costed.quantized else costed.value  # a quantized recipe keeps its gradients in 16 bits
    return (f"the plan was costed with gradients reduced in {said}{default}; {fmt} reduces them in "
            f"{runs.value}, {way} than predicted where the reduction is exposed. {hint}")


@dataclass(frozen=True)
class GradReduce:
    """How an export's files make the run reduce its data-parallel gradients.

    `dtype`: what the gradients cross the data-parallel group in (the runtime's own choice where the
    plan was costed with `grad_reduce_dtype` None); `overlap`: whether every such reduction runs
    while the backward does (None: no stage has dp > 1, nothing is reduced); `written`: the settings
    written for them (config keys as `key: value`, or flags); `notes`: where the run's reduction
    differs from the settings given (slower or faster than a costing with them), for people (the
    files carry them too).
    """

    dtype: DType
    overlap: bool | None
    written: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The record as JSON-ready values (dtype by name)."""
        return {"dtype": self.dtype.value, "overlap": self.overlap, "written": list(self.written),
                "notes": list(self.notes)}


def check_reduce_dtype(value: DType | None) -> None:
    """SpecError unless `value` is None or a dtype gradients are reduced in (`ir.workload.REDUCE_DTYPES`)."""
    if value is not None and value not in REDUCE_DTYPES:
        raise unknown("grad_reduce_dtype", value.value, [d.value for d in REDUCE_DTYPES])


def validate(plan: Plan, model: ModelGraph, cluster: Cluster | None = None) -> None:
    """SpecError unless `plan` covers `model`'s layers exactly (and uses `cluster`'s devices)."""
    try:
        if cluster is not None:
            check_plan(plan, model, cluster)
        first, last = plan.stages[0].layers[0], plan.stages[-1].layers[1]
        if first != 0 or last != len(model.layers):
            raise ValueError(f"plan covers layers [{first}, {last}) but model {model.name!r} has "
                             f"{len(model.layers)} layers [0, {len(model.layers)})")
    except ValueError as exc:
        raise SpecError(f"plan: {exc}") from None
    if (problem := sharding_problem(plan, model)) is not None:
        raise SpecError(f"plan: {problem}")


def uniform_mesh(plan: Plan, fmt: str, why: str) -> tuple[int, int]:
    """The (dp, tp) every stage shares; ExportError naming the first stage that differs or that
    splits its batch unevenly. `why` says what the format supports instead."""
    first = plan.stages[0]
    for i, stage in enumerate(plan.stages):
        for field, value, expected in (("tp", stage.tp, first.tp), ("cp", stage.cp, first.cp),
                                       ("dp", stage.dp, first.dp)):
            if value != expected:
                raise refuse(fmt, f"stages[{i}].{field} = {value} but stages[0].{field} = {expected}; {why}")
        shares = stage.shares()
        if max(shares) - min(shares) > 1e-9:
            raise refuse(fmt, f"stages[{i}].batch_shares = {[round(s, 4) for s in shares]} are uneven; every "
                              "data-parallel replica gets the same micro-batch size in this format")
    return first.dp, first.tp


def micro_batch_size(plan: Plan, global_batch: int, dp: int, fmt: str) -> int:
    """Samples per micro-batch per data-parallel replica; ExportError unless it is a whole number."""
    per_step = plan.micro_batches * dp
    if global_batch % per_step:
        raise refuse(fmt, f"global batch {global_batch} is not divisible by micro_batches * dp = "
                          f"{plan.micro_batches} * {dp} = {per_step}; the per-replica micro-batch size must "
                          "be a whole number of samples (give the global batch the plan was searched for)")
    return global_batch // per_step


def check_rank_order(plan: Plan, groups: Sequence[tuple[int, ...]], *, tp: int, fmt: str, launcher: str,
                     cluster: Cluster | None = None) -> tuple[int, ...]:
    """The plan's devices in `launcher`'s world-rank order (rank i runs device `[i]`); ExportError
    where no launch gives them that order. `groups`: one device group per pipeline rank.

    The launcher numbers ranks tensor-parallel fastest, then context-parallel, then data-parallel, then
    pipeline: pipeline rank p's tensor-parallel group g holds ranks `p*n + g*tp ..` (`Stage.tp_group`).
    Without `cluster` the plan runs with device d as rank d, so pipeline rank p's devices must be ranks `[p*n,
    (p+1)*n)` (order inside a group does not matter) and each tensor-parallel group an aligned block of `tp`.
    With `cluster`, nodes are launched in the order their devices first appear
    (`node_launch.fixed_rank_table`): torchrun gives each node one contiguous range of ranks, so each node's
    devices must follow one another in that order (a stage may start on any node, as the heterogeneous plans'
    fastest nodes often do).
    """
    n = len(groups[0])
    if cluster is None:
        for p, group in enumerate(groups):
            expected = set(range(p * n, (p + 1) * n))
            if set(group) != expected:
                raise refuse(fmt, f"pipeline rank {p} runs on devices {sorted(group)[:16]} but {launcher} gives it "
                                  f"ranks {p * n}..{(p + 1) * n - 1}; order the plan's stages by device, or export "
                                  "with the cluster (--cluster), which launches the nodes in the plan's order")
            stage = plan.stages[p]
            for g in range(stage.dp_cp):
                block = {d // tp for d in stage.tp_group(g)}
                if len(block) != 1:
                    raise refuse(fmt, f"stages[{p}] tensor-parallel group {g} (devices {list(stage.tp_group(g))}) is "
                                      f"not one aligned block of {tp} consecutive ranks, as {launcher} forms "
                                      "tensor-parallel groups")
        return tuple(range(n * len(groups)))
    ranked = tuple(d for p in range(len(groups)) for r in range(plan.stages[p].dp) for d in plan.stages[p].replica(r))
    done: list[int] = []
    for i, d in enumerate(ranked):
        node = cluster.device(d).node
        if done and done[-1] == node:
            continue
        if node in done:
            first = next(j for j, e in enumerate(ranked) if cluster.device(e).node == node)
            raise refuse(fmt, f"{launcher} would run world ranks {first} (device {ranked[first]}) and {i} (device "
                              f"{d}) on node {cluster.nodes[node].name!r} with ranks of another node between "
                              "them, but torchrun gives each node one contiguous range of ranks; place each "
                              "node's devices in consecutive ranks (consecutive replicas, or neighbouring "
                              "pipeline stages)")
        done.append(node)
    return ranked


def exported_loss(fmt: str, loss: LossKernel) -> LossKernel:
    """The cross-entropy format `fmt`'s runtime runs for a plan costed with `loss`: Megatron-Core its own (in-place),
    or Transformer Engine's fused kernel where `loss` is fused (the exporter writes it); the torch program its fused
    one where `loss` is fused, else PyTorch's eager one; DeepSpeed the model's own, eager."""
    if loss is LossKernel.FUSED and fmt in ("megatron", "torch"):
        return LossKernel.FUSED
    return LossKernel.IN_PLACE if fmt == "megatron" else LossKernel.EAGER
