# `mpsd-stress --report DIR`: pictures of finished runs for people, and the trace to explore in Perfetto.
# Everything is drawn from the Timelines (and the summaries already computed from them), never from a live
# run. matplotlib is imported inside write_report, with the Agg backend (no display; files only), so that
# importing the stress package costs nothing when no report is asked for.
# Past a dozen tenants one line or band per tenant cannot be told apart, so the plots show tenant groups.
"""PNG plots and Chrome traces of stress runs."""

from __future__ import annotations

import re
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mpsd.stress.metrics import occupancy, percentile
from mpsd.record.timeline import Timeline
from mpsd.record.trace import write_trace

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["write_report"]

MOST_SERIES = 12  # lines or bands per plot before tenants are drawn by group
OCCUPANCY_BINS = 200
FIGSIZE = (9.0, 5.0)  # inches, at DPI: 900 x 500 pixels
DPI = 100


def write_report(directory: str | PathLike[str], runs: dict[str, Timeline],
                 summaries: dict[str, dict[str, Any]]) -> list[Path]:
    """Write the plots and traces of runs, one run per policy.

    Per policy P: ``latency_cdf_P.png`` (a latency CDF per tenant, log latency axis), ``occupancy_P.png``
    (SMs occupied over time, stacked by tenant, under the device's SM count) and ``trace_P.json`` (see
    mpsd.record.trace); with two policies or more also ``compare.png`` (p99 latency per tenant group, bars grouped
    by policy); ``segments_P.png`` (each caching allocator tenant's reserved and allocated bytes and its
    segments over time) when a tenant has one. Characters of P that do not belong in a file name become "_".

    Args:
        directory: where to write; created if missing.
        runs: policy name -> its run.
        summaries: policy name -> ``metrics.summarize`` of its run (quoted in the plots' titles; may be empty).

    Returns:
        The paths written, in the order above.

    Raises:
        OSError: the directory or a file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for policy, timeline in runs.items():
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", policy)
        for name, draw in ((f"latency_cdf_{tag}.png", _latency_cdf), (f"occupancy_{tag}.png", _occupancy)):
            fig = plt.figure(figsize=FIGSIZE, dpi=DPI)
            try:
                draw(fig, policy, timeline, summaries.get(policy, {}))
                fig.savefig(out / name)
            finally:
                plt.close(fig)
            written.append(out / name)
        if timeline.allocator_series:
            fig = plt.figure(figsize=FIGSIZE, dpi=DPI)
            try:
                _segments(fig, policy, timeline)
                fig.savefig(out / f"segments_{tag}.png")
            finally:
                plt.close(fig)
            written.append(out / f"segments_{tag}.png")
        write_trace(out / f"trace_{tag}.json", timeline)
        written.append(out / f"trace_{tag}.json")
    if len(runs) >= 2:
        fig = plt.figure(figsize=FIGSIZE, dpi=DPI)
        try:
            _compare(fig, runs)
            fig.savefig(out / "compare.png")
        finally:
            plt.close(fig)
        written.append(out / "compare.png")
    return written


def _series(timeline: Timeline) -> tuple[str, dict[str, str]]:
    """What to draw one line or band per: ("tenant", name -> name), or ("group", name -> group) if many."""
    if len(timeline.tenants) <= MOST_SERIES:
        return "tenant", {t.name: t.name for t in timeline.tenants}
    return "group", {t.name: t.group for t in timeline.tenants}


def _latencies_ms(timeline: Timeline, key: dict[str, str]) -> dict[str, list[float]]:
    """Completed requests' latencies in ms, by series (in tenant order); unlisted tenants are left out."""
    by: dict[str, list[float]] = {label: [] for label in key.values()}
    for r in timeline.requests:
        if r.error is None and np.isfinite(r.completed) and r.tenant in key:
            by[key[r.tenant]].append(r.latency * 1e3)
    return by


# Lines of equal figures would hide each other: each series its own dash pattern and markers as well as colour.
STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P")


