"""Measure, on a real GPU with and without real MPS, the timings mpsd's model is calibrated and checked against.

Run on a machine with an NVIDIA GPU, CuPy and nvidia-cuda-mps-control, as root:

    python bench/fidelity/measure_timing.py --out bench/fidelity/h200_timing_extra.json
    python bench/fidelity/measure_timing.py --only "gaps,closed loop,1 tenant alone" \
        --out bench/fidelity/h200_timing_repeat.json      # the second run: a subset, again
    python bench/fidelity/measure_timing.py --set host-switch \
        --out bench/fidelity/h200_timing_host.json        # third and fourth runs (h200_timing_host2.json)
    python bench/fidelity/measure_timing.py --set slices --out bench/fidelity/h200_timing_slices.json
    python bench/fidelity/measure_timing.py --set bandwidth --out bench/fidelity/h200_bandwidth.json
    python bench/fidelity/measure_timing.py --set copies --out bench/fidelity/h200_copies.json
    python bench/fidelity/measure_timing.py --set copy-sharing --out bench/fidelity/h200_copies2.json
    python bench/fidelity/measure_timing.py --set copy-duplex --out bench/fidelity/h200_copies3.json
    python bench/fidelity/measure_timing.py --set copy-streams --out bench/fidelity/h200_copies4.json

It extends the team's reference (h200_timing.json) with what the model needs besides: the host's launch and
synchronise latency for a tiny kernel alone (what calibrates ``DeviceSpec.launch_latency`` and
``sync_latency``), the latency of longer kernels alone and beside a saturating tenant (what the model must
predict from that calibration), active thread percentages, grid sizes either side of a wave boundary, mixed
kernel durations, and time-slicing between two or three processes with small and large kernels. The
host-switch set measures the host's latency against the idle time before a launch, launch calls back to
back, and time-slicing as timelines: every kernel's span on the GPU's globaltimer, in every process.

Shape: every tenant is its own process (as real MPS clients are), started from the ``WORKER`` program below
with its steps as JSON, warmed up, then released by the parent at one CLOCK_MONOTONIC instant (shared by all
processes of one machine). Single-process experiments run their steps in one process to save start-up time.
Everything without MPS runs first (no pipe directory in the environment, so the GPU is time-sliced between
contexts); then one MPS control daemon on private pipe and log directories serves every MPS experiment. The
results are written after each experiment, so a run cut short still leaves what it measured.

The kernels are the model's built-ins (``mpsd.sim.costs``): ``spin(cycles)`` busy-waits on clock64 per block,
``work(iters)`` is a dependent FMA chain per thread, whose iterations are calibrated here so that one full wave
of 264 blocks x 1024 threads takes 1 ms; a step names ``work`` by the model's iterations (93,638 per such
millisecond) and the real count is scaled from the calibration.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

from _mps import private_mps  # this folder: the script's sys.path[0]

WORKER = r"""
import json, math, sys, time
import numpy
import cupy

SOURCE = '''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
extern "C" __global__ void work(int iters, float *sink) {
    float a = threadIdx.x * 1e-3f;
    for (int i = 0; i < iters; ++i) a = fmaf(a, 0.9999f, 1e-4f);
    if (a == -1.0f) sink[0] = a;
}
extern "C" __global__ void gaps(long long duration_ns, long long threshold_ns, unsigned long long *log, int cap) {
    unsigned long long t0, prev, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    prev = t0;
    int n = 0;
    bool rec = blockIdx.x == 0 && threadIdx.x == 0;
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (rec && now - prev > threshold_ns && n < cap) {
            log[2 * n + 1] = prev - t0; log[2 * n + 2] = now - prev; n++;
        }
        prev = now;
    } while (now - t0 < duration_ns);
    if (rec) log[0] = n;
}
extern "C" __global__ void spin_log(long long cycles, unsigned long long *log, int i) {
    // spin, and widen log[2i], log[2i+1] to this block's [start, end] on the GPU-wide globaltimer
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (threadIdx.x == 0) atomicMin(&log[2 * i], t);
    long long start = clock64();
    while (clock64() - start < cycles) { }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (threadIdx.x == 0) atomicMax(&log[2 * i + 1], t);
}
extern "C" __global__ void vadd(const float *a, const float *b, float *c, long long n) {
    // c = a + b over n floats, grid-stride: 12 bytes of DRAM traffic an element, whatever the grid
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        c[i] = a[i] + b[i];
}
extern "C" __global__ void stamp(unsigned long long *out) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[0] = t;
}
'''
steps = json.loads(sys.argv[1])
module = cupy.RawModule(code=SOURCE)
fns = {name: module.get_function(name) for name in ("spin", "work", "stamp", "gaps", "spin_log", "vadd")}
sink = cupy.zeros(1, dtype=cupy.float32)
stamps = cupy.zeros(1, dtype=cupy.uint64)
stream = cupy.cuda.Stream(non_blocking=True)
stream.use()


arrays = {}


def buffers(n):
    if n not in arrays:
        arrays[n] = [cupy.ones(n, dtype=cupy.float32) for _ in range(3)]
    return arrays[n]


copy_buffers = {}
KINDS = {"h2d": 1, "d2h": 2, "d2d": 3}


def copy_args(c):
    # (dst, src) pointers for a copy of c["nbytes"] bytes of kind c["copy"]: pinned host memory unless
    # c["pageable"]; made once, before the release.
    key = (c["copy"], c["nbytes"], c.get("pageable", False))
    if key not in copy_buffers:
        n = c["nbytes"]
        dev = cupy.zeros(n, dtype=cupy.uint8)
        if c["copy"] == "memset":
            copy_buffers[key] = (dev, dev.data.ptr, None)
        elif c["copy"] == "d2d":
            other = cupy.zeros(n, dtype=cupy.uint8)
            copy_buffers[key] = (dev, other, dev.data.ptr, other.data.ptr)
        else:
            host = numpy.zeros(n, dtype=numpy.uint8) if c.get("pageable") else numpy.frombuffer(
                cupy.cuda.alloc_pinned_memory(n), dtype=numpy.uint8, count=n)
            hp = host.ctypes.data
            copy_buffers[key] = (dev, host) + ((dev.data.ptr, hp) if c["copy"] == "h2d" else (hp, dev.data.ptr))
    return copy_buffers[key][-2:]


