# Where capped clients' green contexts lie on a real GPU (mpsd.backends.smgroups): windows of the driver's smallest
# SM groups that overlap as MPS clients' SMs do, spread over the device. Pure functions: no GPU needed. The
# chunks are an H200's as its driver cuts them (15 groups of 8 SMs and 12 left over, bench/fidelity/green_h200.json).
from __future__ import annotations

from mpsd.backends.smgroups import choose_window, shares, windows

H200_CHUNKS = [8] * 15 + [12]
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
