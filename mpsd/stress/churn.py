# A tenant's churn through one of the caching allocator's strategies (workload: allocator = "pytorch" | "buddy" |
# "slab"). The allocator is synchronous, as a CUDA program's is, but a tenant is a trio task, so the allocator's
# device here is a ledger: it decides at once whether a segment fits the memory the tenant had free at set-up
# (the allocator's view of the device), hands the allocator an address of its own, and queues the cudaMalloc or
# cudaFree, which the tenant then awaits on mpsd (`flush`). So mpsd charges every segment and times every round
# trip, while blocks carved from cached segments cost no call at all, as with PyTorch. The blocks' addresses are
# the allocator's (no kernel reads them), the segments' device memory is real.
"""A stress tenant's churn through a caching allocator."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from mpsd_client import CachingAllocator
from mpsd_protocol import OutOfMemoryError

KEPT = 4  # allocations a tenant keeps live across requests: the interleaving that fragments a cache
SMALLEST = 16  # sizes are drawn between churn / SMALLEST and churn
FIGURES = ("reserved_bytes.all.peak", "allocated_bytes.all.peak", "requested_bytes.all.peak", "segment.all.peak",
           "num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")


class LedgerDevice:
    """The allocator's device: `capacity` bytes, segment calls queued for the tenant to await."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.next = 1 << 44  # the allocator's addresses, apart from any real one
        self.queue: list[tuple[str, int, int]] = []  # ("malloc" | "free", address, bytes)
        self.sizes: dict[int, int] = {}

    def malloc(self, nbytes: int) -> int:
        if self.used + nbytes > self.capacity:
            raise OutOfMemoryError(f"{nbytes} bytes past the {self.capacity} free at set-up")
        ptr, self.next = self.next, self.next + nbytes
        self.used += nbytes
        self.sizes[ptr] = nbytes
        self.queue.append(("malloc", ptr, nbytes))
        return ptr

    def free(self, ptr: int) -> None:
        self.used -= self.sizes.pop(ptr)
        self.queue.append(("free", ptr, 0))

    def synchronize(self) -> None:
        """Each request has synchronised before the allocator runs again: nothing of ours is in flight."""

    def mem_get_info(self) -> tuple[int, int]:
        return self.capacity - self.used, self.capacity


class Churn:
    """Each request's allocation of a size drawn up to `churn`, the oldest of the last KEPT freed."""

    def __init__(self, ctx: Any, strategy: str, churn: int, capacity: int) -> None:
        self.ctx = ctx
        self.device = LedgerDevice(capacity)
        self.allocator = CachingAllocator(self.device, strategy=strategy)
        self.strategy = strategy
        self.churn = churn
        # Seeded by churn alone: the same sizes on every run, and for tenants that differ only in strategy, which
        # can so be compared on one trace.
        self.random = random.Random(churn)
        self.live: deque[int] = deque()
        self.real: dict[int, Any] = {}  # the ledger's address of each segment -> mpsd's pointer
        self.samples: list[tuple[float, float]] = []  # (external, internal) after each allocation
        self.series: list[tuple[int, int, int]] = []  # (reserved, allocated, segments) after each request's churn

    async def step(self) -> None:
        """One request's churn.

        Raises:
            OutOfMemoryError: the allocator found no room, or mpsd refused a segment.
        """
        try:
            if len(self.live) >= KEPT:
                self.allocator.free(self.live.popleft())
            self.live.append(self.allocator.malloc(self.random.randint(self.churn // SMALLEST, self.churn)))
            stats = self.allocator.memory_stats()
            self.samples.append((stats["fragmentation.external"], stats["fragmentation.internal"]))
        finally:
            await self.flush()
            self.series.append((self.allocator.memory_reserved(), self.allocator.memory_allocated(),
                                len(self.allocator.memory_snapshot())))

    async def flush(self) -> None:
        """Await the segment calls the allocator made; the first refusal is raised once all were tried."""
        queue, self.device.queue = self.device.queue, []
        refused: OutOfMemoryError | None = None
        for op, ptr, nbytes in queue:
            try:
                if op == "malloc":
                    self.real[ptr] = await self.ctx.malloc(nbytes)
                elif ptr in self.real:  # not if mpsd refused it
                    await self.ctx.free(self.real.pop(ptr))
            except OutOfMemoryError as exc:
                refused = refused or exc
        if refused is not None:
            raise refused

    def figures(self) -> dict[str, Any]:
        """The allocator's figures for the results: its peaks and counts, and fragmentation's mean and
        largest over the run (mpsd's figures, not PyTorch's)."""
        stats = self.allocator.memory_stats()
        out: dict[str, Any] = {"strategy": self.strategy, **{key: stats[key] for key in FIGURES}}
        for i, name in enumerate(("external", "internal")):
            values = [s[i] for s in self.samples]
            out[f"fragmentation.{name}.mean"] = sum(values) / len(values) if values else 0.0
            out[f"fragmentation.{name}.max"] = max(values, default=0.0)
        return out
