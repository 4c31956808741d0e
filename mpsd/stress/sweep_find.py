# Capacity search: `--find max:KEY --until "FIGURE OP VALUE"` asks, for each line of the sweep (each of its points
# with KEY left out: one per policy, say), the largest integer value of KEY at which the figure still holds;
# `min:KEY` the smallest (the fewest SMs, say, that keep a p99). It assumes the answer is monotone in KEY: for max,
# holds up to some value and fails from the next on (as p99 grows with the replicas); for min, fails up to some
# value and holds from the next on. It finds that edge with few runs: an exponential probe upward from 1 (1, 2,
# 4, ... up to the limit) to the first value on the far side of it, then bisection between the last value on the
# near side and that one. Both goals are one search: min is max over the condition's opposite ("below" is what is
# true below the edge). Every line moves a step at a time together, so that each step is one batch of points for
# the executor (as many at once as there are lines); the search itself runs nothing (it asks `evaluate`), so
# that its rules are checked here alone, on any figures. A figure that is None (a p99 with nothing completed, an
# SLO with no deadline) does not hold.
"""The capacity search of a sweep: its grammar, and the bisection per line."""

from __future__ import annotations

import json
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mpsd.stress.sweep import Sweep, check_axis
from mpsd.stress.workload import WorkloadError

__all__ = ["GOALS", "Line", "Until", "frontier", "parse_find", "parse_until", "render_frontier", "search"]

GOALS = ("max", "min")

OPERATORS: dict[str, Callable[[Any, Any], bool]] = {"<=": operator.le, "<": operator.lt, ">=": operator.ge,
                                                    ">": operator.gt, "==": operator.eq}
_UNTIL = re.compile(r"\s*(\S+?)\s*(<=|>=|==|<|>)\s*(\S+)\s*")
NOT_NUMBERS = ("policy", "run.policy", "run.solo")  # axes whose values are not integers


@dataclass(frozen=True)
class Until:
    """The condition a point must meet: its figure (a column of the table), compared to a value."""

    figure: str
    op: str
    value: float

    def holds(self, figures: dict[str, Any]) -> bool:
        """Whether a row's flat figures (sweep_table.flat) meet it; a figure that is None does not."""
        got = figures.get(self.figure)
        return got is not None and OPERATORS[self.op](got, self.value)

    def __str__(self) -> str:
        return f"{self.figure} {self.op} {self.value:.15g}"  # as written: 5 for 5.0, 0.1234567 in full


def parse_until(text: str, figures: Sequence[str]) -> Until:
    """Read ``FIGURE OP VALUE``, the figure one of ``figures``.

    Raises:
        WorkloadError: not of that shape, an unknown figure (named, with the known ones) or a value not a number.
    """
    matched = _UNTIL.fullmatch(text)
    if matched is None:
        raise WorkloadError(f"--until {text!r}: expected \"FIGURE OP VALUE\" with OP one of "
                            f"{', '.join(OPERATORS)} (e.g. \"inference.p99_ms <= 5\")")
    figure, op, number = matched.groups()
    if figure not in figures:
        raise WorkloadError(f"--until: unknown figure {figure!r} (known: {', '.join(figures)})")
    try:
        value = float(number)
    except ValueError:
        value = float("nan")
    if value != value:  # (NaN, written or not a number at all: no figure compares to it)
        raise WorkloadError(f"--until: {number!r} is not a number")
    return Until(figure, op, value)


def parse_find(text: str, sweep: Sweep) -> tuple[str, str]:
    """Read ``max:KEY`` or ``min:KEY``, KEY an axis of the sweep's grammar that takes integers.

    Returns:
        (the goal, max or min; KEY).

    Raises:
        WorkloadError: not of that shape, or not such an axis.
    """
    goal, _, key = text.partition(":")
    if goal not in GOALS or not key:
        raise WorkloadError(f"--find {text!r}: expected max:KEY or min:KEY, KEY an axis "
                            "(e.g. max:tenant.inference.count)")
    tenants = [t.get("name", f"tenant{i}") for i, t in enumerate(sweep.workload.get("tenant", []))]
    try:
        check_axis(key, tenants)
    except WorkloadError as exc:
        raise WorkloadError(f"--find: {str(exc).removeprefix('[sweep] ')}") from None
    if key in NOT_NUMBERS:
        raise WorkloadError(f"--find: {key} does not take integers; the search is over an integer axis")
    return goal, key


