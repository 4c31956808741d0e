"""The placement rule's shortcuts (one SM with room, closed form when the SM cap cannot bind) choose exactly
what placing one block at a time on the SM with the most room chooses (the engine's rule, compiled:
mpsd._core.spread)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd import _core


def spread(fits, left, budget, occupied, lo, hi, room):
    """The compiled rule, called as the engine calls it (a budget below 0 is one that is spent)."""
    return _core.spread(fits, left, max(budget, 0), set(occupied), lo, hi, sorted(room) if room is not None else None)


def one_block_at_a_time(fits, left, budget, occupied, lo, hi):
    """The rule as stated: each block goes to the usable SM with the most room left, lowest index on ties
    (rounds by level, so a grid spreads before it stacks); SMs not yet used cost a unit of budget."""
    room = {i: fits[i] for i in range(lo, hi) if fits[i]}
    taken: dict[int, int] = {}
    for level in range(max(room.values(), default=0), 0, -1):
        for i in sorted(room):
            if room[i] < level or not left:
                continue
            if i not in taken and i not in occupied:
                if budget <= 0:
                    continue
                budget -= 1
            taken[i] = taken.get(i, 0) + 1
            left -= 1
    return sorted(taken.items())


@settings(max_examples=400, deadline=None)
@given(
    fits=st.lists(st.integers(0, 6), min_size=1, max_size=12),
    left=st.integers(1, 40),
    budget=st.integers(-1, 12),
    occupied_mask=st.lists(st.booleans(), min_size=12, max_size=12),
    window=st.tuples(st.integers(0, 11), st.integers(0, 12)),
    with_room=st.booleans(),
)
def test_spread_matches_block_by_block_placement(fits, left, budget, occupied_mask, window, with_room):
    """Every shortcut of spread gives the block-by-block answer, with or without the room set."""
    n = len(fits)
    lo, hi = min(window[0], n - 1), max(min(window[1], n), min(window[0], n - 1))
    occupied = {i: 1 for i in range(n) if occupied_mask[i]}
    room = {i for i in range(lo, hi) if fits[i]} if with_room else None
    got = spread(fits, left, budget, occupied, lo, hi, room)
    assert got == one_block_at_a_time(fits, left, budget, occupied, lo, hi)
