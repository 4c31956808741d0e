# The fidelity table as tests on the simulator alone: every figure measured on a real H200 (with and without
# MPS: the reference and ten runs of bench/fidelity/measure_timing.py) against the model, within 5%. Rows
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
COPY_CALLS = ("back-to-back copies this small are bound by the host's copy call, which differed between runs 7 and "
              "8 and the two modes (h2d and d2h: 3.5 to 6.3 us a copy in run 7, calls of 2.5 to 2.9 us in run 8; "
              "d2d: 7.4 to 8.9 against 5.5 to 5.9 us; a memset's call 1.9 to 3.2 us); the model's figures are run "
              "8's back-to-back calls")
COPY_KERNEL_FIXED = ("a 1-MiB memset took 5 us on the device, where the model's copy kernel takes half that (the gap "
                     "between kernels and its bytes at the DRAM curve's rate): a short copy kernel costs more than "
                     "its bytes")
L2_CACHE = ("16-MiB device copies and memsets of the same buffers, back to back, stay in the H200's L2 cache (a "
            "16-MiB copy took 8.4 us: 4 TB/s of traffic); the model has no cache")
DUPLEX = ("beside device-to-host copies, host-to-device ones got 56 to 82% of their bandwidth on the H200, differing "
          "between runs and modes (in run 9, 50 to 66%); the model gives them the mean of the calibrating runs, 71.5%")
SLICE_EDGE = ("the probe's launch comes within tens of microseconds of the end of a copy-engine slice (two or "
              "three slices after its last copy ended): on the H200 it fell on either side (latency 0.04 to 0.08 "
              "or 1.06 ms), in the model always on one")
COPY_HOST = ("a 64-KiB copy beside work on other engines is host time (17 to 27 us from launch to return), whose "
             "p50 differs between runs and modes as an empty kernel's does and whose p99 is host noise")
SHARED_ENGINE = ("streams of large copies sharing an engine lost 0 to 13% of its bandwidth on the H200, differing "
                 "between leases: two streams 0% in run 7 and 2 to 3% in run 10, three 8 to 10% in run 9 and 2 to 4% "
                 "in run 10, two beside a third's small copies 8 to 13% in run 9 and 3% in run 10; the model's "
                 "slices lose nothing")
PCIE_DRAM = ("host-to-device copies beside a memory-bound kernel were 5 to 8% slower on the H200 (the copies write "
             "DRAM); PCIe copies take no part in the model's DRAM sharing")
COPY_PHASE = ("when the probe or batch arrives within the other tenant's slice or copy kernel is chance on the "
              "H200 (up to one 2-ms context slice, or one copy kernel, under MPS); the model's closed loop meets "
              "it at one phase")

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
    if r["source"] in ("run 7", "run 8", "run 9", "run 10"):
        return _copy_miss(r, key)
    return None


DUPLEX_ROWS = {("run 9", "h2d 64 MiB beside d2h 256 MiB [tenant 0]", "no-mps", "s")}
DUPLEX_ROWS |= {("run 9", "h2d beside d2h from 30 ms on [tenant 0]", mode, "s") for mode in ("mps", "no-mps")}
COPY_CALL_ROWS = {f"alone: 200 x {kind} {size} KiB" for kind in ("h2d", "d2h", "d2d") for size in (4, 64)}
COPY_CALL_ROWS |= {"alone: 100 x d2d 1024 KiB", "alone: 200 x memset 4 KiB"}