@dataclass
class Line:
    """One line's search: its axes (a point of the sweep without the key), each value probed and whether the
    figure held there, and the frontier once found."""

    axes: dict[str, Any]
    goal: str = "max"
    probes: dict[int, bool] = field(default_factory=dict)  # value -> held, in the order probed
    figures: dict[int, Any] = field(default_factory=dict)  # value -> the figure's value there
    keys: dict[int, str] = field(default_factory=dict)  # value -> the point's key
    next: int | None = 1  # the value to probe next; None once the frontier is found

    def _below(self, held: bool) -> bool:  # what is true below the edge: holding for max, failing for min
        return held if self.goal == "max" else not held

    @property
    def near(self) -> int | None:
        """The largest value probed below the edge (None: not even 1 is)."""
        return max((v for v, held in self.probes.items() if self._below(held)), default=None)

    @property
    def far(self) -> int | None:
        """The smallest value probed above the edge (None: up to the limit every value is below it)."""
        return min((v for v, held in self.probes.items() if not self._below(held)), default=None)

    @property
    def holds(self) -> int | None:
        """The answer: for max, the largest value that holds; for min, the smallest (None: no value probed
        holds, or, for max, not even 1)."""
        return self.near if self.goal == "max" else self.far

    @property
    def fails(self) -> int | None:
        """Beside the answer: for max, the smallest value that fails; for min, the largest (None: none does)."""
        return self.far if self.goal == "max" else self.near

    def step(self, value: int, held: bool, limit: int) -> None:
        self.probes[value] = held
        near, far = self.near, self.far
        if far is None:
            self.next = min(value * 2, limit) if value < limit else None
        elif near is None:
            self.next = None  # 1 is past the edge already
        else:
            self.next = (near + far) // 2 if far - near > 1 else None


def lines_of(sweep: Sweep, key: str) -> list[dict[str, Any]]:
    """Each distinct point of the sweep with the key left out (its values there are the search's to choose),
    in the file's order."""
    seen: dict[str, dict[str, Any]] = {}
    for point in sweep.points:
        rest = {axis: value for axis, value in point.items() if axis != key}
        seen.setdefault(json.dumps(rest, sort_keys=True), rest)
    return list(seen.values())


Evaluate = Callable[[list[dict[str, Any]]], list[tuple[str, dict[str, Any]]]]  # points -> (key, flat figures) each


def search(sweep: Sweep, key: str, until: Until, limit: int, evaluate: Evaluate, goal: str = "max") -> list[Line]:
    """Each line's frontier: for max, the largest value of ``key`` (1 to ``limit``) at which ``until`` holds and
    the smallest at which it fails, assuming that it holds up to some value and fails from the next on; for min,
    the smallest that holds and the largest that fails, assuming the opposite.

    Args:
        sweep: the sweep whose points, less the key, are the lines.
        key: the axis searched.
        until: the condition.
        limit: the largest value probed.
        evaluate: given points (axes -> value), each one's (key, flat figures), in the same order.
        goal: "max" or "min".

    Returns:
        The lines in the file's order, each with every value probed.

    Raises:
        WorkloadError: ``limit`` is below 1; or what ``evaluate`` raises.
    """
    if limit < 1:
        raise WorkloadError(f"--find-limit must be at least 1, not {limit}")  # (the command checks it first)
    lines = [Line(axes, goal) for axes in lines_of(sweep, key)]
    while active := [line for line in lines if line.next is not None]:
        points = [{**line.axes, key: line.next} for line in active]
        for line, point, (point_key, figures) in zip(active, points, evaluate(points)):
            value = point[key]
            line.keys[value], line.figures[value] = point_key, figures.get(until.figure)
            line.step(value, until.holds(figures), limit)
    return lines


# -- what the search prints -------------------------------------------------------------------------------

def frontier(lines: list[Line]) -> list[dict[str, Any]]:
    """Each line's frontier as the JSON output holds it: its axes, the answer and the value beside it that fails
    (Line.holds and Line.fails; None where there is none), the keys of the runs that decided them, and every
    run probed (value, key, the figure, whether it held) in the order probed."""
    return [{"axes": line.axes, "holds": line.holds, "fails": line.fails,
             "decided_by": [line.keys[v] for v in (line.holds, line.fails) if v is not None],
             "runs": [{"value": v, "key": line.keys[v], "figure": line.figures[v], "holds": held}
                      for v, held in line.probes.items()]} for line in lines]


def render_frontier(lines: list[Line], key: str, until: Until, limit: int) -> str:
    """The frontier for a terminal, then each run probed (the line's axes, the value, the figure, whether it
    held), those that decided the frontier marked."""
    from mpsd.stress.sweep_table import cell, columns

    axes = list(dict.fromkeys(axis for line in lines for axis in line.axes))
    goal = lines[0].goal if lines else "max"
    head = (f"{key} at most, while {until} (1 to {limit} probed; assumed to hold up to a value and fail after it)"
            if goal == "max" else
            f"{key} at least, while {until} (1 to {limit} probed; assumed to fail up to a value and hold after it)")
    summary = [[cell(line.axes.get(axis)) for axis in axes]
               + [cell(line.holds), cell(line.fails), str(len(line.probes))] for line in lines]
    runs = []
    for line in lines:
        for value in sorted(line.probes):
            figure = line.figures[value]
            runs.append([cell(line.axes.get(axis)) for axis in axes]
                        + [str(value), _figure_cell(figure, until, line.probes[value]),
                           "holds" if line.probes[value] else "fails", line.keys[value],
                           "decides" if value in (line.holds, line.fails) else ""])
    return "\n".join([head, columns([*axes, "holds", "fails", "runs"], summary, len(axes)), "",
                      columns([*axes, key, until.figure, "result", "key", "frontier"], runs, len(axes))])


def _figure_cell(figure: Any, until: Until, held: bool) -> str:
    # Six digits, unless they would contradict the result (a p99 of 1.0000000000000147 ms fails "<= 1"): then all.
    if figure is None:
        return "-"
    short = f"{figure:.6g}"
    return short if until.holds({until.figure: float(short)}) == held else repr(figure)
