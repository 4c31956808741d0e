# A tenant's churn through one of the caching allocator's strategies (workload: allocator = "pytorch" |
# "pytorch-expandable" | "buddy" | "slab"). The allocator is synchronous, as a CUDA program's is, but a tenant
# is a trio task, so the allocator's device here is a ledger: it decides at once whether a segment fits the
# memory the tenant had free at set-up (the allocator's view of the device), hands the allocator an address of
# its own, and queues the cudaMalloc or cudaFree, which the tenant then awaits on mpsd (`flush`). So mpsd
# charges every segment and times every round trip, while blocks carved from cached segments cost no call at
# all, as with PyTorch. The blocks' addresses are the allocator's (no kernel reads them), the segments' device
# memory is real. With expandable segments the ledger takes the driver's virtual memory calls the same way: a
# reservation costs nothing, each page made is charged, and the tenant awaits each reserve, create, map, unmap,
# release and free on mpsd.
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
        self.queue: list[tuple[Any, ...]] = []  # (call, its arguments in the ledger's addresses and handles)
        self.sizes: dict[int, int] = {}
        self.handles: dict[int, int] = {}  # the ledger's handle of each page made -> its bytes
        self.next_handle = 0

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

    def mem_address_reserve(self, size: int, alignment: int = 0) -> int:
        ptr, self.next = self.next, self.next + size
        self.queue.append(("mem_address_reserve", ptr, size))
        return ptr

    def mem_address_free(self, ptr: int, size: int) -> None:
        self.queue.append(("mem_address_free", ptr, size))

    def mem_create(self, size: int) -> int:
        if self.used + size > self.capacity:
            raise OutOfMemoryError(f"{size} bytes past the {self.capacity} free at set-up")
        handle = self.next_handle = self.next_handle + 1
        self.used += size
        self.handles[handle] = size
        self.queue.append(("mem_create", handle, size))
        return handle

    def mem_release(self, handle: int) -> None:
        self.used -= self.handles.pop(handle)
        self.queue.append(("mem_release", handle))

    def mem_map(self, ptr: int, size: int, offset: int, handle: int) -> None:
        self.queue.append(("mem_map", ptr, size, offset, handle))

    def mem_unmap(self, ptr: int, size: int) -> None:
        self.queue.append(("mem_unmap", ptr, size))

    def synchronize(self) -> None:
        """Each request has synchronised before the allocator runs again: nothing of ours is in flight."""

    def mem_get_info(self) -> tuple[int, int]:
        return self.capacity - self.used, self.capacity


class Churn:
    """Each request's allocation of a size drawn up to `churn`, the oldest of the last KEPT freed."""

    def __init__(self, ctx: Any, strategy: str, churn: int, capacity: int) -> None:
        self.ctx = ctx
        self.device = LedgerDevice(capacity)
        expandable = strategy == "pytorch-expandable"
        self.allocator = CachingAllocator(self.device, strategy="pytorch" if expandable else strategy,
                                          expandable_segments=True if expandable else None)
        self.strategy = strategy
        self.churn = churn
        # Seeded by churn alone: the same sizes on every run, and for tenants that differ only in strategy, which
        # can so be compared on one trace.
        self.random = random.Random(churn)
        self.live: deque[int] = deque()
        self.real: dict[int, Any] = {}  # the ledger's address of each segment -> mpsd's pointer
        self.real_reserved: dict[int, int] = {}  # the ledger's address of each reservation -> mpsd's
        self.real_handles: dict[int, int] = {}  # the ledger's handle of each page made -> mpsd's
        self.real_maps: set[int] = set()  # the ledger's address of each page mpsd mapped
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
        for op, ptr, *args in queue:
            try:
                if op == "malloc":
                    self.real[ptr] = await self.ctx.malloc(args[0])
                elif op == "free" and ptr in self.real:  # not if mpsd refused it
                    await self.ctx.free(self.real.pop(ptr))
                elif op.startswith("mem_"):
                    await self._virtual(op, ptr, *args)
            except OutOfMemoryError as exc:
                refused = refused or exc
        if refused is not None:
            raise refused

    async def _virtual(self, op: str, ptr: int, *args: int) -> None:
        """One of the driver's virtual memory calls the allocator made, on mpsd, in its addresses and handles
        (a call on something mpsd refused to make is skipped)."""
        if op == "mem_address_reserve":
            self.real_reserved[ptr] = await self.ctx.mem_address_reserve(args[0])
        elif op == "mem_address_free" and ptr in self.real_reserved:
            await self.ctx.mem_address_free(self.real_reserved.pop(ptr), args[0])
        elif op == "mem_create":
            self.real_handles[ptr] = await self.ctx.mem_create(args[0])
        elif op == "mem_release" and ptr in self.real_handles:
            await self.ctx.mem_release(self.real_handles.pop(ptr))
        elif op in ("mem_map", "mem_unmap"):
            base = max((b for b in self.real_reserved if b <= ptr), default=None)  # the reservation it lies in
            if base is None:
                return
            at = self.real_reserved[base] + ptr - base
            if op == "mem_map" and args[2] in self.real_handles:
                await self.ctx.mem_map(at, args[0], args[1], self.real_handles[args[2]])
                self.real_maps.add(ptr)
            elif op == "mem_unmap" and ptr in self.real_maps:
                await self.ctx.mem_unmap(at, args[0])
                self.real_maps.discard(ptr)

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
