# Stream capture (cudaStreamBeginCapture ... cudaStreamEndCapture), with CUDA's rules as an H200 showed them
# (bench/fidelity/graph_capture_h200.txt; docs/architecture.md lists them). Rule 1: everything a capture changes in
# how a call behaves is here, decided from the call's row (mpsd_protocol's Call.capture), or where the work is
# queued (Context._enqueue asks `_captured`), so that the rest of the context knows nothing of captures.
#
# A capture lives in the context, as the daemon owns the streams: `capturing` maps each stream in a capture to it
# (its origin, and the streams that joined it by waiting on an event recorded in it: a fork), and each such
# stream's current dependencies, the nodes its next captured work runs after. Work queued on such a stream
# becomes nodes of the capture's graph and is not run. A call the capture forbids fails with CUDA's code and
# invalidates the capture, whose further work is cudaErrorStreamCaptureInvalidated, and so is its end.
#
# Threads are the client's: it sends its thread with begin and end, and, while one of its captures is under way,
# with every call (`thread`, and `thread_mode` where cudaThreadExchangeStreamCaptureMode set one), so that the
# thread-local and relaxed modes' rules are CUDA's: a potentially unsafe call is refused to the thread whose
# global or thread-local capture is under way, and to every thread in global mode while any global one is.
"""Stream capture: its state and its rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpsd.backends.ops import Copy, Memset, Record, Work
from mpsd.runtime.graphs import CAPTURED, Graph, Node, NodeBudget
from mpsd_protocol import (
    CAPTURE_ACTIVE,
    CAPTURE_GLOBAL,
    CAPTURE_INVALIDATED,
    CAPTURE_NONE,
    CAPTURE_RELAXED,
    CAPTURE_THREAD_LOCAL,
    COPY,
    QUERY_EVENT,
    QUERY_STREAM,
    SYNC_DEVICE,
    SYNC_EVENT,
    SYNC_STREAM,
    UNSAFE,
    WORK,
    CapturedEventError,
    CudaError,
    IllegalStateError,
    InvalidValueError,
    StreamCaptureImplicitError,
    StreamCaptureInvalidatedError,
    StreamCaptureIsolationError,
    StreamCaptureMergeError,
    StreamCaptureUnjoinedError,
    StreamCaptureUnmatchedError,
    StreamCaptureUnsupportedError,
    StreamCaptureWrongThreadError,
    brief,
)

if TYPE_CHECKING:
    from mpsd.runtime.streams import Event, Stream
    from mpsd_protocol import Call

__all__ = ["Capture", "CaptureCalls"]

MODE_NAMES = {CAPTURE_GLOBAL: "global", CAPTURE_THREAD_LOCAL: "thread-local", CAPTURE_RELAXED: "relaxed"}


@dataclass(eq=False)
class Capture:
    """One capture sequence.

    Attributes:
        id: its id (cudaStreamGetCaptureInfo's).
        origin: the stream it began on, where it must end.
        mode: CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL or CAPTURE_RELAXED.
        thread: the client thread that began it.
        graph: what it has captured.
        deps: for each stream in it, the nodes its next work runs after.
        invalidated: a forbidden call was made: the rest of it fails, and so does its end.
    """

    id: int
    origin: int
    mode: int
    thread: int
    graph: Graph
    deps: dict[int, tuple[int, ...]]
    invalidated: bool = False


class CaptureCalls:
    """The capture calls and rules of a context (mixed into mpsd.runtime.context.Context)."""

    capturing: dict[int, Capture]  # stream id -> the capture it is in
    streams: dict[int, Stream]
    events: dict[int, Event]
    last_error: CudaError | None
    _node_params: dict[str, Any] | None

    if TYPE_CHECKING:  # what the Context they are mixed into has, for the type checker (the real ones are there)
        graphs: dict[int, Graph]  # (GraphCalls')
        _into: tuple[Graph, tuple[int, ...]] | None

        def _handle(self) -> int: ...
        def _stream(self, stream: int | None) -> Stream: ...
        _nodes: NodeBudget
        def _add_nodes(self, graph: Graph, work: Work, deps: tuple[int, ...], count: int = 1) -> tuple[int, ...]: ...
        def _new_graph(self) -> Graph: ...
        def _memory_gone(self, graph: Graph) -> None: ...  # (GraphMemoryCalls')

    def _init_capture(self) -> None:
        self.capturing = {}

    def _captures(self) -> list[Capture]:
        """The captures under way, each once."""
        return list({id(c): c for c in self.capturing.values()}.values())

    # -- the calls ---------------------------------------------------------------------------------------
    def stream_begin_capture(self, stream: int | None, mode: int, thread: int) -> None:
        """``cudaStreamBeginCapture``: work queued on the stream from now on is captured, not run.

        Raises:
            InvalidValueError: an unknown mode. StreamCaptureUnsupportedError: the legacy default stream.
            IllegalStateError: the stream captures already.
        """
        if mode not in MODE_NAMES:
            raise InvalidValueError(f"no capture mode {brief(mode, 20)} (0 global, 1 thread-local, 2 relaxed)")
        s = self._stream(stream)
        if s.id == 0:
            raise StreamCaptureUnsupportedError("the legacy default stream cannot be captured")
        if s.id in self.capturing:
            raise IllegalStateError(f"stream {s.id} is capturing already")
        self.capturing[s.id] = Capture(self._handle(), s.id, mode, thread, self._new_graph(), {s.id: ()})

    def stream_end_capture(self, stream: int | None, thread: int) -> int:
        """``cudaStreamEndCapture``: the capture ends, and its graph is the context's; its handle.

        Raises:
            IllegalStateError: the stream is not capturing. StreamCaptureUnmatchedError: it joined a capture that
                began on another stream (that capture is invalidated). StreamCaptureWrongThreadError: a
                thread-local capture ended by another thread (it goes on). StreamCaptureInvalidatedError: a
                forbidden call invalidated it. StreamCaptureUnjoinedError: a stream forked from it has work the
                origin did not wait for. Either of the last two ends it without a graph.
        """
        s = self._stream(stream)
        cap = self.capturing.get(s.id)
        if cap is None:
            raise IllegalStateError(f"stream {s.id} is not capturing")
        if cap.origin != s.id:
            cap.invalidated = True
            raise StreamCaptureUnmatchedError(f"the capture stream {s.id} is in began on stream {cap.origin}")
        if cap.mode == CAPTURE_THREAD_LOCAL and thread != cap.thread:
            raise StreamCaptureWrongThreadError(f"the thread-local capture on stream {s.id} began in another thread")
        self._end(cap)
        unjoined = [] if cap.invalidated else self._unjoined(cap)
        if cap.invalidated or unjoined:  # no graph: its nodes and allocations go
            self._nodes.give(cap.graph.size)
            if cap.graph.memory:
                self._memory_gone(cap.graph)
        if cap.invalidated:
            raise StreamCaptureInvalidatedError(f"the capture on stream {s.id} was invalidated")
        if unjoined:
            raise StreamCaptureUnjoinedError(f"stream{'s' if len(unjoined) > 1 else ''} "
                                             f"{', '.join(map(str, unjoined))} forked from stream {s.id} "
                                             "did not join it again")
        self.graphs[cap.graph.id] = cap.graph
        return cap.graph.id

    def stream_is_capturing(self, stream: int | None) -> int:
        """``cudaStreamIsCapturing``: CAPTURE_NONE, CAPTURE_ACTIVE or CAPTURE_INVALIDATED."""
        cap = self.capturing.get(self._stream(stream).id)
        return CAPTURE_NONE if cap is None else CAPTURE_INVALIDATED if cap.invalidated else CAPTURE_ACTIVE

    def stream_get_capture_info(self, stream: int | None) -> dict[str, Any]:
        """``cudaStreamGetCaptureInfo``: the status, and while it captures its capture's id, the graph it builds
        and the nodes the stream's next work would depend on."""
        s = self._stream(stream)
        cap = self.capturing.get(s.id)
        if cap is None:
            return {"status": CAPTURE_NONE}
        return {"status": CAPTURE_INVALIDATED if cap.invalidated else CAPTURE_ACTIVE, "id": cap.id,
                "graph": cap.graph.id, "mode": cap.mode, "dependencies": list(cap.deps[s.id])}

    # -- the rules -----------------------------------------------------------------------------------------
    def capture_rule(self, call: Call, values: tuple[Any, ...], args: dict[str, Any]) -> None:
        """What `call` (its row's values; `args` as they came, with the caller's thread) may do while streams
        of this context capture: refused (and the captures it is refused for invalidated), or let go on, its
        arguments noted where it may become a node. The session asks before the call's handler runs."""
        kind = call.capture
        if kind in (WORK, COPY):
            self._node_params = {arg.name: value for arg, value in zip(call.args, values)
                                 if arg.name not in ("stream", "staged")}
            if call.cost[1] in ("h2d", "d2h", "d2d"):
                self._node_params = {"kind": call.cost[1], **self._node_params}
            if kind == COPY:
                names = [arg.name for arg in call.args]
                stream, staged = values[names.index("stream")], values[names.index("staged")]
                cap = self.capturing.get(stream) if stream is not None else None
                if cap is not None and staged:
                    self._refuse([cap], StreamCaptureUnsupportedError(
                        f"{call.name}: a copy of pageable memory cannot be captured (its bytes go by a staging "
                        "buffer when the call is made): copy from a pinned buffer"))
                if stream is None or (staged and call.cost[1] == "d2h"):  # it synchronises
                    self._unsafe(call, args)
            return
        if kind == UNSAFE:
            self._unsafe(call, args)
        elif kind == SYNC_DEVICE:
            captures = self._captures()
            if captures:
                self._refuse(captures, StreamCaptureUnsupportedError(
                    "a device synchronize is not permitted while a stream captures"))
        elif kind in (SYNC_STREAM, QUERY_STREAM):
            stream = values[0]
            cap = self.capturing.get(0 if stream is None else stream)
            if cap is not None:
                self._refuse([cap], StreamCaptureUnsupportedError(
                    f"{call.name} of stream {stream} is not permitted while it captures"))
            if kind == SYNC_STREAM:
                self._unsafe(call, args)
        elif kind in (SYNC_EVENT, QUERY_EVENT):
            event = self.events.get(values[0])
            cap = self._event_capture(event) if event is not None else None
            if cap is not None:
                self._refuse([cap], CapturedEventError(f"{call.name}: event {values[0]} was last recorded in a "
                                                       "capture under way"))
            if kind == SYNC_EVENT:
                self._unsafe(call, args)

    def _unsafe(self, call: Call, args: dict[str, Any]) -> None:
        """A potentially unsafe call from the calling thread, refused where the captures' modes say."""
        thread = args.get("thread", 0)
        mode = args.get("thread_mode", CAPTURE_GLOBAL)
        if mode == CAPTURE_RELAXED:
            return
        refused = [c for c in self._captures()
                   if (c.thread == thread and c.mode != CAPTURE_RELAXED)
                   or (c.thread != thread and c.mode == CAPTURE_GLOBAL and mode == CAPTURE_GLOBAL)]
        if refused:
            self._refuse(refused, StreamCaptureUnsupportedError(
                f"{call.name} is not permitted while stream {refused[0].origin} captures in "
                f"{MODE_NAMES[refused[0].mode]} mode"))

    def _refuse(self, captures: list[Capture], error: CudaError) -> None:
        for cap in captures:
            cap.invalidated = True
        raise error

    def _event_capture(self, event: Event) -> Capture | None:
        """The capture under way that `event` was last recorded in, if any."""
        captured = event.captured
        if captured is None:
            return None
        cap = captured[0]
        return cap if self.capturing.get(cap.origin) is cap else None

    def _end(self, cap: Capture) -> None:
        """The capture is over: its streams capture no more, and what its captured calls left as the last error
        is no error of later calls' (CUDA returned it from the call itself)."""
        for sid in [sid for sid, c in self.capturing.items() if c is cap]:
            del self.capturing[sid]
        if self.last_error is not None and 900 <= self.last_error.code <= 908:
            self.last_error = None

    def _unjoined(self, cap: Capture) -> list[int]:
        """The streams of the capture whose last nodes the origin's do not come after."""
        nodes = cap.graph.nodes
        seen: set[int] = set()
        todo = list(cap.deps[cap.origin])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(nodes[node].deps)
        return sorted(sid for sid, deps in cap.deps.items() if sid != cap.origin and not seen.issuperset(deps))

    # -- where work is queued, events recorded and waited for ------------------------------------------------
    def _captured(self, stream: Stream, work: Work, count: int) -> bool:
        """Whether `work` (`count` launches of it), about to be queued on `stream`, was taken as nodes instead:
        into a capture the stream is in, or into the graph a node is being made for (graph_add_node).

        Raises:
            StreamCaptureInvalidatedError: the stream's capture was invalidated.
            StreamCaptureImplicitError: work on the legacy default stream, which would wait for a capturing
                blocking stream (the captures invalidated).
        """
        into = self._into
        if into is not None:
            self._add_nodes(into[0], work, into[1], count)
            work.handle = CAPTURED
            return True
        if isinstance(work, (Copy, Memset)) and work.dst.nbytes == 0:
            work.handle = CAPTURED  # no bytes, no work: no node, and no stream's rules, as on the H200
            return True
        cap = self.capturing.get(stream.id)
        if cap is None:
            if stream.id == 0:
                implicit = [c for sid, c in self.capturing.items() if self.streams[sid].blocking]
                if implicit:
                    self._refuse(list({id(c): c for c in implicit}.values()), StreamCaptureImplicitError(
                        f"work on the legacy stream would wait for capturing stream {implicit[0].origin}"))
            return False
        if cap.invalidated:
            raise StreamCaptureInvalidatedError(f"the capture on stream {cap.origin} was invalidated")
        if not isinstance(work, Record):  # (a Record here is a pool's wait: no node)
            cap.deps[stream.id] = self._add_nodes(cap.graph, work, cap.deps[stream.id], count)
        work.handle = CAPTURED
        return True

    def _capture_event_node(self, stream: Stream, event: Event, type: str) -> bool:
        """cudaEventRecordExternal or cudaEventWaitExternal on a capturing stream: an event record (wait) node of
        the capture's graph, after the stream's nodes so far, which the stream's next work runs after. Where the
        record or the wait is no edge of the capture, it may name an event outside it (no isolation error)."""
        cap = self.capturing.get(stream.id)
        if cap is None:
            return False
        if cap.invalidated:
            raise StreamCaptureInvalidatedError(f"the capture on stream {cap.origin} was invalidated")
        node = cap.graph.add(Node(self._handle(), type, cap.deps[stream.id], {"event": event.id}, event=event))
        cap.deps[stream.id] = (node.id,)
        return True

    def _capture_record(self, event: Event, stream: Stream) -> bool:
        """An event recorded on a capturing stream marks the nodes the stream has reached (a fork point or a
        join point for stream_wait_event), and records nothing."""
        cap = self.capturing.get(stream.id)
        if cap is None:
            return False
        if cap.invalidated:
            raise StreamCaptureInvalidatedError(f"the capture on stream {cap.origin} was invalidated")
        event.captured = (cap, cap.deps[stream.id])
        return True

    def _capture_wait(self, stream: Stream, event: Event) -> bool:
        """A stream waits on an event: where either is in a capture, the capture's rules. A stream outside any
        capture waiting on an event recorded in one joins it (a fork); a stream of the capture waiting on one
        of its events depends on the nodes the event marked (a join).

        Raises:
            StreamCaptureMergeError: stream and event are in two captures. StreamCaptureIsolationError: a
                capturing stream waits on an event recorded outside the capture. StreamCaptureUnsupportedError:
                the legacy default stream would join a capture. StreamCaptureInvalidatedError: the stream's
                capture was invalidated. Each but the last invalidates the captures involved.
        """
        joined, at = self._event_capture(event), self.capturing.get(stream.id)
        if joined is not None:
            marked = event.captured[1]
            if at is None:
                if stream.id == 0:
                    self._refuse([joined], StreamCaptureUnsupportedError(
                        "the legacy default stream cannot join a capture"))
                self.capturing[stream.id] = joined
                joined.deps[stream.id] = marked
                return True
            if at is not joined:
                self._refuse([at, joined], StreamCaptureMergeError(
                    f"stream {stream.id} would merge the captures of streams {at.origin} and {joined.origin}"))
            if at.invalidated:
                raise StreamCaptureInvalidatedError(f"the capture on stream {at.origin} was invalidated")
            at.deps[stream.id] = tuple(dict.fromkeys(at.deps[stream.id] + marked))
            return True
        if at is None:
            return False
        if at.invalidated:
            raise StreamCaptureInvalidatedError(f"the capture on stream {at.origin} was invalidated")
        if event.record is not None:
            self._refuse([at], StreamCaptureIsolationError(
                f"stream {stream.id} captures, and event {event.id} was recorded outside its capture"))
        return True  # a never-recorded event: nothing to wait for

    def _stream_gone(self, stream: int) -> None:
        """A capturing stream was destroyed: its capture is invalidated, and over if it began there."""
        cap = self.capturing.pop(stream, None)
        if cap is not None:
            cap.invalidated = True
            if cap.origin == stream:
                self._end(cap)
                self._nodes.give(cap.graph.size)
