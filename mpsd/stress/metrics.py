# The figures of a stress run, computed from its Timeline alone, so a run against the daemon and a run in
# virtual time are judged by the same code. Pure functions: no I/O, no clock.
# A timeline can hold a few hundred thousand spans, so everything that depends on what was resident at once
# is one numpy sweep over sorted start/end events, never a loop over instants or over tenants x spans.
"""Metrics of one stress run: latency percentiles, shares and fairness, quota checks, work conservation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpsd.record.timeline import Timeline

__all__ = ["jain_index", "latency_summary", "occupancy", "percentile", "summarize"]

HOST_SHARE_WARNING = 0.1  # share of a request's latency spent issuing it, past which the wall clock misleads


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile: the smallest value with at least q% of the values at or below it.

    Args:
        values: the sample, in any order; must not be empty.
        q: the percentile, in [0, 100]; fractional ranks such as 99.9 work. q = 0 gives the minimum.

    Returns:
        One of the values.

    Raises:
        ValueError: values is empty or q is outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of an empty sample")
    # Rounded first so that 99.9% of 1000 is rank 999, not 1000 through 99.9 * 1000 / 100 = 999.0000000000001.
    rank = math.ceil(round(q * len(ordered) / 100, 9))
    return float(ordered[min(max(rank, 1), len(ordered)) - 1])


def latency_summary(latencies: Sequence[float]) -> dict[str, float | None]:
    """p50, p99, p99.9, max and mean of latencies given in seconds, in milliseconds.

    Args:
        latencies: seconds.

    Returns:
        ``{"p50", "p99", "p99.9", "max", "mean"}`` in ms; every value None when there is no latency to summarise.
    """
    if len(latencies) == 0:
        return {"p50": None, "p99": None, "p99.9": None, "max": None, "mean": None}
    ms = [x * 1e3 for x in latencies]
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "p99.9": percentile(ms, 99.9),
            "max": max(ms), "mean": math.fsum(ms) / len(ms)}


def jain_index(xs: Sequence[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one has everything.

    Args:
        xs: non-negative amounts (here: SM-time shares divided by entitlements).

    Returns:
        The index in [1/n, 1]; 1.0 for an empty list or all zeros, which are equal shares of nothing.
    """
    squares = math.fsum(x * x for x in xs)
    if squares == 0:
        return 1.0
    return math.fsum(xs) ** 2 / (len(xs) * squares)


