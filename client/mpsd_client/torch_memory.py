# torch.cuda.memory's functions, over a context's caching allocator (mpsd_client.caching_allocator): code written
# against PyTorch's memory API runs with one import changed (`from mpsd_client import torch_memory as memory`
# where it had `torch.cuda.memory`, or `torch.cuda`). PyTorch's "current device" is a context here: the one
# given to `set_context`, or a `device` argument that is a Context; 0, "cuda" and "cuda:0" name the current one
# (a context has one device). The figures are the allocator's own, under PyTorch's keys.
#
# Where it differs from PyTorch: list_gpu_processes lists this process only (a client sees the daemon's figure
# of its own memory, not other clients'); the caching host allocator (host_memory_stats) is the context's, taken
# through host_allocator() (PyTorch's pinned tensors use it unseen), and its times are the client's own clock's;
# a MemPool takes no allocator of one's own (its blocks are the caching allocator's, in a private pool).
"""torch.cuda.memory's API over mpsd's caching allocator."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator

from ._caching import CachingAllocator, caching_allocator
from ._graph_pools import graph_pool_handle
from ._host_caching import HostCachingAllocator, host_caching_allocator

__all__ = ["MemPool", "caching_allocator_alloc", "caching_allocator_delete", "current_context", "empty_cache",
           "get_allocator_backend", "get_per_process_memory_fraction", "host_allocator", "host_memory_stats",
           "host_memory_stats_as_nested_dict", "list_gpu_processes", "max_memory_allocated",
           "max_memory_cached", "max_memory_reserved", "mem_get_info", "memory_allocated", "memory_cached",
           "memory_snapshot", "memory_stats", "memory_stats_as_nested_dict", "memory_summary", "memory_reserved",
           "reset_accumulated_host_memory_stats", "reset_accumulated_memory_stats", "reset_max_memory_allocated",
           "reset_max_memory_cached", "reset_peak_host_memory_stats", "reset_peak_memory_stats", "set_context",
           "set_per_process_memory_fraction", "use_mem_pool"]

_current: Any = None


def set_context(ctx: Any) -> None:
    """The context the calls below act on when given no device (torch.cuda.set_device's part here)."""
    global _current
    _current = ctx


def current_context() -> Any:
    """The context set_context gave.

    Raises:
        RuntimeError: none was given.
    """
    if _current is None:
        raise RuntimeError("no current context: mpsd_client.torch_memory.set_context(ctx) first")
    return _current


def _ctx(device: Any) -> Any:
    if device is None or device in (0, "cuda", "cuda:0"):
        return current_context()
    if hasattr(device, "_core"):  # a Context
        return device
    raise ValueError(f"invalid device {device!r}: a context has one device (0, 'cuda', 'cuda:0' or a Context)")


def _allocator(device: Any = None) -> CachingAllocator:
    return caching_allocator(_ctx(device))


# -- allocating ----------------------------------------------------------------------------------------------
def caching_allocator_alloc(size: int, device: Any = None, stream: Any = None) -> int:
    """Memory of `size` bytes from the caching allocator, for work on `stream` (the default stream if None)."""
    return _allocator(device).malloc(size, stream)


def caching_allocator_delete(mem_ptr: int) -> None:
    """Give back memory caching_allocator_alloc gave (to the current context's allocator)."""
    _allocator().free(mem_ptr)


def empty_cache() -> None:
    """Give every whole, free cached segment back to the device."""
    _allocator().empty_cache()


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Cap what the allocator may reserve at `fraction` of the device's memory."""
    _allocator(device).set_per_process_memory_fraction(fraction)


def get_per_process_memory_fraction(device: Any = None) -> float:
    """The fraction set_per_process_memory_fraction set (1.0 where none was)."""
    allocator = _allocator(device)
    if allocator.allowed is None:
        return 1.0
    total: int = allocator.ctx.mem_get_info()[1]
    return allocator.allowed / total


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the device, as cudaMemGetInfo says for the context."""
    return tuple(_ctx(device).mem_get_info())


def get_allocator_backend() -> str:
    """"native": PyTorch's own caching allocator's rules (PYTORCH_CUDA_ALLOC_CONF's backend:cudaMallocAsync is not
    taken)."""
    return "native"


# -- figures -------------------------------------------------------------------------------------------------
def host_allocator() -> HostCachingAllocator:
    """The current context's caching host allocator (allocate, free, record_stream, empty_cache): the pinned
    memory PyTorch's pin_memory() and non_blocking copies take."""
    return host_caching_allocator(current_context())


def host_memory_stats() -> dict[str, Any]:
    """torch.cuda.host_memory_stats(): the caching host allocator's figures, flat under dotted keys, sorted."""
    return host_allocator().stats()


def host_memory_stats_as_nested_dict() -> dict[str, Any]:
    """The same figures nested: {"allocations": {"current": ...}, ..., "host_alloc_time": {"avg": ...}}."""
    return _nested(host_memory_stats())


def reset_accumulated_host_memory_stats() -> None:
    """The host allocator's "allocated" and "freed" figures, counts and times back to 0."""
    host_allocator().reset_accumulated_stats()


def reset_peak_host_memory_stats() -> None:
    """Each of the host allocator's peaks becomes its current figure."""
    host_allocator().reset_peak_stats()


def memory_stats(device: Any = None) -> dict[str, Any]:
    """torch.cuda.memory_stats(): every figure, flat under dotted keys, sorted."""
    return _allocator(device).memory_stats()


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    """The same figures nested: {"allocated_bytes": {"all": {"current": ...}}, ..., "num_ooms": ...}."""
    return _nested(memory_stats(device))


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """Figures under dotted keys as nested maps, a level for each dot."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Set each statistic's "allocated" and "freed" and the event counts (retries, OOMs, device allocations and
    frees, synchronisations) back to 0; current and peak figures stay."""
    allocator = _allocator(device)
    for pools in allocator._stats.values():
        for stat in pools.values():
            stat.allocated = stat.freed = 0
    for stat in allocator._oversize.values():
        stat.allocated = stat.freed = 0
    for name in allocator._counts:
        allocator._counts[name] = 0


def reset_peak_memory_stats(device: Any = None) -> None:
    """Each statistic's peak becomes its current figure."""
    _allocator(device).reset_peak_memory_stats()


def reset_max_memory_allocated(device: Any = None) -> None:
    """Deprecated in PyTorch for reset_peak_memory_stats, which it calls (and which resets every peak)."""
    warnings.warn("reset_max_memory_allocated now calls reset_peak_memory_stats, which resets all peak memory "
                  "stats", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device: Any = None) -> None:
    """Deprecated in PyTorch for reset_peak_memory_stats, which it calls."""
    warnings.warn("reset_max_memory_cached now calls reset_peak_memory_stats, which resets all peak memory stats",
                  FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def memory_allocated(device: Any = None) -> int:
    return _allocator(device).memory_allocated()


def max_memory_allocated(device: Any = None) -> int:
    return _allocator(device).max_memory_allocated()


def memory_reserved(device: Any = None) -> int:
    return _allocator(device).memory_reserved()


def max_memory_reserved(device: Any = None) -> int:
    return _allocator(device).max_memory_reserved()


def memory_cached(device: Any = None) -> int:
    """Deprecated in PyTorch for memory_reserved."""
    warnings.warn("torch.cuda.memory_cached has been renamed to torch.cuda.memory_reserved", FutureWarning,
                  stacklevel=2)
    return memory_reserved(device)


def max_memory_cached(device: Any = None) -> int:
    """Deprecated in PyTorch for max_memory_reserved."""
    warnings.warn("torch.cuda.max_memory_cached has been renamed to torch.cuda.max_memory_reserved",
                  FutureWarning, stacklevel=2)
    return max_memory_reserved(device)


def memory_snapshot() -> list[dict[str, Any]]:
    """The segments and their blocks, in torch.cuda.memory_snapshot()'s shape."""
    return _allocator().memory_snapshot()


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """torch.cuda.memory_summary()'s table."""
    return _allocator(device).memory_summary(0, abbreviated)


def list_gpu_processes(device: Any = None) -> str:
    """torch.cuda.list_gpu_processes()'s lines, for this process: the memory the daemon counts for its
    context (its allocations and pools, as nvidia-smi's per-process figure counts a process's memory)."""
    ctx = _ctx(device)
    used = ctx.statistics()["memory_used"]
    return "\n".join(["GPU:0", f"process {os.getpid():>10d} uses {used / (1024 * 1024):>12.3f} MB GPU memory"])


# -- pools of one's own ----------------------------------------------------------------------------------------
class MemPool:
    """torch.cuda.MemPool: a private pool of the caching allocator; what is allocated inside `use_mem_pool(pool)`
    comes from it and its blocks are reused only by allocations to it, until the pool is gone and its free
    segments go back at the next empty_cache."""

    def __init__(self, device: Any = None) -> None:
        self._allocator = _allocator(device)
        self.id = graph_pool_handle()
        self._allocator._begin_allocate_to_pool(self.id, lambda stream: False, capture=False)  # made, not used yet
        self._allocator._end_allocate_to_pool(self.id)

    def use_count(self) -> int:
        """How many hold the pool: the MemPool itself, and each use_mem_pool block under way."""
        private = self._allocator._private.get(self.id)
        return private.use_count if private is not None else 0

    def snapshot(self) -> list[dict[str, Any]]:
        """memory_snapshot()'s segments of this pool only."""
        return [s for s in self._allocator.memory_snapshot() if tuple(s["segment_pool_id"]) == self.id]

    def __del__(self) -> None:
        allocator = getattr(self, "_allocator", None)
        if allocator is not None:
            allocator._release_pool(self.id)


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device: Any = None) -> Iterator[None]:
    """torch.cuda.use_mem_pool: within it, the allocator's allocations (on every stream) come from `pool`."""
    allocator = _allocator(device)
    if allocator is not pool._allocator:
        raise ValueError("the pool is another context's allocator's")
    allocator._begin_allocate_to_pool(pool.id, lambda stream: True, capture=False)
    try:
        yield
    finally:
        allocator._end_allocate_to_pool(pool.id)
        allocator._release_pool(pool.id)
