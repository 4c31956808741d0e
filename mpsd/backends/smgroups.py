# Where an SM-capped client's green context lies on a real GPU. MPS's active thread percentage is a limit: a
# client holds at most that many SMs at once, any of them, so three tenants at 50% share the whole device (each
# took 1.5 times its alone time on the H200). A green context is a fixed set of SMs instead. The closest mapping
# built here: the device's SMs are cut once into the driver's smallest groups ("chunks", 8 SMs on an H200, the
# remainder one more), laid out as a ring, and each capped client gets a window of consecutive chunks holding at
# least its cap. Windows may overlap, as the SMs of MPS clients do, and each new one is placed where it leaves
# the worst-off tenant (its own window too) the most SMs, counting an SM shared by k windows as 1/k of one, so
# that tenants at 50% get different but overlapping halves spread over the device (a share counts no more than
# its tenant's cap: MPS lets no client hold more).
#
# Measured on the H200 (bench/fidelity/measure_green.py, green_h200.json): green contexts over overlapping chunks
# of one split are made and run side by side; two windows of 72 and 76 SMs overlapping on 16 ran 20 full waves
# each in 40.1 and 41.1 ms, where MPS at 50% took 40.6 and disjoint groups (72 and the 60 left) 40.1 and 60.1.
# Through the daemon (crosscheck_atp50_h200.txt) two tenants at 50% took 44.4 ms each (51.8 with the disjoint
# groups). Three at 50% are the limit of placing one tenant at a time in fixed windows: the first two cover the
# device, the third shares the second's, and they took 61, 75 and 76 ms where MPS took 60 each (three windows
# spaced evenly from the start: 63 to 64).
"""Overlapping SM windows for capped clients."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["choose_window", "shares", "windows"]


def windows(sizes: Sequence[int], cap: int) -> list[tuple[int, ...]]:
    """Every window of consecutive chunks (of `sizes` SMs, a ring) that holds at least `cap` SMs, the shortest
    from each start, by start; the whole ring where none holds fewer chunks."""
    n = len(sizes)
    found = []
    for start in range(n):
        sms, length = 0, 0
        while sms < cap and length < n:
            sms += sizes[(start + length) % n]
            length += 1
        found.append(tuple(sorted((start + i) % n for i in range(length))))
    return list(dict.fromkeys(found))  # a window found from two starts (the whole ring) counts once


def shares(sizes: Sequence[int], placed: Sequence[tuple[tuple[int, ...], int]]) -> list[float]:
    """What each placed (window, cap) may count on when all are busy: its SMs, one shared by k windows as 1/k of
    one, and no more than its cap (MPS lets no client hold more)."""
    load = [0] * len(sizes)
    for window, _ in placed:
        for chunk in window:
            load[chunk] += 1
    return [min(cap, sum(sizes[c] / load[c] for c in window)) for window, cap in placed]


def choose_window(sizes: Sequence[int], placed: Sequence[tuple[tuple[int, ...], int]], cap: int) -> tuple[int, ...]:
    """The window for a new client of `cap` SMs, beside the (window, cap) pairs already `placed`: the one that
    leaves the worst-off tenant the most SMs (shares), then the most in all, then the fewest SMs past the cap,
    then the first."""
    best: tuple[tuple[float, float, int], tuple[int, ...]] | None = None
    for window in windows(sizes, cap):
        after = shares(sizes, [*placed, (window, cap)])
        score = (-round(min(after), 6), -round(sum(after), 6), sum(sizes[c] for c in window))
        if best is None or score < best[0]:
            best = (score, window)
    assert best is not None
    return best[1]