def copy(c):
    dst, src = copy_args(c)
    if c["copy"] == "memset":
        cupy.cuda.runtime.memsetAsync(dst, 0, c["nbytes"], stream.ptr)
    else:
        cupy.cuda.runtime.memcpyAsync(dst, src, c["nbytes"], KINDS[c["copy"]], stream.ptr)


def launch(k):
    if "copy" in k:
        copy(k)
        return
    if k["kernel"] == "spin":
        args = (numpy.int64(k["arg"]),)
    elif k["kernel"] == "work":
        args = (numpy.int32(k["arg"]), sink)
    elif k["kernel"] == "vadd":
        args = (*buffers(int(k["arg"])), numpy.int64(k["arg"]))
    else:
        args = (stamps,)
    fns[k["kernel"]]((k["grid"],), (k["block"],), args)


def pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summary(ms):
    return {"p50": pct(ms, 0.5), "p99": pct(ms, 0.99), "mean": sum(ms) / len(ms), "min": min(ms), "max": max(ms),
            "n": len(ms)}


def event_ms(kernels, repeat):
    a, b = cupy.cuda.Event(), cupy.cuda.Event()
    a.record()
    for _ in range(repeat):
        for k in kernels:
            launch(k)
    b.record()
    b.synchronize()
    return cupy.cuda.get_elapsed_time(a, b)


def wait_until(t):
    while True:
        left = t - time.monotonic()
        if left <= 0:
            return
        if left > 0.0005:
            time.sleep(left - 0.0004)


def run_step(step, go):
    mode = step["mode"]
    if mode == "batch":
        wait_until(go + step.get("delay", 0.0))
        t0 = time.monotonic()
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        for _ in range(step["repeat"]):
            for k in step["kernels"]:
                launch(k)
        b.record()
        stream.synchronize()
        t1 = time.monotonic()
        return {"seconds": t1 - t0, "gpu_seconds": cupy.cuda.get_elapsed_time(a, b) / 1e3,
                "started": t0 - go, "ended": t1 - go}
    if mode == "probe":
        # Launch, synchronise, then sleep (closed loop) or wait for the next tick (open loop, fixed period).
        k = step["kernel"]
        wait_until(go + step.get("delay", 0.0))
        base = time.monotonic()
        lat, call, at = [], [], []
        for i in range(step["samples"]):
            if "period" in step:
                wait_until(base + i * step["period"])
            t0 = time.monotonic()
            launch(k)
            t1 = time.monotonic()
            stream.synchronize()
            t2 = time.monotonic()
            lat.append((t2 - t0) * 1e3)
            call.append((t1 - t0) * 1e3)
            at.append(t0 - go)
            if "sleep" in step:
                time.sleep(step["sleep"])
            if "idle" in step:  # busy-wait: the host thread stays awake, only the GPU idles
                wait_until(time.monotonic() + step["idle"])
        out = {"latency_ms": summary(lat), "launch_call_ms": summary(call), "samples_ms": lat,
               "launched_at_s": at, "ended": time.monotonic() - go}
        if step.get("device_time"):
            dev = [event_ms([k], 1) for _ in range(50)]
            out["device_ms"] = summary(dev)
        return out
    if mode == "saturate":
        # Back-to-back kernels with at most `depth` queued, until `duration` after the release.
        k, depth = step["kernel"], step.get("depth", 4)
        events, n = [], 0
        while time.monotonic() < go + step["duration"]:
            launch(k)
            e = cupy.cuda.Event(disable_timing=True)
            e.record()
            events.append(e)
            n += 1
            if len(events) > depth:
                events.pop(0).synchronize()
        stream.synchronize()
        return {"kernels": n, "ended": time.monotonic() - go}
    if mode == "stamp":
        # Split launch-to-start and start-to-return with the GPU's globaltimer against the host's
        # CLOCK_REALTIME; meaningful only if the driver keeps the two in step (checked by the caller).
        k = {"kernel": "stamp", "grid": 1, "block": 1}
        before, after = [], []
        for _ in range(step["samples"]):
            h0 = time.time_ns()
            launch(k)
            stream.synchronize()
            h2 = time.time_ns()
            g = int(stamps.get()[0])
            before.append((g - h0) / 1e6)
            after.append((h2 - g) / 1e6)
            time.sleep(step.get("sleep", 0.0))
        return {"launch_to_start_ms": summary(before), "start_to_return_ms": summary(after)}
    if mode == "overhead":
        # Device time per kernel, back to back on one stream (CUDA events around the lot).
        k = step["kernel"]
        event_ms([k], 10)
        return {"ms_per_kernel": event_ms([k], step["repeat"]) / step["repeat"]}
    if mode == "clock":
        # SM cycles per second: one block spinning a known number of cycles, timed with events.
        k = {"kernel": "spin", "grid": step.get("grid", 1), "block": 1024, "arg": step["cycles"]}
        ms = [event_ms([k], 1) for _ in range(3)]
        return {"hz": step["cycles"] / (min(ms) / 1e3), "ms": ms}
    if mode == "gaps":
        # One kernel that watches globaltimer in every thread; block 0 logs each jump longer than the
        # threshold: the time its context was switched out (time-slicing), as (offset, length) in ms.
        cap = 2000
        log = cupy.zeros(2 * cap + 1, dtype=cupy.uint64)
        t0 = time.monotonic()
        fns["gaps"]((step["grid"],), (1024,), (numpy.int64(step["duration_ms"] * 1e6),
                                                 numpy.int64(step["threshold_us"] * 1e3), log, numpy.int32(cap)))
        stream.synchronize()
        t1 = time.monotonic()
        host = log.get()
        n = int(host[0])
        pairs = [[int(host[2 * i + 1]) / 1e6, int(host[2 * i + 2]) / 1e6] for i in range(n)]
        return {"seconds": t1 - t0, "started": t0 - go, "ended": t1 - go, "gaps_ms": pairs}
    if mode == "issue":
        # Back-to-back launches with nothing else to do: host time per launch call, device time per kernel.
        k, n = step["kernel"], step["repeat"]
        event_ms([k], 10)
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        t0 = time.perf_counter()
        for _ in range(n):
            launch(k)
        t1 = time.perf_counter()
        b.record()
        b.synchronize()
        return {"host_us_per_call": (t1 - t0) * 1e6 / n, "ms_per_kernel": cupy.cuda.get_elapsed_time(a, b) / n}
    if mode == "timeline":
        # Kernels back to back, each widening [first block's start, last block's end] on globaltimer, which
        # every context of the device shares: the processes' timelines can be laid side by side.
        ks, n = step["kernels"], step["repeat"] * len(step["kernels"])
        log = cupy.zeros(2 * n, dtype=cupy.uint64)
        log[0::2] = numpy.uint64(2**64 - 1)
        stream.synchronize()
        t0 = time.monotonic()
        for i in range(n):
            k = ks[i % len(ks)]
            fns["spin_log"]((k["grid"],), (k["block"],), (numpy.int64(k["arg"]), log, numpy.int32(i)))
        stream.synchronize()
        t1 = time.monotonic()
        return {"seconds": t1 - t0, "started": t0 - go, "ended": t1 - go, "kernels_ns": log.get().tolist()}
    if mode == "calibrate_work":
        out = {}
        for iters in step["iters"]:
            k = {"kernel": "work", "grid": step["grid"], "block": 1024, "arg": iters}
            event_ms([k], 2)
            out[str(iters)] = min(event_ms([k], 1) for _ in range(5))
        return {"ms": out}
    raise ValueError(mode)


