# PyTorch's graph wrapper on mpsd: `CUDAGraph` (torch.cuda.CUDAGraph) and the `graph` context manager
# (torch.cuda.graph), so that a program written against torch's warm-up-then-capture pattern runs with only its
# calls renamed. The pieces are mpsd's own: the capture is a stream capture (mpsd_client._graphs), the executable
# graph is instantiated at capture_end, replay is one graph launch; what the capture allocates through the
# context's caching allocator comes from the graph's private pool (mpsd_client._graph_pools), so the addresses its
# kernels were captured with stay the graph's until reset().
#
# torch works on "the current stream"; mpsd's calls name their stream. So a capture is on the stream given (or
# one side stream per context that graph() makes, as torch.cuda.graph keeps one), work inside it names that
# stream, and replay() launches on the stream given, by default the legacy default stream, torch's current stream
# outside a `with torch.cuda.stream(...)`. Each method works on both shells: it hands its context a generator of
# its steps (awaited on an AsyncContext); the allocator, which is the blocking Context's, is told of the capture
# without a call to the daemon.
"""torch.cuda.CUDAGraph and torch.cuda.graph, on mpsd."""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, Generator

from mpsd_protocol import Calls, CudaError

from . import _graphs
from ._graph_pools import graph_pool_of_capture

if TYPE_CHECKING:
    from ._api import ContextBase
    from ._objects import Stream

__all__ = ["CUDAGraph", "graph"]

Op = Generator[Any, Any, Any]
_SIDE_STREAMS: weakref.WeakKeyDictionary[Any, Stream] = weakref.WeakKeyDictionary()


def _allocator(ctx: ContextBase) -> Any:
    """The context's caching allocator (PyTorch's strategy), where the context is a blocking one: the only kind a
    CachingAllocator works on. None on an AsyncContext."""
    from ._caching import caching_allocator
    from ._sync import Context

    if not isinstance(ctx, Context):
        return None
    allocator = caching_allocator(ctx)
    return allocator if hasattr(allocator, "_begin_allocate_to_pool") else None


class CUDAGraph:
    """``torch.cuda.CUDAGraph``: a graph captured once (capture_begin ... capture_end) and replayed.

    Args:
        ctx: the context it captures and replays on (blocking or trio: each method is awaited on the latter).
        keep_graph: keep the captured graph after instantiating it (for debug_dump and raw_cuda_graph), as
            torch's keep_graph does; by default it is destroyed once instantiated.
    """

    def __init__(self, ctx: ContextBase, keep_graph: bool = False) -> None:
        self.ctx = ctx
        self.keep_graph = keep_graph
        self._stream: Stream | None = None
        self._graph: _graphs.Graph | None = None
        self._exec: _graphs.GraphExec | None = None
        self._pool: tuple[int, int] | None = None
        self._capturing = False
        self._allocator: Any = None

    def capture_begin(self, pool: tuple[int, int] | None = None, capture_error_mode: str = "global",
                      stream: Stream | None = None) -> Any:
        """Begin capturing work queued on `stream` (default: a side stream of the context's); allocations the
        context's caching allocator makes for the capture's streams come from this graph's private pool, or from
        `pool` (another graph's ``pool()`` or a ``graph_pool_handle()``), shared.

        Raises:
            RuntimeError: this graph has captured already (torch's rule: capture a new graph in a new instance).
            CudaError: the capture's own errors (mpsd_client.Stream.begin_capture).
        """
        return self.ctx._drive(self._capture_begin(pool, capture_error_mode, stream))

    def capture_end(self) -> Any:
        """End the capture and instantiate its graph.

        Raises:
            RuntimeError: no capture began. CudaError: the capture's end failed (invalidated, unjoined...): the
                graph then owns nothing, and its pool is given up.
        """
        return self.ctx._drive(self._capture_end())

    def replay(self, stream: Stream | None = None) -> Any:
        """Launch the whole captured graph on `stream` (default: the legacy default stream), one launch.

        Raises:
            RuntimeError: nothing was captured.
        """
        if self._exec is None:
            raise RuntimeError("replay() needs a successful capture first (capture_begin, then capture_end)")
        return self._exec.launch(stream)

    def reset(self) -> Any:
        """Destroy the executable graph (and the kept graph), and give up this graph's use of its pool: once no
        graph uses a pool, empty_cache returns its free memory. The instance may capture again."""
        return self.ctx._drive(self._reset())

    def pool(self) -> tuple[int, int]:
        """The id of the private pool this graph's capture allocated from (``graph(..., pool=g.pool())`` shares it).

        Raises:
            RuntimeError: no capture has begun.
        """
        if self._pool is None:
            raise RuntimeError("pool() is known once capture_begin has been called")
        return self._pool

    def raw_cuda_graph(self) -> _graphs.Graph:
        """The captured `Graph` (kept with keep_graph=True only)."""
        if self._graph is None:
            raise RuntimeError("the captured graph is kept only with CUDAGraph(ctx, keep_graph=True)")
        return self._graph

    def raw_cuda_graph_exec(self) -> _graphs.GraphExec:
        """The executable graph that replay() launches."""
        if self._exec is None:
            raise RuntimeError("nothing was captured")
        return self._exec

    def debug_dump(self, path: str | os.PathLike[str]) -> Any:
        """Write the kept graph in Graphviz's dot language (``cudaGraphDebugDotPrint``)."""
        return self.raw_cuda_graph().to_dot(path)

    # -- the steps ------------------------------------------------------------------------------------------
    def _capture_begin(self, pool: tuple[int, int] | None, mode: str, stream: Stream | None) -> Op:
        if self._exec is not None or self._capturing:
            raise RuntimeError("this CUDAGraph has captured a graph already: reset() it, or capture into a new one")
        ctx = self.ctx
        if stream is None:
            stream = _SIDE_STREAMS.get(ctx)
            if stream is None:
                stream = _SIDE_STREAMS[ctx] = yield from ctx._core.create_stream(ctx, 0, False)
        yield from _graphs.begin_capture(stream, mode)
        self._stream, self._capturing = stream, True
        # (tuple(): a caller may give graph_pool_handle()'s pair as a list, which mypy cannot count the length of)
        self._pool = tuple(pool) if pool is not None else graph_pool_of_capture()  # type: ignore[assignment]
        self._allocator = _allocator(ctx)
        if self._allocator is not None:
            info = yield from _graphs.capture_info(stream)
            self._allocator._begin_allocate_to_pool(self._pool, _member_of(stream, info.id))

    def _capture_end(self) -> Op:
        if not self._capturing or self._stream is None:
            raise RuntimeError("capture_end() without capture_begin()")
        self._capturing = False
        allocator = self._allocator
        try:
            captured = yield from _graphs.end_capture(self._stream)
        except CudaError:
            if allocator is not None:
                allocator._end_allocate_to_pool(self._pool)
                allocator._release_pool(self._pool)
            raise
        if allocator is not None:
            allocator._end_allocate_to_pool(self._pool)
        self._exec = yield from _graphs._instantiate(captured)
        if self.keep_graph:
            self._graph = captured
        else:
            yield from self.ctx._core.invoke(Calls.graph_destroy, captured.handle)

    def _reset(self) -> Op:
        if self._exec is not None:
            yield from self.ctx._core.invoke(Calls.graph_exec_destroy, self._exec.handle)
        if self._graph is not None:
            yield from self.ctx._core.invoke(Calls.graph_destroy, self._graph.handle)
        if self._allocator is not None and self._pool is not None and self._exec is not None:
            self._allocator._release_pool(self._pool)
        self._exec = self._graph = None
        self._pool = self._allocator = None


