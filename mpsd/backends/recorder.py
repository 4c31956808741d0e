# The daemon's timeline, kept on request (`mpsd --trace FILE`) and written when the daemon exits, as a
# Chrome/Perfetto trace (mpsd.record.trace): one row per SM, every block group a slice named after its client. The
# simulator records block groups when asked, a real GPU's traced kernels their blocks (mpsd.backends.cuda_trace);
# this adds what only the daemon knows (which client is which process, its quotas, the kernel's name, how much
# memory it held) and the clock that maps the device's time onto the host's monotonic clock, so a stress run can
# line the device up with what its tenants saw.
"""Recording the daemon's device timeline."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpsd.record.timeline import KernelRecord, TenantInfo, Timeline, partitions_of, spans_of
from mpsd.record.trace import chrome_trace

if TYPE_CHECKING:
    from mpsd.sim import Kernel
    from mpsd.backends.sim import SimBackend
    from mpsd.runtime.context import Context

# A trace is kept in memory until exit; past this many kernels a long-running daemon stops adding to it
# (the file then says so) rather than grow without bound.
MAX_KERNELS = 2_000_000


def client_name(context: Context) -> str:
    return f"client {context.id} (pid {context.pid})"


class Recorder:
    """What one device's trace needs beyond the simulator's block groups.

    Args:
        path: where ``write`` puts the trace.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.contexts: dict[int, Context] = {}  # every client that attached, gone or not
        self.kernels: list[tuple[Kernel, str]] = []
        self.dropped = 0

    def attached(self, context: Context) -> None:
        self.contexts[context.id] = context

    def launched(self, op: Kernel, name: str) -> None:
        if len(self.kernels) >= MAX_KERNELS:
            self.dropped += 1
            return
        self.kernels.append((op, name))

    def tenants(self) -> tuple[dict[int, str], list[TenantInfo]]:
        """Every client's name in the trace (client id -> name), and each as a tenant with its quotas."""
        names = {c.id: client_name(c) for c in self.contexts.values()}
        tenants = [TenantInfo(name=names[c.id], group=f"pid {c.pid}", sm_cap=c.quotas.sm_cap,
                              mem_limit=c.quotas.pinned_mem_limit, entitlement=1 / len(names),
                              priority=c.quotas.priority)
                   for c in self.contexts.values()]
        return names, tenants

    def device(self, names: dict[int, str], tenants: list[TenantInfo], **device: Any) -> Timeline:
        """The device's timeline from what its backend recorded (`device`: Timeline's policy, sm_count,
        duration, launch_overhead, kernels, spans and partitions), with the clients' tenants and memory."""
        return Timeline(tenants=tenants, memory_high_water={names[c.id]: c.account.peak
                                                             for c in self.contexts.values()}, **device)

    def timeline(self, backend: SimBackend) -> Timeline:
        """A simulated device's timeline so far, in simulated seconds."""
        sim = backend.sim
        names, tenants = self.tenants()
        ids = {}
        kernels = []
        for n, (op, name) in enumerate(self.kernels):
            ids[op] = n
            kernels.append(KernelRecord(names[op.client], n, name, op.blocks, op.submitted,
                                        op.started, op.ended if op.done else math.nan, op.eligible))
        return self.device(names, tenants, policy=sim.policy.name, sm_count=backend.spec.sm_count,
                           duration=backend.device_clock.now, launch_overhead=backend.spec.kernel_overhead,
                           kernels=kernels, spans=spans_of(sim, names, ids), partitions=partitions_of(sim))

    def write(self, timeline: Timeline, meta: dict[str, Any]) -> None:
        """Write the trace (atomically: a reader never sees half a file): the timeline as Chrome trace data,
        and `meta` (what maps it onto the clients: `meta`'s) as its otherData["mpsd"].

        Raises:
            OSError: the file cannot be written.
        """
        data = chrome_trace(timeline)
        data["otherData"]["mpsd"] = meta
        # The temporary file gets a fresh name, created exclusively (mkstemp: O_EXCL, mode 0600), so nothing
        # planted beside the trace, such as a symlink under a name we might pick, is ever written through; the
        # rename then replaces whatever is at the trace's own path, a symlink included, without following it.
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(data, separators=(",", ":")))
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def written(self, backend: Any, index: int) -> Path:
        """`write` what the backend's `timeline` gives for device `index`; where it went.

        Raises:
            OSError: the file cannot be written.
        """
        self.write(*backend.timeline(index))
        return self.path

    def meta(self, index: int, origin: float, time_scale: float, max_lag: float) -> dict[str, Any]:
        """What maps the timeline onto the clients' clock and names (a trace's otherData["mpsd"]): `origin`
        is time.monotonic() at the device's time 0 (NaN under the virtual clock), `time_scale` the device's
        seconds per second."""
        return {
            "device": index,
            # time.monotonic() at simulated time 0, and simulated seconds per second: maps the trace onto the
            # clock the clients stamp their requests with
            "monotonic_origin": origin if math.isfinite(origin) else None,
            "clock": "virtual" if origin != origin else "wall",
            "time_scale": time_scale,
            "max_lag": max_lag,
            "clients": {client_name(c): {"client": c.id, "pid": c.pid, "uid": c.uid}
                        for c in self.contexts.values()},
            "kernels_not_recorded": self.dropped,
        }
