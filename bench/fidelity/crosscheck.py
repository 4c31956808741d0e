"""One workload three ways on the H200 machine: through mpsd on the real GPU (`--devices cuda:0`), through mpsd on
the simulated H200 (`--clock virtual`, so its figures are an H200's whatever the host), and straight on the GPU
under real MPS (`nvidia-cuda-mps-control -d`, each process its own CUDA client with cuda-python), side by side.

    python3 bench/fidelity/crosscheck.py [--processes 1,2,4] [--kernels 20] [--atp 50] [--json FILE]

The workload: P processes start together; each launches K full waves of `spin` (264 blocks of 1024 threads, each
block spinning 1 ms of the H200's clock) back to back on its default stream, then synchronises. A process's
figure is the time from its first launch to the return of its synchronise; the row is their mean. Under MPS the
P processes' waves share the SMs, so the mean grows with P; the model predicts by how much.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from mpsd.sim import H200  # noqa: E402

CYCLES = int(H200.clock_hz * 1e-3)  # 1 ms of the H200's SM clock
GRID, BLOCK = 264, 1024

# A tenant through mpsd: the same program under either clock (ctx.clock() is wall time on a real GPU).
MPSD_WORKER = """
import sys, time, mpsd_client
kernels, cycles, virtual = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "virtual"
ctx = mpsd_client.connect()
ctx.launch("spin", 1, 32, [0]); ctx.synchronize()            # warm
print("ready", flush=True)
sys.stdin.readline()                                          # go
if virtual:
    ctx.sleep(max(0.0, 1.0 - ctx.clock()))                    # everyone starts at simulated second 1
clock = ctx.clock if virtual else time.perf_counter
t0 = clock()
for _ in range(kernels):
    ctx.launch("spin", %d, %d, [cycles])
ctx.synchronize()
print((clock() - t0) * 1e3, flush=True)
""" % (GRID, BLOCK)

# A tenant straight on the GPU with cuda-python: under real MPS when the control daemon runs.
CUDA_WORKER = """
import ctypes, sys, time
from mpsd.backends.cuda import CudaBackend
kernels, cycles = int(sys.argv[1]), int(sys.argv[2])
gpu = CudaBackend(0)
cu, spin = gpu.cu, gpu._functions["spin"]
arg = ctypes.c_int64(cycles)
params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
zero = ctypes.c_int64(0)
warm = (ctypes.c_void_p * 1)(ctypes.addressof(zero))
cu.cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, 0, ctypes.addressof(warm), 0); cu.cuCtxSynchronize()
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
for _ in range(kernels):
    cu.cuLaunchKernel(spin, %d, 1, 1, %d, 1, 1, 0, 0, ctypes.addressof(params), 0)
cu.cuCtxSynchronize()
print((time.perf_counter() - t0) * 1e3, flush=True)
""" % (GRID, BLOCK)


def run_tenants(code: str, processes: int, kernels: int, env: dict[str, str], mode: str) -> list[float]:
    """Start `processes` tenants, let them all get ready, start them together; each one's milliseconds."""
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(kernels), str(CYCLES), mode],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(processes)]
    try:
        for p in procs:
            line = p.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "ready":
                raise RuntimeError(f"a tenant did not get ready: {line!r}")
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        return [float(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
    finally:
        for p in procs:
            p.wait(timeout=120)


def with_daemon(args: list[str], processes: int, kernels: int, mode: str, base: dict[str, str]) -> list[float]:
    pipe = Path(tempfile.mkdtemp(prefix="mpsdx-", dir="/tmp"))
    daemon = subprocess.Popen([sys.executable, "-m", "mpsd", "--pipe-dir", str(pipe), *args],
                              stderr=subprocess.PIPE, text=True, env=base)
    try:
        for line in daemon.stderr:  # type: ignore[union-attr]
            if "ready on" in line:
                break
        else:
            raise RuntimeError("the daemon did not start")
        return run_tenants(MPSD_WORKER, processes, kernels, dict(base, CUDA_MPS_PIPE_DIRECTORY=str(pipe)), mode)
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        shutil.rmtree(pipe, ignore_errors=True)


def with_real_mps(processes: int, kernels: int, base: dict[str, str]) -> list[float]:
    pipe = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    env = dict(base, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(pipe))
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
    try:
        time.sleep(0.5)
        return run_tenants(CUDA_WORKER, processes, kernels, env, "mps")
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=env, timeout=30)
        time.sleep(0.5)
        shutil.rmtree(pipe, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--kernels", type=int, default=20)
    parser.add_argument("--atp", type=float, help="every tenant's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    base = dict(os.environ)
    if options.atp is not None:
        base["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = f"{options.atp:g}"
    rows: list[dict[str, Any]] = []
    print(f"{options.kernels} full waves of 1-ms spin blocks ({GRID} x {BLOCK}) per process, mean ms per process"
          + (f", active thread percentage {options.atp:g}" if options.atp is not None else ""))
    print(f"{'P':>2}  {'real MPS':>10}  {'mpsd cuda:0':>12}  {'mpsd model':>11}  {'cuda/MPS':>8}  {'model/MPS':>9}")
    for p in (int(x) for x in options.processes.split(",")):
        real = with_real_mps(p, options.kernels, base)
        cuda = with_daemon(["--devices", "cuda:0"], p, options.kernels, "wall", base)
        model = with_daemon(["--devices", "h200", "--clock", "virtual", "--idle-grace", "30"], p, options.kernels,
                            "virtual", base)
        mean = {k: sum(v) / len(v) for k, v in (("mps", real), ("cuda", cuda), ("model", model))}
        rows.append({"processes": p, "kernels": options.kernels, "atp": options.atp, "real_mps_ms": real,
                     "mpsd_cuda_ms": cuda,
                     "mpsd_model_ms": model, "means": mean})
        print(f"{p:>2}  {mean['mps']:>10.3f}  {mean['cuda']:>12.3f}  {mean['model']:>11.3f}  "
              f"{mean['cuda'] / mean['mps']:>8.3f}  {mean['model'] / mean['mps']:>9.3f}", flush=True)
    if options.json is not None:
        options.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
