"""Monte Carlo tree search over an abstract decision process, deterministic for a given seed.

The loop is mctx's (select -> expand -> evaluate -> backup). The decision process, the prior and the
leaf value enter only as typed callables (`Environment`, `Prior`, `Evaluator`), so the search imports
no model: the GNN is one implementation of those callables, a uniform prior and the simulator another.

One simulation:

1. SELECT from the root down through expanded, non-exhausted children with PUCT (AlphaZero: Silver
   et al., "Mastering the game of Go without human knowledge", Nature 2017):

       a* = argmax_a  Q^(s, a) + c_puct * P(s, a) * sqrt(N(s)) / (1 + N(s, a))

   Q^ is the child's Q min-max normalised over every value backed up so far (MuZero, Schrittwieser et
   al. 2020, Appendix B), so `c_puct` means the same whatever the evaluator's scale. Ties go to the
   child admitted first.
2. EXPAND under progressive widening (Coulom 2007; Chaslot et al. 2008): a node visited N times has
   at most k(N) = max(1, ceil(widening_c * N ** widening_alpha)) children, admitted in decreasing
   prior (ties: action order). A node with fewer children than k(N), or whose children are all
   exhausted, expands its next action instead of selecting, and the simulation stops at that child.
3. EVALUATE: a non-terminal leaf is completed by the environment's default policy (`env.complete`);
   a terminal one is used as is. Values go through a transposition table keyed by the terminal
   state: an equal plan reached along another path is evaluated once, and a repeat is a cache hit.
4. BACKUP the value v along the path: N += 1, W += v, M = max(M, v).
5. POLISH (with `local`): one step of hill climbing, below.

Choices:

- Q is a mix of mean and max, Q = (1 - q_max_weight) * W / N + q_max_weight * M, default 0.5. The
  search returns the best terminal it found, not the action of best expected value, and every
  backed-up value is an achievable plan, so M is a true lower bound on the subtree's best: a
  subtree with one excellent plan among poor ones deserves visits that its mean would deny. Pure max
  is brittle with a deterministic default policy (one lucky completion captures the search); the
  mean keeps a measure of how good the subtree is as a whole. `q_max_weight=0` is AlphaZero's mean.
- Q of an unvisited child is its parent's Q (0 for an unvisited parent), the "completed Q" of Gumbel
  MuZero simplified to the parent's value. Under PUCT every expanded child already has a visit (it is
  visited by the simulation that expands it), so this only feeds the Gumbel root's sigma(q).
- Exhaustion: a node is EXHAUSTED when it is terminal, or when all its actions are expanded and every
  child is exhausted; exhausted nodes are never selected, and the search stops when the root is.
- Gumbel root (Danihelka et al., "Policy improvement by planning with Gumbel", ICLR 2022), used when
  `gumbel_root` is True, or when it is None and `max_evaluations < 50`: at the root, once, draw
  g(a) ~ Gumbel(0) from the seeded RNG and keep the top m = min(gumbel_considered, |A|) actions by
  g(a) + log P(a). Sequential halving over the budget n = max_evaluations, in L = max(1, ceil(log2 m))
  phases: in each phase every remaining action is visited until it has max(1, floor(n / (L * |R|)))
  more visits (least-visited first, ties to the higher score), then the remaining set is cut to the
  best max(2, floor(|R| / 2)) by g(a) + log P(a) + sigma(q^(a)), with
  sigma(q^) = (c_visit + max_b N(b)) * c_scale * q^, c_visit = 50, c_scale = 1 (the paper's values).
  Past the budget the last two keep alternating, as in mctx. Below the root, PUCT as above. When
  every remaining considered action is exhausted, the root falls back to PUCT with widening.
- Randomness: only the Gumbel noise, from `random.Random(seed)`; with PUCT alone the search is fully
  deterministic and the seed has no effect. Children live in insertion-ordered dicts.
- Local search (`local`, optional): after each simulation, one step of hill climbing from the best
  terminal of each region (`search.polish.Climber`): it proposes a terminal one decision away from
  a climb's current one, valued through the same transposition table and counted against the same
  budget. The tree never sees those values (they are not backed up), so the simulations run as
  without it, and what the climber proposes depends only on the values it saw: with PUCT at the
  root the evaluations form one sequence whatever `max_evaluations`, which a budget only cuts, so
  a larger budget never finds a worse best terminal. (The Gumbel root's halving is sized by the
  budget, so below `GUMBEL_DEFAULT_BELOW` evaluations that does not hold.)
- Budgets, checked between simulations (the first simulation always runs): `evaluations >=
  max_evaluations`, `time.perf_counter()` past `max_wall_s`, the root exhausted, or `4 *
  max_evaluations` consecutive simulations without a new evaluation ("stalled"; every simulation
  expands a node, so only a tree far larger than the budget whose completions all repeat gets there).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, runtime_checkable

from tagplan.search.polish import Climber, Neighbourhood

log = logging.getLogger(__name__)

S = TypeVar("S")  # a state of the decision process, hashable
A = TypeVar("A")  # an action, hashable
S_contra = TypeVar("S_contra", contravariant=True)
A_contra = TypeVar("A_contra", contravariant=True)

GUMBEL_C_VISIT = 50.0
"""c_visit of sigma(q) = (c_visit + max_b N(b)) * c_scale * q (Danihelka et al. 2022, Section 4)."""
GUMBEL_C_SCALE = 1.0
"""c_scale of sigma(q) (Danihelka et al. 2022)."""
GUMBEL_DEFAULT_BELOW = 50
"""With `gumbel_root=None`, the Gumbel root is used when `max_evaluations` is below this."""
STALL_FACTOR = 4
"""Stop after `STALL_FACTOR * max_evaluations` consecutive simulations without a new evaluation."""


class Environment(Protocol[S, A]):
    """A deterministic decision process: states, legal actions, transitions and a default policy."""

    def actions(self, state: S) -> Sequence[A]:
        """Legal actions of `state`, distinct and in a deterministic order; empty iff terminal."""
        ...

    def step(self, state: S, action: A) -> S:
        """The state that `action` leads to from `state`."""
        ...

    def is_terminal(self, state: S) -> bool:
        """Whether `state` is a complete decision (a plan), with no legal action."""
        ...

    def complete(self, state: S) -> S:
        """Default policy: a terminal state reached from `state`, deterministically."""
        ...


class Prior(Protocol[S_contra, A_contra]):
    """Scores every legal action of a state in one batch (positional arguments: any such callable fits)."""

    def __call__(self, state: S_contra, actions: Sequence[A_contra], /) -> Sequence[float]:
        """Unnormalised non-negative scores, one per action, in the order of `actions`."""
        ...


@runtime_checkable
class DeferredPrior(Prior[S_contra, A_contra], Protocol[S_contra, A_contra]):
    """A Prior whose calls are expensive: the search asks it about a node only once the node has
    `after_visits` visits (the Gumbel root excepted) and still has actions to admit; until then it
    admits the node's actions in their given order with a uniform P. A node the search never
    returns to costs no call, and a state with one action never costs one."""

    after_visits: int


class Evaluator(Protocol[S_contra]):
    """Values a terminal state (a positional argument: any such callable fits)."""

    def __call__(self, state: S_contra, /) -> float:
        """Value of a TERMINAL state, higher is better, typically in (0, 1]."""
        ...


def uniform_prior(state: object, actions: Sequence[object]) -> list[float]:
    """The same score (1.0) for every action: a search without a learned model."""
    return [1.0] * len(actions)


@dataclass(frozen=True, slots=True)
class SearchStats:
    """What a search did and why it stopped."""

    evaluations: int
    """Calls of the evaluator: distinct terminal states valued."""
    cache_hits: int
    """Simulations whose terminal was already in the transposition table."""
    simulations: int
    """Simulations run (select, expand, evaluate, backup)."""
    wall_s: float
    """Seconds the search took (time.perf_counter)."""
    stopped_by: str
    """"evaluations", "wall_clock", "exhausted" (whole tree searched) or "stalled" (no new terminal)."""
    local_evaluations: int = 0
    """Of `evaluations`, those the interleaved local search (`local`) asked for."""


@dataclass(frozen=True, slots=True)
class SearchResult(Generic[S]):
    """The best terminal state found and every terminal evaluated."""

    best_state: S
    """The evaluated terminal of highest value (ties: the first evaluated)."""
    best_value: float
    """The evaluator's value of `best_state`."""
    evaluated: tuple[tuple[S, float], ...]
    """Every distinct terminal evaluated with its value, in first-evaluation order."""
    stats: SearchStats


