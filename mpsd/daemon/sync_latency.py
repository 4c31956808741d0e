# How long a client's synchronous calls took in the daemon, in fixed buckets, for the metrics' histogram
# (mpsd.daemon.metrics). A session keeps one only while --metrics is on, and only its calls that reply when the
# device is done (synchronize, stream and event synchronize, a blocking copy, free: those whose handler returns
# a Deferred) are counted, never a launch: the launch path stays as it was. Plain counts, not prometheus-client's
# Histogram: the session counts on the trio thread and the exporter copies them there (`snapshot`), so no lock
# is needed, and a departed client's counts go with its session.
from __future__ import annotations

import bisect
from dataclasses import dataclass

# Upper bounds in seconds: from a call answered at once (tens of microseconds) to one that waited for seconds of
# queued work.
BOUNDS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)


@dataclass(frozen=True, slots=True)
class LatencyStatistics:
    """Counts per bucket (not cumulative; the last is past BOUNDS[-1]), their sum in seconds, and the bounds."""

    counts: tuple[int, ...]
    total: float
    bounds: tuple[float, ...] = BOUNDS


class SyncLatency:
    """Counts of one client's synchronous calls by how long each took, wall seconds."""

    __slots__ = ("_counts", "_total")

    def __init__(self) -> None:
        self._counts = [0] * (len(BOUNDS) + 1)
        self._total = 0.0

    def observe(self, seconds: float) -> None:
        """One call that took `seconds` (a bucket's bound is inclusive, as Prometheus's `le`)."""
        self._counts[bisect.bisect_left(BOUNDS, seconds)] += 1
        self._total += seconds

    def statistics(self) -> LatencyStatistics:
        return LatencyStatistics(tuple(self._counts), self._total)
