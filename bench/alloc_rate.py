"""Allocation rate: the host time of a stream-ordered pair (malloc_async + free_async) through mpsd, beside a
synchronous pair (malloc + free through the daemon), a cached pair (mpsd_client.CachingAllocator, a cache hit)
and the raw baselines, all measured in the same run.

    .venv/bin/python bench/alloc_rate.py [--n 2000] [--repeat 5] [--pin] [--json]

A blocking client of a daemon process times blocks of `--n` pairs of each kind in turn (`--repeat` blocks each,
alternating, so load on the machine hits them alike), and reports the median microseconds per pair:

    malloc_async pair     1 MiB from the default pool on a stream (warmed: its reservation made), freed on
                          the same stream; the notifications go ahead of the client's next message, in batches
    cached pair           CachingAllocator.malloc and .free of 1 MiB (the cached block reused)
    malloc pair           ctx.malloc and ctx.free of 1 MiB and of 64 MiB (two round trips; free synchronises)

The raw baselines, over a socketpair to the harness's peer process (bench/_harness.py): a msgpack request-reply
(what a round trip costs at the least) and a one-way msgpack frame (what sending one notification costs). The H200
measured a cudaMallocAsync + cudaFreeAsync pair at about 2.5 us and a cudaMalloc + cudaFree pair at 101 us (1 MiB)
to 222 us (64 MiB): 40 to 89 times as much.

Target: a malloc_async pair at least 20 times cheaper than a malloc pair of 1 MiB, as on the H200.
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

import mpsd_client  # noqa: E402

MiB = 1 << 20
TARGET = 20.0  # a malloc pair over a malloc_async pair, at least
H200_US = {"malloc_async pair": 2.5, "malloc pair 1 MiB": 101.0, "malloc pair 64 MiB": 222.0}


def per_pair(loop, n: int) -> float:
    """Microseconds per pair of one timed block of `n` pairs."""
    t0 = time.perf_counter()
    loop(n)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    p = h.parser(__doc__.splitlines()[0], n=2000, repeat=5, warmup=200)
    args = p.parse_args()
    h.prepare_dirs(args)
    started = time.monotonic()
    samples: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        _, ctx = h.daemon_and_client(stack, args, time_scale=100.0)
        peer = None if args.skip_baseline else stack.enter_context(h.raw_peer(h.SERVER_CPU if args.pin else None))
        if args.pin:
            h.pin(0, h.CLIENT_CPU)
        stream = ctx.create_stream()
        cache = mpsd_client.CachingAllocator(ctx)

        def async_pairs(n: int) -> None:
            for _ in range(n):
                ctx.free_async(ctx.malloc_async(MiB, stream), stream)
            stream.query()  # the last notifications reach the daemon with this call: they count

        def cached_pairs(n: int) -> None:
            for _ in range(n):
                cache.free(cache.malloc(MiB))

        def malloc_pairs(size: int):
            def loop(n: int) -> None:
                for _ in range(n):
                    ctx.free(ctx.malloc(size))
            return loop

        kinds = {"malloc_async pair": (async_pairs, args.n), "cached pair": (cached_pairs, args.n),
                 "malloc pair 1 MiB": (malloc_pairs(MiB), max(args.n // 10, 20)),
                 "malloc pair 64 MiB": (malloc_pairs(64 * MiB), max(args.n // 10, 20))}
        if peer is not None:
            sock, reader = peer
            request = h.frame([0, 1, "malloc", {"nbytes": MiB}])
            note = h.frame([2, "free_async", {"ptr": 0x7F40_0000_0000, "stream": 1}])

            def round_trips(n: int) -> None:
                for _ in range(n):
                    sock.sendall(request)
                    reader.next()

            def notifications(n: int) -> None:
                for _ in range(n):
                    sock.sendall(note)
                sock.sendall(request)  # the peer has read them all when it answers
                reader.next()

            kinds["raw round trip"] = (round_trips, max(args.n // 10, 20))
            kinds["raw notification"] = (notifications, args.n)
        for loop, n in kinds.values():
            loop(min(n, args.warmup))  # warm-up: the pool's reservation, the cache's segment, the peer's start
        for _ in range(args.repeat):
            for name, (loop, n) in kinds.items():
                samples.setdefault(name, []).append(per_pair(loop, n))
        ctx.synchronize()

    us = {name: h.median(values) for name, values in samples.items()}
    ratio = us["malloc pair 1 MiB"] / us["malloc_async pair"]
    rows = [("blocks", f"{args.repeat} of each kind, alternating; {args.n} pairs a block "
                       f"({max(args.n // 10, 20)} of malloc and of raw round trips)")]
    for name, value in us.items():
        rows.append((name, f"{value:8.2f} us  ({1e6 / value:>11,.0f} a second)"
                     + (f"   H200: {H200_US[name]:g} us" if name in H200_US else "")))
    rows += [("malloc pair / malloc_async pair", f"{ratio:.1f}x (1 MiB), "
              f"{us['malloc pair 64 MiB'] / us['malloc_async pair']:.1f}x (64 MiB);  H200: "
              f"{H200_US['malloc pair 1 MiB'] / H200_US['malloc_async pair']:.0f}x and "
              f"{H200_US['malloc pair 64 MiB'] / H200_US['malloc_async pair']:.0f}x"),
             ("malloc pair / cached pair", f"{us['malloc pair 1 MiB'] / us['cached pair']:.1f}x (1 MiB)")]
    if "raw round trip" in us:
        pair = us["malloc_async pair"] / (2 * us["raw notification"])
        rows.append(("against the raw", f"a malloc_async pair {pair:.2f}x two raw notifications "
                     f"({2 * us['raw notification']:.2f} us);  a malloc pair of 1 MiB "
                     f"{us['malloc pair 1 MiB'] / us['raw round trip']:.1f}x a raw round trip"))
    rows += [("target", f"a malloc_async pair at least {TARGET:g}x cheaper than a malloc pair of 1 MiB"),
             ("wall time", f"{time.monotonic() - started:.1f} s")]
    line = {"bench": "alloc_rate", "n": args.n, "repeat": args.repeat, "pass": ratio >= TARGET,
            "us": {k: round(v, 3) for k, v in us.items()}, "ratio": round(ratio, 2),
            "cached_ratio": round(us["malloc pair 1 MiB"] / us["cached pair"], 2)}
    h.report("alloc_rate", rows, ratio >= TARGET, line if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
