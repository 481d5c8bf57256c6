"""Which plans the torch program can express: `check_expressible`, without importing torch.

The planner asks this of every plan result it reports (`export.capability.verdicts`), so these
checks read only the plan, the ModelGraph and the ModelConfig (`shapes.model_config`); building
the program (`torch_program`) is what imports torch. A user's module is the exception: checking
that its layers map one for one instantiates it, which needs torch.
"""

from __future__ import annotations

from tagplan.cost.sharding import shard_block
from tagplan.errors import SpecError
from tagplan.export.checks import ExportError, check_reduce_dtype, refuse
from tagplan.export.hf_types import GPT2_TYPES, HEAD_NORM_TYPES
from tagplan.export.shapes import SUPPORTED_FAMILIES, ModelConfig, model_config
from tagplan.export.tp_flow import (
    EXPERT_OPS,
    EXPERTS_SPLIT,
    MATMUL_STRATEGIES,
    ROUTER,
    ROUTER_LOGITS,
    WHOLE_EXPERTS,
    experts_strategy,
)
from tagplan.frontends.model_spec import ModelSpec, parse_model_spec
from tagplan.ir.model import ModelGraph, OpKind
from tagplan.ir.plan import Plan, ShardStrategy, Stage, check_whole_samples
from tagplan.ir.workload import DType

_SPLITTABLE = (ShardStrategy.COLUMN, ShardStrategy.ROW, ShardStrategy.REPLICATE)
_TOKEN_SPLIT = (ShardStrategy.SEQUENCE, ShardStrategy.BATCH)
_TIED_PAIRS = {("row", "column"), ("column", "row"), ("replicate", "replicate")}


def check_expressible(plan: Plan, model: ModelGraph, *, config: ModelConfig | None = None) -> None:
    """Raise ExportError listing every feature of `plan` on `model` the program cannot express.

    `config` (the torch model's shape, which the graph does not record; `torch_config` reads it
    from the SPEC) adds the check that `tp` divides the attention heads, and is what lets a Hugging
    Face class or a user's module run: without it only tagplan's own families are accepted (a
    graph's name is never read as a SPEC).
    """
    problems = _model_problems(plan, model, config) + _moe_problems(plan, model)
    if not problems:
        analytic = (config.family if config is not None else model.family) in SUPPORTED_FAMILIES
        for i, stage in enumerate(plan.stages):
            problems += _stage_problems(i, stage, model, config, analytic=analytic)
        problems += _norm_problems(plan, model)
    if problems:
        raise ExportError("the plan cannot be exported to a torch program:\n" + "\n".join(f"  - {p}" for p in problems))


def torch_config(spec: ModelSpec, *, seq_len: int) -> ModelConfig:
    """The ModelConfig the program builds `spec` with; ExportError naming why it cannot (a Hugging
    Face model type it does not run, a user's module that is not an nn.Sequential of its layers)."""
    try:
        return model_config(spec, seq_len=seq_len)
    except SpecError as err:
        raise ExportError(f"the plan cannot be exported to a torch program:\n  - {err}") from None


def model_refusal(model: ModelGraph, spec: ModelSpec | None = None) -> str | None:
    """Why the program runs no plan of `model` whatever the plan (a family it does not build, a SPEC it cannot
    build), else None. `spec` as in `check_expressible`: without it only tagplan's own families pass."""
    try:
        config = torch_config(spec, seq_len=model.seq_len) if spec is not None else None
    except ExportError as err:
        return str(err).removeprefix("the plan cannot be exported to a torch program:\n  - ")
    if (config is None or config.family not in ("hf", "module")) and model.family not in SUPPORTED_FAMILIES:
        return _family_refusal(model)
    return None


def _family_refusal(model: ModelGraph) -> str:
    return (f"model {model.name!r} is of family {model.family!r}; the exporter builds {', '.join(SUPPORTED_FAMILIES)} "
            "models and Hugging Face classes (hf:...)")


