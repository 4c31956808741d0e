# A sweep's table: one row per run, in an order fixed by the sweep file (never by which run finished first),
# holding no wall times, so that the same file gives the same bytes whatever ran it. Its columns are named once,
# here (FIGURES, RUN_FIGURES, flat()): the CSV's and Parquet's header, the capacity search's --until figures
# (sweep_find.py) and the report's series (sweep_report.py) all read the same names.
"""The table of a sweep: its rows, and the terminal, CSV and Parquet forms of them."""

from __future__ import annotations

import csv
import importlib
import io
import json
from pathlib import Path
from typing import Any

from mpsd.stress.workload import WorkloadError

__all__ = ["FIGURES", "RUN_FIGURES", "figure_names", "flat", "import_pyarrow", "render", "row", "to_csv",
           "write_parquet"]

FIGURES = ("p50_ms", "p99_ms", "throughput_per_s", "slo", "completed", "errors")
RUN_FIGURES = ("p50_ms", "p99_ms", "throughput_per_s", "completed", "errors")


def row(point: dict[str, Any], key: str, result: dict[str, Any]) -> dict[str, Any]:
    """A point's row: its axes (as the sweep names them), key, path, the run's figures and each tenant group's."""
    return {"axes": point, "key": key, "path": result["path"], "run": result["run"], "groups": result["groups"]}


def figure_names(workload: dict[str, Any]) -> list[str]:
    """Every figure column a run of the workload document has: run.<figure>, then <group>.<figure> for each
    tenant group (a tenant's name)."""
    groups = dict.fromkeys(t.get("name", f"tenant{i}") for i, t in enumerate(workload.get("tenant", [])))
    return [f"run.{name}" for name in RUN_FIGURES] + [f"{group}.{name}" for group in groups for name in FIGURES]


def flat(row: dict[str, Any]) -> dict[str, Any]:
    """A row as one level of columns: the axes, key, path, run.<figure> and <group>.<figure>."""
    out: dict[str, Any] = {**row["axes"], "key": row["key"], "path": row["path"]}
    out.update({f"run.{name}": row["run"][name] for name in RUN_FIGURES})
    for group, figures in row["groups"].items():
        out.update({f"{group}.{name}": figures[name] for name in FIGURES})
    return out


def _columns(rows: list[dict[str, Any]], flats: list[dict[str, Any]]) -> list[str]:
    axes = [axis for row in rows for axis in row["axes"]]  # every axis first, though not every point names it
    return list(dict.fromkeys([*axes, *(column for row in flats for column in row)]))


def to_csv(rows: list[dict[str, Any]]) -> str:
    """The table as CSV: a column per axis, then key, path, run.<figure> and <group>.<figure>; None empty."""
    flats = [flat(row) for row in rows]
    out = io.StringIO()
    writer = csv.DictWriter(out, _columns(rows, flats), lineterminator="\n")
    writer.writeheader()
    for values in flats:
        writer.writerow({k: ("" if v is None else json.dumps(v) if isinstance(v, (bool, list, dict)) else v)
                         for k, v in values.items()})
    return out.getvalue()


def import_pyarrow() -> tuple[Any, Any]:
    """pyarrow and pyarrow.parquet, imported (through importlib: the type checker passes with or without them).

    Raises:
        WorkloadError: pyarrow is not installed (it is not a dependency of mpsd).
    """
    try:
        return importlib.import_module("pyarrow"), importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise WorkloadError("--parquet needs pyarrow, which is not installed (pip install pyarrow)") from None


def write_parquet(rows: list[dict[str, Any]], target: Path) -> None:
    """The table as a Parquet file, the CSV's columns (None null; a column whose values are of mixed types, as
    listed points may give an axis, is written as their JSON text).

    Raises:
        WorkloadError: pyarrow is not installed (it is not a dependency of mpsd).
    """
    pa, parquet = import_pyarrow()
    flats = [flat(row) for row in rows]
    arrays = {}
    for column in _columns(rows, flats):
        values = [values.get(column) for values in flats]
        try:
            arrays[column] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
            arrays[column] = pa.array([None if v is None else json.dumps(v) for v in values], pa.string())
    target.parent.mkdir(parents=True, exist_ok=True)
    parquet.write_table(pa.table(arrays), target)


def render(rows: list[dict[str, Any]]) -> str:
    """The table for a terminal: the axes, then each group's p99 and throughput (and SLO where it has one)."""
    axes = list(dict.fromkeys(axis for row in rows for axis in row["axes"]))
    groups = list(dict.fromkeys(group for row in rows for group in row["groups"]))
    slo = {g for row in rows for g, figures in row["groups"].items() if figures["slo"] is not None}
    header = [*axes, "path"] + [c for g in groups
                                for c in (f"{g} p99 ms", f"{g} req/s", *([f"{g} SLO"] if g in slo else []))]
    lines = [[cell(row["axes"].get(axis)) for axis in axes] + [row["path"]]
             + [c for g in groups for c in _group_cells(row["groups"].get(g), g in slo)] for row in rows]
    return columns(header, lines, len(axes))


def columns(header: list[str], lines: list[list[str]], left: int) -> str:
    """Lines of cells as aligned columns, the first ``left`` of them to the left, the rest to the right."""
    widths = [max([len(h), *(len(line[i]) for line in lines)]) for i, h in enumerate(header)]
    return "\n".join("  ".join(text.rjust(w) if i >= left else text.ljust(w)
                               for i, (text, w) in enumerate(zip(line, widths))).rstrip()
                     for line in [header, *lines])


def _group_cells(figures: dict[str, Any] | None, slo: bool) -> list[str]:
    if figures is None:
        return ["-", "-"] + (["-"] if slo else [])
    p99 = figures["p99_ms"]
    cells = ["-" if p99 is None else f"{p99:.3f}", f"{figures['throughput_per_s']:.1f}"]
    if slo:
        cells.append("-" if figures["slo"] is None else f"{figures['slo']:.1%}")
    return cells


def cell(value: Any) -> str:
    """An axis's value in a terminal's table: strings as they are, the rest as JSON, None as -."""
    return "-" if value is None else value if isinstance(value, str) else json.dumps(value)
