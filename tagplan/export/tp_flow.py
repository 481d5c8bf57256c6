"""How the torch program's tensor-parallel matmuls hand tensors on (no torch): per matmul of a gpt
or llama layer, the layout its input arrives in and the layout it hands on.

Layouts are `cost.sharding`'s: R replicated, H split along the hidden/head dimension, S split along
the tokens (the sequence). A matmul's strategy fixes the layout it needs and the one it makes:

| strategy | needs | makes |
|---|---|---|
| column | R | H |
| row | H | a partial sum, reduced into what it hands on |
| replicate | R | R |
| sequence (tokens split, weights whole) | S | S |

Each matmul converts what arrives into what it needs and what it makes into what the next step of
the block reads, as `cost.sharding.transition` charges (R->S, R->H a slice; S->R, H->R an all-gather;
S<->H an all-to-all):
- q, k and v hand on what attention reads: H when it splits heads, R when every rank runs all of them;
- attention's output reaches the output projection in that same layout;
- the first MLP matmuls (fc1; gate and up) hand on what the second (fc2; down) needs;
- the matmuls that write the residual stream (attn.o, fc2, down) hand it on in the stream's layout: S
  under sequence parallelism, else R;
- the vocabulary projection reads the final norm's output (the stream's layout); split by columns it
  hands on its part of the vocabulary, split by tokens its part of the tokens, and the loss is computed
  on those parts (`loss_split`); otherwise whole logits.
Attention and the MLP read the stream once: under sequence parallelism it is gathered at the module's
input (one all-gather for q, k and v) unless every first matmul reads its part of the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from tagplan.cost.sharding import Layout

NEEDS = {"column": Layout.R, "row": Layout.H, "replicate": Layout.R, "sequence": Layout.S}
MATMUL_STRATEGIES = tuple(NEEDS)  # what the program runs a gpt or llama matmul as
ATTENTION = "attn.sdpa"


@dataclass(frozen=True, slots=True)
class Flow:
    """The layout a matmul's input arrives in and the layout it hands its output on in."""

    arrives: Layout
    departs: Layout


@dataclass(frozen=True, slots=True)
class BlockFlow:
    """Every matmul's flow in one transformer block, and which modules gather the stream at their input."""

    flows: dict[str, Flow]
    gathers: dict[str, bool]  # "attn" / "mlp" -> whether the module gathers the stream (S -> R) first


def mlp_ops(family: str) -> tuple[tuple[str, ...], str]:
    """(the MLP's first matmuls, its second) for `family` (gpt: GELU MLP; llama: SwiGLU)."""
    return (("mlp.fc1",), "mlp.fc2") if family == "gpt" else (("mlp.gate", "mlp.up"), "mlp.down")


def block_flow(family: str, strategies: dict[str, str], *, sp: bool) -> BlockFlow:
    """The flows of a gpt or llama block whose ops take `strategies` (op -> strategy; a missing op is
    replicated, attention splits heads unless `attn.sdpa` says `replicate`), the stream split along
    the sequence between layers when `sp`."""
    stream = Layout.S if sp else Layout.R
    heads = strategies.get(ATTENTION, "heads") == "heads"
    firsts, second = mlp_ops(family)
    modules = {"attn": (("attn.q", "attn.k", "attn.v"), "attn.o", Layout.H if heads else Layout.R),
               "mlp": (firsts, second, None)}
    flows: dict[str, Flow] = {}
    gathers: dict[str, bool] = {}
    for module, (first_ops, last_op, middle) in modules.items():
        needs = [NEEDS[strategies.get(op, "replicate")] for op in first_ops]
        gathers[module] = sp and any(n is not Layout.S for n in needs)
        arrives = Layout.R if gathers[module] else stream
        between = middle if middle is not None else NEEDS[strategies.get(last_op, "replicate")]
        flows.update({op: Flow(arrives, between) for op in first_ops})
        flows[last_op] = Flow(between, stream)
    return BlockFlow(flows, gathers)


def head_flow(strategy: str, *, sp: bool) -> Flow:
    """The vocabulary projection: the final norm's output in; a column head hands on its part of the
    vocabulary, a token-split head its part of the tokens and a row head its partial sums reduce-scattered
    over the tokens (`cost.sharding.loss_layout`), and the loss is computed on those parts (`loss_split`): no
    rank holds whole logits, as the cost model assumes. A replicated head hands on whole logits."""
    out = {"column": Layout.H, "sequence": Layout.S, "row": Layout.S}.get(strategy, Layout.R)  # row: reduce-scattered
    return Flow(Layout.S if sp else Layout.R, out)


def loss_split(family: str, head_strategy: str, tp: int) -> str | None:
    """How the loss reads the last stage's logits on its tp ranks: "vocab" (a column head: the loss is
    vocabulary-parallel, as Megatron's cross-entropy), "tokens" (a token-split or row head: each rank's
    tokens' share of the loss, summed over the ranks) or None (whole logits). gpt and llama heads only."""
    if family not in ("gpt", "llama") or tp < 2:
        return None
    return {"column": "vocab", "sequence": "tokens", "row": "tokens"}.get(head_strategy)
