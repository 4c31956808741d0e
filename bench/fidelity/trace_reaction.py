"""How long the daemon takes to launch the next kernel once the device has gone idle, from a traced run's trace
(trace_<policy>.json, as trace_gaps.py reads it): for each kernel submitted while no kernel ran, the time from the
last end before it to its submission (the daemon's reaction), and from its submission to its first block (the
launch's way to the GPU); then the device's idle time in such gaps.

    python3 bench/fidelity/trace_reaction.py REPORT_DIR/trace_priority.json [...]
"""

from __future__ import annotations

import json
import sys

import numpy as np

from mpsd.record.trace import read_chrome_trace


def main(paths: list[str]) -> None:
    for path in paths:
        timeline = read_chrome_trace(json.load(open(path)))
        kernels = sorted((k for k in timeline.kernels if k.started == k.started and k.ended == k.ended),
                         key=lambda k: k.started)
        reaction, launch, idle = [], [], 0.0
        last_end = -np.inf  # the latest end of the kernels started so far
        for k in kernels:
            if k.started > last_end and last_end > -np.inf:  # the device was idle when this one started
                idle += k.started - last_end
                if k.submitted >= last_end:  # launched after the end: the daemon's reaction
                    reaction.append(k.submitted - last_end)
                    launch.append(k.started - k.submitted)
            last_end = max(last_end, k.ended)
        r, la = np.array(reaction) * 1e6, np.array(launch) * 1e6
        print(f"== {path}: policy {timeline.policy}, {timeline.duration:.3f} s")
        if len(r):
            print(f"idle gaps ended by a launch after the last end: {len(r)}; reaction us p10/p50/p90 "
                  f"{np.percentile(r, 10):.1f}/{np.percentile(r, 50):.1f}/{np.percentile(r, 90):.1f}; "
                  f"launch to first block us p50 {np.median(la):.1f}; device idle in all gaps {idle * 1e3:.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
