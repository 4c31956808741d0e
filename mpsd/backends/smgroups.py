# Where an SM-capped client's green context lies on a real GPU. MPS's active thread percentage is a limit: a
# client holds at most that many SMs at once, any of them, so three tenants at 50% share the whole device (each
# took 1.5 times its alone time on the H200). A green context is a fixed set of SMs instead. The closest mapping
# built here: the device's SMs are cut once into the driver's smallest groups ("chunks", 8 SMs on an H200, the
# remainder one more), laid out as a ring, and each capped client gets a window of consecutive chunks holding at
# least its cap. Windows may overlap, as the SMs of MPS clients do. What a tenant may count on when all are busy
# is its share: an SM under k windows counts as 1/k of one, and no share counts past its tenant's cap (MPS lets
# no client hold more).
#
# Whenever a capped tenant comes or goes, the windows of all of them are chosen again (place): the best
# placement is the one whose shares, worst first, are the greatest, so the worst-off tenant keeps the most, then
# the next. Moving a client costs something (new streams, work queued on the old SMs runs out there), so among
# placements as good as each other the one that moves the fewest wins; then the one with the fewest SMs under
# two windows (caps that fit side by side stay disjoint), then the fewest SMs past the caps. Where the
# placements are few it is exact: every multiset of windows for each cap is weighed at once with numpy (tenants
# of one cap are interchangeable, so three at 50% on an H200 are 816 placements, not 4096), at most
# EXACT_LIMIT of them (25 ms or less on a 2-core build machine). Past that (on an H200: five tenants of one
# cap, or four of more than one cap), coordinate descent from the current windows, a newcomer first given the
# window a lone arrival gets (choose_window): each tenant in turn takes the window that makes the shares
# greater, until none moves. Neither is ever worse than placing tenants one at a time, which is what this
# module did before: windows placed on arrival and never moved left the third tenant at 50% on SMs the first
# two held.
#
# Measured on the H200 (bench/fidelity/measure_green.py, green_h200.json): green contexts over overlapping chunks
# of one split are made and run side by side; two windows of 72 and 76 SMs overlapping on 16 ran 20 full waves
# each in 40.1 and 41.1 ms, where MPS at 50% took 40.6 and disjoint groups (72 and the 60 left) 40.1 and 60.1.
# Through the daemon (crosscheck_atp50_h200.txt) two tenants at 50% took 45.9 ms each (51.8 with the disjoint
# groups). Three at 50%, placed one at a time, took 61, 75 and 76 ms where MPS took 60 each; placed together they
# get shares of 44 SMs each (windows of 68, 72 and 72 SMs, every chunk under one or two of them) and took 62.6 to
# 63.7. Four at 25% (crosscheck_atp25_h200.txt) take disjoint windows, one of them 36 SMs (the 12-SM remainder
# among three chunks of 8), whose tenant ran in 81 ms where MPS holds it to its 32 and 100 ms.
"""Overlapping SM windows for capped clients, placed all together."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

__all__ = ["choose_window", "place", "shares", "windows"]

EXACT_LIMIT = 10_000  # placements weighed at once in the exact search; past it, coordinate descent
ROUNDS = 8  # passes of coordinate descent at most (each pass moves every tenant at most once)


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


def place(sizes: Sequence[int], tenants: Sequence[tuple[tuple[int, ...] | None, int]]) -> list[tuple[int, ...]]:
    """Windows for all capped tenants together, each given as (its current window, None for one that has none
    yet, and its cap), in the same order: the placement whose shares, worst first, are the greatest (the
    worst-off tenant keeps the most, then the next, ...), then the one that moves the fewest tenants from their
    current windows, then the one with the fewest SMs under more than one window, then the fewest SMs past the
    caps. Exact where the placements to weigh are few (tenants of one cap are interchangeable, so a cap's
    windows are weighed as a multiset), else coordinate descent from the current windows, each newcomer first
    given its window one at a time (choose_window): neither is ever worse than that start."""
    if not tenants:
        return []
    caps = sorted({cap for _, cap in tenants})
    count = math.prod(math.comb(len(windows(sizes, cap)) + k - 1, k)
                      for cap, k in Counter(cap for _, cap in tenants).items())
    if count <= EXACT_LIMIT:
        return _exact(sizes, tenants, caps)
    return _descend(sizes, tenants)


def _leximin(sizes: Sequence[int], placed: Sequence[tuple[tuple[int, ...], int]]) -> tuple[float, ...]:
    return tuple(sorted(round(share, 6) for share in shares(sizes, placed)))


def _overlap(sizes: Sequence[int], chosen: Sequence[tuple[int, ...]]) -> int:
    """SMs under more than one window, each counted once for every window past the first."""
    load = Counter(c for window in chosen for c in window)
    return sum(sizes[c] * (k - 1) for c, k in load.items())


def _descend(sizes: Sequence[int], tenants: Sequence[tuple[tuple[int, ...] | None, int]]) -> list[tuple[int, ...]]:
    """Coordinate descent: each tenant in turn takes the window that makes the shares, worst first, greater given
    the others' (the fewest shared SMs, then the fewest past its cap, among several), until none moves."""
    caps = [cap for _, cap in tenants]
    chosen: list[tuple[int, ...]] = []
    for window, cap in tenants:
        chosen.append(window if window is not None else choose_window(sizes, list(zip(chosen, caps)), cap))
    for _ in range(ROUNDS):
        moved = False
        for i, cap in enumerate(caps):
            best = _leximin(sizes, list(zip(chosen, caps)))
            pick: tuple[tuple[int, int], tuple[int, ...]] | None = None
            for window in windows(sizes, cap):
                trial = [*chosen[:i], window, *chosen[i + 1:]]
                score = _leximin(sizes, list(zip(trial, caps)))
                tie = (_overlap(sizes, trial), sum(sizes[c] for c in window))
                if score > best or (pick is not None and score == best and tie < pick[0]):
                    best, pick = score, (tie, window)
            if pick is not None:
                chosen[i], moved = pick[1], True
        if not moved:
            break
    return chosen


