# mpsd-stress's workload files and its virtual-time runner: what a workload means, checked on the model alone,
# where every figure is exact and every run the same.
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from mpsd.sim import H200
from mpsd.stress.metrics import summarize
from mpsd.stress.runner import run_virtual
from mpsd.stress.workload import WorkloadError, arrival_times, load_workload, parse_workload

WORKLOADS = Path(__file__).parent.parent / "examples" / "workloads"
HOST = H200.launch_latency + H200.sync_latency  # a thread's launch and synchronise after a long idle time
HOST_BUSY = H200.launch_latency_busy + H200.sync_latency_busy  # ... right after its previous call


def workload(*tenants: dict, **run) -> object:
    return parse_workload({"run": {"duration": 0.05, **run}, "tenant": list(tenants)})


def spin(ms: float, grid: int = 264, repeat: int = 1) -> dict:
    return {"name": "spin", "grid": grid, "block": 1024, "duration_ms": ms, "repeat": repeat}


@pytest.mark.parametrize("path", sorted([*WORKLOADS.glob("*.toml"), *WORKLOADS.parent.glob("simulate/*.toml")]),
                         ids=lambda p: p.stem)
def test_shipped_workloads_parse(path):
    """Every shipped workload, those for mpsd simulate too (one format), is a valid workload file."""
    w = load_workload(path)
    assert w.tenants and w.duration > 0


@pytest.mark.parametrize("data,message", [
    ({"tenant": []}, "no [[tenant]]"),
    ({"run": {"duration": 0}, "tenant": [{"kernel": [spin(1)]}]}, "duration must be positive"),
    ({"run": {"bogus": 1}, "tenant": [{"kernel": [spin(1)]}]}, "unknown setting(s) bogus"),
    ({"tenant": [{"name": "a", "kernel": [spin(1)], "colour": "red"}]}, "tenant a: unknown setting(s) colour"),
    ({"tenant": [{"name": "a", "kernel": []}]}, "tenant a: needs at least one"),
    ({"tenant": [{"name": "a", "arrival": "poisson", "kernel": [spin(1)]}]}, "needs a positive rate"),
    ({"tenant": [{"name": "a", "arrival": "sometimes", "kernel": [spin(1)]}]}, "arrival must be one of"),
    ({"tenant": [{"name": "a", "kernel": [{"name": "nope"}]}]}, "unknown kernel"),
    ({"tenant": [{"name": "a", "kernel": [{"name": "spin"}]}]}, "needs duration_ms"),
    ({"tenant": [{"name": "a", "active_thread_percentage": 0, "kernel": [spin(1)]}]}, "(0, 100]"),
    ({"tenant": [{"name": "a", "memory": "lots", "kernel": [spin(1)]}]}, "tenant a: memory"),
    ({"tenant": [{"name": "a", "input": -1, "kernel": [spin(1)]}]}, "tenant a: input"),
    ({"tenant": [{"name": "a", "kernel": [spin(1)]}, {"name": "a", "kernel": [spin(1)]}]}, "unique"),
    ({"tenant": [{"name": "c", "ipc": "consumer", "ipc_peer": "p", "kernel": [spin(1)]}]}, "ipc_peer"),
    ({"tenant": [{"name": "a", "kernel": [{"name": "memset"}]}]}, "kernel 0 (memset): needs bytes"),
    ({"tenant": [{"name": "a", "kernel": [{"name": "memset", "bytes": 4, "grid": 2}]}]}, "unknown setting(s) grid"),
    ({"tenant": [{"name": "a", "requests": 0, "kernel": [spin(1)]}]}, "tenant a: requests must be"),
    ({"tenant": [{"name": "a", "start": -1, "kernel": [spin(1)]}]}, "tenant a: start must be"),
    ({"tenant": [{"name": "a", "graph": "yes", "kernel": [spin(1)]}]}, "tenant a: graph must be true or false"),
])
def test_a_bad_workload_says_what_is_wrong(data, message):
    with pytest.raises(WorkloadError) as info:
        parse_workload(data)
    assert message in str(info.value)


