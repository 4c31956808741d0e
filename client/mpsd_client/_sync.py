# The blocking shell: one Unix socket, one lock, and a loop that drives the core's generators. For ordinary
# worker processes (and threads: calls are serialised by the lock).
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any, Iterator

from mpsd_protocol import (
    CLOSED,
    NEED_DATA,
    Connection,
    CudaError,
    MpsConnectionError,
    Notification,
    ProtocolError,
    Reply,
    Request,
    Role,
    pipe_directory,
    brief,
    check_server,
    close_fds,
    pack_fds,
    unpack_fds,
)

from ._api import ContextBase
from ._core import CURRENT, TAKE_NOTICES, Core
from ._env import check_ordinal, requested_limits, visible_devices
from ._wait import DEVICE_SCHEDULE_MASK, ReplyWait


class Context(ContextBase):
    """A connection to the daemon from a blocking worker process. Use `connect()` to make one."""

    def __init__(self, sock: socket.socket, core: Core) -> None:
        self._sock = sock
        self._core = core
        self._conn = Connection(Role.CLIENT)
        self._wait = ReplyWait(sock)
        self._lock = threading.Lock()  # calls never nest: one at a time per context
        self.closed = False

    def _drive(self, op: Any) -> Any:
        with self._lock:
            try:
                item = next(op)
                while True:
                    if item is TAKE_NOTICES:
                        self._take(None)
                        item = op.send(None)
                        continue
                    self._send(item)
                    item = op.send(self._take(item.id) if isinstance(item, Request) else None)
            except StopIteration as stop:
                return stop.value
            except CudaError as exc:
                self._core.last_error = exc
                raise
            finally:
                op.close()

    def _post(self, note: Notification) -> None:
        with self._lock:
            try:
                self._send(note)
            except CudaError as exc:
                self._core.last_error = exc
                raise

    def malloc_async(self, nbytes: int, stream: Any = None) -> Any:
        """``cudaMallocAsync`` (see `ContextBase.malloc_async`): where the pool has room it is the core's alone,
        without the generator a message needs (the figure bench/alloc_rate.py measures)."""
        ptr = self._malloc_now(nbytes, stream, CURRENT)
        return ptr if ptr is not None else super().malloc_async(nbytes, stream)

    def malloc_from_pool_async(self, nbytes: int, pool: Any, stream: Any = None) -> Any:
        """``cudaMallocFromPoolAsync`` (see `ContextBase.malloc_from_pool_async`), as fast as `malloc_async`."""
        ptr = self._malloc_now(nbytes, stream, pool)
        return ptr if ptr is not None else super().malloc_from_pool_async(nbytes, pool, stream)

    def _malloc_now(self, nbytes: int, stream: Any, pool: Any) -> Any:
        with self._lock:
            try:
                return self._core.malloc_async_now(self, nbytes, stream, pool)
            except CudaError as exc:
                self._core.last_error = exc
                raise

    def free_async(self, ptr: Any, stream: Any = None) -> None:
        """``cudaFreeAsync`` (see `ContextBase.free_async`), under the lock other threads' calls take."""
        with self._lock:
            super().free_async(ptr, stream)

    def _send(self, message: Request | Notification) -> None:
        if self.closed:
            raise self._core.connection_lost("the context is closed")
        try:
            data = self._conn.send(message)
            notes = self._core.take_notes()  # stream-ordered allocations made since the last message go first
            if notes:
                ahead = b"".join([self._conn.send(note) for note in notes])
                if message.fds:  # the fds go with the message's own first byte
                    self._sock.sendall(ahead)
                else:
                    data = ahead + data
            if message.fds:
                sent = self._sock.sendmsg([data], pack_fds(message.fds))
                data = data[sent:]
            if data:
                self._sock.sendall(data)
        except OSError as exc:
            raise self._core.connection_lost(f"lost the daemon: {exc.strerror or exc}") from None

    def _take(self, request_id: int | None) -> Reply | None:
        """Take in what the daemon sends up to the reply to `request_id`, and that reply; with None, only what
        has come already (the notices an op waits for, TAKE_NOTICES)."""
        try:
            while True:
                event = self._conn.next_event()
                if event is NEED_DATA:
                    if request_id is not None:
                        data, ancdata, flags, _ = self._wait.read(self._core.device_flags & DEVICE_SCHEDULE_MASK)
                    else:
                        try:
                            data, ancdata, flags, _ = self._wait.now()
                        except BlockingIOError:
                            return None
                    self._conn.receive_data(data, unpack_fds(ancdata, flags))
                elif event is CLOSED:
                    raise self._core.connection_lost("the daemon closed the connection")
                elif isinstance(event, Notification):
                    close_fds(event.fds)
                    self._core.notification_received(event)
                elif isinstance(event, Reply) and event.id == request_id:
                    return event
                else:
                    close_fds(event.fds)
                    raise self._core.connection_lost(f"unexpected message from the daemon: {brief(event, 80)}")
        except ProtocolError as exc:
            raise self._core.connection_lost(f"protocol error: {exc}") from None
        except OSError as exc:
            raise self._core.connection_lost(f"lost the daemon: {exc.strerror or exc}") from None

    def _sleep(self, op: Any) -> None:
        wall = self._drive(op)
        if wall:
            time.sleep(wall)

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """Declare, under the virtual clock, that this client waits on something outside mpsd (a pipe, a
        barrier) until its next call, so the others go on at once instead of after the idle grace."""
        self._drive(self._core.idle())
        yield

    def close(self) -> None:
        """Disconnect; the daemon frees everything this context held."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._sock.close()
                self._conn.close_fds()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self._sock.close()


def connect(pipe_dir: str | os.PathLike[str] | None = None, device: int = 0, timeout: float = 10.0) -> Context:
    """Connect to the mpsd daemon and create this process's context on `device`.

    Args:
        pipe_dir: the daemon's pipe directory (default $CUDA_MPS_PIPE_DIRECTORY, or its alias
            $MPSD_PIPE_DIRECTORY, then /tmp/nvidia-mps, as MPS).
        device: this process's device ordinal (CUDA_VISIBLE_DEVICES applies).
        timeout: seconds to wait for the daemon to accept and answer the handshake.

    Raises:
        MpsConnectionError: no daemon is listening, it runs as a user other than root or ours, or it refused
            the handshake.
        NoDeviceError, InvalidDeviceError: the device is hidden or does not exist.
        InvalidValueError: a CUDA_MPS_* variable is malformed.
    """
    return open_connection(pipe_dir, device, timeout)[0]


def open_connection(pipe_dir: str | os.PathLike[str] | None, device: int,
                    timeout: float) -> tuple[Context, dict[str, Any]]:
    """`connect`, and the daemon's answer to the handshake (the driver flavour reads its device count)."""
    core = Core(check_ordinal(device), visible_devices(), requested_limits(device))
    path = pipe_directory(pipe_dir) / "mpsd.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise MpsConnectionError(f"no mpsd daemon at {path}: {exc.strerror or exc}") from None
    try:
        check_server(sock, path)  # before the first byte: the hello names us, later calls carry our data
    except MpsConnectionError:
        sock.close()
        raise
    ctx = Context(sock, core)
    try:
        hello = ctx._drive(core.hello())
    except CudaError as exc:
        ctx.close()
        if isinstance(exc, (TimeoutError,)) or exc.code == 806:
            raise MpsConnectionError(f"the daemon at {path} did not complete the handshake: {exc.detail}") from None
        raise
    sock.settimeout(None)  # from here a call waits as long as the GPU work it waits for
    return ctx, hello
