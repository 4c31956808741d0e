# One client connection: a thin trio loop around the sans-IO protocol Connection, dispatching each call from
# its row in mpsd_protocol's table of calls (arguments checked there) to the context method of its name, or to
# `on_<name>` where the call needs more than one (mpsd.daemon.session_calls, mixed in, as are the hello,
# mpsd.daemon.handshake, and the launch queue, mpsd.daemon.launch_queue). Calls that must wait for the GPU
# (synchronize, blocking copies, free) run as tasks, so the session keeps reading: replies may come back out of
# order, as msgpack-rpc allows, while the order in which work is queued stays the order in which it arrived.
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
import select
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import trio

from mpsd.backends.engine import VirtualEngine
from mpsd.backends.ops import Work
from mpsd.clock import Host, Timing
from mpsd.daemon.channel import Channel
from mpsd.daemon.handshake import Handshake
from mpsd.daemon.launch_queue import LAUNCH_QUEUE, STAGING, LaunchQueue, staged_bytes
from mpsd.daemon.session_calls import Deferred, SessionCalls, unexpected_error
from mpsd.daemon.sync_latency import SyncLatency
from mpsd.runtime.context import Context
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
    Call,
    Calls,
    Connection,
    CudaError,
    InvalidValueError,
    MpsServerNotReadyError,
    Notification,
    ProtocolError,
    Reply,
    Request,
    Role,
    brief,
    close_fds,
    format_size,
    peer_credentials,
)

if TYPE_CHECKING:
    from mpsd.daemon.routes import Route
    from mpsd.daemon.server import Daemon

log = logging.getLogger("mpsd.daemon.session")
# Calls served by a context method of another name.
_CONTEXT_METHODS = {"event_record": "record_event", "event_elapsed": "elapsed_ms"}
FAIR_MESSAGES = 16  # messages of one client served before the others get a turn
HANGUP_POLL = 0.1  # wall seconds between looks at a blocked client's socket for a hang-up
MAX_HOST_TIME = 3600.0  # seconds of its own code a client may report for one gap between calls


class Session(Handshake, LaunchQueue, SessionCalls):
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
            raise unexpected_error(exc)  # which sets the cause as _call does

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
        staged = staged_bytes(message) if op == STAGING else 0
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

    def _arrival(self) -> None:
        """Under the wall clock: the calls served from here on arrived at the last read. Said after every wait,
        since other sessions may have served calls of their own meanwhile."""
        if self._received is not None:
            self._received(self._read_at)

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


# Each call's handler: ``Session.on_<name>``, else the context method of its name (given the context). A row
# that has neither fails here, when the daemon is imported.
HANDLERS: dict[str, tuple[Callable[..., Any], bool]] = {
    call.name: (getattr(Session, "on_" + call.name), True) if hasattr(Session, "on_" + call.name)
    else (getattr(Context, _CONTEXT_METHODS.get(call.name, call.name)), False) for call in CALLS.values()}


# Launch calls: each queues work on the device and returns (mpsd.clock), and takes a place in the queue.
LAUNCH_CALLS = frozenset(call.name for call in CALLS.values() if call.cost[0] == LAUNCH)
# The op the read loop looks at before its row: the launch it may serve the short way (and the copy that may
# hold staged bytes, launch_queue.STAGING).
_LAUNCH = Calls.launch.name


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer has closed its end, seen without reading what it sent before (POLLRDHUP)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP)
    return any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


