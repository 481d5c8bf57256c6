"""Which plans an export format runs: `exportable(plan, fmt)`, for the planner's `--exportable`.

The search asks it of every candidate, so the plan-only checks are cheap and import no torch: the
formats' own refusals (`megatron.plan_checks`, `deepspeed.plan_checks`) and the whole-sample rule
(`ir.plan.check_whole_samples`) when the global batch is given. The torch program runs every
(dp, tp) per stage, split and schedule; with a model the model-dependent checks run too (the
torch program's per-op strategies and heads, `torch_checks`, which import no torch except to
instantiate a user's module; Megatron's layer counts and shapes; DeepSpeed's partition).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.cost.simulator import ReduceOverlap, Simulator
from tagplan.errors import SpecError
from tagplan.export import deepspeed, megatron
from tagplan.export.checks import exported_loss
from tagplan.frontends.model_spec import ModelSpec, ModelSpecKind
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, check_devices, check_whole_samples
from tagplan.ir.workload import SIXTEEN_BIT, DType, Workload
from tagplan.search.result import PlanResult

Target = Literal["torch", "megatron", "deepspeed"]
TARGETS: tuple[str, ...] = ("torch", "megatron", "deepspeed")


OWN_MODULE_FAMILIES = ("gpt", "llama", "moe")
"""The families the torch program builds from its own modules (zoo and family SPECs), whose SwiGLU is fused;
Hugging Face and user SPECs run their own classes."""


def builds_own_modules(spec: ModelSpec | None) -> bool:
    """Whether the torch program runs `spec` as its own modules (`OWN_MODULE_FAMILIES`), not as the
    transformers class or the user's module."""
    return (spec is not None and spec.kind in (ModelSpecKind.ZOO, ModelSpecKind.FAMILY)
            and spec.family in OWN_MODULE_FAMILIES)


def runtime_workload(fmt: Target | str, workload: Workload, spec: ModelSpec | None = None) -> Workload:
    """`workload` as format `fmt`'s runtime runs it, where the user left it open (`grad_reduce_dtype`
    None): the torch program computes under autocast over fp32 master weights, so its gradients cross
    the data-parallel group in fp32; Megatron forces `--accumulate-allreduce-grads-in-fp32` with bf16
    (which its fp8 runs also set).
    DeepSpeed reduces in the compute dtype unless its config sets `communication_data_type` (the
    exporter writes it, and the older `fp32_allreduce`, from `grad_reduce_dtype`).
    Where `fused_attention` is open, the torch program's attention (scaled_dot_product_attention) is
    fused on every device; Megatron and DeepSpeed keep each device's own (materialised before sm80).
    Only Megatron-Core overlaps tensor-parallel collectives with compute (`tp_comm_overlap`, its
    `--tp-comm-overlap`): the torch program and DeepSpeed are costed with every TP collective exposed.
    Megatron-Core fuses the gated MLP's activation (`fused_activation`), and so does the torch program
    where it builds the model `spec` from its own modules (`builds_own_modules`); Hugging Face classes,
    user modules and DeepSpeed (which runs the user's model) keep each op's inputs.
    The torch program runs its PyTorch modules op by op under autocast over fp32 weights (`eager`, not
    `eager_16bit_weights`: the host issues each op's eager kernels, casts included); Megatron-Core's fused
    kernels are costed one kernel per op (never eager), and DeepSpeed, which runs the user's own modules, as the
    workload says (`--eager 16bit-weights` describes its bf16 and fp16 engines over eager modules).
    The loss (`loss`, `exported_loss`): Megatron-Core runs its own cross-entropy, the in-place one, or Transformer
    Engine's fused one where the workload asks for a fused loss (the exporter then writes
    `--cross-entropy-loss-fusion --cross-entropy-fusion-impl te`); the torch program runs its own fused loss
    where asked (`runtime_loss.FusedCrossEntropy`), else PyTorch's eager one; DeepSpeed the model's own, eager.
    DeepSpeed's pipeline engine keeps each micro-batch's received input and stage output until its backward, and
    its last stage the previous micro-batch's logits too (`keeps_stage_outputs`).
    ExportError (a SpecError) for a `grad_reduce_dtype` the target cannot reduce in."""
    if fmt not in TARGETS:
        raise ValueError(f"unknown export format {fmt!r}; accepted: {', '.join(TARGETS)}")
    if fmt == "megatron":  # a reduction the target cannot run is refused before any search
        megatron.reduce_dtype_args(workload.dtype, workload.grad_reduce_dtype)
    elif fmt == "torch":
        from tagplan.export.torch_checks import check_reduce_dtype_of

        check_reduce_dtype_of(workload.dtype, workload.grad_reduce_dtype)
    sixteen = workload.dtype in SIXTEEN_BIT
    bf16_run = workload.dtype is DType.BF16 or workload.dtype.quantized  # Megatron's --bf16 runs
    fp32 = (fmt == "torch" and sixteen) or (fmt == "megatron" and bf16_run)
    update: dict[str, object] = {}
    if workload.grad_reduce_dtype is None and fp32:
        update["grad_reduce_dtype"] = DType.FP32
    if fmt == "torch" and workload.fused_attention is None:  # SDPA's memory-efficient kernel from sm50
        update["fused_attention"] = True
    if fmt != "megatron" and workload.tp_comm_overlap:
        update["tp_comm_overlap"] = False
    if fmt == "torch" and (not workload.eager or workload.eager_16bit_weights):  # its modules op by op under
        update["eager"], update["eager_16bit_weights"] = True, False  # autocast over fp32 weights, whatever was asked
    if fmt == "megatron" and workload.eager:  # Megatron-Core's fused kernels, whatever was asked
        update["eager"], update["eager_16bit_weights"] = False, False
    fused = fmt == "megatron" or (fmt == "torch" and builds_own_modules(spec))  # bias_swiglu_impl; _GatedProduct
    if fused and not workload.fused_activation:
        update["fused_activation"] = True
    if (loss := exported_loss(fmt, workload.loss)) is not workload.loss:
        update["loss"] = loss
    if fmt == "deepspeed" and not workload.keeps_stage_outputs:  # its pipeline engine's pipe_buffers['outputs']
        update["keeps_stage_outputs"] = True
    return workload.model_copy(update=update) if update else workload


