# `mpsd simulate`: the GPU model alone in virtual time, fed from a scenario file. Exact and repeatable.
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpsd.simulate import ScenarioError, run_scenario

EXAMPLE = Path(__file__).parent.parent / "examples" / "scenarios" / "inference_beside_training.toml"
MPSD = Path(sys.executable).with_name("mpsd")


def full_waves(repeat: int, **tenant) -> dict:
    return {"name": "t", **tenant, "kernel": [{"name": "spin", "grid": 264, "block": 1024, "args": [1_980_000],
                                              "repeat": repeat}]}


def test_back_to_back_kernels_take_what_the_model_says():
    """Ten full waves of 1 ms blocks end at 10 x (1 ms + the 10 us launch overhead); 25% makes 5 waves each."""
    (fast,) = run_scenario({"tenant": [full_waves(10)]})["tenants"]
    (capped,) = run_scenario({"tenant": [full_waves(2, active_thread_percentage=25)]})["tenants"]
    assert fast["kernels"] == 10 and fast["makespan_ms"] == pytest.approx(10 * 1.01, abs=1e-6)
    assert capped["kernels"] == 2 and capped["makespan_ms"] == pytest.approx(2 * 5.01, abs=1e-6)


def test_same_scenario_same_answer():
    """Virtual time is deterministic: the same scenario gives the same figures every run."""
    scenario = {"device": {"policy": "fair"}, "tenant": [full_waves(5, count=3, weight=2.0)]}
    assert run_scenario(scenario) == run_scenario(scenario)


@pytest.mark.parametrize("scenario,message", [
    ({"tenant": []}, "no kernels"),
    ({"device": {"model": "a100"}, "tenant": [full_waves(1)]}, "unknown device model"),
    ({"device": {"policy": "mig", "policy_options": {"partitions": ["9g"]}}, "tenant": [full_waves(1)]}, "9g"),
    ({"tenant": [{"name": "x", "kernel": [{"name": "nope"}]}]}, "kernel 'nope'"),
])
def test_bad_scenarios_say_what_is_wrong(scenario, message):
    """Scenario mistakes are ScenarioErrors naming the problem."""
    with pytest.raises(ScenarioError, match=message):
        run_scenario(scenario)


def test_cli_compares_policies_on_the_example(tmp_path):
    """The shipped example runs from the command line; under MPS the inference tenant's p99 stays near one
    1-ms block behind the training waves (a real H200 showed 1.10 ms), under time-slicing it is worse."""
    results = {}
    for policy in ("mps", "timeslice"):
        scenario = tmp_path / f"{policy}.toml"
        scenario.write_text(EXAMPLE.read_text().replace('policy = "mps"', f'policy = "{policy}"'))
        out = subprocess.run([MPSD, "simulate", str(scenario), "--json"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        results[policy] = {t["tenant"]: t for t in json.loads(out.stdout)["tenants"]}
    assert results["mps"]["inference"]["latency_p99_ms"] == pytest.approx(1.1, abs=0.05)
    assert results["timeslice"]["inference"]["latency_p99_ms"] > results["mps"]["inference"]["latency_p99_ms"]
    bad = subprocess.run([MPSD, "simulate", str(tmp_path / "missing.toml")], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("mpsd simulate:")
