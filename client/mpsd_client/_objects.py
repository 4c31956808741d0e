# The handles users hold: device pointers, pinned host buffers, streams and events. Stream and Event methods
# forward to their context's `_drive`, which is blocking in `Context` and awaitable in `AsyncContext`, so the
# same classes serve both shells: `s.synchronize()` there, `await s.synchronize()` here.
from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Any

from mpsd_protocol import EVENT_EXTERNAL, Calls

from . import _graphs

if TYPE_CHECKING:
    from ._api import ContextBase


class DevicePointer(int):
    """A device address in this client's address space: an int, with the size of what lies behind it.

    ``p + 4096`` is a pointer 4096 bytes further on, with 4096 fewer bytes behind it.
    """

    size: int
    ctx: ContextBase | None

    def __new__(cls, addr: int, size: int = 0, ctx: ContextBase | None = None) -> DevicePointer:
        self = super().__new__(cls, addr)
        self.size = max(int(size), 0)
        self.ctx = ctx
        return self

    def host_view(self) -> Any:
        """A writable memoryview of the device bytes from here to the end of the allocation, shared with the
        daemon (no copy): what a kernel wrote is there once it has completed. Awaitable on an AsyncContext.

        Raises:
            InvalidValueError: the pointer was not made by a context (build one with ``ctx.host_view(p)``).
        """
        if self.ctx is None:
            from mpsd_protocol import InvalidValueError

            raise InvalidValueError("this pointer belongs to no context: use ctx.host_view(ptr)")
        return self.ctx.host_view(self)

    @property
    def addr(self) -> int:
        return int(self)

    def __add__(self, offset: object) -> DevicePointer:
        if not isinstance(offset, int):
            return NotImplemented
        return DevicePointer(int(self) + offset, self.size - offset, self.ctx)

    __radd__ = __add__

    def __sub__(self, offset: object) -> Any:
        if isinstance(offset, DevicePointer):
            return int(self) - int(offset)  # a distance, like pointer subtraction in C
        if not isinstance(offset, int):
            return NotImplemented
        return DevicePointer(int(self) - offset, self.size + offset, self.ctx)

    def __repr__(self) -> str:
        return f"DevicePointer({int(self):#x}, size={self.size})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (DevicePointer, (int(self), self.size))


class HostBuffer(mmap.mmap):
    """Pinned host memory: a memfd mapped both here and in the daemon. ``memoryview(h)`` works.

    Copies from or to it are DMA-like: on a stream they read or write the buffer when they run, and no
    bytes cross the socket.
    """

    id: int
    nbytes: int
    base_address: int

    def __repr__(self) -> str:
        return f"<HostBuffer id={getattr(self, 'id', '?')} nbytes={getattr(self, 'nbytes', '?')}>"


