# The ready queue: kernels past their launch overhead with blocks left to place, and the keys that let a
# dispatch stop early. Kept apart from the engine because it is bookkeeping with one job, asked the same
# three questions by every policy ("who is ready, in hardware order?", "which of them could place a block?",
# "is everything full?"), and none of it touches time or events.
# Why keys: a kernel's key names its block shape and the SM window its client may use; kernels with equal
# keys compete for the very same room, so a key found without room for one block stands for all of them.
# Placing only takes room, so a key filed full stays full until the dispatch ends, and once every key of the
# ready kernels is full nothing more can be placed: a pass stops there instead of walking a long queue.
"""Ready kernels in hardware order, keyed by (block shape, SM window)."""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable

from .policies.base import KernelRun, mps_key, spread
from .sms import FitIndex

__all__ = ["ReadyQueue"]


class ReadyQueue:
    """Kernels with blocks to place, in hardware order (``mps_key``), and their keys.

    Args:
        fit_index: the device's fit tables (a key's table is filed under the key itself).
        sm_count: SMs on the device (the window of a client the policy does not restrict).
        window_of: the policy's ``window(client)``, asked once per client until ``forget_windows``.

    Attributes:
        runs: the ready kernels, by ``mps_key`` (policies read it; do not modify). A kernel that placed its
            last block stays until ``prune``.
        counts: key -> ready kernels with that key and blocks unplaced.
        full: keys found with no room during the current dispatch (cleared when one begins).
        version: changes whenever ``runs`` or their keys change (a kernel added, drained ones pruned,
            cancelled ones dropped, keys recounted), so a policy may keep what it derives from ``runs``
            until then.
    """

    def __init__(self, fit_index: FitIndex, sm_count: int,
                 window_of: Callable[[int], tuple[int, int] | None]) -> None:
        self.runs: list[KernelRun] = []
        self.counts: dict[int, int] = {}
        self.full: set[int] = set()
        self.drained = False  # a ready kernel placed its last block during this dispatch
        self.version = 0
        self._fit_index = fit_index
        self._sm_count = sm_count
        self._window_of = window_of
        self._windows: dict[int, tuple[int, int] | None] = {}  # client -> window_of(client), cached
        self._keys: dict[tuple, int] = {}  # (shape, window) -> a small integer naming it (a run's key)
        self.parts: list[tuple] = []  # and back: key -> (shape, window, need, lo, hi)

    def window(self, client: int) -> tuple[int, int] | None:
        """The SM window the policy gives ``client`` (cached)."""
        window = self._windows.get(client, 0)
        if window == 0:
            window = self._windows[client] = self._window_of(client)
        return window

    def key(self, run: KernelRun) -> int:
        """``run``'s key: a small integer naming (its shape, its client's window)."""
        window = self.window(run.kernel.client)
        key = self._keys.get((run.shape, window))
        if key is None:
            key = self._keys[run.shape, window] = len(self.parts)
            lo, hi = window or (0, self._sm_count)
            self.parts.append((run.shape, window, run.need, lo, hi))
        return key

    def lookup(self, key: int) -> tuple[list[int], set[int]]:
        """The fit table of ``key``'s shape in its window: (fits by SM, SMs of the window with room)."""
        _, _, need, lo, hi = self.parts[key]
        return self._fit_index.lookup(key, need, lo, hi)

    def add(self, run: KernelRun) -> None:
        """``run`` has blocks to place: file it in hardware order, and count its key."""
        run.key = key = self.key(run)
        runs = self.runs
        if runs and mps_key(run) < mps_key(runs[-1]):
            insort(runs, run, key=mps_key)
        else:  # the usual case: it became ready after every kernel already waiting
            runs.append(run)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.version += 1

    def drained_key(self, key: int) -> None:
        """A ready kernel of ``key`` placed its last block (it leaves ``runs`` at the next ``prune``)."""
        self.drained = True
        n = self.counts[key] - 1
        if n:
            self.counts[key] = n
        else:
            del self.counts[key]

    def prune(self) -> None:
        """Drop the kernels that placed their last block during the dispatch just ended."""
        if self.drained:
            self.runs = [r for r in self.runs if r.unplaced]
            self.drained = False
            self.version += 1

    def drop_cancelled(self) -> None:
        """Drop the kernels of cancelled clients and recount the keys."""
        self.runs = [r for r in self.runs if not r.cancelled]
        self.rekey()

    def forget_windows(self) -> None:
        """The policy's windows may have changed (a client was configured): ask again, and recount."""
        self._windows.clear()
        self.rekey()

    def rekey(self) -> None:
        """Recount the keys of the ready kernels (a window or the ready set changed wholesale)."""
        self.version += 1
        self.counts = counts = {}
        for run in self.runs:
            if run.unplaced:
                run.key = key = self.key(run)
                counts[key] = counts.get(key, 0) + 1

    def open_keys(self) -> set[int]:
        """The keys of ready kernels that have room in their window (the others are filed full)."""
        full = self.full
        rooms = self._fit_index.rooms
        open_keys = set()
        for key in self.counts:
            if key in full:
                continue
            room = rooms.get(key)
            if room is None:
                room = self.lookup(key)[1]
            if room:
                open_keys.add(key)
            else:
                full.add(key)
        return open_keys

    def close_keys(self, open_keys: set[int]) -> None:
        """Drop from ``open_keys`` (and file full) the keys a placement has just filled up."""
        rooms = self._fit_index.rooms
        for key in [k for k in open_keys if not rooms[k]]:
            open_keys.discard(key)
            if key in self.counts:  # not one whose last kernel just drained: saturated counts only ready keys
                self.full.add(key)

    def saturated(self) -> bool:
        """True if no ready kernel can place another block in this dispatch: every (shape, window) they
        have was found full, and placing only takes room. A policy may stop offering capacity then; every
        further ``Simulator._place`` would return 0 and change nothing."""
        return len(self.full) >= len(self.counts)

    def stranded(self, client_sms: dict[int, dict[int, int]]) -> int:
        """Blocks of ready kernels that would fit now on SMs their client may use, yet wait
        (``Simulator.stranded_blocks``).

        Args:
            client_sms: client -> SM index -> its resident blocks there.
        """
        total = 0
        for run in self.runs:
            if run.cancelled or not run.unplaced:
                continue
            occupied = client_sms.get(run.kernel.client, {})
            fits, room = self.lookup(run.key)
            cap = run.kernel.sm_cap
            budget = len(fits) if cap is None else cap - len(occupied)
            lo, hi = self.parts[run.key][3:]
            total += sum(n for _, n in spread(fits, run.unplaced, budget, occupied, lo, hi, room))
        return total