for step in steps:                         # warm up every kernel this process will launch
    for k in step.get("kernels", [step.get("kernel")]):
        if k and "copy" in k:
            launch(k)  # its buffers, before the release
        elif k:
            launch(dict(k, arg=min(int(k["arg"]), 1000), grid=1))
            if k["kernel"] == "vadd":  # its arrays, before the release
                buffers(int(k["arg"]))
launch({"kernel": "stamp", "grid": 1, "block": 1})
scratch = cupy.zeros(2, dtype=cupy.uint64)
fns["spin_log"]((1,), (32,), (numpy.int64(0), scratch, numpy.int32(0)))
stream.synchronize()
print("ready", flush=True)
go = float(sys.stdin.readline())
wait_until(go)
results = []
for step in steps:
    results.append(run_step(step, go))
print(json.dumps(results), flush=True)
"""

MS = 1.98e6                  # spin cycles per millisecond at the model's 1.98 GHz (mpsd.sim.specs.H200.clock_hz)
MODEL_WORK_ITERS = 93638     # the model's `work` iterations for one 1-ms FULL wave
FULL, QUARTER = 264, 66


def spin(ms: float, grid: int = FULL, block: int = 1024) -> dict:
    return {"kernel": "spin", "grid": grid, "block": block, "arg": int(ms * MS)}


def work(model_iters: int, grid: int = FULL) -> dict:
    # `arg` is filled in from the calibration; `model_iters` is what compare.py gives the model.
    return {"kernel": "work", "grid": grid, "block": 1024, "model_iters": int(model_iters)}


EMPTY = {"kernel": "spin", "grid": 1, "block": 32, "arg": 0}
PROBE = spin(0.1, grid=8)


def batch(name: str, kernels: list[dict], repeat: int) -> dict:
    return {"mode": "batch", "name": name, "kernels": kernels, "repeat": repeat}


def single_steps() -> list[dict]:
    """One process alone, both modes: host latency, clock, overheads, latency alone, grids, mixed durations."""
    return [
        {"mode": "clock", "name": "clock, 1 block", "cycles": int(200 * MS)},
        {"mode": "clock", "name": "clock, full wave", "cycles": int(20 * MS), "grid": FULL},
        {"mode": "overhead", "name": "empty kernel back to back", "kernel": EMPTY, "repeat": 2000},
        {"mode": "overhead", "name": "FULL 1-ms spin back to back", "kernel": spin(1.0), "repeat": 50},
        {"mode": "probe", "name": "empty kernel, sleep 5 ms", "kernel": EMPTY, "samples": 300, "sleep": 0.005},
        {"mode": "probe", "name": "empty kernel, back to back", "kernel": EMPTY, "samples": 1000},
        {"mode": "stamp", "name": "globaltimer split", "samples": 200, "sleep": 0.005},
        *[{"mode": "probe", "name": f"8 x {ms} ms spin, sleep 5 ms", "kernel": spin(ms, grid=8), "samples": 200,
           "sleep": 0.005, "device_time": True} for ms in (0.01, 0.1, 1.0)],
        {"mode": "probe", "name": "FULL 0.1 ms spin, sleep 5 ms", "kernel": spin(0.1), "samples": 200,
         "sleep": 0.005, "device_time": True},
        batch("100 x FULL spin 1 ms", [spin(1.0)], 100),
        *[batch(f"20 x {g} blocks spin 1 ms", [spin(1.0, grid=g)], 20) for g in (132, 263, 264, 265, 396, 528, 529)],
        *[batch(f"20 x {g} blocks of 256 spin 1 ms", [spin(1.0, grid=g, block=256)], 20) for g in (1056, 1057)],
        batch("100 x FULL spin 0.05 ms", [spin(0.05)], 100),
        batch("50 x FULL spin 0.2 ms", [spin(0.2)], 50),
        batch("10 x FULL spin 2 ms", [spin(2.0)], 10),
        batch("50 x (FULL 0.05 ms + QUARTER 1 ms) spin", [spin(0.05), spin(1.0, grid=QUARTER)], 50),
        batch("100 x FULL work 1 ms", [work(MODEL_WORK_ITERS)], 100),
        batch("200 x QUARTER work 0.1 ms-wave", [work(MODEL_WORK_ITERS // 10, grid=QUARTER)], 200),
    ]


def tenants_batch(name: str, kernels: list[list[dict]], repeats: list[int], envs: list[dict] | None = None) -> dict:
    envs = envs or [{}] * len(kernels)
    return {"name": name, "tenants": [{"env": e, "steps": [batch(name, ks, r)]}
                                      for ks, r, e in zip(kernels, repeats, envs)]}


def multi_experiments(mps: bool) -> list[dict]:
    """Several processes released together: time-slicing (or MPS sharing) with small and large kernels."""
    w1 = work(MODEL_WORK_ITERS)
    out = [
        tenants_batch("2 tenants, 100 x FULL work 1 ms each", [[w1]] * 2, [100] * 2),
        tenants_batch("3 tenants, 100 x FULL work 1 ms each", [[w1]] * 3, [100] * 3),
        tenants_batch("2 tenants, 200 x QUARTER work 0.1 ms-wave each",
                      [[work(MODEL_WORK_ITERS // 10, grid=QUARTER)]] * 2, [200] * 2),
        tenants_batch("2 tenants, 5 x FULL work 20 ms each", [[work(20 * MODEL_WORK_ITERS)]] * 2, [5] * 2),
        tenants_batch("2 tenants, FULL work 1 ms x 100 beside QUARTER work 0.1 ms-wave x 400",
                      [[w1], [work(MODEL_WORK_ITERS // 10, grid=QUARTER)]], [100, 400]),
    ]
    if mps:
        out += [
            tenants_batch("2 tenants, 100 x FULL spin 1 ms each", [[spin(1.0)]] * 2, [100] * 2),
            tenants_batch("2 tenants, FULL spin 1 ms x 100 beside QUARTER spin 0.25 ms x 400",
                          [[spin(1.0)], [spin(0.25, grid=QUARTER)]], [100, 400]),
            tenants_batch("2 tenants, 20 x FULL spin 1 ms, ATP 25 and 75", [[spin(1.0)]] * 2, [20] * 2,
                          [{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"}]),
            tenants_batch("3 tenants, 20 x FULL spin 1 ms, ATP 33 each", [[spin(1.0)]] * 3, [20] * 3,
                          [{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "33"}] * 3),
        ]
        for atp in (10, 25, 33, 50, 75):
            out.append({"name": f"1 tenant, ATP {atp}", "tenants": [{
                "env": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(atp)},
                "steps": [batch(f"20 x FULL spin 1 ms, ATP {atp}", [spin(1.0)], 20),
                          batch(f"20 x QUARTER spin 1 ms, ATP {atp}", [spin(1.0, grid=QUARTER)], 20)]}]})
    return out


def gaps_experiments() -> list[dict]:
    """Time-slicing seen from inside: 1, 2 and 3 processes each run one 100-ms full-GPU kernel that logs the
    globaltimer jumps of its first block (the time its context was switched out)."""
    step = {"mode": "gaps", "grid": FULL, "duration_ms": 100, "threshold_us": 5}
    return [{"name": f"gaps, {n} tenants, one 100-ms FULL kernel each",
             "tenants": [{"env": {}, "steps": [dict(step, name="gaps")]} for _ in range(n)]} for n in (1, 2, 3)]


def slices_experiments() -> list[dict]:
    """What a context switch costs against what the contexts hold: 2 processes each run one 200-ms kernel of
    1, 8, 66, 132 or 264 blocks of 1024 threads that logs its globaltimer jumps (as ``gaps_experiments``), a
    264-block one beside a 1-block one, and 3 processes of 1 block."""
    def step(grid: int) -> dict:
        return {"mode": "gaps", "grid": grid, "duration_ms": 200, "threshold_us": 5, "name": f"gaps, grid {grid}"}

    def tenants(*grids: int) -> list[dict]:
        return [{"env": {}, "steps": [step(g)]} for g in grids]

    return ([{"name": f"slices, 2 tenants, one 200-ms {g}-block kernel each", "tenants": tenants(g, g)}
             for g in (1, 8, QUARTER, 132, FULL)]
            + [{"name": f"slices, a 200-ms {FULL}-block kernel beside a 1-block one", "tenants": tenants(FULL, 1)},
               {"name": "slices, 3 tenants, one 200-ms 1-block kernel each", "tenants": tenants(1, 1, 1)}])


def vadd(n: int, grid: int, block: int = 1024) -> dict:
    return {"kernel": "vadd", "grid": grid, "block": block, "arg": n}


BIG, SMALL = 64 << 20, 16 << 20  # floats: 768 and 192 MB of traffic a launch


def bandwidth_experiments(mps: bool) -> list[dict]:
    """DRAM bandwidth as a shared resource: one process's c = a + b against how many blocks (and, under MPS,
    how large an active thread percentage) it runs on; then two processes side by side, and one beside a
    compute-bound neighbour."""
    out = [{"name": "1 tenant alone", "tenants": [{"env": {}, "steps": [
        batch(f"20 x vadd {n >> 20}M, {g} x {b}", [vadd(n, g, b)], 20)
        for b, grids in ((1024, (1, 2, 4, 8, 16, 33, 66, 132, 264, 1056)), (256, (4, 66, 264, 1056)))
        for g in grids for n in [BIG if g >= 33 else SMALL]]}]}]
    many = vadd(BIG, 1056)
    if mps:
        for atp in (10, 25, 50):
            env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(atp)}
            out.append({"name": f"1 tenant, ATP {atp}", "tenants": [{"env": env, "steps": [
                batch(f"20 x vadd 64M, 1056 x 1024, ATP {atp}", [many], 20)]}]})
        half = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
        out.append({"name": "2 x vadd, ATP 50 each", "tenants": [
            {"env": half, "steps": [batch("50 x vadd 64M, 1056 x 1024", [many], 50)]} for _ in range(2)]})
    out.append({"name": "2 x vadd", "tenants": [
        {"env": {}, "steps": [batch("50 x vadd 64M, 1056 x 1024", [many], 50)]} for _ in range(2)]})
    out.append({"name": "vadd beside FULL spin 1 ms", "tenants": [
        {"env": {}, "steps": [batch("50 x vadd 64M, 1056 x 1024", [many], 50)]},
        {"env": {}, "steps": [batch("20 x FULL spin 1 ms", [spin(1.0)], 20)]}]})
    return out


def memcpy(kind: str, nbytes: int, pageable: bool = False) -> dict:
    return {"copy": kind, "nbytes": nbytes, **({"pageable": True} if pageable else {})}


def copy_experiments(mps: bool) -> list[dict]:
    """Copies: time per cudaMemcpyAsync by kind and size alone (pinned host memory; one pageable size), then
    two processes copying at once, a small copy's latency beside a stream of large ones, the two directions
    together, and a device-to-device copy beside a memory-bound kernel."""
    sizes = ((4 << 10, 200), (64 << 10, 200), (1 << 20, 100), (16 << 20, 20), (256 << 20, 10))
    alone = [batch(f"{r} x {kind} {n >> 10} KiB", [memcpy(kind, n)], r) for kind in ("h2d", "d2h", "d2d")
             for n, r in sizes]
    alone.append(batch("20 x h2d 16384 KiB pageable", [memcpy("h2d", 16 << 20, pageable=True)], 20))
    big = memcpy("h2d", 256 << 20)
    probe = {"mode": "probe", "kernel": memcpy("h2d", 64 << 10), "samples": 100, "sleep": 0.001, "delay": 0.05,
             "name": "h2d 64 KiB probe"}
    return [{"name": "1 tenant alone", "tenants": [{"env": {}, "steps": alone}]},
            {"name": "2 x h2d 256 MiB", "tenants": [
                {"env": {}, "steps": [batch("20 x h2d 262144 KiB", [big], 20)]} for _ in range(2)]},
            {"name": "h2d 64 KiB probe beside h2d 256 MiB", "tenants": [
                {"env": {}, "steps": [probe]}, {"env": {}, "steps": [batch("60 x h2d 262144 KiB", [big], 60)]}]},
            {"name": "h2d beside d2h, 256 MiB", "tenants": [
                {"env": {}, "steps": [batch("20 x h2d 262144 KiB", [big], 20)]},
                {"env": {}, "steps": [batch("20 x d2h 262144 KiB", [memcpy("d2h", 256 << 20)], 20)]}]},
            {"name": "d2d 256 MiB beside vadd", "tenants": [
                {"env": {}, "steps": [batch("40 x d2d 262144 KiB", [memcpy("d2d", 256 << 20)], 40)]},
                {"env": {}, "steps": [batch("50 x vadd 64M, 1056 x 1024", [vadd(BIG, 1056)], 50)]}]}]


def copy_sharing_experiments(mps: bool) -> list[dict]:
    """What run 7 left open. Host time per copy call; memset and pageable copies by size; whether a
    device-to-device copy or a memset is a kernel (its bandwidth under an active thread percentage, beside a
    full-GPU spin, beside another); and how one copy engine is shared: a small copy's latency beside a stream
    of large ones, against the probe's sleep (run 7 slept 1 ms only), and the other kinds beside that stream."""
    alone = [{"mode": "issue", "name": f"issue: {kind} 4 KiB", "kernel": memcpy(kind, 4 << 10), "repeat": 500}
             for kind in ("h2d", "d2h", "d2d", "memset")]
    alone += [batch(f"{r} x memset {n >> 10} KiB", [memcpy("memset", n)], r)
              for n, r in ((4 << 10, 200), (1 << 20, 100), (16 << 20, 20), (64 << 20, 20), (256 << 20, 10))]
    alone += [batch(f"20 x d2d {64 << 10} KiB", [memcpy("d2d", 64 << 20)], 20)]
    alone += [batch(f"{r} x {kind} {n >> 10} KiB pageable", [memcpy(kind, n, pageable=True)], r)
              for kind in ("h2d", "d2h") for n, r in ((64 << 10, 100), (1 << 20, 50), (16 << 20, 10), (256 << 20, 4))]
    out = [{"name": "1 tenant alone", "tenants": [{"env": {}, "steps": alone}]}]
    d2d, fill = memcpy("d2d", 256 << 20), memcpy("memset", 256 << 20)
    if mps:
        for atp in (10, 25, 50):
            env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(atp)}
            out.append({"name": f"1 tenant, ATP {atp}", "tenants": [{"env": env, "steps": [
                batch(f"40 x d2d 262144 KiB, ATP {atp}", [d2d], 40),
                batch(f"40 x memset 262144 KiB, ATP {atp}", [fill], 40)]}]})
    saturate = {"mode": "saturate", "name": "saturating", "kernel": spin(1.0), "duration": 0.3}
    out += [{"name": "d2d 256 MiB beside FULL spin", "tenants": [
                {"env": {}, "steps": [dict(batch("40 x d2d 262144 KiB", [d2d], 40), delay=0.05)]},
                {"env": {}, "steps": [saturate]}]},
            {"name": "memset 256 MiB beside FULL spin", "tenants": [
                {"env": {}, "steps": [dict(batch("40 x memset 262144 KiB", [fill], 40), delay=0.05)]},
                {"env": {}, "steps": [saturate]}]},
            {"name": "2 x d2d 256 MiB", "tenants": [
                {"env": {}, "steps": [batch("40 x d2d 262144 KiB", [d2d], 40)]} for _ in range(2)]}]
    big = memcpy("h2d", 256 << 20)
    for sleep in (0.0, 0.25, 0.5, 2.0, 3.0):
        probe = {"mode": "probe", "kernel": memcpy("h2d", 64 << 10), "samples": 100, "sleep": sleep / 1e3,
                 "delay": 0.05, "name": f"h2d 64 KiB probe, sleep {sleep} ms"}
        out.append({"name": f"h2d 64 KiB probe, sleep {sleep} ms, beside h2d 256 MiB", "tenants": [
            {"env": {}, "steps": [probe]}, {"env": {}, "steps": [batch("120 x h2d 262144 KiB", [big], 120)]}]})
    for kind, stream_kind, n in (("d2h", "h2d", 120), ("h2d", "d2d", 2000), ("d2d", "d2d", 2000)):
        probe = {"mode": "probe", "kernel": memcpy(kind, 64 << 10), "samples": 100, "sleep": 0.0005, "delay": 0.05,
                 "name": f"{kind} 64 KiB probe, sleep 0.5 ms"}
        out.append({"name": f"{kind} 64 KiB probe, sleep 0.5 ms, beside {stream_kind} 256 MiB", "tenants": [
            {"env": {}, "steps": [probe]},
            {"env": {}, "steps": [batch(f"{n} x {stream_kind} 262144 KiB", [memcpy(stream_kind, 256 << 20)], n)]}]})
    return out