def reduce_overlap(fmt: Target | str, workload: Workload, cluster: Cluster | None = None) -> ReduceOverlap | None:
    """Format `fmt`'s rule for which stages reduce gradients while their backward runs, for the
    simulator to cost plans as that runtime runs them (None: `workload.grad_reduce_overlap` for all).

    Megatron overlaps as its arguments say, which the exporter writes from the workload: None.
    DeepSpeed overlaps only where the workload asks and it can (`deepspeed.can_overlap`). The torch
    program's runtimes decide for themselves (`torch_program.reduce_overlaps` on the runtime
    `cluster`'s rank table selects): FSDP2/replicate hooks overlap, its pipelines reduce after the flush.
    """
    if fmt not in TARGETS:
        raise ValueError(f"unknown export format {fmt!r}; accepted: {', '.join(TARGETS)}")
    if fmt == "megatron":
        return None
    if fmt == "deepspeed":
        wanted = workload.grad_reduce_overlap
        return lambda plan: dict.fromkeys(range(len(plan.stages)), wanted and deepspeed.can_overlap(plan))

    def torch_rule(plan: Plan) -> dict[int, bool]:
        from tagplan.export.torch_program import reduce_overlaps, runtime_on  # imports torch

        return reduce_overlaps(plan, runtime_on(plan, cluster))

    return torch_rule


