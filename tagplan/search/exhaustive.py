"""Exhaustive enumeration of the decision process: ground truth for small instances."""

from __future__ import annotations

from collections.abc import Callable

from tagplan.search.space import PlanSpace, PlanState


def terminals(space: PlanSpace, limit: int) -> list[PlanState] | None:
    """Every complete plan state of `space` (depth-first, action order), or None past `limit`."""
    out: list[PlanState] = []
    stack = [PlanState()]
    while stack:
        state = stack.pop()
        if space.is_terminal(state):
            out.append(state)
            if len(out) > limit:
                return None
            continue
        stack.extend(space.step(state, a) for a in reversed(space.actions(state)))
    return out


def exhaustive(space: PlanSpace, evaluate: Callable[[PlanState], float], *,
               limit: int = 3000) -> tuple[PlanState, float, int] | None:
    """(best state, its value, states evaluated), or None when the space has more than `limit` plans."""
    states = terminals(space, limit)
    if not states:
        return None
    best, value = states[0], float("-inf")
    for state in states:
        v = evaluate(state)
        if v > value:
            best, value = state, v
    return best, value, len(states)