def test_arrival_processes():
    w = parse_workload({"tenant": [
        {"name": "u", "arrival": "uniform", "rate": 100, "kernel": [spin(1)]},
        {"name": "p", "arrival": "poisson", "rate": 1000, "kernel": [spin(1)]},
        {"name": "b", "arrival": "bursty", "rate": 1000, "burst": 10, "kernel": [spin(1)]},
        {"name": "t", "arrival": "trace", "trace": [0.5, 0.1, 3.0], "kernel": [spin(1)]},
        {"name": "c", "kernel": [spin(1)]},
    ]})
    u, p, b, t, c = (arrival_times(x, 2.0, seed=1) for x in w.tenants)
    assert len(u) == 200 and all(y - x == pytest.approx(0.01) for x, y in zip(u, u[1:]))
    assert 1800 < len(p) < 2200 and p == sorted(p) and p == arrival_times(w.tenants[1], 2.0, seed=1)
    assert p != arrival_times(w.tenants[1], 2.0, seed=2)
    twice = replace(w.tenants[1], count=2)  # copies of one tenant draw their own arrivals
    assert arrival_times(twice, 2.0, seed=1, copy=0) != arrival_times(twice, 2.0, seed=1, copy=1)
    assert len(b) % 10 == 0 and all(b[i] == b[i - i % 10] for i in range(len(b)))  # bursts of ten at one instant
    assert t == [0.1, 0.5]  # sorted, and cut at the end of the run
    assert c is None  # closed loop


def test_start_and_requests_bound_arrivals():
    """`start` shifts a tenant's arrivals (a uniform tenant's first is at it, without a random phase);
    `requests` makes that many at most, within the run's duration."""
    w = parse_workload({"tenant": [
        {"name": "u", "arrival": "uniform", "rate": 200, "start": 0.5, "requests": 250, "kernel": [spin(1)]},
        {"name": "p", "arrival": "poisson", "rate": 1000, "requests": 5, "kernel": [spin(1)]},
        {"name": "t", "arrival": "trace", "trace": [0.0, 0.25, 9.0], "start": 1.0, "kernel": [spin(1)]},
    ]})
    u, p, t = (arrival_times(x, 2.0, seed=1) for x in w.tenants)
    assert u == [0.5 + i * 0.005 for i in range(250)]
    assert len(arrival_times(w.tenants[0], 1.0, seed=1)) == 100  # what the run's duration holds
    assert p == arrival_times(replace(w.tenants[1], requests=None), 2.0, seed=1)[:5]
    assert t == [1.0, 1.25]


def test_a_closed_loop_starts_late_and_stops_after_its_requests():
    """A closed loop with start and requests: its first request when it starts, and exactly that many."""
    timeline = run_virtual(workload({"name": "a", "start": 0.01, "requests": 3, "kernel": [spin(0.1)]},
                                    duration=0.012), "mps", {})
    submitted = [r.submitted for r in timeline.requests]
    assert len(submitted) == 3 and submitted[0] == 0.01


def test_copies_are_calls_of_a_request():
    """A request of a device-to-device copy and a memset: both kernels of the runtime's, on the tenant's
    stream, so the request takes both; a host-to-device copy step takes its engine as `input` does."""
    steps = [{"name": "memcpy_dtod", "bytes": "64M"}, {"name": "memset", "bytes": "64M", "repeat": 2}]
    timeline = run_virtual(workload({"name": "a", "kernel": steps}, duration=1e-4), "mps", {})
    assert len(timeline.kernels) == 3 and timeline.requests[0].error is None
    as_input = workload({"name": "a", "input": 55_000_000, "kernel": [{"name": "spin", "cycles": 0}]}, duration=1e-4)
    as_step = workload({"name": "a", "kernel": [{"name": "memcpy_htod", "bytes": 55_000_000},
                                               {"name": "spin", "cycles": 0}]}, duration=1e-4)
    assert [r.latency for r in run_virtual(as_step, "mps", {}).requests] == \
        [r.latency for r in run_virtual(as_input, "mps", {}).requests]


