# The fidelity table as tests on the simulator alone: every figure measured on a real H200 (with and without
# MPS: the reference and six runs of bench/fidelity/measure_timing.py) against the model, within 5%. Rows
# the model cannot meet yet are strict-xfail, each with the reason, so that a model that improves turns them
# into failures to update here. Calibration rows (the empty kernel alone, the batches of short spins) are not
# tested as matches; the figures calibrated from them are checked against DeviceSpec instead.
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest

from mpsd.sim import H200
from mpsd.sim.policies import POLICIES

sys.path.insert(0, str(Path(__file__).parent.parent / "bench" / "fidelity"))
import compare  # noqa: E402

TOLERANCE = 0.05

JITTER = ("the model has no host jitter: an idle tenant's p99 is the host's scheduling noise (a launch call "
          "after a 5-ms sleep takes 10 to 120 us)")
HOST_SPREAD = ("host latency differs between runs and processes (the empty kernel's p50 was 0.041 to 0.076 ms "
               "after a 5-ms sleep, 0.010 to 0.0128 ms back to back, in eight measurements each); this row lies "
               "outside the model's calibrated figures")
COOLING_SPREAD = ("how fast the host's latency rises with idle time differs between runs: after 1 ms spent busy, "
                  "an empty kernel took 35.5 and 19.7 us in run 3 (no MPS, MPS), 19.2 and 43.2 us in run 4; the "
                  "model's cooling time is fitted to run 3")
COOLING = ("after 1 ms spent busy, run 3's launch behind a 0.1-ms kernel had cooled far less (8 us above back to "
           "back) than behind an empty kernel (9 to 23 us above, the rows the cooling is fitted to); run 4's did "
           "not, and matches")
LAUNCH_RATE = ("kernels this short back to back are bound by the host's launch call, which took 5.6 to 9.0 us a "
               "kernel over four runs and two modes; the model's one figure (6.39 us) is the calls of run 3's "
               "back-to-back probe")
SMALL_GAP = ("1-block kernels back to back left 1.3 us between them on the device; the model's gap (2 us) is the "
             "one FULL spins showed")
FIRST_SLICE = ("which of two contexts released together the GPU serves first is a race: the model serves tenant "
               "0 (the memory-bound one) first; on the H200 it finished 2.6 ms later, about one slice and switch, "
               "as if the other had gone first")
REFERENCE_SPREAD = ("the reference measured this closed-loop probe beside the saturating tenant under MPS at "
                    "1.076 / 1.100 ms; runs 1 and 2 of the same loop gave 1.006 to 1.022 / 1.038 to 1.045 ms (also at "
                    "CLIENT_PRIORITY 1), which the model meets within 3%; it cannot be within 5% of both")

# Rows that a rule below calls a miss but that matched, by chance, in the data (strict xfails must not pass).
LUCKY = {("run 4", "alone: empty kernel, busy 300 us", "no-mps", "p99 ms")}
HOST_SPREAD_ROWS = {
    ("reference", "latency tenant alone (8 x 0.1 ms blocks)", "no-mps", "p50 ms"),
    ("run 2", "alone: FULL 0.1 ms spin, sleep 5 ms", "no-mps", "p50 ms"),
    ("run 2", "alone: 8 x 0.01 ms spin, sleep 5 ms", "mps", "p50 ms"),
    ("run 1", "alone: empty kernel, back to back", "no-mps", "p50 ms"),
    ("run 1", "alone: empty kernel, back to back", "mps", "p50 ms"),
    ("run 2", "alone: empty kernel, back to back", "no-mps", "p50 ms"),
    ("run 4", "alone: empty kernel, back to back", "no-mps", "p50 ms"),
    ("run 4", "alone: empty kernel, back to back", "mps", "p50 ms"),
    ("run 4", "alone: empty kernel, sleep 5 ms", "no-mps", "p50 ms"),
    ("run 4", "alone: empty kernel, sleep 5 ms", "mps", "p50 ms"),
}
# Back-to-back batches that matched: kernels long enough to bind the device, or a launch call near the model's.
ISSUE_MATCHED = {
    *[(run, "alone: issue: 1-block spin 20 us", mode, "ms per kernel") for run in ("run 3", "run 4")
      for mode in ("mps", "no-mps")],
    ("run 3", "alone: issue: 1-block spin 10 us", "no-mps", "ms per kernel"),
    ("run 3", "alone: issue: 1-block spin 5 us", "no-mps", "ms per kernel"),
    ("run 3", "alone: issue: FULL spin 5 us", "no-mps", "ms per kernel"),
    ("run 3", "alone: issue: FULL spin 5 us", "mps", "ms per kernel"),
    ("run 4", "alone: issue: FULL spin 5 us", "no-mps", "ms per kernel"),
}
# Run 4's empty kernels after an idle time that matched run 3's curve anyway.
COOLING_MATCHED = {("alone: empty kernel, busy 20 us", "no-mps"), ("alone: empty kernel, busy 20 us", "mps"),
                   ("alone: empty kernel, busy 1000 us", "mps"), ("alone: empty kernel, busy 3000 us", "mps"),
                   ("alone: empty kernel, sleep 0.1 ms", "mps")}


