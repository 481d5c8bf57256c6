"""How a block's ops split over a tensor-parallel group, and the collectives that follow.

The default is Megatron-LM's pattern, derived from the dataflow rather than from op names:
a matmul whose input is replicated is split by columns (its output is sharded); a matmul whose
input is sharded is split by rows (its output is a partial sum, all-reduced in the forward);
attention on sharded q/k/v splits by heads; pointwise ops follow their input; ops on replicated
activations run sequence-parallel (Megatron-Core's default with TP, which turns each all-reduce
into a reduce-scatter + all-gather of the same ring cost). The backward mirrors the forward:
each column-split group all-reduces the gradient of its (replicated) input once.

A plan's per-op `sharding` overrides the default op by op; the search's intra-stage solver
(issue 4) fills it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tagplan.ir.model import Block, OpKind
from tagplan.ir.plan import ShardStrategy

_SPLIT = {ShardStrategy.COLUMN, ShardStrategy.HEADS, ShardStrategy.EXPERTS}


@dataclass(frozen=True, slots=True)
class TPComm:
    """One tensor-parallel all-reduce per sample (bytes are the full activation, per sample)."""

    op: str
    bytes_per_sample: float
    backward: bool


@dataclass(frozen=True, slots=True)
class ShardedBlock:
    """A block's per-op strategies and the all-reduces they imply."""

    strategies: dict[str, ShardStrategy]
    comms: tuple[TPComm, ...]


def default_strategies(block: Block) -> dict[str, ShardStrategy]:
    """Megatron-style strategy per op, propagated along the block's dataflow."""
    sharded: dict[str, bool] = {}
    out: dict[str, ShardStrategy] = {}
    for op in block.ops:
        inputs_sharded = any(sharded.get(src, False) for src in op.inputs)
        if op.kind in (OpKind.MATMUL, OpKind.CONV):
            strategy = ShardStrategy.ROW if inputs_sharded else ShardStrategy.COLUMN
        elif op.kind is OpKind.ATTENTION:
            strategy = ShardStrategy.HEADS if inputs_sharded else ShardStrategy.SEQUENCE
        elif op.kind is OpKind.EMBEDDING:
            strategy = ShardStrategy.ROW  # vocab-parallel table; the lookup's partial sums are all-reduced
        elif op.kind is OpKind.ALL_TO_ALL:
            strategy = ShardStrategy.EXPERTS
        else:
            strategy = ShardStrategy.COLUMN if inputs_sharded else ShardStrategy.SEQUENCE
        out[op.name] = strategy
        # Expert dispatch hands each expert whole tokens: the experts' first matmul is column-split.
        sharded[op.name] = strategy in _SPLIT and op.kind is not OpKind.ALL_TO_ALL
    return out


def shard_block(block: Block, overrides: dict[str, ShardStrategy] | None = None) -> ShardedBlock:
    """Strategies (defaults, then `overrides`) and the forward/backward all-reduces they imply."""
    strategies = default_strategies(block)
    if overrides:
        strategies.update({k: v for k, v in overrides.items() if k in strategies})
    comms: list[TPComm] = []
    reduced_inputs: set[tuple[str, ...]] = set()
    for op in block.ops:
        strategy = strategies[op.name]
        if strategy is ShardStrategy.ROW:
            comms.append(TPComm(op.name, op.bytes_written, backward=False))
        elif strategy is ShardStrategy.COLUMN and op.kind in (OpKind.MATMUL, OpKind.CONV):
            inputs_replicated = not any(strategies.get(src) in _SPLIT for src in op.inputs)
            if inputs_replicated and op.inputs not in reduced_inputs:
                reduced_inputs.add(op.inputs)  # q, k and v share one input: one gradient all-reduce
                comms.append(TPComm(op.name, _input_bytes(block, op.inputs), backward=True))
    return ShardedBlock(strategies, tuple(comms))


def _input_bytes(block: Block, inputs: tuple[str, ...]) -> float:
    by_name = {op.name: op for op in block.ops}
    produced = [by_name[name].bytes_written for name in inputs if name in by_name]
    if produced:
        return max(produced)
    return block.output_bytes  # the block's own input: same width as its output in a residual stream


def divides(strategy: ShardStrategy) -> bool:
    """Whether an op under `strategy` does 1/tp of the work on each device (all but REPLICATE)."""
    return strategy is not ShardStrategy.REPLICATE


def divides_params(strategy: ShardStrategy, kind: OpKind) -> bool:
    """Whether the op's parameters are split over the group (matmuls, tables, experts)."""
    return kind in (OpKind.MATMUL, OpKind.CONV, OpKind.EMBEDDING) and strategy in (
        ShardStrategy.COLUMN, ShardStrategy.ROW, ShardStrategy.EXPERTS)
