# memory_summary() and the snapshot's history, in PyTorch's shapes: the table is checked line for line against
# tables PyTorch 2.x printed (an idle allocator's, and rows of a busy one's, as people pasted them), and the
# pickle _dump_snapshot writes holds the segments and the recorded events with their Python stacks, as
# pytorch.org/memory_viz reads them.
from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import pytest

from mpsd_client import CachingAllocator
from mpsd_client._figures import POOLS, STATS
from mpsd_client._caching_report import summary

RECORDED = Path(__file__).parent.parent / "bench" / "fidelity" / "torch_allocator_h200.json.gz"

# torch.cuda.memory_summary() of an allocator that has done nothing, as PyTorch prints it.
IDLE = """\
|===========================================================================|
|                  PyTorch CUDA memory summary, device ID 0                 |
|---------------------------------------------------------------------------|
|            CUDA OOMs: 0            |        cudaMalloc retries: 0         |
|===========================================================================|
|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
|---------------------------------------------------------------------------|
""" + "|---------------------------------------------------------------------------|\n".join(
    f"| {name:<21} |{cells}|\n|       from large pool |{cells}|\n|       from small pool |{cells}|\n"
    for name, cells in [(n, "      0 B   |" * 3 + "      0 B   ") for n in (
        "Allocated memory", "Active memory", "Requested memory", "GPU reserved memory", "Non-releasable memory")]
    + [(n, "       0    |" * 3 + "       0    ") for n in (
        "Allocations", "Active allocs", "GPU reserved segments", "Non-releasable allocs")]) + """\
|---------------------------------------------------------------------------|
| Oversize allocations  |       0    |       0    |       0    |       0    |
|---------------------------------------------------------------------------|
| Oversize GPU segments |       0    |       0    |       0    |       0    |
|===========================================================================|
"""


class Device:
    """Enough of a context for the allocator: addresses from the bottom up, nothing to wait for."""

    def __init__(self) -> None:
        self.next = 1 << 40

    def malloc(self, nbytes: int) -> int:
        self.next += nbytes
        return self.next - nbytes

    def free(self, ptr: int) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        return 1 << 30, 1 << 34


def _stats(**figures: int) -> dict[str, int]:
    stats = {f"{name}.{pool}.{field}": 0 for name in STATS for pool in POOLS
             for field in ("current", "peak", "allocated", "freed")}
    stats.update({f"{name}.{field}": 0 for name in ("oversize_allocations", "oversize_segments")
                  for field in ("current", "peak", "allocated", "freed")})
    stats.update(num_ooms=0, num_alloc_retries=0)
    stats.update({key.replace("__", "."): value for key, value in figures.items()})
    return stats


def test_an_idle_allocators_summary_is_pytorchs_table():
    assert CachingAllocator(Device(), config="").memory_summary() == IDLE


def test_figures_take_the_unit_of_their_first_row_as_pytorch_prints_them():
    """Rows of a summary PyTorch printed after an out-of-memory error: KiB below 768 MiB, a pool's row in its
    statistic's units (so 500 MiB of small-pool traffic shows as 0 GiB), counts past 750,000 in thousands."""
    KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
    figures = {"current": (682537 * KiB, 481280 * KiB, 201257 * KiB), "peak": (65430 * MiB, 65235 * MiB, 196 * MiB),
               "allocated": (3115 * GiB, 3114 * GiB, 500 * MiB), "freed": (3114 * GiB + 5, 3114 * GiB, 500 * MiB)}
    stats = _stats(num_ooms=1, num_alloc_retries=1)
    for field, values in figures.items():
        for pool, value in zip(("all", "large_pool", "small_pool"), values):
            stats[f"allocated_bytes.{pool}.{field}"] = value
    stats["allocation.all.allocated"] = 1_234_567
    lines = summary(stats).splitlines()
    assert "|            CUDA OOMs: 1            |        cudaMalloc retries: 1         |" in lines
    assert "| Allocated memory      | 682537 KiB |  65430 MiB |   3115 GiB |   3114 GiB |" in lines
    assert "|       from large pool | 481280 KiB |  65235 MiB |   3114 GiB |   3114 GiB |" in lines
    assert "|       from small pool | 201257 KiB |    196 MiB |      0 GiB |      0 GiB |" in lines
    assert "| Allocations           |       0    |       0    |    1234 K  |       0    |" in lines
    assert all(len(line) == 77 for line in lines)
    short = summary(stats, device=3, abbreviated=True)
    assert "from large pool" not in short and "device ID 3    " in short


