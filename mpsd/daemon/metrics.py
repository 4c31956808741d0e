# The Prometheus exporter (--metrics HOST:PORT): per device, the DCGM-exporter series that a simulated or real
# GPU behind mpsd can answer, under DCGM's names and labels, so that dashboards and alerts written for
# dcgm-exporter work unchanged; per client, mpsd_client_* series labelled by pid, uid, server and namespace.
#
# Why a thread and a snapshot: prometheus-client's HTTP server runs in threads of its own (one to accept, one per
# request), and nothing of the daemon may be read from them while the trio thread changes it. So a scrape's
# collect() asks the trio thread, through trio.from_thread.run_sync, for a `snapshot`: plain, new values built on
# that thread between two of its tasks' steps, which the request thread then only reads while it formats them.
# This costs the daemon nothing between scrapes (a task that published a snapshot on a timer would wake the loop
# whether anyone scraped or not, and serve figures as old as its period), and a scrape waits at most for the task
# that runs when it comes. The HTTP parsing, the text format and the writes stay off the loop. Nothing here ever
# changes the daemon's state, only the exporter's own (each device's last look, for the utilisation since it).
#
# The figures are those mpsd-smi and ctx.statistics() already show (Daemon.client_statistics, the dispatcher's
# dispatch_statistics); the one kind counted for the exporter alone is the synchronous calls' latency
# (mpsd.daemon.sync_latency), which sessions keep only while --metrics is on.
from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import trio
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from mpsd.daemon.sync_latency import LatencyStatistics
from mpsd.runtime.dispatch import Dispatcher

if TYPE_CHECKING:
    from mpsd.daemon.server import Daemon

log = logging.getLogger("mpsd")
MIB = 1 << 20

# DCGM's labels on every device series (dcgm-exporter's: the GPU's index, its UUID, its PCI bus id, the device
# node's name, the model's name and the host's name).
DEVICE_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname")
# A client: the device it is on (DCGM's gpu, to join the two), its context (a process may hold one per device,
# or more), its pid and uid as SO_PEERCRED gave them, its MPS server and namespace.
CLIENT_LABELS = ("gpu", "context", "pid", "uid", "server", "namespace")

# name -> (type, help). DCGM's names and units: FB in MiB, utilisation in %, SM_ACTIVE a ratio, clock in MHz.
DEVICE_SERIES: dict[str, tuple[str, str]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %) since the previous scrape: on a simulated device the "
                                      "SM-time its blocks held over the SM-time that passed; on a GPU, NVML's"),
    "DCGM_FI_PROF_SM_ACTIVE": ("gauge", "Ratio of SM-time with work resident since the previous scrape "
                                        "(simulated devices, which count it)"),
    "DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB): reserved for the server and its clients"),
    "DCGM_FI_DEV_FB_FREE": ("gauge", "Framebuffer memory free (in MiB)"),
    "DCGM_FI_DEV_SM_CLOCK": ("gauge", "SM clock frequency (in MHz)"),
    "mpsd_device_clients": ("gauge", "Clients connected to the device"),
    "mpsd_device_busy_sms": ("gauge", "SMs holding at least one block now (simulated devices)"),
    "mpsd_device_sm_seconds": ("counter", "SM-seconds of device time the blocks that ended held (simulated time)"),
}

# name -> (type, help, key of the client's figures: Daemon.client_statistics, and what `_client` adds).
CLIENT_SERIES: dict[str, tuple[str, str, str]] = {
    "mpsd_client_sm_seconds": ("counter", "SM-seconds the client's blocks held (simulated time)", "sm_seconds"),
    "mpsd_client_launches": ("counter", "Kernel launches the client made", "launches"),
    "mpsd_client_kernels_completed": ("counter", "The client's kernels that completed", "kernels_completed"),
    "mpsd_client_copies": ("counter", "Memory copies the client made", "copies"),
    "mpsd_client_copied_bytes": ("counter", "Bytes the client's memory copies moved", "bytes_copied"),
    "mpsd_client_memory_used_bytes": ("gauge", "Device memory reserved for the client, its context's included "
                                               "(nvidia-smi's figure)", "memory_used"),
    "mpsd_client_memory_in_use_bytes": ("gauge", "Bytes of the client's live allocations", "memory_in_use"),
    "mpsd_client_memory_peak_bytes": ("gauge", "Most device memory reserved for the client at once", "memory_peak"),
    "mpsd_client_memory_limit_bytes": ("gauge", "The client's pinned device memory limit", "pinned_mem_limit"),
    "mpsd_client_sm_quota": ("gauge", "SMs the client's kernels may occupy (its active thread percentage)",
                             "sm_cap"),
    "mpsd_client_active_thread_percentage": ("gauge", "The client's active thread percentage",
                                             "active_thread_percentage"),
    "mpsd_client_queued_kernels": ("gauge", "Kernels the kernel dispatcher holds for the client (--dispatch "
                                            "kernel)", "queued"),
    "mpsd_client_kernels_in_flight": ("gauge", "The client's kernels the dispatcher has on the device (--dispatch "
                                               "kernel)", "in_flight"),
    "mpsd_client_sticky_error": ("gauge", "CUDA error code of the client's sticky error (0: none)", "sticky_code"),
}
SYNC_SECONDS = "mpsd_client_sync_call_seconds"
SYNC_HELP = ("Wall seconds the client's synchronous calls (synchronize, blocking copies, free) waited in the "
             "daemon for the device")

