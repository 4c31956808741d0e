# `mpsd simulate`: the GPU model alone in virtual time, fed from a workload file or (translated, with a note)
# an old scenario file. Exact and repeatable.
from __future__ import annotations

import json
import math
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mpsd.sim import H200
from mpsd.stress.workload import WorkloadError
from mpsd.tools.scenario import to_toml, to_workload
from mpsd.tools.simulate import run_scenario

HOST_MS = (H200.launch_latency + H200.sync_latency) * 1e3  # what an idle tenant pays on the host, once per wait
OVERHEAD_MS = H200.kernel_overhead * 1e3  # what the device pays before each kernel of a stream
EXAMPLE = Path(__file__).parent.parent / "examples" / "simulate" / "inference_beside_training.toml"
MPSD = Path(sys.executable).with_name("mpsd")


def full_waves(repeat: int, **tenant) -> dict:
    return {"name": "t", **tenant, "kernel": [{"name": "spin", "grid": 264, "block": 1024, "args": [1_980_000],
                                              "repeat": repeat}]}


def test_back_to_back_kernels_take_what_the_model_says():
    """Ten full waves of 1 ms blocks end at 10 x (1 ms + the device's launch overhead), plus one idle launch
    and a synchronise right after the last launch on the host; 25% makes 5 waves each."""
    (fast,) = run_scenario({"tenant": [full_waves(10)]})["tenants"]
    (capped,) = run_scenario({"tenant": [full_waves(2, active_thread_percentage=25)]})["tenants"]
    host_ms = (H200.launch_latency + H200.sync_latency_busy) * 1e3
    assert fast["kernels"] == 10 and fast["makespan_ms"] == pytest.approx(10 * (1 + OVERHEAD_MS) + host_ms, abs=1e-6)
    assert capped["kernels"] == 2 and capped["makespan_ms"] == pytest.approx(2 * (5 + OVERHEAD_MS) + host_ms, abs=1e-6)


def test_back_to_back_launches_are_bound_by_the_host():
    """Kernels shorter than a launch call run one per call: the device waits for the host. 100 empty kernels
    take one idle launch, 99 busy ones, the last kernel and a synchronise."""
    empty = {"name": "e", "kernel": [{"name": "spin", "grid": 1, "block": 32, "args": [0], "repeat": 100}]}
    (t,) = run_scenario({"tenant": [empty]})["tenants"]
    assert H200.launch_latency_busy > H200.kernel_overhead + H200.min_block_time
    expected = (H200.launch_latency + 99 * H200.launch_latency_busy + H200.kernel_overhead + H200.min_block_time
                + H200.sync_latency_busy)
    assert t["makespan_ms"] == pytest.approx(expected * 1e3, abs=1e-9)


def test_a_lone_kernel_costs_host_launch_device_and_synchronise():
    """Tenant-observed latency alone = launch latency + kernel overhead + the block + synchronise latency."""
    probe = {"name": "p", "kernel": [{"name": "spin", "grid": 8, "block": 1024, "args": [198_000], "at": 0.01}]}
    (t,) = run_scenario({"tenant": [probe]})["tenants"]
    expected = H200.launch_latency + H200.kernel_overhead + 198_000 / H200.clock_hz + H200.sync_latency
    assert H200.launch_latency > 0 and H200.sync_latency > 0
    assert t["latency_p50_ms"] == pytest.approx(expected * 1e3, abs=1e-9)
    assert t["makespan_ms"] == pytest.approx((0.010 + expected) * 1e3, abs=1e-9)


def test_closed_loop_launches_after_synchronise_and_sleep():
    """With `sleep`, each launch follows the previous synchronise's return and the sleep (a closed loop)."""
    probe = {"name": "p", "kernel": [{"name": "spin", "grid": 8, "block": 1024, "args": [198_000], "repeat": 4,
                                      "sleep": 0.005}]}
    (t,) = run_scenario({"tenant": [probe]})["tenants"]

    def one(idle: float) -> float:  # the host's figures, warmth exp(-idle / cooling) of the way to busy
        w = math.exp(-idle / H200.host_cooling)
        return (H200.launch_latency - (H200.launch_latency - H200.launch_latency_busy) * w + H200.kernel_overhead
                + 198_000 / H200.clock_hz + H200.sync_latency - (H200.sync_latency - H200.sync_latency_busy) * w)

    assert t["kernels"] == 4
    assert t["makespan_ms"] == pytest.approx((one(math.inf) + 3 * (0.005 + one(0.005))) * 1e3, abs=1e-9)
    (tight,) = run_scenario({"tenant": [{"name": "p", "kernel": [dict(probe["kernel"][0], sleep=0.0)]}]})["tenants"]
    assert tight["latency_p50_ms"] == pytest.approx(one(0.0) * 1e3, abs=1e-9)  # back to back: the busy figures
    assert one(0.0) < one(0.001) < one(0.005) < one(math.inf)


