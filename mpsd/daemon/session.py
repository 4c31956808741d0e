# One client connection: a thin trio loop around the sans-IO protocol Connection, dispatching each call from
# its row in mpsd_protocol's table of calls (arguments checked there) to the context method of its name, or to
# `on_<name>` here where the call needs more than one. Calls that must wait for the GPU (synchronize, blocking
# copies, free) run as tasks, so the session keeps reading: replies may come back out of order, as
# msgpack-rpc allows, while the order in which work is queued stays the order in which it arrived.
#
# Under the virtual clock every call is stamped when it arrives with the simulated time at which it starts
# on the client's host thread (its clock, plus its own code's time where the daemon charges it), and applied
# when the device reaches that time, in stamp order across clients (mpsd.clock, which also says what each
# kind of call costs the host; a call's kind is its row's). `clock`, `sleep` and `idle` act on the client's
# clock alone.
#
# Under either clock, a launch call that finds LAUNCH_QUEUE launches of its client unfinished (or
# MAX_STAGED_BYTES of its pageable copies held) waits until one ends, and the session reads nothing more from
# that client meanwhile: a flood of work blocks its sender, not the daemon. And a session yields to the
# others every FAIR_MESSAGES messages, so one client's backlog delays another's request by a bounded slice.
#
# Nothing a client sends can take the daemon down: protocol errors close this connection only; a bad call
# gets the CUDA error a real runtime would give; an unexpected exception becomes cudaErrorUnknown and a log
# line, and the session goes on.
from __future__ import annotations

import functools
import logging
import os
import select
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import trio

from mpsd.backends.base import HOST_VIEW
from mpsd.backends.engine import VirtualEngine
from mpsd.backends.ops import Plan, Work
from mpsd.clock import Host, Timing
from mpsd.daemon.channel import Channel
from mpsd.daemon.sync_latency import SyncLatency
from mpsd.runtime.context import Context
from mpsd.runtime.kernels import signatures
from mpsd.runtime.limits import refused
from mpsd_protocol import (
    CALL,
    CALLS,
    CLOCK,
    CLOSED,
    HELLO,
    LAUNCH,
    NEED_DATA,
    NOTHING,
    PROTOCOL_ERROR,
    PROTOCOL_VERSION,
    Call,
    Calls,
    Connection,
    CudaError,
    InvalidDeviceError,
    InvalidValueError,
    MpsConnectionError,
    MpsServerNotReadyError,
    Notification,
    NotSupportedError,
    ProtocolError,
    Reply,
    Request,
    Role,
    brief,
    close_fds,
    format_size,
    make_error,
    peer_credentials,
)

if TYPE_CHECKING:
    from mpsd.daemon.routes import Route
    from mpsd.daemon.server import Daemon

log = logging.getLogger("mpsd.daemon.session")
IPC_LAZY_ENABLE_PEER_ACCESS = 0x1  # the one flag cudaIpcOpenMemHandle accepts
# Calls served by a context method of another name.
_CONTEXT_METHODS = {"event_record": "record_event", "event_elapsed": "elapsed_ms"}
# Work a client may have queued before its next launch call blocks: a real H200's host call blocked once
# about 1,000 to 1,023 launches were queued (h200-runtime-measurements.md); and the bytes of pageable copies
# the daemon may hold for one client until they run (each staged piece is at most 8 MiB).
LAUNCH_QUEUE = 1024
MAX_STAGED_BYTES = 256 << 20
FAIR_MESSAGES = 16  # messages of one client served before the others get a turn
HANGUP_POLL = 0.1  # wall seconds between looks at a blocked client's socket for a hang-up
MAX_HOST_TIME = 3600.0  # seconds of its own code a client may report for one gap between calls


@dataclass(frozen=True, slots=True)
class Deferred:
    """A reply that must wait: for `ops` to complete, then `then()` gives the result."""

    ops: Sequence[Work | None]
    then: Callable[[], Any] = lambda: None

    def ready(self) -> bool:
        return all(op is None or op.done for op in self.ops)


