# A sweep is many virtual-time runs of one workload, each with a few settings changed (its axes). Rule 1: a
# point is its workload document with the axes written in, nothing else, so that what a point gives depends
# on that document alone: its key (the name of its results file) is a hash of it, and a point runs the same,
# to the bit, in any process and in any order. This module is the grammar and one point's run; running many is
# the command's (sweep_cli.py: the results directory; sweep_executors.py: where they run; sweep_table.py: the table;
# sweep_find.py: a capacity search's points).
#
# A point runs on the in-process daemon (run_virtual): mpsd-stress --virtual-time's figures. With path =
# "model", a point the model alone can serve (every request one call of a closed loop, nothing the model leaves
# out) runs on mpsd.tools.simulate instead, 20 to 100 times faster. The two agree to rounding (the daemon's run
# starts at a simulated second, the model's at zero) while the SMs have room, which tests/test_sweep.py pins,
# but not once the blocks queue for SMs (16 inference replicas of 16 blocks beside a full-device training
# job: p99 0.612 against 0.614 ms), so the model is asked for, not chosen: the path is part of a point's key.
"""Sweeps: the grammar of a sweep file, and one point's run."""

from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpsd.sim import POLICIES
from mpsd.stress.metrics import latency_summary, summarize
from mpsd.stress.workload import _TENANT_KEYS, Workload, WorkloadError, parse_workload

__all__ = ["Sweep", "load_sweep", "parse_sweep", "pick_path", "point_key", "run_point"]

