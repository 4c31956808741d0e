# mpsd-stress on several simulated devices: tenants placed by `device`, each device under its own policy (the
# daemon's [mpsd.device.N] from [run.device.N]), and a timeline per device. Virtual time, in this process.
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpsd.sim import H200
from mpsd.stress.cli import main
from mpsd.stress.metrics import summarize
from mpsd.stress.runner import run_virtual
from mpsd.stress.workload import WorkloadError, parse_workload

WORKLOADS = Path(__file__).parent.parent / "examples" / "workloads"
MIG = {"policy": "mig", "mig-partitions": ["3g.71gb", "3g.71gb"]}


def spin(ms: float, grid: int = 264) -> dict:
    return {"name": "spin", "grid": grid, "block": 1024, "duration_ms": ms}


def workload(*tenants: dict, **run) -> object:
    return parse_workload({"run": {"duration": 0.05, **run}, "tenant": list(tenants)})


@pytest.mark.parametrize("data,message", [
    ({"run": {"devices": 2}, "tenant": [{"name": "a", "device": 2, "kernel": [spin(1)]}]},
     "tenant a: device 2 is not among the run's 2 devices"),
    ({"run": {"devices": 2, "device": {"2": MIG}}, "tenant": [{"kernel": [spin(1)]}]}, "devices 0 to 1"),
    ({"run": {"devices": 0}, "tenant": [{"kernel": [spin(1)]}]}, "devices must be an integer >= 1"),
    ({"run": {"devices": 2}, "tenant": [{"name": "a", "device": 1, "kernel": [spin(1)]},
                                        {"name": "a", "device": 1, "kernel": [spin(1)]}]}, "unique on each device"),
    ({"run": {"devices": 2}, "tenant": [{"name": "p", "ipc": "producer", "kernel": [spin(1)]},
                                        {"name": "p", "device": 1, "kernel": [spin(1)]}]}, "producer's name"),
])
def test_a_bad_placement_says_what_is_wrong(data, message):
    with pytest.raises(WorkloadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_workload(data)


def test_a_tenant_on_the_second_device_takes_what_it_takes_on_the_first():
    """One closed-loop tenant, alone on GPU 1 of two, meets the same requests in the same times as alone on a
    one-device run; GPU 0's timeline is empty."""
    alone = run_virtual(workload({"name": "a", "kernel": [spin(1.0)]}), "mps", {})
    placed = run_virtual(workload({"name": "a", "device": 1, "kernel": [spin(1.0)]}, devices=2), "mps", {},
                         by_device=True)
    assert [t.name for t in placed[1].tenants] == ["a@1"] and placed[0].tenants == []
    assert [r.latency for r in placed[1].requests] == [r.latency for r in alone.requests]
    assert len(alone.requests) > 0.05 / (1e-3 + H200.kernel_overhead + H200.launch_latency + H200.sync_latency)


def test_each_device_runs_its_own_policy():
    """mps on GPU 0 and mig on GPU 1 ([run.device.1]): the same tenant fills GPU 0's 132 SMs and only its
    3g.71gb instance's 60 on GPU 1, and each device's timeline names its policy."""
    w = workload({"name": "a", "kernel": [spin(0.5, grid=528)]},
                 {"name": "a", "device": 1, "partition": 0, "kernel": [spin(0.5, grid=528)]},
                 devices=2, device={"1": MIG})
    timelines = run_virtual(w, "mps", {}, by_device=True)
    assert (timelines[0].policy, timelines[1].policy) == ("mps", "mig")
    gpu0, gpu1 = (summarize(timelines[i])["tenants"] for i in (0, 1))
    assert (gpu0[0]["max_sms"], gpu1[0]["max_sms"]) == (132, 60)
    assert gpu1[0]["completed"] < gpu0[0]["completed"]


@pytest.mark.parametrize("device1, route", [({}, "peer_copies_nvlink"), (MIG, None)])
def test_an_ipc_pipeline_across_devices_maps_over_nvlink_but_not_into_mig(device1, route):
    """A producer on GPU 0 and its consumer on GPU 1: the handle opens over peer access when GPU 1 runs mps,
    and is cudaErrorPeerAccessUnsupported when GPU 1 runs MIG partitions (MIG has no peer access)."""
    w = workload({"name": "p", "ipc": "producer", "kernel": [spin(0.1, grid=8)]},
                 {"name": "c", "device": 1, "ipc": "consumer", "ipc_peer": "p", "kernel": [spin(0.1, grid=8)]},
                 devices=2, device={"1": device1} if device1 else {})
    consumer = summarize(run_virtual(w, "mps", {}, by_device=True)[1])["tenants"][0]
    if route is None:
        assert consumer["errors_by_name"] == {"cudaErrorPeerAccessUnsupported": 1}
    else:
        assert consumer["errors"] == 0 and consumer["completed"] > 0


def test_the_shipped_mps_and_mig_workload_shows_the_seeds_comparison(capsys):
    """examples/workloads/mps_and_mig.toml through mpsd-stress: a run per GPU, named by its policy; MIG's
    instance keeps the inference service's p99 below what it is beside training under MPS, and MPS gives the
    training jobs more requests a second than their shared instance does."""
    assert main([str(WORKLOADS / "mps_and_mig.toml"), "--virtual-time", "--duration", "0.3", "--no-solo",
                 "--quiet", "--json", "-"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert list(runs) == ["GPU 0 (mps)", "GPU 1 (mig)"]
    mps, mig = ({t["tenant"]: t for t in runs[label]["tenants"]} for label in runs)
    assert mig["inference@1"]["latency_ms"]["p99"] < mps["inference"]["latency_ms"]["p99"]
    assert mps["training#0"]["throughput_per_s"] > mig["training@1#0"]["throughput_per_s"]
    assert mig["inference@1"]["max_sms"] <= 60 and mps["training#0"]["max_sms"] == 66


def test_a_device_table_the_daemon_refuses_is_a_usage_error(tmp_path, capsys):
    """A [run.device.N] setting the daemon's [mpsd.device.N] does not take: exit 2, one line naming the workload
    file and its table, before anything runs."""
    path = tmp_path / "w.toml"
    path.write_text('[run]\ndevices = 2\n[run.device.1]\npolicy = "mig"\nslices = 3\n'
                    '[[tenant]]\nname = "a"\n[[tenant.kernel]]\nname = "spin"\nduration_ms = 1\n')
    assert main([str(path), "--virtual-time", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mpsd-stress: {path}: [run.device.1]") and "slices" in err
    assert len(err.splitlines()) == 1
