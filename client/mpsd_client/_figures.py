# What every strategy of the caching allocator shares with PyTorch's: its sizes (the pools' limits and buffers,
# the rounding), torch.cuda's figures (`_Stat`, each statistic's current, peak, allocated and freed; `_Figures`,
# the views memory_stats, memory_allocated and the rest give of them), mpsd's fragmentation figures, and the
# OutOfMemoryError text. One copy here, so that PyTorch's strategy (_caching), its expandable segments
# (_expandable) and buddy and slab (_strategies) cannot drift apart in what they report.
"""PyTorch's allocator sizes and torch.cuda's figures, shared by every strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIN_BLOCK = 512  # every size is rounded to at least this
SMALL_SIZE = 1 << 20  # the largest small allocation
SMALL_BUFFER = 2 << 20  # small allocations are packed in segments of this size
LARGE_BUFFER = 20 << 20  # allocations between 1 and 10 MiB are packed in segments of this size
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20  # larger allocations round up to this
UNLIMITED = (1 << 64) - 1  # max_split_size when none is set (PyTorch reports it as -1)
STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes", "active_bytes",
         "inactive_split_bytes", "requested_bytes")
POOLS = ("all", "small_pool", "large_pool")


@dataclass(slots=True)
class _Stat:
    current: int = 0
    peak: int = 0
    allocated: int = 0
    freed: int = 0

    def up(self, amount: int) -> None:
        self.current += amount
        if self.current > self.peak:
            self.peak = self.current
        self.allocated += amount

    def down(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount


class _Figures:
    """torch.cuda's views of an allocator's statistics (``_stats`` and ``_oversize``), which every strategy has."""

    _stats: dict[str, dict[str, _Stat]]
    _oversize: dict[str, _Stat]
    _counts: dict[str, int]

    def _torch_figures(self) -> dict[str, float]:
        """memory_stats()'s keys that every strategy keeps alike: each statistic's four figures, the counts."""
        out: dict[str, float] = {}
        for name, pools in self._stats.items():
            for pool, stat in pools.items():
                for field_name in ("current", "peak", "allocated", "freed"):
                    out[f"{name}.{pool}.{field_name}"] = getattr(stat, field_name)
        for name, stat in self._oversize.items():
            for field_name in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{field_name}"] = getattr(stat, field_name)
        out.update(self._counts)
        return out

    def memory_allocated(self) -> int:
        return self._stats["allocated_bytes"]["all"].current

    def max_memory_allocated(self) -> int:
        return self._stats["allocated_bytes"]["all"].peak

    def memory_reserved(self) -> int:
        return self._stats["reserved_bytes"]["all"].current

    def max_memory_reserved(self) -> int:
        return self._stats["reserved_bytes"]["all"].peak

    def reset_peak_memory_stats(self) -> None:
        for stat in [s for pools in self._stats.values() for s in pools.values()] + list(self._oversize.values()):
            stat.peak = stat.current


def _oom_message(ctx: Any, nbytes: int, allocated: int, reserved: int, allowed_bytes: int | None) -> str:
    """PyTorch's OutOfMemoryError text (every strategy raises it, so that scripts matching it still do)."""
    free, total = ctx.mem_get_info()
    allowed = f"{_torch_size(allowed_bytes)} allowed; " if allowed_bytes is not None else ""
    return (f"CUDA out of memory. Tried to allocate {_torch_size(nbytes)}. GPU 0 has a total capacity of "
            f"{_torch_size(total)} of which {_torch_size(free)} is free. {allowed}Of the allocated memory "
            f"{_torch_size(allocated)} is allocated by PyTorch, and {_torch_size(reserved - allocated)} is "
            "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def fragmentation(free_blocks: list[int], requested: float, allocated: float) -> dict[str, float]:
    """mpsd's fragmentation figures, which PyTorch has no keys for, over the memory an allocator has reserved:

    - ``fragmentation.free_bytes``: the cached blocks no allocation holds (reserved less active, pending
      frees aside);
    - ``fragmentation.largest_free_block``: the largest of them, the most one allocation could get without
      reserving more;
    - ``fragmentation.external``: 1 - largest_free_block / free_bytes (0 with nothing free): how much of the
      free memory is in pieces too small for a request as large as it all;
    - ``fragmentation.internal``: 1 - requested / allocated bytes (0 with nothing allocated): the share of what
      is handed out that rounding gave beyond what was asked.
    """
    free = sum(free_blocks)
    largest = max(free_blocks, default=0)
    return {"fragmentation.free_bytes": free, "fragmentation.largest_free_block": largest,
            "fragmentation.external": 1 - largest / free if free else 0.0,
            "fragmentation.internal": 1 - requested / allocated if allocated else 0.0}


def _allocation_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def _power2_division(size: int, divisions: int) -> int:
    """`size` rounded up to the next of `divisions` equal steps between the powers of two around it."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def _stream(stream: Any) -> int:
    """A stream's place in PyTorch's order of free blocks: the default stream first, then by handle."""
    return 0 if stream is None else int(getattr(stream, "handle", stream))


def _torch_size(nbytes: int) -> str:
    """PyTorch's format_size: bytes, KiB, MiB or GiB with two decimals."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    for unit, scale in (("KiB", 1 << 10), ("MiB", 1 << 20)):
        if nbytes <= scale * 1024:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / (1 << 30):.2f} GiB"
