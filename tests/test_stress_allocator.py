# mpsd-stress tenants that churn through the caching allocator (allocator = "pytorch" | "pytorch-expandable" |
# "buddy" | "slab"), on the virtual-time runner: their segments are charged by mpsd, and each tenant's allocator
# figures are in the results.
from __future__ import annotations

import pytest

from mpsd.stress.metrics import summarize
from mpsd.stress.runner import run_virtual
from mpsd.stress.workload import WorkloadError, parse_workload

MiB = 1 << 20


def churner(name: str, allocator: str, **more) -> dict:
    return {"name": name, "allocator": allocator, "churn": "48M", "requests": 24,
            "kernel": [{"name": "spin", "grid": 8, "block": 256, "duration_ms": 0.05}], **more}


def test_each_tenant_reports_its_allocators_figures_and_mpsd_charged_its_segments():
    """Three tenants, one per strategy, the same sizes (drawn from churn alone): each row carries its
    allocator's figures; what mpsd charged the tenant at most covers the allocator's largest reservation; the
    cache serves most requests without a segment call; buddy's power-of-two rounding wastes more of what it
    hands out than PyTorch's 512-byte rounding, slab's quarter-steps less than buddy's."""
    w = parse_workload({"run": {"duration": 0.05, "solo": False},
                        "tenant": [churner(s, s) for s in ("pytorch", "buddy", "slab")]})
    rows = {r["tenant"]: r for r in summarize(run_virtual(w, "mps", {}))["tenants"]}
    figures = {name: row["allocator"] for name, row in rows.items()}
    assert {name: f["strategy"] for name, f in figures.items()} == {"pytorch": "pytorch", "buddy": "buddy",
                                                                     "slab": "slab"}
    for name, row in rows.items():
        f = figures[name]
        assert row["errors"] == 0 and row["completed"] == row["requests"] > 0
        assert row["memory_high_water"] >= f["reserved_bytes.all.peak"] > 0
        assert 0 < f["num_device_alloc"] < row["requests"] and f["num_ooms"] == 0
        assert 0 <= f["fragmentation.external.mean"] <= f["fragmentation.external.max"] < 1
    assert figures["buddy"]["fragmentation.internal.mean"] > figures["slab"]["fragmentation.internal.mean"] \
        > figures["pytorch"]["fragmentation.internal.mean"]


def test_a_tenant_whose_allocator_runs_out_fails_those_requests_only():
    """Under a pinned limit too small for buddy's rounded blocks, the allocator raises OutOfMemoryError: the
    tenant's requests that hit it fail as cudaErrorMemoryAllocation and count in its num_ooms."""
    w = parse_workload({"run": {"duration": 0.05, "solo": False},
                        "tenant": [churner("tight", "buddy", pinned_mem_limit="700M")]})
    row = summarize(run_virtual(w, "mps", {}))["tenants"][0]
    assert row["errors"] == row["allocator"]["num_ooms"] > 0
    assert row["errors_by_name"] == {"cudaErrorMemoryAllocation": row["errors"]}


@pytest.mark.parametrize("entry,message", [
    ({"allocator": "first-fit", "churn": "1M"}, "allocator must be one of pytorch, pytorch-expandable, buddy, slab"),
    ({"allocator": "buddy"}, "allocator needs churn"),
])
def test_a_bad_allocator_setting_says_what_is_wrong(entry, message):
    with pytest.raises(WorkloadError, match=message):
        parse_workload({"tenant": [{"name": "a", "kernel": [{"name": "spin", "duration_ms": 1}], **entry}]})


def test_the_report_draws_each_allocators_segments_over_time(tmp_path):
    """With allocator tenants, --report adds segments_P.png; its series has one point per request, in time
    order, whose largest reserved figure is the allocator's reserved peak (no retry gave any back)."""
    from test_stress_report import assert_picture

    from mpsd.stress.report import write_report

    w = parse_workload({"run": {"duration": 0.05, "solo": False},
                        "tenant": [churner("buddy", "buddy"), churner("slab", "slab")]})
    run = run_virtual(w, "mps", {})
    written = write_report(tmp_path, {"mps": run}, {})
    assert [p.name for p in written] == ["latency_cdf_mps.png", "occupancy_mps.png", "segments_mps.png",
                                         "trace_mps.json"]
    assert_picture(written[2])
    for tenant, series in run.allocator_series.items():
        assert len(series) == sum(1 for r in run.requests if r.tenant == tenant)
        assert [s[0] for s in series] == sorted(s[0] for s in series)
        assert all(reserved >= allocated > 0 and segments > 0 for _, reserved, allocated, segments in series)
        assert max(s[1] for s in series) == run.allocators[tenant]["reserved_bytes.all.peak"]


def test_a_tenant_churns_through_expandable_segments_on_the_daemons_virtual_memory():
    """allocator = "pytorch-expandable": PyTorch's rules with expandable_segments, its pages made and mapped on
    mpsd (the tenant's memory high water is what was mapped at most); the same sizes as a plain PyTorch tenant's, one
    growing segment where that one makes several, and no "segment" counted, as PyTorch counts none for them."""
    w = parse_workload({"run": {"duration": 0.05, "solo": False},
                        "tenant": [churner(s, s) for s in ("pytorch", "pytorch-expandable")]})
    rows = {r["tenant"]: r for r in summarize(run_virtual(w, "mps", {}))["tenants"]}
    plain, grown = rows["pytorch"]["allocator"], rows["pytorch-expandable"]["allocator"]
    assert grown["strategy"] == "pytorch-expandable"
    assert rows["pytorch-expandable"]["errors"] == 0 and rows["pytorch-expandable"]["completed"] > 0
    assert rows["pytorch-expandable"]["memory_high_water"] == grown["reserved_bytes.all.peak"] > 0  # as mapped
    assert grown["segment.all.peak"] == 0 < plain["segment.all.peak"]
    assert grown["num_ooms"] == 0 and grown["num_device_alloc"] > 0
