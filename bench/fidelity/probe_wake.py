"""Where a lone latency tenant's time goes through mpsd on cuda:0 (the crosscheck's `latency alone`: 3.5 times
real MPS's p50 with 2 ms between requests, 1.4 times back to back): one request of the probe kernel (8 blocks
of 128 threads spinning 0.1 ms) and a synchronize, timed with the client's wait for the reply spinning as
cudaDeviceScheduleAuto, Spin or BlockingSync says, with 0, 0.5 and 2 ms between requests, beside a daemon
that spins for a client's next call as long as it may (--spin 0.001) and one that does not (--spin 0).

    python3 bench/fidelity/probe_wake.py [--requests N]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from crosscheck import CYCLES, base_env, mpsd_daemon  # noqa: E402

WORKER = """
import json, sys, time, mpsd_client
requests = int(sys.argv[1])
ctx = mpsd_client.connect()
ctx.launch("spin", 1, 32, [0]); ctx.synchronize()
rows = []
for name, flags in (("auto", 0), ("spin", 1), ("blocking", 4)):
    ctx.set_device_flags(flags)
    for gap in (0.0, 0.5e-3, 2e-3):
        out = []
        for _ in range(requests):
            t0 = time.perf_counter()
            ctx.launch("spin", 8, 128, [%(cycles)d]); ctx.synchronize()
            out.append((time.perf_counter() - t0) * 1e6)
            if gap:
                time.sleep(gap)
        out.sort()
        rows.append([name, gap * 1e3, out[len(out) // 2], out[min(len(out) - 1, round(0.99 * len(out)))]])
print(json.dumps(rows), flush=True)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--spins", default="0,0.001", help="the daemon's --spin values to try, comma-separated")
    parser.add_argument("--devices", default="cuda:0", help="the daemon's --devices (h200: a try-out without a GPU)")
    options = parser.parse_args()
    code = WORKER % {"cycles": CYCLES // 10}
    print(f"{'daemon':<12} {'schedule':<9} {'gap ms':>6} {'p50 us':>8} {'p99 us':>8}")
    for spin in options.spins.split(","):
        with mpsd_daemon(["--devices", options.devices, "--spin", spin], base_env()) as env:
            done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(options.requests)], env=env,
                                  capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(done.stderr)
        rows = json.loads(done.stdout)
        for name, gap, p50, p99 in rows:
            print(f"--spin {spin:<5} {name:<9} {gap:>6.1f} {p50:>8.1f} {p99:>8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
