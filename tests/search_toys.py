"""Toy decision processes the search tests share (`from search_toys import Digits`; tests/ is on the
test path: pyproject's `pythonpath`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

Digits_ = tuple[int, ...]


@dataclass(frozen=True)
class Digits:
    """Choose d1..dk in 0..base-1, one per step; the default policy fills the rest with zeros."""

    base: int
    length: int

    def actions(self, state: Digits_) -> list[int]:
        return [] if len(state) >= self.length else list(range(self.base))

    def step(self, state: Digits_, action: int) -> Digits_:
        return (*state, action)

    def is_terminal(self, state: Digits_) -> bool:
        return len(state) >= self.length

    def complete(self, state: Digits_) -> Digits_:
        return state + (0,) * (self.length - len(state))

    def leaves(self) -> list[Digits_]:
        return list(itertools.product(range(self.base), repeat=self.length))