def summarize(timeline: Timeline, solo_p99: dict[str, float] | None = None) -> dict[str, Any]:
    """Every figure of a run, overall and per tenant, ready for ``json.dumps``.

    Requests, kernels and spans of tenants missing from ``timeline.tenants`` count in the overall figures only.
    A request has completed if it has no error and a completion time; spans of zero length occupy nothing.

    Args:
        timeline: the run.
        solo_p99: tenant name -> its p99 latency when it ran alone, in seconds (for "isolation").

    Returns:
        A dict of floats, ints, strings, None, lists and dicts: policy, virtual, duration_s, requests, completed,
        errors, throughput_per_s, latency_ms (a ``latency_summary``), jain_index (over the normalised shares of
        tenants with an entitlement), sm_seconds, idle_sm_seconds_while_queued, quota_violations, and tenants:
        one dict per tenant in timeline order (its own counts, throughput and latency_ms, slo_attainment,
        isolation, sm_seconds, sm_share, entitlement, normalised_share, max_sms, sm_cap, sm_cap_violations,
        memory_high_water, mem_limit, memory_violations, longest_wait_ms, kernels, blocks). Times in the
        names' units; a kernel that never started counts as waiting until the end of the run. Of a run whose
        device was not traced (Timeline.traced), the figures drawn from the device's side are None: jain_index,
        sm_seconds, idle_sm_seconds_while_queued, quota_violations, and each tenant's sm_seconds, sm_share,
        normalised_share, max_sms, sm_cap_violations, longest_wait_ms, kernels and blocks.
    """
    solo_p99 = solo_p99 or {}
    names = [t.name for t in timeline.tenants]
    index = {name: i for i, name in enumerate(names)}
    n = len(names)  # index n collects records of unlisted tenants
    duration = timeline.duration

    latencies: list[list[float]] = [[] for _ in range(n + 1)]
    requests = [0] * (n + 1)
    errors = [0] * (n + 1)
    on_time = [0] * (n + 1)
    host_shares: list[list[float]] = [[] for _ in range(n + 1)]
    error_names: list[dict[str, int]] = [{} for _ in range(n + 1)]
    deadlines = [t.deadline for t in timeline.tenants] + [None]
    for r in timeline.requests:
        i = index.get(r.tenant, n)
        requests[i] += 1
        if r.error is not None:
            errors[i] += 1
            error_names[i][r.error] = error_names[i].get(r.error, 0) + 1
        elif math.isfinite(r.completed):
            latencies[i].append(r.latency)
            if r.latency > 0:
                host_shares[i].append(r.host / r.latency)
            if (deadline := deadlines[i]) is not None and r.latency <= deadline:
                on_time[i] += 1

    spans = _span_arrays(timeline, index)
    sm_seconds = np.bincount(spans["tenant"], weights=(spans["end"] - spans["start"]) * spans["fraction"],
                             minlength=n + 1)
    total_sm_seconds = float(sm_seconds.sum())
    max_sms = _max_sms_per_tenant(spans, timeline.sm_count, n + 1)

    kernels = [0] * (n + 1)
    blocks = [0] * (n + 1)
    longest_wait = [0.0] * (n + 1)
    for k in timeline.kernels:
        i = index.get(k.tenant, n)
        kernels[i] += 1
        blocks[i] += k.blocks
        # A kernel that never started waited until the end of the run: starvation must not hide.
        first_block = k.started if math.isfinite(k.started) else max(duration, k.ready)
        longest_wait[i] = max(longest_wait[i], first_block - (k.ready + timeline.launch_overhead))

    rows: list[dict[str, Any]] = []
    for i, t in enumerate(timeline.tenants):
        completed = len(latencies[i])
        lat = latency_summary(latencies[i])
        share = float(sm_seconds[i]) / total_sm_seconds if total_sm_seconds else 0.0
        high_water = timeline.memory_high_water.get(t.name, 0)
        solo = solo_p99.get(t.name)
        rows.append({
            "tenant": t.name, "group": t.group,
            "requests": requests[i], "completed": completed, "errors": errors[i],
            "errors_by_name": dict(sorted(error_names[i].items())),
            "throughput_per_s": completed / duration if duration > 0 else 0.0,
            "latency_ms": lat,
            "slo_attainment": on_time[i] / requests[i] if t.deadline is not None and requests[i] else None,
            "isolation": lat["p99"] / (solo * 1e3) if solo and lat["p99"] is not None else None,
            "sm_seconds": float(sm_seconds[i]), "sm_share": share,
            "entitlement": t.entitlement,
            "normalised_share": share / t.entitlement if t.entitlement > 0 else None,
            "max_sms": int(max_sms[i]), "sm_cap": t.sm_cap,
            "sm_cap_violations": int(t.sm_cap is not None and max_sms[i] > t.sm_cap),
            "memory_high_water": high_water, "mem_limit": t.mem_limit,
            "memory_violations": int(t.mem_limit is not None and high_water > t.mem_limit),
            "longest_wait_ms": max(longest_wait[i], 0.0) * 1e3,
            "kernels": kernels[i], "blocks": blocks[i],
            "host_share": float(np.median(host_shares[i])) if host_shares[i] else None,
            "allocator": timeline.allocators.get(t.name),
        })

    if not timeline.traced:  # nothing was seen of the device: its figures are unknown, not zero
        for row in rows:
            row.update(dict.fromkeys(("sm_seconds", "sm_share", "normalised_share", "max_sms", "sm_cap_violations",
                                      "longest_wait_ms", "kernels", "blocks")))
    completed_all = [x for per_tenant in latencies for x in per_tenant]
    # Under the wall clock, time a tenant took to issue its requests is this host's, not an H200 host's.
    slow = sorted(r["tenant"] for r in rows if not timeline.virtual and (r["host_share"] or 0.0) > HOST_SHARE_WARNING)
    return {
        "policy": timeline.policy, "virtual": timeline.virtual, "duration_s": duration, "lag_ms": timeline.lag * 1e3,
        "requests": sum(requests), "completed": len(completed_all), "errors": sum(errors),
        "throughput_per_s": len(completed_all) / duration if duration > 0 else 0.0,
        "latency_ms": latency_summary(completed_all),
        **({"jain_index": jain_index([r["normalised_share"] for r in rows if r["normalised_share"] is not None]),
            "sm_seconds": total_sm_seconds,
            "idle_sm_seconds_while_queued": _idle_sm_seconds_while_queued(timeline, spans),
            "quota_violations": sum(r["sm_cap_violations"] + r["memory_violations"] for r in rows)}
           if timeline.traced else
           dict.fromkeys(("jain_index", "sm_seconds", "idle_sm_seconds_while_queued", "quota_violations"))),
        "tenants": rows,
        "host_time_warning": (f"host time is more than {HOST_SHARE_WARNING:.0%} of the median latency of "
                              f"{', '.join(slow)}: those figures are this host's speed, not the GPU's; run with "
                              "--clock virtual") if slow else None,
    }


