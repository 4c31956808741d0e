"""Teardown latency: how long a bystander's calls wait while a client holding many objects goes away.

    .venv/bin/python bench/teardown_latency.py [--small 300000] [--reservations 25000] [--touched 0] [--kill]
                                               [--baseline 2]

A client process makes `--small` allocations of 512 bytes and `--reservations` VMM reservations of 2 MiB
(mem_address_reserve: address space, no memory), and one allocation of `--touched` GiB whose every page it
writes (host RAM the daemon then holds, which the kernel frees at about 80 ms a GiB), then exits (or is
SIGKILLed, with --kill). A bystander process calls mem_get_info in a loop all along, timing each call.
Printed: the bystander's calls while the big client sat idle (the baseline, `--baseline` seconds of it just
before the exit, in the same run) beside its calls that overlapped the teardown (from the exit until server.log
says what was reclaimed): their count, median, p99 and worst; how long the teardown took; and what the daemon
says it reclaimed. A teardown in one piece shows as a worst call as long as the teardown itself. Not in CI
(`make soak` runs it): making 300,000 of each took most of a minute.
"""
from __future__ import annotations

import argparse
import re
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemons import spawn_worker, start_daemon  # noqa: E402

BIG = """
import sys
import mpsd_client
ctx = mpsd_client.connect()
small, reservations, touched = int(sys.argv[1]), int(sys.argv[2]), int(float(sys.argv[3]) * (1 << 30))
kept = [ctx.malloc(512) for _ in range(small)]
kept += [ctx.mem_address_reserve(2 << 20) for _ in range(reservations)]
if touched:
    kept.append(ctx.malloc(touched))
    ctx.memset(kept[-1], 7, touched)
    ctx.synchronize()
print("ready", flush=True)
sys.stdin.readline()  # exits when told (or is killed first)
"""

# Calls mem_get_info until told to stop on stdin, then writes (start, seconds) of every call to argv[1].
BYSTANDER = """
import sys, threading, time
import numpy as np
import mpsd_client
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
ctx = mpsd_client.connect()
clock, calls = time.monotonic, []
print("ready", flush=True)
while not stop.is_set():
    start = clock()
    ctx.mem_get_info()
    calls.append((start, clock() - start))
np.save(sys.argv[1], np.array(calls))
"""


def summary(latencies: np.ndarray) -> str:
    ms = np.sort(latencies) * 1e3
    return (f"{len(ms)} calls, median {statistics.median(ms):.3f} ms, p99 {np.percentile(ms, 99):.3f} ms, "
            f"worst {ms[-1]:.3f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=300_000, help="512-byte allocations of the big client")
    # Each reserved range is one of the daemon's memory mappings, and one client may hold half of what
    # vm.max_map_count leaves beside the daemon's reserve of 8,192: 28,669 under the default sysctl of 65,530 (the
    # 300,000 of the README's figures need a vm.max_map_count of 608,400 or more).
    parser.add_argument("--reservations", type=int, default=25_000, help="its 2 MiB VMM reservations")
    parser.add_argument("--touched", type=float, default=0.0, help="GiB of one allocation it writes every page of")
    parser.add_argument("--kill", action="store_true", help="SIGKILL the big client rather than let it exit")
    parser.add_argument("--baseline", type=float, default=2.0, help="seconds of bystander calls before the exit")
    options = parser.parse_args()
    # The per-client limits on reservations and mappings (mpsd.runtime.limits) raised to what is asked, so that
    # only the sysctl bounds it; a small allocation's 2 MiB chunk is one mapping per 4,096 of them.
    maps = options.reservations + options.small // 4096 + 1024
    daemon = start_daemon("--max-reservations", str(max(65_536, options.reservations)),
                          "--max-maps", str(max(150_000, maps)))
    try:
        started = time.monotonic()
        big = spawn_worker(BIG, daemon.pipe_dir, str(options.small), str(options.reservations), str(options.touched))
        assert big.stdout is not None and big.stdin is not None
        if big.stdout.readline() != "ready\n":
            print(f"the big client failed: {big.communicate()[1]}")
            return 1
        made = time.monotonic() - started
        out = daemon.pipe_dir.parent / "bystander.npy"
        bystander = spawn_worker(BYSTANDER, daemon.pipe_dir, str(out))
        assert bystander.stdout is not None and bystander.stdin is not None
        assert bystander.stdout.readline() == "ready\n"
        time.sleep(options.baseline)
        gone = time.monotonic()
        if options.kill:
            big.send_signal(signal.SIGKILL)
        else:
            big.stdin.close()
        big.wait()
        line = None
        while line is None:  # the daemon logs what it reclaimed once it has all gone
            time.sleep(0.005)
            line = re.search(rf"Client {big.pid} disconnected; reclaimed (.*)", daemon.server_log())
        done = time.monotonic()
        time.sleep(0.2)
        bystander.communicate("stop\n", timeout=60)
        calls = np.load(out)
        starts, latencies = calls[:, 0], calls[:, 1]
        before = (starts >= gone - options.baseline) & (starts + latencies < gone)
        during = (starts + latencies >= gone) & (starts <= done)
    finally:
        code = daemon.stop()
        shutil.rmtree(daemon.pipe_dir.parent, ignore_errors=True)
    print(f"big client: {options.small} small allocations, {options.reservations} VMM reservations"
          + (f" and {options.touched:g} GiB written" if options.touched else "")
          + f", made in {made:.1f} s; {'killed' if options.kill else 'exited'}")
    print(f"teardown: {done - gone:.3f} s from its exit to the daemon's line: reclaimed {line.group(1)}")
    print(f"bystander, baseline ({options.baseline:g} s before):  {summary(latencies[before])}")
    print(f"bystander, during the teardown:        {summary(latencies[during])}")
    print(f"daemon exit: {code}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
