"""Policies written in Python (mpsd.sim.Policy): the engine calls their dispatch and window, places blocks
through its own rule, and raises what they raise."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_golden  # noqa: E402
from sim_scenarios import play  # noqa: E402

from mpsd.sim import H200, Kernel, Policy, Simulator, kernel_cost  # noqa: E402

SPIN = kernel_cost(H200, "spin", 1, 1024, [round(1e-3 * 1.98e9)])  # 1 ms blocks


class LaunchOrder(Policy):
    """Every ready kernel in turn, all it can place: what mps does."""

    name = "launch-order"

    def dispatch(self, ready):
        for run in ready:
            run.place()


class Lower(Policy):
    """Even clients on SMs 0-9, odd ones on 10-19, each kernel placed in turn."""

    def window(self, client):
        return (0, 10) if client % 2 == 0 else (10, 20)

    def dispatch(self, ready):
        for run in ready:
            run.place()


def test_launch_order_in_python_gives_mps_to_the_bit():
    """A Python policy offering every ready kernel in turn gives the recorded mps behaviour on 300 scenarios."""
    golden = sim_golden.load()["digests"]["mps"]
    for seed in range(300):
        record = play(lambda spec, policy, record, options: Simulator(spec, LaunchOrder(), record), seed, "mps")
        assert sim_golden.digest(sim_golden.normal(record)) == golden[seed], f"seed {seed}"


def test_a_window_keeps_a_client_on_its_sms():
    """The SMs a Python policy's window names are the only ones its client's blocks land on."""
    sim = Simulator(policy=Lower(), record=True)
    for client in (0, 1):
        sim.submit(Kernel(client=client, stream=0, blocks=100, threads=1024, cost=SPIN))
    sim.run()
    assert {g.sm for g in sim.trace if g.op.client == 0} == set(range(10))
    assert {g.sm for g in sim.trace if g.op.client == 1} == set(range(10, 20))


def test_a_policy_named_module_colon_class_is_built_with_the_options():
    """"module:Class" builds the class with policy_options as keyword arguments."""
    sim = Simulator(policy="examples.sjf_policy:ShortestJobFirst")
    assert sim.policy.name == "shortest-job-first"
    with pytest.raises(ValueError, match="takes no arguments"):
        Simulator(policy="examples.sjf_policy:ShortestJobFirst", policy_options={"nope": 1})
    with pytest.raises(ValueError, match="mpsd.sim:Kernel is not a Policy"):
        Simulator(policy="mpsd.sim:Kernel")
    with pytest.raises(ValueError, match="No module"):
        Simulator(policy="no_such_module:Policy")
    with pytest.raises(ValueError, match="own constructor"):
        Simulator(policy=LaunchOrder(), policy_options={"a": 1})


def test_what_a_policy_raises_comes_out_of_the_call_that_ran_it():
    """An exception in dispatch is raised by the advance that dispatched, and a ready kernel kept past its
    dispatch cannot place blocks."""
    kept = []

    class Broken(Policy):
        def dispatch(self, ready):
            kept.extend(ready)
            raise KeyError("boom")

    sim = Simulator(policy=Broken())
    sim.submit(Kernel(client=1, stream=0, blocks=4, threads=256, cost=SPIN))
    with pytest.raises(KeyError, match="boom"):
        sim.run()
    with pytest.raises(RuntimeError, match="only during a dispatch"):
        kept[0].place()


def test_mpsd_stress_runs_a_policy_written_in_python(tmp_path):
    """mpsd-stress --policy module:Class plays a workload under it, in virtual time, and names it; a name that
    is neither a built-in nor module:Class is refused with the known ones."""
    workload = Path(__file__).parent.parent / "examples" / "workloads" / "inference_training.toml"
    out = tmp_path / "results.json"
    run = subprocess.run([sys.executable, "-m", "mpsd.stress.cli", str(workload), "--policy",
                          "examples.sjf_policy:ShortestJobFirst", "--virtual-time", "--duration", "0.05",
                          "--json", str(out)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())
    assert "examples.sjf_policy:ShortestJobFirst" in json.dumps(results)
    refused = subprocess.run([sys.executable, "-m", "mpsd.stress.cli", str(workload), "--policy", "nope"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "or module:Class" in refused.stderr