# The daemon's own (no labels).
HOST_SERIES: dict[str, tuple[str, str]] = {
    "mpsd_host_memory_resident_bytes": ("gauge", "Host RAM the simulated devices' memory and pinned buffers take"),
    "mpsd_host_memory_budget_bytes": ("gauge", "Host RAM they may take (--host-memory)"),
    "mpsd_clients_waiting": ("gauge", "Clients of another user waiting for the current server to exit"),
}


def exposed_names() -> set[str]:
    """Every sample name the exporter can serve, as a query names it (counters with _total, the histogram's
    _bucket, _sum and _count): what the shipped dashboard may use."""
    def samples(name: str, kind: str) -> set[str]:
        return {f"{name}_total"} if kind == "counter" else {name}

    names = {n for name, (kind, _) in {**DEVICE_SERIES, **HOST_SERIES}.items() for n in samples(name, kind)}
    names |= {n for name, (kind, _, _) in CLIENT_SERIES.items() for n in samples(name, kind)}
    return names | {SYNC_SECONDS + suffix for suffix in ("_bucket", "_sum", "_count")}


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one scrape serves, built on the trio thread: (labels, {series: value}) per device and per client
    (with its latencies, if counted), and the daemon's own values."""

    devices: list[tuple[tuple[str, ...], dict[str, float]]]
    clients: list[tuple[tuple[str, ...], dict[str, float], LatencyStatistics | None]]
    host: dict[str, float]