def _model_problems(plan: Plan, model: ModelGraph, config: ModelConfig | None) -> list[str]:
    hf = config is not None and config.family == "hf"
    if config is not None and config.family == "module":
        try:
            from tagplan.export.user_modules import check_layers  # instantiates the module: imports torch

            check_layers(parse_model_spec(config.model_spec), [layer.name for layer in model.layers])
        except SpecError as err:
            return [str(err)]
    elif not hf and model.family not in SUPPORTED_FAMILIES:
        return [_family_refusal(model)]
    if hf and config is not None and len(model.layers) != config.num_layers:
        return [f"model {model.name!r}: the traced graph has {len(model.layers)} layers but the transformers class "
                f"has {config.num_layers} (embedding, {config.layers} decoder layers, head); the program cannot "
                "map the plan's stages onto it"]
    if hf and config is not None and config.model_type in GPT2_TYPES and max(s.tp for s in plan.stages) > 1:
        return [f"model {model.name!r}: GPT-2's matmuls are transformers Conv1D modules, which the program does not "
                "split: tensor parallelism needs tp = 1 on every stage"]
    if hf and config is not None and config.model_type in HEAD_NORM_TYPES and max(s.tp for s in plan.stages) > 1:
        return [f"model {model.name!r}: {config.model_type} normalises q and k per head with one weight shared by "
                "every head, whose gradient the program does not sum over a tensor-parallel group: tensor "
                "parallelism needs tp = 1 on every stage"]
    end = plan.stages[-1].layers[1]
    if plan.stages[0].layers[0] != 0 or end != len(model.layers):
        return [f"the plan covers layers [{plan.stages[0].layers[0]}, {end}) but the model has "
                f"{len(model.layers)} layers [0, {len(model.layers)})"]
    return []


def _moe_problems(plan: Plan, model: ModelGraph) -> list[str]:
    """A moe stage with tp > 1 runs its experts split (`tp_flow.EXPERTS_SPLIT`) or whole (all three experts ops
    replicate or all sequence) and its router replicate, sequence or column (`tp_flow.ROUTER_LOGITS`)."""
    if model.family != "moe":
        return []
    out: list[str] = []
    for i, stage in enumerate(plan.stages):
        if stage.tp == 1:
            continue
        found = len(out)
        for j in range(*stage.layers):
            resolved = {op: st.value for op, st in strategies_for(model, stage, j).items()}
            if ROUTER not in resolved:
                continue  # the embedding or the head
            chosen = [resolved.get(op, "replicate") for op in EXPERT_OPS]
            if experts_strategy(resolved) is None:
                out.append(f"stages[{i}] layer {j}: experts strategies {dict(zip(EXPERT_OPS, chosen, strict=True))}: "
                           f"the program splits each expert's FFN ({', '.join(EXPERTS_SPLIT)}) or runs whole "
                           f"experts (all three {' or all three '.join(WHOLE_EXPERTS)}); experts spread over the "
                           "group (expert parallelism) need Megatron-LM (--format megatron, "
                           "--expert-model-parallel-size) where it accepts the rest of the plan")
            if resolved[ROUTER] not in ROUTER_LOGITS:
                out.append(f"stages[{i}] layer {j}: router={resolved[ROUTER]!r}: the program runs the router as "
                           f"{', '.join(ROUTER_LOGITS)}")
            if len(out) > found:
                break  # one layer's reasons per stage
    return out


def _stage_problems(i: int, stage: Stage, model: ModelGraph, config: ModelConfig | None, *,
                    analytic: bool) -> list[str]:
    out = []
    if stage.cp > 1:
        out.append(f"stages[{i}].cp = {stage.cp}: the program has no context parallelism (ring attention); export "
                   "with --format megatron (--context-parallel-size)")
    if config is not None and stage.tp > 1 and (config.heads % stage.tp or config.kv_heads % stage.tp):
        out.append(f"stages[{i}]: tp={stage.tp} must divide heads={config.heads} and kv_heads={config.kv_heads}: "
                   "the program splits attention by whole heads")
    if config is not None and stage.tp > 1 and config.family == "moe" and config.ffn % stage.tp:
        out.append(f"stages[{i}]: tp={stage.tp} must divide the experts' ffn={config.ffn}: the program splits each "
                   "expert's FFN evenly")
    out += _sharding_problems(i, stage, model, analytic=analytic)
    return out


