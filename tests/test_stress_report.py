# The report directory of mpsd-stress: every file named, PNGs that read back as pictures, traces that load.
from __future__ import annotations

import random

import pytest

from mpsd.stress.metrics import summarize
from mpsd.stress.report import write_report
from mpsd.record.timeline import KernelRecord, Request, Span, Spans, TenantInfo, Timeline
from mpsd.record.trace import load_trace

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def small_run(policy: str, seed: int, tenants: int = 3) -> Timeline:
    """A closed-loop latency tenant and batch tenants, with random latencies; one request per kernel."""
    rng = random.Random(seed)
    infos = [TenantInfo("infer#0", "infer", sm_cap=32, entitlement=0.5, deadline=0.005)]
    infos += [TenantInfo(f"train#{i}", "train", entitlement=0.5 / (tenants - 1)) for i in range(tenants - 1)]
    timeline = Timeline(policy, sm_count=132, duration=0.0, launch_overhead=1e-5, tenants=infos, virtual=True)
    spans = []
    for tenant in infos:
        clock = 0.0
        for _ in range(20):
            latency = rng.expovariate(1 / (0.002 if tenant.group == "infer" else 0.03))
            kernel = len(timeline.kernels)
            timeline.requests.append(Request(tenant.name, clock, clock + latency))
            timeline.kernels.append(KernelRecord(tenant.name, kernel, "spin", 8, clock, clock + 1e-5, clock + latency))
            spans += [Span(tenant.name, kernel, rng.randrange(132), 2, 0.5, clock + 1e-5, clock + latency)
                      for _ in range(4)]
            clock += latency
        timeline.duration = max(timeline.duration, clock)
    timeline.spans = Spans.of_rows(spans)
    timeline.requests.append(Request("infer#0", 0.0, error="cudaErrorMemoryAllocation"))
    return timeline


def assert_picture(path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(path).shape
    assert 300 <= height <= 2000 and 400 <= width <= 3000 and width > height


def test_one_policy(tmp_path):
    run = small_run("mps", seed=1)
    written = write_report(tmp_path / "report", {"mps": run}, {"mps": summarize(run)})
    names = [p.name for p in written]
    assert names == ["latency_cdf_mps.png", "occupancy_mps.png", "trace_mps.json"]  # no comparison of one
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == sorted(names)
    for path in written[:2]:
        assert_picture(path)
    assert len(load_trace(written[2]).spans) == len(run.spans)


def test_policies_compared(tmp_path):
    runs = {"mps": small_run("mps", seed=1), "timeslice": small_run("timeslice", seed=2),
            "mig/3g": small_run("mig", seed=3, tenants=20)}  # past a dozen tenants the plots draw groups
    written = write_report(tmp_path, runs, {})
    assert [p.name for p in written] == [
        "latency_cdf_mps.png", "occupancy_mps.png", "trace_mps.json",
        "latency_cdf_timeslice.png", "occupancy_timeslice.png", "trace_timeslice.json",
        "latency_cdf_mig_3g.png", "occupancy_mig_3g.png", "trace_mig_3g.json",
        "compare.png",
    ]
    for path in written:
        if path.suffix == ".png":
            assert_picture(path)
    assert [load_trace(p).policy for p in written if p.suffix == ".json"] == ["mps", "timeslice", "mig"]


def test_a_run_without_work(tmp_path):
    """Nothing completed and nothing ran: the pictures say so instead of failing."""
    empty = Timeline("mps", sm_count=132, duration=0.0, tenants=[TenantInfo("a", "a")])
    written = write_report(tmp_path, {"mps": empty, "fair": empty}, {"mps": summarize(empty)})
    for path in written:
        if path.suffix == ".png":
            assert_picture(path)


@pytest.fixture(autouse=True)
def no_figures_left_open():
    import matplotlib.pyplot as plt

    yield
    assert plt.get_fignums() == []


def test_the_cdf_marks_deadlines_and_tells_equal_tenants_apart_and_slivers_of_the_device_show():
    """The latency CDF draws each tenant's deadline at its value, in its line's colour; two tenants with the very
    same latencies differ in dash and marker; on the occupancy plot each band is edged (a tenant holding a
    sliver of the device is still a line) and the legend gives each its mean SMs."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from mpsd.stress.report import _latency_cdf, _occupancy

    run = small_run("mps", seed=1)
    twin = [r for r in run.requests if r.tenant == "train#1"]
    run.requests = [r for r in run.requests if r.tenant != "train#0"]
    run.requests += [Request("train#0", r.submitted, r.completed, error=r.error) for r in twin]
    fig = Figure()
    _latency_cdf(fig, "mps", run, summarize(run))
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    deadline = lines["infer#0 deadline 5 ms"]
    assert list(deadline.get_xdata()) == [5.0, 5.0]
    assert deadline.get_color() == lines["infer#0 (20)"].get_color()
    a, b = lines["train#0 (20)"], lines["train#1 (20)"]
    assert list(a.get_xdata()) == list(b.get_xdata())  # the same figures...
    assert (a.get_linestyle(), a.get_marker()) != (b.get_linestyle(), b.get_marker())  # ...told apart
    fig = Figure()
    _occupancy(fig, "mps", run, summarize(run))
    (ax,) = fig.axes
    labels = ax.get_legend_handles_labels()[1]
    assert any(label.startswith("infer#0 (") and label.endswith(" SMs)") for label in labels)
    assert all(band.get_linewidth()[0] > 0 for band in ax.collections)
