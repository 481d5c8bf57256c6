"""Tensor-parallel sharding of a block: per-op strategies, tensor layouts, and the collectives they imply.

A tensor on a TP group is in one of four layouts: replicated (R), split along its hidden/heads
dimension (H), split along its tokens (S: batch or sequence), or a partial sum (P). A strategy
fixes, for each op, the layout it needs on its inputs, the layout of its output, and the layouts
of the gradients in the backward pass:

| op, strategy | input | output | input grad | output grad |
|---|---|---|---|---|
| matmul COLUMN (Megatron's column-parallel) | R | H | P | H |
| matmul ROW (row-parallel) | H | P | H | R |
| matmul SEQUENCE / BATCH (tokens split, weights replicated) | S | S | S | S |
| matmul EXPERTS (experts split over the group) | S | S | S | S |
| attention HEADS | H | H | H | H |
| embedding ROW (vocab-parallel) | indices | P | - | R |
| pointwise, norms: REPLICATE / SEQUENCE / COLUMN | R / S / H | same | same | same |
| anything REPLICATE | R | R | R | R |

Moving a tensor between layouts costs a collective (forward on activations, backward on
gradients, the same table): P->R all-reduce, P->S or P->H reduce-scatter, S->R or H->R
all-gather, S<->H all-to-all, R->S or R->H a free slice; nothing converts into P. Gradients
that several consumers return in one layout are summed locally first (q, k and v reduce once).
With the block boundary in S this reproduces Megatron-LM with sequence parallelism exactly:
per transformer block all-gather + reduce-scatter twice forward and twice backward.

Token-split matmuls keep replicated weights, whose gradients are all-reduced once per
iteration (`per_iteration`), like data parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from tagplan.cost.comm import Collective
from tagplan.ir.model import Block, ModelGraph, Op, OpKind, PartitionDim
from tagplan.ir.plan import Plan
from tagplan.ir.plan import ShardStrategy as St


class Layout(StrEnum):
    """How a tensor lies on a tensor-parallel group."""

    R = "replicated"
    H = "hidden_split"
    S = "token_split"
    P = "partial_sum"


BOUNDARY = Layout.S  # activations between layers: sequence parallel, as Megatron-Core runs TP

_GEMM = (OpKind.MATMUL, OpKind.CONV)
_SPLIT_LAYOUT = {St.REPLICATE: Layout.R, St.SEQUENCE: Layout.S, St.BATCH: Layout.S, St.COLUMN: Layout.H,
                 St.HEADS: Layout.H, St.EXPERTS: Layout.S}


@dataclass(frozen=True, slots=True)
class OpLayouts:
    """Layouts an op under a strategy needs and produces (None: input is not an activation)."""

    input: Layout | None
    output: Layout
    input_grad: Layout | None
    output_grad: Layout


@dataclass(frozen=True, slots=True)
class TPComm:
    """One collective over the TP group: bytes per sample in the nccl-tests size convention."""

    op: str
    collective: Collective
    bytes_per_sample: float
    backward: bool
    per_iteration: bool = False


@dataclass(frozen=True, slots=True)
class ShardedBlock:
    """A block's per-op strategies and the collectives they imply."""

    strategies: dict[str, St]
    comms: tuple[TPComm, ...]


def candidate_strategies(op: Op) -> tuple[St, ...]:
    """The strategies `op` may take, by kind (first is the kind's usual choice)."""
    if op.kind in _GEMM:
        return (St.COLUMN, St.ROW, St.SEQUENCE, St.REPLICATE)
    if op.kind is OpKind.ATTENTION:
        return (St.HEADS, St.REPLICATE)
    if op.kind is OpKind.EMBEDDING:
        return (St.ROW, St.COLUMN, St.SEQUENCE, St.REPLICATE)
    if op.kind in (OpKind.LAYERNORM, OpKind.REDUCTION):
        return (St.SEQUENCE, St.REPLICATE)
    return (St.SEQUENCE, St.COLUMN, St.REPLICATE)


def accepted_strategies(op: Op) -> tuple[St, ...]:
    """What a plan's `sharding` may give `op`: its kind's `candidate_strategies`, `batch` wherever `sequence` is (a
    token split too), and `experts` for an expert bank's matmuls (an op partitioned along its experts)."""
    out = [*candidate_strategies(op)]
    if St.SEQUENCE in out:
        out.append(St.BATCH)
    if PartitionDim.EXPERTS in op.partition_dims:
        out.append(St.EXPERTS)
    return tuple(out)