class Session:
    """Serves one connected client."""

    def __init__(self, daemon: Daemon, sock: socket.socket, route: Route | None = None) -> None:
        self.daemon = daemon
        self.pid, self.uid, self.gid = peer_credentials(sock)
        self.route = route  # the server/namespace socket it came in by (MPS v3), None: the main socket
        self.channel = Channel(sock, daemon.spin)
        self.conn = Connection(Role.SERVER)
        self.context: Context | None = None
        self.reader_scope = trio.CancelScope()
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._admitting = False
        self.host: Host | None = None  # this client's host clock, under the virtual clock
        self._engine: VirtualEngine | None = None  # and its device's engine (set with `host`)
        self._deferred = 0  # replies waiting for the device
        self._max_deferred = daemon.config.client_limits.waits  # (mpsd.runtime.limits)
        # The client's launch queue (`_full`): per stream, the work of its launch calls, oldest first, with the
        # staged bytes of each and the calls it stands for (a run of repeated launches is one work), and how
        # many calls there are (work that has ended since stays counted until the queue is next pruned); and
        # calls taken but not served yet (stamped, under the virtual clock).
        self._queues: dict[tuple[int, int], deque[tuple[Work, int, int]]] = {}
        self._queued = 0
        self._posted = 0
        self._staged = 0  # bytes of pageable copies among both, which the daemon holds until they run
        self._watched: set[Work] = set()  # heads of queues a held call waits on
        self._held: Request | Notification | None = None  # a launch call waiting for room in the queue
        self._room = trio.Event()  # set when the held call has gone on
        self._answered = trio.Event()  # set when the last of them has gone
        self._read_at = 0.0  # trio time of the last read from the socket: when the calls it held arrived
        self._received: Callable[[float], None] | None = None  # its backend's `received`, under the wall clock
        # Whether the connection remembers launch notifications (`_launch`), each as its plan and stream: the
        # read loop serves their repeats as one call of many launches.
        self._repeating = False
        # Only while --metrics is on: how long its synchronous calls took (mpsd.daemon.sync_latency).
        self.sync_latency = SyncLatency() if daemon.config.metrics is not None else None

    @property
    def _ctx(self) -> Context:
        if self.context is None:  # hello came first (the protocol sees to it), but may still be pending
            raise MpsServerNotReadyError("this client is still waiting for its server")
        return self.context

    # -- the I/O loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                with self.reader_scope:
                    await self._read_loop()
                if not self.reader_scope.cancelled_caught:
                    # The client went away (or broke the rules): replies still waiting on the GPU have
                    # nobody to go to, and its work must be reclaimed now, not when that work ends.
                    nursery.cancel_scope.cancel()
                else:  # the daemon is shutting down: replies already waiting get their grace period
                    while self._deferred:
                        await self._answered.wait()
        finally:
            self._queues.clear()
            self._watched.clear()
            self.conn.close_fds()
            self.channel.close()
            try:
                if self.context is not None:
                    if self.host is not None:
                        # Under the virtual clock the client holds the clock until its teardown, which goes in
                        # pieces, is over: every call stamped after it sees it all gone, as if it were one step.
                        self._virtual.leaving(self.host)
                    with trio.CancelScope(shield=True):  # a shutdown waits for it
                        await self.daemon.clients.detach(self.context)
            finally:
                if self.host is not None:  # it holds the clock no longer; its calls still queued come to nothing
                    engine = self._virtual
                    engine.clock.leave(self.host.client)
                    engine.heard(self.host)

    async def _read_loop(self) -> None:
        served = 0
        clock = trio.lowlevel.current_clock()  # trio.current_time() is this, less two calls
        # Whether repeats of a remembered launch may be next in line: after a read, a launch or a run, not after
        # a look found none (a loop's next run after a request starts at its next launch, served the short way).
        look = False
        while True:
            if look and self._repeating:
                taken = self._repeat(FAIR_MESSAGES - served % FAIR_MESSAGES)
                if taken:
                    if (served := served + taken) % FAIR_MESSAGES == 0:
                        await trio.lowlevel.checkpoint()
                        self._arrival()
                    continue
                look = False
            try:
                event = self.conn.next_event()
                if event is NEED_DATA:
                    self.conn.receive_data(*await self.channel.receive())
                    self._read_at = clock.current_time()
                    if self._received is not None:  # _arrival, inlined
                        self._received(self._read_at)
                    look = True
                    continue
            except ProtocolError as exc:
                self._protocol_error(str(exc))
                return
            except OSError:
                return  # the peer reset the connection: it is gone
            if event is CLOSED or self._closing:
                return
            if (type(event) is Notification and event.op == _LAUNCH and not event.fds and self.host is None
                    and self._queued + self._posted < LAUNCH_QUEUE):
                self._launch(event)  # a launch under the wall clock with room in the queue: most messages
                look = True
            elif isinstance(event, (Request, Notification)):
                self._receive(event)
                if self._closing:
                    return
                if self._held is not None:
                    if not await self._wait_for_room():
                        return  # the client hung up while its call was held
                    continue
            else:
                close_fds(event.fds)
                self._protocol_error("a client does not send replies")
                return
            if (served := served + 1) % FAIR_MESSAGES == 0:
                await trio.lowlevel.checkpoint()  # one read holds many messages: let other clients in
                self._arrival()

    async def _wait_for_room(self) -> bool:
        """Wait until the held call goes on (the client's call blocks: nothing more is read meanwhile). False
        if the client hangs up first: a client killed while its launch call is held is noticed now, not once
        its queue has drained."""
        while True:
            with trio.move_on_after(HANGUP_POLL):
                await self._room.wait()
                return True
            if _hung_up(self.channel.sock):
                return False

    def _protocol_error(self, text: str) -> None:
        """Say what was wrong, where the socket still allows it, then close this connection only."""
        self.daemon.log.complaint(("uid", self.uid),
                                  f"Client {self.pid}: protocol error, closing its connection: {text}")
        self._send(Notification(PROTOCOL_ERROR, {"message": text}))

    def _tell(self, op: str, args: dict[str, Any]) -> None:
        """A notice to this client that no call of its asked for (another client's call caused it)."""
        self._send(Notification(op, args))

    def _send(self, message: Reply | Notification) -> None:
        assert self._nursery is not None
        self.channel.send_nowait(self.conn.send(message), message.fds, self._nursery)

    def _reply(self, request_id: int, error: CudaError | None, result: Any = None,
               fds: tuple[int, ...] = ()) -> None:
        self._send(Reply(request_id, error.to_wire() if error else None, result, fds))

    # -- dispatch --------------------------------------------------------------------------------------
    def _request(self, request: Request, call: Call | None, timing: Timing | None = None) -> None:
        """Serve one request (`call` its row, if it has one). Under the virtual clock `timing` is the call's on
        the client's clock, which moves to when the call returns before it is answered."""
        if request.op == HELLO:
            self.daemon.greeted(self)
            self._hello(request)
            return
        try:
            if call is None:
                raise InvalidValueError(f"unknown request {brief(request.op, 60)}")
            result = self._dispatch(call, request.args, request.fds)
        except CudaError as exc:
            result = exc
        # Whatever a handler needed from the fds it has mapped by now; they go before the reply does.
        if request.fds:
            close_fds(request.fds)
        if isinstance(result, Deferred) and not result.ready():
            if self._deferred < self._max_deferred:
                if timing is not None:
                    self._virtual.clock.wait(self._host)
                self._deferred += 1
                began = time.perf_counter() if self.sync_latency is not None else 0.0
                self.daemon.device_of(self._ctx).backend.when_done(
                    result.ops, functools.partial(self._finish, request.id, result, timing, began))
                return
            # Past the client's limit (mpsd.runtime.limits): a synchronize or a free has done nothing yet; a copy
            # that waits was refused before it was queued (_room_to_wait), so none comes here.
            result = refused("waits", self._max_deferred)
        if timing is not None:
            self._returned(timing, waited=False)
        if isinstance(result, CudaError):
            self._reply(request.id, result)
        elif isinstance(result, Deferred):
            if self.sync_latency is not None:  # a synchronous call with nothing to wait for
                self.sync_latency.observe(0.0)
            self._complete(request.id, result)  # nothing to wait for: answer now, in order
        elif call.reply_fds:  # type: ignore[union-attr]  # (no call: an unknown op, whose result is the error above)
            self._reply(request.id, None, *result)
        else:  # a row that answers nothing answers None, whatever its context method gave (an op it queued)
            # (_reply and _send, inlined: most replies are these)
            # (as above)
            reply = Reply(request.id, None, None if call.reply is NOTHING else result)  # type: ignore[union-attr]
            # (_nursery is set while the session serves)
            self.channel.send_nowait(self.conn.send(reply), (), self._nursery)  # type: ignore[arg-type]

    def _dispatch(self, call: Call, args: dict[str, Any], fds: tuple[int, ...]) -> Any:
        """Check a call's arguments against its row and run its handler: ``on_<name>`` here, else the context
        method of its name (what `_call` does, inlined: every call comes this way)."""
        ctx = self.context
        if not call.sticky_ok:
            if ctx is None:
                ctx = self._ctx  # raises
            if ctx.sticky is not None:
                raise ctx.sticky  # check_usable's rule
        values = call.check(args, fds)
        if ctx is not None and ctx.capturing and call.capture is not None:
            ctx.capture_rule(call, values, args)  # what a capture under way makes of the call (mpsd.runtime.capture)
        handler, on_session = HANDLERS[call.name]
        target = self if on_session else ctx if ctx is not None else self._ctx  # (the last raises)
        try:
            return handler(target, *values, *((fds,) if call.fds else ()))
        except CudaError:
            raise
        except Exception as exc:
            raise _unexpected(exc)  # which sets the cause as _call does

    def _finish(self, request_id: int, deferred: Deferred, timing: Timing | None, began: float) -> None:
        if self.sync_latency is not None:  # from its handler's return to the device's completion
            self.sync_latency.observe(time.perf_counter() - began)
        self._deferred -= 1
        if not self._deferred:
            self._answered.set()
            self._answered = trio.Event()
        self._returned(timing, waited=True)
        self._complete(request_id, deferred)

    def _complete(self, request_id: int, deferred: Deferred) -> None:
        try:
            self._ctx.check_usable()
            if self._ctx.last_error is not None:
                # Errors of earlier fire-and-forget calls surface at the next synchronising call.
                error, self._ctx.last_error = self._ctx.last_error, None
                raise error
            result = deferred.then()
        except CudaError as exc:
            self._reply(request_id, exc)
        else:
            self._reply(request_id, None, result)

    # -- the virtual clock ------------------------------------------------------------------------------
    @property
    def _virtual(self) -> VirtualEngine:
        assert self._engine is not None
        return self._engine

    @property
    def _host(self) -> Host:
        assert self.host is not None
        return self.host

    def _receive(self, message: Request | Notification) -> None:
        """A call arrived. Under the virtual clock it is stamped with when it starts and when it reaches the
        device on the client's clock, and applied then, in stamp order with every other client's; under the
        wall clock it is served now. A launch call that finds the client's queue full waits (held) until
        work of that client has ended, as a real host's call blocks."""
        op = message.op
        call = CALLS.get(op)
        # Whether it takes a place in the launch queue, and the bytes it holds there: worked out once.
        counted = op in LAUNCH_CALLS and self.context is not None
        staged = _staged_bytes(message) if op == _STAGING else 0
        if self.host is None:
            charged = 0.0
            if not counted:  # _serve's share for it, inlined
                if isinstance(message, Notification):
                    self._notification(message, call)
                else:
                    self._request(message, call)
                return
            if not self._full(staged):  # under the wall clock a call with room goes straight on (_go's share)
                self._posted += 1
                self._staged += staged
                self._serve(message, call, True, staged, None)
                return
        else:
            engine, host = self._engine, self.host
            assert engine is not None  # (set together with host, by _attach)
            charged = self._charged(message.args)
            engine.heard(host)
            if call is not None and call.cost[0] == CLOCK and isinstance(message, Request):
                engine.clock.start(host, charged)  # answered at once: it touches the client's clock alone
                self._request(message, call)
                return
            if not counted or not self._full(staged):
                self._go(message, call, counted, staged, charged)
                return
        if self.host is not None:  # it waits in the driver: it holds no one's clock meanwhile
            self._virtual.clock.start(self._host, charged)
            self._virtual.clock.wait(self._host)
        self._held = message
        queued = self._queued + self._posted
        full = (f"{queued} launches queued" if queued >= LAUNCH_QUEUE
                else f"{format_size(self._staged)} of pageable copies held")
        self.daemon.log.complaint(("uid", self.uid), f"Client {self.pid}: {full}; its next call waits for its "
                                                     "work to run")
        self._watch()

    def _launch(self, note: Notification) -> None:
        """A launch notification that `_receive` would serve at once (the wall clock, room in the queue, no
        fds), where its context has no sticky error and has its plan (Context.planned): what `_receive`,
        `_serve`, `_notification`, `_dispatch` and `on_launch` do for the call, in one frame. Anything else
        goes their way, by its row."""
        ctx = self.context
        stream = note.args.get("stream")
        if (ctx is None or ctx.sticky is not None or (stream is not None and type(stream) is not int)
                or ctx.capturing or (plan := ctx.planned(note.args)) is None):  # (a bool or a float is no stream)
            self._receive(note)
            return
        self._launched(ctx, plan, stream, 1)
        if not plan.touches:  # the same bytes again will be the same launch again (`_repeat`)
            self._repeating = self.conn.remember((plan, stream)) or self._repeating

    def _repeat(self, most: int) -> int:
        """Serve the launch notifications next in line that repeat one `_launch` remembered, up to `most` of
        them, as one call of `count` launches: what `_launch` would do for each, where the context has no
        sticky error and the queue has room; how many, 0 for none. (A plan stays true while its context lives:
        only one that touches no memory is remembered, and its stream is looked up again.)"""
        ctx = self.context
        assert ctx is not None  # (only a launch served by a context is remembered)
        room = LAUNCH_QUEUE - self._queued - self._posted
        if (ctx.sticky is not None or room <= 0 or ctx.capturing  # (a capture's rules are the row's way)
                or (taken := self.conn.repeats(min(most, room))) is None):
            return 0
        token, count = taken
        plan, stream = cast("tuple[Plan, int | None]", token)  # the tokens this session remembers (_launch)
        self._launched(ctx, plan, stream, count)
        return count

    def _launched(self, ctx: Context, plan: Plan, stream: int | None, count: int) -> None:
        """`count` launches of `plan`, served at once: their work takes the places of their calls in the
        queue, or a failure is the context's last error, as for each of them."""
        try:
            work = ctx.launch(plan, stream, count)
        except Exception as exc:
            _failed(ctx, exc)
            return
        if not work.done:  # (what _serve does)
            self._queue(work, 0, count)

    def _queue(self, work: Work, staged: int, calls: int) -> None:
        """`work`, holding `staged` bytes, takes the places of `calls` launch calls in the client's queue."""
        queue = self._queues.get(work.stream)
        if queue is None:
            queue = self._queues[work.stream] = deque()
        queue.append((work, staged, calls))
        self._queued += calls

    def _arrival(self) -> None:
        """Under the wall clock: the calls served from here on arrived at the last read. Said after every wait,
        since other sessions may have served calls of their own meanwhile."""
        if self._received is not None:
            self._received(self._read_at)

    def _full(self, staged: int) -> bool:
        """Whether a launch call (holding `staged` bytes) must wait for room in its client's queue. The counts
        are exact once pruned, and pruning is cheap: work on a stream ends in the order it was queued, so the
        ended entries of each stream's queue are at its head. Below the limits, not even that is needed."""
        if self._queued + self._posted < LAUNCH_QUEUE and not (staged and self._staged >= MAX_STAGED_BYTES):
            return False
        for key, queue in list(self._queues.items()):
            while queue and queue[0][0].done:
                _, staged_there, calls = queue.popleft()
                self._queued -= calls
                self._staged -= staged_there
            if not queue:
                del self._queues[key]
        return self._queued + self._posted >= LAUNCH_QUEUE or bool(staged and self._staged >= MAX_STAGED_BYTES)

    def _go(self, message: Request | Notification, call: Call | None, counted: bool, staged: int,
            charged: float) -> None:
        """A call goes on: served now under the wall clock, stamped and posted under the virtual one (a counted
        launch call, holding `staged` bytes, is among those taken but not served yet until it is served)."""
        if counted:
            self._posted += 1
            self._staged += staged
        if self.host is None:
            self._serve(message, call, counted, staged, None)
            return
        engine, host = self._engine, self.host
        assert engine is not None  # (set together with host, by _attach)
        timing = engine.clock.call(host, call.cost if call is not None else (CALL, None), charged)
        engine.clock.post(host, timing.at,
                          functools.partial(self._apply, message, call, counted, staged, timing))

    def _serve(self, message: Request | Notification, call: Call | None, counted: bool, staged: int,
               timing: Timing | None) -> None:
        """Serve a call now; a counted launch call's place in the queue is its work's from here."""
        if not counted:
            if isinstance(message, Notification):
                self._notification(message, call)
            else:
                self._request(message, call, timing)
            return
        ctx = self.context
        before = ctx.last_op if ctx is not None else None
        if isinstance(message, Notification):
            self._notification(message, call)
        else:
            self._request(message, call, timing)
        self._posted -= 1
        queued = ctx.last_op if ctx is not None else None
        if queued is not before and queued is not None and not queued.done:
            self._queue(queued, staged, 1)
        else:
            self._staged -= staged
        if self._held is not None:
            self._recheck()

    def _watch(self) -> None:
        """Judge the held call again once the oldest work of any stream's queue has ended (or, if the queues
        are empty, once the next call taken is served: the queue is full of calls not yet served)."""
        backend = self.daemon.device_of(self._ctx).backend
        for queue in self._queues.values():
            head = queue[0][0]
            if head not in self._watched:
                self._watched.add(head)
                backend.when_done([head], functools.partial(self._head_ended, head))

    def _head_ended(self, head: Work) -> None:
        self._watched.discard(head)
        self._recheck()

    def _recheck(self) -> None:
        """The queue may have room: a held call goes on, if it may now."""
        message = self._held
        if message is None:
            return
        if self.channel.closed:  # nobody to answer: the reader goes on, to find the connection ended
            self._held = None
            close_fds(message.fds)
        elif self._full(staged := _staged_bytes(message)):
            self._watch()
            return
        else:
            self._held = None
            self._arrival()
            self._go(message, CALLS.get(message.op), True, staged, 0.0)
            if self.host is not None:
                self._virtual.heard(self._host)
        self._room.set()
        self._room = trio.Event()

    def _charged(self, args: Any) -> float:
        """Simulated seconds of the client's own code since its last call: what it measured (its thread's
        CPU time) times the daemon's factor, if the daemon charges it at all."""
        factor = self.daemon.config.host_time
        if factor is None or not isinstance(args, dict):
            return 0.0
        measured = args.get("host_time")
        if isinstance(measured, bool) or not isinstance(measured, (int, float)) or not 0 <= measured <= MAX_HOST_TIME:
            return 0.0
        return float(measured) * factor

    def _apply(self, message: Request | Notification, call: Call | None, counted: bool, staged: int,
               timing: Timing) -> None:
        """The device has reached the call's stamp: serve it (unless the client has gone meanwhile)."""
        if self.channel.closed or self.context is None or self.context.closed:
            close_fds(message.fds)
            return
        self._serve(message, call, counted, staged, timing)

    def _returned(self, timing: Timing | None, waited: bool) -> None:
        """The call stamped `timing` returns now (after waiting for the device, if `waited`): the client's
        clock moves to when a real host's call would return, and it holds the clock from there."""
        if timing is not None:
            engine, host = self._engine, self.host
            assert engine is not None and host is not None  # (a call is stamped only under the virtual clock)
            engine.clock.returned(host, timing, waited)
            engine.heard(host)

    def _notification(self, note: Notification, call: Call | None) -> None:
        if note.fds:
            close_fds(note.fds)
        if self.context is None:
            return
        try:
            if call is None:
                raise InvalidValueError(f"unknown notification {brief(note.op, 60)}")
            # Only calls that merely queue work may come as notifications; the rest need their reply, as does
            # a copy that turns out to be synchronous (its work is queued all the same).
            if not call.notify or isinstance(self._dispatch(call, note.args, ()), Deferred):
                raise InvalidValueError(f"{note.op} needs a request, not a notification")
        except CudaError as exc:
            if self._ctx.sticky is None:
                self._ctx.last_error = exc

    def _hello(self, request: Request) -> None:
        close_fds(request.fds)
        if self.context is not None or self._admitting:
            self._reply(request.id, InvalidValueError("hello was already said"))
            self._closing = True
            return
        self._admitting = True
        if self.daemon.admission.admits(self.uid):
            self._attach(request)
        else:  # a client of another user than the current server's waits, as MPS keeps it pending
            assert self._nursery is not None
            self._nursery.start_soon(self._admit, request)

    async def _admit(self, request: Request) -> None:
        await self.daemon.control.wait_turn(self.pid, self.uid)
        self._attach(request)
        if self._closing:
            self.reader_scope.cancel()

    def _attach(self, request: Request) -> None:
        try:
            args = request.args
            if args.get("version") != PROTOCOL_VERSION:
                raise MpsConnectionError(f"protocol version {brief(args.get('version'), 20)} is not supported "
                                         f"(the daemon speaks {PROTOCOL_VERSION})")
            # Any malformed hello becomes the CUDA error a bad argument gets, never a failed session.
            self.context = _call(self.daemon.clients.attach, self, self._quotas_args(args), args)
        except CudaError as exc:
            self._reply(request.id, exc)
            self._closing = True
            return
        ctx = self.context
        ctx.tell = self._tell
        backend = self.daemon.device_of(ctx).backend
        clock = backend.clock_info()
        engine = backend.virtual
        if isinstance(engine, VirtualEngine):
            self._engine = engine
            self.host = engine.clock.join(ctx.id)
            engine.heard(self.host)
            clock["host_time"] = self.daemon.config.host_time
        else:
            self._received = backend.received
        self._arrival()  # calls read with the hello (or while it waited for its server) arrived with it
        self._reply(request.id, None, {
            "version": PROTOCOL_VERSION,
            "clock": clock,
            "client_id": ctx.id,
            "device_count": ctx.visible_count,
            "server_pid": self.daemon.control.server.pid,
            "properties": self.daemon.device_of(ctx).client_properties(ctx),
            "kernels": signatures(),
            "quotas": {"active_thread_percentage": ctx.quotas.active_thread_percentage,
                       "sm_cap": ctx.quotas.sm_cap, "pinned_mem_limit": ctx.quotas.pinned_mem_limit,
                       "priority": ctx.quotas.priority, "weight": ctx.quotas.weight},
        })

    def _quotas_args(self, args: dict[str, Any]) -> dict[str, Any]:
        limits = args.get("limits") or {}
        if not isinstance(limits, dict):
            raise InvalidValueError("hello limits must be a map")
        return limits

    # -- the calls that need more than their context method (mpsd_protocol's CALLS) ----------------------
    def on_device_properties(self) -> dict[str, Any]:
        return self.daemon.device_of(self._ctx).client_properties(self._ctx)

    def on_statistics(self) -> dict[str, Any]:
        return self.daemon.clients.client_statistics(self._ctx)

    def on_launch(self, name: str, grid: object, block: object, args: object, shared_mem: int,
                  stream: int | None) -> Work:
        """A launch by its row (one `_launch` did not serve: the virtual clock's, a request, one not planned yet,
        a bad one): its plan (made, or found), launched."""
        ctx = self._ctx
        return ctx.launch(ctx.plan(name, grid, block, args, shared_mem), stream)

    def on_free(self, ptr: int) -> Deferred:
        self._ctx.check_free(ptr)
        # cudaFree synchronises: it waits for the context's work before the memory goes.
        return Deferred(self._ctx.tails(), lambda: self._ctx.free(ptr))

    def on_host_register(self, nbytes: int, fds: tuple[int, ...]) -> int:
        return self._ctx.host_register(fds[0], nbytes)

    def on_memcpy_htod(self, dst: int, host: int, offset: int, nbytes: int, stream: int | None,
                       staged: bool) -> Deferred | None:
        if stream is None and not staged:
            self._room_to_wait()
        op = self._ctx.memcpy_htod(dst, host, offset, nbytes, stream, staged)
        # A pageable source has been read already; a pinned one is read when the copy runs, so a
        # synchronous copy from pinned memory returns only once it has.
        return Deferred([op]) if stream is None and not staged else None

    def on_memcpy_dtoh(self, host: int, offset: int, src: int, nbytes: int, stream: int | None,
                       staged: bool) -> Deferred | None:
        if stream is None or staged:
            self._room_to_wait()
        op = self._ctx.memcpy_dtoh(host, offset, src, nbytes, stream)
        # Device-to-pageable copies are synchronous even on a stream (the bytes land in staging).
        return Deferred([op]) if stream is None or staged else None

    def _room_to_wait(self) -> None:
        """Raise if this client has as many calls waiting for the device as it may: a copy that will wait is
        refused before it is queued, not queued and then left to run unwaited for."""
        if self._deferred >= self._max_deferred:
            raise refused("waits", self._max_deferred)

    def on_synchronize(self) -> Deferred:
        return Deferred(self._ctx.tails())

    def on_stream_synchronize(self, stream: int | None) -> Deferred:
        return Deferred([self._ctx.stream_tail(stream)])

    def on_event_synchronize(self, event: int) -> Deferred:
        return Deferred([self._ctx.event_record_op(event)])

    def on_get_last_error(self, clear: bool) -> dict[str, Any] | None:
        error = self._ctx.take_last_error(clear=clear)
        return error.to_wire() if error else None

    def on_mem_fd(self, ptr: int) -> tuple[dict[str, Any], tuple[int, ...]]:
        """The memfd behind a device pointer, so the client can map the same bytes (host_view): the
        allocation's are `size` bytes from `offset` in it (a small one's memfd is its chunk's)."""
        alloc = self._ctx.segment_of(ptr)
        return {"base": alloc.addr, "size": alloc.size, "offset": alloc.segment.offset}, (os.dup(alloc.segment.fd),)

    def on_memcpy_peer(self, dst: int, src_client: int, src: int, nbytes: int, stream: int | None) -> Work:
        """A peer copy from another of this process's contexts (its client id; SO_PEERCRED says whose process
        a context is), over NVLink where the devices are peers, staged through the host where not."""
        ctx = self._ctx
        source = next((c for device in self.daemon.devices for c in device.contexts.values() if c.id == src_client),
                      None)
        if source is None or (source.pid, source.uid) != (ctx.pid, ctx.uid) or source.sticky is not None:
            raise InvalidDeviceError(f"client {brief(src_client, 20)} is no usable context of this process")
        devices = (source.device, ctx.device)
        if source.device is not ctx.device and not all(HOST_VIEW in d.backend.capabilities for d in devices):
            raise NotSupportedError("copies between real GPUs are not built yet")
        peer = self.daemon.peers(source.device.index, ctx.device.index)
        return ctx.memcpy_peer(dst, source, src, nbytes, stream, peer)

    def on_ipc_get_mem_handle(self, ptr: int) -> bytes:
        return self.daemon.ipc.export_memory(self._ctx, ptr)

    def on_ipc_open_mem_handle(self, handle: bytes, flags: int) -> tuple[dict[str, Any], tuple[int, ...]]:
        if flags != IPC_LAZY_ENABLE_PEER_ACCESS:
            raise InvalidValueError("ipc_open_mem_handle takes flags=1 (cudaIpcMemLazyEnablePeerAccess) only")
        mapping = self.daemon.ipc.open_memory(self._ctx, handle)
        return ({"ptr": mapping.addr, "size": mapping.size, "offset": mapping.segment.offset,
                 "mappable": HOST_VIEW in self._ctx.backend.capabilities}, (os.dup(mapping.segment.fd),))

    def on_ipc_close_mem_handle(self, ptr: int) -> None:
        ctx = self._ctx
        segment = self.daemon.ipc.close_memory(ctx, ptr)
        if segment is not None:
            # The pointer is gone from the context now, so a later call with it fails, as after
            # cudaIpcCloseMemHandle; the bytes stay mapped until the work queued before it has run.
            ctx.backend.when_done(ctx.tails(), segment.release)

    # `clock`, `sleep` and `idle` act on the client's clock alone, under the virtual clock: answered at once,
    # never stamped. Under the wall clock the client keeps time itself and asks only for the device's now.
    def on_clock(self) -> dict[str, float]:
        if self.host is None:
            return {"now": self.daemon.device_of(self._ctx).backend.now()}
        return {"now": self.host.clock}

    def on_sleep(self, seconds: float) -> dict[str, float]:
        self._host_clock("sleep").clock += float(seconds)  # the thread makes no call meanwhile: it cools as it would
        return {"now": self._host.clock}

    def on_idle(self) -> dict[str, float]:
        host = self._host_clock("idle")
        self._virtual.clock.idle(host)
        return {"now": host.clock}

    def _host_clock(self, what: str) -> Host:
        if self.host is None:
            raise NotSupportedError(f"{what} acts on the daemon's virtual clock; this daemon's follows the wall clock")
        return self.host


