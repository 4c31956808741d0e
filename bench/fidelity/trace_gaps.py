"""Where a traced run's device time went, per tenant group, from the trace mpsd-stress --report writes
(trace_<policy>.json; on cuda:0 drawn from the traced kernels' block records, on the model from its block groups).

For each group: kernels, their device time (first block to last, median), SM-time (SM-seconds weighted by the
share of the SM the blocks hold), the wait from the backend's being given a kernel to its first block (median,
p99), and the gaps with none of the group's kernels on the device while one of them was queued (summed). Then
the whole device: SM-time used of the SM-time the run had, and idle SM-seconds while work was queued.

    python3 bench/fidelity/trace_gaps.py REPORT_DIR/trace_priority.json [...]
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np

from mpsd.stress.metrics import summarize
from mpsd.record.trace import read_chrome_trace


def group(tenant: str) -> str:
    return re.sub(r"#\d+$", "", tenant)


def main(paths: list[str]) -> None:
    for path in paths:
        timeline = read_chrome_trace(json.load(open(path)))
        summary = summarize(timeline)
        print(f"== {path}: policy {timeline.policy}, {timeline.duration:.3f} s, {timeline.sm_count} SMs")
        spans = timeline.spans
        weight = (spans.end - spans.start) * spans.sm_fraction
        names = np.array(spans.names, dtype=object)
        span_group = np.array([group(n) for n in names[spans.tenant]]) if len(spans) else np.array([])
        print(f"{'group':<14}{'kernels':>8}{'device ms p50':>15}{'SM-s':>8}{'wait us p50':>13}{'wait us p99':>13}"
              f"{'queued gaps ms':>16}")
        for name in sorted({group(k.tenant) for k in timeline.kernels}):
            kernels = sorted((k for k in timeline.kernels if group(k.tenant) == name and k.started == k.started),
                             key=lambda k: k.started)
            if not kernels:
                continue
            device = np.array([k.ended - k.started for k in kernels]) * 1e3
            wait = np.array([k.started - k.ready for k in kernels]) * 1e6
            # stretches with a kernel of the group queued (ready, not started) and none of its kernels running
            gaps, running_until = 0.0, -np.inf
            for k in kernels:
                if k.ready > running_until:
                    gaps += max(0.0, k.started - k.ready)
                elif k.started > running_until:
                    gaps += k.started - running_until
                running_until = max(running_until, k.ended)
            sm_s = float(weight[span_group == name].sum()) if len(spans) else 0.0
            print(f"{name:<14}{len(kernels):>8}{np.median(device):>15.3f}{sm_s:>8.3f}{np.median(wait):>13.1f}"
                  f"{np.percentile(wait, 99):>13.1f}{gaps * 1e3:>16.3f}")
        print(f"SM-time used {summary['sm_seconds']:.3f} of {timeline.sm_count * timeline.duration:.3f} SM-s; "
              f"idle SM-s while work was queued {summary['idle_sm_seconds_while_queued']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
