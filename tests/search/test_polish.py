"""Hill climbing interleaved with MCTS (`search.polish`), on toys and on the planner's decision space."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from search_toys import Digits, Digits_

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Workload
from tagplan.search.exhaustive import terminals
from tagplan.search.mcts import SearchResult, mcts
from tagplan.search.planner import SimulatorEvaluator
from tagplan.search.polish import Climber
from tagplan.search.space import PlanSpace, PlanState


def closeness(target: Digits_) -> Callable[[Digits_], float]:
    """1 / (1 + squared distance to `target`): unimodal, 1 at `target`."""
    return lambda state: 1.0 / (1.0 + sum((a - b) ** 2 for a, b in zip(state, target, strict=True)))


def evaluations_to_find(result: SearchResult[Digits_], state: Digits_) -> float:
    return next((i + 1 for i, (s, _) in enumerate(result.evaluated) if s == state), math.inf)


class OneDigit:
    """Neighbours: one digit changed (later positions first); region: the first digit."""

    def __init__(self, base: int) -> None:
        self.base = base

    def neighbours(self, state: Digits_) -> list[Digits_]:
        return [(*state[:i], d, *state[i + 1:]) for i in reversed(range(len(state))) for d in range(self.base)
                if d != state[i]]

    def region(self, state: Digits_) -> int:
        return state[0]


class Line:
    """Integers; neighbours n + 1 then n - 1; regions of ten."""

    def neighbours(self, state: int) -> list[int]:
        return [state + 1, state - 1]

    def region(self, state: int) -> int:
        return state // 10


def climb(climber: Climber[int], value: dict[int, float], budget: int) -> list[int]:
    """Drive `climber` alone: value what it proposes, up to `budget` proposals; the proposals in order."""
    known: dict[int, float] = {}
    asked = []
    for _ in range(budget):
        state = climber.propose(known.get)
        if state is None:
            break
        asked.append(state)
        known[state] = value.get(state, 0.0)
        climber.report(state, known[state])
    return asked


def test_a_climb_moves_to_the_first_better_neighbour_until_a_local_optimum() -> None:
    value = {n: -abs(n - 6) for n in range(10)}  # peak at 6, inside region 0
    climber = Climber(Line())
    climber.observe(2, value[2])
    asked = climb(climber, value, 20)
    assert asked == [3, 4, 5, 6, 7]  # 3 beats 2 at once (so 1 is never asked); 7 shows 6 is the peak
    assert climber.moves == 4 and climber.propose(lambda s: value.get(s, 0.0)) is None


def test_a_climb_stays_in_its_region_and_seeds_the_next_one() -> None:
    value = {n: float(n) for n in range(30)}  # rising across regions 0, 1 and 2
    climber = Climber(Line())
    climber.observe(8, value[8])
    asked = climb(climber, value, 5)
    # 9 is a move; 10 is better but in region 1: it starts its own climb instead of moving this one
    assert asked[:3] == [9, 10, 11]
    assert climber.climbs >= 2


def test_a_start_overtaken_in_its_region_is_not_climbed() -> None:
    value = {n: float(n) for n in range(10)}
    climber = Climber(Line())
    climber.observe(3, 3.0)
    climber.observe(7, 7.0)  # region 0's best now: the climb from 3 is dropped
    asked = climb(climber, value, 10)
    assert asked[0] == 8 and 4 not in asked


def test_neighbours_valued_elsewhere_are_not_asked_again() -> None:
    climber = Climber(Line())
    climber.observe(5, 0.0)
    known = {6: -1.0, 4: -1.0}
    assert climber.propose(known.get) is None  # a local optimum without a new evaluation


def test_polishing_finds_the_optimum_that_the_tree_alone_misses_on_the_budget() -> None:
    env, target = Digits(6, 5), (3, 1, 4, 1, 5)  # 7776 leaves, a unimodal value
    plain = mcts(env, (), evaluator=closeness(target), max_evaluations=300, gumbel_root=False)
    polished = mcts(env, (), evaluator=closeness(target), max_evaluations=150, gumbel_root=False,
                    local=OneDigit(env.base))
    assert plain.best_value < 1.0
    assert polished.best_state == target and evaluations_to_find(polished, target) <= 150
    assert 0 < polished.stats.local_evaluations < polished.stats.evaluations == 150


@pytest.mark.parametrize("budget", [7, 60, 130])
def test_evaluations_with_polish_are_a_prefix_of_a_larger_budgets(budget: int) -> None:
    env, value = Digits(5, 4), closeness((4, 0, 3, 1))
    small = mcts(env, (), evaluator=value, max_evaluations=budget, gumbel_root=False, local=OneDigit(env.base))
    large = mcts(env, (), evaluator=value, max_evaluations=2 * budget, gumbel_root=False, local=OneDigit(env.base))
    assert small.stats.evaluations == budget
    assert large.evaluated[:budget] == small.evaluated  # so a larger budget never has a worse best
    assert large.best_value >= small.best_value


def space(model: str, cluster: str, batch: int, seq: int) -> PlanSpace:
    at_boost_clock = load_cluster(cluster)
    if "H100-SXM" in at_boost_clock.device_types:  # the instances were chosen at the H100's boost clock
        at_boost_clock = at_boost_clock.with_device_figures("H100-SXM", sustained_peak_fraction=1.0)
    workload = Workload(global_batch=batch, seq_len=seq)
    return PlanSpace(Simulator(load_model(model, seq_len=seq), at_boost_clock, workload))


def test_plan_neighbours_are_other_plans_one_decision_away() -> None:
    sp = space("llama?layers=4&hidden=256&heads=4&vocab=500", "dgx-h100+dgx-a100-80gb+p3.16xlarge", 16, 256)
    states = terminals(sp, limit=100_000) or []
    for state in states[:: max(len(states) // 40, 1)]:
        own = sp.plan_key(state)
        near = list(sp.neighbours(state))
        assert near and len({sp.plan_key(n) for n in near}) == len(near)  # distinct plans
        for n in near:
            assert sp.is_terminal(n) and sp.plan_key(n) != own
            sp.to_plan(n)  # a valid plan
        # every single-decision change of the memory options is among them (or the same plan)
        for memory in {(False, 0), (True, 1)} - {state.memory}:
            changed = PlanState(**{**vars(state), "memory": memory})
            assert sp.plan_key(changed) == own or changed in near or any(
                sp.plan_key(n) == sp.plan_key(changed) for n in near)


def test_plan_key_is_equal_exactly_when_the_plans_are() -> None:
    sp = space("gpt?layers=4&hidden=128&heads=4&vocab=100", "dgx-a100-80gb+g4dn.12xlarge", 16, 128)
    states = terminals(sp, limit=100_000) or []
    sample = states[:: max(len(states) // 300, 1)]
    by_key: dict[tuple[object, ...], str] = {}
    for state in sample:
        text = sp.to_plan(state).to_json()
        assert by_key.setdefault(sp.plan_key(state), text) == text
    assert len(set(by_key.values())) == len(by_key)


def test_the_neighbourhood_crosses_a_decision_that_changes_nothing() -> None:
    """Whole-sample replicas split one sample each whatever `balanced_shares` says, so the two
    encodings are one plan; the neighbourhood includes what is one decision away from either."""
    sp = space("llama?layers=4&hidden=256&heads=4&vocab=500", "dgx-h100+dgx-a100-80gb", 16, 256)
    base = PlanState(nodes=(0, 1), stages=1, groups=(tuple(range(16)),), tps=(1,), cp=1, bounds=(),
                     balanced_shares=False, micro_batches=1, chunks=1, memory=(False, 3))
    other = PlanState(**{**vars(base), "balanced_shares": True})
    assert sp.plan_key(base) == sp.plan_key(other)
    wanted = PlanState(**{**vars(other), "tps": (2,)})  # two decisions from `base`, one from `other`
    assert sp.plan_key(wanted) in {sp.plan_key(n) for n in sp.neighbours(base)}


def subtree(sp: PlanSpace, root: PlanState) -> list[PlanState]:
    """Every terminal below `root`."""
    out, stack = [], [root]
    while stack:
        state = stack.pop()
        if sp.is_terminal(state):
            out.append(state)
        else:
            stack.extend(sp.step(state, a) for a in sp.actions(state))
    return out


# H100 (at its boost clock: `space`) and A100 nodes: data parallelism over both pays only with TP 2 and
# a by-speed batch split at once, so one decision alone from the fastest plan MCTS finds (the H100 node alone) is worse
MIXED = ("gpt?layers=4&hidden=1024&heads=16&vocab=500", "dgx-h100+dgx-a100-80gb", 16, 1024)


def test_polish_reaches_a_plan_the_tree_alone_misses_with_twice_the_budget() -> None:
    sp = space(*MIXED)
    judge = SimulatorEvaluator(sp)
    plain = mcts(sp, PlanState(), evaluator=judge, max_evaluations=400)
    polished = mcts(sp, PlanState(), evaluator=judge, max_evaluations=200, local=sp)
    assert polished.best_value > plain.best_value
    both = PlanState(nodes=(0, 1), stages=1)  # every one-stage plan on both nodes
    assert polished.best_value == max(judge(s) for s in subtree(sp, both))
    assert polished.best_state.nodes == (0, 1) and polished.best_state.tps == (2,)


@pytest.mark.slow
def test_polished_search_finds_the_exhaustive_optimum() -> None:
    sp = space(*MIXED)
    judge = SimulatorEvaluator(sp)
    optimum = max(judge(s) for s in terminals(sp, limit=100_000) or [])
    assert mcts(sp, PlanState(), evaluator=judge, max_evaluations=200, local=sp).best_value == optimum
