# `mpsd-stress sweep`: the grammar of a sweep file, the two paths a point runs on (the model alone, the
# in-process daemon) giving the same figures where both serve a point, and the same bytes whatever order or
# number of workers ran the points, with a results directory that a rerun resumes. Tiny workloads (50
# simulated ms, three tenants), so that the whole file stays within a few seconds on two cores.
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mpsd.stress.sweep import load_sweep, model_serves, parse_sweep, pick_path, point_key, run_point
from mpsd.stress.sweep_cli import main
from mpsd.stress.workload import WorkloadError, parse_workload

STRESS = Path(sys.executable).with_name("mpsd-stress")

WORKLOAD = """
[run]
duration = 0.05
seed = 1

[[tenant]]
name = "inference"
think_ms = 0.3
[[tenant.kernel]]
name = "spin"
grid = 8
block = 1024
duration_ms = 0.1

[[tenant]]
name = "training"
[[tenant.kernel]]
name = "work"
grid = 264
block = 1024
iterations = 20000
"""

# Two points the model serves, two that need the daemon (a deadline: SLO attainment is the daemon's figure).
POINTS = [{"policy": "mps"}, {"policy": "timeslice", "tenant.inference.count": 2},
          {"policy": "mps", "tenant.inference.deadline_ms": 0.2},
          {"policy": "timeslice", "tenant.inference.deadline_ms": 1.0, "seed": 2}]


def sweep_text(points: list[dict]) -> str:
    listed = "".join("\n[[sweep.point]]\n" + "".join(f"{json.dumps(k)} = {json.dumps(v)}\n" for k, v in p.items())
                     for p in points)
    return WORKLOAD + listed


def workload() -> dict:
    return tomllib.loads(WORKLOAD)


def test_a_grid_is_every_combination_in_the_files_order():
    """[sweep.grid] is the cartesian product of its axes, the first axis slowest; each point's document has the
    axes written in (tenant.<name>.<key> into that tenant)."""
    sweep = parse_sweep({**workload(), "sweep": {"grid": {"policy": ["mps", "timeslice"],
                                                          "tenant.inference.count": [1, 2, 4]}}})
    assert sweep.points == tuple({"policy": p, "tenant.inference.count": n}
                                 for p in ("mps", "timeslice") for n in (1, 2, 4))
    doc = sweep.document(sweep.points[-1])
    assert doc["run"]["policy"] == "timeslice" and doc["tenant"][0]["count"] == 4
    assert "count" not in doc["tenant"][1] and "count" not in sweep.workload["tenant"][0]  # a copy, each point


def test_points_are_listed_and_a_workload_may_be_a_file(tmp_path):
    """[[sweep.point]] lists points as written; workload = "path" reads the workload from beside the sweep."""
    (tmp_path / "w.toml").write_text(WORKLOAD)
    (tmp_path / "s.toml").write_text('workload = "w.toml"\n[[sweep.point]]\nseed = 3\n'
                                     '[[sweep.point]]\n"run.duration" = 0.02\n"tenant.training.weight" = 2\n')
    sweep = load_sweep(tmp_path / "s.toml")
    assert sweep.points == ({"seed": 3}, {"run.duration": 0.02, "tenant.training.weight": 2})
    assert sweep.document(sweep.points[1])["run"]["duration"] == 0.02
    # The key is the point's workload document's: the same run under either spelling of an axis.
    assert point_key(sweep.document({"seed": 3})) == point_key(sweep.document({"run.seed": 3}))
    assert point_key(sweep.document({"seed": 3})) != point_key(sweep.document({"seed": 4}))
    assert point_key(sweep.document({"seed": 3})) != point_key(sweep.document({"seed": 3}), "model")


@pytest.mark.parametrize(("table", "message"), [
    ({"grid": {"tenant.inference.rte": [1]}},
     "[sweep] unknown axis 'tenant.inference.rte' (known: policy, seed, run.<duration|seed|policy|solo|devices>, "
     "tenant.<name>.<key> with name one of inference, training and key one of active_thread_percentage"),
    ({"grid": {"tenant.serving.rate": [1]}}, "[sweep] axis tenant.serving.rate: no tenant named 'serving' "
                                             "(known: inference, training)"),
    ({"grid": {"run.lenght": [1]}}, "[sweep] unknown axis 'run.lenght'"),
    ({"grid": {"seed": [1]}, "points": []}, "[sweep]: unknown key(s) points (known: grid, point)"),
    ({"grid": {"seed": [1]}, "point": [{"seed": 2}]}, "[sweep] needs one of [sweep.grid]"),
    ({}, "[sweep] needs one of [sweep.grid]"),
    ({"grid": {"seed": []}}, "[sweep.grid] seed must be a non-empty list of values"),
    ({"point": [{"seed": 1}, {"run.seed": 1}]}, "two points of the sweep are the same run"),
    ({"point": [{"seed": 1}, {"tenant.inference.count": 0}]},
     "point tenant.inference.count=0: tenant inference: count must be an integer >= 1, not 0"),
    ({"grid": {"policy": ["mps", "fastest"]}}, 'point policy="fastest": unknown policy'),
])
def test_a_wrong_sweep_is_an_error_naming_the_key(table, message):
    """Every mistake in a sweep is one error naming what is wrong (and, for an unknown key, the known ones),
    found before any point runs."""
    data = {**workload(), "sweep": table}
    with pytest.raises(WorkloadError) as caught:
        parse_sweep(data)
    assert str(caught.value).startswith(message)


