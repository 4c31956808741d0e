# The stress metrics on timelines small enough to work out by hand, and the sweeps against a brute-force
# reading of the same definitions on random timelines.
from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.stress.metrics import jain_index, latency_summary, occupancy, percentile, summarize
from mpsd.record.timeline import KernelRecord, Request, Span, Spans, TenantInfo, Timeline


def hand_timeline() -> Timeline:
    """Four SMs, 0.1 s launch overhead, three tenants; the figures in the tests below are worked out from it.

    SM 0 holds A's kernel 1 over [1, 2) and B's kernel 2 over [1.5, 4) (sharing it over [1.5, 2));
    SM 1 holds kernel 1 over [2, 3); SM 2 kernel 2 over [1.5, 2.5); SM 3 kernel 2 over [3, 4).
    A's kernel 3 never starts. C is entitled to nothing and does nothing.
    """
    tenants = [
        TenantInfo("A", "latency", sm_cap=1, mem_limit=100, entitlement=0.25, deadline=1.0),
        TenantInfo("B", "batch", sm_cap=1, mem_limit=50, entitlement=0.75),
        TenantInfo("C", "batch", entitlement=0.0),
    ]
    requests = [
        Request("A", 0.0, 0.5),
        Request("A", 1.0, 3.0),
        Request("A", 2.0, error="cudaErrorMemoryAllocation"),
        Request("B", 0.0, 4.0),
    ]
    kernels = [
        KernelRecord("A", 1, "spin", 4, submitted=0.0, started=1.0, ended=3.0),
        KernelRecord("B", 2, "matmul", 6, submitted=0.0, started=1.5, ended=4.0),
        KernelRecord("A", 3, "spin", 8, submitted=5.0),
    ]
    spans = [
        Span("A", 1, sm=0, blocks=2, sm_fraction=0.5, start=1.0, end=2.0),
        Span("A", 1, sm=1, blocks=2, sm_fraction=1.0, start=2.0, end=3.0),
        Span("B", 2, sm=0, blocks=2, sm_fraction=0.5, start=1.5, end=4.0),
        Span("B", 2, sm=2, blocks=2, sm_fraction=1.0, start=1.5, end=2.5),
        Span("B", 2, sm=3, blocks=2, sm_fraction=0.25, start=3.0, end=4.0),
    ]
    return Timeline("mps", sm_count=4, duration=10.0, launch_overhead=0.1, tenants=tenants, requests=requests,
                    kernels=kernels, spans=Spans.of_rows(spans), memory_high_water={"A": 80, "B": 60})


def test_percentile_is_nearest_rank():
    """The smallest value with at least q% of the sample at or below it; q = 0 is the minimum."""
    sample = [40, 15, 50, 35, 20]
    assert [percentile(sample, q) for q in (0, 5, 30, 40, 50, 100)] == [15, 15, 20, 20, 35, 50]
    assert percentile(range(1, 1001), 99.9) == 999  # not 1000 through float rounding of 99.9 * 1000 / 100
    assert percentile(range(1, 101), 99.9) == 100


@pytest.mark.parametrize("values, q", [([], 50), ([1.0], -1), ([1.0], 100.5)])
def test_percentile_refuses_what_has_no_answer(values, q):
    with pytest.raises(ValueError):
        percentile(values, q)


def test_latency_summary_in_milliseconds():
    assert latency_summary([0.004, 0.001, 0.003, 0.002]) == pytest.approx(
        {"p50": 2.0, "p99": 4.0, "p99.9": 4.0, "max": 4.0, "mean": 2.5})
    assert latency_summary([]) == {"p50": None, "p99": None, "p99.9": None, "max": None, "mean": None}


@pytest.mark.parametrize("xs, expected", [
    ([1, 1, 1, 1], 1.0), ([1, 0, 0, 0], 0.25), ([1, 2], 0.9), ([], 1.0), ([0, 0], 1.0),
])
def test_jain_index(xs, expected):
    assert jain_index(xs) == pytest.approx(expected)


