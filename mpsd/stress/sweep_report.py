# `--report DIR`: the plots people draw from a sweep, as PNG files, and beside them report.json, the series each
# plot draws. The series are computed first, from the table's rows, and each plot is drawn from its series alone,
# so that what is drawn is what report.json says, which tests/test_sweep.py holds to the table. Drawn on
# matplotlib's Figure objects without pyplot, so that no GUI backend or global state is involved.
#
# Plots: each figure (p99, throughput, SLO attainment where there is one) against each numeric axis, a panel
# per tenant group and a line per setting of the other axes (a line per policy, in a policy-by-count sweep);
# and with --find, the frontier: the searched figure against the searched key per line, probes that held
# filled, the threshold drawn, and the answer per line (the largest value that held, or for min:, the smallest).
"""The report of a sweep: plots of its table and of a capacity search's frontier."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mpsd.stress.sweep import describe

__all__ = ["draw", "plots", "write_report"]

PLOTTED = (("p99_ms", "p99 (ms)"), ("throughput_per_s", "requests/s"), ("slo", "SLO attainment"))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plots(rows: list[dict[str, Any]], found: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The series of every plot of the report, from the table's rows (and a search's JSON, ``found``).

    Returns:
        Plots, each ``{"file", "title", "x", "y", "panels": [{"title", "series": [{"label", "x", "y"}]}]}``
        (a frontier plot adds ``threshold`` and, per series, ``held``, and a ``bars`` panel).
    """
    out = []
    axes = list(dict.fromkeys(axis for row in rows for axis in row["axes"]))
    groups = list(dict.fromkeys(group for row in rows for group in row["groups"]))
    for axis in axes:
        values = [row["axes"].get(axis) for row in rows]
        if not all(_number(v) for v in values) or len(set(values)) < 2:
            continue
        for figure, label in PLOTTED:
            panels = []
            for group in groups:
                series: dict[str, dict[str, list[Any]]] = {}
                for row in sorted(rows, key=lambda r: r["axes"][axis]):
                    y = row["groups"].get(group, {}).get(figure)
                    if y is None:
                        continue
                    rest = {a: v for a, v in row["axes"].items() if a != axis}
                    line = series.setdefault(describe(rest) or "all", {"x": [], "y": []})
                    line["x"].append(row["axes"][axis])
                    line["y"].append(y)
                if series:
                    panels.append({"title": group, "series": [{"label": k, **v} for k, v in series.items()]})
            if panels:
                out.append({"file": f"{figure}-vs-{axis}.png", "title": f"{label} against {axis}", "x": axis,
                            "y": label, "panels": panels})
    if found is not None:
        out.append(_frontier(found))
    return out


def _frontier(found: dict[str, Any]) -> dict[str, Any]:
    key, until = found["find"], found["until"]
    series, bars = [], []
    for line in found["frontier"]:
        runs = sorted((r for r in line["runs"] if r["figure"] is not None), key=lambda r: r["value"])
        label = describe(line["axes"]) or "all"
        series.append({"label": label, "x": [r["value"] for r in runs], "y": [r["figure"] for r in runs],
                       "held": [r["holds"] for r in runs]})
        bars.append({"label": label, "x": [label], "y": [line["holds"] or 0]})
    return {"file": "frontier.png", "title": f"{key} while {until['text']}", "x": key, "y": until["figure"],
            "threshold": until["value"], "panels": [{"title": until["figure"], "series": series},
                       {"title": f"{'largest' if found['goal'] == 'max' else 'smallest'} {key} that holds",
                        "bars": True, "series": bars}]}


def draw(plot: dict[str, Any]) -> Any:
    """A matplotlib Figure drawn from one plot's series alone: a panel each, a line per series (with a
    ``bars`` panel last, a bar per series)."""
    from matplotlib.figure import Figure

    panels = plot["panels"]
    figure = Figure(figsize=(5 * len(panels), 3.6), layout="constrained")
    figure.suptitle(plot["title"])
    for ax, panel in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels):
        ax.set_title(panel["title"])
        if panel.get("bars"):
            for series in panel["series"]:
                ax.bar(series["x"], series["y"], label=series["label"])
            continue
        for series in panel["series"]:
            (line,) = ax.plot(series["x"], series["y"], marker="o", label=series["label"])
            if "held" in series:  # the probes that failed, hollow
                failed = [(x, y) for x, y, held in zip(series["x"], series["y"], series["held"]) if not held]
                ax.scatter([x for x, _ in failed], [y for _, y in failed], s=80, facecolors="white",
                           edgecolors=line.get_color(), zorder=3)
        if "threshold" in plot:  # (not in the bars panel, which ends above)
            ax.axhline(plot["threshold"], color="grey", linestyle="--", label="threshold")
        ax.set_xlabel(plot["x"])
        ax.set_ylabel(plot["y"])
        ax.legend(fontsize="small")
    return figure


def write_report(directory: Path, rows: list[dict[str, Any]], found: dict[str, Any] | None = None) -> list[Path]:
    """Draw every plot into ``directory`` (made if need be) as PNG, with report.json holding their series.

    Returns:
        The files written, report.json last.
    """
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    every = plots(rows, found)
    for plot in every:
        target = directory / plot["file"]
        draw(plot).savefig(target, dpi=100)
        written.append(target)
    (directory / "report.json").write_text(json.dumps(every, indent=1, allow_nan=False) + "\n")
    return [*written, directory / "report.json"]
