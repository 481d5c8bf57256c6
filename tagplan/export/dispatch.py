"""Export a plan to a runnable form: `export(spec, plan, out_dir, fmt=...)` picks the writer.

Formats: `torch` (a self-contained PyTorch program, `tagplan.export.torch_program`), `megatron`
(Megatron-LM `pretrain_gpt.py` arguments, `tagplan.export.megatron`) and `deepspeed` (a DeepSpeed
config and pipeline partition, `tagplan.export.deepspeed`). A format that cannot express the plan
refuses with an `ExportError` (`tagplan.export.checks`: a `SpecError`, so the CLI exits with code
2) naming the stage, the field and the reason, instead of writing something that would run a
different plan. The torch writer is imported on first use: it imports torch.

The gradient reduction the plan was costed with (`Workload.grad_reduce_dtype`, `grad_reduce_overlap`)
is written as each format's runtime takes it; `grad_reduce_settings` says what was written and
where the run will differ from the costing (`checks.GradReduce`). Tensor-parallel collectives
costed as overlapped with compute (`Workload.tp_comm_overlap`) are written for Megatron-LM
(`--tp-comm-overlap`); the torch program runs them exposed, which `tp_comm_settings` says (slower
than predicted, as for a gradient reduction costed overlapped that a runtime does not overlap).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from tagplan.errors import SpecError, unknown
from tagplan.export import deepspeed, megatron
from tagplan.export.checks import GradReduce, check_reduce_dtype, validate
from tagplan.export.deepspeed import write_deepspeed
from tagplan.export.megatron import model_config_from_spec, write_megatron
from tagplan.export.shapes import parsed
from tagplan.frontends.model_spec import ModelSpec, build_model
from tagplan.ir.cluster import Cluster
from tagplan.ir.plan import Plan
from tagplan.ir.workload import LOSS_KERNEL_TEXT, DType, LossKernel, Optimizer

Format = Literal["torch", "megatron", "deepspeed"]
FORMATS: tuple[str, ...] = ("torch", "megatron", "deepspeed")


def export(model_spec: str | ModelSpec, plan: Plan, out_dir: Path, *, fmt: Format, seq_len: int | None,
           global_batch: int, cluster: Cluster | None = None, dtype: DType = DType.BF16,
           optimizer: Optimizer = Optimizer.ADAM, grad_reduce_dtype: DType | None = None,
           grad_reduce_overlap: bool = True, tp_comm_overlap: bool = False,
           loss: LossKernel = LossKernel.EAGER) -> list[Path]:
    """Write `plan` for `model_spec` (a SPEC string or a parsed ModelSpec) in format `fmt` under
    `out_dir`; returns the paths written.

    The model is built at `seq_len` (None: its own) and the plan checked against it (and against
    `cluster`'s devices when given) before any file is written; `cluster` also launches each
    format on the plan's nodes in its rank order (whichever node holds the first stage) and names
    their GPU types. `dtype`, `optimizer`, `grad_reduce_dtype` (None: the
    runtime's own), `grad_reduce_overlap`, `tp_comm_overlap` and `loss`: as the plan was costed
    (`grad_reduce_settings`, `tp_comm_settings` and `loss_settings` say how they were written). ExportError when the
    format cannot express the plan; SpecError for bad input.
    """
    if fmt not in FORMATS:
        raise unknown("export format", str(fmt), list(FORMATS))
    if global_batch <= 0:
        raise SpecError(f"global_batch={global_batch}: must be a positive number of samples")
    check_reduce_dtype(grad_reduce_dtype)
    spec = parsed(model_spec)
    model = build_model(spec, seq_len=seq_len, dtype=dtype)
    validate(plan, model, cluster)
    seq = model.seq_len
    if fmt == "torch":
        from tagplan.export.torch_program import write_torch_program  # imports torch

        train = write_torch_program(model_spec, plan, out_dir, seq_len=seq, global_batch=global_batch,
                                    cluster=cluster, dtype=dtype, optimizer=optimizer,
                                    grad_reduce_dtype=grad_reduce_dtype, grad_reduce_overlap=grad_reduce_overlap,
                                    loss=loss)
        return [train, train.with_name("plan.json"), *sorted(out_dir.glob("launch_node*.sh"))]
    if fmt == "megatron":
        config = model_config_from_spec(spec)
        return write_megatron(model, plan, out_dir, global_batch=global_batch, seq_len=seq, model_config=config,
                              grad_reduce_dtype=grad_reduce_dtype, grad_reduce_overlap=grad_reduce_overlap,
                              tp_comm_overlap=tp_comm_overlap, loss=loss, cluster=cluster)
    return write_deepspeed(model, plan, out_dir, global_batch=global_batch, seq_len=seq,
                           grad_reduce_dtype=grad_reduce_dtype, grad_reduce_overlap=grad_reduce_overlap,
                           cluster=cluster)


def grad_reduce_settings(plan: Plan, *, fmt: Format, dtype: DType = DType.BF16, cluster: Cluster | None = None,
                         grad_reduce_dtype: DType | None = None, grad_reduce_overlap: bool = True) -> GradReduce:
    """How `export` (same arguments) makes the run reduce gradients in format `fmt`: the dtype and
    overlap as the runtime runs them, the settings written and notes where the run will be slower
    than the costing. For a plan `export` accepted; ExportError where it refuses the reduction."""
    if fmt not in FORMATS:
        raise unknown("export format", str(fmt), list(FORMATS))
    if fmt == "torch":
        from tagplan.export.torch_program import grad_reduce, runtime_on  # imports torch

        return grad_reduce(plan, runtime_on(plan, cluster), dtype=dtype, grad_reduce_dtype=grad_reduce_dtype,
                           grad_reduce_overlap=grad_reduce_overlap)
    writer = megatron if fmt == "megatron" else deepspeed
    return writer.grad_reduce(plan, dtype, grad_reduce_dtype=grad_reduce_dtype, grad_reduce_overlap=grad_reduce_overlap)


def loss_settings(*, fmt: Format, loss: LossKernel) -> dict[str, object]:
    """How `export` (same arguments) makes the run's cross-entropy relate to the costing (`Workload.loss`):
    `runs` the loss the runtime runs (`capability.runtime_workload`'s), `fused_written` when a fused loss was
    written (Megatron-LM's Transformer Engine flags, the torch program's own); `notes` where the run keeps more
    than was costed. JSON-ready."""
    from tagplan.export.checks import exported_loss

    if fmt not in FORMATS:
        raise unknown("export format", str(fmt), list(FORMATS))
    runs = exported_loss(fmt, loss)
    notes = [] if runs is loss or runs is LossKernel.IN_PLACE else [  # Megatron-Core's in-place keeps less than eager
        f"the plan was costed with the {loss.value} cross-entropy (--loss {loss.value}); the {fmt} runtime runs the "
        f"{runs.value} one ({LOSS_KERNEL_TEXT[runs]}), which keeps more memory on the stage holding the head (plan "
        f"--exportable {fmt} costs it as {fmt} runs it)"]
    return {"runs": runs.value, "fused_written": runs is LossKernel.FUSED, "notes": notes}


def tp_comm_settings(plan: Plan, *, fmt: Format, tp_comm_overlap: bool) -> dict[str, object]:
    """How `export` (same arguments) makes the run's tensor-parallel collectives relate to the
    costing: `overlapped` when Megatron-LM's `--tp-comm-overlap` was written (costed so, tp > 1);
    `notes` where the run differs from a costing that overlapped them (only Megatron-LM overlaps them;
    the other runtimes run them exposed, slower than predicted). JSON-ready."""
    if fmt not in FORMATS:
        raise unknown("export format", str(fmt), list(FORMATS))
    split = any(s.tp > 1 for s in plan.stages)
    overlapped = tp_comm_overlap and split and fmt == "megatron"
    notes = [] if overlapped or not (tp_comm_overlap and split) else [
        f"the plan was costed with its tensor-parallel collectives overlapped with compute (--tp-comm-overlap), "
        f"which only Megatron-LM runs; the {fmt} runtime runs them exposed, so the run will be slower than "
        f"predicted (plan --exportable {fmt} costs them as {fmt} runs them)"]
    return {"overlapped": overlapped, "notes": notes}