def test_summary_overall_figures():
    s = summarize(hand_timeline())
    assert (s["policy"], s["virtual"], s["duration_s"]) == ("mps", False, 10.0)
    assert (s["requests"], s["completed"], s["errors"]) == (4, 3, 1)
    assert s["throughput_per_s"] == pytest.approx(0.3)
    assert s["latency_ms"] == pytest.approx({"p50": 2000, "p99": 4000, "p99.9": 4000, "max": 4000, "mean": 6500 / 3})
    # A: 1 s x 0.5 + 1 s x 1; B: 2.5 s x 0.5 + 1 s x 1 + 1 s x 0.25
    assert s["sm_seconds"] == pytest.approx(1.5 + 2.5)
    # shares 0.375 / 0.25 = 1.5 and 0.625 / 0.75 = 5/6 (C has no entitlement): (7/3)^2 / (2 x 106/36)
    assert s["jain_index"] == pytest.approx(49 / 53)
    assert s["quota_violations"] == 2  # B: two SMs at once with a cap of one, 60 bytes over a limit of 50


def test_idle_sm_time_while_kernels_are_queued():
    """Kernels 1 and 2 are queued over [0.1, 2) and [0.1, 3): their union is [0.1, 3); kernel 3 has no spans.

    Busy SMs in that window: none over [0.1, 1), SM 0 over [1, 1.5), SMs 0 and 2 over [1.5, 2), SMs 0, 1, 2 over
    [2, 2.5), SMs 0 and 1 over [2.5, 3): idle 4 x 0.9 + 3 x 0.5 + 2 x 0.5 + 1 x 0.5 + 2 x 0.5.
    """
    assert summarize(hand_timeline())["idle_sm_seconds_while_queued"] == pytest.approx(3.6 + 1.5 + 1.0 + 0.5 + 1.0)


def test_a_kernel_waits_from_its_streams_turn_not_from_its_submission():
    """The second of two back-to-back kernels on one stream is submitted with the first, but is not queued (nor
    starving) while the first runs: its clock starts at its turn (eligible), plus the launch overhead."""
    t = Timeline(policy="mps", sm_count=2, duration=10.0, launch_overhead=1.0,
                 tenants=[TenantInfo("a", "a")],
                 kernels=[KernelRecord("a", 0, "spin", 1, submitted=0.0, started=1.0, ended=5.0, eligible=0.0),
                          KernelRecord("a", 1, "spin", 1, submitted=0.0, started=7.0, ended=9.0, eligible=5.0)],
                 spans=Spans.of_rows([Span("a", 0, 0, 1, 1.0, 1.0, 5.0), Span("a", 1, 0, 1, 1.0, 7.0, 9.0)]))
    s = summarize(t)
    assert s["tenants"][0]["longest_wait_ms"] == pytest.approx(1000.0)  # kernel 1: 7 - (5 + 1)
    # Queued: kernel 1 over [6, 7) with both SMs idle; kernel 0 over [1, 1): nothing.
    assert s["idle_sm_seconds_while_queued"] == pytest.approx(2.0)
    without = replace(t, kernels=[replace(k, eligible=math.nan) for k in t.kernels])  # submission stands in
    assert summarize(without)["tenants"][0]["longest_wait_ms"] == pytest.approx(6000.0)


def test_summary_per_tenant():
    a, b, c = summarize(hand_timeline(), solo_p99={"A": 0.5})["tenants"]
    assert (a["tenant"], a["group"], a["requests"], a["completed"], a["errors"]) == ("A", "latency", 3, 2, 1)
    assert a["throughput_per_s"] == pytest.approx(0.2)
    assert a["latency_ms"] == pytest.approx({"p50": 500, "p99": 2000, "p99.9": 2000, "max": 2000, "mean": 1250})
    assert a["slo_attainment"] == pytest.approx(1 / 3)  # one of three within 1 s; the failed one counts as missed
    assert a["isolation"] == pytest.approx(2000 / 500)
    assert (a["sm_seconds"], a["sm_share"], a["normalised_share"]) == pytest.approx((1.5, 0.375, 1.5))
    # SM 0 is released at t = 2 as SM 1 is taken: one SM at a time, within the cap
    assert (a["max_sms"], a["sm_cap"], a["sm_cap_violations"]) == (1, 1, 0)
    assert (a["memory_high_water"], a["mem_limit"], a["memory_violations"]) == (80, 100, 0)
    assert a["longest_wait_ms"] == pytest.approx((10.0 - 5.1) * 1e3)  # kernel 3 waits until the run ends
    assert (a["kernels"], a["blocks"]) == (2, 12)

    assert b["slo_attainment"] is None and b["isolation"] is None
    assert (b["sm_seconds"], b["sm_share"], b["normalised_share"]) == pytest.approx((2.5, 0.625, 0.625 / 0.75))
    assert (b["max_sms"], b["sm_cap_violations"], b["memory_violations"]) == (2, 1, 1)
    assert b["longest_wait_ms"] == pytest.approx((1.5 - 0.1) * 1e3)

    assert (c["requests"], c["completed"], c["throughput_per_s"], c["sm_seconds"], c["sm_share"]) == (0, 0, 0, 0, 0)
    assert c["latency_ms"]["p99"] is None and c["normalised_share"] is None
    assert (c["max_sms"], c["memory_high_water"], c["longest_wait_ms"], c["kernels"], c["blocks"]) == (0, 0, 0, 0, 0)


