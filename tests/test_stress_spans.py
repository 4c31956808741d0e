"""The Spans table: a run's block groups as columns, from the simulator's trace to the trace file and back."""

import json
import math

import numpy as np
import pytest

from mpsd.sim import BlockCost, Kernel, Simulator
from mpsd.stress.metrics import occupancy, summarize
from mpsd.record.timeline import Span, Spans, TenantInfo, Timeline, spans_of
from mpsd.record.trace import as_drawn, chrome_trace, load_trace, read_chrome_trace, write_trace

ROWS = [
    Span("b", 7, 3, 2, 0.5, 0.25, 0.5),
    Span("a", 1, 0, 1, 1.0, 0.1, 0.1 + 1 / 3),
    Span("b", 7, 0, 4, 0.125, 1e-9 / 3, 0.2),  # a start between two nanoseconds
    Span("c", 2, 1, 1, 1.0, 0.3, 0.3),  # zero length
]


def test_rows_in_and_out():
    """A table built from rows gives the same rows back, tenants coded in the order they first come."""
    spans = Spans.of_rows(ROWS)
    assert list(spans) == ROWS and len(spans) == 4
    assert spans.names == ["b", "a", "c"] and spans.tenant.tolist() == [0, 1, 0, 2]
    assert [spans.tenant.dtype, spans.sm.dtype, spans.start.dtype] == [np.int64, np.int64, np.float64]
    assert spans.tenants().tolist() == ["b", "a", "b", "c"]
    assert spans == Spans.of_rows(tuple(r) for r in ROWS) and spans != Spans.of_rows(ROWS[:3])
    assert eval(repr(spans)) == spans  # repr writes every float in full


def test_an_empty_table():
    """No rows: empty columns of the right types, and every consumer takes them."""
    for empty in (Spans(), Spans.of_rows([])):
        assert len(empty) == 0 and not empty and list(empty) == [] and empty.names == []
        assert empty.start.dtype == np.float64 and empty.kernel.dtype == np.int64
        assert len(empty.codes({"a": 0}, 1)) == 0 and len(empty.tenants()) == 0
        assert len(empty.renamed({"a": "x"}).shifted(1.0)) == 0
    timeline = Timeline("mps", sm_count=4, duration=1.0, tenants=[TenantInfo("a", "a")])
    back = read_chrome_trace(json.loads(json.dumps(chrome_trace(timeline))))
    assert len(back.spans) == 0 and repr(back) == repr(as_drawn(timeline))
    assert summarize(timeline)["sm_seconds"] == 0.0
    assert occupancy(timeline, 4)[1]["a"].tolist() == [0.0] * 4


def test_columns_must_agree():
    with pytest.raises(ValueError, match="length"):
        Spans(["a"], [0, 0], [1], [0], [1], [1.0], [0.0], [1.0])
    with pytest.raises(ValueError, match="tenant codes"):
        Spans(["a"], [1], [1], [0], [1], [1.0], [0.0], [1.0])


def test_renamed_drops_the_unnamed_and_merges_names():
    """Tenants renamed to None (or not named) lose their spans; two renamed alike share one code."""
    spans = Spans.of_rows(ROWS).renamed({"a": "x", "c": "x"})
    assert spans.names == ["x"]
    assert list(spans) == [Span("x", *ROWS[1][1:]), Span("x", *ROWS[3][1:])]
    assert list(Spans.of_rows(ROWS).renamed({"b": "y", "a": None})) == [Span("y", *r[1:]) for r in (ROWS[0], ROWS[2])]


def test_shifted_is_one_subtraction_per_time():
    """Shifted by t0, each time is the float start - t0 (what the runner's clock shift has always been)."""
    t0 = 1.0 + 1 / 7
    shifted = list(Spans.of_rows(ROWS).shifted(t0))
    assert [(s.start, s.end) for s in shifted] == [(r.start - t0, r.end - t0) for r in ROWS]


def test_round_trip_through_the_trace_file(tmp_path):
    """Written and read back, the table comes in the trace's row order (process, then SM, each row in the
    order it came), its times through the nanosecond, its integers as integers: what as_drawn gives, to the bit."""
    timeline = Timeline("mig", sm_count=8, duration=1.0, tenants=[TenantInfo(n, n) for n in "abc"],
                        spans=Spans.of_rows(ROWS), partitions=[("0: 1g", 2, 4)])
    write_trace(tmp_path / "t.json", timeline)
    back = load_trace(tmp_path / "t.json")
    assert repr(back.spans) == repr(as_drawn(timeline).spans)
    # partition 0 holds SM 3; SMs 0 and 1 are outside it, on the whole-device process drawn after it
    assert [(s.sm, s.kernel) for s in back.spans] == [(3, 7), (0, 1), (0, 7), (1, 2)]
    assert [s.start for s in back.spans][2] == round(1e-9 / 3 * 1e9) / 1e3 / 1e6 == 0.0
    assert all(isinstance(s.blocks, int) and isinstance(s.sm_fraction, float) for s in back.spans)


def test_spans_of_a_simulator_are_its_trace():
    """spans_of gives one row per recorded block group of the kernels it is asked about, each with its
    tenant, id and the share of the SM its blocks hold, computed as count * threads / the SM's thread slots."""
    sim = Simulator(record=True)
    cost = BlockCost(1e-4)
    mine = [Kernel(client=c, stream=0, blocks=300, threads=t, cost=cost) for c, t in ((1, 96), (2, 1024), (1, 352))]
    other = Kernel(client=3, stream=0, blocks=10, threads=64, cost=cost)
    for op in (*mine, other):
        sim.submit(op)
    sim.run()
    ids = {op: 10 + i for i, op in enumerate(mine)}
    spans = spans_of(sim, {1: "one", 2: "two", 3: "three"}, ids)
    per_sm = sim.spec.max_threads_per_sm
    want = [Span({1: "one", 2: "two"}[g.op.client], ids[g.op], g.sm, g.count,
                 min(1.0, g.count * g.op.threads / per_sm), g.start, g.end) for g in sim.trace if g.op in ids]
    assert len(want) > 3 and list(spans) == want
    assert not math.isclose(want[0].sm_fraction, 1.0)  # fractions below a whole SM are in it
