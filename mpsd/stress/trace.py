# A Timeline as Chrome trace JSON, the format ui.perfetto.dev and chrome://tracing open, and back again. The
# daemon writes its timeline with it when asked to record one, and mpsd-stress writes one per run, so this
# module stays light: standard library only (no numpy, matplotlib or trio).
#
# Layout: one process per device (or per MIG partition), one thread row per SM; each span is a complete ("X")
# event named after its tenant, because Perfetto colours slices by name. A "tenants" process has a row per
# tenant with its requests. Complete events on one row must nest, and block groups sharing an SM or requests
# of an open-loop tenant overlap without nesting (Perfetto drops such slices), so a row that needs it is
# split into lanes: "SM 3", "SM 3 (2)", ... Everything that is not an event (tenants, kernels, settings)
# travels in otherData, so read_chrome_trace rebuilds the Timeline from the file alone.
"""Chrome/Perfetto trace JSON for a Timeline."""

from __future__ import annotations

import heapq
import json
import math
from collections import defaultdict
from os import PathLike
from typing import Any

from mpsd.stress.timeline import KernelRecord, Request, Span, TenantInfo, Timeline

__all__ = ["as_drawn", "chrome_trace", "load_trace", "read_chrome_trace", "write_trace"]

FORMAT = "mpsd-timeline/1"
# Column order of a kernel record in otherData["kernels"]: lists are a third the size of dicts.
KERNEL_FIELDS = ("tenant", "kernel", "name", "blocks", "submitted", "started", "ended", "eligible")


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The timeline as a Chrome trace: ``{"traceEvents", "displayTimeUnit", "otherData"}``.

    Times become microseconds rounded to the nanosecond (the resolution Perfetto keeps), so that spans
    that touch in the timeline touch in the trace.

    Args:
        timeline: the run to draw.

    Returns:
        A JSON-ready dict (no NaN: times that never happened are None).
    """
    device_events, processes = _device_events(timeline)
    return {"traceEvents": device_events + _tenant_events(timeline, len(processes) + 1),
            "displayTimeUnit": "ms", "otherData": _other_data(timeline)}


def read_chrome_trace(data: dict[str, Any]) -> Timeline:
    """Rebuild the Timeline that ``chrome_trace`` drew.

    Span times come back from the events' microseconds (to the nanosecond); everything else is exact.

    Args:
        data: a parsed trace written by ``chrome_trace``.

    Returns:
        The timeline, its spans and requests in the order they were drawn.

    Raises:
        ValueError: the data is not a trace of an mpsd timeline.
    """
    other = data.get("otherData") if isinstance(data, dict) else None
    if not isinstance(other, dict) or other.get("format") != FORMAT:
        raise ValueError(f"not an mpsd timeline trace (otherData.format is not {FORMAT!r})")
    try:
        timeline = Timeline(
            policy=other["policy"], sm_count=other["sm_count"], duration=other["duration"],
            launch_overhead=other["launch_overhead"], virtual=other["virtual"], lag=other.get("lag", 0.0),
            tenants=[TenantInfo(**t) for t in other["tenants"]],
            kernels=[KernelRecord(**{f: _float_or_nan(v) if f in ("submitted", "started", "ended", "eligible") else v
                                     for f, v in zip(KERNEL_FIELDS, k)}) for k in other["kernels"]],
            memory_high_water=dict(other["memory_high_water"]),
            partitions=[(name, first, end) for name, first, end in other["partitions"]],
        )
        for e in data["traceEvents"]:
            if e.get("ph") != "X":
                continue
            args = e["args"]
            if e.get("cat") == "kernel":
                start = e["ts"] / 1e6
                timeline.spans.append(Span(args["tenant"], args["kernel"], args["sm"], args["blocks"],
                                           args["sm_fraction"], start, (e["ts"] + e["dur"]) / 1e6))
            elif e.get("cat") == "request":
                timeline.requests.append(Request(e["name"], args["submitted"], _float_or_nan(args["completed"]),
                                                 args["error"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed mpsd timeline trace: {exc!r}") from None
    return timeline


def as_drawn(timeline: Timeline) -> Timeline:
    """``read_chrome_trace(chrome_trace(timeline))``, to the bit, without drawing a trace: spans in the order
    the trace's rows give them, their times through its nanoseconds, times that never happened as NaN. A run in
    the daemon's own process (mpsd-stress --virtual-time) reads its device so, and gets the very figures that a
    run of real processes reads from the daemon's trace file."""
    processes = _device_processes(timeline)
    pids = {sm: pid for pid, (_, first, end) in enumerate(processes, start=1) for sm in range(first, end)}
    outside = len(processes) + 1  # the whole-device process that SMs outside every partition are drawn on
    rows: defaultdict[int, list[Span]] = defaultdict(list)  # an SM's row, in the order its spans came
    for span in timeline.spans:
        rows[span.sm].append(span)
    spans: list[Span] = []
    add = spans.append
    for sm in sorted(rows, key=lambda sm: (pids.get(sm, outside), sm)):  # rows in the trace's order
        for tenant, kernel, sm, blocks, fraction, start, end in rows[sm]:
            start_ns = round(start * 1e9)  # _ns, inline: this runs for every span of a run
            ts, dur = start_ns / 1e3, (round(end * 1e9) - start_ns) / 1e3  # the event's microseconds, as drawn
            add(Span(tenant, kernel, sm, blocks, fraction, ts / 1e6, (ts + dur) / 1e6))
    by_tenant: dict[str, list[Request]] = {t.name: [] for t in timeline.tenants}
    for r in timeline.requests:
        by_tenant.setdefault(r.tenant, []).append(Request(r.tenant, r.submitted, _finite(r.completed), r.error))
    return Timeline(
        policy=timeline.policy, sm_count=timeline.sm_count, duration=timeline.duration,
        launch_overhead=timeline.launch_overhead, virtual=timeline.virtual, lag=timeline.lag,
        tenants=[TenantInfo(t.name, t.group, t.sm_cap, t.mem_limit, t.entitlement, t.deadline, t.priority)
                 for t in timeline.tenants],
        kernels=[KernelRecord(k.tenant, k.kernel, k.name, k.blocks, _finite(k.submitted), _finite(k.started),
                              _finite(k.ended), _finite(k.eligible)) for k in timeline.kernels],
        memory_high_water=dict(timeline.memory_high_water),
        partitions=[(name, first, end) for name, first, end in timeline.partitions],
        spans=spans, requests=[r for requests in by_tenant.values() for r in requests])


