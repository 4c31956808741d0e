"""RPC latency: p50 and p99 of a synchronous no-op request (`ctx.mem_get_info()`) through the daemon, beside a
raw msgpack ping-pong between two processes over a Unix socketpair, measured in the same run.

    .venv/bin/python bench/rpc_latency.py [--n 5000] [--repeat 3] [--json]

Target (2-core machines): our p50 at most 2x the raw ping-pong's p50.
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

TARGET = 2.0  # our p50 / raw p50, at most


def measure_ours(pipe_dir: Path, n: int, warmup: int, repeat: int, args) -> list[list[float]]:
    import mpsd_client

    runs = []
    with mpsd_client.connect(pipe_dir) as ctx:
        for r in range(repeat):
            for _ in range(warmup):
                ctx.mem_get_info()
            samples = [0.0] * n
            clock = time.perf_counter_ns
            call = ctx.mem_get_info
            with h.client_profile(args.profile, args.py_spy, "rpc_client") if r == 0 else contextlib.nullcontext():
                for i in range(n):
                    t0 = clock()
                    call()
                    samples[i] = (clock() - t0) / 1000.0
            runs.append(sorted(samples))
    return runs


def measure_raw(n: int, warmup: int, repeat: int) -> list[list[float]]:
    runs = []
    with h.raw_peer() as (sock, reader):
        request_id = 0
        clock = time.perf_counter_ns
        for _ in range(repeat):
            samples = [0.0] * n
            for i in range(-warmup, n):
                request_id += 1
                t0 = clock()
                sock.sendall(h.frame([0, request_id, "mem_get_info", {}]))
                reply = reader.next()
                elapsed = (clock() - t0) / 1000.0
                assert reply is not None and reply[1] == request_id
                if i >= 0:
                    samples[i] = elapsed
            runs.append(sorted(samples))
    return runs


def main() -> int:
    args = h.parser(__doc__.splitlines()[0], n=5000, repeat=3, warmup=500).parse_args()
    h.prepare_dirs(args)
    started = time.monotonic()
    with h.daemon(time_scale=1.0, profile_dir=args.profile, py_spy_dir=args.py_spy) as d:
        ours = measure_ours(d.pipe_dir, args.n, args.warmup, args.repeat, args)
    raw = [] if args.skip_baseline else measure_raw(args.n, args.warmup, args.repeat)

    def figures(runs: list[list[float]]) -> tuple[float, float, list[float], list[float]]:
        p50s = [h.percentile(r, 50) for r in runs]
        p99s = [h.percentile(r, 99) for r in runs]
        return h.median(p50s), h.median(p99s), p50s, p99s

    o50, o99, o50s, o99s = figures(ours)
    rows = [("request", "ctx.mem_get_info() through a private daemon (blocking client, one process)"),
            ("samples", f"{args.n} per repeat x {args.repeat} repeats, {args.warmup} warm-up each; "
                        "figures are the median over repeats"),
            ("mpsd p50 / p99", f"{o50:.1f} us / {o99:.1f} us   (per repeat p50 "
                               + ", ".join(f"{v:.1f}" for v in o50s) + ")")]
    line = {"bench": "rpc_latency", "n": args.n, "repeat": args.repeat, "p50_us": round(o50, 2),
            "p99_us": round(o99, 2), "p50_runs_us": [round(v, 2) for v in o50s], "target_ratio": TARGET}
    verdict = True
    if raw:
        r50, r99, r50s, _ = figures(raw)
        ratio50, ratio99 = o50 / r50, o99 / r99
        verdict = ratio50 <= TARGET
        rows += [("raw p50 / p99", f"{r50:.1f} us / {r99:.1f} us   (msgpack ping-pong, socketpair, 2 processes; "
                                   "per repeat p50 " + ", ".join(f"{v:.1f}" for v in r50s) + ")"),
                 ("ratio p50 (p99)", f"{ratio50:.2f}x ({ratio99:.2f}x)"),
                 ("target", f"p50 ratio <= {TARGET:.1f}x")]
        line.update({"raw_p50_us": round(r50, 2), "raw_p99_us": round(r99, 2), "ratio_p50": round(ratio50, 3),
                     "ratio_p99": round(ratio99, 3), "pass": verdict})
    rows.append(("wall time", f"{time.monotonic() - started:.1f} s"))
    h.report("rpc_latency", rows, verdict, line if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