class Stream:
    """A CUDA stream. Work on one stream runs in order; work on different streams may overlap."""

    def __init__(self, ctx: ContextBase, handle: int, priority: int, non_blocking: bool) -> None:
        self.ctx = ctx
        self.handle = handle
        self.priority = priority
        self.non_blocking = non_blocking

    def synchronize(self) -> Any:
        """Wait until all work queued on this stream has completed (``cudaStreamSynchronize``)."""
        return self.ctx._drive(self.ctx._core.invoke(Calls.stream_synchronize, self))

    def query(self) -> Any:
        """True if all work queued on this stream has completed (``cudaStreamQuery``)."""
        return self.ctx._drive(self.ctx._core.invoke(Calls.stream_query, self))

    def wait_event(self, event: Event, external: bool = False) -> Any:
        """Make later work on this stream wait for `event`'s latest record (``cudaStreamWaitEvent``). With
        `external` (cudaEventWaitExternal), a capture makes the wait an event wait node of its graph, which may wait
        on an event recorded outside the capture; outside a capture it changes nothing."""
        return self.ctx._drive(self.ctx._core.invoke(Calls.stream_wait_event, self, event,
                                                     EVENT_EXTERNAL if external else 0))

    def destroy(self) -> Any:
        """Destroy the stream; work already queued on it still runs (``cudaStreamDestroy``). A capture it is in is
        invalidated, and ends where it began here."""
        return self.ctx._drive(self.ctx._core.invoke(Calls.destroy_stream, self))

    # -- stream capture (mpsd.runtime.capture has the rules) ---------------------------------------------------
    def begin_capture(self, mode: str = "global") -> Any:
        """``cudaStreamBeginCapture``: work queued on this stream from now on (and on the streams that wait on
        events recorded in it: a fork) is recorded as a graph's nodes, not run, until `end_capture`. `mode`
        ("global", "thread_local" or "relaxed") says which other calls are refused meanwhile, as CUDA's modes do.

        Raises:
            InvalidValueError: another mode. StreamCaptureUnsupportedError: the legacy default stream.
            IllegalStateError: this stream captures already.
        """
        return self.ctx._drive(_graphs.begin_capture(self, mode))

    def end_capture(self) -> Any:
        """``cudaStreamEndCapture``: the `Graph` captured.

        Raises:
            IllegalStateError: the stream is not capturing. StreamCaptureUnmatchedError: its capture began on
                another stream. StreamCaptureWrongThreadError: a thread-local capture of another thread.
            StreamCaptureInvalidatedError: a refused call invalidated it. StreamCaptureUnjoinedError: a stream
                forked from it was not joined back (waited on) before the end. Either ends it without a graph.
        """
        return self.ctx._drive(_graphs.end_capture(self))

    def is_capturing(self) -> Any:
        """``cudaStreamIsCapturing``: whether a capture is under way on this stream (active or invalidated)."""
        return self.ctx._drive(_graphs.is_capturing(self))

    def capture_info(self) -> Any:
        """``cudaStreamGetCaptureInfo``: a `CaptureInfo` (status, id, mode, graph, dependencies)."""
        return self.ctx._drive(_graphs.capture_info(self))

    def __repr__(self) -> str:
        return f"<Stream {self.handle} priority={self.priority}>"


class Event:
    """A CUDA event: a marker recorded into a stream."""

    def __init__(self, ctx: ContextBase, handle: int, disable_timing: bool, interprocess: bool) -> None:
        self.ctx = ctx
        self.handle = handle
        self.disable_timing = disable_timing
        self.interprocess = interprocess

    def record(self, stream: Stream | None = None, external: bool = False) -> Any:
        """Record the event in `stream` (the default stream if None) (``cudaEventRecord``). With `external`
        (cudaEventRecordExternal), a capture makes the record an event record node of its graph, which records the
        event each time the graph runs; outside a capture it changes nothing."""
        return self.ctx._drive(self.ctx._core.invoke(Calls.event_record, self, stream,
                                                     EVENT_EXTERNAL if external else 0))

    def synchronize(self) -> Any:
        """Wait until the event's latest record has completed (``cudaEventSynchronize``)."""
        return self.ctx._drive(self.ctx._core.invoke(Calls.event_synchronize, self))

    def query(self) -> Any:
        """True if the latest record has completed, or the event was never recorded (``cudaEventQuery``)."""
        return self.ctx._drive(self.ctx._core.invoke(Calls.event_query, self))

    def elapsed_ms(self, end: Event) -> Any:
        """Simulated milliseconds from this event to `end` (``cudaEventElapsedTime``).

        Raises:
            InvalidResourceHandleError: either event disables timing or was never recorded.
            NotReadyError: either has not completed yet.
        """
        return self.ctx._drive(self.ctx._core.invoke(Calls.event_elapsed, self, end))

    def destroy(self) -> Any:
        """Destroy the event (``cudaEventDestroy``)."""
        return self.ctx._drive(self.ctx._core.invoke(Calls.destroy_event, self))

    def __repr__(self) -> str:
        return f"<Event {self.handle}>"