def _exact(sizes: Sequence[int], tenants: Sequence[tuple[tuple[int, ...] | None, int]],
           caps: Sequence[int]) -> list[tuple[int, ...]]:
    """Every placement weighed at once (numpy), a multiset of windows for each cap."""
    size = np.asarray(sizes, dtype=float)
    cells, columns, kept, extra = [], [], [], []  # per cap: its windows' chunks, the tenants, and per multiset
    for cap in caps:
        members = [i for i, (_, c) in enumerate(tenants) if c == cap]
        found = windows(sizes, cap)
        incidence = np.zeros((len(found), len(sizes)))
        for row, window in enumerate(found):
            incidence[row, list(window)] = 1
        combos = np.array(list(itertools.combinations_with_replacement(range(len(found)), len(members))))
        held = Counter(found.index(w) for i in members if (w := tenants[i][0]) is not None and w in found)
        counts = np.stack([(combos == row).sum(1) for row in range(len(found))], axis=1)
        stays = sum(np.minimum(counts[:, row], k) for row, k in held.items()) if held else np.zeros(len(combos))
        past = (incidence @ size - cap)[combos].sum(1)
        cells.append((found, incidence, combos))
        columns.extend(members)
        kept.append(stays)
        extra.append(past)
    pick = np.stack([grid.ravel() for grid in np.meshgrid(*[np.arange(len(c[2])) for c in cells], indexing="ij")],
                    axis=1)  # one row a placement: which multiset of each cap
    chunks = np.concatenate([cells[g][1][cells[g][2][pick[:, g]]] for g in range(len(cells))], axis=1)
    load = chunks.sum(1)  # (placements, chunks): windows over each chunk
    per_sm = np.divide(size, load, out=np.zeros_like(load), where=load > 0)
    cap_of = np.array([tenants[i][1] for i in columns], dtype=float)
    share = np.minimum((chunks * per_sm[:, None, :]).sum(2), cap_of).round(6)
    worst_first = np.sort(share, axis=1)
    stays = sum(kept[g][pick[:, g]] for g in range(len(cells)))
    past = sum(extra[g][pick[:, g]] for g in range(len(cells)))
    shared = (np.maximum(load - 1, 0) * size).sum(1)
    order = np.lexsort((np.arange(len(pick)), past, shared, -stays,
                        *(-worst_first[:, j] for j in reversed(range(worst_first.shape[1])))))
    best = pick[order[0]]
    chosen: list[tuple[int, ...] | None] = [None] * len(tenants)
    for g, (found, _, combos) in enumerate(cells):
        left = Counter(found[row] for row in combos[best[g]])
        members = [i for i, (_, c) in enumerate(tenants) if c == caps[g]]
        for i in members:  # whoever holds a window of the multiset keeps it
            if tenants[i][0] is not None and left[tenants[i][0]]:
                chosen[i] = tenants[i][0]
                left[tenants[i][0]] -= 1
        rest = sorted(left.elements())
        for i in members:
            if chosen[i] is None:
                chosen[i] = rest.pop(0)
    return chosen  # type: ignore[return-value]  # (every tenant has its window by now)
