# `mpsd-stress sweep SWEEP.toml`: the points of a sweep (mpsd.stress.sweep) run on an executor (sweep_executors.py:
# local worker processes, as many at once as --jobs says, or Ray), which hands each point's figures back as it
# finishes. With --results DIR, each point's figures are a file named by the point's key as it finishes, so that a
# rerun (after Ctrl-C, or with more points) runs only what no file holds. The table (stdout, --json, --csv,
# --parquet; sweep_table.py) lists the points in the file's order, whatever order they finished in, and holds no
# wall times: the same file gives the same bytes, whatever executor ran it. With --find, the points are the capacity
# search's (sweep_find.py), each step a batch through the same results directory, so that a rerun of a search
# resumes too; --report draws the plots (sweep_report.py).
# Exit codes as mpsd-stress's: 0 done, 1 a point failed, 2 a bad file or option, 130 on Ctrl-C.
"""The mpsd-stress sweep command."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from mpsd.stress.runner import RunError
from mpsd.stress.sweep import Sweep, describe, load_sweep, pick_path, point_key
from mpsd.stress.sweep_executors import EXECUTORS, Executor, Task, open_executor
from mpsd.stress.sweep_find import Until, frontier, parse_find, parse_until, render_frontier, search
from mpsd.stress.sweep_table import figure_names, flat, import_pyarrow, render, row, to_csv, write_parquet
from mpsd.stress.workload import WorkloadError

__all__ = ["main"]

Planned = tuple[dict[str, Any], dict[str, Any], str, str]  # a point's axes, workload document, path and key


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpsd-stress sweep", description="Run a workload at every point of a sweep (a grid or listed points "
                                              "of settings), each point a virtual-time run, and tabulate the figures.")
    parser.add_argument("sweep", type=Path, help="a sweep TOML file (see examples/sweeps/)")
    parser.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1, metavar="N",
                        help="points run at once, each in a worker process (default: one per core; the local "
                             "executor's: Ray runs as many as its cluster has CPUs)")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="one JSON file per point, named by its key; a rerun skips the points done")
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="write the table as JSON ('-' for stdout); with --find, {find, goal, until, limit, "
                             "frontier, runs}: each line's frontier, and the table of the runs probed")
    parser.add_argument("--csv", type=Path, metavar="FILE", help="write the table as CSV ('-' for stdout)")
    parser.add_argument("--parquet", type=Path, metavar="FILE",
                        help="write the table as Parquet, the CSV's columns (needs pyarrow, not a dependency)")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="draw the plots into DIR as PNG: each figure against each numeric axis, a line per "
                             "setting of the others; with --find, the frontier; report.json holds their series")
    parser.add_argument("--path", choices=("daemon", "model"), default="daemon",
                        help="daemon (default): each point beside a daemon in a worker, mpsd-stress --virtual-time's "
                             "figures; model: the model alone (mpsd simulate) where it serves the point, 20-100x "
                             "faster, the same figures to rounding while the SMs have room, not once blocks queue")
    parser.add_argument("--executor", choices=EXECUTORS, default="local",
                        help="where points run: local worker processes (default), or Ray (pip install 'mpsd[ray]'): "
                             "the cluster's nodes need mpsd, and trace files at the same paths")
    parser.add_argument("--address", metavar="ADDR",
                        help="with --executor ray, the cluster's address (default: Ray's own choice, a local "
                             "cluster where none is running)")
    search = parser.add_argument_group(
        "capacity search", "For each point of the sweep with KEY left out (each policy, say), the largest integer "
                           "KEY (max:) or the smallest (min:) from 1 to the limit at which the --until condition "
                           "holds, found by an exponential probe upward (1, 2, 4, ...) and then bisection. It "
                           "assumes the condition is monotone in KEY (for max, holds up to some value and fails "
                           "from the next on; for min, the opposite); a figure that is None fails. "
                           "Values of KEY the sweep lists are the search's to choose, so left out. Each run goes "
                           "through --results like a sweep's point, so that a rerun resumes.")
    search.add_argument("--find", metavar="max:KEY", help="the axis searched, e.g. max:tenant.inference.count or "
                                                          "min:tenant.inference.active_thread_percentage")
    search.add_argument("--until", metavar="EXPR",
                        help='"FIGURE OP VALUE": FIGURE a column of the table (run.p99_ms, inference.p99_ms, '
                             'inference.slo, ...), OP one of <=, <, >=, >, ==; e.g. "inference.p99_ms <= 5"')
    search.add_argument("--find-limit", type=int, default=1024, metavar="N",
                        help="the largest value of KEY probed (default 1024)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    try:
        if options.jobs < 1:
            raise WorkloadError("--jobs must be at least 1")
        if options.address is not None and options.executor != "ray":
            raise WorkloadError("--address is the Ray cluster's: it needs --executor ray")
        if options.find_limit < 1:
            raise WorkloadError(f"--find-limit must be at least 1, not {options.find_limit}")
        if (options.find is None) != (options.until is None):
            raise WorkloadError("--find and --until go together: the axis searched and the condition")
        if options.executor == "ray":
            from mpsd.stress.sweep_ray import import_ray

            import_ray()
        if options.parquet is not None:
            import_pyarrow()  # before the runs, not after them
        sweep = load_sweep(options.sweep)
        if options.find is not None:
            goal, key = parse_find(options.find, sweep)
            until = parse_until(options.until, figure_names(sweep.workload))
        else:
            points = plan(sweep, sweep.points, options.path)
    except WorkloadError as exc:
        print(f"mpsd-stress sweep: {exc}", file=sys.stderr)
        return 2
    say = (lambda line: None) if options.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    found = None
    try:
        with open_executor(options.executor, options.jobs, options.address) as executor:
            if options.find is not None:
                found = run_search(sweep, goal, key, until, options.find_limit, executor, options.path,
                                   options.results, say)
                rows = found["runs"]
            else:
                results = run_sweep(sweep, points, executor, options.results, say)
                rows = [row(point, key, results[key]) for point, _document, _path, key in points]
    except (RunError, WorkloadError) as exc:
        print(f"mpsd-stress sweep: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mpsd-stress sweep: interrupted" + (f"; the points done are in {options.results}/, and a rerun "
                                                  "resumes" if options.results else ""), file=sys.stderr)
        return 130
    print(found.pop("text") if found is not None else render(rows))
    document = found if found is not None else rows
    for target, text in ((options.json, lambda: json.dumps(document, indent=1, allow_nan=False) + "\n"),
                         (options.csv, lambda: to_csv(rows))):
        if target is None:
            continue
        if str(target) == "-":
            sys.stdout.write(text())
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text())
    if options.parquet is not None:
        write_parquet(rows, options.parquet)
    if options.report is not None:
        from mpsd.stress.sweep_report import write_report

        if len(write_report(options.report, rows, found)) == 1:
            print(f"mpsd-stress sweep: --report: no axis takes two or more numbers, nothing to plot against; "
                  f"{options.report}/report.json is empty", file=sys.stderr)
    return 0


def plan(sweep: Sweep, points: Sequence[dict[str, Any]], wanted: str) -> list[Planned]:
    """Each point, in the order given: (its axes, its workload document, its path, its key).

    Raises:
        WorkloadError: a point's workload is wrong (named by its axes).
    """
    out = []
    for point in points:
        document = sweep.document(point)
        try:
            path = pick_path(document, sweep.base, wanted)
        except WorkloadError as exc:
            raise WorkloadError(f"point {describe(point)}: {exc}") from None
        out.append((point, document, path, point_key(document, path)))
    return out


def run_search(sweep: Sweep, goal: str, key: str, until: Until, limit: int, executor: Executor, wanted: str,
               results: Path | None, say: Callable[[str], None]) -> dict[str, Any]:
    """A capacity search, each step's points run as a sweep's (through ``results``, so that a rerun resumes).

    Returns:
        ``{"find", "goal", "until", "limit", "frontier", "runs", "text"}``: the frontier per line (sweep_find.frontier),
        every run probed as a table row (each line's in the order of the key's value), and the terminal's text.

    Raises:
        RunError: a point's run failed.
        WorkloadError: a point's workload is wrong, or was refused.
    """
    done: dict[str, dict[str, Any]] = {}
    steps: list[int] = []

    def evaluate(points: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        planned = plan(sweep, points, wanted)
        steps.append(len(planned))
        figures = run_sweep(sweep, planned, executor, results, say, f"search step {len(steps)}: ")
        out = []
        for point, _document, _path, point_key_ in planned:
            done[point_key_] = row(point, point_key_, figures[point_key_])
            out.append((point_key_, flat(done[point_key_])))
        return out

    lines = search(sweep, key, until, limit, evaluate, goal)
    runs = [done[line.keys[value]] for line in lines for value in sorted(line.probes)]
    return {"find": key, "goal": goal,
            "until": {"figure": until.figure, "op": until.op, "value": until.value, "text": str(until)},
            "limit": limit, "frontier": frontier(lines), "runs": runs,
            "text": render_frontier(lines, key, until, limit)}


def run_sweep(sweep: Sweep, points: list[Planned], executor: Executor, results: Path | None,
              say: Callable[[str], None], step: str = "") -> dict[str, dict[str, Any]]:
    """Every point's figures, by key: read from ``results`` where a file holds them, else run on the executor
    and, with ``results``, written there as each finishes.

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
        say(f"mpsd-stress sweep: {step}{resumed} of {total} points already in {results}/, {len(todo)} to run")
    if not todo:
        return done
    started = time.monotonic()
    finished = 0
    tasks = [Task(key, documents[key][1], sweep.base, documents[key][2]) for key in todo]
    for key, outcome in executor.run(tasks):
        point = documents[key][0]
        if isinstance(outcome, Exception):
            raise type(outcome)(f"point {describe(point)}: {outcome}") from None
        result = {"key": key, "point": point, **outcome}
        done[key] = result
        if results is not None:
            _write(results / f"{key}.json", result)
        finished += 1
        elapsed = time.monotonic() - started
        left = elapsed / finished * (len(todo) - finished)
        say(f"mpsd-stress sweep: {step}{resumed + finished}/{total} {describe(point)} ({outcome['path']}); "
            f"{elapsed:.1f} s, about {left:.1f} s left")
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
