# Where capped clients' green contexts lie on a real GPU (mpsd.backends.smgroups): windows of the driver's smallest
# SM groups that overlap as MPS clients' SMs do, spread over the device, all placed again as tenants come and go.
# Pure functions: no GPU needed. The chunks are an H200's as its driver cut them (15 groups of 8 SMs and 12 left
# over, bench/fidelity/green_h200.json); the placement of all tenants is also held to 16 groups of 8 and 4 left
# over (another cut of the same 132 SMs) and to a smaller device.
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.backends import smgroups
from mpsd.backends.smgroups import choose_window, place, shares, windows

H200_CHUNKS = [8] * 15 + [12]
LAYOUTS = [H200_CHUNKS, [8] * 16 + [4]]
HALF = 66  # 50% of 132 SMs, as MPS rounds it


def sms(window):
    return sum(H200_CHUNKS[c] for c in window)


def test_a_window_is_consecutive_chunks_holding_the_cap():
    found = windows(H200_CHUNKS, HALF)
    assert len(found) == len(H200_CHUNKS)
    for window in found:
        assert sms(window) >= HALF
        n, k = len(H200_CHUNKS), len(window)
        starts = [s for s in range(n) if tuple(sorted((s + i) % n for i in range(k))) == window]
        assert starts, window  # consecutive around the ring
        shorter = [(starts[0] + i) % n for i in range(k - 1)]
        assert sum(H200_CHUNKS[c] for c in shorter) < HALF  # the shortest run from its start
    assert windows(H200_CHUNKS, 200) == [tuple(range(16))]  # more than the device: all of it


def test_one_tenant_at_half_gets_the_closest_window_to_its_cap():
    window = choose_window(H200_CHUNKS, [], HALF)
    assert sms(window) == min(sms(w) for w in windows(H200_CHUNKS, HALF)) == 68


def test_two_tenants_at_half_get_different_overlapping_halves():
    first = choose_window(H200_CHUNKS, [], HALF)
    second = choose_window(H200_CHUNKS, [(first, HALF)], HALF)
    assert first != second and set(first) & set(second)
    assert set(first) | set(second) == set(range(16))  # the whole device is busy, as under MPS
    assert min(shares(H200_CHUNKS, [(first, HALF), (second, HALF)])) >= 64


def test_caps_that_fit_side_by_side_get_disjoint_windows():
    placed = []
    for _ in range(4):
        placed.append((choose_window(H200_CHUNKS, placed, 32), 32))
    seen = [c for window, _ in placed for c in window]
    assert len(seen) == len(set(seen))
    assert all(sms(window) >= 32 for window, _ in placed)


def test_a_tenant_that_left_frees_its_window_for_the_next():
    first = choose_window(H200_CHUNKS, [], 32)
    second = choose_window(H200_CHUNKS, [(first, 32)], 32)
    assert choose_window(H200_CHUNKS, [(second, 32)], 32) == first


def one_at_a_time(sizes, caps):
    """Windows as tenants arriving one by one got them before: each placed once, beside those already there."""
    placed = []
    for cap in caps:
        placed.append((choose_window(sizes, placed, cap), cap))
    return [window for window, _ in placed]


def worst_first(sizes, chosen, caps):
    return sorted(round(share, 6) for share in shares(sizes, list(zip(chosen, caps))))


def load(chosen):
    return [sum(chunk in window for window in chosen) for chunk in range(max(map(max, chosen)) + 1)]


@pytest.mark.parametrize("sizes", LAYOUTS, ids=["15x8+12", "16x8+4"])
def test_three_tenants_at_half_end_spaced_evenly(sizes):
    caps = [HALF] * 3
    before = one_at_a_time(sizes, caps)
    chosen = place(sizes, [(window, HALF) for window in before])  # the third arrived: all are placed again
    got = worst_first(sizes, chosen, caps)
    assert got[-1] - got[0] <= min(sizes[:-1])  # equal within a chunk
    assert got[0] >= sum(sizes) / 3 - min(sizes[:-1])
    assert got[0] > worst_first(sizes, before, caps)[0]  # the one at a time placement left one far worse off
    assert all(1 <= k <= 2 for k in load(chosen))  # no chunk idle, none under all three