def test_host_time_warns_past_a_tenth_of_the_median_latency_on_the_wall_clock_only():
    """A tenant whose median request spent more than 10% of its latency being issued is named in the warning,
    which points at --clock virtual; one at 10% or below is not; under the virtual clock nothing warns."""
    tenants = [TenantInfo("slow", "slow"), TenantInfo("edge", "edge"), TenantInfo("quick", "quick")]
    requests = [Request("slow", 0.0, 1.0, host=0.4), Request("slow", 1.0, 2.0, host=0.2),
                Request("slow", 2.0, 3.0, host=0.0),  # median share 0.2
                Request("edge", 0.0, 1.0, host=0.1),  # exactly the threshold: no warning
                Request("quick", 0.0, 1.0, host=0.01)]
    wall = Timeline("mps", sm_count=1, duration=3.0, tenants=tenants, requests=requests, traced=False)
    s = summarize(wall)
    assert [t["host_share"] for t in s["tenants"]] == pytest.approx([0.2, 0.1, 0.01])
    assert "of slow:" in s["host_time_warning"] and "--clock virtual" in s["host_time_warning"]
    assert "edge" not in s["host_time_warning"] and "quick" not in s["host_time_warning"]
    assert summarize(replace(wall, virtual=True))["host_time_warning"] is None
    assert summarize(replace(wall, requests=requests[3:]))["host_time_warning"] is None


def test_summary_is_plain_json_with_the_documented_keys():
    s = summarize(hand_timeline())
    assert json.loads(json.dumps(s, allow_nan=False)) == s
    assert set(s) == {"policy", "virtual", "duration_s", "lag_ms", "requests", "completed", "errors",
                      "throughput_per_s", "latency_ms", "jain_index", "sm_seconds", "idle_sm_seconds_while_queued",
                      "quota_violations", "tenants", "host_time_warning"}
    assert set(s["tenants"][0]) == {
        "tenant", "group", "requests", "completed", "errors", "throughput_per_s", "latency_ms", "slo_attainment",
        "isolation", "sm_seconds", "sm_share", "entitlement", "normalised_share", "max_sms", "sm_cap",
        "sm_cap_violations", "memory_high_water", "mem_limit", "memory_violations", "longest_wait_ms", "kernels",
        "blocks", "errors_by_name", "host_share", "allocator"}


def test_records_of_unlisted_tenants_count_only_in_the_totals():
    timeline = hand_timeline()
    timeline.requests.append(Request("ghost", 0.0, 1.0))
    timeline.spans = Spans.of_rows([*timeline.spans, Span("ghost", 9, sm=3, blocks=1, sm_fraction=1.0, start=0.0,
                                                         end=4.0)])
    s = summarize(timeline)
    assert (s["requests"], s["completed"]) == (5, 4)
    assert s["sm_seconds"] == pytest.approx(4.0 + 4.0)
    assert [t["tenant"] for t in s["tenants"]] == ["A", "B", "C"]
    assert s["tenants"][0]["sm_share"] == pytest.approx(1.5 / 8)


def test_an_untraced_run_renders_its_unknown_device_figures_as_dashes():
    """A run whose device was not traced (an isolation baseline, say): the table shows '-' where a traced run has
    SM figures, and its caption says why, where a traced run's gives the fairness and SM time."""
    from rich.console import Console

    from mpsd.stress.cli import render_comparison, render_run

    untraced = replace(hand_timeline(), kernels=[], spans=Spans(), traced=False)
    s = summarize(untraced)
    assert s["tenants"][0]["memory_high_water"] == 80 and s["tenants"][1]["memory_violations"] == 1
    console = Console(width=200, record=True)
    console.print(render_run(s))
    console.print(render_comparison({"mps": s}, {"mps": untraced}))
    text = console.export_text()
    row = next(line for line in text.splitlines() if line.startswith("│ A "))
    assert "-/1" in row and "80 B" in row and "0.0%" not in row
    assert "The device was not traced" in text and "Jain's fairness 0" not in text
    traced = Console(width=200, record=True)
    traced.print(render_run(summarize(hand_timeline())))
    assert "Jain's fairness 0.925" in traced.export_text()


