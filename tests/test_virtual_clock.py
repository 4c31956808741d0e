# The daemon's virtual clock with real processes over real sockets: what worker processes measure is what the
# model gives for the same work (`mpsd simulate`), exactly and whatever the host's load; clients blocked
# outside mpsd, computing, killed or asleep never deadlock or stall the others for longer than the idle grace.
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest

from daemons import spawn_worker, start_daemon
from mpsd.sim import H200
from mpsd.tools.simulate import run_scenario

# A worker: connects when told (CONNECT on stdin: the runner connects workers one after another, so their
# client ids, which order ties in the daemon as in the model, follow the entries), says READY, waits for GO
# (holding the clock at its start), then runs its entries (kernels back to back and one synchronise, or a
# closed loop of launch, synchronise and sleep) and
# prints its clock at the end and each closed-loop latency.
WORKER = """
import json, sys
import mpsd_client
entry = json.loads(sys.argv[1])
assert sys.stdin.readline().strip() == "CONNECT"
with mpsd_client.connect() as ctx:
    print("READY", flush=True)
    assert sys.stdin.readline().strip() == "GO"
    if entry.get("at"):
        ctx.sleep(entry["at"])
    shape = (entry["name"], entry["grid"], entry["block"], entry["args"])
    latencies = []
    if entry.get("sleep") is None:
        for _ in range(entry["repeat"]):
            ctx.launch(*shape)
        ctx.synchronize()
    else:
        for i in range(entry["repeat"]):
            start = ctx.clock()
            ctx.launch(*shape)
            ctx.synchronize()
            latencies.append(ctx.clock() - start)
            if i + 1 < entry["repeat"]:
                ctx.sleep(entry["sleep"])
    print(json.dumps({"makespan": ctx.clock(), "latencies": latencies}), flush=True)
"""

FULL_SPIN = {"name": "spin", "grid": 264, "block": 1024, "args": [1_980_000]}
QUARTER_SPIN = dict(FULL_SPIN, grid=66)
FULL_WORK = {"name": "work", "grid": 264, "block": 1024, "args": [93_638]}
LATENCY = {"name": "spin", "grid": 8, "block": 1024, "args": [198_000], "repeat": 20, "sleep": 0.005}


