"""DISB-C's shape straight on the GPU, no mpsd: the baseline that `--devices cuda:0 --policy priority` is held to.

    python3 bench/fidelity/disb_direct.py [--duration 2] [--json FILE]

The shape of examples/workloads/disb_c.toml: one critical process, Poisson arrivals at 50 a second (seed 5), each
request two `spin` kernels of 264 blocks of 1024 threads spinning 0.5 ms, on a stream of the greatest priority,
then a stream synchronise; and five best-effort processes in a closed loop of two `work` kernels (132 blocks of
1024 threads, 93,638 dependent FMAs a thread) and a synchronise, at CUDA_MPS_CLIENT_PRIORITY=1. Each process is its
own CUDA client (cuda-python, the kernels mpsd's CUDA backend compiles). Three runs: the critical process alone
under real MPS (its solo latency), all six under real MPS, and all six without MPS (the driver's time-slicing).
A request's latency runs from when it was due to its synchronise's return, as mpsd-stress counts it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _mps import private_mps  # noqa: E402

from mpsd.sim import H200  # noqa: E402
from mpsd.stress.metrics import latency_summary  # noqa: E402

WORKER = """
import ctypes, random, sys, time
from mpsd.backends.cuda import CudaBackend, _check
role, duration, seed = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
gpu = CudaBackend(0)
cu = gpu.cu
least, greatest = gpu.priorities
stream = _check(cu.cuStreamCreateWithPriority(cu.CUstream_flags.CU_STREAM_NON_BLOCKING,
                                              greatest if role == "critical" else least))
if role == "critical":
    kernel, grid, value = gpu._functions["spin"], 264, int(0.5e-3 * %(clock)r)
else:
    kernel, grid, value = gpu._functions["work"], 132, 93638
arg = ctypes.c_int64(value)
params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
address = ctypes.addressof(params)
def request():
    for _ in range(2):
        _check(cu.cuLaunchKernel(kernel, grid, 1, 1, 1024, 1, 1, 0, stream, address, 0))
    _check(cu.cuStreamSynchronize(stream))
request()  # warm
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
out = []
if role == "critical":
    rng, due = random.Random(seed), 0.0
    while True:
        due += rng.expovariate(50.0)
        if due >= duration:
            break
        wait = t0 + due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        request()
        out.append(time.perf_counter() - (t0 + due))
else:
    while time.perf_counter() - t0 < duration:
        start = time.perf_counter()
        request()
        out.append(time.perf_counter() - start)
print(" ".join(repr(x) for x in out), flush=True)
""" % {"clock": H200.clock_hz}


def run(roles: list[str], duration: float, env: dict[str, str]) -> dict[str, list[float]]:
    """Start one process per role, let them get ready, start them together; each role's latencies."""
    code = textwrap.dedent(WORKER)
    procs = []
    for i, role in enumerate(roles):
        penv = dict(env, **({"CUDA_MPS_CLIENT_PRIORITY": "1"} if role == "best_effort" else {}))
        procs.append((role, subprocess.Popen([sys.executable, "-c", code, role, repr(duration), str(5 + i)],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=penv)))
    try:
        for role, p in procs:
            if p.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError(f"a {role} process did not get ready")
        for _, p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        out: dict[str, list[float]] = {}
        for role, p in procs:
            out.setdefault(role, []).extend(float(x) for x in p.stdout.readline().split())  # type: ignore[union-attr]
        return out
    finally:
        for _, p in procs:
            p.wait(timeout=120)


def figures(latencies: dict[str, list[float]], duration: float) -> dict[str, Any]:
    crit = latency_summary(latencies.get("critical", []))
    be = latencies.get("best_effort", [])
    return {"critical_p50_ms": crit["p50"], "critical_p99_ms": crit["p99"],
            "critical_slo": (sum(1 for x in latencies.get("critical", []) if x <= 5e-3)
                             / max(1, len(latencies.get("critical", [])))),
            "best_effort_req_per_s": len(be) / duration,
            "best_effort_p50_ms": latency_summary(be)["p50"] if be else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    shared = ["critical"] + ["best_effort"] * 5
    rows: dict[str, Any] = {}
    logs: dict[str, list[str]] = {}
    with private_mps(logs) as mps:
        env = {**os.environ, **mps}
        rows["solo, real MPS"] = figures(run(["critical"], options.duration, env), options.duration)
        rows["shared, real MPS"] = figures(run(shared, options.duration, env), options.duration)
    rows["shared, no MPS"] = figures(run(shared, options.duration, dict(os.environ)), options.duration)
    print(f"DISB-C shape, {options.duration:g} s, direct cuda-python processes")
    print(f"{'run':<18} {'crit p50 ms':>11} {'crit p99 ms':>11} {'SLO 5 ms':>8} {'BE req/s':>9} {'BE p50 ms':>9}")
    for name, r in rows.items():
        be_p50 = "-" if r["best_effort_p50_ms"] is None else f"{r['best_effort_p50_ms']:.3f}"
        print(f"{name:<18} {r['critical_p50_ms']:>11.3f} {r['critical_p99_ms']:>11.3f} {r['critical_slo']:>8.1%} "
              f"{r['best_effort_req_per_s']:>9.1f} {be_p50:>9}")
    if options.json:
        options.json.write_text(json.dumps({"duration_s": options.duration, "rows": rows, "mps_logs": logs},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