def copy_duplex_experiments(mps: bool) -> list[dict]:
    """What run 8 left open: copies in both directions at once (again, with other sizes, and overlapping in
    part), a copy engine shared by three streams, the other direction's engine sliced the same way, PCIe
    copies beside a memory-bound kernel, and pageable copies again."""
    h2d, d2h = memcpy("h2d", 256 << 20), memcpy("d2h", 256 << 20)
    alone = [batch(f"10 x {kind} 16384 KiB pageable", [memcpy(kind, 16 << 20, pageable=True)], 10)
             for kind in ("h2d", "d2h")]

    def probe(kind: str, sleep_ms: float) -> dict:
        return {"mode": "probe", "kernel": memcpy(kind, 64 << 10), "samples": 100, "sleep": sleep_ms / 1e3,
                "delay": 0.05, "name": f"{kind} 64 KiB probe, sleep {sleep_ms} ms"}

    return [{"name": "1 tenant alone", "tenants": [{"env": {}, "steps": alone}]},
            {"name": "h2d beside d2h, 256 MiB", "tenants": [
                {"env": {}, "steps": [batch("20 x h2d 262144 KiB", [h2d], 20)]},
                {"env": {}, "steps": [batch("20 x d2h 262144 KiB", [d2h], 20)]}]},
            {"name": "h2d 64 MiB beside d2h 256 MiB", "tenants": [
                {"env": {}, "steps": [batch("80 x h2d 65536 KiB", [memcpy("h2d", 64 << 20)], 80)]},
                {"env": {}, "steps": [batch("20 x d2h 262144 KiB", [d2h], 20)]}]},
            {"name": "h2d beside d2h from 30 ms on", "tenants": [
                {"env": {}, "steps": [batch("20 x h2d 262144 KiB", [h2d], 20)]},
                {"env": {}, "steps": [dict(batch("10 x d2h 262144 KiB", [d2h], 10), delay=0.03)]}]},
            {"name": "3 x h2d 256 MiB", "tenants": [
                {"env": {}, "steps": [batch("20 x h2d 262144 KiB", [h2d], 20)]} for _ in range(3)]},
            {"name": "h2d 64 KiB probe, sleep 0.5 ms, beside 2 x h2d 256 MiB", "tenants": [
                {"env": {}, "steps": [probe("h2d", 0.5)]},
                *[{"env": {}, "steps": [batch("120 x h2d 262144 KiB", [h2d], 120)]} for _ in range(2)]]},
            {"name": "d2h 64 KiB probe, sleep 0.25 ms, beside d2h 256 MiB", "tenants": [
                {"env": {}, "steps": [probe("d2h", 0.25)]},
                {"env": {}, "steps": [batch("120 x d2h 262144 KiB", [d2h], 120)]}]},
            {"name": "h2d 256 MiB beside vadd", "tenants": [
                {"env": {}, "steps": [batch("20 x h2d 262144 KiB", [h2d], 20)]},
                {"env": {}, "steps": [batch("200 x vadd 64M, 1056 x 1024", [vadd(BIG, 1056)], 200)]}]}]


