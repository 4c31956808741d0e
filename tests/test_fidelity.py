# The fidelity table as tests on the simulator alone: every figure measured on a real H200 (with and without
# MPS) against the model, within 5%. The latency rows are known misses (the model has no host launch and
# synchronise latency yet, and the saturating tenant's phase differs), marked strict-xfail so that fixing
# the model turns them into failures to update here.
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench" / "fidelity"))
import compare  # noqa: E402

TOLERANCE = 0.05


@functools.cache
def table() -> dict[tuple[str, str, str], dict]:
    return {(r["row"], r["mode"], r["figure"]): r for r in compare.rows()}


def _cases():
    for key in table():
        marks = []
        if key[0].startswith("latency") and not (key[0].endswith("waves") and key[1:] == ("mps", "p99 ms")):
            marks.append(pytest.mark.xfail(strict=True, reason="no host launch/sync latency in the model yet"))
        yield pytest.param(key, marks=marks, id=" / ".join(key))


@pytest.mark.parametrize("key", list(_cases()))
def test_measured_figure_within_five_percent(key):
    """The simulated figure is within 5% of what the real H200 measured."""
    row = table()[key]
    assert abs(row["error"]) <= TOLERANCE, f"measured {row['measured']}, simulated {row['simulated']:.4f}"
