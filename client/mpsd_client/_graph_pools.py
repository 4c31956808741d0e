# The caching allocator's private pools for CUDA graphs, as torch.cuda.graph's: while a capture is under way,
# what is allocated for work on a stream of that capture comes from the graph's private pool, not the shared
# cache. A graph's kernels keep the addresses they were captured with, so the memory behind them must stay the
# graph's for as long as the graph can be replayed; the pool keeps it (its blocks are reused only by allocations to
# the same pool) until every graph using it is reset. Two graphs may share one pool (`pool=other.pool()` or a
# `graph_pool_handle()`), if they are replayed in the order they were captured, as PyTorch requires.
#
# Three more of PyTorch's rules hold during a capture: a new segment's cudaMalloc is made in relaxed capture mode
# (it would invalidate a global or thread-local capture: bench/fidelity/graph_capture_h200 measured it), an
# allocation that fails is not retried after emptying the cache (that synchronises the device, which a capture
# forbids), and a block freed while other streams use it (record_stream) waits for the capture's end before its
# events are recorded and queried (a query of an event recorded in a capture is cudaErrorCapturedEvent).
#
# Mixed into CachingAllocator, whose blocks carry `pool_id`: (0, 0) for the shared cache, else their private pool's.
"""Private memory pools of the caching allocator for CUDA graphs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["GraphPools", "SHARED", "graph_pool_handle"]

SHARED = (0, 0)  # the pool id of the shared cache's blocks
_handles = itertools.count(1)


def graph_pool_handle() -> tuple[int, int]:
    """``torch.cuda.graph_pool_handle()``: a fresh pool id that graphs may share (``graph(g, pool=handle)``)."""
    return (0, next(_handles))


def graph_pool_of_capture() -> tuple[int, int]:
    """The id of a private pool made for one capture (PyTorch numbers those by capture, in the other half)."""
    return (next(_handles), 0)


@dataclass(eq=False)
class _PrivatePool:
    """One private pool: its free blocks (small and large, as the shared cache's) and the graphs using it."""

    pools: dict[bool, Any]
    use_count: int = 1
    segments: set[int] = field(default_factory=set)  # base addresses of its segments


class GraphPools:
    """The caching allocator's side of graph capture (mixed into CachingAllocator)."""

    _pools: dict[bool, Any]
    _segments: dict[int, Any]

    def _init_graph_pools(self, make_pool: Callable[[bool], Any]) -> None:
        self._make_pool = make_pool
        self._private: dict[tuple[int, int], _PrivatePool] = {}
        # What allocates to a private pool now, a capture or a MemPool in use (use_mem_pool): (pool id, whether
        # a stream's allocations go there, whether it is a capture's).
        self._to_pool: list[tuple[tuple[int, int], Callable[[Any], bool], bool]] = []
        self._deferred: list[Any] = []  # blocks freed during a capture while other streams used them

    # -- what CUDAGraph calls ------------------------------------------------------------------------------
    def _begin_allocate_to_pool(self, pool_id: tuple[int, int], belongs: Callable[[Any], bool],
                                capture: bool = True) -> None:
        """From now on, allocations for a stream `belongs` says is in the capture (or, for a MemPool in use, any
        stream: `capture` False) come from pool `pool_id` (made here, or used by one more graph or MemPool when it
        exists: a shared pool)."""
        private = self._private.get(pool_id)
        if private is None:
            self._private[pool_id] = _PrivatePool({True: self._make_pool(True), False: self._make_pool(False)})
        else:
            private.use_count += 1
        self._to_pool.append((pool_id, belongs, capture))

    def _end_allocate_to_pool(self, pool_id: tuple[int, int]) -> None:
        """The capture that allocated to `pool_id` is over (its graph, if one was made, still uses the pool)."""
        self._to_pool = [entry for entry in self._to_pool if entry[0] != pool_id]

    def _release_pool(self, pool_id: tuple[int, int]) -> None:
        """A graph using the pool is gone (CUDAGraph.reset): with the last, the pool's free segments may go back to
        the device at the next empty_cache."""
        private = self._private.get(pool_id)
        if private is not None and private.use_count > 0:
            private.use_count -= 1

    # -- inside the allocator ------------------------------------------------------------------------------
    @property
    def _capturing(self) -> bool:
        return any(capture for _, _, capture in self._to_pool)

    def _target(self, stream: Any) -> tuple[tuple[int, int], dict[bool, Any]]:
        """The pool an allocation for `stream` comes from: the private pool of the capture it belongs to, else
        the shared cache."""
        for pool_id, belongs, _ in reversed(self._to_pool):
            if belongs(stream):
                return pool_id, self._private[pool_id].pools
        return SHARED, self._pools

    def _home(self, block: Any) -> Any:
        """The pool (small or large) a block of `block`'s segment goes back to."""
        pools = self._pools if block.pool_id == SHARED else self._private[block.pool_id].pools
        return pools[block.small]

    def _freeable_private(self) -> list[Any]:
        """The free pools (small and large) of private pools no graph uses any more: empty_cache empties them."""
        return [pool for private in self._private.values() if private.use_count == 0
                for pool in private.pools.values()]

    def _forget_empty_pools(self) -> None:
        for pool_id in [pid for pid, p in self._private.items() if p.use_count == 0 and not p.segments]:
            del self._private[pool_id]

    def _new_private_segment(self, pool_id: tuple[int, int], ptr: int) -> None:
        if pool_id != SHARED:
            self._private[pool_id].segments.add(ptr)

    def _segment_gone(self, block: Any) -> None:
        if block.pool_id != SHARED:
            self._private[block.pool_id].segments.discard(block.ptr)