def _sharding_problems(i: int, stage: Stage, model: ModelGraph, *, analytic: bool) -> list[str]:
    """A gpt, llama or moe layer (`analytic`) runs its matmuls column, row, replicate or sequence (`export.tp_flow`;
    a moe block's router and experts: `_moe_problems`);
    a Hugging Face class's or a user's module's traced matmuls split column, row or replicate only."""
    if not stage.sharding:
        return []
    ops = {op.name: op for j in range(*stage.layers) for op in model.block_of(j).ops}
    every = {op.name for block in model.blocks for op in block.ops}
    out = []
    for name, strategy in stage.sharding.items():
        op = ops.get(name)
        if model.family == "moe" and (name in EXPERT_OPS or name == ROUTER):
            continue  # `_moe_problems`
        if op is None and name in every:
            continue  # another stage's op: one dict may serve every stage, and each layer reads its own ops
        if op is None:
            out.append(f"stages[{i}].sharding names op {name!r}, which no layer of the model has "
                       f"(the stage's ops: {', '.join(sorted(ops))})")
        elif op.kind is OpKind.MATMUL and analytic and strategy.value not in MATMUL_STRATEGIES:
            out.append(f"stages[{i}].sharding[{name!r}]={strategy.value!r}: the program runs a gpt, llama or moe "
                       "matmul as column, row, replicate or sequence (tokens split along the sequence); batch- and "
                       "expert-split matmuls are not expressed")
        elif op.kind is OpKind.MATMUL and not analytic and strategy not in _SPLITTABLE:
            out.append(f"stages[{i}].sharding[{name!r}]={strategy.value!r}: the program splits a traced model's "
                       "matmuls as column, row or replicate only (token-split and expert-split matmuls are "
                       "expressed for tagplan's own families only)")
        elif op.kind is OpKind.EMBEDDING and strategy not in (*_SPLITTABLE, *_TOKEN_SPLIT):
            out.append(f"stages[{i}].sharding[{name!r}]={strategy.value!r}: the program splits embeddings as row, "
                       "column, replicate or sequence/batch (run replicated) only")
    return out


def tied_split_alike(plan: Plan, model: ModelGraph) -> bool:
    """Whether a tied embedding table and its head copy hold matching pieces on their tp ranks (row with
    column, column with row, both whole; or no tensor parallelism on either), so that their gradients sum
    piece by piece; otherwise the program sums whole tables (`runtime_parallel.sync_tied`). True when untied."""
    head_ops = [op.name for op in model.block_of(len(model.layers) - 1).ops]
    if "lm_head.tied" not in head_ops:
        return True
    first, last = plan.stages[0], plan.stages[-1]
    if first.tp == 1 and last.tp == 1:
        return True
    if first.tp != last.tp:
        return False
    wte = strategies_for(model, first, 0).get("wte", ShardStrategy.REPLICATE)
    wte = ShardStrategy.REPLICATE if wte in _TOKEN_SPLIT else wte  # a token-split lookup keeps the whole table
    head = strategies_for(model, last, len(model.layers) - 1).get("lm_head.tied", ShardStrategy.REPLICATE)
    head = ShardStrategy.REPLICATE if head in _TOKEN_SPLIT else head  # a token-split head keeps the whole table
    return (wte.value, head.value) in _TIED_PAIRS


def _norm_strategies(plan: Plan, model: ModelGraph) -> dict[str, set[ShardStrategy]]:
    """Strategy -> the norms (`stages[i].op`) that take it, over every stage with tp > 1."""
    out: dict[str, set[ShardStrategy]] = {}
    for i, stage in enumerate(plan.stages):
        if stage.tp == 1:
            continue
        for j in range(*stage.layers):
            norms = [op.name for op in model.block_of(j).ops if op.kind is OpKind.LAYERNORM]
            resolved = strategies_for(model, stage, j)
            for name in norms:
                out.setdefault(f"stages[{i}].{name}", set()).add(resolved[name])
    return out