# Each call's handler: ``Session.on_<name>``, else the context method of its name (given the context). A row
# that has neither fails here, when the daemon is imported.
HANDLERS: dict[str, tuple[Callable[..., Any], bool]] = {
    call.name: (getattr(Session, "on_" + call.name), True) if hasattr(Session, "on_" + call.name)
    else (getattr(Context, _CONTEXT_METHODS.get(call.name, call.name)), False) for call in CALLS.values()}


# Launch calls: each queues work on the device and returns (mpsd.clock), and takes a place in the queue.
LAUNCH_CALLS = frozenset(call.name for call in CALLS.values() if call.cost[0] == LAUNCH)
# The ops the read loop looks at before their row: the launch it may serve the short way, the copy that may
# hold staged bytes.
_LAUNCH, _STAGING = Calls.launch.name, Calls.memcpy_htod.name


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer has closed its end, seen without reading what it sent before (POLLRDHUP)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP)
    return any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


def _staged_bytes(message: Request | Notification) -> int:
    """The bytes a call makes the daemon hold until it runs: those of a staged (pageable) host-to-device copy."""
    args = message.args
    if message.op != _STAGING or not isinstance(args, dict) or not args.get("staged"):
        return 0
    nbytes = args.get("nbytes")
    return nbytes if type(nbytes) is int and nbytes > 0 else 0


