"""The positional builders of the two objects the daemon makes per launch (`Kernel.of`, `Launch.of`) give what
their dataclass's own constructor gives, field for field: a field added to either and left out of its builder
fails here."""
from __future__ import annotations

import dataclasses
import math

import pytest

from mpsd.backends.ops import Extent, Launch, Plan
from mpsd.sim import H200, Kernel, kernel_cost


def _fields(obj: object) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)  # an unset slot raises
        out[f.name] = "nan" if isinstance(value, float) and math.isnan(value) else value
    return out


@pytest.mark.parametrize("sm_cap", [None, 7])
def test_kernel_of_is_kernel(sm_cap):
    cost = kernel_cost(H200, "spin", 4, 128, [1000])
    after = (Kernel(client=2, stream=0, blocks=1, threads=32, cost=cost),)
    built = Kernel.of(1, (1, 3), after, 4, 128, cost, 1024, -2, sm_cap)
    made = Kernel(client=1, stream=(1, 3), after=after, blocks=4, threads=128, cost=cost, smem=1024, priority=-2,
                  sm_cap=sm_cap)
    assert type(built) is Kernel and _fields(built) == _fields(made)


def test_launch_of_is_launch():
    extents = ((0, Extent(None, 8, 64)), (1, None))
    plan = Plan("fill_f32", (2, 1, 1), (32, 1, 1), 0, (4096, 1.0, 16), ((0, 64),))
    built = Launch.of(1, (1, 2), -1, 33, plan, extents)
    made = Launch(client=1, stream=(1, 2), priority=-1, sm_cap=33, plan=plan, extents=extents)
    assert type(built) is Launch and _fields(built) == _fields(made)