class Exporter:
    """The metrics of one daemon, served at http://HOST:PORT/metrics while `run` runs."""

    def __init__(self, daemon: Daemon, host: str, port: int) -> None:
        """Bind the HTTP server (its threads start now; collect() works once `run` has begun).

        Raises:
            OSError: the address cannot be bound.
        """
        self.daemon = daemon
        self.hostname = socket.gethostname()
        self._looks: dict[int, tuple[float, float]] = {}  # device -> (device time, SM-seconds) at the last scrape
        self._token: trio.lowlevel.TrioToken | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self._take))
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        bound, port = self.server.server_address[:2]  # the port really bound, where 0 asked for any
        assert isinstance(bound, str)  # (an IP server's address: a str, never an AF_UNIX path's bytes)
        self.address = bound, port
        self.remote = host != "localhost" and not ipaddress.ip_address(self.address[0]).is_loopback

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Answer scrapes until cancelled (shutdown begins), then stop the HTTP server."""
        self._token = trio.lowlevel.current_trio_token()
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            # From now on a scrape gets no series. The accept loop notices a shutdown only at its next poll (half
            # a second), which the daemon's own shutdown need not wait for: a thread of its own waits.
            self._token = None
            threading.Thread(target=self.close, name="mpsd-metrics-close", daemon=True).start()

    def close(self) -> None:
        """Stop the HTTP server and close its socket (blocks up to half a second)."""
        self.server.shutdown()
        self.server.server_close()

    def _take(self) -> Snapshot | None:
        """On a request thread: the snapshot, taken on the trio thread; None once the daemon is stopping."""
        token = self._token
        if token is None:
            return None
        try:
            return trio.from_thread.run_sync(self.snapshot, trio_token=token)
        except trio.RunFinishedError:
            return None

    # -- on the trio thread -----------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        daemon = self.daemon
        control = daemon.control
        server = control.server.name or str(control.server.pid)
        devices: list[tuple[tuple[str, ...], dict[str, float]]] = []
        clients: list[tuple[tuple[str, ...], dict[str, float], LatencyStatistics | None]] = []
        latencies = {id(s.context): s.sync_latency for s in daemon.sessions if s.context is not None}
        for device in daemon.devices:
            props = device.properties
            backend = device.backend
            labels = (str(device.index), props["uuid"],
                      "{:08X}:{:02X}:{:02X}.0".format(*(props[f"pci_{k}_id"] for k in ("domain", "bus", "device"))),
                      f"nvidia{device.index}", device.name, self.hostname)
            busy, now = backend.statistics().sm_seconds, backend.now()
            last_time, last_busy = self._looks.get(device.index, (0.0, 0.0))
            self._looks[device.index] = (now, busy)
            span = (now - last_time) * props["multiprocessor_count"]
            used = device.ledger.device.reserved
            values: dict[str, float] = {
                "DCGM_FI_DEV_FB_USED": used // MIB, "DCGM_FI_DEV_FB_FREE": (device.total_memory - used) // MIB,
                "DCGM_FI_DEV_SM_CLOCK": props["clock_rate_khz"] // 1000,
                "mpsd_device_clients": len(device.contexts), "mpsd_device_sm_seconds": busy,
            }
            sampled = backend.utilization()  # a real GPU's, from NVML; the simulator counts SM-time instead
            if sampled is None:
                active = min(1.0, max(0.0, (busy - last_busy) / span)) if span > 0 else 0.0
                values.update({"DCGM_FI_DEV_GPU_UTIL": round(100 * active), "DCGM_FI_PROF_SM_ACTIVE": active,
                               "mpsd_device_busy_sms": backend.busy_sms()})
            else:
                values["DCGM_FI_DEV_GPU_UTIL"] = round(100 * sampled)
            devices.append((labels, values))
            dispatched = backend.dispatch_statistics() if isinstance(backend, Dispatcher) else {}
            for ctx in device.contexts.values():
                figures = self._client(ctx, dispatched.get(ctx.id))
                latency = latencies.get(id(ctx))
                clients.append(((str(device.index), str(ctx.id), str(ctx.pid), str(ctx.uid), server, ctx.namespace),
                                figures, None if latency is None else latency.statistics()))
        memory = daemon.host_memory
        host: dict[str, float] = {
            "mpsd_host_memory_resident_bytes": memory.resident, "mpsd_host_memory_budget_bytes": memory.budget,
            "mpsd_clients_waiting": len(daemon.control.state.waiting)}
        return Snapshot(devices, clients, host)

    def _client(self, ctx: Any, dispatched: dict[str, Any] | None) -> dict[str, float]:
        stats = self.daemon.clients.client_statistics(ctx)
        figures = {key: stats[key] for _, _, key in CLIENT_SERIES.values() if key in stats}
        figures["active_thread_percentage"] = ctx.quotas.active_thread_percentage
        figures["sticky_code"] = ctx.sticky.code if ctx.sticky is not None else 0
        if dispatched is not None:  # only under the kernel dispatcher: without it the daemon holds no kernels
            figures["queued"], figures["in_flight"] = dispatched["queued"], dispatched["in_flight"]
        return figures


class _Collector(Collector):
    """Turns a snapshot into metric families, on the request's thread."""

    def __init__(self, take: Callable[[], Snapshot | None]) -> None:
        self._take = take

    def describe(self) -> list[Metric]:
        return []  # (registering must not collect: that needs the trio loop running)

    def collect(self) -> Iterator[Metric]:
        snapshot = self._take()
        if snapshot is None:
            return
        for name, (kind, text) in DEVICE_SERIES.items():
            family = _family(kind, name, text, DEVICE_LABELS)
            for labels, values in snapshot.devices:
                if name in values:
                    family.add_metric(labels, values[name])
            yield family
        for name, (kind, text, key) in CLIENT_SERIES.items():
            family = _family(kind, name, text, CLIENT_LABELS)
            for labels, figures, _ in snapshot.clients:
                if key in figures:
                    family.add_metric(labels, figures[key])
            yield family
        histogram = HistogramMetricFamily(SYNC_SECONDS, SYNC_HELP, labels=CLIENT_LABELS)
        for labels, _, latency in snapshot.clients:
            if latency is not None:
                cumulative, buckets = 0, []
                for bound, count in zip((*latency.bounds, float("inf")), latency.counts):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
                histogram.add_metric(labels, buckets, latency.total)
        yield histogram
        for name, (kind, text) in HOST_SERIES.items():
            family = _family(kind, name, text, ())
            family.add_metric((), snapshot.host[name])
            yield family


def _family(kind: str, name: str, text: str, labels: tuple[str, ...]) -> CounterMetricFamily | GaugeMetricFamily:
    return (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, labels=labels)