def _call(handler: Callable[..., Any], *args: Any) -> Any:
    """Run a handler, turning what malformed arguments cause into the error CUDA would give."""
    try:
        return handler(*args)
    except CudaError:
        raise
    except Exception as exc:
        raise _unexpected(exc)  # which sets the cause


def _failed(ctx: Context, exc: Exception) -> None:
    """A fire-and-forget launch failed (called while handling `exc`): what _dispatch and _notification make of
    it, the context's last error, unless a sticky one stands."""
    error = exc if isinstance(exc, CudaError) else _unexpected(exc)
    if ctx.sticky is None:
        ctx.last_error = error


def _unexpected(exc: Exception) -> CudaError:
    """The CUDA error for what a handler raised that is no CUDA error (called while handling `exc`): what
    malformed arguments cause is an invalid value; anything else is a bug of ours, logged, and unknown."""
    error: CudaError
    if isinstance(exc, (KeyError, TypeError, ValueError, OverflowError)):
        error = InvalidValueError(f"malformed arguments: {type(exc).__name__}: {exc}"[:200])
        error.__cause__, error.__suppress_context__ = None, True  # as `raise ... from None`
        return error
    log.exception("handler failed")
    error = make_error(999, f"internal error: {type(exc).__name__}")
    error.__cause__ = exc  # as `raise ... from exc`
    return error
