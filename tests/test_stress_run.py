# mpsd-stress end to end: the command, a real daemon of its own, real tenant processes, the JSON and the report.
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpsd.record.trace import load_trace

MIX = """
[run]
duration = 0.6
seed = 2

[[tenant]]
name = "latency"
arrival = "uniform"
rate = 100
deadline_ms = 50
input = "64K"
output = "16K"
[[tenant.kernel]]
name = "spin"
grid = 8
block = 1024
duration_ms = 0.2

[[tenant]]
name = "batch"
count = 2
active_thread_percentage = 25
pinned_mem_limit = "2G"
memory = "256M"
churn = "64M"
[[tenant.kernel]]
name = "work"
grid = 132
block = 1024
iterations = 20000
"""


def stress(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mpsd.stress.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_a_small_mix_with_real_processes(tmp_path):
    (tmp_path / "mix.toml").write_text(MIX)
    done = stress(str(tmp_path / "mix.toml"), "--compare-policies", "mps,timeslice", "--duration", "0.1",
                  "--json", "-", "--report", str(tmp_path / "report"))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["clock"] == "virtual" and result["in_process"] is False
    assert set(result["runs"]) == {"mps", "timeslice"}
    for run in result["runs"].values():
        tenants = {t["tenant"]: t for t in run["tenants"]}
        assert set(tenants) == {"latency", "batch#0", "batch#1"}
        assert run["quota_violations"] == 0 and run["errors"] == 0
        latency = tenants["latency"]
        assert latency["requests"] == 10  # uniform at 100/s for 0.1 s
        assert latency["completed"] == 10 and 0 < latency["latency_ms"]["p50"] <= latency["latency_ms"]["p99"]
        assert latency["memory_high_water"] == 2 << 20  # its input and output buffers, packed in one 2 MiB chunk
        assert latency["isolation"] is not None and latency["isolation"] > 0  # the solo run happened
        assert run["solo_p99_ms"]["batch#0"] == run["solo_p99_ms"]["batch#1"] > 0
        for name in ("batch#0", "batch#1"):
            batch = tenants[name]
            assert batch["completed"] > 0 and batch["sm_cap"] == 32 and 0 < batch["max_sms"] <= 32
            # What the daemon charged: 256 MiB held, plus 64 MiB of churn at a time.
            assert batch["memory_high_water"] == (256 + 64) << 20
            assert batch["kernels"] >= batch["completed"] and batch["sm_seconds"] > 0
        assert sum(t["sm_share"] for t in tenants.values()) == pytest.approx(1.0)
    assert "policies compared" in done.stderr and "latency p99 ms" in done.stderr
    # stderr is no terminal here: progress comes as lines, each run's phases (on the virtual clock, with no
    # time left: how long simulated time takes is not known)
    assert "mpsd-stress: timeslice: running latency " in done.stderr
    assert "mpsd-stress: mps: finished latency 10 done, batch " in done.stderr
    report = tmp_path / "report"
    assert {p.name for p in report.iterdir()} == {"latency_cdf_mps.png", "occupancy_mps.png", "trace_mps.json",
                                                  "latency_cdf_timeslice.png", "occupancy_timeslice.png",
                                                  "trace_timeslice.json", "compare.png"}
    timeline = load_trace(report / "trace_mps.json")
    assert {s.tenant for s in timeline.spans} == {"latency", "batch#0", "batch#1"}
    assert all(0 <= s.sm < 132 and s.start <= s.end for s in timeline.spans)
    # Device time and the tenants' clock line up: every kernel ran inside a request of its tenant.
    windows = {}
    for r in timeline.requests:
        lo, hi = windows.get(r.tenant, (r.submitted, r.completed))
        windows[r.tenant] = (min(lo, r.submitted), max(hi, r.completed))
    for k in timeline.kernels:
        lo, hi = windows[k.tenant]
        assert lo - 0.005 <= k.submitted and k.ended <= hi + 0.005


def test_bad_workload_is_a_usage_error(tmp_path):
    (tmp_path / "bad.toml").write_text("[[tenant]]\nname = 'x'\n")
    done = stress(str(tmp_path / "bad.toml"))
    assert done.returncode == 2 and done.stderr.startswith("mpsd-stress: tenant x: needs at least one")
    done = stress(str(tmp_path / "bad.toml"), "--compare-policies", "mps,nope")
    assert done.returncode == 2


def test_virtual_time_from_the_command_line(tmp_path):
    (tmp_path / "mix.toml").write_text(MIX)
    done = stress(str(tmp_path / "mix.toml"), "--virtual-time", "--scale", "10", "--no-solo", "--duration", "0.01",
                  "--json", "-")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["in_process"] is True and result["runs"]["mps"]["virtual"] is True
    assert len(result["runs"]["mps"]["tenants"]) == 3 * 10


def test_weights_and_priority_levels_reach_the_daemon(tmp_path):
    """Weights and priority levels MPS has no variable for go through mpsd-control (a refused command fails the
    run, so the level -2 is checked to be accepted): under fair share, a tenant
    with three times the weight gets the larger share of SM-time. Kernels of ten waves, so a kernel boundary (where
    the other tenant takes the freed SMs for one block's time) costs little."""
    (tmp_path / "fair.toml").write_text("""
[run]
duration = 0.5
[[tenant]]
name = "heavy"
weight = 3.0
priority = -2
[[tenant.kernel]]
name = "spin"
grid = 2640
block = 1024
duration_ms = 1.0
repeat = 2
[[tenant]]
name = "light"
[[tenant.kernel]]
name = "spin"
grid = 2640
block = 1024
duration_ms = 1.0
repeat = 2
""")
    done = stress(str(tmp_path / "fair.toml"), "--policy", "fair", "--no-solo", "--json", "-")
    assert done.returncode == 0, done.stderr
    heavy, light = json.loads(done.stdout)["runs"]["fair"]["tenants"]
    assert heavy["entitlement"] == 0.75 and light["entitlement"] == 0.25
    assert heavy["sm_share"] > 1.5 * light["sm_share"]


def test_a_run_started_beside_another_mpsd_package_uses_the_installed_one(tmp_path):
    """From a directory holding an mpsd/ of its own (a clone not built, say), mpsd-stress's daemon and tenants
    still import the installed mpsd: `python -m` would put the directory first on their path."""
    (tmp_path / "mpsd").mkdir()
    (tmp_path / "mpsd" / "__init__.py").write_text("raise ImportError('not the installed mpsd')\n")
    (tmp_path / "mpsd_client").mkdir()
    (tmp_path / "mpsd_client" / "__init__.py").write_text("raise ImportError('not the installed mpsd_client')\n")
    (tmp_path / "mix.toml").write_text(MIX)
    cli = subprocess.run([sys.executable, "-P", "-m", "mpsd.stress.cli", "mix.toml", "--duration", "0.05",
                          "--no-solo", "--json", "-"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["runs"]["mps"]["errors"] == 0
