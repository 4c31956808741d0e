# The trio shell: a reader task routes replies to the tasks waiting for them, so several tasks can have calls
# in flight on one context (a task synchronising one stream does not hold up another launching on the next).
#
# The socket is driven as the daemon's channel drives its own: a send or a read that the socket can take now is
# made at once, and only one that it cannot waits (trio's socket methods yield to the scheduler on every call,
# which cost an in-process stress run about a fifth of its time); one task in a long run of such calls lets the
# others in every FAIR_CALLS of them, as a checkpoint would.
from __future__ import annotations

import os
import socket
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Mapping

import trio

from mpsd_protocol import (
    ANCILLARY_SIZE,
    CLOSED,
    NEED_DATA,
    RECV_FLAGS,
    Connection,
    CudaError,
    MpsConnectionError,
    Message,
    Notification,
    ProtocolError,
    Reply,
    Request,
    Role,
    pipe_directory,
    check_server,
    close_fds,
    pack_fds,
    unpack_fds,
)

from ._api import ContextBase
from ._core import TAKE_NOTICES, Core
from ._env import check_ordinal, requested_limits, visible_devices

READ_SIZE = 1 << 16
FAIR_CALLS = 16  # sends or reads made at once before the task lets the others run
_TIMER_STEP = 1e-3  # what a trio timer may oversleep by, under epoll


class _Answer:
    """Where the reader leaves a request's reply (or the error that ended the connection) for its caller."""

    __slots__ = ("arrived", "value")

    def __init__(self) -> None:
        self.arrived = trio.Event()
        self.value: Reply | CudaError | None = None

    def give(self, value: Reply | CudaError) -> None:
        """The first answer stands: a reply that came before the connection ended is the caller's."""
        if not self.arrived.is_set():
            self.value = value
            self.arrived.set()


