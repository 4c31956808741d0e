# What a departed client leaves behind must go with it (issue 13): work it left queued and the memory its
# staged copies held; and memory it shared by IPC stays charged to someone.
# Real daemons, real client processes, the daemon's own RSS read with psutil.
from __future__ import annotations

import time

import psutil
import pytest

import mpsd_client
from daemons import run_worker, spawn_worker, start_daemon

# A client that queues 256 MiB of pageable (staged) copies behind a long kernel, then leaves.
QUEUER = """
import numpy as np, mpsd_client
ctx = mpsd_client.connect()
s = ctx.create_stream()
dst = ctx.malloc(64 << 20)
ctx.launch("spin", 264, 1024, [int(60 * 1.98e9)], stream=s)   # a minute of device time
data = np.ones(64 << 20, np.uint8)
for _ in range(4):
    ctx.memcpy_htod(dst, data, stream=s)   # staged in the daemon until the kernel is done
print("queued", flush=True)
"""


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_work_a_client_left_queued_is_freed_with_it(daemon_factory):
    """Three clients each leave 256 MiB of staged copies queued and exit: the daemon's RSS comes back (it
    kept every dropped op, and the bytes its copies held, for ever)."""
    # Once glibc's malloc has freed one mapping of a staged piece's size (8 MiB), it puts buffers that size on
    # its heap, and whether freed heap memory goes back to the system depends on what lies above it (the test
    # passed or failed with the order of the daemon's calls). The daemon runs with its heap taking such buffers
    # from the start, as it does after the first client's copies have gone.
    daemon = start_daemon("--time-scale", "1", env={"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432"})
    daemon_factory.append(daemon)
    rss = psutil.Process(daemon.proc.pid).memory_info
    baseline = rss().rss
    for n in range(1, 4):
        result = run_worker(QUEUER, daemon.pipe_dir)
        assert result.returncode == 0 and "queued" in result.stdout, result.stderr
        # The line that says what was reclaimed comes once it has been; the MPS-style "Client process N
        # disconnected" before it comes as reclaiming begins (counting both let the check run mid-reclaim).
        _wait_for(lambda: daemon.server_log().count("disconnected; reclaimed") >= n)
    assert rss().rss - baseline < 128 << 20


@pytest.mark.parametrize("order", ["exporter frees first", "importer closes first"])
def test_ipc_memory_stays_charged_until_its_last_user_lets_go(daemon_factory, order):
    """Memory an exporter frees while an importer still has it open stays charged to the exporter, against
    its pinned limit, until the last importer closes it: two clients limited to 1 GiB can never hold more
    than 2 GiB between them (they held 12.25 GiB)."""
    daemon = start_daemon("--time-scale", "100", "--pinned-mem-limit", "1G")
    daemon_factory.append(daemon)
    with mpsd_client.connect(daemon.pipe_dir) as exporter:
        free_before = exporter.mem_get_info()[0]
        p = exporter.malloc(256 << 20)
        handle = exporter.ipc_get_mem_handle(p)
        proc = spawn_worker(f"""
import sys, mpsd_client
with mpsd_client.connect() as ctx:
    q = ctx.ipc_open_mem_handle(bytes.fromhex("{handle.hex()}"))
    print("open", flush=True)
    sys.stdin.readline()
    if sys.argv[1] == "close":
        ctx.ipc_close_mem_handle(q)
        print("closed", flush=True)
        sys.stdin.readline()
""", daemon.pipe_dir, "close" if order == "importer closes first" else "hold")
        try:
            assert proc.stdout.readline().strip() == "open"
            if order == "exporter frees first":
                exporter.free(p)
                # Still charged to the exporter while the importer maps it: its limit still counts it.
                assert exporter.mem_get_info()[0] == free_before - (256 << 20)
                with pytest.raises(mpsd_client.OutOfMemoryError):
                    exporter.malloc(free_before - (128 << 20))
                proc.stdin.write("\n")
                proc.stdin.flush()
                proc.communicate(timeout=60)
                _wait_for(lambda: exporter.mem_get_info()[0] == free_before)
            else:
                proc.stdin.write("\n")
                proc.stdin.flush()
                assert proc.stdout.readline().strip() == "closed"
                assert exporter.mem_get_info()[0] == free_before - (256 << 20)  # the exporter still has it
                exporter.free(p)
                assert exporter.mem_get_info()[0] == free_before
                proc.stdin.write("\n")
                proc.stdin.flush()
                proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.mark.parametrize("flood", ["launches", "pageable copies"])
