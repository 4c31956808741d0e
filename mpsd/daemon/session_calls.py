# The calls a session serves itself, where a call needs more than its context's method (a reply that waits for
# the device, the daemon's other contexts, its IPC registry, fds to pass, the client's virtual clock): each is
# ``on_<name>``, which the session's table of handlers (mpsd.daemon.session.HANDLERS) finds before the context's
# method of the call's name. And what every handler's failure becomes: the CUDA error a real runtime gives, or,
# for a bug of ours, cudaErrorUnknown and a log line.
"""A session's own handlers of calls, and the errors handlers end in."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from mpsd.backends.base import HOST_VIEW
from mpsd.backends.ops import Work
from mpsd.clock import Host
from mpsd.runtime.limits import refused
from mpsd_protocol import CudaError, InvalidDeviceError, InvalidValueError, NotSupportedError, brief, make_error

if TYPE_CHECKING:
    from mpsd.backends.engine import VirtualEngine
    from mpsd.daemon.server import Daemon
    from mpsd.runtime.context import Context

__all__ = ["Deferred", "SessionCalls", "call_guarded", "launch_failed", "unexpected_error"]

log = logging.getLogger("mpsd.daemon.session")

IPC_LAZY_ENABLE_PEER_ACCESS = 0x1  # the one flag cudaIpcOpenMemHandle accepts


@dataclass(frozen=True, slots=True)
class Deferred:
    """A reply that must wait: for `ops` to complete, then `then()` gives the result."""

    ops: Sequence[Work | None]
    then: Callable[[], Any] = lambda: None

    def ready(self) -> bool:
        return all(op is None or op.done for op in self.ops)


def call_guarded(handler: Callable[..., Any], *args: Any) -> Any:
    """Run a handler, turning what malformed arguments cause into the error CUDA would give."""
    try:
        return handler(*args)
    except CudaError:
        raise
    except Exception as exc:
        raise unexpected_error(exc)  # which sets the cause


def launch_failed(ctx: Context, exc: Exception) -> None:
    """A fire-and-forget launch failed (called while handling `exc`): what _dispatch and _notification make of
    it, the context's last error, unless a sticky one stands."""
    error = exc if isinstance(exc, CudaError) else unexpected_error(exc)
    if ctx.sticky is None:
        ctx.last_error = error


def unexpected_error(exc: Exception) -> CudaError:
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


class SessionCalls:
    """The calls a session serves itself (mixed into mpsd.daemon.session.Session)."""

    if TYPE_CHECKING:  # what the Session they are mixed into has, for the type checker (the real ones are there)
        daemon: Daemon
        host: Host | None
        _deferred: int
        _max_deferred: int

        @property
        def _ctx(self) -> Context: ...
        @property
        def _virtual(self) -> VirtualEngine: ...
        @property
        def _host(self) -> Host: ...

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
