"""Local search that polishes what the tree search finds: first-improvement hill climbing over the
terminals one decision away, from the best terminal of each region of the space.

Why: MCTS spreads its visits by the values its completions back up, so a subtree whose first
completions are poor gets few visits even where its best plan is the best of all (on a mixed
cluster, adding a slower node only pays once the TP degree and the batch split change with it:
one decision alone makes the plan worse). Hill climbing from the best plan the tree found in each
region reaches such an optimum in a few dozen evaluations where the tree would need hundreds.

The climber is driven by the tree search, which interleaves it (`mcts(..., local=...)`):

- a terminal valued by anyone (the tree search or a climb) that beats the best value seen so far
  in its region (`Neighbourhood.region`) starts a CLIMB there;
- each step serves the live climb whose current terminal is the most valuable: it looks at that
  terminal's next neighbour, in the neighbourhood's order; a neighbour valued already (by the tree
  or an earlier climb) costs nothing, a new one is proposed for valuing;
- a better neighbour in the same region becomes the climb's current terminal (first improvement);
  one in another region only seeds that region's climb, so each climb polishes its own basin;
- a climb ends at a local optimum (no better neighbour), or when a better terminal of its region
  turns up elsewhere (that one is climbed instead).

The climber only proposes terminals and takes their values; it never calls the evaluator, so the
caller counts every valuation against one budget. What it proposes depends only on the values it
saw, so a search that interleaves it deterministically still evaluates a budget-independent
sequence of terminals: a larger budget evaluates a superset, and its best plan is never worse.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar

S = TypeVar("S")


class Neighbourhood(Protocol[S]):
    """The local structure of a decision process's terminals."""

    def neighbours(self, state: S, /) -> Iterable[S]:
        """Terminals near the terminal `state`, most promising first, distinct and without `state`
        (may be lazy: a climb draws them one at a time and stops at the first better one)."""
        ...

    def region(self, state: S, /) -> Hashable:
        """A coarse class of terminals (a basin of the climb): each region's best is climbed from."""
        ...


class Climber(Generic[S]):
    """Best-first hill climbing from the regions' best terminals (module docstring); it values nothing itself."""

    def __init__(self, space: Neighbourhood[S]) -> None:
        self.space = space
        self.climbs = 0
        """Climbs started (terminals whose neighbourhood was opened)."""
        self.moves = 0
        """Steps of a climb to a better neighbour."""
        self._heap: list[tuple[float, int, S]] = []  # climbs by their terminal's value: (-value, arrival, state)
        self._arrivals = 0
        self._region_best: dict[Hashable, float] = {}
        self._pending: dict[S, Iterator[S]] = {}  # the neighbours a live climb has still to look at
        self._ended: set[S] = set()  # climbs that moved on or reached a local optimum
        self._asked: tuple[S, float] | None = None  # the climb whose neighbour `propose` returned

    def observe(self, state: S, value: float) -> None:
        """A valued terminal (the caller reports the tree search's): a climb starts there if it is its
        region's best so far."""
        if self._improves_region(state, value):
            self._arrivals += 1
            heapq.heappush(self._heap, (-value, self._arrivals, state))

    def propose(self, known: Callable[[S], float | None]) -> S | None:
        """The next terminal the best live climb needs valued, one that `known` has no value for;
        None when no climb has work left (until a new region best is observed)."""
        while self._heap:
            negative, _, state = self._heap[0]
            value = -negative
            if state in self._ended or value < self._region_best[self.space.region(state)]:
                heapq.heappop(self._heap)  # moved on, or overtaken by a better terminal of its region
                continue
            pending = self._pending.get(state)
            if pending is None:
                self.climbs += 1
                pending = self._pending[state] = iter(self.space.neighbours(state))
            neighbour = next(pending, None)
            if neighbour is None:  # no better neighbour: a local optimum
                self._end(state)
                continue
            known_value = known(neighbour)
            if known_value is None:
                self._asked = (state, value)
                return neighbour
            self._take((state, value), neighbour, known_value)
        return None

    def report(self, state: S, value: float) -> None:
        """The value of the terminal `propose` returned last."""
        if self._asked is None:
            raise ValueError("report without a proposal")
        origin, self._asked = self._asked, None
        self._take(origin, state, value)

    def _take(self, origin: tuple[S, float], state: S, value: float) -> None:
        """A neighbour's value: the climb moves there if it is better and in its region; a region's
        new best starts a climb (the climb's next terminal, or another region's seed)."""
        if value > origin[1] and self.space.region(state) == self.space.region(origin[0]):
            self.moves += 1
            self._end(origin[0])
        self.observe(state, value)

    def _end(self, state: S) -> None:
        self._ended.add(state)
        self._pending.pop(state, None)

    def _improves_region(self, state: S, value: float) -> bool:
        """Record `value` in its region; whether it beats the region's best so far."""
        region = self.space.region(state)
        if value > self._region_best.get(region, -math.inf):
            self._region_best[region] = value
            return True
        return False
