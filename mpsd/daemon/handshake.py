# A session's handshake: the hello that opens every connection. Its protocol version is checked; the control
# plane admits the client (one user's server at a time: a client of another user waits its turn, as MPS keeps it
# pending); the daemon makes its context under the quotas it asks to tighten; and the reply says what the client
# needs from then on (its clock, its device's properties, the kernels' signatures, its quotas). A second hello,
# or a refused one, ends the connection.
"""A session's handshake: the hello, the client's admission and its context."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import trio

from mpsd.backends.engine import VirtualEngine
from mpsd.clock import Host
from mpsd.daemon.session_calls import call_guarded
from mpsd.runtime.kernels import signatures
from mpsd_protocol import PROTOCOL_VERSION, CudaError, InvalidValueError, MpsConnectionError, Request, brief, close_fds

if TYPE_CHECKING:
    from mpsd.daemon.server import Daemon
    from mpsd.runtime.context import Context

__all__ = ["Handshake"]


class Handshake:
    """A session's hello (mixed into mpsd.daemon.session.Session)."""

    if TYPE_CHECKING:  # what the Session they are mixed into has, for the type checker (the real ones are there)
        daemon: Daemon
        context: Context | None
        pid: int
        uid: int
        host: Host | None
        reader_scope: trio.CancelScope
        _nursery: trio.Nursery | None
        _closing: bool
        _admitting: bool
        _engine: VirtualEngine | None
        _received: Callable[[float], None] | None

        def _reply(self, request_id: int, error: CudaError | None, result: Any = None,
                   fds: tuple[int, ...] = ()) -> None: ...
        def _tell(self, op: str, args: dict[str, Any]) -> None: ...
        def _arrival(self) -> None: ...

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
            self.context = call_guarded(self.daemon.clients.attach, self, self._quotas_args(args), args)
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
