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

A moe block's attention is llama's. Its router is a matmul that reads the stream and hands on its
logits whole (replicate; column: its experts' columns, gathered) or for this rank's tokens (sequence),
and its experts run one of two ways (`experts_flow`):
- split (experts.gate and experts.up column, experts.down row: Megatron's expert tensor parallelism):
  every rank runs every token through its piece of each expert's FFN, so the tokens and the router's
  logits are made whole first (an all-gather of S; the gradients coming back are partial sums, reduced)
  and the output is a partial sum, reduced into the stream's layout (a reduce-scatter into S, an
  all-reduce into R);
- whole (all three replicate, or all three sequence): whole experts on the tokens of that layout.
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


EXPERT_OPS = ("experts.gate", "experts.up", "experts.down")
ROUTER = "router"
EXPERTS_SPLIT = ("column", "column", "row")  # gate, up and down: each expert's FFN split over the group
WHOLE_EXPERTS = ("replicate", "sequence")  # every expert whole, on all the tokens or on this rank's
ROUTER_LOGITS = {"replicate": Layout.R, "sequence": Layout.S, "column": Layout.R}  # router strategy -> its logits


@dataclass(frozen=True, slots=True)
class ExpertsFlow:
    """How a moe block's experts run on a tp group: the tokens arrive in `tokens` (the stream's layout),
    the router's logits in `logits`; they run in `runs` (R when `split`: every token through this rank's
    piece of each expert's FFN, the output a partial sum) and hand the output on in `departs` (the stream's)."""

    tokens: Layout
    logits: Layout
    runs: Layout
    split: bool
    departs: Layout


def experts_strategy(strategies: dict[str, str]) -> str | None:
    """"split" (`EXPERTS_SPLIT`), "replicate" or "sequence" (all three experts ops alike), else None: a mix the
    program does not run (missing ops are replicated)."""
    chosen = tuple(strategies.get(op, "replicate") for op in EXPERT_OPS)
    if chosen == EXPERTS_SPLIT:
        return "split"
    return chosen[0] if len(set(chosen)) == 1 and chosen[0] in WHOLE_EXPERTS else None


def experts_flow(strategies: dict[str, str], *, sp: bool) -> ExpertsFlow:
    """The flow of a moe block's experts whose ops take `strategies` (one `experts_strategy` accepts)."""
    stream = Layout.S if sp else Layout.R
    mode = experts_strategy(strategies)
    if mode is None:
        raise ValueError(f"experts strategies {[strategies.get(op, 'replicate') for op in EXPERT_OPS]} are not "
                         f"{list(EXPERTS_SPLIT)} nor one of {WHOLE_EXPERTS} for all three")
    runs = Layout.R if mode == "split" else NEEDS[mode]
    logits = ROUTER_LOGITS[strategies.get(ROUTER, "replicate")]
    return ExpertsFlow(tokens=stream, logits=logits, runs=runs, split=mode == "split", departs=stream)


def mlp_ops(family: str) -> tuple[tuple[str, ...], str]:
    """(the MLP's first matmuls, its second) for a dense `family` (gpt: GELU MLP; llama: SwiGLU)."""
    return (("mlp.fc1",), "mlp.fc2") if family == "gpt" else (("mlp.gate", "mlp.up"), "mlp.down")


def block_flow(family: str, strategies: dict[str, str], *, sp: bool) -> BlockFlow:
    """The flows of a gpt, llama or moe block whose ops take `strategies` (op -> strategy; a missing op is
    replicated, attention splits heads unless `attn.sdpa` says `replicate`), the stream split along
    the sequence between layers when `sp`. A moe block's router reads the stream and hands its logits on
    in its own layout; its experts convert what they read themselves (`experts_flow`)."""
    stream = Layout.S if sp else Layout.R
    heads = strategies.get(ATTENTION, "heads") == "heads"
    modules: dict[str, tuple[tuple[str, ...], str, Layout | None]] = {
        "attn": (("attn.q", "attn.k", "attn.v"), "attn.o", Layout.H if heads else Layout.R)}
    flows: dict[str, Flow] = {}
    gathers: dict[str, bool] = {"mlp": False}
    if family == "moe":
        flows[ROUTER] = Flow(stream, ROUTER_LOGITS[strategies.get(ROUTER, "replicate")])
    else:
        modules["mlp"] = (*mlp_ops(family), None)
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
    tokens' share of the loss, summed over the ranks) or None (whole logits). tagplan's own families' heads only."""
    if family not in ("gpt", "llama", "moe") or tp < 2:
        return None
    return {"column": "vocab", "sequence": "tokens", "row": "tokens"}.get(head_strategy)
