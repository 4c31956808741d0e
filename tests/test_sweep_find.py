# The capacity search of `mpsd-stress sweep --find max:KEY --until "FIGURE OP VALUE"`: its bisection, on made-up
# monotone figures (every edge, the first value failing, the limit holding), and once end to end on the model
# (the frontier checked by running its two points directly, a rerun resumed from the results directory), with
# the report's plots and the Parquet table drawn from that one search. The search's workload is
# tests/test_sweep.py's, on the model: ten runs of at most eight replicas, about a second on two cores.
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpsd.stress.sweep import parse_sweep, run_point
from mpsd.stress.sweep_cli import main
from mpsd.stress.sweep_find import Until, frontier, parse_until, search
from mpsd.stress.sweep_table import figure_names
from mpsd.stress.workload import WorkloadError

from test_sweep import WORKLOAD, workload

STRESS = Path(sys.executable).with_name("mpsd-stress")
UNTIL = "inference.p99_ms <= 1.5"  # time-slicing passes 1.5 ms between 5 and 6 replicas; MPS not below 8


def made_up_search(edge: int, limit: int, goal: str = "max"):
    """A search over two lines whose figure is KEY itself (mps) or twice it (timeslice): for max, holding while
    at most ``edge``; for min, while at least ``edge``."""
    sweep = parse_sweep({**workload(), "sweep": {"grid": {"policy": ["mps", "timeslice"],
                                                          "tenant.inference.count": [1, 2]}}})
    scale = {"mps": 1, "timeslice": 2}
    sign = 1 if goal == "max" else -1
    asked: list[dict] = []

    def evaluate(points):
        asked.extend(points)
        return [(f"{p['policy']}-{p['tenant.inference.count']}",
                 {"run.p99_ms": sign * p["tenant.inference.count"] * scale[p["policy"]]}) for p in points]

    until = Until("run.p99_ms", "<=", sign * edge)
    return search(sweep, "tenant.inference.count", until, limit, evaluate, goal), asked