def test_trace_file_is_read_relative_to_the_workload(tmp_path):
    (tmp_path / "times.txt").write_text("0.25\n0.001\n")
    (tmp_path / "w.toml").write_text('[[tenant]]\narrival = "trace"\ntrace = "times.txt"\n'
                                     '[[tenant.kernel]]\nname = "spin"\nduration_ms = 1\n')
    assert load_workload(tmp_path / "w.toml").tenants[0].trace == (0.001, 0.25)


def test_a_closed_loop_alone_takes_exactly_what_the_model_says():
    """One full wave of 1 ms blocks per request: each request is the kernel's launch overhead plus 1 ms plus the
    host's latency (idle for the first, back to back after), until the end of the run."""
    timeline = run_virtual(workload({"name": "a", "kernel": [spin(1.0)]}), "mps", {})
    device = H200.kernel_overhead + 1e-3
    latencies = [r.latency for r in timeline.requests]
    assert latencies == pytest.approx([device + HOST] + [device + HOST_BUSY] * math.ceil(
        (0.05 - device - HOST) / (device + HOST_BUSY)))
    assert timeline.requests[1].submitted == pytest.approx(timeline.requests[0].completed)


def test_a_requests_launch_calls_follow_one_another():
    """A request of three empty kernels: one idle launch call, two back to back, each kernel reaching the
    device as its call returns, so the host, not the device, sets the pace; then a warm synchronise."""
    empty = {"name": "spin", "grid": 1, "block": 32, "cycles": 0, "repeat": 3}
    timeline = run_virtual(workload({"name": "a", "kernel": [empty]}, duration=1e-4), "mps", {})
    first = timeline.requests[0]
    assert H200.launch_latency_busy > H200.kernel_overhead + H200.min_block_time
    expected = (H200.launch_latency + 2 * H200.launch_latency_busy + H200.kernel_overhead + H200.min_block_time
                + H200.sync_latency_busy)
    assert first.latency == pytest.approx(expected)
    starts = sorted(k.started for k in timeline.kernels)[:3]
    assert starts[1] - starts[0] == pytest.approx(H200.launch_latency_busy)


def test_a_graph_tenant_launches_its_request_as_one_graph():
    """graph = true: the request's ten empty kernels are captured once and each request is one graph launch, so a
    warm request is one graph launch call, ten graph nodes on the device and a synchronise, and the run fits many
    more requests than the same tenant's ten launch calls a request; every request still runs its ten kernels."""
    empty = {"name": "spin", "grid": 1, "block": 32, "cycles": 0, "repeat": 10}
    plain, graph = (run_virtual(workload({"name": "a", "graph": g, "kernel": [empty]}, duration=1e-3), "mps", {})
                    for g in (False, True))
    node = H200.graph_node_overhead + H200.min_block_time
    assert graph.requests[1].latency == pytest.approx(H200.graph_launch_call * H200.launch_latency_busy + 10 * node
                                                      + H200.sync_latency_busy)
    assert len(graph.requests) > 4 * len(plain.requests)
    assert len(graph.kernels) == 10 * len(graph.requests) and len(plain.kernels) == 10 * len(plain.requests)


def test_open_loop_requests_queue_in_the_tenant():
    """Arrivals due while the last request runs wait for it, and the wait counts as latency."""
    timeline = run_virtual(workload({"name": "a", "arrival": "trace", "trace": [0.0, 0.0005],
                                     "kernel": [spin(1.0)]}), "mps", {})
    first, second = sorted(timeline.requests, key=lambda r: r.submitted)
    assert second.submitted == 0.0005
    assert second.completed == pytest.approx(first.completed + H200.kernel_overhead + 1e-3 + HOST_BUSY)