def copy_streams_experiments(mps: bool) -> list[dict]:
    """What run 9 left open: why three streams of large copies on one engine lost bandwidth that two did not.
    Two and three streams again, on one lease; two beside an idle third process (its copies warmed up, none
    during the run); two beside a third's small copies back to back; one beside two streams of small copies."""
    big = memcpy("h2d", 256 << 20)

    def stream(n: int = 20) -> dict:
        return {"env": {}, "steps": [batch(f"{n} x h2d 262144 KiB", [big], n)]}

    def probe(sleep_ms: float, delay: float = 0.05) -> dict:
        return {"env": {}, "steps": [{"mode": "probe", "kernel": memcpy("h2d", 64 << 10), "samples": 100,
                                      "sleep": sleep_ms / 1e3, "delay": delay,
                                      "name": f"h2d 64 KiB probe, sleep {sleep_ms} ms"}]}

    return [{"name": "2 x h2d 256 MiB", "tenants": [stream(), stream()]},
            {"name": "3 x h2d 256 MiB", "tenants": [stream(), stream(), stream()]},
            {"name": "2 x h2d 256 MiB beside an idle third", "tenants": [stream(), stream(), probe(0.0, delay=0.5)]},
            {"name": "2 x h2d 256 MiB beside a 64 KiB probe back to back", "tenants": [stream(), stream(), probe(0.0)]},
            {"name": "h2d 256 MiB beside two 64 KiB probes, sleep 0.5 ms", "tenants": [
                stream(60), probe(0.5), probe(0.5)]}]


