"""One tenant of the demo: a worker process that uses the emulated GPU through mpsd_client.

    python examples/worker.py ROLE        (ROLE: inference, training, batch or background)

It reads its quotas from the environment exactly as a real MPS client does (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, CUDA_MPS_CLIENT_PRIORITY) and finds the daemon through CUDA_MPS_PIPE_DIRECTORY.

Talking to examples/demo.py on stdin/stdout, so that every tenant starts its work at the same instant:
  1. connect, do any set-up, print ``READY`` and wait for a line on stdin;
  2. do the role's work, then print one JSON line with everything measured, and exit 0
     (1 if a correctness check failed, 2 if something raised).
Times called "sim" are simulated GPU time: from CUDA events or the daemon's statistics, not the wall clock.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

import mpsd_client

MiB = 1 << 20
CLOCK_HZ = 1.98e9            # the simulated H200's SM clock: spin(1.98e6) keeps a block busy for 1 ms
THREADS = 1024               # 1024-thread blocks: two fit on an SM
FULL_WAVE = 264              # 264 such blocks fill all 132 SMs once
BLOCKS_PER_SM = 2


def spin_cycles(ms: float) -> int:
    return int(round(ms * 1e-3 * CLOCK_HZ))


class Tenant:
    """Collects what a role measured; `result()` is the JSON line the demo reads."""

    def __init__(self, role: str, ctx: mpsd_client.Context) -> None:
        self.role = role
        self.ctx = ctx
        self.checks: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []   # CUDA errors that were expected and caught
        self.info: dict[str, Any] = {}
        props = ctx.device_properties()
        free, total = ctx.mem_get_info()
        self.info.update(
            device=props["name"], multiprocessor_count=props["multiprocessor_count"],
            total_memory=props["total_memory"], mem_free=free, mem_total=total,
        )

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})

    def bulk_spin(self, kernels: int, block_ms: float, stream: Any) -> None:
        """`kernels` back-to-back full-wave spin kernels on `stream`, timed with events.

        Records the simulated time they took and the time they would take alone under this tenant's SM cap
        (whole waves of `block_ms`: a kernel's last partial wave still costs a full block time).
        """
        cap = self.ctx.quotas["sm_cap"]
        waves = math.ceil(FULL_WAVE / (BLOCKS_PER_SM * cap))
        start, end = self.ctx.create_event(), self.ctx.create_event()
        start.record(stream)
        for _ in range(kernels):
            self.ctx.launch("spin", FULL_WAVE, THREADS, [spin_cycles(block_ms)], stream=stream)
        end.record(stream)
        end.synchronize()
        self.info.update(
            bulk_kernels=kernels, bulk_block_ms=block_ms, bulk_waves=waves,
            bulk_sim_ms=start.elapsed_ms(end), bulk_alone_ms=kernels * waves * block_ms,
        )

    def result(self, wall_s: float) -> dict[str, Any]:
        return {
            "role": self.role, "pid": os.getpid(), "quotas": self.ctx.quotas, "info": self.info,
            "checks": self.checks, "errors": self.errors, "wall_s": wall_s, "stats": self.ctx.statistics(),
        }


# --- the roles -----------------------------------------------------------------------------------------------

def inference_setup(t: Tenant) -> None:
    """Latency probes while the other tenants are connected but idle: the 'alone' baseline."""
    _least, greatest = t.ctx.stream_priority_range()
    t.stream = t.ctx.create_stream(priority=greatest)
    t.info["stream_priority"] = greatest
    t.probe_events = (t.ctx.create_event(), t.ctx.create_event())
    for _ in range(3):
        probe(t)  # warm up
    t.info["latency_alone_ms"] = [probe(t) for _ in range(20)]


def probe(t: Tenant) -> float:
    """8 blocks of 0.1 ms on the high-priority stream, launched then waited for: simulated ms."""
    start, end = t.probe_events
    start.record(t.stream)
    t.ctx.launch("spin", 8, THREADS, [spin_cycles(0.1)], stream=t.stream)
    end.record(t.stream)
    end.synchronize()
    return start.elapsed_ms(end)


def inference_run(t: Tenant) -> None:
    time.sleep(0.05)  # let the other tenants queue their work first, so that the probes see a loaded GPU
    loaded = []
    for _ in range(40):
        loaded.append(probe(t))
        time.sleep(0.005)
    t.info["latency_loaded_ms"] = loaded

    # A request's worth of real arithmetic: y = 2x + y, then sum(y), both checked against numpy.
    n = 1 << 20
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    dx, dy, dsum = t.ctx.malloc(4 * n), t.ctx.malloc(4 * n), t.ctx.malloc(4)
    t.ctx.memcpy_htod(dx, x)
    t.ctx.memcpy_htod(dy, y)
    t.ctx.launch("saxpy_f32", n // 256, 256, [2.0, dx, dy, n], stream=t.stream)
    t.ctx.launch("reduce_sum_f32", n // 256, 256, [dy, dsum, n], stream=t.stream)
    t.stream.synchronize()
    got_y = np.empty(n, np.float32)
    got_sum = np.empty(1, np.float32)
    t.ctx.memcpy_dtoh(got_y, dy)
    t.ctx.memcpy_dtoh(got_sum, dsum)
    want_y = np.float32(2.0) * x + y
    t.check("saxpy", np.array_equal(got_y, want_y), f"y = 2x + y over {n:,} floats, compared with numpy")
    want_sum = float(np.sum(want_y, dtype=np.float64))
    ok = math.isclose(float(got_sum[0]), want_sum, rel_tol=1e-4, abs_tol=1e-1)
    t.check("reduce_sum", ok, f"sum {float(got_sum[0]):.3f} vs numpy {want_sum:.3f}")
    for p in (dx, dy, dsum):
        t.ctx.free(p)


def training_run(t: Tenant) -> None:
    n = 1 << 20  # 4 MiB per vector
    a = np.arange(n, dtype=np.float32)
    b = np.full(n, 0.5, dtype=np.float32)
    da, db, dc = (t.ctx.malloc(4 * n) for _ in range(3))
    t.ctx.memcpy_htod(da, a)
    t.ctx.memcpy_htod(db, b)
    stream = t.ctx.create_stream()
    t.ctx.launch("vector_add_f32", n // 256, 256, [da, db, dc, n], stream=stream)
    t.bulk_spin(kernels=500, block_ms=1.0, stream=stream)  # "training steps": 500 full-wave kernels
    c = np.empty(n, np.float32)
    t.ctx.memcpy_dtoh(c, dc)
    t.check("vector_add", np.array_equal(c, a + b), f"c = a + b over {n:,} floats ({3 * 4 * n // MiB} MiB)")


def batch_setup(t: Tenant) -> None:
    """Allocate 256 MiB at a time until the pinned memory limit refuses."""
    chunk = 256 * MiB
    chunks = []
    refused = None
    while len(chunks) < 64:  # 16 GiB: stop even if no limit applies
        try:
            chunks.append(t.ctx.malloc(chunk))
        except mpsd_client.OutOfMemoryError as exc:
            refused = exc
            t.errors.append({"code": exc.code, "name": exc.name, "message": str(exc),
                             "when": f"malloc #{len(chunks) + 1} of 256 MiB"})
            break
    limit = t.ctx.quotas["pinned_mem_limit"]
    held = len(chunks) * chunk
    t.info.update(alloc_chunk=chunk, alloc_count=len(chunks), alloc_held=held)
    t.check("memory_limit", refused is not None and limit is not None and held <= limit,
            f"{len(chunks)} x 256 MiB allocated, then "
            + (f"{refused.name} ({refused.code})" if refused else "no error"))
    t.chunks = chunks


def batch_run(t: Tenant) -> None:
    # Keep one chunk, give the rest back, and really compute on 64 MiB of it: fill with 0.5, then sum.
    for p in t.chunks[1:]:
        t.ctx.free(p)
    buf = t.chunks[0]
    n = 16 * MiB  # floats
    out = t.ctx.malloc(4)
    stream = t.ctx.create_stream()
    t.ctx.launch("fill_f32", n // 1024, 1024, [buf, 0.5, n], stream=stream)
    t.ctx.launch("reduce_sum_f32", n // 1024, 1024, [buf, out, n], stream=stream)
    t.bulk_spin(kernels=200, block_ms=1.0, stream=stream)  # 200 full-wave kernels, 5 waves each on 32 SMs
    got = np.empty(1, np.float32)
    t.ctx.memcpy_dtoh(got, out)
    t.check("fill+reduce", float(got[0]) == 0.5 * n, f"sum of {n:,} x 0.5 = {float(got[0]):,.1f} (want {0.5 * n:,.1f})")
    t.ctx.free(out)
    t.ctx.free(buf)


def background_run(t: Tenant) -> None:
    n = 4 * MiB
    p = t.ctx.malloc(n)
    stream = t.ctx.create_stream()
    t.ctx.memset(p, 0x5A, n, stream=stream)
    t.bulk_spin(kernels=500, block_ms=1.0, stream=stream)
    got = np.empty(n, np.uint8)
    t.ctx.memcpy_dtoh(got, p)
    t.check("memset", bool(np.all(got == 0x5A)), f"{n // MiB} MiB set to 0x5A and read back")
    t.ctx.free(p)


ROLES = {
    "inference": (inference_setup, inference_run),
    "training": (None, training_run),
    "batch": (batch_setup, batch_run),
    "background": (None, background_run),
}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ROLES:
        print(f"usage: {argv[0]} {{{','.join(ROLES)}}}", file=sys.stderr)
        return 2
    role = argv[1]
    setup, run = ROLES[role]
    try:
        with mpsd_client.connect() as ctx:  # CUDA_MPS_PIPE_DIRECTORY says where
            tenant = Tenant(role, ctx)
            if setup:
                setup(tenant)
            print("READY", flush=True)
            if sys.stdin.readline().strip() != "GO":
                return 2
            t0 = time.perf_counter()
            run(tenant)
            ctx.synchronize()
            result = tenant.result(time.perf_counter() - t0)
    except Exception as exc:  # report it on the JSON line too, so the demo can say which tenant failed
        print(json.dumps({"role": role, "pid": os.getpid(), "fatal": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()}), flush=True)
        return 2
    print(json.dumps(result), flush=True)
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
