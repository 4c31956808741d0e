"""Shortest job first, a dispatch policy written in Python, beside mps on a shipped workload.

    .venv/bin/python examples/sjf_policy.py [examples/workloads/disb_c.toml]

Whenever capacity frees, the ready kernel with the least work left (its unplaced blocks times each block's
duration) places first, then the next; ties keep hardware order. On DISB-C (one latency-critical tenant of
264-block kernels beside five best-effort tenants of 132-block ones) it shows what such a rule costs: the
best-effort tenants' smaller grids go first and their p99 falls from 7 to 5 ms, while the critical tenant,
whose stream priority mps honours, waits behind them (p50 from about 2 ms to 1.7 s). The same class works
wherever a policy is named: as ``"examples.sjf_policy:ShortestJobFirst"`` (from the repository's root) in a
workload's ``[run] policy`` for ``mpsd simulate`` or in ``Simulator(policy=...)``, or as an instance.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from mpsd.sim import Policy, ReadyKernel


class ShortestJobFirst(Policy):
    """Place the ready kernel with the least work left first (unplaced blocks x seconds per block)."""

    name = "shortest-job-first"

    def dispatch(self, ready: list[ReadyKernel]) -> None:
        """Shortest first; each places what fits, the next back-fills what is left."""
        for run in sorted(ready, key=lambda r: r.unplaced * r.kernel.cost.seconds):
            run.place()


def main(argv: list[str]) -> None:
    from mpsd.stress.workload import load_workload
    from mpsd.tools.simulate import run_workload

    path = Path(argv[0]) if argv else Path(__file__).resolve().parent / "workloads" / "disb_c.toml"
    workload = load_workload(path)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(f"{path.name}: p50 / p99 latency (ms) of each tenant")
    for policy in ("mps", "sjf_policy:ShortestJobFirst"):
        result = run_workload(dataclasses.replace(workload, policy=policy))
        cells = [f"{t['tenant']} {t['latency_p50_ms']:.3f} / {t['latency_p99_ms']:.3f}" for t in result["tenants"]]
        print(f"  {policy:28} " + "   ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