@dataclass(slots=True, eq=False)
class _Node(Generic[S, A]):
    """One state of the search tree and its statistics."""

    state: S
    terminal: bool
    prior: float
    """P(parent, action that led here), normalised over the parent's actions; 1 at the root."""
    scored: bool = False
    """Whether `actions`, `priors` and `order` are filled (once, on the first expansion)."""
    prior_due: bool = False
    """Whether `priors` are still the uniform stand-in of a prior deferred to a later visit (`after_visits`)."""
    actions: tuple[A, ...] = ()
    priors: tuple[float, ...] = ()
    """P(s, a) for each of `actions`; sums to 1."""
    order: tuple[int, ...] = ()
    """Indices of `actions` in admission order: decreasing prior, ties by index."""
    children: dict[A, _Node[S, A]] = field(default_factory=dict)
    visits: int = 0
    value_sum: float = 0.0
    value_max: float = -math.inf
    exhausted: bool = False


@dataclass(frozen=True, slots=True)
class _Config:
    """The hyper-parameters of one search (see `mcts`)."""

    max_evaluations: int
    max_wall_s: float | None
    c_puct: float
    widening_c: float
    widening_alpha: float
    q_max_weight: float
    gumbel: bool
    gumbel_considered: int


@dataclass(slots=True)
class _Bounds:
    """Smallest and largest value backed up so far, for min-max normalisation of Q."""

    low: float = math.inf
    high: float = -math.inf

    def update(self, value: float) -> None:
        self.low, self.high = min(self.low, value), max(self.high, value)

    def normalise(self, q: float) -> float:
        """q mapped to [0, 1] by the bounds; 0 while every value seen is equal."""
        return (q - self.low) / (self.high - self.low) if self.high > self.low else 0.0