@pytest.mark.parametrize("edge", [0, 1, 2, 3, 5, 7, 8, 9, 31, 32, 33, 99, 100, 101, 1000])
def test_the_search_finds_the_edge_of_a_monotone_figure(edge):
    """For every edge, the frontier is the largest value that holds and the next, which fails, found in at most
    two probes per doubling; a first value that fails gives no largest, a limit that holds no smallest. The
    sweep's own values of the key are the search's to choose: its two counts make no more lines."""
    limit = 100
    lines, asked = made_up_search(edge, limit)
    assert [line.axes for line in lines] == [{"policy": "mps"}, {"policy": "timeslice"}]
    for line, scale in zip(lines, (1, 2)):
        best = min(edge // scale, limit)
        assert line.holds == (best if best >= 1 else None)
        assert line.fails == (best + 1 if best < limit else None)
        assert len(line.probes) <= 2 * 7 + 1  # 2^7 > 100
        assert all(held == (v * scale <= edge) for v, held in line.probes.items())
    # Each step asks for one point per line still searching, never the same point twice.
    assert len(asked) == len({json.dumps(p, sort_keys=True) for p in asked}) == sum(len(line.probes) for line in lines)
    decided = frontier(lines)[0]["decided_by"]
    assert decided == [f"mps-{v}" for v in (lines[0].holds, lines[0].fails) if v is not None]


@pytest.mark.parametrize("edge", [0, 1, 2, 3, 5, 8, 9, 64, 65, 100, 101])
def test_a_min_search_finds_the_smallest_value_that_holds(edge):
    """min:KEY is the opposite edge: the smallest value that holds (figure at least ``edge``) and the largest
    that fails below it; where every value holds, 1 and none; where none up to the limit does, none and it."""
    limit = 100
    lines, _ = made_up_search(edge, limit, "min")
    for line, scale in zip(lines, (1, 2)):
        least = max(1, -(-edge // scale))  # the smallest v with v * scale >= edge
        assert line.holds == (least if least <= limit else None)
        assert line.fails == (least - 1 if 1 < least <= limit else limit if least > limit else None)
        assert all(held == (v * scale >= edge) for v, held in line.probes.items())


@pytest.mark.parametrize(("text", "message"), [
    ("inference.p99 <= 1", "--until: unknown figure 'inference.p99' (known: run.p50_ms, "),
    ("inference.p99_ms =< 1", "--until 'inference.p99_ms =< 1': expected \"FIGURE OP VALUE\" with OP one of "
                              "<=, <, >=, >, =="),
    ("inference.p99_ms <= fast", "--until: 'fast' is not a number"),
    ("inference.p99_ms<=nan", "--until: 'nan' is not a number"),
    ("", "--until '': expected"),
])
def test_a_wrong_until_names_what_is_wrong(text, message):
    """A condition that is not FIGURE OP VALUE, or names no figure of the table, is refused before any run."""
    with pytest.raises(WorkloadError) as caught:
        parse_until(text, figure_names(workload()))
    assert str(caught.value).startswith(message)
    assert {op: parse_until(f"training.slo {op} 0.9", figure_names(workload())).holds({"training.slo": 0.9})
            for op in ("<=", "<", ">=", ">", "==")} == {"<=": True, "<": False, ">=": True, ">": False, "==": True}
    assert not parse_until("training.slo >= 0", figure_names(workload())).holds({"training.slo": None})


def test_a_wrong_search_is_one_line_and_exit_2(tmp_path):
    """The command refuses a wrong --until or --find with one line naming it and exit 2, no traceback."""
    sweep = tmp_path / "s.toml"
    sweep.write_text(WORKLOAD + '[sweep.grid]\npolicy = ["mps"]\n')
    wrong = subprocess.run([STRESS, "sweep", str(sweep), "--find", "max:tenant.inference.count", "--until",
                            "inference.p99_ms <= soon"], capture_output=True, text=True, timeout=60)
    assert (wrong.returncode, wrong.stdout) == (2, "")
    assert wrong.stderr == "mpsd-stress sweep: --until: 'soon' is not a number\n"
    for argv, message in [(["--find", "max:policy", "--until", UNTIL], "--find: policy does not take integers"),
                          (["--find", "least:seed", "--until", UNTIL],
                           "--find 'least:seed': expected max:KEY or min:KEY"),
                          (["--find", "max:tenant.serving.count", "--until", UNTIL],
                           "--find: axis tenant.serving.count: no tenant named 'serving'"),
                          (["--until", UNTIL], "--find and --until go together")]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main([str(sweep), *argv]) == 2
        assert err.getvalue().startswith(f"mpsd-stress sweep: {message}"), argv


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One search, on the model, with every output: (its directory, its stdout, the JSON it wrote)."""
    where = tmp_path_factory.mktemp("search")
    (where / "s.toml").write_text(WORKLOAD + '[sweep.grid]\npolicy = ["mps", "timeslice"]\n')
    out = io.StringIO()
    argv = [str(where / "s.toml"), "--path", "model", "--jobs", "2", "--quiet", "--find", "max:tenant.inference.count",
            "--until", UNTIL, "--find-limit", "8", "--results", str(where / "results"), "--json", str(where / "f.json"),
            "--csv", str(where / "f.csv"), "--report", str(where / "report")]
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return where, out.getvalue(), json.loads((where / "f.json").read_text()), argv


def test_the_frontier_is_the_last_point_that_holds_and_the_next(searched):
    """Time-slicing's frontier is 5 replicas (holds) and 6 (fails), as running those two points directly says;
    MPS holds up to the limit; the runs that decided it are named; a rerun runs nothing and prints the same."""
    where, printed, found, argv = searched
    by_policy = {line["axes"]["policy"]: line for line in found["frontier"]}
    assert (by_policy["timeslice"]["holds"], by_policy["timeslice"]["fails"]) == (5, 6)
    assert (by_policy["mps"]["holds"], by_policy["mps"]["fails"]) == (8, None)
    assert [r["value"] for r in by_policy["timeslice"]["runs"]] == [1, 2, 4, 8, 6, 5]
    sweep = parse_sweep({**workload(), "sweep": {"grid": {"policy": ["timeslice"]}}})
    direct = {n: run_point(sweep.document({"policy": "timeslice", "tenant.inference.count": n}), path="model")
              for n in (5, 6)}
    assert direct[5]["groups"]["inference"]["p99_ms"] <= 1.5 < direct[6]["groups"]["inference"]["p99_ms"]
    runs = {row["key"]: row for row in found["runs"]}
    assert [runs[k]["axes"]["tenant.inference.count"] for k in by_policy["timeslice"]["decided_by"]] == [5, 6]
    assert runs[by_policy["timeslice"]["decided_by"][1]]["groups"] == direct[6]["groups"]
    lines = printed.splitlines()
    assert lines[0].startswith("tenant.inference.count at most, while inference.p99_ms <= 1.5 (1 to 8 probed")
    assert lines[2].split() == ["mps", "8", "-", "4"] and lines[3].split() == ["timeslice", "5", "6", "6"]
    assert sum("decides" in line for line in lines) == 3
    # Every probe went through the results directory; a rerun finds them all there.
    assert len(list((where / "results").glob("*.json"))) == len(found["runs"]) == 10
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main([str(where / "s.toml"), "--path", "model", "--find", "max:tenant.inference.count", "--until", UNTIL,
                     "--find-limit", "8", "--results", str(where / "results")]) == 0
    assert out.getvalue() == printed
    steps = enumerate([2] * 4 + [1] * 2, 1)  # both lines for 1, 2, 4, 8; then time-slicing's 6 and 5
    assert err.getvalue().splitlines() == [f"mpsd-stress sweep: search step {n}: {lines} of {lines} points already in "
                                           f"{where / 'results'}/, 0 to run" for n, lines in steps]
    assert (where / "f.csv").read_text().count("\n") == 11


def test_the_report_draws_the_tables_figures(searched):
    """--report writes a PNG per plot and report.json, the series each draws; those are the table's figures,
    and the lines drawn are those series."""
    from mpsd.stress.sweep_report import draw

    where, _, found, _ = searched
    plots = json.loads((where / "report" / "report.json").read_text())
    assert [p["file"] for p in plots] == ["p99_ms-vs-tenant.inference.count.png",
                                          "throughput_per_s-vs-tenant.inference.count.png", "frontier.png"]
    for plot in plots:
        assert (where / "report" / plot["file"]).stat().st_size > 1000
    table = {(r["axes"]["policy"], r["axes"]["tenant.inference.count"]): r for r in found["runs"]}
    for plot, figure in zip(plots[:2], ("p99_ms", "throughput_per_s")):
        assert [panel["title"] for panel in plot["panels"]] == ["inference", "training"]
        for panel in plot["panels"]:
            for series in panel["series"]:
                policy = json.loads(series["label"].removeprefix("policy="))
                expected = sorted((n, r["groups"][panel["title"]][figure])
                                  for (p, n), r in table.items() if p == policy)
                assert list(zip(series["x"], series["y"])) == expected
    frontier_plot = plots[2]
    timeslice = frontier_plot["panels"][0]["series"][1]
    assert timeslice["x"] == [1, 2, 4, 5, 6, 8] and timeslice["held"] == [True] * 4 + [False] * 2
    assert timeslice["y"] == [table[("timeslice", n)]["groups"]["inference"]["p99_ms"] for n in timeslice["x"]]
    assert [s["y"] for s in frontier_plot["panels"][1]["series"]] == [[8], [5]]
    drawn = draw(frontier_plot).axes[0].get_lines()
    assert [list(line.get_xdata()) for line in drawn[:2]] == [s["x"] for s in frontier_plot["panels"][0]["series"]]
    assert [list(line.get_ydata()) for line in drawn[:2]] == [s["y"] for s in frontier_plot["panels"][0]["series"]]
    assert list(drawn[2].get_ydata()) == [1.5, 1.5]  # the threshold


def test_parquet_holds_the_csvs_table(searched, tmp_path):
    """--parquet writes the CSV's columns and values (pyarrow is optional: skipped where it is absent)."""
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (optional, not a test dependency)")
    import csv

    where, _, _, argv = searched
    target = tmp_path / "t.parquet"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv, "--parquet", str(target)]) == 0
    table = pq.read_table(target).to_pylist()
    rows = list(csv.DictReader(io.StringIO((where / "f.csv").read_text())))
    assert [list(r) for r in table] == [list(r) for r in rows]
    assert [{k: "" if v is None else str(v) for k, v in r.items()} for r in table] == rows
