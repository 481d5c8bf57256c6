"""Pareto frontier of plans over (iteration time, peak memory per device, GPUs used)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class HasObjectives(Protocol):
    """Anything with the three objectives (all minimised)."""

    @property
    def objectives(self) -> tuple[float, float, float]: ...


T = TypeVar("T", bound=HasObjectives)


def dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Whether `a` is no worse than `b` everywhere and better somewhere (all minimised)."""
    return all(x <= y for x, y in zip(a, b, strict=True)) and any(x < y for x, y in zip(a, b, strict=True))


def frontier(items: Sequence[T]) -> list[T]:
    """The non-dominated items, by increasing first objective; exact duplicates keep the first."""
    ordered = sorted(items, key=lambda item: item.objectives)
    out: list[T] = []
    for item in ordered:
        if any(dominates(kept.objectives, item.objectives) or kept.objectives == item.objectives for kept in out):
            continue
        out.append(item)
    return out
