# A context's streams and events, with CUDA's rules for each call: priorities clamped into the device's range, a
# destroyed stream's queued work still counted, an event's latest record (shared through an IPC event handle by
# the contexts that opened it), elapsed time between two recorded, timing-enabled events. Mixed into the context
# (mpsd.runtime.context.Context), whose work queue (_enqueue) and captures these calls go through.
"""A context's streams and events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from mpsd.backends.ops import OnStream, Record, Work
from mpsd.runtime.graphs import EVENT_RECORD, EVENT_WAIT
from mpsd.runtime.limits import refused
from mpsd_protocol import EVENT_EXTERNAL, InvalidResourceHandleError, InvalidValueError, NotReadyError, brief

if TYPE_CHECKING:
    from mpsd.runtime.capture import Capture
    from mpsd.runtime.context import Context
    from mpsd.runtime.ipc import Export, IpcRegistry
    from mpsd.runtime.limits import ClientLimits

__all__ = ["Event", "EventCell", "NON_BLOCKING", "STREAM_PRIORITY_GREATEST", "STREAM_PRIORITY_LEAST", "Stream",
           "StreamCalls"]

STREAM_PRIORITY_GREATEST, STREAM_PRIORITY_LEAST = -5, 0  # cudaDeviceGetStreamPriorityRange on Hopper
NON_BLOCKING = 0x1  # cudaStreamNonBlocking


def _event_flags(flags: int, call: str) -> bool:
    """Whether a record's or a wait's flags are cudaEvent{Record,Wait}External, the one flag either takes."""
    if flags & ~EVENT_EXTERNAL:
        raise InvalidValueError(f"{call}: bad flags {flags:#x}")
    return bool(flags)


@dataclass(eq=False, slots=True)
class Stream:
    id: int
    priority: int
    blocking: bool
    key: tuple[int, int]
    tail: Work | None = None


@dataclass(eq=False, slots=True)
class EventCell:
    """An event's latest record. IPC event handles share one cell among the processes that opened it."""

    record: Record | None = None
    users: int = 1  # events (in any context) that use this cell
    export: Export | None = None


@dataclass(eq=False, slots=True)
class Event:
    id: int
    timing: bool
    interprocess: bool
    cell: EventCell = field(default_factory=EventCell)
    captured: Any = None  # (capture, the nodes it marks) where it was last recorded in a capture (mpsd.runtime.capture)

    @property
    def record(self) -> Record | None:
        return self.cell.record


