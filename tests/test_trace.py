# The Chrome/Perfetto trace of a Timeline: it is a well-formed Chrome trace that Perfetto draws whole (slices on
# one row nest), and it carries the whole Timeline back.
from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.record.timeline import KernelRecord, Request, Span, Spans, TenantInfo, Timeline
from mpsd.record.trace import as_drawn, chrome_trace, load_trace, read_chrome_trace, write_trace


def rich_timeline() -> Timeline:
    """Two MIG partitions; spans sharing an SM, back to back, of zero length; overlapping and failed requests;
    a kernel that never started; a tenant with nothing recorded; odd float times."""
    tenants = [
        TenantInfo("infer#0", "infer", sm_cap=16, mem_limit=1 << 30, entitlement=0.5, deadline=0.002, priority=0),
        TenantInfo("train#0", "train", sm_cap=None, mem_limit=None, entitlement=0.5, deadline=None, priority=1),
        TenantInfo("idle#0", "idle", entitlement=0.0),
    ]
    requests = [
        Request("infer#0", 0.0, 0.0015),
        Request("infer#0", 0.001, 0.0031),  # overlaps the previous one
        Request("train#0", 0.0001, 0.1 + 1 / 3),
        Request("train#0", 0.2, error="cudaErrorIllegalAddress"),
    ]
    kernels = [
        KernelRecord("infer#0", 1, "gemv", 64, 0.0, 0.00001, 0.0014),
        KernelRecord("train#0", 2, "matmul", 528, 0.0001, 0.00011, 0.1 + 1 / 3),
        KernelRecord("train#0", 3, "matmul", 528, 0.3),
    ]
    spans = [
        Span("infer#0", 1, 0, 2, 0.25, 0.00001, 0.0007),
        Span("infer#0", 1, 0, 2, 0.25, 0.0007, 0.0014),  # back to back with the first, same SM
        Span("train#0", 2, 0, 1, 0.5, 0.00011, 0.1 + 1 / 3),  # shares SM 0 with both
        Span("train#0", 2, 1, 1, 1.0, 0.00011, 0.00011),  # zero length
        Span("train#0", 2, 20, 4, 1.0, 0.00011, 0.1 + 1 / 3),
    ]
    return Timeline("mig", sm_count=132, duration=0.1 + 1 / 3, launch_overhead=1e-5, tenants=tenants,
                    requests=requests, kernels=kernels, spans=Spans.of_rows(spans),
                    memory_high_water={"infer#0": 123456789, "train#0": 70 << 30},
                    partitions=[("0: 3g.71gb", 0, 16), ("1: 3g.71gb", 16, 32)], virtual=True)


def same_float(a: float, b: float, ulps_of: float = 0.0) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=ulps_of)


def assert_same_timeline(got: Timeline, want: Timeline) -> None:
    """Equal, spans and requests in any order, span times to the nanosecond the trace keeps."""
    scalars = ("policy", "sm_count", "duration", "launch_overhead", "tenants", "memory_high_water", "partitions",
               "virtual")
    assert {f: getattr(got, f) for f in scalars} == {f: getattr(want, f) for f in scalars}

    # exact, NaN included (repr writes every float in full)
    assert list(map(repr, got.kernels)) == list(map(repr, want.kernels))
    assert sorted(map(repr, got.requests)) == sorted(map(repr, want.requests))
    assert len(got.spans) == len(want.spans)

    def span_order(s: Span):
        return s.sm, round(s.start * 1e9), round(s.end * 1e9), s.kernel, s.tenant, s.blocks, s.sm_fraction

    for g, w in zip(sorted(got.spans, key=span_order), sorted(want.spans, key=span_order)):
        assert (g.tenant, g.kernel, g.sm, g.blocks, g.sm_fraction) == (w.tenant, w.kernel, w.sm, w.blocks,
                                                                       w.sm_fraction)
        assert same_float(g.start, w.start, 1e-9) and same_float(g.end, w.end, 1e-9)


def test_round_trip_through_json(tmp_path):
    timeline = rich_timeline()
    write_trace(tmp_path / "t.json", timeline)
    assert_same_timeline(load_trace(tmp_path / "t.json"), timeline)


def test_is_a_well_formed_chrome_trace():
    data = json.loads(json.dumps(chrome_trace(rich_timeline()), allow_nan=False))
    assert data["displayTimeUnit"] == "ms"
    for e in data["traceEvents"]:
        assert {"ph", "pid", "tid", "ts", "name"} <= set(e), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
        else:
            assert e["ph"] == "M", e


