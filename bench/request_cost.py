"""Request cost: a request of a few launches and a synchronize (an inference step's shape), one after another
from one client, through the daemon beside the same calls made straight, in the same run.

    .venv/bin/python bench/request_cost.py [--n 500] [--repeat 5] [--launches 2] [--us 20]
    python3 bench/request_cost.py --devices cuda:0                    # beside the same calls with cuda-python
    python3 bench/request_cost.py --devices cuda:0 --policy priority  # ... through the kernel dispatcher

A request is `--launches` launches of `spin` (1 block of 32 threads spinning `--us` microseconds of the H200's
clock) on the default stream, then a synchronize; its figure is the wall time from the first launch to the
synchronize's return. On a real GPU the baseline makes the same launches with cuLaunchKernel and waits with
cuCtxSynchronize, in this process's own context; on the simulated H200 (whose kernels take simulated time at
--time-scale 1) it is the raw peer: as many launch frames and one request round trip. The two sides alternate
block by block. Target (issue 33): our p50 at most 50 us above the baseline's on a real GPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402
from launch_rate import WIRE  # noqa: E402

from mpsd.sim import H200  # noqa: E402

TARGET_US = 50.0  # our p50 less the direct calls' p50, at most, on a real GPU


def block_ours(ctx: Any, n: int, warmup: int, launches: int, cycles: int) -> list[float]:
    launch, synchronize, args = ctx.launch, ctx.synchronize, [cycles]
    out = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        for _ in range(launches):
            launch("spin", 1, 32, args)
        synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def direct(ordinal: int, launches: int, cycles: int) -> Callable[[int, int], list[float]]:
    """The same request straight from Python with cuda-python, in this process's own context."""
    from mpsd.backends.cuda import CudaBackend

    gpu = CudaBackend(ordinal)
    cu, spin = gpu.cu, gpu._functions["spin"]
    value = ctypes.c_int64(cycles)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(value))
    address = ctypes.addressof(params)

    def block(n: int, warmup: int, keep: tuple[Any, ...] = (value, params)) -> list[float]:
        # `keep` holds the argument buffer alive: the launches read it through its bare address.
        out = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            for _ in range(launches):
                cu.cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, 0, address, 0)
            cu.cuCtxSynchronize()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        return out

    return block


def raw(sock: Any, reader: h.FrameReader, launches: int) -> Callable[[int, int], list[float]]:
    def block(n: int, warmup: int) -> list[float]:
        out = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            for _ in range(launches):
                sock.sendall(h.frame(WIRE))
            sock.sendall(h.frame([0, 1, "synchronize", {}]))
            reply = reader.next()
            assert reply is not None and reply[1] == 1
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        return out

    return block


def main() -> int:
    p = h.parser(__doc__.splitlines()[0], n=500, repeat=5, warmup=50)
    p.add_argument("--devices", help="the daemon's --devices; cuda:N compares with the same calls by cuda-python")
    p.add_argument("--dispatch", help="the daemon's --dispatch (kernel: the dispatcher in front of the simulator too)")
    p.add_argument("--policy", help="the daemon's --policy (on cuda:N any but mps puts its kernel dispatcher in "
                                    "the path)")
    p.add_argument("--launches", type=int, default=2, help="launches a request (default 2)")
    p.add_argument("--us", type=float, default=20.0, help="microseconds each kernel spins (default 20)")
    args = p.parse_args()
    real = args.devices is not None and args.devices.startswith("cuda:")
    cycles = round(args.us * 1e-6 * H200.clock_hz)
    h.prepare_dirs(args)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        _, ctx = h.daemon_and_client(stack, args, time_scale=1.0, devices=args.devices, policy=args.policy,
                                     dispatch=args.dispatch)
        baseline = None
        if real and not args.skip_baseline:
            baseline = direct(int(args.devices.split(":")[1]), args.launches, cycles)
        elif not args.skip_baseline:
            baseline = raw(*stack.enter_context(h.raw_peer()), args.launches)
        ours, theirs = h.alternate(args, "request_client",
                                   lambda: block_ours(ctx, args.n, args.warmup, args.launches, cycles),
                                   (lambda: baseline(args.n, args.warmup)) if baseline else None)
    p50, p99 = h.percentiles(ours)
    rows = [("request", f"{args.launches} x spin (1 block of 32 threads, {args.us:g} us), then synchronize; one "
                        "blocking client, its own process"),
            ("daemon", f"--devices {args.devices}" + (f" --policy {args.policy}" if args.policy else "")
             if args.devices else "the simulated H200, --time-scale 1"),
            ("blocks", f"{args.repeat} x {args.n} per side, alternating, {args.warmup} warm-up per block"),
            ("mpsd", f"p50 {p50 * 1e6:,.1f} us, p99 {p99 * 1e6:,.1f} us")]
    verdict = None
    line: dict[str, Any] = {"bench": "request_cost", "devices": args.devices, "policy": args.policy,
                            "launches": args.launches, "us": args.us, "p50_us": round(p50 * 1e6, 2),
                            "p99_us": round(p99 * 1e6, 2)}
    if theirs:
        b50, b99 = h.percentiles(theirs)
        what = "the same calls by cuda-python, in this process" if real else "raw frames and a round trip"
        rows += [("baseline", f"p50 {b50 * 1e6:,.1f} us, p99 {b99 * 1e6:,.1f} us   ({what})"),
                 ("difference", f"p50 {(p50 - b50) * 1e6:+,.1f} us, p99 {(p99 - b99) * 1e6:+,.1f} us")]
        line.update({"baseline_p50_us": round(b50 * 1e6, 2), "baseline_p99_us": round(b99 * 1e6, 2)})
        if real:
            verdict = (p50 - b50) * 1e6 <= TARGET_US
            rows.append(("target", f"p50 at most {TARGET_US:g} us above the direct calls'"))
            line["pass"] = verdict
    rows.append(("wall time", f"{time.monotonic() - started:.1f} s"))
    h.report("request_cost", rows, verdict, line if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