def exportable(plan: Plan, fmt: str, model: ModelGraph | None = None, *, global_batch: int | None = None,
               spec: ModelSpec | None = None, cluster: Cluster | None = None,
               tp_comm_overlap: bool = False, dtype: DType | None = None) -> str | None:
    """None when format `fmt` can run `plan`, else the reason (naming the stage and the field).

    Without `model` only what the plan alone decides is checked; `global_batch` adds the
    whole-sample rule (every replica a whole number of samples, at least one, per micro-batch).
    `spec` (the model's SPEC) lets the torch check build Hugging Face classes and user modules
    (`torch_checks.torch_config`); without it only the gpt and llama families pass. `cluster`: the
    launch on its nodes in the format's rank order (Megatron-LM and DeepSpeed number ranks stage by
    stage, so without it the first stage's devices must be devices 0..n-1) and, with `tp_comm_overlap`
    (the plan costed so), where Megatron's `--tp-comm-overlap` runs (`megatron.tp_overlap_refusal`).
    `dtype` (the workload's): whether the format computes in it on the plan's devices (the torch program no
    quantized recipe; Transformer Engine's fp8 only on GPUs with fp8 tensor cores).
    ValueError for an unknown format.
    """
    if fmt not in TARGETS:
        raise ValueError(f"unknown export format {fmt!r}; accepted: {', '.join(TARGETS)}")
    try:
        if global_batch is not None:
            check_whole_samples(plan, global_batch)
        if cluster is not None:  # the rank order reads the plan's devices off the cluster
            check_devices(plan, cluster)
        if fmt == "megatron":  # with a model, the arguments run every plan check too
            if model is None:
                megatron.plan_checks(plan, cluster, tp_comm_overlap=tp_comm_overlap)
            else:
                megatron.megatron_arguments(model, plan, global_batch=global_batch or _batch(plan),
                                            seq_len=model.seq_len, cluster=cluster, tp_comm_overlap=tp_comm_overlap)
        elif fmt == "deepspeed":
            if model is None:
                deepspeed.plan_checks(plan, cluster)
            else:
                deepspeed.deepspeed_config(model, plan, global_batch=global_batch or _batch(plan),
                                           seq_len=model.seq_len, cluster=cluster)
        else:
            from tagplan.export.torch_checks import check_dtype, check_expressible, check_sequence_split, torch_config

            if dtype is not None:
                check_dtype(dtype)
            if model is not None:
                config = torch_config(spec, seq_len=model.seq_len) if spec is not None else None
                check_expressible(plan, model, config=config)
                check_sequence_split(plan, model, seq_len=model.seq_len)
    except (SpecError, ValueError) as err:
        return str(err)
    return None


def model_refusal(fmt: str, model: ModelGraph, spec: ModelSpec | None = None,
                  cluster: Cluster | None = None) -> str | None:
    """Why format `fmt` runs no plan of `model` at all (the model families it builds, its dtype; with the
    `cluster`, a quantized dtype none of its GPUs has the tensor cores for under Megatron), else None: what
    `plan --exportable` checks before it searches, so that a model no plan of which can run is refused at
    once, not after a search that admits nothing. `spec` as in `exportable`. ValueError for an unknown format."""
    if fmt not in TARGETS:
        raise ValueError(f"unknown export format {fmt!r}; accepted: {', '.join(TARGETS)}")
    if fmt == "megatron":
        why = megatron.model_refusal(model)
        if why is None and cluster is not None:
            why = megatron.cluster_quantized_refusal(cluster, model.dtype)
        return why
    if fmt == "torch":
        from tagplan.export.torch_checks import check_dtype
        from tagplan.export.torch_checks import model_refusal as torch_refusal

        try:
            check_dtype(model.dtype)
        except SpecError as err:
            return str(err)
        return torch_refusal(model, spec)
    if model.dtype.quantized:  # DeepSpeed's config describes the parallelism, not the model: only its dtype counts
        return (f"dtype {model.dtype.value}: DeepSpeed's config has no quantized GEMMs; accepted: bf16, fp16, fp32 "
                "(or --format megatron, whose Transformer Engine runs them)")
    return None


def verdicts(plan: Plan, model: ModelGraph, workload: Workload, *,
             spec: ModelSpec | None = None, cluster: Cluster | None = None) -> dict[str, str | None]:
    """For each export format, None when it runs `plan` for `workload`, else why not: its runtime's
    refusal of the workload (`runtime_workload`: a gradient reduction it cannot run), then `exportable`
    with the model. What a plan result reports, so no plan is shown as runnable without saying by
    which runtime."""
    out: dict[str, str | None] = {}
    for fmt in TARGETS:
        try:
            runtime_workload(fmt, workload)
        except SpecError as err:
            out[fmt] = str(err)
            continue
        out[fmt] = exportable(plan, fmt, model, global_batch=workload.global_batch, spec=spec, cluster=cluster,
                              tp_comm_overlap=workload.tp_comm_overlap, dtype=workload.dtype)
    return out


