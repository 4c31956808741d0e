# A Timeline as Chrome trace JSON, the format ui.perfetto.dev and chrome://tracing open, and back again. The
# daemon writes its timeline with it when asked to record one, and mpsd-stress writes one per run, so this
# module stays light: the standard library and numpy (which the daemon has loaded already), no matplotlib or trio.
#
# Layout: one process per device (or per MIG partition), one thread row per SM; each span is a complete ("X")
# event named after its tenant, because Perfetto colours slices by name. A "tenants" process has a row per
# tenant with its requests. Complete events on one row must nest, and block groups sharing an SM or requests
# of an open-loop tenant overlap without nesting (Perfetto drops such slices), so a row that needs it is
# split into lanes: "SM 3", "SM 3 (2)", ... Everything that is not an event (tenants, kernels, settings)
# travels in otherData, so read_chrome_trace rebuilds the Timeline from the file alone.
# Spans stay columns (numpy) on the way in and out; only the JSON events themselves are made one by one. Times
# go through the nanosecond as Python's round(seconds * 1e9) would take them: np.rint is the same rounding
# (half to even) and the same value, and int-to-float, -, / are the same IEEE operations in float64.
"""Chrome/Perfetto trace JSON for a Timeline."""

from __future__ import annotations

import heapq
import json
import math
from os import PathLike
from typing import Any

import numpy as np

from mpsd.record.timeline import KernelRecord, Request, Spans, TenantInfo, Timeline

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
        names: dict[str, int] = {}
        tenant, kernel, sm, blocks, fraction, ts, dur = [], [], [], [], [], [], []
        for e in data["traceEvents"]:
            if e.get("ph") != "X":
                continue
            args = e["args"]
            if e.get("cat") == "kernel":
                tenant.append(names.setdefault(args["tenant"], len(names)))
                kernel.append(args["kernel"])
                sm.append(args["sm"])
                blocks.append(args["blocks"])
                fraction.append(args["sm_fraction"])
                ts.append(e["ts"])
                dur.append(e["dur"])
            elif e.get("cat") == "request":
                timeline.requests.append(Request(e["name"], args["submitted"], _float_or_nan(args["completed"]),
                                                 args["error"]))
        ts_, dur_ = np.array(ts, dtype=np.float64), np.array(dur, dtype=np.float64)
        timeline.spans = Spans(list(names), tenant, kernel, sm, blocks, fraction, ts_ / 1e6, (ts_ + dur_) / 1e6)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed mpsd timeline trace: {exc!r}") from None
    return timeline


def as_drawn(timeline: Timeline) -> Timeline:
    """``read_chrome_trace(chrome_trace(timeline))``, to the bit, without drawing a trace: spans in the order
    the trace's rows give them, their times through its nanoseconds, times that never happened as NaN. A run in
    the daemon's own process (mpsd-stress --virtual-time) reads its device so, and gets the very figures that a
    run of real processes reads from the daemon's trace file."""
    spans, _, _ = _in_rows(timeline)
    start_ns = _ns_array(spans.start)
    ts, dur = start_ns / 1e3, (_ns_array(spans.end) - start_ns) / 1e3  # the events' microseconds, as drawn
    spans = spans.replace(start=ts / 1e6, end=(ts + dur) / 1e6)
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
    spans, pid, processes = _in_rows(timeline)
    start, end = _ns_array(spans.start), _ns_array(spans.end)
    # Rows are runs of equal (pid, sm) in the sorted table: [bounds[i], bounds[i + 1]).
    cuts = np.flatnonzero((pid[1:] != pid[:-1]) | (spans.sm[1:] != spans.sm[:-1])) + 1
    bounds = [0, *cuts.tolist(), len(spans)] if len(spans) else [0]
    starts, ends = start.tolist(), end.tolist()
    lanes: list[int] = []
    for a, b in zip(bounds, bounds[1:]):
        lanes += _lanes(starts[a:b], ends[a:b])
    width = max(lanes, default=0) + 1  # tids keep rows in SM order
    events: list[dict[str, Any]] = []
    for p, (name, _, _) in enumerate(processes, start=1):
        events += _metadata(p, 0, "process_name", name) + _metadata(p, 0, "process_sort_index", p)
    tenant = spans.tenants().tolist()
    tid = (spans.sm * width + np.array(lanes, dtype=np.int64) + 1).tolist()
    columns = list(zip(tenant, (start / 1e3).tolist(), ((end - start) / 1e3).tolist(), pid.tolist(), tid,
                       spans.kernel.tolist(), spans.sm.tolist(), spans.blocks.tolist(), spans.sm_fraction.tolist()))
    for a, b in zip(bounds, bounds[1:]):
        row_pid, sm = columns[a][3], columns[a][6]
        for lane in range(max(lanes[a:b]) + 1):
            row_tid = sm * width + lane + 1
            label = f"SM {sm}" if lane == 0 else f"SM {sm} ({lane + 1})"
            events += (_metadata(row_pid, row_tid, "thread_name", label)
                       + _metadata(row_pid, row_tid, "thread_sort_index", row_tid))
        events += [{"name": t, "cat": "kernel", "ph": "X", "ts": ts, "dur": dur, "pid": p, "tid": i,
                    "args": {"tenant": t, "kernel": k, "kernel_name": names.get(k), "sm": sm, "blocks": n,
                             "sm_fraction": f}}
                   for t, ts, dur, p, i, k, sm, n, f in columns[a:b]]
    return events, processes