def test_empty_run():
    s = summarize(Timeline("mps", sm_count=132, duration=0.0))
    assert (s["requests"], s["throughput_per_s"], s["jain_index"], s["idle_sm_seconds_while_queued"]) == (0, 0, 1, 0)
    assert s["tenants"] == [] and s["latency_ms"]["p50"] is None


def test_occupancy_per_bin():
    edges, sms = occupancy(hand_timeline(), bins=5)
    assert list(edges) == pytest.approx([0, 2, 4, 6, 8, 10])
    # [0, 2): A 0.5 SM for 1 s; B 0.5 SM + 1 SM for 0.5 s.  [2, 4): A 1 SM for 1 s; B 0.5 x 2 + 1 x 0.5 + 0.25 x 1
    assert list(sms["A"]) == pytest.approx([0.25, 0.5, 0, 0, 0])
    assert list(sms["B"]) == pytest.approx([0.375, 0.875, 0, 0, 0])
    assert list(sms["C"]) == [0] * 5
    with pytest.raises(ValueError):
        occupancy(hand_timeline(), bins=0)


# Random timelines on 3 SMs with times on a coarse grid, so that ties (hand-overs, shared instants) are common.
times = st.integers(0, 12).map(lambda t: t / 4)


@st.composite
def random_timelines(draw) -> Timeline:
    tenants = [TenantInfo(f"t{i}", "g") for i in range(draw(st.integers(1, 3)))]
    spans, kernels = [], []
    for k in range(draw(st.integers(0, 5))):
        tenant = draw(st.sampled_from(tenants)).name
        submitted = draw(times)
        starts = []
        for _ in range(draw(st.integers(0, 3))):
            start, length = draw(times), draw(times)
            starts.append(start)
            spans.append(Span(tenant, k, draw(st.integers(0, 2)), 1, draw(st.sampled_from([0.25, 1.0])),
                              start, start + length))
        kernels.append(KernelRecord(tenant, k, "k", 1, submitted, min(starts, default=math.nan)))
    return Timeline("mps", sm_count=3, duration=6.0, launch_overhead=0.25, tenants=tenants, kernels=kernels,
                    spans=Spans.of_rows(spans))


def brute_force(timeline: Timeline) -> tuple[float, dict[str, int]]:
    """Idle SM-seconds while queued and each tenant's most SMs, read off at the middle of every elementary step."""
    spans = list(timeline.spans)
    points = sorted({0.0, timeline.duration} | {t for s in spans for t in (s.start, s.end)}
                    | {k.submitted + timeline.launch_overhead for k in timeline.kernels})
    last_start = {}
    for s in spans:
        if s.end > s.start:
            last_start[s.kernel] = max(last_start.get(s.kernel, -math.inf), s.start)
    idle, most = 0.0, {t.name: 0 for t in timeline.tenants}
    for lo, hi in itertools.pairwise(points):
        mid = (lo + hi) / 2
        resident = [s for s in spans if s.start <= mid < s.end]
        for name, held in most.items():
            most[name] = max(held, len({s.sm for s in resident if s.tenant == name}))
        queued = any(k.submitted + timeline.launch_overhead <= mid < last_start.get(k.kernel, -math.inf)
                     for k in timeline.kernels)
        idle += (timeline.sm_count - len({s.sm for s in resident})) * (hi - lo) * queued
    return idle, most


@settings(max_examples=150, deadline=None)
@given(random_timelines())
def test_sweeps_agree_with_brute_force(timeline):
    idle, most = brute_force(timeline)
    s = summarize(timeline)
    assert s["idle_sm_seconds_while_queued"] == pytest.approx(idle)
    assert {t["tenant"]: t["max_sms"] for t in s["tenants"]} == most
    edges, sms = occupancy(timeline, bins=4)
    assert sum(sum(v) for v in sms.values()) * (edges[1] - edges[0]) == pytest.approx(s["sm_seconds"])