def with_verdicts(result: PlanResult, model: ModelGraph, workload: Workload, *, spec: ModelSpec | None = None,
                  cluster: Cluster | None = None, refusals: dict[str, str] | None = None,
                  calibration: Calibration = DEFAULT_CALIBRATION, exportable_option: str | None = None) -> PlanResult:
    """`result` with every plan it reports judged by each export format (`verdicts`): the best plan,
    each plan of the frontier and each baseline's plan, so that none is shown as runnable without
    saying by which runtime, or why none runs it. With the `cluster`, a format that expresses a plan
    also has to fit it in memory as its runtime runs it (`runtime_workload`: e.g. the torch program's
    fp32 master weights and eager activations), else its verdict says by how much it does not.
    `refusals` override a format's verdict on all of them (the service's inline graph, which the torch
    program cannot build). Where no format runs the best plan, a note names the fastest reported plan one does
    (`runnable_note`; `exportable_option`: the option that asks the search for a format's plans, e.g. the CLI's
    --exportable)."""
    seen: dict[str, dict[str, str | None]] = {}
    sims: dict[str, Simulator] = {}

    def memory(plan: Plan, fmt: str) -> str | None:
        if cluster is None:
            return None
        if fmt not in sims:
            sims[fmt] = Simulator(model, cluster, runtime_workload(fmt, workload, spec), calibration=calibration)
        return memory_refusal(plan, fmt, sims[fmt])

    def judge(plan: Plan) -> dict[str, str | None]:
        key = plan.model_dump_json()
        if key not in seen:
            found = {**verdicts(plan, model, workload, spec=spec, cluster=cluster), **(refusals or {})}
            seen[key] = {fmt: why if why is not None else memory(plan, fmt) for fmt, why in found.items()}
        return seen[key]

    judged = replace(result, exporters=judge(result.best.plan),
                     pareto_exporters=tuple(judge(c.plan) for c in result.pareto),
                     baseline_exporters={name: judge(b.candidate.plan) for name, b in result.baselines.items()
                                         if b.candidate is not None})
    note = runnable_note(judged, exportable_option)
    return replace(judged, notes=(*judged.notes, note)) if note else judged


def runnable_note(result: PlanResult, exportable_option: str | None = None) -> str | None:
    """Where no format runs the best plan: the fastest reported plan (frontier or baseline) that one does, and,
    given the option that asks for it, how to search for the fastest plan a format runs (None: a format runs
    the best plan, or none was judged)."""
    if not result.exporters or any(why is None for why in result.exporters.values()):
        return None
    reported = [(f"pareto {i}", c, e) for i, (c, e) in enumerate(zip(result.pareto, result.pareto_exporters,
                                                                     strict=False))]
    reported += [(name, b.candidate, result.baseline_exporters[name]) for name, b in result.baselines.items()
                 if b.candidate is not None and name in result.baseline_exporters]
    runnable = [(c.report.iteration_time_s, name, [fmt for fmt, why in e.items() if why is None])
                for name, c, e in reported if c.report.fits and any(why is None for why in e.values())]
    if not runnable:
        return (f"no reported plan runs under {', '.join(result.exporters)}"
                + (f"; {exportable_option} FORMAT searches only the plans a format runs" if exportable_option else ""))
    time_s, name, runs = min(runnable)
    return (f"the fastest reported plan a format runs is {name}: {time_s:.4g} s as costed here "
            f"({time_s / result.best.report.iteration_time_s:.2f}x the best), under {', '.join(runs)}"
            + (f"; {exportable_option} {runs[0]} searches for the fastest plan {runs[0]} runs, costed as its "
               "runtime runs it" if exportable_option else ""))


def _batch(plan: Plan) -> int:
    """A global batch the model-dependent checks accept when none is given: one sample per replica."""
    return plan.micro_batches * plan.stages[0].dp


def memory_refusal(plan: Plan, fmt: str, sim: Simulator) -> str | None:
    """Why format `fmt`'s runtime runs out of memory on `plan` (None: it fits), `sim` costing the workload as that
    runtime runs it (`runtime_workload`): the most committed device, its need and its memory."""
    if sim.fits(plan):
        return None
    used = sim.memory_bytes(plan)
    devices = sim.cluster.devices
    device = max(used, key=lambda d: used[d] / devices[d].spec.mem_bytes)
    return (f"{fmt}: the plan does not fit in memory as this runtime runs it: {used[device] / 2**30:.1f} GiB on "
            f"device {device} of {devices[device].spec.mem_bytes / 2**30:.1f} GiB")