def test_closed_loop_beside_full_waves_waits_for_the_running_wave():
    """A closed-loop probe beside back-to-back full waves never preempts them under MPS: each wait is at
    most one wave (1 ms and its launch overhead) plus its own 0.1 ms and the host latencies."""
    probe = {"name": "p", "kernel": [{"name": "spin", "grid": 8, "block": 1024, "args": [198_000],
                                                  "repeat": 20, "sleep": 0.005, "at": 0.02}]}
    result = run_scenario({"tenant": [probe, full_waves(200)]})
    p = result["tenants"][0]
    assert p["kernels"] == 20
    own = 0.1 + OVERHEAD_MS
    assert own < p["latency_p50_ms"] <= p["latency_p99_ms"] <= (1 + OVERHEAD_MS) + own + HOST_MS + 1e-9


def copies(kind: str, nbytes: int, **entry) -> dict:
    return {"kind": kind, "bytes": nbytes, **entry}


def test_a_lone_copy_costs_its_call_the_engine_and_a_synchronise():
    """A host-to-device copy alone: the copy call (a fraction of a launch's), the engine's fixed latency and
    the bytes at PCIe bandwidth, then a synchronise."""
    (t,) = run_scenario({"tenant": [{"name": "c", "copy": [copies("h2d", 55_000_000, at=0.01)]}]})["tenants"]
    call = dict(H200.copy_calls)["h2d"] * H200.launch_latency
    expected = call + H200.copy_latency + 55_000_000 / H200.pcie_bandwidth + H200.sync_latency
    assert 0 < call < H200.launch_latency
    assert t["kernels"] == 1 and t["latency_p50_ms"] == pytest.approx(expected * 1e3, abs=1e-9)


def test_a_small_copy_waits_for_the_other_streams_slice():
    """A 64-KiB copy launched every so often beside a stream of 256-MiB copies waits for that stream's copy-
    engine slice to end, which a closed loop meets at the same point each time: its latency and its sleep add
    up to one slice and its own copy (run 8 on an H200: 0.496 ms after sleeps of 0.5 ms that took 0.56)."""
    probe = {"name": "probe", "copy": [copies("h2d", 65536, repeat=50, sleep=0.0005, at=0.01)]}
    stream = {"name": "stream", "copy": [copies("h2d", 256 << 20, repeat=10)]}
    alone = run_scenario({"tenant": [probe]})["tenants"][0]
    beside = run_scenario({"tenant": [probe, stream]})["tenants"][0]
    assert alone["latency_p99_ms"] < 0.05
    own = H200.copy_latency + 65536 / H200.pcie_bandwidth
    assert beside["latency_p50_ms"] == pytest.approx((H200.copy_timeslice + own - 0.0005) * 1e3, abs=1e-6)


def test_device_copies_are_kernels_under_the_tenants_quota():
    """A device-to-device copy runs on the SMs: at 25% active threads it takes longer, and beside a tenant of
    full-GPU waves it waits for a wave to end (its blocks queue behind the running ones)."""
    def latency(busy: bool = False, **tenant) -> float:
        c = {"name": "c", **tenant, "copy": [copies("d2d", 256 << 20, at=0.0015)]}  # mid-wave, if busy
        others = [full_waves(10)] if busy else []
        return {t["tenant"]: t for t in run_scenario({"tenant": [c, *others]})["tenants"]}["c"]["latency_p50_ms"]

    alone, capped, busy = latency(), latency(active_thread_percentage=25), latency(busy=True)
    assert capped > 1.5 * alone
    assert busy > alone + 0.3  # half of a 1-ms wave was left


