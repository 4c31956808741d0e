# The fidelity table as tests on the simulator alone: every figure measured on a real H200 (with and without
# MPS: the reference and two runs of bench/fidelity/measure_timing.py) against the model, within 5%. Rows
# the model cannot meet yet are strict-xfail, each with the reason, so that a model that improves turns them
# into failures to update here. Calibration rows (the empty kernel alone) are not tested as matches; the
# figures calibrated from them are checked against DeviceSpec instead.
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

from mpsd.sim import H200

sys.path.insert(0, str(Path(__file__).parent.parent / "bench" / "fidelity"))
import compare  # noqa: E402

TOLERANCE = 0.05

JITTER = ("the model has no host jitter: an idle tenant's p99 is the host's scheduling noise (a launch call "
          "after a 5-ms sleep takes 10 to 120 us)")
HOST_STATE = ("one host latency: launches back to back cost the host ~6 us, launches after a 5-ms sleep ~60 us; "
              "the model has the one figure, calibrated after a sleep")
OVERHEAD = ("DeviceSpec.kernel_overhead (10 us, pinned by exact timeline tests) is more than the 1 to 2 us a "
            "real H200 leaves between back-to-back kernels (6 to 9 us for empty ones); short kernels show it")
HOST_SPREAD = ("host latency differs between runs and processes (the empty kernel's p50 was 0.041 to 0.076 ms "
               "in four measurements); this row lies outside the model's one calibrated figure")


def known_miss(r: dict) -> str | None:
    """Why a row is expected to miss 5%, or None if it must match."""
    row, figure, key = r["row"], r["figure"], (r["source"], r["row"], r["mode"], r["figure"])
    if "beside" not in row and figure == "p99 ms" and "1.0 ms" not in row:
        return JITTER
    if "empty kernel, back to back" in row:
        return HOST_STATE
    if "empty kernel back to back" in row or "FULL spin 0.05 ms" in row or (
            "QUARTER work 0.1 ms-wave" in row and not ("beside" in row and (r["mode"] == "mps" or "tenant 0" in row))):
        return OVERHEAD
    if key in {("reference", "latency tenant alone (8 x 0.1 ms blocks)", "no-mps", "p50 ms"),
               ("run 2", "alone: FULL 0.1 ms spin, sleep 5 ms", "no-mps", "p50 ms"),
               ("run 2", "alone: 8 x 0.01 ms spin, sleep 5 ms", "mps", "p50 ms"),
               ("run 2", "probe beside FULL 1-ms spin, closed loop, sleep 5 ms", "mps", "p50 ms")}:
        return HOST_SPREAD
    return None


@functools.cache
def table() -> dict[tuple[str, str, str, str], dict]:
    return {(r["source"], r["row"], r["mode"], r["figure"]): r for r in compare.rows() if not r["calibration"]}


def _cases():
    for key, r in table().items():
        reason = known_miss(r)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        yield pytest.param(key, marks=marks, id=" / ".join(key))


@pytest.mark.parametrize("key", list(_cases()))
def test_measured_figure_within_five_percent(key):
    """The simulated figure is within 5% of what the real H200 measured."""
    row = table()[key]
    assert abs(row["error"]) <= TOLERANCE, f"measured {row['measured']}, simulated {row['simulated']:.4f}"


def test_host_latency_in_the_spec_is_what_the_measurements_give():
    """DeviceSpec's launch and synchronise latencies are the calibration's, not guesses (to 0.1 us)."""
    cal = compare.calibration()
    assert H200.launch_latency == pytest.approx(cal["launch_latency"], abs=1e-7)
    assert H200.sync_latency == pytest.approx(cal["sync_latency"], abs=1e-7)


def test_time_slice_calibration_agrees_between_two_and_three_processes():
    """The switch cost read from 2 and from 3 time-sliced processes is one figure: the model's shape
    (slice, then a switch into each other context) fits what globaltimer showed."""
    cal = compare.calibration()
    assert 1.5e-3 < cal["timeslice"] < 2.5e-3 and 0 < cal["switch"] < 0.5e-3
