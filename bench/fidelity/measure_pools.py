"""Measure what stream-ordered pools do, with the same probe on a real GPU and on mpsd, so the two can be put
side by side: where mpsd_client._pools packs allocations (its 512-byte step is an assumption), what one request
larger than 32 MiB reserves (assumed: its size in 32 MiB steps), what the release threshold and trim_to keep,
which reuse across streams each set of flags allows, how the high marks reset, and what a pair costs the host.

    python3 bench/fidelity/measure_pools.py > bench/fidelity/h200_pools.json      # a GPU, through cuda-python
    python3 bench/fidelity/measure_pools.py --mpsd                                # a daemon on the pipe directory

The cuda-python half has not run on the H200 yet (no GPU in the session that wrote it); the mpsd half runs in
tests/test_pools.py, whose test pins what mpsd answers.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

MiB = 1 << 20
UINT64_MAX = (1 << 64) - 1
SIZES = (1, 100, 512, 513, 1000, 4096, 65536, MiB, MiB + 1, 3 * MiB)
LARGE_MIB = (31, 32, 33, 40, 64, 100)
FLAGS = ("reuse_follow_event_dependencies", "reuse_allow_opportunistic", "reuse_allow_internal_dependencies")


class Cuda:
    """The CUDA runtime through cuda-python (cuda.bindings.runtime, or cuda.cudart before 12.8)."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver, runtime as rt  # type: ignore[import-not-found]
        except ImportError:
            from cuda import cuda as driver, cudart as rt  # type: ignore[import-not-found,no-redef]
        self.rt = rt
        self.uint64 = driver.cuuint64_t  # the wide attributes' type lives in the driver's module
        attr = rt.cudaMemPoolAttr
        self.attrs = {"release_threshold": attr.cudaMemPoolAttrReleaseThreshold,
                      "reuse_follow_event_dependencies": attr.cudaMemPoolReuseFollowEventDependencies,
                      "reuse_allow_opportunistic": attr.cudaMemPoolReuseAllowOpportunistic,
                      "reuse_allow_internal_dependencies": attr.cudaMemPoolReuseAllowInternalDependencies,
                      "reserved_mem_current": attr.cudaMemPoolAttrReservedMemCurrent,
                      "reserved_mem_high": attr.cudaMemPoolAttrReservedMemHigh,
                      "used_mem_current": attr.cudaMemPoolAttrUsedMemCurrent,
                      "used_mem_high": attr.cudaMemPoolAttrUsedMemHigh}
        self.call("cudaFree", 0)  # the context

    def call(self, name: str, *args: Any) -> Any:
        err, *values = getattr(self.rt, name)(*args)
        if int(err) != 0:
            raise RuntimeError(f"{name}: {err}")
        return values[0] if len(values) == 1 else values

    def stream(self) -> Any:
        return self.call("cudaStreamCreateWithFlags", self.rt.cudaStreamNonBlocking)

    def pool(self) -> Any:
        props = self.rt.cudaMemPoolProps()
        props.allocType = self.rt.cudaMemAllocationType.cudaMemAllocationTypePinned
        props.location.type = self.rt.cudaMemLocationType.cudaMemLocationTypeDevice
        props.location.id = 0
        return self.call("cudaMemPoolCreate", props)

    def default_pool(self) -> Any:
        return self.call("cudaDeviceGetDefaultMemPool", 0)

    def malloc(self, nbytes: int, pool: Any, stream: Any) -> int:
        return int(self.call("cudaMallocFromPoolAsync", nbytes, pool, stream))

    def free(self, ptr: int, stream: Any) -> None:
        self.call("cudaFreeAsync", ptr, stream)

    def get(self, pool: Any, name: str) -> int:
        return int(self.call("cudaMemPoolGetAttribute", pool, self.attrs[name]))

    def set(self, pool: Any, name: str, value: int) -> None:
        wide = name in ("release_threshold", "reserved_mem_high", "used_mem_high")
        self.call("cudaMemPoolSetAttribute", pool, self.attrs[name], self.uint64(value) if wide else value)

    def trim(self, pool: Any, keep: int) -> None:
        self.call("cudaMemPoolTrimTo", pool, keep)

    def destroy(self, pool: Any) -> None:
        self.call("cudaMemPoolDestroy", pool)

    def wait(self, waiter: Any, recorder: Any) -> None:
        """An event recorded on `recorder`, waited for by `waiter`."""
        event = self.call("cudaEventCreateWithFlags", self.rt.cudaEventDisableTiming)
        self.call("cudaEventRecord", event, recorder)
        self.call("cudaStreamWaitEvent", waiter, event, 0)

    def sync(self, stream: Any = None) -> None:
        if stream is None:
            self.call("cudaDeviceSynchronize")
        else:
            self.call("cudaStreamSynchronize", stream)

    def spin(self, stream: Any) -> None:
        """Work that keeps `stream` busy for a while (a large device-to-device copy)."""
        size = 1 << 30
        a, b = (int(self.call("cudaMallocAsync", size, stream)) for _ in range(2))
        for _ in range(8):
            self.call("cudaMemcpyAsync", b, a, size, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream)
        self.free(a, stream)
        self.free(b, stream)


