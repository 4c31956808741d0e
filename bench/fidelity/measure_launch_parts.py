"""What each driver call on the CUDA backend's launch path costs from Python (cuda-python), on the H200: the
figures that decide what the backend does per launch and what it does once per batch.

    python3 bench/fidelity/measure_launch_parts.py [--n 20000] [--json FILE]

Each row is the mean wall time of one call (or one short sequence) over n repetitions, in microseconds, on one
non-blocking stream of the primary context, with an empty `spin` (1 block of 32 threads, 0 cycles).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from mpsd.backends.cuda import CudaBackend  # noqa: E402
from mpsd.backends.cuda_driver import _check  # noqa: E402


def timed(n: int, body: Callable[[], Any], sync: Callable[[], Any]) -> float:
    for _ in range(min(n, 500)):
        body()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        body()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    gpu = CudaBackend(0)
    cu = gpu.cu
    spin = gpu._functions["spin"]
    stream = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    sync = lambda: cu.cuStreamSynchronize(stream)  # noqa: E731
    arg = ctypes.c_int64(0)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    address = ctypes.addressof(params)
    event = _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT))
    quiet = _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    base = _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT))
    cu.cuEventRecord(base, stream)
    ctx = gpu.context
    n = options.n
    # The driver's own cuLaunchKernel through ctypes, with plain integers: slower than cuda-python's wrapper
    # (6.5 us against 5.1 on the H200), which is why the backend calls the wrapper.
    raw = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    uint, pointer = ctypes.c_uint, ctypes.c_void_p
    raw.argtypes = [pointer, uint, uint, uint, uint, uint, uint, uint, pointer, pointer, pointer]
    raw.restype = ctypes.c_int
    spin_handle, stream_handle = int(spin), int(stream)

    def packed_each_time() -> None:
        values = [ctypes.c_int64(0)]
        pointers = (ctypes.c_void_p * 1)(*[ctypes.addressof(v) for v in values])
        cu.cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, stream, ctypes.addressof(pointers), 0)

    def create_destroy() -> None:
        e = cu.cuEventCreate(0)[1]
        cu.cuEventDestroy(e)

    rows = {
        "cuLaunchKernel, cached argument buffer": lambda: cu.cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, stream,
                                                                            address, 0),
        "cuLaunchKernel, argument buffer packed per launch": packed_each_time,
        "cuLaunchKernel through ctypes, cached argument buffer": lambda: raw(
            spin_handle, 1, 1, 1, 32, 1, 1, 0, stream_handle, address, None),
        "cuLaunchKernel, arguments as a (values, types) tuple": lambda: cu.cuLaunchKernel(
            spin, 1, 1, 1, 32, 1, 1, 0, stream, ((0,), (ctypes.c_int64,)), 0),
        "cuEventRecord (timing event)": lambda: cu.cuEventRecord(event, stream),
        "cuEventRecord (disable-timing event)": lambda: cu.cuEventRecord(quiet, stream),
        "cuEventCreate + cuEventDestroy": create_destroy,
        "cuEventQuery (completed)": lambda: cu.cuEventQuery(event),
        "cuEventElapsedTime": lambda: cu.cuEventElapsedTime(base, event),
        "cuCtxSetCurrent (same context)": lambda: cu.cuCtxSetCurrent(ctx),
        "cuStreamWaitEvent": lambda: cu.cuStreamWaitEvent(stream, event, 0),
    }
    results = {}
    for name, body in rows.items():
        results[name] = round(timed(n, body, sync), 3)
        print(f"{results[name]:8.3f} us  {name}", flush=True)
    if options.json is not None:
        options.json.write_text(json.dumps({"n": n, "us": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
