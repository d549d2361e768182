"""Book-keeping shared by the histogram heuristics (SPFHP, LPFHP, best-fit decreasing).

Open packs are grouped by the space they have left. Each group is a stack of
(count, strategy) entries; a sorted list of the spaces that have a non-empty
stack lets a heuristic find the smallest or largest space that fits a length
in O(log N) instead of scanning every space.
"""

from __future__ import annotations

import bisect
from collections import defaultdict


class OpenPacks:
    """Packs that can still take sequences, keyed by tokens left; full ones are closed."""

    def __init__(self, max_sequence_length: int, depth: int):
        self.n = max_sequence_length
        self.depth = depth
        self._stacks: dict[int, list[list]] = defaultdict(list)  # space -> [[count, strategy]]
        self._spaces: list[int] = []  # sorted spaces with a non-empty stack
        self.closed: list[tuple[tuple[int, ...], int]] = []

    def place(self, strategy: tuple[int, ...], count: int) -> None:
        """Record `count` packs holding `strategy`; close them if no sequence can be added."""
        if count <= 0:
            return
        space = self.n - sum(strategy)
        if space == 0 or len(strategy) >= self.depth:
            self.closed.append((strategy, count))
            return
        if not self._stacks[space]:
            bisect.insort(self._spaces, space)
        self._stacks[space].append([count, strategy])

    def smallest_space_at_least(self, length: int) -> int | None:
        i = bisect.bisect_left(self._spaces, length)
        return self._spaces[i] if i < len(self._spaces) else None

    def largest_space(self) -> int | None:
        return self._spaces[-1] if self._spaces else None

    def pop(self, space: int) -> tuple[int, tuple[int, ...]]:
        """Remove and return the most recently placed (count, strategy) group with `space` left."""
        count, strategy = self._stacks[space].pop()
        if not self._stacks[space]:
            del self._stacks[space]
            self._spaces.remove(space)
        return count, strategy

    def push_back(self, space: int, count: int, strategy: tuple[int, ...]) -> None:
        """Return the untouched part of a popped group to the top of its stack."""
        if not self._stacks[space]:
            bisect.insort(self._spaces, space)
        self._stacks[space].append([count, strategy])

    def all_pairs(self) -> list[tuple[tuple[int, ...], int]]:
        """Closed and still-open packs together, as (strategy, count) pairs."""
        still_open = [(s, c) for stack in self._stacks.values() for c, s in stack]
        return self.closed + still_open
