# What CachingAllocator reports in PyTorch's own shapes, apart from the allocator's rules: the text table of
# torch.cuda.memory_summary() (the layout people paste into bug reports and parse with scripts), and the history
# of allocator events that torch.cuda.memory._record_memory_history keeps and _dump_snapshot pickles with the
# segments, for pytorch.org/memory_viz. The layout, key names and action names are PyTorch 2.11's.
"""memory_summary() and the snapshot's history, as PyTorch writes them."""

from __future__ import annotations

import sys
import time
import traceback
from collections import deque
from typing import Any

WIDTH = 75
# (statistic, its row's name, bytes or a count), in PyTorch's order
ROWS = (("allocated_bytes", "Allocated memory", True), ("active_bytes", "Active memory", True),
        ("requested_bytes", "Requested memory", True), ("reserved_bytes", "GPU reserved memory", True),
        ("inactive_split_bytes", "Non-releasable memory", True), ("allocation", "Allocations", False),
        ("active", "Active allocs", False), ("segment", "GPU reserved segments", False),
        ("inactive_split", "Non-releasable allocs", False))
OVERSIZE = (("oversize_allocations", "Oversize allocations"), ("oversize_segments", "Oversize GPU segments"))
FIELDS = ("current", "peak", "allocated", "freed")
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom")


def _size(value: int, scale_by: int) -> str:
    """A byte figure in the unit its row's first figure picks: the next unit up while that one is 768 of it."""
    unit = "B  "
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if scale_by < 768 * 1024:
            break
        unit, value, scale_by = bigger, value // 1024, scale_by // 1024
    return f"{value:6d} {unit}"


def _count(value: int, scale_by: int) -> str:
    unit = " "
    for bigger in ("K", "M"):
        if scale_by < 750 * 1000:
            break
        unit, value, scale_by = bigger, value // 1000, scale_by // 1000
    return f"{value:7d} {unit} "


def summary(stats: dict[str, float], device: int = 0, abbreviated: bool = False) -> str:
    """torch.cuda.memory_summary()'s table for `stats` (memory_stats()'s keys; the figures it shows are
    ints, in a dict that holds the fragmentation fractions too)."""
    rule, double = "-" * WIDTH, "=" * WIDTH
    lines = [double, f" {'':16} PyTorch CUDA memory summary, device ID {device:<17d} ", rule,
             f"  {'':9} CUDA OOMs: {stats['num_ooms']:<12d} | {'':6} cudaMalloc retries: "
             f"{stats['num_alloc_retries']:<8d}  ", double,
             "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
    pools = (("all", None), ("large_pool", "      from large pool"), ("small_pool", "      from small pool"))
    for key, name, in_bytes in ROWS:
        lines.append(rule)
        form = _size if in_bytes else _count
        first = [int(stats[f"{key}.all.{field}"]) for field in FIELDS]  # every row of a statistic scales by the first
        for pool, label in pools[:1] if abbreviated else pools:
            values = [int(stats[f"{key}.{pool}.{field}"]) for field in FIELDS]
            cells = " | ".join(form(v, scale) for v, scale in zip(values, first))
            lines.append(f" {label or name:<21} | {cells} ")
    for key, name in OVERSIZE:
        lines.append(rule)
        cells = " | ".join(_count(v, v) for v in (int(stats[f"{key}.{field}"]) for field in FIELDS))
        lines.append(f" {name:<21} | {cells} ")
    lines.append(double)
    return "|" + "|\n|".join(lines) + "|\n"


class History:
    """The events _record_memory_history(enabled="all") keeps: each with its Python stack when asked
    (context="all" or "alloc"), at most `max_entries`, the oldest dropped first."""

    def __init__(self, context: str | None, max_entries: int) -> None:
        self.context = context
        self.entries: deque[dict[str, Any]] = deque(maxlen=max_entries)

    def frames(self, action: str) -> list[dict[str, Any]]:
        """The caller's stack, innermost first, without this package's own frames: what the event is charged to."""
        if self.context is None or (self.context == "alloc" and action not in ("alloc", "segment_alloc")):
            return []
        here = __file__.rsplit("/", 1)[0]
        return [{"filename": f.filename, "line": f.lineno or 0, "name": f.name}
                for f in reversed(traceback.extract_stack(sys._getframe(1)))
                if not f.filename.startswith(here)]

    def add(self, action: str, addr: int, size: int, stream: int, frames: list[dict[str, Any]] | None = None,
            device_free: int | None = None) -> list[dict[str, Any]]:
        """Record one event; the frames it was charged to."""
        frames = self.frames(action) if frames is None else frames
        entry: dict[str, Any] = {"action": action, "size": size, "stream": stream, "frames": frames,
                                 "time_us": time.time_ns() // 1000}
        if action == "oom":
            entry["device_free"] = device_free
        else:
            entry["addr"] = addr
        self.entries.append(entry)
        return frames