class Mpsd:
    """The same calls through mpsd_client (a daemon on $CUDA_MPS_PIPE_DIRECTORY)."""

    def __init__(self) -> None:
        import mpsd_client

        self.ctx = mpsd_client.connect()

    def stream(self) -> Any:
        return self.ctx.create_stream(non_blocking=True)

    def pool(self) -> Any:
        return self.ctx.mem_pool_create()

    def default_pool(self) -> Any:
        return self.ctx.device_get_default_mem_pool()

    def malloc(self, nbytes: int, pool: Any, stream: Any) -> int:
        return int(self.ctx.malloc_from_pool_async(nbytes, pool, stream))

    def free(self, ptr: int, stream: Any) -> None:
        self.ctx.free_async(ptr, stream)

    def get(self, pool: Any, name: str) -> int:
        return int(pool.get_attribute(name))

    def set(self, pool: Any, name: str, value: int) -> None:
        pool.set_attribute(name, value)

    def trim(self, pool: Any, keep: int) -> None:
        pool.trim_to(keep)

    def destroy(self, pool: Any) -> None:
        pool.destroy()

    def wait(self, waiter: Any, recorder: Any) -> None:
        event = self.ctx.create_event(disable_timing=True)
        event.record(recorder)
        waiter.wait_event(event)

    def sync(self, stream: Any = None) -> None:
        (self.ctx if stream is None else stream).synchronize()

    def spin(self, stream: Any) -> None:
        self.ctx.launch("spin", 8, 32, [int(0.05 * 1.98e9)], stream=stream)  # 50 ms


def packing(rt: Any) -> dict[str, Any]:
    """Eight allocations of each size from a fresh pool: the gaps between them and what the pool reserved."""
    out = {}
    s = rt.stream()
    for size in SIZES:
        pool = rt.pool()
        ptrs = [rt.malloc(size, pool, s) for _ in range(8)]
        out[str(size)] = {"gaps": [b - a for a, b in zip(ptrs, ptrs[1:])],
                          "reserved": rt.get(pool, "reserved_mem_current"), "used": rt.get(pool, "used_mem_current")}
        for p in ptrs:
            rt.free(p, s)
        rt.sync(s)
        rt.destroy(pool)
    return out


def large(rt: Any) -> dict[str, Any]:
    """What one request of N MiB reserves, then what a second of 1 MiB adds."""
    out = {}
    s = rt.stream()
    for mib in LARGE_MIB:
        pool = rt.pool()
        a = rt.malloc(mib * MiB, pool, s)
        first = rt.get(pool, "reserved_mem_current")
        b = rt.malloc(MiB, pool, s)
        out[str(mib)] = {"reserved": first, "then_1_mib": rt.get(pool, "reserved_mem_current"), "gap": b - a}
        rt.free(a, s)
        rt.free(b, s)
        rt.sync(s)
        rt.destroy(pool)
    return out


