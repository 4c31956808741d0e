"""Launch rate: fire-and-forget launches per second of a zero-duration kernel (`spin` of 0 cycles, 1 block of
32 threads) from one client, beside raw one-way msgpack streaming between two processes, in the same run.

    .venv/bin/python bench/launch_rate.py [--n 20000] [--repeat 3] [--time-scale 1000] [--json]

Our interval runs from the first launch to the return of `ctx.synchronize()` after the last, so the daemon
has really taken every launch through its engine. The raw stream sends the same number of frames shaped like
our launch notification, one `sendall` each, and ends with one request whose reply says the peer has decoded
them all. Target (2-core machines): our rate at least 40% of the raw stream's.
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

TARGET = 0.40  # our rate / raw rate, at least
KERNEL = ("spin", 1, 32, [0])
# The notification our client sends for KERNEL, so the raw stream moves the same bytes.
WIRE = [2, "launch", {"name": "spin", "grid": [1, 1, 1], "block": [32, 1, 1], "args": [0], "shared_mem": 0,
                      "stream": None}]


def measure_ours(pipe_dir: Path, n: int, warmup: int, repeat: int, args) -> list[float]:
    import mpsd_client

    rates = []
    with mpsd_client.connect(pipe_dir) as ctx:
        launch = ctx.launch
        name, grid, block, kargs = KERNEL
        for r in range(repeat):
            for _ in range(warmup):
                launch(name, grid, block, kargs)
            ctx.synchronize()
            profiling = h.client_profile(args.profile, args.py_spy, "launch_client") if r == 0 \
                else contextlib.nullcontext()
            with profiling:
                t0 = time.perf_counter()
                for _ in range(n):
                    launch(name, grid, block, kargs)
                ctx.synchronize()
                rates.append(n / (time.perf_counter() - t0))
        stats = ctx.statistics()
        expected = repeat * (n + warmup)
        if stats.get("kernels_completed") not in (None, expected):
            raise RuntimeError(f"the daemon completed {stats.get('kernels_completed')} kernels, not {expected}")
    return rates


def measure_raw(n: int, warmup: int, repeat: int) -> list[float]:
    rates = []
    with h.raw_peer() as (sock, reader):
        request_id = 0

        def stream(count: int) -> None:
            nonlocal request_id
            for _ in range(count):
                sock.sendall(h.frame(WIRE))  # encoded per frame, as our client encodes each launch
            request_id += 1
            sock.sendall(h.frame([0, request_id, "synchronize", {}]))
            reply = reader.next()
            assert reply is not None and reply[1] == request_id

        for _ in range(repeat):
            stream(warmup)
            t0 = time.perf_counter()
            stream(n)
            rates.append(n / (time.perf_counter() - t0))
    return rates


def main() -> int:
    p = h.parser(__doc__.splitlines()[0], n=20000, repeat=3, warmup=2000)
    p.add_argument("--time-scale", type=float, default=1000.0,
                   help="the daemon's --time-scale (default 1000: simulated kernel overhead, 10 us per kernel "
                        "at scale 1, becomes 10 ns and cannot bound the rate)")
    args = p.parse_args()
    h.prepare_dirs(args)
    started = time.monotonic()
    with h.daemon(time_scale=args.time_scale, profile_dir=args.profile, py_spy_dir=args.py_spy) as d:
        ours = measure_ours(d.pipe_dir, args.n, args.warmup, args.repeat, args)
    raw = [] if args.skip_baseline else measure_raw(args.n, args.warmup, args.repeat)

    rate = h.median(ours)
    rows = [("launch", f"ctx.launch{KERNEL!r} x {args.n}, then ctx.synchronize(); one blocking client"),
            ("daemon", f"--time-scale {args.time_scale:g} (simulated launch overhead 10 us / {args.time_scale:g}"
                       " per kernel, so it does not bound the rate)"),
            ("repeats", f"{args.repeat}, {args.warmup} warm-up launches each; figures are the median"),
            ("mpsd rate", f"{rate:,.0f} launches/s   (per repeat " + ", ".join(f"{v:,.0f}" for v in ours) + ")")]
    line = {"bench": "launch_rate", "n": args.n, "repeat": args.repeat, "time_scale": args.time_scale,
            "rate_per_s": round(rate), "rate_runs_per_s": [round(v) for v in ours], "target_ratio": TARGET}
    verdict = True
    if raw:
        raw_rate = h.median(raw)
        ratio = rate / raw_rate
        verdict = ratio >= TARGET
        rows += [("raw rate", f"{raw_rate:,.0f} frames/s   (one-way msgpack stream, one sendall per frame, "
                              "socketpair, 2 processes; per repeat " + ", ".join(f"{v:,.0f}" for v in raw) + ")"),
                 ("ratio", f"{ratio:.1%} of raw"),
                 ("target", f">= {TARGET:.0%} of raw")]
        line.update({"raw_rate_per_s": round(raw_rate), "raw_rate_runs_per_s": [round(v) for v in raw],
                     "ratio": round(ratio, 4), "pass": verdict})
    rows.append(("wall time", f"{time.monotonic() - started:.1f} s"))
    h.report("launch_rate", rows, verdict, line if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
