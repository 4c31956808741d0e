# What a traced real GPU's block records become (mpsd.backends.cuda_trace): the slots each launch is given, and the
# kernels and spans drawn from records as the GPU writes them (two words a block: its start by the GPU's timer,
# and its time in ns above its SM). The copy back from device memory is the GPU's half (tests/test_backends.py).
from __future__ import annotations

import math

import numpy as np
import pytest

from mpsd.backends.cuda_trace import CHUNK_RECORDS, MAX_RECORDS, RECORD, BlockTrace

CHUNK = 1 << 40  # the address of a chunk already there: slots within it need no driver


def _record(start_ns: int, took_ns: int, sm: int) -> tuple[int, int]:
    return start_ns, (took_ns << 32) | sm


def test_launches_get_slots_in_turn_and_records_become_kernels_and_spans():
    trace = BlockTrace(cu=None, max_threads_per_sm=2048, chunks=[CHUNK], used=0)
    assert trace.slots(1, (1, 0), "spin", 3, 1024, 0.5) == CHUNK
    assert trace.slots(1, (1, 0), "fill_f32", 2, 256, 0.6) == CHUNK + 3 * RECORD
    assert trace.slots(2, (2, 0), "spin", 2, 1024, 0.7) == CHUNK + 5 * RECORD
    assert trace.slots(3, (3, 0), "spin", 1, 32, 0.8) == CHUNK + 7 * RECORD  # a client the trace does not name
    trace.stamps = [(1_000_000_000, 0.0), (3_000_000_000, 2.0)]  # backend seconds = timer ns / 1e9 - 1
    words = np.zeros((CHUNK_RECORDS, 2), dtype=np.uint64)
    rows = [_record(2_000_000_000, 1_000_000, 0), _record(2_000_100_000, 1_000_000, 1),
            _record(2_001_000_000, 500_000, 0),  # the spin's three blocks, two SMs
            _record(2_002_000_000, 10_000, 5), _record(2_002_000_000, 20_000, 6),  # the fill, after it
            _record(1_800_000_000, 50_000, 131), (0, 0),  # client 2: one block never wrote (a fault, say)
            _record(1_900_000_000, 1_000, 7)]
    words[:len(rows)] = rows
    kernels, spans = trace.drawn(words, {1: "one", 2: "two"})
    assert [(k.tenant, k.kernel, k.name, k.blocks) for k in kernels] == [
        ("one", 0, "spin", 3), ("one", 1, "fill_f32", 2), ("two", 2, "spin", 2)]
    spin, fill, other = kernels
    assert (spin.submitted, spin.started, spin.ended) == pytest.approx((0.5, 1.0, 1.0015))
    assert spin.eligible == 0.5  # first on its stream: its turn came when it was given
    assert fill.eligible == pytest.approx(1.0015)  # after the spin before it on the stream ended
    assert (fill.started, fill.ended) == pytest.approx((1.002, 1.00202))
    assert (other.started, other.ended) == pytest.approx((0.8, 0.80005))
    rows = list(spans)
    assert len(rows) == 6  # the unwritten slot and the unnamed client's block are left out
    assert sorted(r.sm for r in rows if r.kernel == 0) == [0, 0, 1]
    assert {(r.tenant, r.sm_fraction, r.blocks) for r in rows if r.kernel == 1} == {("one", 0.125, 1)}
    assert [(r.tenant, r.sm, r.sm_fraction) for r in rows if r.kernel == 2] == [("two", 131, 0.5)]
    assert all(r.end > r.start for r in rows)


def test_a_grid_larger_than_a_chunk_or_past_the_limit_runs_untraced():
    trace = BlockTrace(cu=None, max_threads_per_sm=2048, chunks=[CHUNK], used=0)
    assert trace.slots(1, (1, 0), "spin", CHUNK_RECORDS + 1, 32, 0.0) == 0
    full = BlockTrace(cu=None, max_threads_per_sm=2048, chunks=[CHUNK] * (MAX_RECORDS // CHUNK_RECORDS),
                      used=CHUNK_RECORDS - 1)
    assert full.slots(1, (1, 0), "spin", 1, 32, 0.0) == CHUNK + (CHUNK_RECORDS - 1) * RECORD  # the last slot
    assert full.slots(1, (1, 0), "spin", 1, 32, 0.0) == 0  # and no chunk more
    assert (trace.untraced, full.untraced, len(full.launches)) == (1, 1, 1)


def test_one_stamp_maps_the_timer_at_its_nominal_rate():
    trace = BlockTrace(cu=None, max_threads_per_sm=2048, chunks=[CHUNK], used=0)
    trace.slots(1, (1, 0), "spin", 1, 2048, 0.0)
    trace.stamps = [(5_000_000_000, 2.0)]
    words = np.zeros((CHUNK_RECORDS, 2), dtype=np.uint64)
    words[0] = _record(5_000_500_000, 250_000, 3)
    (kernel,), spans = trace.drawn(words, {1: "one"})
    assert (kernel.started, kernel.ended) == pytest.approx((2.0005, 2.00075))
    assert list(spans)[0].sm_fraction == 1.0 and not math.isnan(kernel.eligible)
