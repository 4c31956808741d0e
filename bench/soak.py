"""Soak: clients SIGKILLed at random points of their work, against one daemon, then what the daemon kept.

    .venv/bin/python bench/soak.py [--kills 1000] [--concurrent 4] [--minutes 10] [--seed 1]

Each client is forked from this process (mpsd_client already imported, so a client starts in milliseconds),
connects, and does a random mix of what clients do: allocations large and small, memsets and device copies,
kernels, pageable and pinned copies, synchronizes, IPC exports and imports of another client's export, events,
streams; it is killed with SIGKILL after a random time. A healthy tenant beside them makes one round trip
after another and measures each. At the end, once every killed client is reclaimed, the daemon's open fds,
RSS and device memory are compared with the baseline taken after the first few clients, and the healthy
tenant's slowest round trip is printed beside its median (a hang shows there). Not in CI: it runs minutes.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import mpsd_client  # noqa: E402
from daemons import start_daemon  # noqa: E402
from mpsd.tools.smi import query  # noqa: E402


def client(pipe_dir: Path, seed: int, handles: Path) -> None:
    """A client's life until it is killed (it never returns normally; any error just ends it)."""
    rng = random.Random(seed)
    try:
        ctx = mpsd_client.connect(pipe_dir)
        stream = ctx.create_stream()
        pointers = []
        pinned = ctx.host_alloc(1 << 20)
        while True:
            step = rng.randrange(10)
            if step == 0 or not pointers:
                pointers.append(ctx.malloc(rng.choice([512, 4096, 1 << 20, 8 << 20])))
            elif step == 1 and len(pointers) > 1:
                ctx.free(pointers.pop(rng.randrange(len(pointers))))
            elif step == 2:
                p = rng.choice(pointers)
                ctx.memset(p, rng.randrange(256), p.size, stream=stream)
            elif step == 3:
                ctx.launch("spin", rng.choice([1, 66, 264]), 1024, [rng.randrange(1, 2_000_000)], stream=stream)
            elif step == 4:
                p = rng.choice(pointers)
                ctx.memcpy_htod(p, np.ones(min(p.size, 1 << 20), np.uint8), stream=stream)  # pageable: staged
            elif step == 5:
                p = rng.choice(pointers)
                ctx.memcpy_dtoh(memoryview(pinned)[:min(p.size, 1 << 20)], p, stream=stream)
            elif step == 6:
                stream.synchronize()
            elif step == 7:
                with handles.open("a") as f:  # one short line: appends of it do not interleave
                    f.write(ctx.ipc_get_mem_handle(rng.choice(pointers)).hex() + "\n")
            elif step == 8 and handles.exists():
                known = [line for line in handles.read_text().splitlines() if len(line) == 128]
                try:
                    if known:
                        ctx.ipc_open_mem_handle(bytes.fromhex(rng.choice(known)))
                except mpsd_client.CudaError:
                    pass  # its exporter was killed, or it is our own
            else:
                event = ctx.create_event()
                event.record(stream)
    finally:
        os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=1000)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=10.0, help="stop then even if fewer kills were made")
    parser.add_argument("--seed", type=int, default=1)
    options = parser.parse_args()
    rng = random.Random(options.seed)
    base = Path(tempfile.mkdtemp(prefix="mpsd-soak-", dir="/tmp"))
    daemon = start_daemon("--time-scale", "10", "--max-clients", "64", pipe_dir=base / "pipe")
    proc = psutil.Process(daemon.proc.pid)
    handles = base / "handles"  # IPC handles the clients exported, one a line, for the others to open
    round_trips: list[float] = []
    stop = threading.Event()

    def healthy() -> None:
        with mpsd_client.connect(daemon.pipe_dir) as ctx:
            p = ctx.malloc(1 << 20)
            while not stop.is_set():
                start = time.perf_counter()
                ctx.memset(p, 1, 4096)
                ctx.synchronize()
                round_trips.append(time.perf_counter() - start)
                time.sleep(0.01)

    running: dict[int, float] = {}  # pid -> when to kill it

    def kill_clients(count: int, deadline: float) -> int:
        """Start clients and kill them, `count` of them (fewer if `deadline` comes first); the rest too."""
        kills = 0
        while kills < count and time.monotonic() < deadline and daemon.proc.poll() is None:
            while len(running) < options.concurrent:
                pid = os.fork()
                if pid == 0:
                    client(daemon.pipe_dir, rng.randrange(1 << 30), handles)
                running[pid] = time.monotonic() + rng.uniform(0.0, 0.5)
            due = min(running, key=running.__getitem__)
            time.sleep(max(0.0, running.pop(due) - time.monotonic()))
            os.kill(due, signal.SIGKILL)
            os.waitpid(due, 0)
            kills += 1
        for pid in list(running):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        running.clear()
        return kills

    def settled() -> tuple[int, int, int, int]:
        """(fds, RSS, device memory used, clients) once the daemon has reclaimed every killed client."""
        for _ in range(100):
            status = query(daemon.pipe_dir)
            if not status["processes"]:
                break
            time.sleep(0.1)
        return (proc.num_fds(), proc.memory_info().rss, status["devices"][0]["memory_used"],
                len(status["processes"]))

    kill_clients(20, math.inf)  # every kind of state is made and reclaimed a few times before the baseline
    baseline = settled()
    tenant = threading.Thread(target=healthy, daemon=True)
    tenant.start()
    kills = 20 + kill_clients(options.kills - 20, time.monotonic() + options.minutes * 60)
    if daemon.proc.poll() is not None:
        print(f"CRASH: the daemon exited with {daemon.proc.returncode} after {kills} kills")
        return 1
    stop.set()
    tenant.join(timeout=30)
    hung = tenant.is_alive()
    fds, rss, used, left = settled()
    code = daemon.stop()
    shutil.rmtree(base, ignore_errors=True)  # the pipe and log directories and the handles file
    print(f"kills: {kills} in {options.minutes:g} min at most, {options.concurrent} clients at a time")
    print(f"crashes: {0 if code == 0 else 1} (daemon exit {code}); hangs: {int(hung)}; clients left: {left}")
    print(f"healthy tenant round trips: {len(round_trips)}, median {statistics.median(round_trips) * 1e3:.2f} ms, "
          f"max {max(round_trips) * 1e3:.2f} ms")
    print(f"daemon fds: {baseline[0]} after 20 kills, {fds} at the end (leaked {fds - baseline[0]})")
    print(f"daemon RSS: {baseline[1] / 2**20:.0f} MiB after 20 kills, {rss / 2**20:.0f} MiB at the end "
          f"(grew {(rss - baseline[1]) / 2**20:.0f} MiB)")
    print(f"device memory used: {baseline[2]} bytes after 20 kills, {used} at the end "
          f"(not returned: {used - baseline[2]})")
    return 0 if code == 0 and not hung else 1


if __name__ == "__main__":
    raise SystemExit(main())