def test_a_flooding_client_is_blocked_not_the_daemon(daemon_factory, flood):
    """A client that queues launches or pageable copies faster than they run is held at 1,024 launches (a
    real H200's queue) or 256 MiB of staged bytes: its calls wait, the daemon says so in server.log, its RSS
    stays bounded, another client is served meanwhile, and killing it frees everything at once."""
    # Once glibc's malloc has freed one mapping of a staged piece's size (8 MiB), it puts buffers that size on
    # its heap, and whether freed heap memory goes back to the system depends on what lies above it (the test
    # passed or failed with the order of the daemon's calls). The daemon runs with its heap taking such buffers
    # from the start, as it does after the first client's copies have gone.
    daemon = start_daemon("--time-scale", "1", env={"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432"})
    daemon_factory.append(daemon)
    rss = psutil.Process(daemon.proc.pid).memory_info
    baseline = rss().rss
    flooder = spawn_worker("""
import sys, threading, numpy as np, mpsd_client
ctx = mpsd_client.connect()
s = ctx.create_stream()
dst = ctx.malloc(8 << 20)
if sys.argv[1] == "launches":
    work = lambda: [ctx.launch("spin", 264, 1024, [int(1.98e9)], stream=s) for _ in range(3000)]   # 1 s each
else:
    ctx.launch("spin", 264, 1024, [int(60 * 1.98e9)], stream=s)
    data = np.ones(8 << 20, np.uint8)
    work = lambda: [ctx.memcpy_htod(dst, data, stream=s) for _ in range(80)]   # 640 MiB, staged
threading.Thread(target=work, daemon=True).start()
print("flooding", flush=True)
sys.stdin.readline()
""", daemon.pipe_dir, flood)
    try:
        assert flooder.stdout.readline().strip() == "flooding"
        _wait_for(lambda: "its next call waits for its work to run" in daemon.server_log())
        line = next(x for x in daemon.server_log().splitlines() if "its next call waits" in x)
        assert ("1024 launches queued" if flood == "launches" else "256 MiB of pageable copies held") in line
        with mpsd_client.connect(daemon.pipe_dir) as other:  # (its kernels would queue behind the flood's)
            p = other.malloc(1 << 20)
            other.free(p)
            assert other.mem_get_info()[0] > 0
        assert rss().rss - baseline < 384 << 20
        # Killed while its call is held, it is noticed at once, not when its queue has drained (17 minutes of
        # launches, or a minute-long kernel before the copies): its connection goes and its work is reclaimed.
        flooder.kill()
        _wait_for(lambda: f"Client {flooder.pid} disconnected" in daemon.server_log(), timeout=10)
    finally:
        flooder.kill()
        flooder.communicate()


@pytest.mark.parametrize("policy", ["mps", "fair", "mig", "timeslice"])
def test_the_simulator_forgets_a_departed_client(policy):
    """300 clients come, run a kernel and go (the daemon forgets each as it detaches): the simulator keeps
    nothing per client about them, and the device's SM-time still counts theirs (what mpsd-smi's utilisation
    reads)."""
    from mpsd.sim import H200, Kernel, Simulator, kernel_cost

    sim = Simulator(H200, policy=policy)
    cost = kernel_cost(H200, "spin", 4, 128, [1000])
    for client in range(1, 301):
        sim.configure_client(client, weight=2.0)
        sim.submit(Kernel(client=client, stream=0, blocks=4, threads=128, cost=cost))
        sim.run()
        sim.forget_client(client)
    stats = sim.statistics()
    assert stats.per_client == {} and stats.kernels_completed == 300
    assert stats.sm_seconds == pytest.approx(300 * 4 * (128 / 2048) * 1000 / H200.clock_hz, rel=0.01)
    assert sim.client_config(7).weight == 1.0  # back to the defaults: nothing is kept
