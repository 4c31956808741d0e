"""RPC latency: p50 and p99 of a synchronous no-op request (`ctx.mem_get_info()`) through the daemon, beside a
raw msgpack ping-pong between two processes over a Unix socketpair, measured in the same run.

    .venv/bin/python bench/rpc_latency.py [--n 2000] [--repeat 5] [--json]

The two sides alternate, block by block (`--repeat` blocks of `--n` samples each, after `--warmup`
unmeasured calls per block), so that load from other processes on a small machine falls on both alike.
Percentiles are over all samples of a side. Target (issue 14, 2-core machines): our p50 at most 1.5x the raw p50.
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

TARGET = 1.5  # our p50 / raw p50, at most


def block_ours(ctx, n: int, warmup: int) -> list[float]:
    call = ctx.mem_get_info
    clock = time.perf_counter_ns
    for _ in range(warmup):
        call()
    samples = [0.0] * n
    for i in range(n):
        t0 = clock()
        call()
        samples[i] = (clock() - t0) / 1000.0
    return samples


def block_raw(sock, reader: h.FrameReader, n: int, warmup: int) -> list[float]:
    clock = time.perf_counter_ns
    samples = [0.0] * n
    for i in range(-warmup, n):
        t0 = clock()
        sock.sendall(h.frame([0, i & 0xFFFF, "mem_get_info", {}]))  # encoded per call, as our client does
        reply = reader.next()
        elapsed = (clock() - t0) / 1000.0
        assert reply is not None and reply[1] == i & 0xFFFF
        if i >= 0:
            samples[i] = elapsed
    return samples


def main() -> int:
    args = h.parser(__doc__.splitlines()[0], n=2000, repeat=5, warmup=300).parse_args()
    h.prepare_dirs(args)

    started = time.monotonic()
    server_cpu = h.SERVER_CPU if args.pin else None
    with contextlib.ExitStack() as stack:
        d, ctx = h.daemon_and_client(stack, args, time_scale=1.0)
        peer = None if args.skip_baseline else stack.enter_context(h.raw_peer(server_cpu))
        if args.pin:
            h.pin(0, h.CLIENT_CPU)
        ours, raw = h.alternate(args, "rpc_client", lambda: block_ours(ctx, args.n, args.warmup),
                                None if peer is None else lambda: block_raw(*peer, args.n, args.warmup))

    o50, o99 = h.percentiles(ours)
    rows = [("request", "ctx.mem_get_info() through a private daemon (blocking client, its own process)"),
            ("samples", f"{args.repeat} x {args.n} per side, alternating blocks, {args.warmup} warm-up per block"),
            ("mpsd p50 / p99", f"{o50:.1f} us / {o99:.1f} us")]
    line = {"bench": "rpc_latency", "n": args.n, "repeat": args.repeat, "p50_us": round(o50, 2),
            "p99_us": round(o99, 2), "target_ratio": TARGET}
    verdict = None
    if raw:
        r50, r99 = h.percentiles(raw)
        ratio50, ratio99 = o50 / r50, o99 / r99
        per_block = [h.percentile(sorted(a), 50) / h.percentile(sorted(b), 50) for a, b in zip(ours, raw)]
        verdict = ratio50 <= TARGET
        rows += [("raw p50 / p99", f"{r50:.1f} us / {r99:.1f} us   (msgpack ping-pong over a socketpair, "
                                   "2 processes, blocking)"),
                 ("ratio p50 (p99)", f"{ratio50:.2f}x ({ratio99:.2f}x);  p50 ratio per block "
                                     + " ".join(f"{v:.2f}" for v in per_block)),
                 ("target", f"p50 ratio <= {TARGET:.1f}x")]
        line.update({"raw_p50_us": round(r50, 2), "raw_p99_us": round(r99, 2), "ratio_p50": round(ratio50, 3),
                     "ratio_p99": round(ratio99, 3), "ratio_p50_blocks": [round(v, 3) for v in per_block],
                     "pass": verdict})
    rows.append(("wall time", f"{time.monotonic() - started:.1f} s"))
    h.report("rpc_latency", rows, verdict, line if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
