"""cudaSetDeviceFlags and cudaGetDeviceFlags on the H200: what the runtime accepts and reports, and how a host
thread waits in cudaStreamSynchronize under each scheduling choice (the rules mpsd_client._wait follows).

    python3 bench/fidelity/measure_device_flags.py [--json FILE]

The flags part runs in a fresh process per row (flags are per process and device). The wait part runs a 50 ms
kernel (clock64 spin, CuPy) three times per choice in a fresh process and reports, per wait, the thread's
voluntary context switches (a thread that sleeps makes one or more; one that spins, none) and its CPU time.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

FLAGS = {"auto": 0x00, "spin": 0x01, "yield": 0x02, "blocking_sync": 0x04, "map_host": 0x08,
         "lmem_resize_to_max": 0x10, "sync_memops": 0x80}

CHECK = r"""
import json, sys
from cuda.bindings import runtime as rt
flags = int(sys.argv[1])
row = {"flags": flags}
err, before = rt.cudaGetDeviceFlags()
row["get_before_init"] = [err.name, before]
err, = rt.cudaSetDeviceFlags(flags)
row["set"] = err.name
err, after = rt.cudaGetDeviceFlags()
row["get_after_set"] = [err.name, after]
rt.cudaFree(0)
err, inited = rt.cudaGetDeviceFlags()
row["get_after_init"] = [err.name, inited]
err, = rt.cudaSetDeviceFlags(0x01)
row["set_spin_after_init"] = err.name
err, last = rt.cudaGetDeviceFlags()
row["get_after_second_set"] = [err.name, last]
print(json.dumps(row))
"""

WAIT = r"""
import json, resource, sys, time
from cuda.bindings import runtime as rt
import cupy as cp
err, = rt.cudaSetDeviceFlags(int(sys.argv[1]))
assert err.name == "cudaSuccess", err
spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
    long long start = clock64(); while (clock64() - start < cycles) {} }''', "spin")
rate = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0) * 1000
stream = cp.cuda.Stream(non_blocking=True)
waits = []
for i in range(4):
    spin((1,), (32,), (cp.int64(int(0.05 * rate)),), stream=stream)
    r0, t0, c0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter(), time.thread_time()
    stream.synchronize()
    r1, t1, c1 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter(), time.thread_time()
    if i:  # the first wait includes the module's load
        waits.append({"wall_ms": round((t1 - t0) * 1e3, 2), "cpu_ms": round((c1 - c0) * 1e3, 2),
                      "voluntary_switches": r1.ru_nvcsw - r0.ru_nvcsw})
print(json.dumps(waits))
"""


def run(code: str, *args: str) -> object:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    checked = [0x00, 0x01, 0x02, 0x04, 0x08, 0x01 | 0x08, 0x04 | 0x10, 0x02 | 0x80, 0x03, 0x05, 0x06, 0x07, 0x20,
               0x40, 0x100]
    result = {"flags": FLAGS, "checks": [run(CHECK, str(f)) for f in checked],
              "waits": {name: run(WAIT, str(FLAGS[name])) for name in ("auto", "spin", "yield", "blocking_sync")}}
    for row in result["checks"]:
        print(row)
    for name, waits in result["waits"].items():
        print(name, waits)
    if options.json:
        options.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
