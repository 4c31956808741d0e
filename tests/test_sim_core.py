"""The compiled core (mpsd.sim._core) against the Python rules it must match exactly."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.sim import _core
from mpsd.sim.policies.base import spread


@settings(max_examples=400, deadline=None)
@given(fits=st.lists(st.integers(0, 6), min_size=1, max_size=40), left=st.integers(1, 60),
       budget=st.integers(0, 45), occupied_bits=st.integers(0, 2**40 - 1), window=st.tuples(st.integers(0, 39),
       st.integers(0, 39)), with_room=st.booleans())
def test_spread_matches_python(fits, left, budget, occupied_bits, window, with_room):
    n = len(fits)
    lo, hi = sorted(w % n for w in window)
    hi += 1
    occupied = {i: 1 for i in range(n) if occupied_bits >> i & 1}
    room = {i for i, f in enumerate(fits) if f} if with_room else None
    want = spread(fits, left, budget, occupied, lo, hi, room)
    got = _core.spread(fits, left, budget, set(occupied), lo, hi, sorted(room) if room is not None else None)
    assert got == want