def run_workers(pipe_dir, entries: list[dict], tenants: list[dict] | None = None) -> list[dict]:
    """Start one worker per entry (with the tenant's environment), connect them in order, release them
    together, and return what each printed."""
    procs = []
    for i, entry in enumerate(entries):
        percentage = (tenants or [{}] * len(entries))[i].get("active_thread_percentage")
        env = {} if percentage is None else {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percentage)}
        procs.append(spawn_worker(WORKER, pipe_dir, json.dumps(entry), env=env))
    try:
        for proc in procs:
            proc.stdin.write("CONNECT\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        for proc in procs:
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        out = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, stderr
            out.append(json.loads(stdout))
        return out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def simulated(entries: list[dict], policy: str, tenants: list[dict] | None = None) -> list[dict]:
    scenario = {"device": {"policy": policy},
                "tenant": [{"name": f"t{i}", **(tenants[i] if tenants else {}), "kernel": [entry]}
                           for i, entry in enumerate(entries)]}
    return run_scenario(scenario)["tenants"]


@pytest.fixture
def virtual_daemon(daemon_factory):
    """A daemon on the virtual clock whose idle grace outlasts any start-up of the workers."""
    def start(*args: str):
        d = start_daemon("--clock", "virtual", "--idle-grace", "60", *args)
        daemon_factory.append(d)
        return d
    return start


# The H200 rows of ../shared/reference/h200-mps-measurements.md: (policy, entries, tenants' quotas).
BATCHES = {
    "1 x 100 FULL spin": ("mps", [dict(FULL_SPIN, repeat=100)], None),
    "2 x 100 FULL spin": ("mps", [dict(FULL_SPIN, repeat=100)] * 2, None),
    "2 x 200 QUARTER spin": ("mps", [dict(QUARTER_SPIN, repeat=200)] * 2, None),
    "4 x 200 QUARTER spin": ("mps", [dict(QUARTER_SPIN, repeat=200)] * 4, None),
    "2 x 100 FULL work": ("mps", [dict(FULL_WORK, repeat=100)] * 2, None),
    "1 x 100 FULL spin at 25%": ("mps", [dict(FULL_SPIN, repeat=100)], [{"active_thread_percentage": 25}]),
    "2 x 100 FULL spin at 50%": ("mps", [dict(FULL_SPIN, repeat=100)] * 2, [{"active_thread_percentage": 50}] * 2),
    "timeslice 1 x 200 QUARTER spin": ("timeslice", [dict(QUARTER_SPIN, repeat=200)], None),
    "timeslice 2 x 100 FULL work": ("timeslice", [dict(FULL_WORK, repeat=100)] * 2, None),
}


@pytest.mark.parametrize("row", list(BATCHES))
def test_batches_from_real_processes_match_the_model(virtual_daemon, row):
    """Batches of back-to-back kernels from 1, 2 and 4 real processes end when `mpsd simulate` says, to the
    nanosecond: simulated time follows the clients' host clocks, not the host's speed."""
    policy, entries, tenants = BATCHES[row]
    daemon = virtual_daemon("--policy", policy)
    measured = run_workers(daemon.pipe_dir, entries, tenants)
    model = simulated(entries, policy, tenants)
    for got, want in zip(measured, model):
        assert got["makespan"] * 1e3 == pytest.approx(want["makespan_ms"], rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("policy", ["mps", "timeslice"])
def test_latency_tenant_beside_a_saturating_one_matches_the_model(virtual_daemon, policy):
    """The latency tenant (8 blocks of 0.1 ms, a closed loop with 5-ms sleeps) beside back-to-back full waves:
    every latency the real process measures is the model's, so p50 and p99 are too."""
    daemon = virtual_daemon("--policy", policy)
    entries = [dict(LATENCY, at=0.002), dict(FULL_SPIN, repeat=120)]
    measured = run_workers(daemon.pipe_dir, entries)
    model = simulated(entries, policy)
    ordered = sorted(measured[0]["latencies"])
    assert len(ordered) == 20
    assert ordered[9] * 1e3 == pytest.approx(model[0]["latency_p50_ms"], rel=1e-9)
    assert ordered[-1] * 1e3 == pytest.approx(model[0]["latency_p99_ms"], rel=1e-9)
    assert measured[1]["makespan"] * 1e3 == pytest.approx(model[1]["makespan_ms"], rel=1e-9)


def test_figures_do_not_depend_on_the_hosts_load(virtual_daemon):
    """The same mix run twice, once beside a process that keeps a core busy, prints the same figures to the
    last bit."""
    entries = [dict(LATENCY, repeat=10), dict(QUARTER_SPIN, repeat=50), dict(FULL_WORK, repeat=20)]
    quiet = run_workers(virtual_daemon().pipe_dir, entries)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        loaded = run_workers(virtual_daemon().pipe_dir, entries)
    finally:
        hog.kill()
        hog.wait()
    assert loaded == quiet


def test_events_around_one_wave_time_the_wave_not_the_host(virtual_daemon):
    """Two events around one 1-ms wave measure the wave, its launch call and the device's overhead: the
    client's Python between the calls costs no simulated time."""
    daemon = virtual_daemon()
    code = """
import mpsd_client, time
with mpsd_client.connect() as ctx:
    a, b = ctx.create_event(), ctx.create_event()
    a.record()
    time.sleep(0.05)  # host time the virtual clock does not charge
    ctx.launch("work", 264, 1024, [93638])
    b.record()
    b.synchronize()
    print(a.elapsed_ms(b))
"""
    proc = spawn_worker(code, daemon.pipe_dir)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    # the kernel's launch call follows the record's (both warm), then the device's overhead and the wave
    record = H200.launch_latency_busy
    assert float(out) == pytest.approx((record + H200.kernel_overhead + 1e-3) * 1e3, rel=1e-3)


def test_a_client_blocked_outside_mpsd_is_idle_after_the_grace(daemon_factory):
    """A client that holds the clock (computing, or waiting on a pipe) stops holding it after the idle grace:
    the others finish while it is still blocked, and server.log says so."""
    daemon = start_daemon("--clock", "virtual", "--idle-grace", "0.3")
    daemon_factory.append(daemon)
    holder = spawn_worker("""
import sys, mpsd_client
with mpsd_client.connect() as ctx:
    print("READY", flush=True)
    sys.stdin.readline()  # blocked outside mpsd, holding the clock at its start
    ctx.launch("spin", 1, 32, [0]); ctx.synchronize()
    print(ctx.clock())
""", daemon.pipe_dir)
    assert holder.stdout.readline().strip() == "READY"
    batch = spawn_worker("""
import mpsd_client
with mpsd_client.connect() as ctx:
    for _ in range(10):
        ctx.launch("spin", 264, 1024, [1980000])
    ctx.synchronize()
    print(ctx.clock())
""", daemon.pipe_dir)
    out, err = batch.communicate(timeout=60)
    assert batch.returncode == 0, err
    assert holder.poll() is None  # still blocked: the batch did not wait for it
    holder.stdin.write("\n")
    holder.stdin.flush()
    held, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
    assert float(held) >= float(out) - 1e-9  # it came back at the device's now, not before it
    assert "counted idle at simulated time" in daemon.server_log()


@pytest.mark.parametrize("declared", [True, False])
def test_ipc_pair_passing_its_handle_through_a_pipe_does_not_deadlock(daemon_factory, declared):
    """A consumer waiting on a pipe for the producer's IPC handle holds the clock at its start: with
    ctx.idle() it says so at once, without it the idle grace frees the producer. The consumer then sees the
    producer's bytes."""
    daemon = start_daemon("--clock", "virtual", "--idle-grace", "0.3")
    daemon_factory.append(daemon)
    consumer = spawn_worker(f"""
import sys, mpsd_client
with mpsd_client.connect() as ctx:
    if {declared}:
        with ctx.idle():
            handle = bytes.fromhex(sys.stdin.readline())
    else:
        handle = bytes.fromhex(sys.stdin.readline())
    ptr = ctx.ipc_open_mem_handle(handle)
    out = ctx.malloc(4)
    ctx.launch("reduce_sum_f32", 132, 256, [ptr, out, 1 << 20])
    result = bytearray(4)
    ctx.memcpy_dtoh(result, out)
    import struct
    print(struct.unpack("f", result)[0])
""", daemon.pipe_dir)
    producer = spawn_worker("""
import sys, mpsd_client
with mpsd_client.connect() as ctx:
    ptr = ctx.malloc(4 << 20)
    ctx.launch("fill_f32", 132, 256, [ptr, 1.0, 1 << 20])
    ctx.synchronize()
    print(ctx.ipc_get_mem_handle(ptr).hex(), flush=True)
    sys.stdin.readline()  # keep the export alive until the consumer is done
""", daemon.pipe_dir)
    handle = producer.stdout.readline()
    consumer.stdin.write(handle)
    consumer.stdin.flush()
    out, err = consumer.communicate(timeout=60)
    producer.communicate("\n", timeout=60)
    assert consumer.returncode == 0, err
    assert float(out) == float(1 << 20)


@pytest.mark.parametrize("state", ["holding", "waiting"])
def test_killing_a_client_releases_the_clock(virtual_daemon, state):
    """SIGKILL of a client that holds the clock (blocked outside mpsd, with an idle grace far away) or waits on
    the device lets the others go on."""
    daemon = virtual_daemon()
    victim = spawn_worker("""
import sys, mpsd_client
with mpsd_client.connect() as ctx:
    if sys.argv[1] == "waiting":
        for _ in range(1000):
            ctx.launch("spin", 264, 1024, [1980000])
        print("READY", flush=True)
        ctx.synchronize()
    else:
        print("READY", flush=True)
        sys.stdin.readline()
""", daemon.pipe_dir, state)
    assert victim.stdout.readline().strip() == "READY"
    other = spawn_worker("""
import sys, mpsd_client
with mpsd_client.connect() as ctx:
    print("READY", flush=True)
    ctx.launch("spin", 1, 32, [0])
    ctx.synchronize()
    print(ctx.clock())
""", daemon.pipe_dir)
    assert other.stdout.readline().strip() == "READY"
    os.kill(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=60)
    out, err = other.communicate(timeout=60)
    assert other.returncode == 0, err
    assert math.isfinite(float(out))


def test_measured_host_time_is_charged(virtual_daemon):
    """With --host-time measured:2 the CPU time a client spends between two calls moves its clock twice as
    far; with the default it costs nothing."""
    code = """
import time, mpsd_client
with mpsd_client.connect() as ctx:
    before = ctx.clock()
    cpu = time.thread_time()
    while time.thread_time() - cpu < 0.02:
        pass
    spent = time.thread_time() - cpu
    print(ctx.clock() - before, spent)
"""
    for args, factor in ((("--host-time", "measured:2"), 2.0), ((), 0.0)):
        proc = spawn_worker(code, virtual_daemon(*args).pipe_dir)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        moved, spent = map(float, out.split())
        if factor:
            assert factor * spent <= moved < factor * (spent + 0.01)
        else:
            assert moved == 0.0


def test_clock_and_sleep_under_the_wall_clock(daemon):
    """Under the wall clock, ctx.clock() is the device's simulated time and ctx.sleep() a real sleep of that
    many simulated seconds (the fixture's daemon runs 100 times faster than the wall), so one program runs
    under both clocks."""
    code = """
import time, mpsd_client
with mpsd_client.connect() as ctx:
    t0, w0 = ctx.clock(), time.monotonic()
    ctx.sleep(2.0)
    print(ctx.clock() - t0, time.monotonic() - w0)
    with ctx.idle():
        pass
"""
    proc = spawn_worker(code, daemon.pipe_dir)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    simulated, wall = map(float, out.split())
    assert simulated >= 2.0 and wall >= 0.02


def test_a_full_launch_queue_blocks_the_launch_call(virtual_daemon):
    """Launch calls return at once while fewer than 1,024 launches are queued; past that a launch call returns
    only when a kernel has ended, as a real H200's host call blocks (and the daemon reads nothing more from the
    client meanwhile)."""
    daemon = virtual_daemon()
    code = """
import mpsd_client
with mpsd_client.connect() as ctx:
    marks = {}
    for i in range(1, 1201):
        ctx.launch("spin", 264, 1024, [1980000])   # 1-ms waves, one after another
        if i in (1000, 1200):
            marks[i] = ctx.clock()
    ctx.synchronize()
    print(marks[1000], marks[1200], ctx.clock())
"""
    proc = spawn_worker(code, daemon.pipe_dir)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    early, late, end = map(float, out.split())
    wave = 1e-3 + H200.kernel_overhead

    def ended(k: int) -> float:  # the k-th wave ends (they run back to back from the first launch's return)
        return H200.launch_latency + H200.kernel_overhead + k * 1e-3 + (k - 1) * H200.kernel_overhead

    assert early == pytest.approx(H200.launch_latency + 999 * H200.launch_latency_busy, rel=1e-6)  # not blocked
    # The 1,200th call found 1,199 queued: it returned once the 176th wave had ended, and its own call cost.
    assert ended(176) < late < ended(176) + H200.launch_latency
    assert end == pytest.approx(ended(1200) + H200.sync_latency, rel=1e-3)
    assert end > 1200 * wave
