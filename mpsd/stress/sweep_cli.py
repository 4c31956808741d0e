# `mpsd-stress sweep SWEEP.toml`: the points of a sweep (mpsd.stress.sweep) run in worker processes, as many
# at once as --jobs says. A worker runs one point at a time (the in-process daemon is one per process) and is
# reused for the next, as mpsd-stress reuses its process for each policy: a point's figures depend on its
# workload document alone, which tests/test_sweep.py pins by running the points in two orders. Workers are
# spawned, not forked, so that none inherits a parent's trio or threads. With --results DIR, each point's
# figures are a file named by the point's key as it finishes, so that a rerun (after Ctrl-C, or with more
# points) runs only what no file holds. The table (stdout, --json, --csv) lists the points in the file's
# order, whatever order they finished in, and holds no wall times: the same file gives the same bytes.
# Exit codes as mpsd-stress's: 0 done, 1 a point failed, 2 a bad file or option, 130 on Ctrl-C.
"""The mpsd-stress sweep command."""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import io
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from mpsd.stress.runner import RunError
from mpsd.stress.sweep import Sweep, describe, load_sweep, pick_path, point_key, run_point
from mpsd.stress.workload import WorkloadError

__all__ = ["main"]

FIGURES = ("p50_ms", "p99_ms", "throughput_per_s", "slo", "completed", "errors")
RUN_FIGURES = ("p50_ms", "p99_ms", "throughput_per_s", "completed", "errors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpsd-stress sweep", description="Run a workload at every point of a sweep (a grid or listed points "
                                              "of settings), each point a virtual-time run, and tabulate the figures.")
    parser.add_argument("sweep", type=Path, help="a sweep TOML file (see examples/sweeps/)")
    parser.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1, metavar="N",
                        help="points run at once, each in a worker process (default: one per core)")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="one JSON file per point, named by its key; a rerun skips the points done")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the table as JSON ('-' for stdout)")
    parser.add_argument("--csv", type=Path, metavar="FILE", help="write the table as CSV ('-' for stdout)")
    parser.add_argument("--path", choices=("daemon", "model"), default="daemon",
                        help="daemon (default): each point beside a daemon in a worker, mpsd-stress --virtual-time's "
                             "figures; model: the model alone (mpsd simulate) where it serves the point, 20-100x "
                             "faster, the same figures to rounding while the SMs have room, not once blocks queue")
    parser.add_argument("--executor", choices=("local",), default="local",
                        help="where points run: local worker processes (Ray is not built in yet)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    try:
        if options.jobs < 1:
            raise WorkloadError("--jobs must be at least 1")
        sweep = load_sweep(options.sweep)
        points = plan(sweep, options.path)
    except WorkloadError as exc:
        print(f"mpsd-stress sweep: {exc}", file=sys.stderr)
        return 2
    say = (lambda line: None) if options.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        results = run_sweep(sweep, points, options.jobs, options.results, say)
    except (RunError, WorkloadError) as exc:
        print(f"mpsd-stress sweep: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mpsd-stress sweep: interrupted" + (f"; the points done are in {options.results}/, and a rerun "
                                                  "resumes" if options.results else ""), file=sys.stderr)
        return 130
    rows = table(points, results)
    print(render(rows))
    for target, text in ((options.json, lambda: json.dumps(rows, indent=1, allow_nan=False) + "\n"),
                         (options.csv, lambda: to_csv(rows))):
        if target is None:
            continue
        if str(target) == "-":
            sys.stdout.write(text())
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text())
    return 0


def plan(sweep: Sweep, wanted: str) -> list[tuple[dict[str, Any], dict[str, Any], str, str]]:
    """Each point, in the file's order: (its axes, its workload document, its path, its key).

    Raises:
        WorkloadError: a point's workload is wrong.
    """
    out = []
    for point in sweep.points:
        document = sweep.document(point)
        path = pick_path(document, sweep.base, wanted)
        out.append((point, document, path, point_key(document, path)))
    return out