class StreamCalls:
    """The stream and event calls of a context (mixed into mpsd.runtime.context.Context)."""

    streams: dict[int, Stream]
    events: dict[int, Event]
    _orphans: list[Work]  # last work of destroyed streams: it still counts

    if TYPE_CHECKING:  # what the Context they are mixed into has, for the type checker (the real ones are there)
        id: int
        ipc: IpcRegistry
        limits: ClientLimits
        capturing: dict[int, Capture]  # (CaptureCalls')

        def _handle(self) -> int: ...
        def _stream(self, stream: int | None) -> Stream: ...
        def _on(self, stream: Stream) -> OnStream: ...
        def _enqueue(self, stream: Stream, work: Work, count: int = 1) -> Work: ...
        def _stream_gone(self, stream: int) -> None: ...
        def _capture_event_node(self, stream: Stream, event: Event, type: str) -> bool: ...
        def _capture_wait(self, stream: Stream, event: Event) -> bool: ...
        def _capture_record(self, event: Event, stream: Stream) -> bool: ...

    def create_stream(self, priority: int, flags: int) -> tuple[int, int]:
        if flags & ~NON_BLOCKING:
            raise InvalidValueError(f"bad stream flags {flags:#x}")
        # Priorities outside the range are clamped, as the runtime does.
        priority = min(max(priority, STREAM_PRIORITY_GREATEST), STREAM_PRIORITY_LEAST)
        if len(self.streams) > self.limits.streams:  # (the default stream is not one it created)
            raise refused("streams", self.limits.streams)
        stream_id = self._handle()
        self.streams[stream_id] = Stream(stream_id, priority, not flags & NON_BLOCKING, (self.id, stream_id))
        return stream_id, priority

    def destroy_stream(self, stream: int) -> None:
        # Work already queued still runs, as with cudaStreamDestroy; the handle is gone at once.
        gone = self.streams.pop(stream, None) if stream else None  # None and 0: the default stream
        if gone is None:
            raise InvalidResourceHandleError(f"no stream {brief(stream, 20)} to destroy")
        if self.capturing:
            self._stream_gone(stream)
        self._orphans = [op for op in self._orphans if not op.done]
        if gone.tail is not None and not gone.tail.done:
            self._orphans.append(gone.tail)

    def stream_tail(self, stream: int | None) -> Work | None:
        return self._stream(stream).tail

    def stream_query(self, stream: int | None) -> bool:
        tail = self._stream(stream).tail
        return tail is None or tail.done

    def stream_wait_event(self, stream: int | None, event: int, flags: int = 0) -> None:
        s, e = self._stream(stream), self._event(event)
        external = _event_flags(flags, "stream_wait_event")
        if self.capturing and external and self._capture_event_node(s, e, EVENT_WAIT):
            return
        if (self.capturing or e.captured is not None) and self._capture_wait(s, e):
            return
        if e.record is not None and not e.record.done:
            self._enqueue(s, Record(**self._on(s), after=(e.record,)))

    def create_event(self, disable_timing: bool, interprocess: bool) -> int:
        if interprocess and not disable_timing:
            raise InvalidValueError("an interprocess event must also disable timing")
        self.check_events()
        event_id = self._handle()
        self.events[event_id] = Event(event_id, not disable_timing, bool(interprocess))
        return event_id

    def check_events(self) -> None:
        """Raise if this client holds as many events as it may (its own and those opened from IPC handles)."""
        if len(self.events) >= self.limits.events:
            raise refused("events", self.limits.events)

    def _event(self, event: int) -> Event:
        e = self.events.get(event)
        if e is None:
            raise InvalidResourceHandleError(f"no event {brief(event, 20)} in this context")
        return e

    def destroy_event(self, event: int) -> None:
        self.ipc.event_destroyed(self._event(event).cell)
        del self.events[event]

    def record_event(self, event: int, stream: int | None, flags: int = 0) -> None:
        e, s = self._event(event), self._stream(stream)
        external = _event_flags(flags, "event_record")
        if self.capturing and external and self._capture_event_node(s, e, EVENT_RECORD):
            return
        if self.capturing and self._capture_record(e, s):
            return
        record = Record(**self._on(s))
        self._enqueue(s, record)  # (it returns the work it was given)
        e.captured = None
        e.cell.record = record

    # -- IPC event handles ---------------------------------------------------------------------------
    def ipc_get_event_handle(self, event: int) -> bytes:
        e = self._event(event)
        if not e.interprocess or e.timing:
            raise InvalidResourceHandleError("only events created with interprocess=True and disable_timing=True "
                                             "have IPC handles")
        return self.ipc.export_event(cast("Context", self), e.cell)

    def ipc_open_event_handle(self, handle: object) -> int:
        """A new event of this context sharing the exported event's records (it behaves as disable-timing)."""
        self.check_events()
        cell = self.ipc.open_event(cast("Context", self), handle)
        cell.users += 1
        event_id = self._handle()
        self.events[event_id] = Event(event_id, False, True, cell)
        return event_id

    def event_record_op(self, event: int) -> Record | None:
        return self._event(event).record

    def event_query(self, event: int) -> bool:
        record = self._event(event).record
        return record is None or record.done  # a never-recorded event counts as complete

    def elapsed_ms(self, start: int, end: int) -> float:
        a, b = self._event(start), self._event(end)
        if not (a.timing and b.timing):
            raise InvalidResourceHandleError("elapsed time needs two events created with timing enabled")
        if a.record is None or b.record is None:
            raise InvalidResourceHandleError("elapsed time needs two recorded events")
        if not (a.record.done and b.record.done):
            raise NotReadyError("an event has not completed yet")
        return (b.record.ended - a.record.ended) * 1e3

    def tails(self) -> list[Work]:
        """The last op of every stream: what a context synchronize waits for."""
        tails = [s.tail for s in self.streams.values() if s.tail is not None] + self._orphans
        return [op for op in tails if not op.done]