def write_trace(path: str | PathLike[str], timeline: Timeline) -> None:
    """Write ``chrome_trace(timeline)`` to a JSON file, compact.

    Raises:
        OSError: the file cannot be written.
    """
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(timeline), f, separators=(",", ":"), allow_nan=False)


def load_trace(path: str | PathLike[str]) -> Timeline:
    """Read a trace file written by ``write_trace``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON, or not a trace of an mpsd timeline.
    """
    with open(path, encoding="utf-8") as f:
        return read_chrome_trace(json.load(f))


def _device_events(timeline: Timeline) -> tuple[list[dict[str, Any]], list[tuple[str, int, int]]]:
    """The spans on SM rows of the device (or partition) processes, pids from 1; and those processes."""
    names = {k.kernel: k.name for k in timeline.kernels}
    processes = _device_processes(timeline)
    pids = {sm: pid for pid, (_, first, end) in enumerate(processes, start=1) for sm in range(first, end)}
    rows: dict[tuple[int, int], list[tuple[int, int, Span]]] = {}  # (pid, sm) -> its spans
    outside: list[int] = []  # the pid of the whole-device process, once one is needed
    for span in timeline.spans:
        pid = pids.get(span.sm)
        if pid is None:  # an SM outside every MIG partition: all such go on one whole-device process
            if not outside:
                processes.append((_device_name(timeline), 0, timeline.sm_count))
                outside.append(len(processes))
            pid = pids[span.sm] = outside[0]
        rows.setdefault((pid, span.sm), []).append((_ns(span.start), _ns(span.end), span))
    events: list[dict[str, Any]] = []
    for pid, (name, _, _) in enumerate(processes, start=1):
        events += _metadata(pid, 0, "process_name", name) + _metadata(pid, 0, "process_sort_index", pid)
    lanes = {row: _lanes(spans) for row, spans in rows.items()}
    width = max((max(row_lanes) + 1 for row_lanes in lanes.values()), default=1)  # tids keep rows in SM order
    for (pid, sm), spans in sorted(rows.items()):
        for lane in range(max(lanes[pid, sm]) + 1):
            tid = sm * width + lane + 1
            label = f"SM {sm}" if lane == 0 else f"SM {sm} ({lane + 1})"
            events += _metadata(pid, tid, "thread_name", label) + _metadata(pid, tid, "thread_sort_index", tid)
        for (start, end, span), lane in zip(spans, lanes[pid, sm]):
            events.append({
                "name": span.tenant, "cat": "kernel", "ph": "X", "ts": start / 1e3, "dur": (end - start) / 1e3,
                "pid": pid, "tid": sm * width + lane + 1,
                "args": {"tenant": span.tenant, "kernel": span.kernel, "kernel_name": names.get(span.kernel),
                         "sm": span.sm, "blocks": span.blocks, "sm_fraction": span.sm_fraction},
            })
    return events, processes