def test_caps_and_partitions_hold_and_are_reported():
    w = workload({"name": "small", "active_thread_percentage": 25, "kernel": [spin(0.5)]},
                 {"name": "big", "kernel": [spin(0.5, grid=528)]})
    for policy, options, partition_sms in (("mps", {}, None), ("mig", {"partitions": ["3g.71gb", "4g.71gb"]}, 60)):
        tenants = [t if partition_sms is None else replace(t, partition=i) for i, t in enumerate(w.tenants)]
        summary = summarize(run_virtual(w, policy, options, tenants))
        small, big = summary["tenants"]
        assert summary["quota_violations"] == 0
        assert small["max_sms"] == small["sm_cap"] == 32
        assert big["max_sms"] == (132 if partition_sms is None else 64)


def test_same_workload_same_figures():
    w = load_workload(WORKLOADS / "disb_c.toml")
    short = replace(w, duration=0.2)
    assert summarize(run_virtual(short, "priority", {"aging": 0.05})) == \
        summarize(run_virtual(short, "priority", {"aging": 0.05}))


def test_memory_past_the_limit_fails_each_request_and_nobody_else():
    w = workload({"name": "hog", "pinned_mem_limit": "2G", "memory": "1G", "churn": "1536M",
                  "kernel": [spin(0.1, grid=8)]},
                 {"name": "calm", "pinned_mem_limit": "2G", "memory": "1G", "churn": "64M",
                  "kernel": [spin(0.1, grid=8)]})
    hog, calm = summarize(run_virtual(w, "mps", {}))["tenants"]
    assert hog["completed"] == 0 and hog["errors"] == hog["requests"] > 0
    assert hog["errors_by_name"] == {"cudaErrorMemoryAllocation": hog["errors"]}
    assert calm["errors"] == 0 and calm["completed"] > 0
    assert calm["memory_high_water"] == (1 << 30) + (64 << 20) and hog["memory_high_water"] == 1 << 30
    assert hog["memory_violations"] == calm["memory_violations"] == 0


def test_without_a_device_trace_memory_is_each_contexts_own_and_the_device_figures_are_unknown():
    """A run that records nothing of the device (as on a real GPU, which keeps no trace) reports each tenant's
    memory high water as its context's own peak, the same as the trace gives, and no SM figure at all: None,
    not the zeros an empty trace would sum to."""
    w = workload({"name": "a", "pinned_mem_limit": "2G", "memory": "1G", "churn": "64M", "kernel": [spin(0.1, grid=8)]},
                 {"name": "b", "memory": "256M", "kernel": [spin(0.1, grid=8)]}, duration=0.01)
    traced, untraced = summarize(run_virtual(w, "mps", {})), summarize(run_virtual(w, "mps", {}, device_trace=False))
    assert [t["memory_high_water"] for t in untraced["tenants"]] == \
        [t["memory_high_water"] for t in traced["tenants"]] == [(1 << 30) + (64 << 20), 256 << 20]
    assert [t["completed"] for t in untraced["tenants"]] == [t["completed"] for t in traced["tenants"]]
    assert traced["sm_seconds"] > 0 and traced["tenants"][0]["max_sms"] > 0
    for key in ("jain_index", "sm_seconds", "idle_sm_seconds_while_queued", "quota_violations"):
        assert untraced[key] is None, key
    for key in ("sm_seconds", "sm_share", "normalised_share", "max_sms", "sm_cap_violations", "longest_wait_ms",
                "kernels", "blocks"):
        assert {t[key] for t in untraced["tenants"]} == {None}, key


def test_timeslicing_hurts_the_latency_tenant_more_than_mps():
    """The seed's point, in numbers: beside training, inference's p99 under time-slicing is more than twice its
    p99 under MPS (it waits for other contexts' whole slices, not for one block to end)."""
    w = load_workload(WORKLOADS / "inference_training.toml")
    w = replace(w, duration=0.5)
    p99 = {policy: summarize(run_virtual(w, policy, {}))["tenants"][0]["latency_ms"]["p99"]
           for policy in ("mps", "timeslice")}
    assert p99["timeslice"] > 2 * p99["mps"]


