"""A 100-point sweep run serially and with two worker processes, in the same run: the wall time of each, the
ratio, and whether their tables are the same, byte for byte (issue 32's target: --jobs 2 at least 1.8 times
faster on 2 cores); and where Ray is installed (mpsd[ray]), on a local Ray cluster of two CPUs that it starts
(`ray start --head`, as a user's existing cluster would be), the same table byte for byte and Ray's overhead per
point against --jobs 2 (the cluster's start is left out; connecting to it is counted).

    .venv/bin/python bench/sweep_rate.py [--points 100] [--path daemon|model]

The sweep is examples/sweeps/replicas_per_gpu.toml's workload over seeds and replica counts, each point a
virtual-time run of 0.05 simulated seconds, so the figure is the executor's, not the model's.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = (ROOT / "examples" / "sweeps" / "replicas_per_gpu.toml").read_text().split("[sweep.grid]")[0]


def sweep_file(directory: Path, points: int) -> Path:
    """The workload over `points` points: replica counts 1 to 5 times as many seeds as make up the number."""
    counts = [1, 2, 3, 4, 5]
    seeds = list(range(1, -(-points // len(counts)) + 1))
    path = directory / "sweep.toml"
    path.write_text(WORKLOAD.replace("duration = 0.2", "duration = 0.05")
                    + f'[sweep.grid]\nseed = {seeds}\n"tenant.inference.count" = {counts}\n')
    return path


def timed(path: Path, jobs: int, out: Path, where: str, *extra: str) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mpsd.stress.cli", "sweep", str(path), "--jobs", str(jobs), "--quiet",
                    "--path", where, "--json", str(out), *extra], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def ray_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-c", "from ray.scripts.scripts import main; main()", *args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def on_ray(path: Path, out: Path, where: str) -> float:
    """The sweep's wall time on a local Ray cluster of two CPUs, started before and stopped after."""
    ray_cli("start", "--head", "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats")
    try:
        return timed(path, 2, out, where, "--executor", "ray", "--address", "auto")
    finally:
        ray_cli("stop")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100)
    parser.add_argument("--path", choices=("daemon", "model"), default="daemon")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        path = sweep_file(directory, args.points)
        serial = timed(path, 1, directory / "serial.json", args.path)
        parallel = timed(path, 2, directory / "parallel.json", args.path)
        same = (directory / "serial.json").read_bytes() == (directory / "parallel.json").read_bytes()
        ray = importlib.util.find_spec("ray") is not None
        if ray:
            on_cluster = on_ray(path, directory / "ray.json", args.path)
            ray_same = (directory / "serial.json").read_bytes() == (directory / "ray.json").read_bytes()
    ratio = serial / parallel
    print("== sweep_rate ==")
    print(f"  points      {args.points} ({args.path} path, 0.05 simulated s each)")
    print(f"  serial      {serial:.2f} s  (--jobs 1)")
    print(f"  parallel    {parallel:.2f} s  (--jobs 2)")
    print(f"  ratio       {ratio:.2f}x faster;  tables byte for byte the same: {same}")
    if ray:
        overhead = (on_cluster - parallel) / args.points * 1e3
        print(f"  ray         {on_cluster:.2f} s  (a local cluster of 2 CPUs); {overhead:.1f} ms a point more than "
              f"--jobs 2;  table byte for byte the same: {ray_same}")
    else:
        print("  ray         not installed (pip install 'mpsd[ray]'): not measured")
    print(f"  target      at least 1.8x, the same table\n  result      {'PASS' if ratio >= 1.8 and same else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