def _copy_miss(r: dict, key: tuple) -> str | None:
    row = r["row"]
    if row in COPY_CALL_ROWS:
        return COPY_CALLS
    if row == "alone: 100 x memset 1024 KiB":
        return COPY_KERNEL_FIXED
    if row == "alone: 20 x d2d 16384 KiB" or key == ("run 8", "alone: 20 x memset 16384 KiB", "no-mps", "s"):
        return L2_CACHE
    if key in DUPLEX_ROWS:
        return DUPLEX
    if r["source"] == "run 9" and (row.startswith("3 x h2d") or "beside 2 x h2d 256 MiB [tenant" in row):
        return SHARED_ENGINE
    if key in {("run 10", f"2 x h2d 256 MiB beside an idle third [tenant {i}]", "mps", "s") for i in (0, 1)}:
        return SHARED_ENGINE
    if r["source"] == "run 10" and (row == "2 x h2d 256 MiB beside an idle third"
                                    or r["figure"] == "p99 ms" and "two 64 KiB probes" in row):
        return COPY_HOST  # a copy alone after the others, and the p99s of copies beside them
    if key == ("run 10", "2 x h2d 256 MiB beside a 64 KiB probe back to back", "mps", "p99 ms"):
        return COPY_HOST
    if row == "h2d 256 MiB beside vadd [tenant 0]":
        return PCIE_DRAM
    if ("sleep 2.0 ms" in row and r["mode"] == "mps" or "sleep 3.0 ms" in row) and "tenant" not in row:
        return SLICE_EDGE
    if (row.startswith(("d2h 64 KiB probe, sleep 0.5 ms", "h2d 64 KiB probe, sleep 0.5 ms, beside d2d"))
            and "tenant" not in row):
        return COPY_HOST
    if key == ("run 9", "d2h 64 KiB probe, sleep 0.25 ms, beside d2h 256 MiB", "no-mps", "p99 ms"):
        return COPY_HOST
    if key == ("run 8", "h2d 64 KiB probe, sleep 0.5 ms, beside h2d 256 MiB", "mps", "p99 ms"):
        return COPY_HOST
    if key in {("run 8", "d2d 64 KiB probe, sleep 0.5 ms, beside d2d 256 MiB", "mps", "p99 ms"),
               ("run 8", "memset 256 MiB beside FULL spin [tenant 0]", "no-mps", "s")}:
        return COPY_PHASE
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


def test_copy_figures_in_the_spec_are_what_the_measurements_give():
    """DeviceSpec's copy engine time slice, copy kernels and copy calls are the calibration's (to 0.1%)."""
    cal = compare.calibration()
    assert H200.copy_timeslice == pytest.approx(cal["copy_timeslice"], rel=1e-3)
    assert [k for k, *_ in H200.copy_kernels] == [k for k, *_ in cal["copy_kernels"]]
    for ours, measured in zip(H200.copy_kernels, cal["copy_kernels"]):
        assert ours[1:] == pytest.approx(measured[1:], rel=1e-3)
    assert dict(H200.copy_calls) == pytest.approx(dict(cal["copy_calls"]), rel=1e-3)
    assert dict(H200.copy_duplex) == pytest.approx(dict(cal["copy_duplex"]), rel=1e-3)


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


def test_repeated_figures_beyond_reach_are_those_no_prediction_can_match():
    """compare.py --repeats: a figure the H200 measured in several runs is beyond reach exactly when no one
    prediction lies within 5% of every measurement (the interval [0.95 hi, 1.05 lo] is empty), and the
    figure it offers as nearest all of them is within 5% of each when one exists. Every figure beyond reach
    has a row the table expects to miss."""
    found = compare.repeats(list(table().values()))
    assert len(found) > 50 and any(not f["reach"] for f in found)
    for f in found:
        lo, hi = min(f["measured"].values()), max(f["measured"].values())
        assert f["reach"] == (hi * (1 - TOLERANCE) <= lo * (1 + TOLERANCE) * (1 + 1e-12)), f["row"]
        assert f["reach"] == all(abs(f["best"] - m) / m <= TOLERANCE + 1e-12 for m in f["measured"].values())
        if not f["reach"]:
            keys = [(source, f["row"], f["mode"], f["figure"]) for source in f["measured"]]
            assert any(known_miss(table()[k]) for k in keys), f["row"]
