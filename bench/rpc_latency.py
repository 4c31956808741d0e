"""RPC latency: p50 and p99 of a synchronous no-op request (`ctx.mem_get_info()`) through the daemon, beside a
raw msgpack ping-pong between two processes over a Unix socketpair, measured in the same run.

    .venv/bin/python bench/rpc_latency.py [--n 2000] [--repeat 5] [--json]

The two sides alternate, block by block (`--repeat` blocks of `--n` samples each, after `--warmup`
unmeasured calls per block), so that load from other processes on a small machine falls on both alike.
Percentiles are over all samples of a side. Target (issue 14, 2-core machines): our p50 at most 1.5x the raw p50.
Both ends of ours spin a while for the next message before they block (the daemon's --spin, the client's
cudaDeviceScheduleAuto), and the raw pair blocks: a third side, the raw pair with both ends spinning (for up to
1 ms, then blocking), shows what that choice alone is worth (printed, not part of the target).
Beside the latencies it prints the server side's CPU per request (the daemon's, the raw peer's: user and
system time, read with psutil over every call of every block): what the latency is made of beyond the
kernel's wake-ups.
"""
from __future__ import annotations

import contextlib
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402
import psutil  # noqa: E402

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


def server_cpu_counted(block: Callable[[], Any], pid: int, totals: list[float]) -> Callable[[], Any]:
    """`block`, adding the user and system CPU seconds process `pid` spent meanwhile to `totals`."""
    server = psutil.Process(pid)

    def counted() -> Any:
        before = server.cpu_times()
        out = block()
        after = server.cpu_times()
        totals[0] += after.user - before.user
        totals[1] += after.system - before.system
        return out
    return counted


def peer_pid(sock: socket.socket) -> int:
    pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid


def main() -> int:
    args = h.parser(__doc__.splitlines()[0], n=2000, repeat=5, warmup=300).parse_args()
    h.prepare_dirs(args)

    started = time.monotonic()
    server_cpu = h.SERVER_CPU if args.pin else None
    with contextlib.ExitStack() as stack:
        d, ctx = h.daemon_and_client(stack, args, time_scale=1.0)
        peer = None if args.skip_baseline else stack.enter_context(h.raw_peer(server_cpu))
        spinner = None if args.skip_baseline else stack.enter_context(h.raw_peer(server_cpu, spin=True))
        if args.pin:
            h.pin(0, h.CLIENT_CPU)
        our_cpu, raw_cpu = [0.0, 0.0], [0.0, 0.0]
        spun: list[list[float]] = []

        def raw_blocks() -> list[float]:
            assert peer is not None and spinner is not None
            spun.append(block_raw(*spinner, args.n, args.warmup))
            return server_cpu_counted(lambda: block_raw(*peer, args.n, args.warmup), peer_pid(peer[0]), raw_cpu)()

        ours, raw = h.alternate(
            args, "rpc_client", server_cpu_counted(lambda: block_ours(ctx, args.n, args.warmup), d.proc.pid, our_cpu),
            None if peer is None else raw_blocks)
    calls = args.repeat * (args.n + args.warmup)

    o50, o99 = h.percentiles(ours)
    rows = [("request", "ctx.mem_get_info() through a private daemon (blocking client, its own process)"),
            ("samples", f"{args.repeat} x {args.n} per side, alternating blocks, {args.warmup} warm-up per block"),
            ("mpsd p50 / p99", f"{o50:.1f} us / {o99:.1f} us"),
            ("daemon CPU", f"{our_cpu[0] / calls * 1e6:.1f} us user + {our_cpu[1] / calls * 1e6:.1f} us system per "
                           "request (psutil)")]
    line = {"bench": "rpc_latency", "n": args.n, "repeat": args.repeat, "p50_us": round(o50, 2),
            "p99_us": round(o99, 2), "target_ratio": TARGET,
            "daemon_cpu_us": [round(v / calls * 1e6, 2) for v in our_cpu]}
    verdict = None
    if raw:
        r50, r99 = h.percentiles(raw)
        ratio50, ratio99 = o50 / r50, o99 / r99
        per_block = [h.percentile(sorted(a), 50) / h.percentile(sorted(b), 50) for a, b in zip(ours, raw)]
        verdict = ratio50 <= TARGET
        rows += [("raw p50 / p99", f"{r50:.1f} us / {r99:.1f} us   (msgpack ping-pong over a socketpair, "
                                   "2 processes, blocking)"),
                 ("raw peer CPU", f"{raw_cpu[0] / calls * 1e6:.1f} us user + {raw_cpu[1] / calls * 1e6:.1f} us "
                                  "system per round trip"),
                 ("raw spinning", f"{h.percentiles(spun)[0]:.1f} us / {h.percentiles(spun)[1]:.1f} us   (the same "
                                  f"pair, both ends spinning; ours is {o50 / h.percentiles(spun)[0]:.2f}x its p50)"),
                 ("ratio p50 (p99)", f"{ratio50:.2f}x ({ratio99:.2f}x);  p50 ratio per block "
                                     + " ".join(f"{v:.2f}" for v in per_block)),
                 ("target", f"p50 ratio <= {TARGET:.1f}x")]
        line.update({"raw_p50_us": round(r50, 2), "raw_p99_us": round(r99, 2), "ratio_p50": round(ratio50, 3),
                     "ratio_p99": round(ratio99, 3), "ratio_p50_blocks": [round(v, 3) for v in per_block],
                     "raw_peer_cpu_us": [round(v / calls * 1e6, 2) for v in raw_cpu],
                     "raw_spinning_p50_us": round(h.percentiles(spun)[0], 2), "pass": verdict})
    rows.append(("wall time", f"{time.monotonic() - started:.1f} s"))
    h.report("rpc_latency", rows, verdict, line if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
