# A sorted set of ints for the address-space indexes (mpsd.runtime.memory). A plain sorted list with bisect.insort
# searches in O(log n) but moves half the list on every insert and delete: a C memmove, cheap at a thousand
# entries and 10 us of every malloc and free at 50,000. Here the ints are cut into blocks of at most
# 2 * LOAD, each a sorted list, with the first int of each block in a list of its own: a search bisects the
# firsts and then one block, and an insert or delete moves at most one block (the list of firsts changes only
# when a block splits or empties, and is n / LOAD long).
from __future__ import annotations

import bisect
from typing import Iterator

LOAD = 512


class SortedInts:
    """Distinct ints in ascending order, with O(log n) search and inserts and deletes that move at most a
    block of 2 * LOAD."""

    __slots__ = ("_blocks", "_firsts", "_len")

    def __init__(self) -> None:
        self._blocks: list[list[int]] = []  # never an empty one
        self._firsts: list[int] = []  # _blocks[i][0], for bisecting
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for block in self._blocks:
            yield from block

    def emptied(self) -> Iterator[None]:
        """Let go of every int, a block at a time, yielding after each (for an index no longer used, whose ints
        would all be freed at once otherwise)."""
        blocks = self._blocks
        self._firsts.clear()
        self._len = 0
        while blocks:
            blocks.pop()
            yield

    def first(self) -> int | None:
        """The smallest, or None when empty."""
        return self._firsts[0] if self._firsts else None

    def floor(self, value: int) -> int | None:
        """The largest int at most `value`, or None if there is none."""
        index = bisect.bisect_right(self._firsts, value) - 1
        if index < 0:
            return None
        block = self._blocks[index]
        return block[bisect.bisect_right(block, value) - 1]

    def add(self, value: int) -> None:
        """Insert `value`, which must not be here already."""
        self._len += 1
        if not self._blocks:
            self._blocks.append([value])
            self._firsts.append(value)
            return
        index = max(0, bisect.bisect_right(self._firsts, value) - 1)
        block = self._blocks[index]
        bisect.insort(block, value)
        self._firsts[index] = block[0]
        if len(block) > 2 * LOAD:
            self._blocks.insert(index + 1, block[LOAD:])
            self._firsts.insert(index + 1, block[LOAD])
            del block[LOAD:]

    def remove(self, value: int) -> None:
        """Delete `value`, which must be here.

        Raises:
            KeyError: it is not.
        """
        index = bisect.bisect_right(self._firsts, value) - 1
        block = self._blocks[index] if index >= 0 else []
        position = bisect.bisect_left(block, value)
        if position == len(block) or block[position] != value:
            raise KeyError(value)
        del block[position]
        self._len -= 1
        if block:
            self._firsts[index] = block[0]
        else:
            del self._blocks[index]
            del self._firsts[index]
