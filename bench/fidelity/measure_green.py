"""Green contexts over overlapping SM groups on the H200: can they be made, and do tenants in them share the
device the way MPS's active thread percentage lets them (a limit, not a partition)?

    python3 bench/fidelity/measure_green.py [--kernels 20] [--json FILE]

The device's SMs are split once into the driver's smallest groups ("chunks"); a green context is then made from a
run of consecutive chunks, so two contexts may share chunks. Each layout below runs, from one process, one
stream per context, K full waves of `spin` (264 blocks of 1024 threads, 1 ms of the H200's clock each) per
stream, all issued before any completes; a stream's figure is the host time from the first launch until its
last event has fired. The same workload under real MPS at 50% (bench/fidelity/crosscheck_atp50_h200.txt) gave
40 ms for one tenant, 40.6 ms each for two and 60 ms each for three.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from mpsd.backends.cuda import CudaBackend  # noqa: E402
from mpsd.backends.cuda_driver import _check  # noqa: E402
from mpsd.sim import H200  # noqa: E402

CYCLES = int(H200.clock_hz * 1e-3)
GRID, BLOCK = 264, 1024


def chunks(gpu: CudaBackend) -> tuple[list[Any], Any, dict[str, Any]]:
    cu = gpu.cu
    whole = _check(cu.cuDeviceGetDevResource(gpu.device, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    info = {"sm_count": whole.sm.smCount}
    for name in ("minSmPartitionSize", "smCoscheduledAlignment"):
        info[name] = getattr(whole.sm, name, None)
    parts, count, rest = _check(cu.cuDevSmResourceSplitByCount(whole.sm.smCount, whole, 0, 1))
    parts = list(parts[:count])
    info["chunks"] = [p.sm.smCount for p in parts]
    info["rest"] = rest.sm.smCount if rest is not None else 0
    return parts, rest, info


def green(gpu: CudaBackend, resources: list[Any]) -> Any:
    cu = gpu.cu
    desc = _check(cu.cuDevResourceGenerateDesc(resources, len(resources)))
    g = _check(cu.cuGreenCtxCreate(desc, gpu.device, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    return _check(cu.cuCtxFromGreenCtx(g))


def run(gpu: CudaBackend, contexts: list[Any], kernels: int) -> list[float]:
    """Each context one stream, `kernels` waves each, issued round-robin; ms until each stream's last event."""
    cu = gpu.cu
    spin = gpu._functions["spin"]
    arg = ctypes.c_int64(CYCLES)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    streams, events = [], []
    for ctx in contexts:
        _check(cu.cuCtxSetCurrent(ctx))
        streams.append(_check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))
        events.append(_check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)))
    for ctx, s in zip(contexts, streams):  # warm each context
        _check(cu.cuCtxSetCurrent(ctx))
        _check(cu.cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, s, ctypes.addressof(params), 0))
        _check(cu.cuStreamSynchronize(s))
    t0 = time.perf_counter()
    for _ in range(kernels):
        for ctx, s in zip(contexts, streams):
            _check(cu.cuCtxSetCurrent(ctx))
            _check(cu.cuLaunchKernel(spin, GRID, 1, 1, BLOCK, 1, 1, 0, s, ctypes.addressof(params), 0))
    for ctx, s, e in zip(contexts, streams, events):
        _check(cu.cuCtxSetCurrent(ctx))
        _check(cu.cuEventRecord(e, s))
    ends: list[float | None] = [None] * len(events)
    while any(v is None for v in ends):
        for i, e in enumerate(events):
            if ends[i] is None and cu.cuEventQuery(e)[0] == cu.CUresult.CUDA_SUCCESS:
                ends[i] = (time.perf_counter() - t0) * 1e3
    for ctx, s, e in zip(contexts, streams, events):
        _check(cu.cuCtxSetCurrent(ctx))
        cu.cuEventDestroy(e)
        cu.cuStreamDestroy(s)
    return [float(v) for v in ends]  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=20)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    gpu = CudaBackend(0)
    parts, rest, info = chunks(gpu)
    print("SM resource:", info)
    ring = parts + ([rest] if rest is not None and rest.sm.smCount else [])
    n = len(ring)

    def window(start: int, length: int) -> list[Any]:
        return [ring[(start + i) % n] for i in range(length)]

    def sms(resources: list[Any]) -> int:
        return sum(r.sm.smCount for r in resources)

    half = next(k for k in range(1, n + 1) if sms(window(0, k)) >= gpu.sm_cap(50))  # chunks for 66 SMs
    results: dict[str, Any] = {"info": info, "kernels": options.kernels, "chunks_for_50pct": half, "layouts": {}}
    layouts: dict[str, list[list[Any]]] = {
        "one_50pct": [window(0, half)],
        "two_disjoint_50pct": [window(0, half), window(half, n - half)],
        "two_overlapping_50pct": [window(0, half), window(n - half, half)],
        "three_overlapping_50pct": [window(round(i * n / 3), half) for i in range(3)],
        "three_old_scheme": [window(0, half), window(half, n - half), window(0, half)],
        "two_same_context": [window(0, half)],  # two streams of one context (filled in below)
    }
    made: dict[tuple[int, ...], Any] = {}
    for name, groups in layouts.items():
        try:
            contexts = []
            for g in groups:
                key = tuple(id(r) for r in g)
                if key not in made:
                    made[key] = green(gpu, g)
                contexts.append(made[key])
            if name == "two_same_context":
                contexts = contexts * 2
            ms = run(gpu, contexts, options.kernels)
            results["layouts"][name] = {"sms": [sms(g) for g in groups], "ms": ms}
            print(f"{name:>26}: SMs {[sms(g) for g in groups]}  ms {[round(v, 2) for v in ms]}", flush=True)
        except Exception as exc:  # a layout the driver refuses is a finding, not a crash
            results["layouts"][name] = {"error": repr(exc)}
            print(f"{name:>26}: {exc!r}", flush=True)
    ms = run(gpu, [gpu.context], options.kernels)
    results["layouts"]["primary"] = {"sms": [info["sm_count"]], "ms": ms}
    print(f"{'primary':>26}: ms {[round(v, 2) for v in ms]}")
    if options.json is not None:
        options.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