def _member_of(origin: Stream, capture_id: Any) -> Any:
    """Whether a stream an allocation is for is in the capture that began on `origin`: the origin itself, or a
    stream forked into it (asked of the daemon: only while a capture is under way)."""
    def belongs(stream: Any) -> bool:
        if stream is None or not hasattr(stream, "handle"):
            return False
        if stream.handle == origin.handle:
            return True
        info: _graphs.CaptureInfo = stream.capture_info()
        return info.status != "none" and info.id == capture_id
    return belongs


class graph:  # noqa: N801 (torch.cuda.graph's name)
    """``torch.cuda.graph``: ``with graph(g, stream=s):`` captures what the block queues on `s` into the
    `CUDAGraph` g (``async with`` on an AsyncContext). On entry, as torch does, it waits for the device and empties
    the caching allocator's cache; on a clean exit it ends the capture and instantiates the graph. An exception in
    the block ends the capture without a graph, and is what the block raises.

    Args:
        cuda_graph: the CUDAGraph to capture into.
        pool: a pool id to share (another graph's ``pool()``, or ``graph_pool_handle()``).
        stream: the stream to capture on (default: one side stream per context, as torch keeps one).
        capture_error_mode: "global", "thread_local" or "relaxed" (cudaStreamCaptureMode).
    """

    def __init__(self, cuda_graph: CUDAGraph, pool: tuple[int, int] | None = None, stream: Stream | None = None,
                 capture_error_mode: str = "global") -> None:
        self.cuda_graph, self.pool, self.stream, self.mode = cuda_graph, pool, stream, capture_error_mode

    def __enter__(self) -> Stream | None:
        g = self.cuda_graph
        g.ctx.synchronize()
        allocator = _allocator(g.ctx)
        if allocator is not None:
            allocator.empty_cache()
        g.capture_begin(pool=self.pool, capture_error_mode=self.mode, stream=self.stream)
        return g._stream

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.cuda_graph.capture_end()
            return
        try:
            self.cuda_graph.capture_end()
        except CudaError:
            pass  # the block's own error is the one to see

    async def __aenter__(self) -> Stream | None:
        g = self.cuda_graph
        await g.ctx.synchronize()
        await g.capture_begin(pool=self.pool, capture_error_mode=self.mode, stream=self.stream)
        return g._stream

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            await self.cuda_graph.capture_end()
            return
        try:
            await self.cuda_graph.capture_end()
        except CudaError:
            pass