def thresholds(rt: Any) -> dict[str, Any]:
    """Reserved memory around a synchronisation at thresholds 0, 40 MiB and UINT64_MAX, and after trim_to."""
    out = {}
    s = rt.stream()
    for threshold in (0, 40 * MiB, UINT64_MAX):
        pool = rt.pool()
        rt.set(pool, "release_threshold", threshold)
        ptrs = [rt.malloc(32 * MiB, pool, s) for _ in range(3)]
        for p in ptrs:
            rt.free(p, s)
        before = rt.get(pool, "reserved_mem_current")
        rt.sync(s)
        after = rt.get(pool, "reserved_mem_current")
        rt.trim(pool, 40 * MiB)
        trimmed = rt.get(pool, "reserved_mem_current")
        rt.trim(pool, 0)
        out[str(threshold)] = {"before_sync": before, "after_sync": after, "after_trim_to_40_mib": trimmed,
                               "after_trim_to_0": rt.get(pool, "reserved_mem_current")}
        rt.destroy(pool)
    return out


def reuse(rt: Any) -> dict[str, Any]:
    """Whether memory freed on stream A (behind work) goes to stream B at once, after an event, after a sync."""
    out = {}
    a, b = rt.stream(), rt.stream()
    for flags in ((True, True, True), (True, True, False), (True, False, False), (False, True, False),
                  (False, False, False)):
        pool = rt.pool()
        rt.set(pool, "release_threshold", UINT64_MAX)
        for name, value in zip(FLAGS, flags):
            rt.set(pool, name, int(value))
        seen = {}
        p = rt.malloc(MiB, pool, a)
        rt.spin(a)
        rt.free(p, a)
        q = rt.malloc(MiB, pool, b)
        seen["at_once"] = q == p
        rt.free(q, b)
        rt.sync()
        p = rt.malloc(MiB, pool, a)
        rt.free(p, a)
        rt.wait(b, a)
        q = rt.malloc(MiB, pool, b)
        seen["after_an_event"] = q == p
        rt.free(q, b)
        rt.sync()
        p = rt.malloc(MiB, pool, a)
        rt.free(p, a)
        rt.sync(a)
        q = rt.malloc(MiB, pool, b)
        seen["after_a_sync"] = q == p
        rt.free(q, b)
        rt.sync()
        out["/".join(f"{n}={int(v)}" for n, v in zip(FLAGS, flags))] = seen
        rt.destroy(pool)
    return out


def marks(rt: Any) -> dict[str, int]:
    """The high marks, and what setting them to 0 leaves."""
    s = rt.stream()
    pool = rt.pool()
    p, q = rt.malloc(3 * MiB, pool, s), rt.malloc(MiB, pool, s)
    rt.free(p, s)
    out = {"used_high": rt.get(pool, "used_mem_high"), "reserved_high": rt.get(pool, "reserved_mem_high")}
    rt.set(pool, "used_mem_high", 0)
    rt.set(pool, "reserved_mem_high", 0)
    out.update(used_high_reset=rt.get(pool, "used_mem_high"), reserved_high_reset=rt.get(pool, "reserved_mem_high"))
    rt.free(q, s)
    rt.sync(s)
    rt.destroy(pool)
    return out


def pair_us(rt: Any, n: int = 20000) -> float:
    """Host microseconds per malloc_async + free_async pair of 1 MiB from the default pool (its memory kept)."""
    s, pool = rt.stream(), rt.default_pool()
    rt.set(pool, "release_threshold", UINT64_MAX)
    rt.free(rt.malloc(MiB, pool, s), s)
    t0 = time.perf_counter()
    for _ in range(n):
        rt.free(rt.malloc(MiB, pool, s), s)
    spent = time.perf_counter() - t0
    rt.sync(s)
    rt.set(pool, "release_threshold", 0)
    return spent / n * 1e6


def probe(rt: Any, timing: bool = True) -> dict[str, Any]:
    out = {"packing": packing(rt), "large": large(rt), "thresholds": thresholds(rt), "reuse": reuse(rt),
           "marks": marks(rt)}
    if timing:
        out["pair_us"] = pair_us(rt)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mpsd", action="store_true", help="probe mpsd (a daemon on $CUDA_MPS_PIPE_DIRECTORY), not a GPU")
    p.add_argument("--no-timing", action="store_true", help="leave out the pair's host time")
    args = p.parse_args()
    print(json.dumps({"runtime": "mpsd" if args.mpsd else "cuda",
                      **probe(Mpsd() if args.mpsd else Cuda(), timing=not args.no_timing)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