def _in_rows(timeline: Timeline) -> tuple[Spans, np.ndarray, list[tuple[str, int, int]]]:
    """The spans in the order the trace's rows give them (by device process, then SM; each row's spans in the
    order they came), each one's pid, and the device processes: the MIG partitions, else the whole device, and
    after them a whole-device process for SMs outside every partition if a span is on one."""
    spans = timeline.spans
    processes = _device_processes(timeline)
    if not len(spans):
        return spans, np.zeros(0, dtype=np.int64), processes
    pid = _pids(timeline, processes)[spans.sm]
    if (pid > len(processes)).any():
        processes.append((_device_name(timeline), 0, timeline.sm_count))
    order = np.argsort(pid * (int(spans.sm.max()) + 1) + spans.sm, kind="stable")
    return spans.take(order), pid[order], processes


def _pids(timeline: Timeline, processes: list[tuple[str, int, int]]) -> np.ndarray:
    """SM -> the pid of its device process (from 1), for every SM a span is on; len(processes) + 1 for SMs
    outside them all (the whole-device process _in_rows adds then)."""
    width = max([timeline.sm_count, int(timeline.spans.sm.max(initial=-1)) + 1, *(end for _, _, end in processes)])
    pid = np.full(width, len(processes) + 1, dtype=np.int64)
    for p, (_, first, end) in enumerate(processes, start=1):  # a later process wins an SM, as in a dict
        pid[first:end] = p
    return pid


def _tenant_events(timeline: Timeline, pid: int) -> list[dict[str, Any]]:
    """The "tenants" process: a row (or more, see _lanes) per tenant with its requests."""
    events = _metadata(pid, 0, "process_name", "tenants") + _metadata(pid, 0, "process_sort_index", pid)
    by_tenant: dict[str, list[tuple[int, int, Request]]] = {t.name: [] for t in timeline.tenants}
    for r in timeline.requests:
        end = r.completed if math.isfinite(r.completed) else r.submitted  # a failed request is an instant
        by_tenant.setdefault(r.tenant, []).append((_ns(r.submitted), _ns(end), r))
    tid = 1
    for tenant, requests in by_tenant.items():
        lanes = _lanes([start for start, _, _ in requests], [end for _, end, _ in requests])
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


def _lanes(starts: list[Any], ends: list[Any]) -> list[int]:
    """A lane for each interval (starts[i], ends[i]) so that no two overlapping ones share one: as few as
    overlap."""
    order = sorted(range(len(starts)), key=lambda i: (starts[i], ends[i]))
    lanes = [0] * len(starts)
    free: list[tuple[Any, int]] = []  # (end of its last interval, lane)
    used = 0
    for i in order:
        if free and free[0][0] <= starts[i]:
            _, lanes[i] = heapq.heappop(free)
        else:
            lanes[i], used = used, used + 1
        heapq.heappush(free, (ends[i], lanes[i]))
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


def _ns_array(seconds: np.ndarray) -> np.ndarray:
    """_ns of each, as float64 (the same integers: below 2**53 exactly, past it the float round already was);
    + 0.0 makes the -0.0 that rint gives tiny negative times the 0 that round gives."""
    return np.rint(seconds * 1e9) + 0.0


def _json_float(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _float_or_nan(x: Any) -> Any:
    return math.nan if x is None else x


def _finite(x: float) -> float:
    """What a time comes back as from a trace: itself if it happened (is finite), else NaN."""
    return x if math.isfinite(x) else math.nan
