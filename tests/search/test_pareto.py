from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from tagplan.search.pareto import dominates, frontier


@dataclass(frozen=True)
class P:
    objectives: tuple[float, float, float]


@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 4)).map(
    lambda t: P(tuple(float(x) for x in t))), max_size=30))
def test_frontier_is_exactly_the_non_dominated_set(points: list[P]) -> None:
    front = frontier(points)
    for f in front:
        assert not any(dominates(p.objectives, f.objectives) for p in points)
    for p in points:
        assert p in front or any(dominates(f.objectives, p.objectives) or f.objectives == p.objectives for f in front)
    assert len({f.objectives for f in front}) == len(front)