def latency_experiments(mps: bool) -> list[dict]:
    """The 8 x 0.1 ms probe beside a tenant saturating the GPU with back-to-back FULL 1-ms kernels."""
    closed = {"mode": "probe", "kernel": PROBE, "samples": 200, "sleep": 0.005, "delay": 0.05}
    opened = {"mode": "probe", "kernel": PROBE, "samples": 200, "period": 0.0053, "delay": 0.05}
    out = []
    loads = [("spin", spin(1.0))] + ([] if mps else [("work", work(MODEL_WORK_ITERS))])
    for load_name, load in loads:
        for loop_name, probe in (("closed loop, sleep 5 ms", closed), ("open loop, period 5.3 ms", opened)):
            name = f"probe beside FULL 1-ms {load_name}, {loop_name}"
            out.append({"name": name, "tenants": [
                {"env": {}, "steps": [dict(probe, name=name)]},
                {"env": {}, "steps": [{"mode": "saturate", "name": "saturating", "kernel": load, "duration": 1.6}]}]})
    if mps:
        name = "probe beside FULL 1-ms spin at CLIENT_PRIORITY 1, closed loop, sleep 5 ms"
        out.append({"name": name, "tenants": [
            {"env": {}, "steps": [dict(closed, name=name)]},
            {"env": {"CUDA_MPS_CLIENT_PRIORITY": "1"},
             "steps": [{"mode": "saturate", "name": "saturating", "kernel": spin(1.0), "duration": 1.6}]}]})
    return out