def run_sweep(sweep: Sweep, points: list[tuple[dict[str, Any], dict[str, Any], str, str]], jobs: int,
              results: Path | None, say: Any) -> dict[str, dict[str, Any]]:
    """Every point's figures, by key: read from ``results`` where a file holds them, else run (at most ``jobs``
    at once) and, with ``results``, written there as each finishes.

    Raises:
        RunError: a point's run failed (the others already done are kept).
        WorkloadError: a point's workload was refused by the model or the daemon.
    """
    documents = {key: (point, document, path) for point, document, path, key in points}
    done: dict[str, dict[str, Any]] = {}
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        for key in documents:
            kept = _read(results / f"{key}.json", key)
            if kept is not None:
                done[key] = kept
    todo = [key for key in documents if key not in done]
    total, resumed = len(documents), len(done)
    if resumed:
        say(f"mpsd-stress sweep: {resumed} of {total} points already in {results}/, {len(todo)} to run")
    if not todo:
        return done
    started = time.monotonic()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(todo)), mp_context=context) as pool:
        futures = {pool.submit(run_point, documents[key][1], sweep.base, documents[key][2]): key for key in todo}
        try:
            for finished, future in enumerate(concurrent.futures.as_completed(futures), 1):
                key = futures[future]
                point = documents[key][0]
                try:
                    figures = future.result()
                except (RunError, WorkloadError) as exc:
                    raise type(exc)(f"point {describe(point)}: {exc}") from None
                result = {"key": key, "point": point, **figures}
                done[key] = result
                if results is not None:
                    _write(results / f"{key}.json", result)
                elapsed = time.monotonic() - started
                left = elapsed / finished * (len(todo) - finished)
                say(f"mpsd-stress sweep: {resumed + finished}/{total} {describe(point)} ({figures['path']}); "
                    f"{elapsed:.1f} s, about {left:.1f} s left")
        except BaseException:
            for future in futures:  # what has not started yet never will; the points done are kept
                future.cancel()
            raise
    return done


def _read(path: Path, key: str) -> dict[str, Any] | None:
    """A point's results file, or None where there is none or it is not one (a torn write is run again)."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) and kept.get("key") == key else None


def _write(path: Path, result: dict[str, Any]) -> None:
    # Written beside and renamed into place, so that a file there is whole (Ctrl-C leaves no torn result).
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    os.replace(partial, path)


# -- the table --------------------------------------------------------------------------------------------

def table(points: list[tuple[dict[str, Any], dict[str, Any], str, str]],
          results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point, in the file's order: its axes (as this file names them), key, path, the run's
    figures and each tenant group's."""
    rows = []
    for point, _document, _path, key in points:
        result = results[key]
        rows.append({"axes": point, "key": key, "path": result["path"], "run": result["run"],
                     "groups": result["groups"]})
    return rows


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {**row["axes"], "key": row["key"], "path": row["path"]}
    out.update({f"run.{name}": row["run"][name] for name in RUN_FIGURES})
    for group, figures in row["groups"].items():
        out.update({f"{group}.{name}": figures[name] for name in FIGURES})
    return out


def to_csv(rows: list[dict[str, Any]]) -> str:
    """The table as CSV: a column per axis, then key, path, run.<figure> and <group>.<figure>; None empty."""
    flat = [_flat(row) for row in rows]
    axes = [axis for row in rows for axis in row["axes"]]  # every axis first, though not every point names it
    columns = list(dict.fromkeys([*axes, *(column for row in flat for column in row)]))
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, lineterminator="\n")
    writer.writeheader()
    for row in flat:
        writer.writerow({k: ("" if v is None else json.dumps(v) if isinstance(v, (bool, list, dict)) else v)
                         for k, v in row.items()})
    return out.getvalue()


def render(rows: list[dict[str, Any]]) -> str:
    """The table for a terminal: the axes, then each group's p99 and throughput (and SLO where it has one)."""
    axes = list(dict.fromkeys(axis for row in rows for axis in row["axes"]))
    groups = list(dict.fromkeys(group for row in rows for group in row["groups"]))
    slo = {g for row in rows for g, figures in row["groups"].items() if figures["slo"] is not None}
    header = [*axes, "path"] + [c for g in groups
                                for c in (f"{g} p99 ms", f"{g} req/s", *([f"{g} SLO"] if g in slo else []))]
    lines = [[_cell(row["axes"].get(axis)) for axis in axes] + [row["path"]]
             + [c for g in groups for c in _group_cells(row["groups"].get(g), g in slo)] for row in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    return "\n".join("  ".join(cell.rjust(w) if i >= len(axes) else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
                     for line in [header, *lines])


def _group_cells(figures: dict[str, Any] | None, slo: bool) -> list[str]:
    if figures is None:
        return ["-", "-"] + (["-"] if slo else [])
    p99 = figures["p99_ms"]
    cells = ["-" if p99 is None else f"{p99:.3f}", f"{figures['throughput_per_s']:.1f}"]
    if slo:
        cells.append("-" if figures["slo"] is None else f"{figures['slo']:.1%}")
    return cells


def _cell(value: Any) -> str:
    return "-" if value is None else value if isinstance(value, str) else json.dumps(value)