def _latency_cdf(fig: Figure, policy: str, timeline: Timeline, summary: dict[str, Any]) -> None:
    kind, key = _series(timeline)
    ax = fig.add_subplot()
    deadlines: dict[str, float] = {}
    for t in timeline.tenants:
        if t.deadline is not None and t.name in key:
            deadlines.setdefault(key[t.name], t.deadline * 1e3)
    for i, (label, latencies) in enumerate(_latencies_ms(timeline, key).items()):
        ms = np.sort([x for x in latencies if x > 0])  # a log axis has no place for 0
        if len(ms):
            line, = ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=f"{label} ({len(ms)})",
                            linestyle=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)],
                            markevery=max(1, len(ms) // 8), markersize=4)
            if label in deadlines:  # the objective its requests are held to
                ax.axvline(deadlines[label], color=line.get_color(), linestyle=":", linewidth=1,
                           label=f"{label} deadline {deadlines[label]:.3g} ms")
    ax.set_xscale("log")
    ax.set_xlabel("launch-to-completion latency (ms)")
    ax.set_ylabel("fraction of requests completed within")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(title=f"{kind} (requests)", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no completed requests", transform=ax.transAxes, ha="center")
    p99 = summary.get("latency_ms", {}).get("p99")
    detail = f" - p99 {p99:.3g} ms, {summary.get('throughput_per_s', 0):.4g} requests/s" if p99 is not None else ""
    ax.set_title(f"Latency CDF per {kind}, policy {policy}{detail}")
    fig.tight_layout()


def _occupancy(fig: Figure, policy: str, timeline: Timeline, summary: dict[str, Any]) -> None:
    kind, key = _series(timeline)
    edges, per_tenant = occupancy(timeline, OCCUPANCY_BINS)
    bands: dict[str, np.ndarray] = {}
    for tenant, sms in per_tenant.items():
        bands[key[tenant]] = bands.get(key[tenant], 0) + sms
    ax = fig.add_subplot()
    # Each bin's mean held flat across the bin: edges[:-1] and edges[1:] interleaved.
    x = np.repeat(edges, 2)[1:-1]
    if bands:
        # Each band edged in its colour, so that a tenant holding a sliver of the device still shows as a line;
        # its mean SMs in the legend.
        labels = [f"{name} ({np.mean(v):.3g} SMs)" for name, v in bands.items()]
        for band in ax.stackplot(x, *[np.repeat(v, 2) for v in bands.values()], labels=labels, alpha=0.85):
            band.set_edgecolor(band.get_facecolor())
            band.set_linewidth(1.2)
    ax.axhline(timeline.sm_count, color="black", linestyle="--", linewidth=1,
               label=f"device: {timeline.sm_count} SMs")
    ax.set_xlim(edges[0], edges[-1] if edges[-1] > edges[0] else 1.0)
    ax.set_ylim(0, timeline.sm_count * 1.08)
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("SMs occupied (mean per bin)")
    ax.legend(title=kind, fontsize="small", loc="upper right")
    share = summary.get("jain_index")
    detail = f" - Jain's index {share:.3f}" if share is not None else ""
    ax.set_title(f"SM occupancy by {kind}, policy {policy}{detail}")
    fig.tight_layout()


def _segments(fig: Figure, policy: str, timeline: Timeline) -> None:
    """Reserved (solid) and allocated (dashed) MiB per allocator tenant above, its segment count below: the gap
    between the lines is what the cache holds unallocated."""
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    for tenant, series in timeline.allocator_series.items():
        at, reserved, allocated, segments = (np.array(column) for column in zip(*series))
        strategy = timeline.allocators.get(tenant, {}).get("strategy", "?")
        line, = top.step(at, reserved / (1 << 20), where="post", label=f"{tenant} ({strategy})")
        top.step(at, allocated / (1 << 20), where="post", linestyle="--", color=line.get_color())
        bottom.step(at, segments, where="post", color=line.get_color())
    top.set_ylabel("MiB: reserved (solid), allocated (dashed)")
    top.legend(title="tenant (strategy)", fontsize="small", loc="upper left")
    bottom.set_ylabel("segments")
    bottom.set_xlabel("time since the run started (s)")
    top.set_title(f"Caching allocators' segments over time, policy {policy}")
    fig.tight_layout()


def _compare(fig: Figure, runs: dict[str, Timeline]) -> None:
    """p99 per tenant group (over all its tenants' requests), one bar per policy in each group."""
    groups = list(dict.fromkeys(t.group for timeline in runs.values() for t in timeline.tenants))
    ax = fig.add_subplot()
    width = 0.8 / len(runs)
    measured: list[float] = []
    for i, (policy, timeline) in enumerate(runs.items()):
        by_group = _latencies_ms(timeline, {t.name: t.group for t in timeline.tenants})
        p99 = [percentile(by_group[g], 99) if by_group.get(g) else np.nan for g in groups]
        bars = ax.bar(np.arange(len(groups)) + (i - (len(runs) - 1) / 2) * width, p99, width, label=policy)
        ax.bar_label(bars, ["" if np.isnan(v) else f"{v:.3g}" for v in p99], fontsize="x-small")
        measured += [v for v in p99 if v > 0]
    # Latency-critical and batch groups differ by orders of magnitude: a log axis keeps both readable.
    if measured and max(measured) > 20 * min(measured):
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    if not measured:
        ax.text(0.5, 0.5, "no completed requests", transform=ax.transAxes, ha="center")
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.set_xlabel("tenant group")
    ax.set_ylabel("p99 latency (ms)")
    ax.legend(title="policy")
    ax.set_title("p99 latency per tenant group, by policy")
    fig.tight_layout()