def sharding_problem(plan: Plan, model: ModelGraph) -> str | None:
    """Why a stage's `sharding` cannot be costed as written (None: it can): it names an op no layer of the model has
    (a typo, `attn.Q`, was dropped in silence and the defaults costed; one dict may serve every stage, so an op of
    another stage is no error), or gives an op of the stage a strategy its kind does not take
    (`accepted_strategies`)."""
    every = {op.name for block in model.blocks for op in block.ops}
    for i, stage in enumerate(plan.stages):
        if not stage.sharding:
            continue
        hashes = {model.layers[j].block for j in range(*stage.layers)}  # each distinct block once
        ops = {op.name: op for block in model.blocks if block.hash in hashes for op in block.ops}
        for name, strategy in stage.sharding.items():
            op = ops.get(name)
            if op is None:
                if name in every:
                    continue
                listed = sorted(every)
                more = f", ... ({len(listed)} in all)" if len(listed) > 12 else ""
                return (f"stages[{i}].sharding names op {name[:80]!r}, which no layer of the model has (its ops: "
                        f"{', '.join(listed[:12])}{more})")
            accepted = accepted_strategies(op)
            if strategy not in accepted:
                return (f"stages[{i}].sharding[{name!r}] = {strategy.value!r} is not accepted for a "
                        f"{op.kind.value} op; accepted: {', '.join(a.value for a in accepted)}")
    return None


def layouts(op: Op, strategy: St) -> OpLayouts:
    """The layouts of `op`'s input, output and their gradients under `strategy`."""
    if op.kind in _GEMM and strategy is St.COLUMN:
        return OpLayouts(Layout.R, Layout.H, Layout.P, Layout.H)
    if op.kind in _GEMM and strategy is St.ROW:
        return OpLayouts(Layout.H, Layout.P, Layout.H, Layout.R)
    if op.kind is OpKind.EMBEDDING:
        out = {St.ROW: Layout.P, St.COLUMN: Layout.H}.get(strategy, _SPLIT_LAYOUT.get(strategy, Layout.R))
        return OpLayouts(None, out, None, Layout.R if out is Layout.P else out)
    layout = _SPLIT_LAYOUT.get(strategy, Layout.R)
    return OpLayouts(layout, layout, layout, layout)


def transition(src: Layout, dst: Layout) -> Collective | None:
    """The collective that moves a tensor from `src` to `dst` (None: free). ValueError into P."""
    if src is dst or (src is Layout.R and dst in (Layout.S, Layout.H)):
        return None
    if dst is Layout.P:
        raise ValueError(f"no collective turns a {src.value} tensor into a partial sum")
    if src is Layout.P:
        return Collective.ALL_REDUCE if dst is Layout.R else Collective.REDUCE_SCATTER
    if dst is Layout.R:
        return Collective.ALL_GATHER
    return Collective.ALL_TO_ALL


def divides(strategy: St) -> bool:
    """Whether an op under `strategy` does 1/tp of the work on each device (all but REPLICATE)."""
    return strategy is not St.REPLICATE


def divides_params(strategy: St, kind: OpKind) -> bool:
    """Whether the op's parameters are split over the group."""
    return kind in (*_GEMM, OpKind.EMBEDDING) and strategy in (St.COLUMN, St.ROW, St.EXPERTS)


def param_split(strategy: St, kind: OpKind, tp: int) -> int:
    """How many ways an op's parameters divide over a `tp`-way group: `tp` where they are split, else 1."""
    return tp if tp > 1 and divides_params(strategy, kind) else 1


def collective_bytes(collective: Collective, tensor_bytes: float, tp: int) -> float:
    """Bytes in the nccl-tests size convention for moving a tensor of `tensor_bytes` in total."""
    return tensor_bytes / tp if collective is Collective.ALL_TO_ALL else tensor_bytes


def comm_events(block: Block, strategies: dict[str, St], *, boundary: Layout = BOUNDARY) -> tuple[TPComm, ...]:
    """Every collective of one micro-batch of `block` under `strategies` (tp-independent bytes)."""
    resolved = resolve(block, strategies, boundary)
    size = _sizes(block)
    events: list[TPComm] = []
    grads: dict[str, dict[Layout, str]] = {}  # tensor -> gradient layouts returned -> by which op
    converted: set[tuple[str, Layout]] = set()  # a gathered tensor serves every consumer (q, k, v)
    for op in block.ops:
        lay = resolved[op.name]
        if op.kind in _GEMM and strategies[op.name] in (St.SEQUENCE, St.BATCH) and op.param_bytes:
            events.append(TPComm(op.name, Collective.ALL_REDUCE, op.param_bytes, backward=True, per_iteration=True))
        if lay.input is None or op.kind is OpKind.VIEW:
            continue
        for src in op.inputs or ("",):
            src_layout = resolved[src].output if src in resolved else boundary
            if (src, lay.input) not in converted:
                converted.add((src, lay.input))
                _move(events, op.name, src_layout, lay.input, size(src), backward=False)
            grads.setdefault(src, {})[lay.input_grad or lay.input] = op.name
    output = output_op(block)
    if output is not None:
        made = resolved[output].output
        handed = loss_layout(made) if ends_in_loss(block, output) else boundary
        _move(events, output, made, handed, size(output), backward=False)
        grads.setdefault(output, {})[handed] = "output"
    for tensor, returned in grads.items():
        need = resolved[tensor].output_grad if tensor in resolved else boundary
        for layout, consumer in returned.items():
            _move(events, consumer, layout, need, size(tensor), backward=True)
    return tuple(events)