@dataclass(slots=True)
class _Halving:
    """Sequential halving over the considered root actions (Danihelka et al. 2022, Section 4)."""

    base: dict[int, float]
    """g(a) + log P(a) for each considered action index."""
    remaining: list[int]
    """Considered action indices still in the race."""
    target: int
    """Visits each remaining action should reach before the next cut."""
    budget: int
    """n, the visit budget of the halving (max_evaluations)."""
    phases: int
    """L = max(1, ceil(log2 m))."""

    def extra(self) -> int:
        """Visits added per remaining action in a phase: max(1, floor(n / (L * |R|)))."""
        return max(1, self.budget // (self.phases * len(self.remaining)))


def mcts(
    env: Environment[S, A],
    root: S,
    *,
    prior: Prior[S, A] = uniform_prior,
    evaluator: Evaluator[S],
    max_evaluations: int = 200,
    max_wall_s: float | None = None,
    seed: int = 0,
    c_puct: float = 1.25,
    widening_c: float = 1.0,
    widening_alpha: float = 0.5,
    q_max_weight: float = 0.5,
    gumbel_root: bool | None = None,
    gumbel_considered: int = 8,
    progress: Callable[[int, int], None] | None = None,
    local: Neighbourhood[S] | None = None,
) -> SearchResult[S]:
    """Search the decision process from `root` for the terminal state of highest evaluator value.

    Arguments:
        env: the decision process; `env.complete` is the default policy that finishes a leaf.
        root: the state to search from.
        prior: scores a state's actions in one batch; normalised to P(s, a) (all-zero, negative or
            non-finite scores give a uniform P).
        evaluator: the value of a terminal state, higher is better; called once per distinct terminal.
        max_evaluations: stop once this many evaluator calls were made (n of the Gumbel halving).
        max_wall_s: stop once this many seconds have passed (checked between simulations).
        seed: seeds `random.Random`, the only source of randomness (the Gumbel noise).
        c_puct: exploration constant of PUCT (1.25, MuZero's c1).
        widening_c, widening_alpha: progressive widening, k(N) = max(1, ceil(c * N ** alpha)).
        q_max_weight: weight of the max in Q = (1 - w) * mean + w * max (0: AlphaZero's mean).
        gumbel_root: Gumbel sequential-halving selection at the root; None: when max_evaluations < 50.
        gumbel_considered: m, the number of root actions the halving considers (mctx's default 16
            is for Go's 362 moves; planning steps have a handful of candidates).
        progress: called as `progress(evaluations, max_evaluations)` after each new evaluation.
        local: the terminals' neighbourhood; when given, each simulation is followed by one step of
            hill climbing from the regions' best terminals (`search.polish`), whose evaluations
            count against the same budget.

    Returns the best terminal state and its value, every terminal evaluated in first-evaluation
    order, and the search statistics (see the module docstring for the algorithm).
    """
    _check_arguments(max_evaluations, max_wall_s, c_puct, widening_c, widening_alpha, q_max_weight, gumbel_considered)
    gumbel = max_evaluations < GUMBEL_DEFAULT_BELOW if gumbel_root is None else gumbel_root
    config = _Config(
        max_evaluations, max_wall_s, c_puct, widening_c, widening_alpha, q_max_weight, gumbel, gumbel_considered
    )
    climber = Climber(local) if local is not None else None
    return _Search(env, prior, evaluator, config, random.Random(seed), progress, root, climber).run()


def _check_arguments(
    max_evaluations: int,
    max_wall_s: float | None,
    c_puct: float,
    widening_c: float,
    widening_alpha: float,
    q_max_weight: float,
    gumbel_considered: int,
) -> None:
    """Raise ValueError naming the first out-of-range hyper-parameter, its value and the accepted range."""
    checks = [
        ("max_evaluations", max_evaluations, max_evaluations >= 1, "an integer >= 1"),
        ("max_wall_s", max_wall_s, max_wall_s is None or max_wall_s > 0, "None or seconds > 0"),
        ("c_puct", c_puct, c_puct >= 0, ">= 0"),
        ("widening_c", widening_c, widening_c > 0, "> 0"),
        ("widening_alpha", widening_alpha, 0 <= widening_alpha <= 1, "in [0, 1]"),
        ("q_max_weight", q_max_weight, 0 <= q_max_weight <= 1, "in [0, 1]"),
        ("gumbel_considered", gumbel_considered, gumbel_considered >= 1, "an integer >= 1"),
    ]
    for name, value, ok, accepted in checks:
        if not ok:
            raise ValueError(f"mcts: {name} must be {accepted}, got {value!r}")


def normalise_prior(scores: Sequence[float], n: int) -> tuple[float, ...]:
    """Scores divided by their sum; uniform when any is negative or non-finite, or all are zero."""
    if len(scores) != n:
        raise ValueError(f"prior returned {len(scores)} scores for {n} actions; it must score each action once")
    values = [float(s) for s in scores]
    total = sum(values)
    if any(not math.isfinite(v) or v < 0 for v in values) or total <= 0:
        log.debug("prior scores %s are not usable; using a uniform prior", values[:8])
        return tuple([1.0 / n] * n)
    return tuple(v / total for v in values)


class _Search(Generic[S, A]):
    """The state of one search: the tree, the transposition table and the counters."""

    def __init__(
        self,
        env: Environment[S, A],
        prior: Prior[S, A],
        evaluator: Evaluator[S],
        config: _Config,
        rng: random.Random,
        progress: Callable[[int, int], None] | None,
        root: S,
        climber: Climber[S] | None = None,
    ) -> None:
        self.env, self.prior, self.evaluator, self.config = env, prior, evaluator, config
        self.after_visits = prior.after_visits if isinstance(prior, DeferredPrior) else 0
        self.rng, self.progress, self.climber = rng, progress, climber
        self.root: _Node[S, A] = _Node(root, env.is_terminal(root), prior=1.0)
        self.table: dict[S, float] = {}
        self.evaluated: list[tuple[S, float]] = []
        self.bounds = _Bounds()
        self.halving: _Halving | None = None
        self.cache_hits = 0
        self.simulations = 0
        self.local_evaluations = 0

    def run(self) -> SearchResult[S]:
        """Simulate until a budget is spent or the tree is exhausted."""
        start = time.perf_counter()
        stalled = 0
        while True:
            new = self._simulate()
            if self.climber is not None and not self._stop_reason(time.perf_counter() - start, 0):
                new = self._polish(self.climber) or new
            stalled = 0 if new else stalled + 1
            stopped_by = self._stop_reason(time.perf_counter() - start, stalled)
            if stopped_by:
                break
        best_state, best_value = self.evaluated[0]
        for state, value in self.evaluated:
            if value > best_value:
                best_state, best_value = state, value
        stats = SearchStats(
            len(self.evaluated),
            self.cache_hits,
            self.simulations,
            time.perf_counter() - start,
            stopped_by,
            self.local_evaluations,
        )
        return SearchResult(best_state, best_value, tuple(self.evaluated), stats)

    def _stop_reason(self, elapsed_s: float, stalled: int) -> str:
        """Why the search must stop now, or "" to go on."""
        config = self.config
        if self.root.exhausted:
            return "exhausted"
        if len(self.evaluated) >= config.max_evaluations:
            return "evaluations"
        if config.max_wall_s is not None and elapsed_s >= config.max_wall_s:
            return "wall_clock"
        if stalled >= STALL_FACTOR * config.max_evaluations:
            return "stalled"
        return ""

    def _polish(self, climber: Climber[S]) -> bool:
        """One step of the interleaved hill climbing: value the terminal it proposes; True if it did."""
        state = climber.propose(self.table.get)
        if state is None:
            return False
        self.local_evaluations += 1
        climber.report(state, self._value(state))
        return True

    def _simulate(self) -> bool:
        """One select -> expand -> evaluate -> backup; True when it evaluated a new terminal."""
        self.simulations += 1
        path = self._select()
        value, new = self._evaluate(path[-1])
        self._backup(path, value)
        return new

    # -- select and expand -------------------------------------------------------------------

    def _select(self) -> list[_Node[S, A]]:
        """The path from the root to a newly expanded child, or to the root when it is terminal."""
        node = self.root
        path = [node]
        while not node.terminal:
            self._score(node)
            node = self._choose(node)
            path.append(node)
            if node.visits == 0:
                break
        return path

    def _score(self, node: _Node[S, A]) -> None:
        """Fill the node's actions, priors (one batched prior call) and admission order, once; with a
        prior that defers (`after_visits`), a uniform stand-in first and the prior's scores once the
        node has that many visits."""
        if node.scored:
            if node.prior_due and node.visits >= self.after_visits:
                if len(node.children) < len(node.actions):  # scores still decide who is admitted next
                    self._rescore(node)
                node.prior_due = False
            return
        actions = tuple(self.env.actions(node.state))
        if not actions:
            raise ValueError(
                f"env.actions returned no action for a state env.is_terminal says is not terminal: {_short(node.state)}"
            )
        if len(set(actions)) != len(actions):
            raise ValueError(f"env.actions returned repeated actions {list(actions)[:8]} for {_short(node.state)}")
        node.actions = actions
        node.scored = True
        if len(actions) == 1:  # nothing to weigh: no prior call
            node.priors, node.order = (1.0,), (0,)
            return
        defer = self.after_visits > node.visits and not (node is self.root and self.config.gumbel)
        if defer:
            node.priors, node.order, node.prior_due = tuple([1.0 / len(actions)] * len(actions)), tuple(
                range(len(actions))), True
            return
        node.priors = normalise_prior(self.prior(node.state, actions), len(actions))
        node.order = tuple(sorted(range(len(actions)), key=lambda i: (-node.priors[i], i)))

    def _rescore(self, node: _Node[S, A]) -> None:
        """Replace a node's uniform stand-in by its prior's scores: its children admitted so far keep
        their statistics and take the new P; the rest are admitted in the new order."""
        node.priors = normalise_prior(self.prior(node.state, node.actions), len(node.actions))
        node.order = tuple(sorted(range(len(node.actions)), key=lambda i: (-node.priors[i], i)))
        for index, action in enumerate(node.actions):
            child = node.children.get(action)
            if child is not None:
                child.prior = node.priors[index]
        node.prior_due = False

    def _choose(self, node: _Node[S, A]) -> _Node[S, A]:
        """The child to descend into: Gumbel at the root, else widening then PUCT."""
        if node is self.root and self.config.gumbel:
            index = self._gumbel_index(node)
            if index is not None:
                return self._child(node, index)
        if self._may_widen(node):
            index = next(i for i in node.order if node.actions[i] not in node.children)
            return self._child(node, index)
        return self._puct(node)

    def _may_widen(self, node: _Node[S, A]) -> bool:
        """Whether to expand a new child: fewer than k(N) children, or every child exhausted."""
        if len(node.children) == len(node.actions):
            return False
        config = self.config
        limit = max(1, math.ceil(config.widening_c * node.visits**config.widening_alpha))
        return len(node.children) < limit or all(child.exhausted for child in node.children.values())

    def _child(self, node: _Node[S, A], index: int) -> _Node[S, A]:
        """The child for action `index`, created (expanded) if it does not exist."""
        action = node.actions[index]
        child = node.children.get(action)
        if child is None:
            state = self.env.step(node.state, action)
            child = _Node(state, self.env.is_terminal(state), prior=node.priors[index])
            node.children[action] = child
        return child

    def _puct(self, node: _Node[S, A]) -> _Node[S, A]:
        """argmax over non-exhausted children of Q^ + c_puct * P * sqrt(N) / (1 + n); ties: first admitted."""
        explore = self.config.c_puct * math.sqrt(node.visits)
        best, best_score = None, -math.inf
        for child in node.children.values():
            if child.exhausted:
                continue
            score = self._q_hat(child, node) + explore * child.prior / (1 + child.visits)
            if score > best_score:
                best, best_score = child, score
        if best is None:
            raise AssertionError("PUCT reached a node whose children are all exhausted; it should be exhausted")
        return best

    def _q(self, node: _Node[S, A]) -> float:
        """Q = (1 - w) * W / N + w * max, of a visited node."""
        weight = self.config.q_max_weight
        return (1 - weight) * node.value_sum / node.visits + weight * node.value_max

    def _q_hat(self, child: _Node[S, A] | None, parent: _Node[S, A]) -> float:
        """Normalised Q of a child; an unvisited child takes its parent's Q (0 if the parent is unvisited)."""
        if child is not None and child.visits:
            return self.bounds.normalise(self._q(child))
        return self.bounds.normalise(self._q(parent)) if parent.visits else 0.0

    # -- Gumbel root ---------------------------------------------------------------------------

    def _gumbel_index(self, root: _Node[S, A]) -> int | None:
        """The root action index sequential halving visits next; None when every remaining one is exhausted."""
        halving = self.halving or self._start_halving(root)
        while True:
            live = [i for i in halving.remaining if not self._exhausted_at(root, i)]
            if not live:
                return None
            if any(self._visits_at(root, i) < halving.target for i in live):
                break
            if len(halving.remaining) > 2:
                ranked = sorted(halving.remaining, key=lambda i: (-self._gumbel_score(root, i), i))
                halving.remaining = ranked[: max(2, len(halving.remaining) // 2)]
            halving.target += halving.extra()
        return min(live, key=lambda i: (self._visits_at(root, i), -self._gumbel_score(root, i), i))

    def _start_halving(self, root: _Node[S, A]) -> _Halving:
        """Draw g(a) ~ Gumbel(0) and keep the top m actions by g(a) + log P(a)."""
        base = {}
        for i, p in enumerate(root.priors):
            u = max(self.rng.random(), 1e-300)
            base[i] = -math.log(-math.log(u)) + (math.log(p) if p > 0 else -math.inf)
        m = min(self.config.gumbel_considered, len(root.actions))
        considered = sorted(base, key=lambda i: (-base[i], i))[:m]
        phases = max(1, math.ceil(math.log2(m)))
        self.halving = _Halving({i: base[i] for i in considered}, considered, 0, self.config.max_evaluations, phases)
        self.halving.target = self.halving.extra()
        return self.halving

    def _gumbel_score(self, root: _Node[S, A], index: int) -> float:
        """g(a) + log P(a) + sigma(q^(a)), sigma(q^) = (c_visit + max_b N(b)) * c_scale * q^."""
        assert self.halving is not None
        max_visits = max((child.visits for child in root.children.values()), default=0)
        q_hat = self._q_hat(root.children.get(root.actions[index]), root)
        return self.halving.base[index] + (GUMBEL_C_VISIT + max_visits) * GUMBEL_C_SCALE * q_hat

    @staticmethod
    def _visits_at(root: _Node[S, A], index: int) -> int:
        child = root.children.get(root.actions[index])
        return child.visits if child is not None else 0

    @staticmethod
    def _exhausted_at(root: _Node[S, A], index: int) -> bool:
        child = root.children.get(root.actions[index])
        return child is not None and child.exhausted

    # -- evaluate and backup ---------------------------------------------------------------------

    def _evaluate(self, leaf: _Node[S, A]) -> tuple[float, bool]:
        """Value of the leaf's terminal (itself, or its default-policy completion); True if newly evaluated."""
        terminal = leaf.state if leaf.terminal else self._complete(leaf.state)
        cached = self.table.get(terminal)
        if cached is not None:
            self.cache_hits += 1
            return cached, False
        value = self._value(terminal)
        if self.climber is not None:
            self.climber.observe(terminal, value)
        return value, True

    def _value(self, terminal: S) -> float:
        """The evaluator's value of a terminal not valued yet, recorded in the table."""
        value = float(self.evaluator(terminal))
        if not math.isfinite(value):
            raise ValueError(f"evaluator returned {value} for {_short(terminal)}; values must be finite")
        self.table[terminal] = value
        self.evaluated.append((terminal, value))
        if self.progress is not None:
            self.progress(len(self.evaluated), self.config.max_evaluations)
        return value

    def _complete(self, state: S) -> S:
        """The default policy's terminal from `state`, checked to be terminal."""
        terminal = self.env.complete(state)
        if not self.env.is_terminal(terminal):
            raise ValueError(f"env.complete returned a non-terminal state {_short(terminal)} from {_short(state)}")
        return terminal

    def _backup(self, path: list[_Node[S, A]], value: float) -> None:
        """Add the value to every node on the path, then mark newly exhausted nodes bottom-up."""
        self.bounds.update(value)
        for node in path:
            node.visits += 1
            node.value_sum += value
            node.value_max = max(node.value_max, value)
        for node in reversed(path):
            node.exhausted = node.terminal or (
                node.scored
                and len(node.children) == len(node.actions)
                and all(child.exhausted for child in node.children.values())
            )
            if not node.exhausted:
                break


def _short(state: object, limit: int = 200) -> str:
    """repr of a state, cut to `limit` characters for error messages."""
    text = repr(state)
    return text if len(text) <= limit else text[: limit - 3] + "..."
