"""mpsd_client: connect worker processes to the mpsd daemon and use its emulated CUDA runtime.

    import mpsd_client
    with mpsd_client.connect() as ctx:
        p = ctx.malloc(1 << 20)
        ctx.launch("fill_f32", 256, 256, [p, 1.0, 1 << 18])
        ctx.synchronize()

`Context` blocks; `open_context()` gives an `AsyncContext` for trio with the same calls, awaited.
Errors are `CudaError` subclasses carrying `.code` and `.name`, one per CUDA error code.
`mpsd_client.driver` is the driver API's flavour (cuInit, cuCtxCreate, push and pop of current contexts),
`mpsd_client.runtime` the runtime's as a thin layer over it (primary contexts, cudaSetDevice, cudaDeviceReset).
"""
from typing import TYPE_CHECKING, Any

from mpsd_protocol import (
    ERROR_CLASSES,  # noqa: F401  (the table, reachable from the client as it always was)
    CudaError,
    _errors,
    error_name,
    error_string,
    format_size,
    parse_size,
)
from mpsd_protocol._errors import *  # noqa: F403  (the error classes are part of the client's API)

from ._api import ContextBase
from ._caching import CachingAllocator, caching_allocator
from ._cuda_graph import CUDAGraph, graph
from ._graph_pools import graph_pool_handle
from ._graphs import CaptureInfo, Graph, GraphExec, GraphNode
from ._modules import Function, Module
from ._objects import DevicePointer, Event, HostBuffer, Stream
from ._pools import MemPool, PoolStatistics
from ._sync import Context, connect
from ._wait import (DEVICE_LMEM_RESIZE_TO_MAX, DEVICE_MAP_HOST, DEVICE_SCHEDULE_AUTO, DEVICE_SCHEDULE_BLOCKING_SYNC,
                    DEVICE_SCHEDULE_MASK, DEVICE_SCHEDULE_SPIN, DEVICE_SCHEDULE_YIELD, DEVICE_SYNC_MEMOPS)


if TYPE_CHECKING:  # what __getattr__ below gives, for a type checker
    from ._async import AsyncContext, open_context


def __getattr__(name: str) -> Any:
    # The trio shell is imported on first use: a blocking client never loads trio (10 MiB of a process).
    if name in ("AsyncContext", "open_context"):
        from . import _async
        return getattr(_async, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "DEVICE_LMEM_RESIZE_TO_MAX", "DEVICE_MAP_HOST", "DEVICE_SCHEDULE_AUTO", "DEVICE_SCHEDULE_BLOCKING_SYNC",
    "DEVICE_SCHEDULE_MASK", "DEVICE_SCHEDULE_SPIN", "DEVICE_SCHEDULE_YIELD", "DEVICE_SYNC_MEMOPS",
    "AsyncContext", "CUDAGraph", "CachingAllocator", "CaptureInfo", "Context", "ContextBase", "CudaError",
    "DevicePointer", "Event", "Function", "HostBuffer", "Module",
    "Graph", "GraphExec", "GraphNode", "MemPool", "PoolStatistics", "Stream",
    "caching_allocator", "connect", "error_name", "error_string", "format_size", "graph", "graph_pool_handle",
    "open_context", "parse_size",
]
__all__ += _errors.__all__  # one exception class per error code, as mpsd_protocol has them