def occupancy(timeline: Timeline, bins: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """How many SMs each tenant held, on average, in each of ``bins`` equal slices of the run.

    An SM counts by the share of it a span holds (its sm_fraction), so the tenants' values add up to at most
    the device's SM count.

    Args:
        timeline: the run; the window is [0, duration] (or up to the last span's end if duration is 0).
        bins: number of slices, at least 1.

    Returns:
        (edges, per tenant): the bins + 1 edges in seconds, and tenant name -> array of bins mean SMs occupied,
        for every tenant of ``timeline.tenants``.

    Raises:
        ValueError: bins < 1.
    """
    if bins < 1:
        raise ValueError(f"occupancy needs at least one bin, not {bins}")
    index = {t.name: i for i, t in enumerate(timeline.tenants)}
    spans = _span_arrays(timeline, index)
    end = timeline.duration if timeline.duration > 0 else float(spans["end"].max(initial=0.0))
    edges = np.linspace(0.0, end, bins + 1)
    result = {t.name: np.zeros(bins) for t in timeline.tenants}
    if end <= 0:
        return edges, result
    # The occupancy of a tenant is a step function; its integral F(t) is piecewise linear, and
    # F(t) = t * (sum of slopes so far) - (sum of slope x time so far) over the start/end events up to t.
    times, tenant, slope = _events(spans["tenant"], spans["start"], spans["end"], spans["fraction"])
    order = np.lexsort((times, tenant))
    times, tenant, slope = times[order], tenant[order], slope[order]
    bounds = np.searchsorted(tenant, np.arange(len(index) + 1))
    for name, i in index.items():
        t, s = times[bounds[i]:bounds[i + 1]], slope[bounds[i]:bounds[i + 1]]
        if len(t) == 0:
            continue
        rate, offset = np.cumsum(s), np.cumsum(s * t)
        seen = np.searchsorted(t, edges, side="right") - 1
        integral = np.where(seen >= 0, edges * rate[seen] - offset[seen], 0.0)
        result[name] = np.diff(integral) / np.diff(edges)
    return edges, result


def _span_arrays(timeline: Timeline, index: dict[str, int]) -> dict[str, np.ndarray]:
    """The spans of positive length as columns; tenant is the index in ``index``, len(index) if not in it."""
    spans = timeline.spans
    kept = spans.end > spans.start
    return {
        "tenant": spans.codes(index, len(index))[kept],
        "sm": spans.sm[kept],
        "kernel": spans.kernel[kept],
        # To the nanosecond (the trace's resolution): a group ending as the next starts must meet it exactly,
        # and times that went through the trace's microseconds or a clock shift can be an ulp apart.
        "start": np.round(spans.start[kept] * 1e9) / 1e9,
        "end": np.round(spans.end[kept] * 1e9) / 1e9,
        "fraction": spans.sm_fraction[kept],
    }


def _events(key: np.ndarray, start: np.ndarray, end: np.ndarray, weight: np.ndarray | None = None):
    """Interval starts and ends as one list of events: (times, keys, +weight at starts / -weight at ends)."""
    w = np.ones(len(start)) if weight is None else weight
    return np.concatenate([start, end]), np.concatenate([key, key]), np.concatenate([w, -w])


def _occupied_changes(key: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Where the union of the intervals of each key begins (+1) and ends (-1): (times, keys, steps).

    Overlapping intervals of one key (block groups sharing an SM) make one occupied stretch.
    """
    # A run has millions of spans: the events' arrays are the largest a run makes, so the steps are small
    # integers (counts are exact in any type) and each array is reordered on its own, its unsorted copy freed.
    times, keys = np.concatenate([start, end]), np.concatenate([key, key])
    delta = np.concatenate([np.ones(len(start), dtype=np.int8), np.full(len(end), -1, dtype=np.int8)])
    order = np.lexsort((delta, times, keys))  # by key, then time, ends before starts at the same time
    times = times[order]
    keys = keys[order]
    delta = delta[order]
    del order
    # Each key's events sum to zero, so one running count over all keys restarts at 0 for every key.
    count = np.cumsum(delta, dtype=np.int64)
    step = (count > 0).astype(np.int64) - (count - delta > 0)
    del count
    changed = step != 0
    return times[changed], keys[changed], step[changed]


def _max_sms_per_tenant(spans: dict[str, np.ndarray], sm_count: int, tenants: int) -> np.ndarray:
    """The most distinct SMs each tenant held at any one instant."""
    width = max(sm_count, int(spans["sm"].max(initial=0)) + 1)
    times, keys, step = _occupied_changes(spans["tenant"] * width + spans["sm"], spans["start"], spans["end"])
    tenant = keys // width
    # Per tenant in time order, a release before an acquisition at the same instant: SMs handed over
    # from one block group to the next at time t are not held twice.
    order = np.lexsort((step, times, tenant))
    held = np.cumsum(step[order])
    most = np.zeros(tenants, dtype=np.int64)
    np.maximum.at(most, tenant[order], held)
    return most


def _idle_sm_seconds_while_queued(timeline: Timeline, spans: dict[str, np.ndarray]) -> float:
    """SM-seconds of SMs with nothing resident while at least one kernel was queued (0 = work conserving).

    A kernel is queued from its stream's turn (KernelRecord.ready) + launch_overhead until its last span starts.
    """
    kernel_ids, of_kernel = np.unique(spans["kernel"], return_inverse=True)
    latest = np.full(len(kernel_ids), -np.inf)
    np.maximum.at(latest, of_kernel, spans["start"])
    last_start = dict(zip(kernel_ids.tolist(), latest.tolist()))
    ready = [(k.ready + timeline.launch_overhead, last_start[k.kernel])
             for k in timeline.kernels if k.kernel in last_start]
    queued = np.array([q for q in ready if q[1] > q[0]], dtype=float).reshape(-1, 2)
    if len(queued) == 0:
        return 0.0
    busy_t, _, busy_step = _occupied_changes(spans["sm"], spans["start"], spans["end"])
    # As in _occupied_changes, each array of the events goes as soon as what is made from it is there.
    times = np.concatenate([busy_t, queued[:, 0], queued[:, 1]])
    busy = np.concatenate([busy_step, np.zeros(2 * len(queued), dtype=np.int64)])
    waiting = np.concatenate([np.zeros(len(busy_t), dtype=np.int64),
                              np.ones(len(queued), dtype=np.int64), -np.ones(len(queued), dtype=np.int64)])
    del busy_t, _, busy_step
    order = np.argsort(times, kind="stable")
    times = times[order]
    busy = np.cumsum(busy[order])
    waiting = np.cumsum(waiting[order])
    del order
    # After the i-th event the state holds until the next event; events at the same instant bound
    # zero-length stretches, so their order does not matter.
    idle = (timeline.sm_count - busy[:-1]) * (waiting[:-1] > 0) * np.diff(times)
    return float(idle.sum())
