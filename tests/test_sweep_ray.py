# `mpsd-stress sweep --executor ray`: the same table as local workers, byte for byte, on a local Ray this test
# starts (two CPUs, no dashboard). Ray is an optional extra (mpsd[ray]) and large, so it is not a test dependency:
# where it is not installed the test is skipped, saying so.
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from mpsd.stress.sweep_cli import main

from test_sweep import POINTS, sweep_text

ray = pytest.importorskip("ray", reason="Ray is not installed (the optional extra mpsd[ray]; not a test dependency)")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_gives_the_local_table_byte_for_byte(local_ray, tmp_path):
    """The same points on Ray and on local workers give the same JSON and CSV tables, byte for byte, with a
    progress line per point as each comes back."""
    sweep = tmp_path / "s.toml"
    sweep.write_text(sweep_text(POINTS))
    tables = {}
    for executor in ("local", "ray"):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            assert main([str(sweep), "--path", "model", "--jobs", "2", "--executor", executor,
                         "--json", str(tmp_path / f"{executor}.json"), "--csv", str(tmp_path / f"{executor}.csv"),
                         "--results", str(tmp_path / executor)]) == 0
        assert len(err.getvalue().splitlines()) == len(POINTS), err.getvalue()
        tables[executor] = [(tmp_path / f"{executor}.{kind}").read_bytes() for kind in ("json", "csv")]
    assert tables["ray"] == tables["local"]
    assert sorted(p.read_bytes() for p in (tmp_path / "ray").iterdir()) == sorted(
        p.read_bytes() for p in (tmp_path / "local").iterdir())


def test_a_point_that_fails_on_ray_comes_back_as_its_own_error(local_ray):
    """A point's WorkloadError raised in a Ray worker comes back as that WorkloadError, not Ray's wrapper, so that
    the command names the point and exits as it does for a local one."""
    from mpsd.stress.sweep_executors import Task
    from mpsd.stress.sweep_ray import RayExecutor
    from mpsd.stress.workload import WorkloadError

    document = {"run": {"duration": 0.01}, "tenant": [{"name": "a", "count": 0, "kernel": [
        {"name": "spin", "grid": 1, "block": 32, "duration_ms": 0.1}]}]}
    executor = RayExecutor(None)
    [(key, outcome)] = list(executor.run([Task("k", document, Path("."), "daemon")]))
    executor.close()  # (a Ray it did not start is left running)
    assert key == "k" and type(outcome) is WorkloadError
    assert str(outcome) == "tenant a: count must be an integer >= 1, not 0"
    assert ray.is_initialized()