def test_same_scenario_same_answer():
    """Virtual time is deterministic: the same scenario gives the same figures every run."""
    scenario = {"device": {"policy": "fair"}, "tenant": [full_waves(5, count=3, weight=2.0)]}
    assert run_scenario(scenario) == run_scenario(scenario)


@pytest.mark.parametrize("scenario,message", [
    ({"tenant": []}, "no kernels"),
    ({"device": {"model": "a100"}, "tenant": [full_waves(1)]}, "unknown device model"),
    ({"device": {"policy": "mig", "policy_options": {"partitions": ["9g"]}}, "tenant": [full_waves(1)]}, "9g"),
    ({"tenant": [{"name": "x", "kernel": [{"name": "nope"}]}]}, r"kernel 0 \(nope\): unknown kernel"),
    ({"tenant": [{"name": "x", "kernel": [{"name": "spin", "args": [1, 2]}]}]}, "args must be 1 values"),
    ({"tenant": [{"name": "x", "kernel": [{"name": "spin", "args": [1], "period": 1, "sleep": 1}]}]}, "not both"),
    ({"tenant": [{"name": "x", "copy": [{"kind": "p2p", "bytes": 1}]}]}, "kind must be one of"),
    ({"tenant": [{"name": "x", "copy": [{"kind": "h2d", "bytes": -1}]}]}, r"\(memcpy_htod\): bytes"),
    ({"tenant": [{"name": "x", "copy": [{"kind": "d2d", "bytes": 1, "stream": "s"}]}]}, "copy d2d: stream"),
    ({"tenant": [{"name": "x", "kernel": [dict(full_waves(1)["kernel"][0], stream=1)],
                  "copy": [{"kind": "h2d", "bytes": 1}]}]}, "tenant x: its kernels and copies are paced apart"),
    ({"device": {"policyy": "fair"}, "tenant": [full_waves(1)]}, r"\[device\]: unknown setting\(s\) policyy"),
    ({"tenant": [full_waves(1)], "time_scale": 2}, r"the scenario: unknown setting\(s\) time_scale"),
    ({"tenant": [dict(full_waves(1), at=0.1)]}, r"tenant t: unknown setting\(s\) at"),
    ({"tenant": [{"name": "x", "kernel": [{"name": "spin", "args": [1], "pereod": 1}]}]}, r"kernel spin: unknown"),
])
def test_bad_scenarios_say_what_is_wrong(scenario, message):
    """Scenario mistakes are WorkloadErrors naming the problem."""
    with pytest.raises(WorkloadError, match=message):
        run_scenario(scenario)


