"""Clock rate: simulated seconds per wall second of the demo mix (examples/workloads/inference_training.toml)
on the daemon's virtual clock, with real tenant processes against a daemon process, beside the same mix with
every tenant a task beside a daemon in this process (mpsd-stress --virtual-time), in the same run. Both give the
same figures; the ratio is what real processes cost.

    .venv/bin/python bench/clock_rate.py [--duration 1.0] [--policy mps] [--repeat 1]

A run's wall time counts from the start of its daemon to the end of its timeline: tenant start-up (each
process imports numpy and the client) is part of what real processes cost. A rate above 1 means the mix runs
faster than an H200 would run it.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from mpsd.stress.metrics import summarize
from mpsd.stress.runner import run_real, run_virtual
from mpsd.stress.workload import load_workload

MIX = Path(__file__).resolve().parent.parent / "examples" / "workloads" / "inference_training.toml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1.0, help="simulated seconds of the mix")
    parser.add_argument("--policy", default="mps")
    parser.add_argument("--repeat", type=int, default=1)
    options = parser.parse_args()
    workload = dataclasses.replace(load_workload(MIX), duration=options.duration)
    walls: dict[str, list[float]] = {"real processes": [], "in-process": []}
    summaries = {}
    for _ in range(options.repeat):
        for name, run in (("real processes", run_real), ("in-process", run_virtual)):
            start = time.perf_counter()
            timeline = run(workload, options.policy, {})
            walls[name].append(time.perf_counter() - start)
            summaries[name] = summarize(timeline)
    simulated = summaries["real processes"]["duration_s"]
    rates = {name: simulated / min(w) for name, w in walls.items()}
    for name, rate in rates.items():
        print(f"{name:>15}: {simulated:.3f} simulated s in {min(walls[name]):.2f} wall s = {rate:.3f} simulated s/s")
    same = summaries["real processes"] == summaries["in-process"]
    print(f"ratio (real processes / in-process): {rates['real processes'] / rates['in-process']:.2f}; "
          f"figures {'identical' if same else 'DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