def host_steps() -> list[dict]:
    """One process alone, both modes: what a launch costs the host, and how its latency grows with idle time.

    The model had one host latency, measured after a 5-ms sleep; back to back the same launch and synchronise
    took a fifth of it. Here the idle time before each launch varies, spent busy (the thread stays on its CPU,
    only the GPU idles) or asleep (the thread is descheduled too), and launch calls are timed back to back
    beside the device's time per kernel for kernels shorter and longer than a launch call."""
    out = [{"mode": "probe", "name": f"empty kernel, busy {us} us", "kernel": EMPTY, "samples": 300,
            "idle": us / 1e6} for us in (20, 100, 300, 1000, 3000)]
    out += [{"mode": "probe", "name": f"empty kernel, sleep {ms} ms", "kernel": EMPTY, "samples": 300,
             "sleep": ms / 1e3} for ms in (0.1, 0.3, 1, 2, 5)]
    out += [{"mode": "probe", "name": "empty kernel, back to back", "kernel": EMPTY, "samples": 1000},
            {"mode": "probe", "name": "8 x 0.1 ms spin, back to back", "kernel": PROBE, "samples": 300},
            {"mode": "probe", "name": "8 x 0.1 ms spin, busy 1000 us", "kernel": PROBE, "samples": 300,
             "idle": 1e-3}]
    out += [{"mode": "issue", "name": f"issue: 1-block spin {us} us", "kernel": spin(us / 1e3, grid=1, block=32),
             "repeat": 2000} for us in (0, 2, 5, 10, 20)]
    out.append({"mode": "issue", "name": "issue: FULL spin 5 us", "kernel": spin(0.005), "repeat": 2000})
    return out


def timeline(name: str, kernels: list[dict], repeat: int) -> dict:
    return {"mode": "timeline", "name": name, "kernels": kernels, "repeat": repeat}


def switch_experiments(mps: bool) -> list[dict]:
    """Two or three processes with back-to-back spins, every kernel's span logged on the GPU's globaltimer:
    where time-slicing switches contexts (mid-kernel or between kernels), how long a switch leaves the GPU
    idle, and whether that depends on the kernels' length or on how many SMs they hold. With MPS, the same
    runs show the two processes' kernels side by side."""
    def pair(name: str, a: tuple[list[dict], int], b: tuple[list[dict], int] | None = None, n: int = 2) -> dict:
        b = b or a
        tenants = [a, b] + [a] * (n - 2)
        return {"name": f"timeline, {name}", "tenants": [{"env": {}, "steps": [timeline(name, ks, r)]}
                                                         for ks, r in tenants]}
    out = [
        pair("2 x FULL spin 0.05 ms x 400", ([spin(0.05)], 400)),
        pair("2 x QUARTER spin 0.05 ms x 400", ([spin(0.05, grid=QUARTER)], 400)),
        pair("2 x FULL spin 1 ms x 40", ([spin(1.0)], 40)),
        pair("FULL spin 1 ms x 40 beside QUARTER spin 0.05 ms x 400", ([spin(1.0)], 40),
             ([spin(0.05, grid=QUARTER)], 400)),
    ]
    if not mps:
        out += [
            pair("2 x FULL spin 0.5 ms x 80", ([spin(0.5)], 80)),
            pair("2 x 8-block spin 0.5 ms x 80", ([spin(0.5, grid=8)], 80)),
            pair("2 x FULL spin 5 ms x 8", ([spin(5.0)], 8)),
            pair("2 x QUARTER spin 5 ms x 8", ([spin(5.0, grid=QUARTER)], 8)),
            pair("2 x 8-block spin 5 ms x 8", ([spin(5.0, grid=8)], 8)),
            pair("3 x FULL spin 0.05 ms x 400", ([spin(0.05)], 400), n=3),
        ]
    return out


def with_work_iters(obj, real_per_model: float):
    """Fill in each `work` kernel's real iteration count from the calibration."""
    if isinstance(obj, dict):
        out = {k: with_work_iters(v, real_per_model) for k, v in obj.items()}
        if out.get("kernel") == "work" and "model_iters" in out:
            out["arg"] = max(1, round(out["model_iters"] * real_per_model))
        return out
    if isinstance(obj, list):
        return [with_work_iters(v, real_per_model) for v in obj]
    return obj