def test_cli_compares_policies_on_the_example(tmp_path):
    """The shipped example (a workload file: no note) runs from the command line; under MPS the inference
    tenant's p99 stays near one 1-ms block behind the training waves (a real H200, open loop, showed 1.149 ms:
    h200_timing_extra.json), under time-slicing it is worse."""
    results = {}
    for policy in ("mps", "timeslice"):
        scenario = tmp_path / f"{policy}.toml"
        scenario.write_text(EXAMPLE.read_text().replace('policy = "mps"', f'policy = "{policy}"'))
        out = subprocess.run([MPSD, "simulate", str(scenario), "--json"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        results[policy] = {t["tenant"]: t for t in json.loads(out.stdout)["tenants"]}
    assert results["mps"]["inference"]["latency_p99_ms"] == pytest.approx(1.149, abs=0.05)
    assert results["timeslice"]["inference"]["latency_p99_ms"] > results["mps"]["inference"]["latency_p99_ms"]
    bad = subprocess.run([MPSD, "simulate", str(tmp_path / "missing.toml")], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("mpsd simulate:")


# One scenario of each pacing and call the old format had: back to back, open loop (a period that is a whole
# rate, and one that is not), closed loop, copies of every kind, policy options.
OLD = """
[device]
policy = "timeslice"
[device.policy_options]
timeslice = 0.001
[[tenant]]
name = "probe"
[[tenant.kernel]]
name = "spin"
grid = 8
block = 1024
args = [198000]
repeat = 20
sleep = 0.002
at = 0.001
[[tenant]]
name = "batch"
count = 2
active_thread_percentage = 50
[[tenant.kernel]]
name = "work"
grid = 132
block = 1024
args = [20000]
repeat = 30
[[tenant.copy]]
kind = "d2d"
bytes = 16777216
[[tenant.copy]]
kind = "memset"
bytes = 16777216
repeat = 2
[[tenant]]
name = "feed"
[[tenant.copy]]
kind = "h2d"
bytes = 65536
repeat = 25
period = 0.0019
stream_priority = -1
[[tenant]]
name = "drain"
[[tenant.copy]]
kind = "d2h"
bytes = 1048576
repeat = 10
period = 0.002
at = 0.0005
"""


def simulate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MPSD, "simulate", *map(str, args)], capture_output=True, text=True, timeout=120)


def test_an_old_scenario_file_runs_with_a_note_and_as_its_conversion(tmp_path):
    """An old scenario file still runs, with one note on stderr naming it and what to write instead, and
    gives the same figures, to the bit, as the workload file `--convert` prints for it (which runs without
    a note)."""
    old = tmp_path / "old.toml"
    old.write_text(OLD)
    ran, converted = simulate(old, "--json"), simulate(old, "--convert")
    assert ran.returncode == converted.returncode == 0, ran.stderr + converted.stderr
    (note,) = ran.stderr.splitlines()
    assert note.startswith(f"mpsd simulate: {old}: note: scenario files are deprecated")
    assert f"mpsd simulate --convert {old}" in note and converted.stderr == ran.stderr
    new = tmp_path / "new.toml"
    new.write_text(converted.stdout)
    again = simulate(new, "--json")
    assert again.returncode == 0 and again.stderr == ""
    assert json.loads(again.stdout) == json.loads(ran.stdout)
    # What the scenario reader gave before scenarios were translated (mpsd 3d584e8; identical there, to the bit).
    tenants = json.loads(ran.stdout)["tenants"]
    figures = [f for t in tenants for f in (t["kernels"], t["makespan_ms"], t["latency_p99_ms"])]
    assert figures == pytest.approx([20, 45.90711411965818, 1.5185499999999996, 33, 16.316799982869536,
                                     16.316799982869536, 33, 17.07052996573908, 17.07052996573908,
                                     25, 45.62918343772164, 0.03407676363636364,
                                     10, 18.546098589821746, 0.05032331818181814], rel=1e-12)


def test_conversion_writes_toml_that_reads_back_the_same():
    """The converted document survives TOML: written and read back it is the same tables (so --convert's
    output is the workload it ran)."""
    doc = to_workload(tomllib.loads(OLD))
    assert tomllib.loads(to_toml(doc)) == doc
    assert doc["tenant"][2]["arrival"] == "trace"  # 1 / (1 / 0.0019) is not 0.0019: its times, as they were
    assert doc["tenant"][3]["arrival"] == "uniform" and doc["tenant"][3]["start"] == 0.0005


def test_a_workload_file_runs_and_says_what_the_model_leaves_out(tmp_path):
    """mpsd simulate reads the workload format: arrivals drawn as mpsd-stress draws them, requests of calls
    in order; what the model alone cannot run (memory, deadlines) is named in one note. An unknown key is an
    error naming the key and the file."""
    path = tmp_path / "w.toml"
    path.write_text("""
[run]
duration = 0.05
seed = 3
[[tenant]]
name = "serving"
arrival = "poisson"
rate = 400
deadline_ms = 2.0
memory = "1G"
input = "64K"
[[tenant.kernel]]
name = "spin"
grid = 8
block = 1024
duration_ms = 0.1
[[tenant]]
name = "batch"
[[tenant.kernel]]
name = "work"
grid = 264
block = 1024
iterations = 93638
""")
    done = simulate(path, "--json")
    assert done.returncode == 0, done.stderr
    assert done.stderr == (f"mpsd simulate: {path}: not modelled here (mpsd-stress --virtual-time runs them): "
                           "tenant serving: memory, deadline_ms\n")
    serving, batch = json.loads(done.stdout)["tenants"]
    from mpsd.stress.workload import arrival_times, load_workload
    arrivals = arrival_times(load_workload(path).tenants[0], 0.05, 3)
    assert serving["kernels"] == 2 * len(arrivals)  # its input copy and its kernel
    assert batch["kernels"] > 40  # 1-ms waves back to back, each after the last one's synchronise
    path.write_text(path.read_text().replace("seed = 3", "seed = 3\npolicyy = 'fair'"))
    bad = simulate(path)
    assert bad.returncode == 2 and bad.stderr == f"mpsd simulate: {path}: [run]: unknown setting(s) policyy\n"