def _tenant_events(timeline: Timeline, pid: int) -> list[dict[str, Any]]:
    """The "tenants" process: a row (or more, see _lanes) per tenant with its requests."""
    events = _metadata(pid, 0, "process_name", "tenants") + _metadata(pid, 0, "process_sort_index", pid)
    by_tenant: dict[str, list[tuple[int, int, Request]]] = {t.name: [] for t in timeline.tenants}
    for r in timeline.requests:
        end = r.completed if math.isfinite(r.completed) else r.submitted  # a failed request is an instant
        by_tenant.setdefault(r.tenant, []).append((_ns(r.submitted), _ns(end), r))
    tid = 1
    for tenant, requests in by_tenant.items():
        lanes = _lanes(requests)
        for lane in range(max(lanes, default=0) + 1):
            label = tenant if lane == 0 else f"{tenant} ({lane + 1})"
            events += (_metadata(pid, tid + lane, "thread_name", label)
                       + _metadata(pid, tid + lane, "thread_sort_index", tid + lane))
        for (start, end, r), lane in zip(requests, lanes):
            events.append({
                "name": r.tenant, "cat": "request", "ph": "X", "ts": start / 1e3, "dur": (end - start) / 1e3,
                "pid": pid, "tid": tid + lane,
                "args": {"submitted": r.submitted, "completed": _json_float(r.completed), "error": r.error},
            })
        tid += max(lanes, default=0) + 1
    return events


def _device_processes(timeline: Timeline) -> list[tuple[str, int, int]]:
    """(name, first SM, end SM) of each device process: the MIG partitions, else the whole device."""
    if timeline.partitions:
        return [(name, first, end) for name, first, end in timeline.partitions]
    return [(_device_name(timeline), 0, timeline.sm_count)]


def _device_name(timeline: Timeline) -> str:
    return f"GPU ({timeline.policy}, {timeline.sm_count} SMs)"


def _lanes(intervals: list[tuple[int, int, Any]]) -> list[int]:
    """A lane for each (start, end, _) so that no two overlapping intervals share one: as few as overlap."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i][:2])
    lanes = [0] * len(intervals)
    free: list[tuple[int, int]] = []  # (end of its last interval, lane)
    used = 0
    for i in order:
        start, end, _ = intervals[i]
        if free and free[0][0] <= start:
            _, lanes[i] = heapq.heappop(free)
        else:
            lanes[i], used = used, used + 1
        heapq.heappush(free, (end, lanes[i]))
    return lanes


def _metadata(pid: int, tid: int, name: str, value: Any) -> list[dict[str, Any]]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return [{"name": name, "ph": "M", "pid": pid, "tid": tid, "ts": 0, "args": {key: value}}]


def _other_data(timeline: Timeline) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "policy": timeline.policy, "sm_count": timeline.sm_count, "duration": timeline.duration,
        "launch_overhead": timeline.launch_overhead, "virtual": timeline.virtual, "lag": timeline.lag,
        "tenants": [{"name": t.name, "group": t.group, "sm_cap": t.sm_cap, "mem_limit": t.mem_limit,
                     "entitlement": t.entitlement, "deadline": t.deadline, "priority": t.priority}
                    for t in timeline.tenants],
        "memory_high_water": dict(timeline.memory_high_water),
        "partitions": [list(p) for p in timeline.partitions],
        "kernels": [[k.tenant, k.kernel, k.name, k.blocks, _json_float(k.submitted), _json_float(k.started),
                     _json_float(k.ended), _json_float(k.eligible)] for k in timeline.kernels],
    }


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _json_float(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _float_or_nan(x: Any) -> Any:
    return math.nan if x is None else x


def _finite(x: float) -> float:
    """What a time comes back as from a trace: itself if it happened (is finite), else NaN."""
    return x if math.isfinite(x) else math.nan