@pytest.mark.parametrize("sizes", LAYOUTS, ids=["15x8+12", "16x8+4"])
def test_two_tenants_at_half_get_halves_that_share_one_chunk_at_most(sizes):
    # 66 SMs is no whole number of chunks: two windows of at least 66 must share some SMs of 132.
    first, second = place(sizes, [(None, HALF)] * 2)
    assert set(first) | set(second) == set(range(len(sizes)))
    assert len(set(first) & set(second)) <= 1
    assert min(shares(sizes, [(first, HALF), (second, HALF)])) >= HALF - 2


@pytest.mark.parametrize("sizes", LAYOUTS, ids=["15x8+12", "16x8+4"])
def test_one_leaving_lets_the_others_spread(sizes):
    three = place(sizes, [(None, HALF)] * 3)
    stay = three[:2]
    spread = place(sizes, [(window, HALF) for window in stay])
    assert spread != stay
    assert worst_first(sizes, spread, [HALF] * 2)[0] > worst_first(sizes, stay, [HALF] * 2)[0]
    assert set(spread[0]) | set(spread[1]) == set(range(len(sizes)))


@pytest.mark.parametrize("sizes", LAYOUTS, ids=["15x8+12", "16x8+4"])
@pytest.mark.parametrize("caps", [[32] * 4, [HALF, 32, 32], [40, 40, 40], [24, 16, 48, 8]])
def test_caps_that_sum_below_the_device_stay_disjoint(sizes, caps):
    chosen = place(sizes, [(None, cap) for cap in caps])
    assert max(load(chosen)) == 1
    assert worst_first(sizes, chosen, caps) == sorted(caps)


def test_moving_costs_something_so_a_tie_keeps_the_current_windows():
    # Two tenants of 32 anywhere disjoint are as well off as anywhere else: neither moves, not even for a third.
    current = [tuple(range(4, 8)), tuple(range(9, 13))]
    assert place(H200_CHUNKS, [(window, 32) for window in current]) == current
    assert place(H200_CHUNKS, [*((window, 32) for window in current), (None, 32)])[:2] == current


def test_many_tenants_are_placed_by_descent_and_gain_on_one_at_a_time():
    caps = [32] * 6  # too many placements to weigh one by one
    tenants = [(None, cap) for cap in caps]
    assert smgroups.EXACT_LIMIT < len(list(itertools.combinations_with_replacement(windows(H200_CHUNKS, 32), 6)))
    chosen = place(H200_CHUNKS, tenants)
    assert worst_first(H200_CHUNKS, chosen, caps) > worst_first(H200_CHUNKS, one_at_a_time(H200_CHUNKS, caps), caps)


CAPS = st.integers(2, 130)
SIZES = st.sampled_from([*LAYOUTS, [8] * 8 + [4]])


@settings(max_examples=40, deadline=None)
@given(SIZES, st.lists(CAPS, min_size=1, max_size=6), st.data())
def test_placing_all_together_is_never_worse_than_one_at_a_time(sizes, caps, data):
    caps = [min(cap, sum(sizes)) for cap in caps]
    chosen = place(sizes, [(None, cap) for cap in caps])
    assert all(window in windows(sizes, cap) for window, cap in zip(chosen, caps))
    before = one_at_a_time(sizes, caps)
    assert worst_first(sizes, chosen, caps) >= worst_first(sizes, before, caps)
    assert min(shares(sizes, list(zip(chosen, caps)))) >= min(shares(sizes, list(zip(before, caps)))) - 1e-6
    # A newcomer beside tenants already placed: never worse than placing it alone beside them.
    cap = min(data.draw(CAPS), sum(sizes))
    added = place(sizes, [*zip(chosen, caps), (None, cap)])
    alone = [*chosen, choose_window(sizes, list(zip(chosen, caps)), cap)]
    assert worst_first(sizes, added, [*caps, cap]) >= worst_first(sizes, alone, [*caps, cap])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(2, 68), min_size=1, max_size=3))
def test_the_exact_search_finds_the_best_placement(caps):
    sizes = [8] * 8 + [4]
    best = max(worst_first(sizes, combo, caps) for combo in itertools.product(*(windows(sizes, c) for c in caps)))
    assert worst_first(sizes, place(sizes, [(None, cap) for cap in caps]), caps) == best
