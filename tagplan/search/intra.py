"""Intra-stage sharding solver: per-op strategies for one block on a tensor-parallel group.

Exact dynamic programming over the block's ops in dataflow order. The state is the set of live
tensors (produced, still to be consumed) with their layout, the layouts already made for
consumers, and the gradient layouts consumers will return; each op's decision adds its compute
time (`cost.compute.op_time` on its split), the collectives that move its inputs into the
layout it needs (`cost.sharding.transition`), and, when a tensor's last consumer is decided,
the collectives that bring its gradient back. Every state keeps the Pareto set of
(time, memory) partial solutions, as FT (Shi et al., TPDS'22) does; views alias their input.
Memory is parameters plus saved activations per device. Per-iteration collectives (weight
gradients of token-split matmuls) are charged once per `micro_batches`.

With many live tensors (large traced blocks) the number of states is capped (`max_states`,
keeping the fastest), which makes the search a beam; transformer blocks stay well below it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tagplan.cost.calibration import Calibration
from tagplan.cost.comm import Collective
from tagplan.cost.compute import op_time
from tagplan.cost.sharding import (
    BOUNDARY,
    Layout,
    candidate_strategies,
    collective_bytes,
    ends_in_loss,
    layouts,
    loss_layout,
    transition,
)
from tagplan.ir.cluster import DeviceSpec
from tagplan.ir.model import Block, Op, OpKind
from tagplan.ir.plan import ShardStrategy
from tagplan.ir.workload import DType

CollectiveTime = Callable[[Collective, float], float]  # (collective, bytes) -> seconds on the TP group
_EXTERNAL = ""  # the block's input from the previous layer


@dataclass(frozen=True, slots=True)
class IntraSolution:
    """One Pareto-optimal sharding: seconds per micro-batch (fwd + bwd + TP comm) and bytes per device."""

    strategies: dict[str, ShardStrategy]
    time_s: float
    memory_bytes: float


@dataclass(frozen=True, slots=True)
class _Tensor:
    layout: Layout
    grad_layout: Layout
    made: frozenset[Layout]
    returned: frozenset[Layout]


_State = tuple[tuple[str, _Tensor], ...]
_Trace = tuple["_Trace", tuple[str, ShardStrategy]] | None
"""The decisions so far, newest first, as a linked list: extending it copies nothing (a tuple of every decision
copied it per op, quadratic in a block's ops)."""
_Partial = tuple[float, float, _Trace]


class OutOfTimeError(Exception):
    """`solve_block` passed its deadline; the solve is abandoned."""


@dataclass(frozen=True)
class _Problem:
    block: Block
    tp: int
    samples: float
    micro_batches: int
    spec: DeviceSpec
    dtype: DType
    calibration: Calibration
    comm: CollectiveTime
    boundary: Layout


def solve_block(block: Block, *, tp: int, samples: float, spec: DeviceSpec, dtype: DType, calibration: Calibration,
                comm: CollectiveTime, micro_batches: int = 1, boundary: Layout = BOUNDARY,
                max_states: int = 512, max_pareto: int = 16, deadline: float | None = None) -> list[IntraSolution]:
    """The Pareto frontier of shardings of `block` on a `tp`-way group, fastest first. OutOfTimeError when
    `time.perf_counter()` passes `deadline` before it is done."""
    problem = _Problem(block, tp, samples, micro_batches, spec, dtype, calibration, comm, boundary)
    alias, ops = _fold_views(block)
    last_use = _last_uses(ops, alias)
    states: dict[_State, list[_Partial]] = {((_EXTERNAL, _Tensor(boundary, boundary, frozenset(), frozenset())),): [
        (0.0, 0.0, None)]}
    for index, op in enumerate(ops):
        if deadline is not None and time.perf_counter() > deadline:
            raise OutOfTimeError(f"block {block.hash}: op {index} of {len(ops)}")
        nxt: dict[_State, list[_Partial]] = {}
        for state, partials in states.items():
            for strategy in candidate_strategies(op):
                step = _decide(problem, state, op, strategy, index, alias, last_use)
                if step is None:
                    continue
                new_state, dt, dm = step
                bucket = nxt.setdefault(new_state, [])
                bucket.extend((t + dt, m + dm, (trace, (op.name, strategy))) for t, m, trace in partials)
        states = _prune(nxt, max_states, max_pareto)
    return _finish(problem, states, ops, block)


def _decisions(trace: _Trace) -> list[tuple[str, ShardStrategy]]:
    """A trace's decisions, oldest first."""
    out = []
    while trace is not None:
        trace, decision = trace
        out.append(decision)
    return out[::-1]


def _fold_views(block: Block) -> tuple[dict[str, str], list[Op]]:
    """Views alias their first input; the DP decides only real ops."""
    alias: dict[str, str] = {}
    ops: list[Op] = []
    for op in block.ops:
        if op.kind is OpKind.VIEW:
            src = op.inputs[0] if op.inputs else _EXTERNAL
            alias[op.name] = alias.get(src, src)
        else:
            ops.append(op)
    return alias, ops


def _sources(op: Op, alias: dict[str, str]) -> tuple[str, ...]:
    if op.kind is OpKind.EMBEDDING:
        return ()  # token indices: no layout, no gradient
    return tuple(dict.fromkeys(alias.get(s, s) for s in op.inputs)) or (_EXTERNAL,)


def _last_uses(ops: list[Op], alias: dict[str, str]) -> dict[str, int]:
    last: dict[str, int] = {}
    for i, op in enumerate(ops):
        for src in _sources(op, alias):
            last[src] = i
    return last


def _decide(p: _Problem, state: _State, op: Op, strategy: ShardStrategy, index: int, alias: dict[str, str],
            last_use: dict[str, int]) -> tuple[_State, float, float] | None:
    live = dict(state)
    lay = layouts(op, strategy)
    time_s, split = _compute(p, op, strategy), strategy is not ShardStrategy.REPLICATE
    for src in _sources(op, alias):
        tensor = live.get(src)
        if tensor is None or lay.input is None:
            continue
        if lay.input not in tensor.made:
            try:
                time_s += _move(p, tensor.layout, lay.input, _size(p, src))
            except ValueError:
                return None
        tensor = _Tensor(tensor.layout, tensor.grad_layout, tensor.made | {lay.input},
                         tensor.returned | {lay.input_grad or lay.input})
        live[src] = tensor
        if last_use.get(src) == index:
            time_s += _settle(p, tensor, _size(p, src))
            del live[src]
    live[op.name] = _Tensor(lay.output, lay.output_grad, frozenset(), frozenset())
    memory = _memory(p, op, strategy, split)
    return tuple(sorted(live.items())), time_s, memory


def _compute(p: _Problem, op: Op, strategy: ShardStrategy) -> float:
    t = op_time(op, samples=p.samples, tp=p.tp, strategy=strategy, spec=p.spec, dtype=p.dtype,
                calibration=p.calibration)
    extra = 0.0
    if op.kind in (OpKind.MATMUL, OpKind.CONV) and strategy in (ShardStrategy.SEQUENCE, ShardStrategy.BATCH):
        extra = p.comm(Collective.ALL_REDUCE, op.param_bytes) / p.micro_batches  # replicated weights' gradients
    return t.forward_s + t.backward_s + extra


def _memory(p: _Problem, op: Op, strategy: ShardStrategy, split: bool) -> float:
    from tagplan.cost.sharding import param_split

    params = op.param_bytes / param_split(strategy, op.kind, p.tp)
    saved = op.saved_bytes * p.samples / (p.tp if split else 1)
    return params + saved


def _size(p: _Problem, tensor: str) -> float:
    if tensor == _EXTERNAL:
        return p.block.output_bytes * p.samples
    return next(op.bytes_written for op in p.block.ops if op.name == tensor) * p.samples


def _move(p: _Problem, src: Layout, dst: Layout, nbytes: float) -> float:
    collective = transition(src, dst)
    if collective is None or nbytes <= 0:
        return 0.0
    return p.comm(collective, collective_bytes(collective, nbytes, p.tp))


def _settle(p: _Problem, tensor: _Tensor, nbytes: float) -> float:
    """Backward: bring every returned gradient layout to the layout the producer needs."""
    return sum(_move(p, g, tensor.grad_layout, nbytes) for g in sorted(tensor.returned))


def _prune(states: dict[_State, list[_Partial]], max_states: int, max_pareto: int) -> dict[_State, list[_Partial]]:
    kept: dict[_State, list[_Partial]] = {}
    for state, partials in states.items():
        partials.sort(key=lambda x: (x[0], x[1]))
        front: list[_Partial] = []
        for cand in partials:
            if not front or cand[1] < front[-1][1]:
                front.append(cand)
        kept[state] = front[:max_pareto]
    if len(kept) > max_states:
        best = sorted(kept, key=lambda s: kept[s][0][0])[:max_states]
        kept = {s: kept[s] for s in best}
    return kept


def _finish(p: _Problem, states: dict[_State, list[_Partial]], ops: list[Op], block: Block) -> list[IntraSolution]:
    out: list[_Partial] = []
    last = ops[-1].name
    loss = ends_in_loss(block, last)
    for state, partials in states.items():
        live = dict(state)
        tail = 0.0
        for name, tensor in live.items():
            nbytes = _size(p, name)
            if name == last:  # handed on to the next layer, or to the loss where the logits lie
                handed = loss_layout(tensor.layout) if loss else p.boundary
                try:
                    tail += _move(p, tensor.layout, handed, nbytes)
                except ValueError:
                    tail = float("inf")
                tensor = _Tensor(tensor.layout, tensor.grad_layout, tensor.made, tensor.returned | {handed})
            tail += _settle(p, tensor, nbytes)
        out.extend((t + tail, m, trace) for t, m, trace in partials)
    out.sort(key=lambda x: (x[0], x[1]))
    frontier: list[IntraSolution] = []
    for t, m, trace in out:
        if t == float("inf"):
            continue
        if not frontier or m < frontier[-1].memory_bytes:
            strategies = dict(_decisions(trace))
            strategies.update({op.name: ShardStrategy.REPLICATE for op in block.ops if op.name not in strategies})
            frontier.append(IntraSolution(strategies, t, m))
    return frontier