class AsyncContext(ContextBase):
    """A connection to the daemon for trio programs; every call is awaited. Use `open_context()`."""

    def __init__(self, sock: trio.socket.SocketType, raw: socket.socket, core: Core) -> None:
        self._sock = sock  # for what has to wait
        self._raw = raw  # the same socket, non-blocking, for what need not
        self._core = core
        self._conn = Connection(Role.CLIENT)
        self._send_lock = trio.StrictFIFOLock()  # held by a send that has to wait: later ones queue behind it
        self._waiting: dict[int, _Answer] = {}
        self._eager = 0  # sends and reads made at once since the task last let the others run

    async def _drive(self, op: Any) -> Any:
        try:
            item = next(op)
            while True:
                if item is TAKE_NOTICES:
                    self._take_now()
                    item = op.send(None)
                elif isinstance(item, Request):
                    waiter = self._waiting[item.id] = _Answer()
                    try:
                        await self._send(item)
                        await waiter.arrived.wait()
                    finally:
                        self._waiting.pop(item.id, None)
                    answer = waiter.value
                    if isinstance(answer, CudaError):
                        raise answer
                    item = op.send(answer)
                else:
                    await self._send(item)
                    item = op.send(None)
        except StopIteration as stop:
            return stop.value
        except CudaError as exc:
            self._core.last_error = exc
            raise
        finally:
            op.close()

    async def _post(self, note: Notification) -> None:
        try:
            await self._send(note)
        except CudaError as exc:
            self._core.last_error = exc
            raise

    async def _send(self, message: Request | Notification) -> None:
        data = self._conn.send(message)
        notes = self._core.take_notes()  # stream-ordered allocations made since the last message go first
        ahead = b"".join([self._conn.send(note) for note in notes]) if notes else b""
        if ahead and not message.fds:  # else the fds go with the message's own first byte, after these
            data, ahead = ahead + data, b""
        fds = message.fds
        try:
            if not self._send_lock.locked():  # nobody's bytes wait before ours: send what the socket takes now
                if ahead:
                    ahead = ahead[self._send_now(ahead, ()):]
                if not ahead:
                    sent = self._send_now(data, fds)
                    if sent == len(data):
                        await self._fairly()
                        return
                    data, fds = data[sent:], (fds if not sent else ())
            async with self._send_lock:
                while ahead:
                    ahead = ahead[await self._sock.send(ahead):]
                sent = await self._sock.sendmsg([data], pack_fds(fds)) if fds else 0
                while sent < len(data):
                    data = data[sent:]
                    sent = await self._sock.send(data)
        except OSError as exc:
            raise self._core.connection_lost(f"lost the daemon: {exc.strerror or exc}") from None

    def _send_now(self, data: bytes, fds: tuple[int, ...]) -> int:
        """The bytes of `data` (with `fds` on its first) that the socket takes without waiting."""
        try:
            return self._raw.sendmsg([data], pack_fds(fds)) if fds else self._raw.send(data)
        except BlockingIOError:
            return 0

    async def _fairly(self) -> None:
        """After a send or read made at once: every FAIR_CALLS of them, let the other tasks run."""
        self._eager += 1
        if self._eager >= FAIR_CALLS:
            self._eager = 0
            await trio.lowlevel.checkpoint()

    async def _sleep(self, op: Any) -> None:
        """Wake on time, as time.sleep does: trio's timers are whole milliseconds under epoll (Python's
        epoll.poll rounds a timeout up to one), so a Poisson tenant that slept with trio alone would start
        each request up to a millisecond late, and mpsd-stress counts that as its latency. It sleeps with
        trio to within a millisecond of the end, then lets the other tasks run until the end comes."""
        wall = await self._drive(op)
        if wall > 0:
            start = time.monotonic()
            if wall > _TIMER_STEP:
                await trio.sleep(wall - _TIMER_STEP)
            # At most one step more: under a test's mock clock the sleep above took no real time.
            end = min(start + wall, time.monotonic() + _TIMER_STEP)
            while time.monotonic() < end:
                await trio.lowlevel.checkpoint()

    @asynccontextmanager
    async def idle(self) -> AsyncIterator[None]:
        """``async with actx.idle():`` as `Context.idle`: this client waits outside mpsd until its next call."""
        await self._drive(self._core.idle())
        yield

    async def _read(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        why = "the daemon closed the connection"
        try:
            while True:
                event = self._conn.next_event()
                if event is NEED_DATA:
                    try:
                        data, ancdata, flags, _ = self._raw.recvmsg(READ_SIZE, ANCILLARY_SIZE, RECV_FLAGS)
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(self._raw)
                        continue
                    self._conn.receive_data(data, unpack_fds(ancdata, flags))
                    await self._fairly()
                elif event is CLOSED:
                    break
                elif (ended := self._route(event)) is not None:
                    why = ended or why
                    break
        except ProtocolError as exc:
            why = f"protocol error: {exc}"
        except OSError as exc:
            why = f"lost the daemon: {exc.strerror or exc}"
        error = self._core.connection_lost(why)
        for waiter in list(self._waiting.values()):
            waiter.give(error)

    def _route(self, event: Message) -> str | None:
        """Give a reply to the task that waits for it, or act on a notice; why the connection ends, if it does.
        (A request, which a daemon never sends, is read as a notice of its op.)"""
        if isinstance(event, Reply):
            waiter = self._waiting.get(event.id)
            if waiter is None:
                close_fds(event.fds)
            else:
                waiter.give(event)
            return None
        close_fds(event.fds)
        try:
            self._core.notification_received(event)
        except CudaError as exc:
            return exc.detail or ""
        return None

    def _take_now(self) -> None:
        """Take in what the daemon has sent already, without waiting (TAKE_NOTICES). The end of the connection
        and its errors stay where they are, for the reader to find."""
        try:
            while (event := self._conn.next_event()) is not CLOSED:
                if event is NEED_DATA:
                    data, ancdata, flags, _ = self._raw.recvmsg(READ_SIZE, ANCILLARY_SIZE, RECV_FLAGS)
                    self._conn.receive_data(data, unpack_fds(ancdata, flags))
                    if not data:
                        return
                elif self._route(event) is not None:
                    return
        except (ProtocolError, OSError):  # BlockingIOError: nothing more has come
            return


@asynccontextmanager
async def open_context(pipe_dir: str | os.PathLike[str] | None = None, device: int = 0, timeout: float = 10.0,
                       environ: Mapping[str, str] | None = None) -> AsyncIterator[AsyncContext]:
    """Connect to the daemon from trio: ``async with open_context() as actx: p = await actx.malloc(n)``.

    `environ` stands for the process's environment where CUDA_VISIBLE_DEVICES, the CUDA_MPS_* variables and
    CUDA_MPS_PIPE_DIRECTORY are read (default os.environ): a program that plays many clients gives each its own.

    Raises:
        MpsConnectionError: no daemon is listening, it runs as a user other than root or ours, or it refused
            the handshake.
        NoDeviceError, InvalidDeviceError, InvalidValueError: as `mpsd_client.connect`.
    """
    environ = os.environ if environ is None else environ
    core = Core(check_ordinal(device), visible_devices(environ), requested_limits(device, environ))
    path = pipe_directory(pipe_dir, environ) / "mpsd.sock"
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.setblocking(False)
    sock = trio.socket.from_stdlib_socket(raw)
    try:
        with trio.fail_after(timeout):
            await sock.connect(str(path))
    except (OSError, trio.TooSlowError) as exc:
        sock.close()
        raise MpsConnectionError(f"no mpsd daemon at {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        check_server(sock, path)  # before the first byte: the hello names us, later calls carry our data
    except MpsConnectionError:
        sock.close()
        raise
    actx = AsyncContext(sock, raw, core)
    refused: CudaError | None = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(actx._read)
            try:
                with trio.fail_after(timeout):
                    await actx._drive(core.hello())
            except trio.TooSlowError:
                refused = MpsConnectionError(f"the daemon at {path} did not answer the handshake")
            except CudaError as exc:
                refused = exc
            if refused is None:
                yield actx
            nursery.cancel_scope.cancel()
    finally:
        sock.close()
        actx._conn.close_fds()
    if refused is not None:  # raised here, outside the nursery: the caller gets the CUDA error itself
        raise refused