@pytest.mark.parametrize("trace", json.loads(gzip.open(RECORDED, "rt").read())[:3])
def test_the_summary_shows_the_recorded_statistics(trace):
    """For PyTorch's own final statistics of a recorded trace, every figure of the table is that statistic in
    the row's unit."""
    stats = trace["steps"][-1]["stats"]
    rows = {line.split("|")[1].strip(): line for line in
            summary(stats).splitlines()
            if line.count("|") == 6}
    line = rows["GPU reserved memory"]
    cells = [c.split() for c in line.split("|")[2:6]]
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for (value, unit), field in zip(cells, ("current", "peak", "allocated", "freed")):
        assert int(value) == stats[f"reserved_bytes.all.{field}"] // scale[unit]


def test_dump_snapshot_pickles_segments_and_the_recorded_events_with_their_stacks(tmp_path):
    """_record_memory_history, then _dump_snapshot: the pickle has memory_viz's two keys, the segments (blocks
    with their allocation's stack) and every event in order, each charged to the caller's frames."""
    allocator = CachingAllocator(Device(), config="")
    before = allocator.malloc(4096)  # before recording: in the segments, but no event of its own
    allocator._record_memory_history(max_entries=100)
    a = allocator.malloc(3 << 20)
    allocator.free(a)
    allocator.empty_cache()
    kept = allocator.malloc(1000)
    path = tmp_path / "snapshot.pickle"
    allocator._dump_snapshot(str(path))
    snapshot = pickle.loads(path.read_bytes())
    assert set(snapshot) == {"segments", "device_traces", "allocator_settings"} and len(snapshot["device_traces"]) == 1
    assert snapshot["allocator_settings"] == {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                              "garbage_collection_threshold": 0.0, "expandable_segments": False,
                                              "roundup_power2_divisions": 0}
    events = snapshot["device_traces"][0]
    assert [(e["action"], e["size"]) for e in events] == [
        ("segment_alloc", 20 << 20), ("alloc", 3 << 20), ("free_requested", 3 << 20), ("free_completed", 3 << 20),
        ("segment_free", 20 << 20), ("alloc", 1000)]
    assert events[1]["addr"] == a and events[-1]["addr"] == kept
    here = "test_dump_snapshot_pickles_segments_and_the_recorded_events_with_their_stacks"
    assert all(e["frames"][0]["name"] == here and e["frames"][0]["filename"] == __file__ for e in events)
    assert all(events[i]["time_us"] <= events[i + 1]["time_us"] for i in range(len(events) - 1))
    blocks = {b["address"]: b for s in snapshot["segments"] for b in s["blocks"]}
    assert blocks[kept]["frames"][0]["name"] == here and blocks[before]["frames"] == []
    allocator._record_memory_history(enabled=None)
    assert allocator._snapshot()["device_traces"] == [[]]
    with pytest.raises(ValueError):
        allocator._record_memory_history(enabled="sometimes")


def test_history_keeps_the_latest_events_and_stacks_only_where_asked():
    allocator = CachingAllocator(Device(), config="")
    allocator._record_memory_history(context="alloc", max_entries=3)
    allocator.free(allocator.malloc(4096))
    events = allocator._snapshot()["device_traces"][0]
    assert [e["action"] for e in events] == ["alloc", "free_requested", "free_completed"]
    assert events[0]["frames"] and not events[1]["frames"] and not events[2]["frames"]