RESULTS_VERSION = 1  # part of every key: a change to what a result holds makes old results files stale
RUN_AXES = ("duration", "seed", "policy", "solo", "devices")
TENANT_AXES = tuple(sorted(_TENANT_KEYS - {"name", "kernel"}))


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file: the workload as written, its base directory, and the points in file order."""

    workload: dict[str, Any]  # the workload's TOML document
    base: Path  # where its trace files are read from
    points: tuple[dict[str, Any], ...]  # axis -> value, axes in the order the file names them

    def document(self, point: dict[str, Any]) -> dict[str, Any]:
        """The workload document of one point: the axes written into a copy of the workload."""
        return apply_point(self.workload, point)


def load_sweep(path: Path) -> Sweep:
    """Read and check a sweep file.

    Raises:
        WorkloadError: unreadable, not TOML, or the sweep or a point's workload is wrong.
    """
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise WorkloadError(f"{path}: {exc}") from None
    return parse_sweep(data, path.parent)


def parse_sweep(data: dict[str, Any], base: Path = Path(".")) -> Sweep:
    """Check a parsed sweep document: ``[sweep]`` beside the workload inline or ``workload = "path"``.

    Raises:
        WorkloadError: an unknown key or axis (named, with the known ones), an empty axis, or a point whose
            workload is wrong (named by its axes).
    """
    data = dict(data)
    sweep = data.pop("sweep", None)
    if not isinstance(sweep, dict):
        raise WorkloadError("the file has no [sweep] table")
    if "workload" in data:
        name = data.pop("workload")
        if data or not isinstance(name, str):
            raise WorkloadError("workload = \"path\" names the workload file; the rest of it goes there, "
                                f"not here: {', '.join(sorted(data)) or repr(name)}")
        try:
            workload = tomllib.loads((base / name).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise WorkloadError(f"workload {name}: {exc}") from None
        base = (base / name).parent
    else:
        workload = data
    parse_workload(workload, base)  # the workload as written is right before any point is
    unknown = sorted(set(sweep) - {"grid", "point"})
    if unknown:
        raise WorkloadError(f"[sweep]: unknown key(s) {', '.join(unknown)} (known: grid, point)")
    grid, listed = sweep.get("grid", {}), sweep.get("point", [])
    if not isinstance(grid, dict) or not isinstance(listed, list) or not all(isinstance(p, dict) for p in listed):
        raise WorkloadError("[sweep.grid] is a table of axes, each a list; [[sweep.point]] tables of axis = value")
    if bool(grid) == bool(listed):
        raise WorkloadError("[sweep] needs one of [sweep.grid] (every combination) or [[sweep.point]] (listed)")
    tenants = [t.get("name", f"tenant{i}") for i, t in enumerate(workload.get("tenant", []))]
    for axis in [*grid, *(a for p in listed for a in p)]:
        check_axis(axis, tenants)
    if grid:
        for axis, values in grid.items():
            if not isinstance(values, list) or not values:
                raise WorkloadError(f"[sweep.grid] {axis} must be a non-empty list of values")
        points = tuple(dict(zip(grid, combination)) for combination in itertools.product(*grid.values()))
    else:
        points = tuple(dict(p) for p in listed)
    if len({point_key(apply_point(workload, p)) for p in points}) != len(points):
        raise WorkloadError("two points of the sweep are the same run")
    out = Sweep(workload, base, points)
    for point in points:
        try:
            _policy(parse_workload(out.document(point), base))
        except WorkloadError as exc:
            raise WorkloadError(f"point {describe(point)}: {exc}") from None
    return out


def check_axis(axis: str, tenants: list[str]) -> None:
    """Check an axis's name, given the workload's tenant names (the capacity search checks its key with it too).

    Raises:
        WorkloadError: an unknown axis (named, with the known ones) or a tenant no entry is named.
    """
    known = (f"policy, seed, run.<{'|'.join(RUN_AXES)}>, tenant.<name>.<key> with name one of "
             f"{', '.join(tenants)} and key one of {', '.join(TENANT_AXES)}")
    parts = axis.split(".")
    if axis in ("policy", "seed") or (len(parts) == 2 and parts[0] == "run" and parts[1] in RUN_AXES):
        return
    if len(parts) == 3 and parts[0] == "tenant":
        if parts[1] not in tenants:
            raise WorkloadError(f"[sweep] axis {axis}: no tenant named {parts[1]!r} (known: {', '.join(tenants)})")
        if parts[2] in TENANT_AXES:
            return
    raise WorkloadError(f"[sweep] unknown axis {axis!r} (known: {known})")


def apply_point(workload: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """A copy of the workload document with the point's axes written in (tenant.<name>.<key>: every entry of
    that name, on any device)."""
    doc = copy.deepcopy(workload)
    for axis, value in point.items():
        parts = axis.split(".")
        if len(parts) == 1:  # policy, seed
            doc.setdefault("run", {})[axis] = value
        elif parts[0] == "run":
            doc.setdefault("run", {})[parts[1]] = value
        else:
            for i, entry in enumerate(doc["tenant"]):
                if entry.get("name", f"tenant{i}") == parts[1]:
                    entry[parts[2]] = value
    return doc


def describe(point: dict[str, Any]) -> str:
    return ", ".join(f"{axis}={json.dumps(value)}" for axis, value in point.items())


def point_key(document: dict[str, Any], path: str = "daemon") -> str:
    """A stable name for a point's run: the hash of its workload document (whatever order its tables were
    written in) and the path it runs on."""
    text = json.dumps({"version": RESULTS_VERSION, "workload": document, "path": path}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- one point's run --------------------------------------------------------------------------------------

def model_serves(workload: Workload) -> bool:
    """Whether the model alone gives mpsd-stress's figures for the workload: one device, a built-in policy
    with no dispatcher settings and no partitions, every tenant a closed loop whose request is one call, and
    nothing the model leaves out."""
    from mpsd.tools.simulate import left_out

    options = workload.policy_options.get(workload.policy, {})
    return (workload.devices == 1 and workload.policy in POLICIES and workload.policy != "mig"
            and not (set(options) & {"dispatch", "kernels_in_flight", "dispatch_reaction"}) and not left_out(workload)
            and all(t.arrival == "closed" and t.start is None and t.requests is None and t.partition is None
                    and not t.input and not t.output and len(t.kernels) == 1 and t.kernels[0].repeat == 1
                    for t in workload.tenants))


def pick_path(document: dict[str, Any], base: Path, wanted: str) -> str:
    """The path a point runs on: "model" where it is ``wanted`` and the model alone serves the point, else
    "daemon".

    Raises:
        WorkloadError: the workload is wrong.
    """
    return "model" if wanted == "model" and model_serves(parse_workload(document, base)) else "daemon"


def run_point(document: dict[str, Any], base: Path = Path("."), path: str = "daemon") -> dict[str, Any]:
    """Run one point's workload in virtual time and return its figures (no wall times: the same document gives
    the same dict).

    Args:
        document: the point's workload document.
        base: where its trace files are read from.
        path: "daemon" or "model" (which must serve it: ``pick_path``).

    Returns:
        ``{"path", "run": {...}, "groups": {name: {...}}}``: per run and per tenant group, requests, completed,
        errors, throughput_per_s, p50_ms, p99_ms (None without a completed request) and, by group, slo (the
        mean of its instances' SLO attainment; None without deadline_ms).

    Raises:
        WorkloadError: the workload is wrong.
        RunError: the daemon could not run it.
    """
    workload = parse_workload(document, base)
    instances = _model(workload) if path == "model" else _daemon(workload)
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in instances:
        groups.setdefault(row["group"], []).append(row)
    return {"path": path, "run": _figures(instances), "groups": {name: _figures(rows, slo=True)
                                                                  for name, rows in groups.items()}}


def _figures(rows: list[dict[str, Any]], slo: bool = False) -> dict[str, Any]:
    latencies = [x for row in rows for x in row["latencies"]]
    summary = latency_summary(latencies)
    out = {"requests": sum(r["requests"] for r in rows), "completed": len(latencies),
           "errors": sum(r["errors"] for r in rows), "throughput_per_s": sum(r["throughput_per_s"] for r in rows),
           "p50_ms": summary["p50"], "p99_ms": summary["p99"]}
    if slo:
        attained = [r["slo"] for r in rows if r["slo"] is not None]
        out["slo"] = sum(attained) / len(attained) if attained else None
    return out


def _model(workload: Workload) -> list[dict[str, Any]]:
    """Each instance's latencies and throughput, as mpsd-stress's timeline would have them: the run lasts
    until the later of its duration and the last request's return."""
    from mpsd.tools.simulate import run_workload

    result = run_workload(workload, latencies=True)
    duration = max([workload.duration, *(t["makespan_ms"] / 1e3 for t in result["tenants"])])
    groups = [t.name for t in workload.tenants for _ in range(t.count)]
    return [{"group": group, "latencies": t["latencies_s"], "requests": len(t["latencies_s"]), "errors": 0,
             "throughput_per_s": len(t["latencies_s"]) / duration, "slo": None}
            for group, t in zip(groups, result["tenants"])]


def _policy(workload: Workload) -> tuple[str, dict[str, Any]]:
    """The workload's policy and its options, checked as mpsd-stress checks them.

    Raises:
        WorkloadError: an unknown policy, or options it refuses.
    """
    from mpsd.stress.cli import _policies

    options = argparse.Namespace(compare_policies=None, policy=None, dispatch="block", devices=None,
                                 dispatch_reaction=None)
    return next(iter(_policies(workload, options).items()))


def _daemon(workload: Workload) -> list[dict[str, Any]]:
    """Each instance's figures from a run of tenant tasks beside a daemon in this process, placed and
    configured as mpsd-stress places them (without the runs alone: isolation is not among a sweep's figures,
    nor the device's trace)."""
    from mpsd.stress.cli import _place_in_partitions
    from mpsd.stress.runner import device_policies, run_virtual

    policy, settings = _policy(workload)
    tenants = _place_in_partitions(workload.tenants, device_policies(workload, policy, settings))
    played = run_virtual(workload, policy, settings, tenants, by_device=workload.devices > 1, device_trace=False)
    out = []
    for timeline in (played.values() if isinstance(played, dict) else [played]):
        summary = summarize(timeline)
        latencies: dict[str, list[float]] = {}
        for r in timeline.requests:
            if r.error is None and r.completed == r.completed:  # (NaN: never completed)
                latencies.setdefault(r.tenant, []).append(r.latency)
        for t in summary["tenants"]:
            out.append({"group": t["group"], "latencies": latencies.get(t["tenant"], []), "requests": t["requests"],
                        "errors": t["errors"], "throughput_per_s": t["throughput_per_s"], "slo": t["slo_attainment"]})
    return out
