# A session's launch queue: a launch call that finds LAUNCH_QUEUE launches of its client unfinished (or
# MAX_STAGED_BYTES of its pageable copies held) waits until one ends, and the session reads nothing more from that
# client meanwhile, so that a flood of work blocks its sender, not the daemon. The counts are kept per stream
# without a callback per launch: work on a stream ends in order, so the ended entries are at each queue's head,
# pruned only when a limit is reached. And the short way of a launch under the wall clock (a plan the context has
# kept, room in the queue), with the repeats of one served as one call of many launches.
"""A session's launch queue and a launch's short way."""

from __future__ import annotations

import functools
from collections import deque
from typing import TYPE_CHECKING, Any, cast

import trio

from mpsd.backends.ops import Plan, Work
from mpsd.daemon.session_calls import launch_failed
from mpsd_protocol import CALLS, Calls, Connection, Notification, Request, close_fds

if TYPE_CHECKING:
    from mpsd.backends.engine import VirtualEngine
    from mpsd.clock import Host
    from mpsd.daemon.channel import Channel
    from mpsd.daemon.server import Daemon
    from mpsd.runtime.context import Context
    from mpsd_protocol import Call

__all__ = ["LAUNCH_QUEUE", "LaunchQueue", "MAX_STAGED_BYTES", "STAGING", "staged_bytes"]

# Work a client may have queued before its next launch call blocks: a real H200's host call blocked once
# about 1,000 to 1,023 launches were queued (h200-runtime-measurements.md); and the bytes of pageable copies
# the daemon may hold for one client until they run (each staged piece is at most 8 MiB).
LAUNCH_QUEUE = 1024
MAX_STAGED_BYTES = 256 << 20
STAGING = Calls.memcpy_htod.name  # the copy that may hold staged bytes


def staged_bytes(message: Request | Notification) -> int:
    """The bytes a call makes the daemon hold until it runs: those of a staged (pageable) host-to-device copy."""
    args = message.args
    if message.op != STAGING or not isinstance(args, dict) or not args.get("staged"):
        return 0
    nbytes = args.get("nbytes")
    return nbytes if type(nbytes) is int and nbytes > 0 else 0


class LaunchQueue:
    """A session's launch queue (mixed into mpsd.daemon.session.Session)."""

    _queues: dict[Any, deque[tuple[Work, int, int]]]  # stream key -> (work, staged bytes, launch calls)
    _queued: int  # launch calls whose work is queued and may not have ended
    _posted: int  # launch calls taken, not yet served
    _staged: int  # bytes of pageable copies held
    _held: Request | Notification | None  # the call waiting for room
    _watched: set[Work]
    _room: trio.Event
    _repeating: bool

    if TYPE_CHECKING:  # what the Session they are mixed into has, for the type checker (the real ones are there)
        daemon: Daemon
        context: Context | None
        conn: Connection
        channel: Channel
        host: Host | None

        @property
        def _ctx(self) -> Context: ...
        @property
        def _virtual(self) -> VirtualEngine: ...
        @property
        def _host(self) -> Host: ...
        def _receive(self, message: Request | Notification) -> None: ...
        def _arrival(self) -> None: ...
        def _go(self, message: Request | Notification, call: Call | None, counted: bool, staged: int,
                charged: float) -> None: ...

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
            launch_failed(ctx, exc)
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
        elif self._full(staged := staged_bytes(message)):
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