def test_a_request_with_input_and_output_copies_takes_what_the_model_says():
    """A request that copies 55 MB in, runs an empty kernel and copies 55 MB out: the first call (the input
    copy's, after a long idle time) costs its share of a launch call; the kernel and output-copy calls follow
    back to back while the input copy runs; then the copy, the kernel and the other copy run in stream order,
    each copy its fixed latency and 1 ms at PCIe bandwidth, and the warm synchronise returns."""
    empty = {"name": "spin", "grid": 1, "block": 32, "cycles": 0}
    timeline = run_virtual(workload({"name": "a", "input": 55_000_000, "output": 55_000_000, "kernel": [empty]},
                                    duration=1e-4), "mps", {})
    (first,) = timeline.requests
    call = H200.launch_latency * dict(H200.copy_calls)["h2d"]
    copy = H200.copy_latency + 1e-3
    kernel = H200.kernel_overhead + H200.min_block_time
    assert first.latency == pytest.approx(call + copy + kernel + copy + H200.sync_latency_busy)


def test_small_input_copies_wait_out_a_loaders_slices_unless_partitioned():
    """A service whose requests copy 64 KiB in beside a data loader copying 64 MiB: under MPS its copies wait
    for the loader's copy-engine slices (as on a real H200), under MIG its partition has engines of its own.
    (256 MiB, as the H200 measurement had it, waits the same way: p50 0.81 ms against 0.48 here and 0.08 alone;
    a quarter of the bytes is a quarter of the memory traffic beside the other test worker.)"""
    w = workload({"name": "serving", "arrival": "uniform", "rate": 500, "input": "64K",
                  "kernel": [spin(0.05, grid=8)]},
                 {"name": "loader", "input": "64M", "kernel": [spin(0.05, grid=8)]})
    alone = summarize(run_virtual(w, "mps", {}, [w.tenants[0]]))["tenants"][0]["latency_ms"]["p50"]
    mps = summarize(run_virtual(w, "mps", {}))["tenants"][0]["latency_ms"]["p50"]
    tenants = [replace(t, partition=i) for i, t in enumerate(w.tenants)]
    mig = summarize(run_virtual(w, "mig", {"partitions": ["3g.71gb", "3g.71gb"]}, tenants))
    assert mps > alone + 0.2  # a slice is about 1 ms: the wait averages about half of one
    assert mig["tenants"][0]["latency_ms"]["p50"] == pytest.approx(alone, rel=0.05)
    assert mig["tenants"][1]["memory_high_water"] == 64 << 20


def test_memory_is_charged_as_the_daemon_charges_it():
    """Allocations of 1 MiB or less share 2 MiB chunks, as in the daemon (tests/test_stress_run.py sees the same
    2 MiB for these buffers from real processes); larger ones take whole 2 MiB pages; churn is freed again."""
    w = workload({"name": "small", "input": "64K", "output": "16K", "kernel": [spin(0.05, grid=8)]},
                 {"name": "large", "memory": "3M", "churn": "1M", "kernel": [spin(0.05, grid=8)]}, duration=0.01)
    small, large = summarize(run_virtual(w, "mps", {}))["tenants"]
    assert small["memory_high_water"] == 2 << 20
    assert large["memory_high_water"] == (4 << 20) + (2 << 20)  # 3M in two pages, 1M of churn in a chunk
    assert large["completed"] > 1 and large["errors"] == 0


def test_a_run_without_its_device_trace_has_the_same_requests_and_no_spans():
    """An isolation baseline reads only its requests: without the device's trace the run is the same run (the
    daemon's recorder only watches), and its timeline holds no spans or kernels."""
    w = workload({"name": "infer", "arrival": "poisson", "rate": 400, "kernel": [spin(0.2, grid=66)]},
                 {"name": "train", "kernel": [spin(1.0)]})
    traced = run_virtual(w, "mps", {})
    bare = run_virtual(w, "mps", {}, device_trace=False)
    assert traced.spans and traced.kernels and not bare.spans and not bare.kernels
    assert bare.virtual and len(bare.requests) > 10
    assert bare.requests == traced.requests