def _sizes(block: Block) -> Callable[[str], float]:
    """Bytes per sample of a tensor, following views back to the op that made it."""
    by_name = {op.name: op for op in block.ops}

    def size(name: str) -> float:
        seen = 0
        while name in by_name and by_name[name].kind is OpKind.VIEW and by_name[name].inputs and seen < 64:
            name, seen = by_name[name].inputs[0], seen + 1
        op = by_name.get(name)
        if op is None or op.kind is OpKind.VIEW:
            return block.output_bytes
        return op.bytes_written

    return size


def output_op(block: Block) -> str | None:
    """The op whose result leaves the block: the last real op no other op of the block reads."""
    consumed = {src for op in block.ops for src in op.inputs}
    leaves = [op.name for op in block.ops if op.name not in consumed and op.kind is not OpKind.VIEW]
    return leaves[-1] if leaves else None


def ends_in_loss(block: Block, output: str) -> bool:
    """A model's last layer hands back a loss (or logits), not activations: no boundary layout (`loss_layout`)."""
    op = next(o for o in block.ops if o.name == output)
    return block.kind == "head" or op.kind is OpKind.SOFTMAX


LOSS_READS = (Layout.R, Layout.H, Layout.S)
"""Logits the loss reads where they lie: whole, split over the vocabulary (Megatron's vocabulary-parallel
cross-entropy) or over the tokens (each rank its tokens' share)."""


def loss_layout(made: Layout) -> Layout:
    """The layout the loss reads logits made in `made`: the same, but partial sums, which are reduce-scattered
    over the tokens first (their gradient comes back so and is gathered)."""
    return made if made in LOSS_READS else Layout.S


def _move(events: list[TPComm], op: str, src: Layout, dst: Layout, size: float, *, backward: bool) -> None:
    collective = transition(src, dst)
    if collective is not None and size > 0:
        events.append(TPComm(op, collective, size, backward=backward))


def resolve(block: Block, strategies: dict[str, St], boundary: Layout = BOUNDARY) -> dict[str, OpLayouts]:
    """Layouts of every op; views take their input's layout whatever their recorded strategy."""
    out: dict[str, OpLayouts] = {}
    for op in block.ops:
        if op.kind is OpKind.VIEW:
            src = next((out[i] for i in op.inputs if i in out), None)
            layout = src.output if src is not None else boundary
            grad = src.output_grad if src is not None else boundary
            out[op.name] = OpLayouts(layout, layout, grad, grad)
        else:
            out[op.name] = layouts(op, strategies[op.name])
    return out


def default_strategies(block: Block) -> dict[str, St]:
    """Megatron's pattern propagated along the dataflow: column on replicated-or-token-split
    inputs, row on hidden-split inputs, heads for attention, sequence parallel elsewhere."""
    split: dict[str, bool] = {}
    out: dict[str, St] = {}
    tables = [op for op in block.ops if op.kind is OpKind.EMBEDDING]
    vocab = max(tables, key=lambda op: op.param_bytes).name if tables else None
    for op in block.ops:
        sharded = any(split.get(src, False) for src in op.inputs)
        if op.kind in _GEMM:
            strategy = St.ROW if sharded else St.COLUMN
        elif op.kind is OpKind.ATTENTION:
            strategy = St.HEADS if sharded else St.REPLICATE
        elif op.kind is OpKind.EMBEDDING:
            # the token table is vocab-parallel; position and segment tables stay replicated (Megatron)
            strategy = St.ROW if op.name == vocab else St.SEQUENCE
        else:
            strategy = St.COLUMN if sharded else St.SEQUENCE
        out[op.name] = strategy
        split[op.name] = strategy in (St.COLUMN, St.HEADS) and op.kind is not OpKind.ALL_TO_ALL
    return out


def shard_block(block: Block, overrides: dict[str, St] | None = None) -> ShardedBlock:
    """Strategies (defaults, then `overrides`) and the collectives they imply."""
    strategies = default_strategies(block)
    if overrides:
        strategies.update({k: v for k, v in overrides.items() if k in strategies})
    return ShardedBlock(strategies, comm_events(block, strategies))
