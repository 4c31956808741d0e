"""Wake-up: how long after a kernel's end a synchronize returns, on the simulated H200 under the wall clock
(`--clock wall`, where simulated seconds follow the wall's), beside the kernel's own simulated duration.

    .venv/bin/python bench/sync_wake.py [--n 100] [--ms 2.3]

Each request is one `spin` kernel of `--ms` milliseconds (1 block of 32 threads) and a synchronize; its figure
is the wall time from the launch to the synchronize's return. The baseline is the time the kernel itself took,
as the device's events measured it. trio's timers oversleep by up to a millisecond under epoll, so a daemon
that waited for the kernel's end on a timer alone would add up to that much to every request.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

from mpsd.sim import H200  # noqa: E402


def main() -> int:
    p = h.parser(__doc__.splitlines()[0], n=100, repeat=1, warmup=5)
    p.add_argument("--ms", type=float, default=2.3, help="the kernel's length in milliseconds (default 2.3)")
    args = p.parse_args()
    h.prepare_dirs(args)
    cycles = int(args.ms * 1e-3 * H200.clock_hz)
    walls, kernels = [], []
    with contextlib.ExitStack() as stack:
        _, ctx = h.daemon_and_client(stack, args, time_scale=1.0)
        start, end = ctx.create_event(), ctx.create_event()
        for i in range(args.warmup + args.n):
            t0 = time.perf_counter()
            start.record()
            ctx.launch("spin", 1, 32, [cycles])
            end.record()
            ctx.synchronize()
            wall = time.perf_counter() - t0
            if i >= args.warmup:
                walls.append(wall * 1e3)
                kernels.append(start.elapsed_ms(end))
    ours, base = statistics.median(walls), statistics.median(kernels)
    h.report("sync_wake", [
        ("request", f"spin of {args.ms:g} ms (1 block), then synchronize; one blocking client, --clock wall"),
        ("mpsd", f"p50 {ours:.3f} ms, max {max(walls):.3f} ms (launch to the synchronize's return)"),
        ("baseline", f"p50 {base:.3f} ms (the kernel, between its events)"),
        ("difference", f"p50 +{(ours - base) * 1e3:.0f} us, ratio {ours / base:.3f}"),
    ], None, {"bench": "sync_wake", "ms": args.ms, "p50_ms": round(ours, 4), "kernel_p50_ms": round(base, 4)}
        if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