def run_tenants(tenants: list[dict], base_env: dict[str, str]) -> list:
    """Start one process per tenant, wait until all are warm, release them together, collect their steps."""
    procs = []
    for t in tenants:
        env = {**os.environ, **base_env, **t["env"]}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(t["steps"])], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"worker did not start: {line!r} {p.stderr.read()[-800:]}")
        go = time.monotonic() + 0.05
        for p in procs:
            p.stdin.write(f"{go}\n")
            p.stdin.flush()
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            if p.returncode != 0:
                out.append({"error": stderr[-800:]})
            else:
                out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def device_facts() -> dict:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    query = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,compute_mode"
    smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                         text=True, check=False)
    code = "import cupy; r = cupy.cuda.runtime; print(r.runtimeGetVersion(), r.driverGetVersion(), cupy.__version__)"
    versions = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    return {"nvidia_smi": dict(zip(query.split(","), [s.strip() for s in smi.stdout.split(",")])),
            "cuda_runtime_driver_cupy": versions.stdout.split(), "python": sys.version.split()[0], "cpu": cpu,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file to write (rewritten after each experiment)")
    parser.add_argument("--only", default="",
                        help="comma-separated name fragments: run only the multi-process experiments whose names "
                             "hold one (the single-process steps are skipped)")
    parser.add_argument("--set", choices=("main", "host-switch", "slices", "bandwidth", "copies",
                                          "copy-sharing", "copy-duplex", "copy-streams"), default="main",
                        help="main: the experiments of h200_timing_extra.json; host-switch: host latency against "
                             "idle time, launch cost, and time-slicing timelines (h200_timing_host.json); slices: "
                             "context switches against the blocks resident (no MPS; h200_timing_slices.json); "
                             "bandwidth: DRAM bandwidth against blocks, SM caps and neighbours (h200_bandwidth.json); "
                             "copies: memcpy by kind and size, alone and beside others (h200_copies.json); "
                             "copy-sharing: copy calls, memsets, pageable copies, device copies as kernels, and how a "
                             "copy engine is shared (h200_copies2.json); "
                             "copy-duplex: both directions at once, three streams on one engine (h200_copies3.json); "
                             "copy-streams: two and three streams on one engine (h200_copies4.json)")
    parser.add_argument("--plan", action="store_true", help="print the experiments and exit (no GPU needed)")
    args = parser.parse_args()

    def experiments(mps: bool) -> list[dict]:
        if args.set == "copies":
            return copy_experiments(mps)
        if args.set == "copy-sharing":
            return copy_sharing_experiments(mps)
        if args.set == "copy-duplex":
            return copy_duplex_experiments(mps)
        if args.set == "copy-streams":
            return copy_streams_experiments(mps)
        if args.set == "bandwidth":
            return bandwidth_experiments(mps)
        if args.set == "slices":
            return [] if mps else slices_experiments()  # MPS does not time-slice its clients
        if args.set == "host-switch":
            return [{"name": "1 tenant alone", "tenants": [{"env": {}, "steps": host_steps()}]},
                    *switch_experiments(mps)]
        single = {"name": "1 tenant alone", "tenants": [{"env": {}, "steps": single_steps()}]}
        return chosen([single] + multi_experiments(mps) + gaps_experiments() + latency_experiments(mps))

    def chosen(es: list[dict]) -> list[dict]:
        if not args.only:
            return es
        return [e for e in es if any(f in e["name"] for f in args.only.split(","))]

    if args.plan:
        for mps in (False, True):
            for e in experiments(mps):
                print("mps" if mps else "no-mps", e["name"], [len(t["steps"]) for t in e["tenants"]])
        return
    results: dict = {"device": device_facts(), "source": "bench/fidelity/measure_timing.py", "spin_cycles_per_ms": MS,
                     "model_work_iters_per_ms": MODEL_WORK_ITERS, "full": FULL, "quarter": QUARTER,
                     "no-mps": [], "mps": []}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    started = time.monotonic()
    (cal,) = run_tenants([{"env": {}, "steps": [{"mode": "calibrate_work", "grid": FULL,
                                                 "iters": [50_000, 200_000]}]}], {})
    ms = {int(k): v for k, v in cal[0]["ms"].items()}
    slope = (ms[200_000] - ms[50_000]) / 150_000        # ms per real iteration, fixed costs cancelled
    real_per_model = (1.0 / slope) / MODEL_WORK_ITERS
    results["work_calibration"] = {"full_wave_ms": ms, "real_iters_per_ms": 1.0 / slope,
                                   "real_iters_per_model_iter": real_per_model}
    save()

    def experiment(mode: str, e: dict, env: dict) -> None:
        e = with_work_iters(e, real_per_model)
        t0 = time.monotonic()
        try:
            outcome = run_tenants(e["tenants"], env)
        except Exception as exc:  # noqa: BLE001 - keep what the other experiments measured
            outcome = [{"error": repr(exc)[:800]}]
        results[mode].append({"name": e["name"], "tenants": [
            {"env": t["env"], "steps": t["steps"], "results": r} for t, r in zip(e["tenants"], outcome)],
            "wall_s": time.monotonic() - t0})
        save()
        print(f"{mode:7} {time.monotonic() - started:6.1f}s {e['name']}", file=sys.stderr, flush=True)

    for e in experiments(False):
        experiment("no-mps", e, {})
    logs: dict[str, list[str]] = {}
    if not experiments(True):
        results["total_wall_s"] = time.monotonic() - started
        save()
        return
    try:
        with private_mps(logs, tail=30) as env:
            for e in experiments(True):
                experiment("mps", e, env)
    finally:
        for name, lines in logs.items():
            results[f"{name}_log_tail"] = lines
        results["total_wall_s"] = time.monotonic() - started
        save()


if __name__ == "__main__":
    main()
