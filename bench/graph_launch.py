"""Graph launch: the client's CPU time per iteration of one replay of a 100-kernel graph, beside the same 100 kernels
launched one by one, in the same run; and what the simulated H200 makes of both, beside the H200's own figures.

    .venv/bin/python bench/graph_launch.py [--n 50] [--repeat 5] [--json]
    python3 bench/graph_launch.py --devices cuda:0     # on a real GPU: beside direct cuda-python graph launches

An iteration is 100 `ctx.launch` calls of an empty kernel (`spin` of 0 cycles, 1 block of 32 threads) on a
stream, or one `exec.launch(s)` of a graph captured from those 100 calls. Its cost is this process's CPU time
(time.process_time), the part a graph saves: the client blocks (BlockingSync) rather than spins where the daemon's
launch queue is full, so waiting costs it nothing. The sides alternate block by block. Target: at least 95% of the
one-by-one CPU saved (the H200 saves 99.6% of its host time: 483 us against 2.0 us).

The second part asks a daemon under the virtual clock (--clock virtual), whose host model charges each call what
it costs a real CUDA host, what 100 launches and one graph launch cost the host and how long the GPU takes for
each (events around them), for empty kernels and for 264 blocks of 1024 threads spinning about 10 us, beside the
H200's figures (h200-runtime-measurements.md). On a real GPU (`--devices cuda:0`) the GPU times are the device's
own, and the baseline is the same graph captured and launched straight from Python with cuda-python.
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

import mpsd_client  # noqa: E402

TARGET = 0.95  # of the one-by-one client CPU saved, at least
NODES = 100
EMPTY = ("spin", 1, 32, [0])
SPIN_10US = ("spin", 264, 1024, [int(10e-6 * 1.98e9)])  # ~10 us at the H200's 1.98 GHz, one block per SM pair
# The H200's figures for 100 kernels (h200-runtime-measurements.md, CUDA graphs): host and GPU microseconds.
H200_FIGURES = {"empty": {"host one by one": 483.0, "host graph": 2.0, "gpu one by one": 485.0, "gpu graph": 53.0,
                          "host instantiate": 155.0},
                "10us": {"gpu one by one": 1167.0, "gpu graph": 1090.0}}


def capture(ctx: Any, stream: Any, kernel: tuple[Any, ...]) -> Any:
    """The executable graph of NODES launches of `kernel`, captured on `stream`."""
    name, grid, block, args = kernel
    stream.begin_capture()
    for _ in range(NODES):
        ctx.launch(name, grid, block, args, stream=stream)
    return stream.end_capture().instantiate()


def block_launches(ctx: Any, stream: Any, n: int, warmup: int) -> float:
    """CPU seconds of this process per iteration of NODES launches, over `n` iterations."""
    launch = ctx.launch
    name, grid, block, args = EMPTY
    for _ in range(warmup * NODES):
        launch(name, grid, block, args, stream=stream)
    stream.synchronize()
    t0 = time.process_time()
    for _ in range(n):
        for _ in range(NODES):
            launch(name, grid, block, args, stream=stream)
    spent = time.process_time() - t0
    stream.synchronize()
    return spent / n


def block_graph(executable: Any, stream: Any, n: int, warmup: int) -> float:
    """CPU seconds of this process per graph launch, over `n` launches."""
    launch = executable.launch
    for _ in range(warmup):
        launch(stream)
    stream.synchronize()
    t0 = time.process_time()
    for _ in range(n):
        launch(stream)
    spent = time.process_time() - t0
    stream.synchronize()
    return spent / n


def timed(ctx: Any, stream: Any, kernel: tuple[Any, ...], executable: Any, real: bool) -> dict[str, float]:
    """Microseconds of host time (the client's clock: simulated under the virtual clock, the wall's on a GPU) and
    of GPU time (events around them) for NODES launches of `kernel` one by one and for one launch of their graph."""
    name, grid, block, args = kernel
    start, end = ctx.create_event(), ctx.create_event()
    now = time.perf_counter if real else ctx.clock
    out = {}
    for side in ("one by one", "graph"):
        stream.synchronize()
        start.record(stream)
        t0 = now()
        if side == "graph":
            executable.launch(stream)
        else:
            for _ in range(NODES):
                ctx.launch(name, grid, block, args, stream=stream)
        host = now() - t0
        end.record(stream)
        stream.synchronize()
        out[f"host {side}"] = host * 1e6
        out[f"gpu {side}"] = start.elapsed_ms(end) * 1e3
    return out


def model_figures(args: Any, devices: str | None, real: bool) -> dict[str, dict[str, float]]:
    """`timed` for the empty kernel and the 10-us one, on a daemon of their own (the virtual clock unless real)."""
    figures = {}
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(h.daemon(time_scale=1.0, devices=devices, clock=None if real else "virtual"))
        ctx = stack.enter_context(mpsd_client.connect(d.pipe_dir))
        s = ctx.create_stream()
        now = time.perf_counter if real else ctx.clock
        for label, kernel in (("empty", EMPTY), ("10us", SPIN_10US)):
            executable = capture(ctx, s, kernel)
            timed(ctx, s, kernel, executable, real)  # warm: the first of each is not the figure
            figures[label] = timed(ctx, s, kernel, executable, real)
        name, grid, block, kargs = EMPTY
        s.begin_capture()
        for _ in range(NODES):
            ctx.launch(name, grid, block, kargs, stream=s)
        graph = s.end_capture()
        t0 = now()
        graph.instantiate()
        figures["empty"]["host instantiate"] = (now() - t0) * 1e6
    return figures


def direct(ordinal: int) -> tuple[Callable[[int, int], float], Callable[[int, int], float]]:
    """The baselines on a real GPU, in this process's own context with cuda-python: CPU seconds per iteration of
    NODES cuLaunchKernel calls, and per cuGraphLaunch of the same NODES captured with cuStreamBeginCapture."""
    from mpsd.backends.cuda import CudaBackend
    from mpsd.backends.cuda_driver import _check

    gpu = CudaBackend(ordinal)
    cu, spin = gpu.cu, gpu._functions["spin"]
    cycles = ctypes.c_int64(0)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(cycles))
    address = ctypes.addressof(params)
    stream = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    _check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    for _ in range(NODES):
        _check(cu.cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, stream, address, 0))
    graph = _check(cu.cuStreamEndCapture(stream))
    executable = _check(cu.cuGraphInstantiate(graph, 0))  # (cuda-python 12 on: the flags form, as WithFlags was)

    def launches(n: int, warmup: int, keep: tuple[Any, ...] = (cycles, params)) -> float:
        # `keep` holds the argument buffer alive: the launches read it through its bare address.
        for _ in range(warmup * NODES):
            cu.cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, stream, address, 0)
        cu.cuStreamSynchronize(stream)
        t0 = time.process_time()
        for _ in range(n * NODES):
            cu.cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, stream, address, 0)
        spent = time.process_time() - t0
        cu.cuStreamSynchronize(stream)
        return spent / n

    def graphs(n: int, warmup: int, keep: tuple[Any, ...] = (cycles, params, graph)) -> float:
        for _ in range(warmup):
            cu.cuGraphLaunch(executable, stream)
        cu.cuStreamSynchronize(stream)
        t0 = time.process_time()
        for _ in range(n):
            cu.cuGraphLaunch(executable, stream)
        spent = time.process_time() - t0
        cu.cuStreamSynchronize(stream)
        return spent / n

    return launches, graphs


def main() -> int:
    p = h.parser(__doc__.splitlines()[0], n=50, repeat=5, warmup=5)
    p.add_argument("--time-scale", type=float, default=1000.0,
                   help="the first daemon's --time-scale (default 1000: the simulated GPU does not bound the rate)")
    p.add_argument("--devices", help="the daemons' --devices; cuda:N adds direct cuda-python launches and graphs")
    args = p.parse_args()
    real = args.devices is not None and args.devices.startswith("cuda:")
    h.prepare_dirs(args)
    started = time.monotonic()

    with contextlib.ExitStack() as stack:
        _, ctx = h.daemon_and_client(stack, args, time_scale=args.time_scale, devices=args.devices)
        if args.pin:
            h.pin(0, h.CLIENT_CPU)
        ctx.set_device_flags(mpsd_client.DEVICE_SCHEDULE_BLOCKING_SYNC)
        s = ctx.create_stream()
        executable = capture(ctx, s, EMPTY)
        one_by_one, graph = h.alternate(args, "graph_launch", lambda: block_launches(ctx, s, args.n, args.warmup),
                                        None if args.skip_baseline else
                                        lambda: block_graph(executable, s, args.n, args.warmup))
    base = h.median(one_by_one)
    rows = [("iteration", f"{NODES} x ctx.launch{EMPTY!r} on a stream, or one exec.launch(s) of them captured"),
            ("blocks", f"{args.repeat} x {args.n} iterations per side, alternating, {args.warmup} warm-up each; "
                       f"daemon --time-scale {args.time_scale:g}" + (f" --devices {args.devices}" if args.devices
                                                                      else "")),
            ("one by one", f"{base * 1e6:,.1f} us of client CPU per iteration (median of blocks: "
                           + " ".join(f"{v * 1e6:,.0f}" for v in one_by_one) + ")")]
    line: dict[str, Any] = {"bench": "graph_launch", "n": args.n, "repeat": args.repeat, "devices": args.devices,
                            "one_by_one_cpu_us": round(base * 1e6, 2), "target_saved": TARGET}
    verdict = None
    if graph:
        mine = h.median(graph)
        saved = 1 - mine / base
        verdict = saved >= TARGET
        rows += [("graph", f"{mine * 1e6:,.1f} us of client CPU per iteration (median of blocks: "
                           + " ".join(f"{v * 1e6:,.1f}" for v in graph) + ")"),
                 ("ratio", f"{mine / base:.2%} of one by one: {saved:.1%} saved (the H200: 99.6%)"),
                 ("target", f">= {TARGET:.0%} saved")]
        line.update({"graph_cpu_us": round(mine * 1e6, 2), "ratio": round(mine / base, 5), "saved": round(saved, 5),
                     "pass": verdict})
    if real:
        launches, graphs = direct(int(args.devices.split(":")[1]))
        raw_one, raw_graph = launches(args.n, args.warmup), graphs(args.n, args.warmup)
        rows += [("direct", f"cuda-python in this process: {raw_one * 1e6:,.1f} us per {NODES} cuLaunchKernel, "
                            f"{raw_graph * 1e6:,.1f} us per cuGraphLaunch ({1 - raw_graph / raw_one:.1%} saved)")]
        line.update({"direct_one_by_one_cpu_us": round(raw_one * 1e6, 2),
                     "direct_graph_cpu_us": round(raw_graph * 1e6, 2)})
    figures = model_figures(args, args.devices, real)
    where = "the GPU, by events; host by the wall" if real else "the simulated H200 (--clock virtual)"
    for label, title in (("empty", "empty kernels"), ("10us", "264 x 1024 spinning ~10 us")):
        for key, value in figures[label].items():
            theirs = H200_FIGURES[label].get(key)
            rows.append((f"{label} {key}", f"{value:,.1f} us on {where}"
                         + (f"   (H200: {theirs:g} us)" if theirs is not None else "")))
    line["model"] = {label: {k: round(v, 2) for k, v in f.items()} for label, f in figures.items()}
    line["h200"] = H200_FIGURES
    rows.append(("wall time", f"{time.monotonic() - started:.1f} s"))
    h.report("graph_launch", rows, verdict, line if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