def sequence_parallel(plan: Plan, model: ModelGraph) -> bool:
    """Whether the program splits the residual stream along the sequence: tp > 1 and every norm
    `sequence` (tagplan's default, Megatron-Core's layout); all `replicate` turns it off."""
    return any(ShardStrategy.SEQUENCE in s for s in _norm_strategies(plan, model).values())


def _norm_problems(plan: Plan, model: ModelGraph) -> list[str]:
    by_norm = _norm_strategies(plan, model)
    seq = sorted(n for n, s in by_norm.items() if ShardStrategy.SEQUENCE in s)
    other = sorted(n for n, s in by_norm.items() if s - {ShardStrategy.SEQUENCE})
    if seq and other:
        return [f"norms {other[:4]} are not 'sequence' while {seq[:4]} are: the residual stream is split along "
                "the sequence (all norms 'sequence') or kept whole (all 'replicate') in the whole plan"]
    return []


def strategies_for(model: ModelGraph, stage: Stage, layer: int) -> dict[str, ShardStrategy]:
    """Every op's strategy in `layer` under `stage`: tagplan's Megatron defaults, then the stage's overrides."""
    return shard_block(model.block_of(layer), stage.sharding).strategies


def check_reduce_dtype_of(dtype: DType, grad_reduce_dtype: DType | None) -> None:
    """ExportError unless the program reduces in `grad_reduce_dtype` under `dtype` training: it keeps
    fp32 weights, so only fp32 (or unset)."""
    check_reduce_dtype(grad_reduce_dtype)
    if grad_reduce_dtype not in (None, DType.FP32):
        raise refuse("torch", f"grad_reduce_dtype={grad_reduce_dtype.value}: the program keeps fp32 weights (dtype "
                          f"{dtype.value}: bf16/fp16 run under autocast over them), so its gradients cross the "
                          "data-parallel group in fp32; it accepts grad_reduce_dtype fp32 or unset (re-plan with "
                          "--grad-reduce-dtype fp32 to cost it as it runs)")


def check_dtype(dtype: DType) -> None:
    """ExportError for a dtype the torch program cannot compute in: a quantized recipe (it runs bf16/fp16
    autocast, not Transformer Engine's quantized GEMMs)."""
    if dtype.quantized:
        raise ExportError(f"dtype {dtype.value}: the torch program runs bf16/fp16 autocast, not Transformer "
                          "Engine's quantized GEMMs; export to megatron (--fp8-format/--fp4-format) or plan in bf16")


def check_batch(plan: Plan, model: ModelGraph, *, seq_len: int, global_batch: int) -> None:
    """ExportError unless every replica gets whole samples of every micro-batch and the sequence splits over
    every stage's tp group where the program splits it (`check_sequence_split`)."""
    try:
        check_whole_samples(plan, global_batch)
    except ValueError as err:
        raise ExportError(f"global_batch={global_batch}: {err}") from None
    check_sequence_split(plan, model, seq_len=seq_len)


def check_sequence_split(plan: Plan, model: ModelGraph, *, seq_len: int) -> None:
    """ExportError unless, under sequence parallelism or a token-split matmul, every stage's tp divides the
    sequence (each rank takes an equal part)."""
    sp = sequence_parallel(plan, model)
    for i, stage in enumerate(plan.stages):
        if stage.tp == 1 or not seq_len % stage.tp:
            continue
        if sp:
            raise ExportError(f"seq_len={seq_len} does not split over stages[{i}].tp={stage.tp} ranks: the norms "
                              "are 'sequence' (sequence parallel), so the sequence must be a multiple of tp")
        split = sorted({op for j in range(*stage.layers) for op, st in strategies_for(model, stage, j).items()
                        if st is ShardStrategy.SEQUENCE and _op_kind(model, j, op) is OpKind.MATMUL})
        if split:
            raise ExportError(f"seq_len={seq_len} does not split over stages[{i}].tp={stage.tp} ranks: matmuls "
                              f"{split[:4]} are token-split ('sequence'), so the sequence must be a multiple of tp")


def _op_kind(model: ModelGraph, layer: int, op: str) -> OpKind | None:
    """The kind of op `op` of layer `layer` (None: no such op)."""
    return next((o.kind for o in model.block_of(layer).ops if o.name == op), None)
