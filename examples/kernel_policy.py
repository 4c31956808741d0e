"""Fewest SMs first, a kernel-level policy written in Python: one class for the simulated H200 and a real GPU.

    .venv/bin/python examples/kernel_policy.py [examples/workloads/disb_c.toml]
    mpsd --devices cuda:0 --policy examples.kernel_policy:FewestSmsFirst      # from the repository's root

The daemon's dispatcher (mpsd.runtime.dispatch) asks the policy, each time work arrives or ends, which client's
next kernel goes to the device. This one sends the kernel that needs the fewest SMs, and only where it finds them
free beside what is already running, so small kernels slip in beside big ones and never queue behind them. Named
as ``module:Class`` it runs wherever `--dispatch kernel` does: `mpsd --policy`, `mpsd-stress --policy` with
`--dispatch kernel` (or `--devices cuda:0`). On DISB-C it shows what a size-based rule costs a large urgent kernel:
the best-effort kernels (66 SMs each) always find room before the critical tenant's (all 132), and the critical
tenant starves (p50 526 ms, p99 1,002 ms in a 1-s run, against 1.6 and 2.6 under `priority`), while the
best-effort p99 falls from 7.0 to 5.0 ms.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from mpsd.runtime.dispatch_policies import KernelPolicy


class FewestSmsFirst(KernelPolicy):
    """The ready client whose next kernel occupies the fewest SMs goes first, where they are free."""

    name = "fewest-sms-first"

    def pick(self, dispatcher, ready):
        best = min(ready, key=lambda t: (dispatcher.footprint(t.head().work), t.head().seq))
        return best if dispatcher.room_for(best) else None


def main(argv: list[str]) -> None:
    from mpsd.stress.metrics import latency_summary
    from mpsd.stress.runner import run_virtual
    from mpsd.stress.workload import load_workload

    path = Path(argv[0]) if argv else Path(__file__).resolve().parent / "workloads" / "disb_c.toml"
    workload = dataclasses.replace(load_workload(path), duration=1.0)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(f"{path.name}, 1 s on the simulated H200, the dispatcher in front of its mps blocks: p50 / p99 ms")
    for policy in ("priority", "kernel_policy:FewestSmsFirst"):
        timeline = run_virtual(workload, policy, {"dispatch": "kernel"})
        cells = []
        for tenant in dict.fromkeys(r.tenant.split("#")[0] for r in timeline.requests):
            figures = latency_summary([r.latency for r in timeline.requests if r.tenant.split("#")[0] == tenant])
            cells.append(f"{tenant} {figures['p50']:.3f} / {figures['p99']:.3f}")
        print(f"  {policy:30} " + "   ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
