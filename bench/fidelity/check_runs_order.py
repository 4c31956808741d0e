"""Runs of repeated launches keep the legacy default stream's order on a device: loops of 1-ms kernels of one
block on the default stream and on a blocking stream beside it run one after another (about 1 ms each, as one
launch at a time would), and the same loops with a non-blocking stream run side by side (about half that).

    python3 bench/fidelity/check_runs_order.py [--devices cuda:0]     # the simulated H200 by default

Each pattern is sent as launches that repeat byte for byte, which the daemon serves as runs (README,
"Benchmarks"); the figure is the wall time from the first launch to the return of synchronize().
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _harness as h  # noqa: E402

MS = 1_980_000  # spin cycles in 1 ms at the H200's 1.98 GHz
PATTERN = [0] * 6 + [1] * 6 + [0] * 6 + [1, 1, 0, 0] * 3  # 0: the default stream, 1: the other one


def elapsed(ctx, other) -> float:
    for _ in range(3):  # the second launch of each stream is the one remembered
        ctx.launch("spin", 1, 32, [MS])
        ctx.launch("spin", 1, 32, [MS], stream=other)
    ctx.synchronize()
    start = time.perf_counter()
    for which in PATTERN:
        ctx.launch("spin", 1, 32, [MS], stream=other if which else None)
    ctx.synchronize()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", help="the daemon's --devices (default: one simulated H200)")
    args = p.parse_args()
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(h.daemon(time_scale=1.0, devices=args.devices))
        import mpsd_client
        ctx = stack.enter_context(mpsd_client.connect(d.pipe_dir))
        blocking = elapsed(ctx, ctx.create_stream())
        side_by_side = elapsed(ctx, ctx.create_stream(non_blocking=True))
    n = len(PATTERN)
    print(f"device          {args.devices or 'h200 (simulated)'}")
    print(f"blocking        {blocking * 1e3:.2f} ms for {n} 1-ms kernels (one after another: about {n} ms)")
    print(f"non-blocking    {side_by_side * 1e3:.2f} ms (side by side: about {PATTERN.count(0)} ms, the default "
          "stream's share)")
    ok = blocking >= 0.95 * n * 1e-3 and side_by_side < 0.8 * n * 1e-3
    print(f"result          {'PASS' if ok else 'MISS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