def known_miss(r: dict) -> str | None:
    """Why a row is expected to miss 5%, or None if it must match."""
    row, figure, key = r["row"], r["figure"], (r["source"], r["row"], r["mode"], r["figure"])
    if key in LUCKY:
        return None
    if figure == "p99 ms" and "beside" not in row and "1.0 ms" not in row:
        return JITTER
    if key in {("run 3", "alone: 8 x 0.1 ms spin, busy 1000 us", mode, "p50 ms") for mode in ("mps", "no-mps")}:
        return COOLING
    if (r["source"] == "run 4" and row.startswith("alone: empty kernel, ") and figure == "p50 ms"
            and "back to back" not in row and "sleep 5 ms" not in row and (row, r["mode"]) not in COOLING_MATCHED):
        return COOLING_SPREAD
    if "issue:" in row and key not in ISSUE_MATCHED:
        return SMALL_GAP if "10 us" in row else LAUNCH_RATE
    if "empty kernel back to back" in row:
        return LAUNCH_RATE
    if r["source"] == "reference" and row == "latency tenant beside FULL 1-ms spin waves" and r["mode"] == "mps":
        return REFERENCE_SPREAD
    if key in HOST_SPREAD_ROWS:
        return HOST_SPREAD
    if key == ("run 6", "vadd beside FULL spin 1 ms [tenant 0]", "no-mps", "s"):
        return FIRST_SLICE
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


def test_kernel_overhead_in_the_spec_is_what_the_measurements_give():
    """DeviceSpec's gap between back-to-back kernels is the one the short batches showed (to 0.1 us)."""
    assert H200.kernel_overhead == pytest.approx(compare.calibration()["kernel_overhead"], abs=1e-7)


def test_host_latency_in_the_spec_is_what_the_measurements_give():
    """DeviceSpec's launch and synchronise latencies, idle and back to back, are the calibration's, not
    guesses (to 0.1 us), and so is the cooling time between them (to 1%)."""
    cal = compare.calibration()
    for name in ("launch_latency", "sync_latency", "launch_latency_busy", "sync_latency_busy"):
        assert getattr(H200, name) == pytest.approx(cal[name], abs=1e-7), name
    assert H200.host_cooling == pytest.approx(cal["host_cooling"], rel=0.01)
    assert H200.launch_latency_busy < H200.launch_latency / 5  # what made the model need two figures


def test_timeslice_defaults_are_what_the_measurements_give():
    """The timeslice policy's default slice, switch and state costs are the calibration's figures (to 0.1 us),
    the ones compare.py's time-sliced rows run with."""
    cal = compare.calibration()
    defaults = POLICIES["timeslice"].options
    assert defaults["timeslice"] == pytest.approx(cal["timeslice"], abs=1e-7)
    assert defaults["switch"] == pytest.approx(cal["switch"], abs=1e-7)
    assert len(defaults["state"]) == len(cal["state"])
    for ours, measured in zip(defaults["state"], cal["state"]):
        assert ours == pytest.approx(measured, abs=1e-7)


def test_dram_curve_in_the_spec_is_what_the_measurements_give():
    """DeviceSpec.dram_curve is the calibration's (to 0.1%), the one compare.py's memory-bound rows run with."""
    cal = compare.calibration()
    assert len(H200.dram_curve) == len(cal["dram_curve"])
    for ours, measured in zip(H200.dram_curve, cal["dram_curve"]):
        assert ours[0] == pytest.approx(measured[0], abs=1) and ours[1] == pytest.approx(measured[1], rel=1e-3)
    assert H200.dram_knee == cal["dram_knee"] and H200.dram_beyond == pytest.approx(cal["dram_beyond"], abs=1e-3)


def test_switch_costs_grow_with_the_warps_a_context_holds():
    """The premise of the state costs: contexts of 1 and of 8 blocks hold next to nothing (their slices agree
    to 1 us), and from a quarter of the warp slots to all of them a switch costs more and a slice runs less."""
    e = {e["name"]: compare._slices(e) for e in json.loads(compare.RUN5.read_text())["no-mps"]}
    own = {g: e[f"slices, 2 tenants, one 200-ms {g}-block kernel each"][0][1] for g in (1, 8)}
    assert own[1] == pytest.approx(own[8], abs=1e-6)
    state = compare.calibration()["state"]
    assert [h for h, _, _ in state] == [0.25, 0.5, 1.0]
    for (_, extra, loss), (_, more, less) in zip(state, state[1:]):
        assert 0 < extra < more and 0 < loss < less