def test_the_model_and_the_daemon_give_the_same_figures():
    """Where the model alone serves a point (and the SMs have room) it gives the in-process daemon's figures, to
    rounding (the daemon's run starts at a simulated second); a deadline, which the model does not keep, sends
    a point to the daemon even where the model is asked for."""
    doc = parse_sweep({**workload(), "sweep": {"point": [{"tenant.inference.count": 2}]}}).document(
        {"tenant.inference.count": 2})
    assert model_serves(parse_workload(doc))
    model, daemon = run_point(doc, path="model"), run_point(doc, path="daemon")
    assert model["path"] == "model" and daemon["path"] == "daemon"
    for mine, theirs in [(model["run"], daemon["run"])] + [(model["groups"][g], daemon["groups"][g])
                                                           for g in ("inference", "training")]:
        assert mine.keys() == theirs.keys() and mine["completed"] == theirs["completed"] > 0
        for name, value in mine.items():
            assert value == (None if theirs[name] is None else pytest.approx(theirs[name], rel=1e-9)), name
    doc["tenant"][0]["deadline_ms"] = 0.2
    assert not model_serves(parse_workload(doc)) and pick_path(doc, Path("."), "model") == "daemon"
    assert run_point(doc)["groups"]["inference"]["slo"] is not None


def test_same_bytes_in_any_order_and_any_jobs_and_a_rerun_resumes(tmp_path, capsys):
    """The same points give the same results files, byte for byte, listed in two orders and run by one worker
    or two; a rerun runs nothing, and a deleted result is the one point run again, to the same bytes."""
    forward, backward = tmp_path / "forward.toml", tmp_path / "backward.toml"
    forward.write_text(sweep_text(POINTS))
    backward.write_text(sweep_text(POINTS[::-1]))
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([str(forward), "--path", "model", "--jobs", "2", "--results", str(two),
                 "--json", str(tmp_path / "f.json"), "--csv", str(tmp_path / "f.csv")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == len(POINTS) and err[-1].startswith(f"mpsd-stress sweep: {len(POINTS)}/{len(POINTS)} ")
    assert "s left" in err[0]
    assert main([str(backward), "--path", "model", "--jobs", "1", "--results", str(one),
                 "--json", str(tmp_path / "b.json")]) == 0
    files = sorted(p.name for p in two.iterdir())
    assert len(files) == len(POINTS) and files == sorted(p.name for p in one.iterdir())
    assert all((one / name).read_bytes() == (two / name).read_bytes() for name in files)
    paths = [row["path"] for row in json.loads((tmp_path / "f.json").read_text())]
    assert paths == ["model", "model", "daemon", "daemon"]
    assert json.loads((tmp_path / "b.json").read_text())[::-1] == json.loads((tmp_path / "f.json").read_text())
    csv = (tmp_path / "f.csv").read_text().splitlines()
    assert len(csv) == 1 + len(POINTS) and csv[0].startswith(
        "policy,tenant.inference.count,tenant.inference.deadline_ms,seed,key,path,")
    assert "inference.p99_ms" in csv[0] and "training.throughput_per_s" in csv[0]
    capsys.readouterr()

    before = {name: (two / name).read_bytes() for name in files}
    assert main([str(forward), "--path", "model", "--results", str(two)]) == 0
    assert capsys.readouterr().err == f"mpsd-stress sweep: 4 of 4 points already in {two}/, 0 to run\n"
    (two / files[0]).unlink()
    assert main([str(forward), "--path", "model", "--results", str(two)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"mpsd-stress sweep: 3 of 4 points already in {two}/, 1 to run" and len(err) == 2
    assert {name: (two / name).read_bytes() for name in files} == before


def test_the_command_runs_a_sweep_and_says_what_is_wrong(tmp_path):
    """`mpsd-stress sweep FILE` prints the table; a wrong file is exit 2 and one line naming the mistake."""
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(WORKLOAD + '[sweep.grid]\n"tenant.inference.active_thread_percentage" = [25, 100]\n')
    bad.write_text(WORKLOAD + '[sweep.grid]\n"tenant.inference.rat" = [1]\n')
    done = subprocess.run([STRESS, "sweep", str(good), "--quiet"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == ""
    header, *rows = done.stdout.splitlines()
    assert header.split()[:3] == ["tenant.inference.active_thread_percentage", "path", "inference"]
    assert [row.split()[:2] for row in rows] == [["25", "daemon"], ["100", "daemon"]]
    wrong = subprocess.run([STRESS, "sweep", str(bad)], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.startswith("mpsd-stress sweep: [sweep] unknown axis 'tenant.inference.rat' (known: ")
    assert len(wrong.stderr.splitlines()) == 1
