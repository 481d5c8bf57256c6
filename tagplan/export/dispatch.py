"""Export a plan to a runnable form: `export(spec, plan, out_dir, fmt=...)` picks the writer.

Formats: `torch` (a self-contained PyTorch program, `tagplan.export.torch_program`), `megatron`
(Megatron-LM `pretrain_gpt.py` arguments, `tagplan.export.megatron`) and `deepspeed` (a DeepSpeed
config and pipeline partition, `tagplan.export.deepspeed`). A format that cannot express the plan
refuses with an `ExportError` (a `SpecError`, so the CLI exits with code 2) naming the stage, the
field and the reason, instead of writing something that would run a different plan.

The shared checks of the two config formats live here too: one (dp, tp) mesh for all stages,
even batch shares, a whole per-replica micro-batch, and device placement in launcher rank order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from tagplan.errors import SpecError, unknown
from tagplan.frontends.model_spec import load_model
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, check_plan

Format = Literal["torch", "megatron", "deepspeed"]
FORMATS: tuple[str, ...] = ("torch", "megatron", "deepspeed")


class _FallbackExportError(SpecError):
    """Stand-in for `tagplan.export.torch_program.ExportError` while that module cannot be imported."""


def export_error() -> type[SpecError]:
    """The `ExportError` class: the one `tagplan.export.torch_program` defines, imported on demand
    (that module may import torch), or a local `SpecError` subclass when it cannot be imported."""
    try:
        from tagplan.export.torch_program import ExportError
    except ImportError:
        return _FallbackExportError
    return ExportError


def refuse(fmt: str, message: str) -> SpecError:
    """An ExportError saying that format `fmt` cannot express the plan, and why."""
    return export_error()(f"{fmt}: {message}")


def export(model_spec: str, plan: Plan, out_dir: Path, *, fmt: Format, seq_len: int | None, global_batch: int,
           cluster: Cluster | None = None) -> list[Path]:
    """Write `plan` for `model_spec` in format `fmt` under `out_dir`; returns the paths written.

    The model is loaded at `seq_len` (None: its own) and the plan checked against it (and against
    `cluster`'s devices when given) before any file is written. ExportError when the format cannot
    express the plan; SpecError for bad input.
    """
    if fmt not in FORMATS:
        raise unknown("export format", str(fmt), list(FORMATS))
    if global_batch <= 0:
        raise SpecError(f"global_batch={global_batch}: must be a positive number of samples")
    model = load_model(model_spec, seq_len=seq_len)
    validate(plan, model, cluster)
    seq = model.seq_len
    if fmt == "torch":
        from tagplan.export.torch_program import write_torch_program

        train = write_torch_program(model_spec, plan, out_dir, seq_len=seq, global_batch=global_batch)
        return [train, train.with_name("plan.json")]
    if fmt == "megatron":
        from tagplan.export.megatron import model_config_from_spec, write_megatron

        config = model_config_from_spec(model_spec)
        return write_megatron(model, plan, out_dir, global_batch=global_batch, seq_len=seq, model_config=config)
    from tagplan.export.deepspeed import write_deepspeed

    return write_deepspeed(model, plan, out_dir, global_batch=global_batch, seq_len=seq)


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


def uniform_mesh(plan: Plan, fmt: str, why: str) -> tuple[int, int]:
    """The (dp, tp) every stage shares; ExportError naming the first stage that differs or that
    splits its batch unevenly. `why` says what the format supports instead."""
    first = plan.stages[0]
    for i, stage in enumerate(plan.stages):
        for field, value, expected in (("tp", stage.tp, first.tp), ("dp", stage.dp, first.dp)):
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
                          "be a whole number of samples")
    return global_batch // per_step


def check_rank_order(plan: Plan, groups: Sequence[tuple[int, ...]], *, tp: int, fmt: str, launcher: str) -> None:
    """ExportError unless pipeline rank `p`'s devices are the launcher ranks `[p*n, (p+1)*n)` with
    each tensor-parallel group a contiguous aligned block of `tp` ranks (`groups`: one per pipeline
    rank). Order inside a group does not matter; which devices run which stage does."""
    n = len(groups[0])
    for p, group in enumerate(groups):
        expected = set(range(p * n, (p + 1) * n))
        if set(group) != expected:
            raise refuse(fmt, f"pipeline rank {p} runs on devices {sorted(group)[:16]} but {launcher} gives it "
                              f"ranks {p * n}..{(p + 1) * n - 1}; order the plan's stages by device, or launch "
                              "with a host order that maps these devices to those ranks")
        stage = plan.stages[p]
        for r in range(stage.dp):
            block = {d // tp for d in stage.replica(r)}
            if len(block) != 1:
                raise refuse(fmt, f"stages[{p}] replica {r} (devices {list(stage.replica(r))}) is not one aligned "
                                  f"block of {tp} consecutive ranks, as {launcher} forms tensor-parallel groups")
