# The daemon: one trio event loop that owns the devices, listens on $MPSD_PIPE_DIRECTORY/mpsd.sock, gives each
# connection a Session and each session a sub-context with its quotas. Shutdown (SIGTERM, SIGINT, or `stop`)
# stops accepting, stops reading requests, lets replies already in flight finish for a short grace period,
# removes the socket file and returns, so the process exits 0.
from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

import trio

from mpsd.config import Config
from mpsd.context import Context, Quotas
from mpsd.device import Device
from mpsd.ipc import IpcRegistry
from mpsd.servlog import ServerLog
from mpsd.session import Session
from mpsd.sim import sm_cap
from mpsd_protocol import (  # type: ignore[attr-defined]
    InvalidDeviceError,
    InvalidValueError,
    NoDeviceError,
    OutOfMemoryError,
    format_size,
)

log = logging.getLogger("mpsd")
SHUTDOWN_GRACE = 5.0  # seconds that in-flight replies get to finish


class DaemonError(Exception):
    """The daemon cannot start; the message says why."""


class Daemon:
    """An mpsd server for one configuration."""

    def __init__(self, config: Config) -> None:
        """Set up the simulated devices and open the logs.

        Raises:
            DaemonError: the log directory cannot be written.
        """
        self.config = config
        try:
            self.log = ServerLog(config.log_dir)
        except OSError as exc:
            raise DaemonError(f"cannot write logs in {config.log_dir}: {exc.strerror}") from None
        self.devices = [
            Device(i, spec, policy=config.policy, time_scale=config.time_scale,
                   containment=config.fault_containment, log=self.log)
            for i, spec in enumerate(config.devices)
        ]
        self.ipc = IpcRegistry(config.ipc_access, self.log)
        self.sessions: set[Session] = set()
        self._next_client = 1
        self._stop = trio.Event()

    # -- clients ---------------------------------------------------------------------------------------
    def attach(self, session: Session, limits: dict[str, Any], hello: dict[str, Any]) -> Context:
        """Create the sub-context for a client that said hello; its requests can only tighten our quotas.

        Raises:
            InvalidDeviceError: no such device.
            InvalidValueError: a requested limit is malformed.
        """
        device = self.devices[self._device_index(hello.get("device", 0), hello.get("visible"))]
        index = device.index
        percentage = self.config.active_thread_percentage
        requested = limits.get("active_thread_percentage")
        if requested is not None:
            if not isinstance(requested, (int, float)) or not 0 < requested <= 100:
                raise InvalidValueError(f"active thread percentage {requested!r:.20} is outside (0, 100]")
            percentage = min(percentage, float(requested))
        memory = self.config.pinned_mem_limit(index) or device.total_memory
        requested = limits.get("pinned_mem_limit")
        if requested is not None:
            if not isinstance(requested, int) or requested < 0:
                raise InvalidValueError(f"pinned memory limit {requested!r:.20} is not a byte count")
            memory = min(memory, requested)
        priority = limits.get("priority")
        if priority is not None and priority not in (0, 1):
            raise InvalidValueError(f"client priority {priority!r:.20} must be 0 or 1")
        priority = max(self.config.client_priority, priority or 0)
        quotas = Quotas(percentage, sm_cap(device.spec, percentage), memory, priority)
        if device.total_memory - device.used < device.spec.context_memory:
            raise OutOfMemoryError(f"device {index} has no room for another context "
                                   f"({format_size(device.spec.context_memory)} each)")
        context = Context(device, self._next_client, session.pid, session.uid, session.gid, quotas, self.ipc)
        device.used += device.spec.context_memory
        self._next_client += 1
        device.contexts[context.id] = context
        claimed = hello.get("pid")
        self.log.server(f"New client {session.pid} connected (context {context.id}, uid {session.uid}, "
                        f"device {index})" + (f"; it claimed pid {claimed!r:.20}" if claimed != session.pid else ""))
        self.log.server(f"Client {session.pid}: active thread percentage {percentage:.1f} ({quotas.sm_cap} SMs), "
                        f"pinned memory limit {format_size(memory)}, priority {priority}")
        return context

    def _device_index(self, ordinal: Any, visible: Any) -> int:
        """Our index of the client's device `ordinal`, through its CUDA_VISIBLE_DEVICES list (None: unset).

        Raises:
            NoDeviceError: the list names none of our devices.
            InvalidDeviceError: the ordinal is not one of the visible devices.
        """
        count = len(self.devices)
        if visible is None:
            indices = list(range(count))
        elif isinstance(visible, list) and all(isinstance(v, int) for v in visible):
            # As in CUDA, an index that does not exist ends the list.
            indices = list(itertools.takewhile(lambda v: 0 <= v < count, visible))
            if not indices:
                raise NoDeviceError(f"CUDA_VISIBLE_DEVICES names none of the daemon's {count} device(s)")
        else:
            raise InvalidValueError("hello: visible must be a list of device indices")
        if not isinstance(ordinal, int) or not 0 <= ordinal < len(indices):
            raise InvalidDeviceError(f"device {ordinal!r:.20} does not exist ({len(indices)} visible)")
        return indices[ordinal]

    def detach(self, context: Context) -> None:
        """The client is gone (closed, exited or killed): reclaim everything it held."""
        reclaimed = context.close()
        context.device.contexts.pop(context.id, None)
        self.log.server(
            f"Client {context.pid} disconnected; reclaimed {reclaimed['allocations']} allocations "
            f"({format_size(reclaimed['bytes'])}), {reclaimed['imports']} IPC imports, {reclaimed['streams']} "
            f"streams, {reclaimed['events']} events, {reclaimed['host_buffers']} host buffers")

    @staticmethod
    def device_of(context: Context) -> Device:
        return context.device

    def client_statistics(self, context: Context) -> dict[str, Any]:
        stats = context.device.sim.statistics()
        mine = stats.per_client.get(context.id)
        counters = context.counters
        return {
            "client_id": context.id, "pid": context.pid, "device": context.device.index,
            "sm_cap": context.quotas.sm_cap, "pinned_mem_limit": context.quotas.pinned_mem_limit,
            "priority": context.quotas.priority,
            "memory_used": context.used, "memory_peak": counters.peak_used,
            "memory_imported": sum(export.importers[context.id].size for export in
                                   {id(e): e for e in context.imports.values()}.values()),
            "launches": counters.launches, "copies": counters.copies, "bytes_copied": counters.bytes_copied,
            "kernels_completed": mine.kernels if mine else 0,
            "blocks_completed": mine.blocks if mine else 0,
            "block_seconds": mine.block_seconds if mine else 0.0,
            "sm_seconds": mine.sm_seconds if mine else 0.0,
            "max_sms": mine.max_sms if mine else 0,
            "sim_time": stats.now,
            "sticky_error": context.sticky.to_wire() if context.sticky else None,
        }

    # -- serving ---------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Begin a clean shutdown."""
        self._stop.set()

    async def serve(self, *, handle_signals: bool = True,
                    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until `stop()` or SIGTERM/SIGINT; reports the socket path to `nursery.start` when listening.

        Raises:
            DaemonError: the pipe directory or socket cannot be set up.
        """
        listener = await _listen(self.config.pipe_dir, self.config.socket_path)
        self.log.server(f"Server {self.log.pid} started on {len(self.devices)} device(s): "
                        + ", ".join(d.spec.name for d in self.devices)
                        + f"; policy {self.config.policy}, time scale {self.config.time_scale}")
        received = (trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) if handle_signals
                    else contextlib.nullcontext(None))
        try:
            # The signal receiver is installed before we say we are ready, so an early SIGTERM is never lost.
            with received as signals:
                async with trio.open_nursery() as engines:
                    for device in self.devices:
                        await engines.start(device.engine.run)
                    await self._serve_clients(listener, signals, task_status)
                    engines.cancel_scope.cancel()
        finally:
            if handle_signals:  # we are on our way out: a second signal must not cut the clean-up short
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            listener.close()
            _unlink(self.config.socket_path)
            self.log.server("Server exited")
            self.log.close()

    async def _serve_clients(self, listener: trio.socket.SocketType, signals: Any,
                             task_status: trio.TaskStatus[Path]) -> None:
        async with trio.open_nursery() as sessions:
            async with trio.open_nursery() as front:  # the tasks that end when shutdown begins
                front.start_soon(self._accept, listener, sessions)
                if signals is not None:
                    front.start_soon(self._watch_signals, signals)
                notify("READY=1\nSTATUS=accepting clients")
                task_status.started(self.config.socket_path)
                await self._stop.wait()
                front.cancel_scope.cancel()
            notify("STOPPING=1")
            self.log.server("Shutting down")
            for session in list(self.sessions):
                session.reader_scope.cancel()
            sessions.cancel_scope.deadline = trio.current_time() + SHUTDOWN_GRACE

    async def _accept(self, listener: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        while True:
            try:
                sock, _ = await listener.accept()
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("accept failed (%s); waiting before the next", exc)
                    await trio.sleep(0.1)
                    continue
                raise
            nursery.start_soon(self._serve_session, sock)

    async def _serve_session(self, tsock: trio.socket.SocketType) -> None:
        # Sessions drive the plain socket themselves (see mpsd.channel), without trio's wrapper.
        sock = socket.socket(fileno=tsock.detach())
        try:
            session = Session(self, sock)
        except OSError:
            sock.close()
            return
        self.sessions.add(session)
        try:
            await session.run()
        except Exception:
            # A bug met by one client's input ends that client's session, never the daemon.
            log.exception("session of client %d failed", session.pid)
            self.log.server(f"Client {session.pid}: internal error; its connection was closed")
        finally:
            self.sessions.discard(session)

    async def _watch_signals(self, signals: Any) -> None:
        async for signum in signals:
            self.log.server(f"Received {signal.Signals(signum).name}")
            self.stop()
            return


async def _listen(pipe_dir: Path, path: Path) -> trio.socket.SocketType:
    try:
        pipe_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if pipe_dir.stat().st_uid == os.geteuid():
            pipe_dir.chmod(0o700)
    except OSError as exc:
        raise DaemonError(f"cannot create the pipe directory {pipe_dir}: {exc.strerror}") from None
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            _unlink(path)  # a stale socket from a daemon that died
        else:
            raise DaemonError(f"another mpsd is already listening on {path}")
        finally:
            probe.close()
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(str(path))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise DaemonError(f"cannot listen on {path}: {exc.strerror}") from None
    return sock


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def notify(state: str) -> None:
    """Tell systemd (Type=notify) about our state, if it is listening; a no-op otherwise."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError as exc:
            log.warning("cannot notify systemd at %s: %s", address, exc)
