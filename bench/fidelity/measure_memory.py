"""Measure, on a real GPU under real MPS, what a client's context costs against its pinned memory limit.

Run on a machine with an NVIDIA GPU, CuPy and nvidia-cuda-mps-control, as root:

    python bench/fidelity/measure_memory.py > bench/fidelity/h200_memory.json

It starts an MPS control daemon on private pipe and log directories, runs one probe process per setting,
and stops the daemon. Each probe reports cudaMemGetInfo right after context creation, the largest single
allocation that succeeds (to 1 MiB), how much free memory a 1-byte allocation costs, the 256 MiB then
512 MiB sequence measured earlier, and what 16 allocations of various sizes cost and where they land.
mpsd's model of context memory and allocation granularity (mpsd.sim.specs, mpsd.runtime.memory) comes from this.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from _mps import private_mps  # this folder: the script's sys.path[0]

PROBE = r"""
import json, os
import cupy
rt = cupy.cuda.runtime
MiB = 1 << 20
cupy.cuda.Device(0).use()
rt.free(rt.malloc(1))                # create the context
free0, total = rt.memGetInfo()
one = rt.malloc(1)
free1, _ = rt.memGetInfo()
rt.free(one)
lo, hi = 0, free0 // MiB + 64        # largest single allocation, in MiB
while lo < hi:
    mid = (lo + hi + 1) // 2
    try:
        rt.free(rt.malloc(mid * MiB)); lo = mid
    except cupy.cuda.runtime.CUDARuntimeError:
        hi = mid - 1
seq = []
held = []
for size in (256, 512):
    try:
        held.append(rt.malloc(size * MiB)); seq.append([size, "ok"])
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        seq.append([size, str(exc)[:80]])
for p in held:
    rt.free(p)
granularity = {}
for size in (1, 512, 4096, 65536, MiB, MiB + 1, 3 * MiB):
    before, _ = rt.memGetInfo()
    ptrs = sorted(rt.malloc(size) for _ in range(16))
    during, _ = rt.memGetInfo()
    for p in ptrs:
        rt.free(p)
    after, _ = rt.memGetInfo()
    granularity[size] = {"cost_of_16": before - during, "not_returned_after_free": before - after,
                         "smallest_address_gap": min(b - a for a, b in zip(ptrs, ptrs[1:])),
                         "all_2mib_aligned": all(p % (2 * MiB) == 0 for p in ptrs)}
props = rt.getDeviceProperties(0)
print(json.dumps({"limit_env": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), "free_after_context": free0,
                  "total": total, "one_byte_costs": free0 - free1, "largest_malloc_mib": lo, "sequence": seq,
                  "granularity": granularity, "totalGlobalMem": props["totalGlobalMem"]}))
"""


def probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
        return {"error": out.stderr[-500:], "env": env}
    return json.loads(out.stdout)


def main() -> None:
    results = {"without_mps": probe({})}
    logs: dict[str, list[str]] = {}
    with private_mps(logs) as env:
        results["mps_no_limit"] = probe(env)
        for limit in ("1G", "2G", "4G", "600M"):
            results[f"mps_limit_{limit}"] = probe({**env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={limit}"})
    for name, lines in logs.items():
        results[f"{name}_log"] = lines
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