def test_tracks_are_named_for_partitions_sms_and_tenants():
    events = chrome_trace(rich_timeline())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    by_name = {name: pid for pid, name in processes.items()}
    assert set(by_name) == {"0: 3g.71gb", "1: 3g.71gb", "tenants"}
    # SM rows only where spans ran, SM 0 split in two for the block groups that share it
    sm_rows = sorted(name for (pid, _), name in threads.items() if pid != by_name["tenants"])
    assert sm_rows == ["SM 0", "SM 0 (2)", "SM 1", "SM 20"]
    assert {threads[e["pid"], e["tid"]] for e in events if e.get("args", {}).get("sm") == 20} == {"SM 20"}
    assert {e["pid"] for e in events if e.get("args", {}).get("sm") == 20} == {by_name["1: 3g.71gb"]}
    tenant_rows = sorted(name for (pid, _), name in threads.items() if pid == by_name["tenants"])
    # infer#0's requests overlap; train#0's failure is an instant during its long request
    assert tenant_rows == ["idle#0", "infer#0", "infer#0 (2)", "train#0", "train#0 (2)"]
    assert {e["name"] for e in events if e["ph"] == "X"} == {"infer#0", "train#0"}  # slices coloured by tenant
    sort_keys = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_sort_index"}
    assert sort_keys == set(threads)


def assert_rows_nest(data: dict) -> None:
    """Perfetto drops complete events that overlap on a row without nesting; there must be none."""
    rows = defaultdict(list)
    for e in data["traceEvents"]:
        if e["ph"] == "X":
            rows[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for row in rows.values():
        row.sort(key=lambda iv: (iv[0], -iv[1]))
        open_ends: list[float] = []
        for start, end in row:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"{(start, end)} overlaps a slice ending {open_ends[-1]}"
            open_ends.append(end)


def test_slices_on_a_row_nest():
    assert_rows_nest(chrome_trace(rich_timeline()))


def test_refuses_a_trace_it_did_not_write():
    with pytest.raises(ValueError):
        read_chrome_trace({"traceEvents": [], "displayTimeUnit": "ms"})
    broken = chrome_trace(rich_timeline())
    del broken["otherData"]["tenants"]
    with pytest.raises(ValueError):
        read_chrome_trace(broken)


floats = st.floats(0, 10, allow_nan=False)


@st.composite
def timelines(draw) -> Timeline:
    names = draw(st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=3, unique=True))
    tenants = [TenantInfo(n, draw(st.sampled_from(["a", "b"])), draw(st.none() | st.integers(1, 8)),
                          draw(st.none() | st.integers(0, 1 << 40)), draw(st.floats(0, 1)),
                          draw(st.none() | floats), draw(st.integers(0, 3))) for n in names]
    tenant = st.sampled_from(names)
    requests = draw(st.lists(st.builds(
        lambda t, s, d, err: Request(t, s, math.nan if err else s + d, err),
        tenant, floats, floats, st.none() | st.just("cudaErrorLaunchFailure")), max_size=6))
    kernels = draw(st.lists(st.builds(KernelRecord, tenant, st.integers(0, 5), st.text(max_size=4),
                                      st.integers(1, 100), floats, floats | st.just(math.nan),
                                      floats | st.just(math.nan)), max_size=4))
    spans = draw(st.lists(st.builds(lambda t, k, sm, b, f, s, d: Span(t, k, sm, b, f, s, s + d), tenant,
                                    st.integers(0, 5), st.integers(0, 7), st.integers(1, 32),
                                    st.floats(0.01, 1), floats, floats), max_size=8))
    partitions = draw(st.sampled_from([[], [("a", 0, 4), ("b", 4, 6)]]))
    return Timeline(draw(st.sampled_from(["mps", "mig"])), 8, draw(floats), draw(floats), tenants, requests,
                    kernels, Spans.of_rows(spans), {n: draw(st.integers(0, 1 << 40)) for n in names[:1]}, partitions,
                    draw(st.booleans()))


@settings(max_examples=100, deadline=None)
@given(timelines())
def test_any_timeline_round_trips_and_nests(timeline):
    data = json.loads(json.dumps(chrome_trace(timeline), allow_nan=False))
    assert_same_timeline(read_chrome_trace(data), timeline)
    assert_rows_nest(data)


@settings(max_examples=200, deadline=None)
@given(timelines())
def test_as_drawn_is_the_trace_read_back_to_the_bit(timeline):
    """What mpsd-stress --virtual-time reads its device as, with no file, is what a run of real processes reads
    from the daemon's trace file: the same spans in the same order, every float to the bit (repr is exact)."""
    for t in (timeline, rich_timeline()):
        data = json.loads(json.dumps(chrome_trace(t), allow_nan=False))
        assert repr(as_drawn(t)) == repr(read_chrome_trace(data))
