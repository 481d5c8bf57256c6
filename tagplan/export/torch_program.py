"""Export a Plan as a runnable PyTorch program: `train.py`, `plan.json` and one launch script per node.

`train.py` is `tagplan/export/runtime_train.py` copied verbatim (read it: it is the program; the
layers and their parallelization it imports from `tagplan.export.modules`, `runtime_parallel` and
`runtime_pipeline`); `plan.json` carries what it reads: the model SPEC, the workload (batch,
sequence, dtype, optimizer), the rank table (`tagplan.export.node_launch`), the runtime and per
stage its layers, pipeline rank, recompute flag, ZeRO stage and the tensor-parallel strategy of
every matmul and embedding (tagplan's Megatron defaults overridden by the stage's `sharding`,
resolved here so the program needs no cost model). `launch_node{k}.sh` starts node rank k.

Runtimes (`runtime_for`): plans whose stages share one (dp, tp) with even shares, whose ranks are in
the plan's device order and whose schedule torch.distributed.pipelining accepts run on one
("pp", "dp", "tp") mesh (`mesh`); every other plan runs on the pipeline runtime (`pipeline`:
per-stage meshes, activations re-split between stages of different dp or tp, whole-sample shares).

What the program expresses, and what `check_expressible` refuses (with the reason):
- stages: any contiguous layer ranges, any (dp, tp) per stage; `interleaved_1f1b` runs several
  stages per device group;
- batch shares: whole samples per replica per micro-batch (`ir.plan.check_whole_samples`);
- matmuls of the gpt, llama and moe families take `column`, `row`, `replicate` or `sequence` (tokens
  split, whole weights whose gradients are summed over the tp group once per step); each converts
  what arrives and what it hands on as `export.tp_flow` lays out (an all-gather, all-to-all,
  reduce or slice, the collectives `cost.sharding` charges), so any mix of those chains; a moe block's
  experts are split along each expert's FFN (gate and up `column`, down `row`) or run whole (all three
  `replicate` or all `sequence`), its router `replicate`, `sequence` or `column`. A traced
  model's matmuls (Hugging Face classes, a user's module) take `column`, `row` or `replicate`;
  `batch`- and `experts`-split matmuls are refused; embeddings also take `sequence`/`batch`, run
  as a whole table;
- norms all `sequence` (tagplan's default, Megatron-Core's layout) -> sequence parallelism on
  stages with tp > 1: the residual stream is split along the sequence, norms run on their part
  (SequenceParallel), attention and MLP gather it first (unless their first matmuls are
  token-split), the matmul writing the stream back reduce-scatters; norms all `replicate` -> plain
  Megatron TP; a mix is refused, and so is a seq_len that a stage's tp does not divide under
  sequence parallelism. Attention splits heads (`heads`) or runs whole (`replicate`); pointwise
  ops follow their inputs' layout (their declared strategy is not read); a column, token-split or
  row head on tp > 1 leaves its logits split over the vocabulary or the tokens and the loss is
  computed on those parts (`loss_split`);
- `heads` and `kv_heads` divisible by each stage's `tp`; a tied table's two copies may be split
  alike (their gradients summed piece by piece) or not (summed as whole tables, `tied_split_alike`);
- ZeRO 0 -> `replicate` (DDP on FSDP2's machinery), 1 and 2 -> FSDP2 `fully_shard` with
  `reshard_after_forward=False`, 3 -> `reshard_after_forward=True` (mesh runtime); the pipeline
  runtime shards the optimizer state and fp32 master slice over each stage's dp group for ZeRO 1
  (all-reduce then keep the slice) and 2 (reduce-scatter), weights whole between steps
  (`runtime_optim`), and ZeRO 3 with FSDP2 over the stage's dp mesh (the "dp" axis of a (dp, tp)
  mesh under tp): 1/dp of the weights per dp rank between steps, gradients summed over the
  replicas (`runtime_pipeline.shard_stage`); ZeRO with `dp == 1` shards over nothing and runs as
  plain training;
- `recompute` checkpoints every transformer block of the stage (embedding and head are kept), or its
  first `recompute_layers` blocks where that is set;
- gradients reduce in fp32 (autocast over fp32 master weights): a costed 16-bit
  `grad_reduce_dtype` is refused. Where they overlap the backward (`reduce_overlaps`): on the mesh
  runtime with one pipeline rank (FSDP2/replicate hooks during the last micro-batch's backward) and
  on ZeRO-3 stages of the pipeline runtime; elsewhere after the stage's last backward (torch
  2.13's pipelining schedules sync FSDP2 in their REDUCE_GRAD step; the pipeline runtime sums
  replicas after the step's program). `grad_reduce_overlap=False` is refused where a stage
  overlaps; an overlapped costing where one does not is written with a note (plan.json
  `grad_reduce.notes`).
Models: the gpt, llama and moe families (`tagplan.export.modules`); Hugging Face SPECs as the
transformers class itself (`tagplan.export.hf_modules`: Llama-style decoders and GPT-2, GPT-2 at
tp 1); a user's own `nn.Sequential` language model as itself (`tagplan.export.user_modules`; a
`file.py` is copied beside the program).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tagplan.errors import SpecError
from tagplan.export.checks import ExportError, GradReduce, exported_loss, reduce_dtype_note
from tagplan.export.modules import tp_ops
from tagplan.export.node_launch import clear_launch_files, launch_scripts, rank_table, record_launch_files
from tagplan.export.runtime_train import PROGRAM_FORMAT
from tagplan.export.shapes import ModelConfig, model_config, parsed
from tagplan.export.torch_checks import (
    check_batch,
    check_dtype,
    check_expressible,
    check_reduce_dtype_of,
    sequence_parallel,
    strategies_for,
    tied_split_alike,
)
from tagplan.export.tp_flow import ATTENTION, loss_split
from tagplan.frontends.hf_config import config_path
from tagplan.frontends.model_spec import ModelSpec, ModelSpecKind, build_model
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph, OpKind
from tagplan.ir.plan import Plan, Schedule
from tagplan.ir.workload import DType, LossKernel, Optimizer

FMT = "torch"
PROGRAM_SOURCE = Path(__file__).with_name("runtime_train.py")
PROGRAM_NAME = "train.py"
"""The name the program is copied under in the run directory (beside `plan.json`)."""


def pipeline_ranks(plan: Plan) -> list[int]:
    """Per stage, the pipeline rank that runs it: the index of its device group among distinct groups."""
    groups = list(dict.fromkeys(s.devices for s in plan.stages))
    return [groups.index(s.devices) for s in plan.stages]


def mesh_schedule_ok(plan: Plan) -> bool:
    """Whether torch.distributed.pipelining's schedule classes accept the plan: pipelined 1f1b needs
    micro_batches >= stages; interleaved needs micro_batches divisible by max(1, micro_batches // ranks)."""
    ranks = len(set(pipeline_ranks(plan)))
    m, stages = plan.micro_batches, len(plan.stages)
    if plan.schedule is Schedule.ONE_F_ONE_B and ranks > 1 and m < stages:
        return False
    return not (plan.schedule is Schedule.INTERLEAVED_1F1B and ranks > 1 and m % max(1, m // ranks))


def runtime_for(plan: Plan, ranks: list[int]) -> str:
    """`mesh` when one ("pp", "dp", "tp") mesh runs the plan (same dp and tp everywhere, even shares,
    world ranks in the plan's device order, a schedule torch's pipelining accepts), else `pipeline`."""
    first = plan.stages[0]
    uniform = all((s.dp, s.tp) == (first.dp, first.tp) and max(s.shares()) - min(s.shares()) < 1e-9
                  for s in plan.stages)
    return "mesh" if uniform and ranks == list(plan.devices) and mesh_schedule_ok(plan) else "pipeline"


def runtime_on(plan: Plan, cluster: Cluster | None) -> str:
    """`runtime_for` the plan launched on `cluster`'s nodes (None: one host), as `write_torch_program` writes it."""
    return runtime_for(plan, [row["device"] for row in rank_table(plan, cluster)])


def split_ops(config: ModelConfig, model: ModelGraph, layer: int) -> list[str]:
    """The ops of `layer` whose tensor-parallel strategy the program applies: the analytic names of
    `modules.tp_ops` for tagplan's own families, every traced matmul and embedding for family `hf`."""
    if config.family in ("hf", "module"):
        return [op.name for op in model.block_of(layer).ops if op.kind in (OpKind.MATMUL, OpKind.EMBEDDING)]
    return list(tp_ops(config, layer))


def program_config(model_spec: str, plan: Plan, model: ModelGraph, config: ModelConfig, *, seq_len: int,
                   global_batch: int, steps: int, seed: int, table: list[dict[str, Any]],
                   dtype: DType = DType.FP32, optimizer: Optimizer = Optimizer.ADAM,
                   reduce: GradReduce | None = None, loss: LossKernel = LossKernel.EAGER) -> dict[str, Any]:
    """The plan.json the program reads (format `runtime_train.PROGRAM_FORMAT`); `reduce` (how it
    reduces gradients, `grad_reduce`) is recorded for people as `grad_reduce`, the program does not read it;
    `loss`: the cross-entropy it runs (`checks.exported_loss`: eager, or fused; an in-place costing runs eager)."""
    ranks = pipeline_ranks(plan)
    stages = []
    for i, stage in enumerate(plan.stages):
        strategies = {}
        for j in range(*stage.layers):
            resolved = strategies_for(model, stage, j)
            ops = [*split_ops(config, model, j), *((ATTENTION,) if config.family in ("gpt", "llama") else ())]
            strategies[str(j)] = {op: resolved[op].value for op in ops if op in resolved}
        stages.append({"layers": list(stage.layers), "pp_rank": ranks[i], "devices": list(stage.devices),
                       "dp": stage.dp, "tp": stage.tp, "recompute": stage.recompute,
                       "recompute_layers": stage.recompute_layers,
                       "zero": stage.zero if stage.dp > 1 else 0, "strategies": strategies})
    first = plan.stages[0]
    runtime = runtime_for(plan, [row["device"] for row in table])
    return {"format": PROGRAM_FORMAT, "model": model_spec, "seq_len": seq_len, "global_batch": global_batch,
            "steps": steps, "seed": seed, "dtype": dtype.value, "optimizer": optimizer.value,
            "micro_batches": plan.micro_batches, "schedule": plan.schedule.value, "runtime": runtime,
            "sequence_parallel": sequence_parallel(plan, model), "tied_split_alike": tied_split_alike(plan, model),
            "loss_split": loss_split(config.family, head_strategy(plan, model), plan.stages[-1].tp),
            "mesh": {"pp": len(set(ranks)), "dp": first.dp, "tp": first.tp}, "world_size": len(plan.devices),
            "ranks": table, "stages": stages, "plan": plan.model_dump(mode="json"),
            "grad_reduce": (reduce or grad_reduce(plan, runtime, dtype=dtype)).as_json(),
            "loss": exported_loss("torch", loss).value}


def head_strategy(plan: Plan, model: ModelGraph) -> str:
    """The vocabulary projection's strategy on the last stage (tagplan's default, or the stage's own)."""
    resolved = strategies_for(model, plan.stages[-1], len(model.layers) - 1)
    return next((resolved[op].value for op in ("lm_head.tied", "lm_head") if op in resolved), "replicate")


def reduce_overlaps(plan: Plan, runtime: str) -> dict[int, bool]:
    """Per stage with dp > 1, whether the program reduces its gradients while its backward runs.

    Mesh runtime: FSDP2/replicate sync in the last micro-batch's backward with one pipeline rank;
    with more, torch.distributed.pipelining (torch 2.13) runs FSDP2's reduction in its REDUCE_GRAD
    step, after the stage's last backward. Pipeline runtime: ZeRO-3 stages reduce-scatter in FSDP2's
    backward hooks; the others are summed (ZeRO 0/1) or reduce-scattered (ZeRO 2) after the step's
    program of forwards and backwards.
    """
    if runtime == "mesh":
        one_rank = len(set(pipeline_ranks(plan))) == 1
        return {i: one_rank for i, s in enumerate(plan.stages) if s.dp > 1}
    return {i: s.zero >= 3 for i, s in enumerate(plan.stages) if s.dp > 1}


def grad_reduce(plan: Plan, runtime: str, *, dtype: DType, grad_reduce_dtype: DType | None = None,
                grad_reduce_overlap: bool = True) -> GradReduce:
    """How the program (on `runtime`, `runtime_for`) reduces gradients: always fp32, overlapped where
    `reduce_overlaps` says; nothing is written, the program's behaviour is fixed. ExportError for a
    16-bit `grad_reduce_dtype`; a note where `grad_reduce_overlap` disagrees with a stage (`plan
    --exportable torch` costs each stage as the program runs it, so its plans need none)."""
    check_reduce_dtype_of(dtype, grad_reduce_dtype)
    overlaps = reduce_overlaps(plan, runtime)
    if not overlaps:
        return GradReduce(dtype=DType.FP32, overlap=None)
    hidden = [i for i, o in overlaps.items() if o]
    exposed = [i for i, o in overlaps.items() if not o]
    notes: list[str] = []
    if not grad_reduce_overlap and hidden:
        notes.append(f"the program reduces the gradients of stages {hidden} while the backward runs ({runtime} "
                     "runtime: FSDP2/replicate hooks); a plan costed with the reduction after the backward will run "
                     "faster than predicted there. `plan --exportable torch` costs it as the program runs it")
    if grad_reduce_overlap and exposed:
        notes.append(f"the program reduces the gradients of stages {exposed} after their last backward, exposed; a "
                     "plan costed with the reduction overlapped will run slower than predicted there. `plan "
                     "--exportable torch` costs it as the program runs it")
    wider = reduce_dtype_note(FMT, dtype, grad_reduce_dtype, DType.FP32,
                              "`plan --exportable torch` costs it as the program runs it")
    return GradReduce(dtype=DType.FP32, overlap=not exposed, notes=(*notes, *([wider] if wider else [])))


def _carry_user_file(spec: ModelSpec, out_dir: Path) -> str | None:
    """For a `file.py:factory` or config.json SPEC, copy the file beside the program and return the
    SPEC naming the copy (the program runs in its folder); None for every other SPEC (a
    `package.module:factory` must be importable on every node)."""
    if spec.kind is ModelSpecKind.HF_FILE:
        source = config_path(spec.name)
        target = out_dir / "config.json"
        if source.resolve() != target.resolve():
            shutil.copyfile(source, target)
        return "config.json"
    if spec.kind is not ModelSpecKind.MODULE or not spec.name.endswith(".py"):
        return None
    source = Path(spec.name)
    target = out_dir / source.name
    if source.resolve() != target.resolve():
        shutil.copyfile(source, target)
    return f"{source.name}:{spec.attr}"


def write_torch_program(model_spec: str | ModelSpec, plan: Plan, out_dir: Path, *, seq_len: int, global_batch: int,
                        steps: int = 3, seed: int = 0, cluster: Cluster | None = None, dtype: DType = DType.FP32,
                        optimizer: Optimizer = Optimizer.ADAM, grad_reduce_dtype: DType | None = None,
                        grad_reduce_overlap: bool = True, loss: LossKernel = LossKernel.EAGER) -> Path:
    """Write `train.py`, `plan.json` and `launch_node{k}.sh` per node into `out_dir` (created);
    return the path of `train.py`.

    `cluster` gives the nodes and GPU types (node order, start-up check); without it the plan runs
    on one host. `dtype`, `optimizer`, `grad_reduce_dtype`, `grad_reduce_overlap` and `loss`: as the plan
    was costed (`grad_reduce`; a fused loss runs `runtime_loss.FusedCrossEntropy`). ExportError when the
    model, plan or gradient reduction cannot be expressed, or `global_batch` gives some replica a fraction of
    a sample.
    """
    text = model_spec.text if isinstance(model_spec, ModelSpec) else model_spec  # what plan.json names
    check_dtype(dtype)
    try:
        spec = parsed(model_spec)
        config = model_config(spec, seq_len=seq_len)
        model = build_model(spec, seq_len=seq_len)
    except SpecError as err:
        raise ExportError(str(err)) from None
    check_expressible(plan, model, config=config)
    check_batch(plan, model, seq_len=seq_len, global_batch=global_batch)
    table = rank_table(plan, cluster)
    reduce = grad_reduce(plan, runtime_on(plan, cluster), dtype=dtype,
                         grad_reduce_dtype=grad_reduce_dtype, grad_reduce_overlap=grad_reduce_overlap)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = _carry_user_file(spec, out_dir) or text
    cfg = program_config(text, plan, model, config, seq_len=seq_len, global_batch=global_batch, steps=steps,
                         seed=seed, table=table, dtype=dtype, optimizer=optimizer, reduce=reduce, loss=loss)
    (out_dir / "plan.json").write_text(json.dumps(cfg, indent=2) + "\n")
    clear_launch_files(out_dir)
    scripts = launch_scripts(table, PROGRAM_NAME)
    for name, body in scripts.items():
        (out_dir / name).write_text(body)
        (out_dir / name).chmod(0o755)
    record_launch_files(out_dir, [out_dir / name for name in scripts])
    target = out_dir / PROGRAM_NAME
    shutil.copyfile(PROGRAM_SOURCE, target)
    return target
