# mpsd.runtime.sorted_ints.SortedInts, the block list under the address-space indexes, against a plain sorted list
# through enough inserts and deletes that blocks split, shrink and empty.
from __future__ import annotations

import bisect
import random

import pytest

from mpsd.runtime.sorted_ints import LOAD, SortedInts


def test_sorted_ints_agree_with_a_sorted_list():
    """Membership, order, first and floor stay those of a sorted list through splits and emptied blocks."""
    rng = random.Random(5)
    ours, model = SortedInts(), []
    for step in range(40_000):
        grow = (step // 10_000) % 2 == 0  # phases that grow to a few blocks of 2 * LOAD, then shrink to none
        if model and (rng.random() < (0.2 if grow else 0.8)):
            value = model[rng.randrange(len(model))]
            ours.remove(value)
            model.remove(value)
        else:
            value = rng.randrange(64 * LOAD)
            if model[bisect.bisect_left(model, value):][:1] == [value]:
                continue
            ours.add(value)
            bisect.insort(model, value)
        probe = rng.randrange(-1, 64 * LOAD + 1)
        below = bisect.bisect_right(model, probe)
        assert ours.floor(probe) == (model[below - 1] if below else None)
        assert ours.first() == (model[0] if model else None)
        assert len(ours) == len(model)
    assert list(ours) == model


def test_removing_an_absent_int_is_a_key_error():
    """remove() of an int that is not there raises KeyError and changes nothing."""
    ours = SortedInts()
    with pytest.raises(KeyError):
        ours.remove(3)
    ours.add(5)
    with pytest.raises(KeyError):
        ours.remove(3)
    assert list(ours) == [5]
