# The daemon: one trio event loop that owns the devices, listens on $CUDA_MPS_PIPE_DIRECTORY/mpsd.sock, gives each
# connection a Session and each session a sub-context with its quotas. Shutdown (SIGTERM, SIGINT, or `stop`)
# stops accepting, stops reading requests, lets replies already in flight finish for a short grace period,
# removes the socket file and returns, so the process exits 0. An exception that leaves `serve` makes the
# process exit 1 (mpsd.daemon.cli), and control.log's last line says which.
#
# The daemon holds the sockets and the tasks; what it serves is in the modules beside it, each holding its
# own part: the clients and their quotas (mpsd.daemon.clients), the control plane (mpsd.daemon.control_plane,
# over the sans-IO interpreters of mpsd.daemon.control), one session per connection (mpsd.daemon.session).
from __future__ import annotations

import contextlib
import errno
import functools
import gc
import logging
import math
import os
import resource
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import trio

from mpsd.backends.base import HOST_VIEW, Backend
from mpsd.backends.factory import DeviceDescription, GpuUnavailableError, open_backend
from mpsd.backends.hostmem import HostMemory, default_budget
from mpsd.backends.sim import SimBackend
from mpsd.daemon.channel import Spin
from mpsd.daemon.clients import Clients
from mpsd.daemon.config import Config
from mpsd.daemon.control_plane import ControlPlane
from mpsd.daemon.control_state import Settings
from mpsd.daemon.control_text import MPS_VERSION
from mpsd.daemon.listeners import (ControlConnections, Greetings, Listeners, ListenError, notify, open_listeners,
                                   write_protocol_file)
from mpsd.daemon.ownership import UnsafePathError
from mpsd.daemon.routes import Route, RouteSockets, open_route
from mpsd.daemon.servlog import ServerLog
from mpsd.daemon.session import Session
from mpsd.daemon.sm_partitions import PartitionError, SmPartitions
from mpsd.runtime.context import Context
from mpsd.runtime.device import Device
from mpsd.runtime.dispatch import Dispatcher
from mpsd.runtime.dispatch_policies import kernel_policy
from mpsd.runtime.ipc import IpcRegistry
from mpsd.runtime.limits import FDS, MAPS, ProcessBudget, fd_limit, map_limit
from mpsd.runtime.memory import CHUNK
from mpsd_protocol import (
    parse_integer,
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
            DaemonError: the log directory cannot be written, or is not safely the daemon's own.
        """
        self.config = config
        moved = None
        try:
            try:
                self.log = ServerLog(config.log_dir)
            except OSError as exc:
                if not config.default_log_dir or isinstance(exc, UnsafePathError):
                    raise
                # MPS's default log directory is root's to make: any other user's daemon logs beside its pipes.
                moved = f"cannot write logs in {config.log_dir} ({exc.strerror}); they go in {config.pipe_dir}"
                self.log = ServerLog(config.pipe_dir)
        except UnsafePathError as exc:
            raise DaemonError(str(exc)) from None
        except OSError as exc:
            raise DaemonError(f"cannot write logs in {exc.filename or config.log_dir}: {exc.strerror}") from None
        if config.control_log_stdout:
            self.log.echo = sys.stdout
        if moved is not None:
            logging.getLogger("mpsd").warning(moved)
            self.log.server(moved[0].upper() + moved[1:])
        # One budget of host RAM for every device's simulated memory and the clients' pinned buffers mapped here:
        # they all live in this process.
        self.host_memory = HostMemory(config.host_memory if config.host_memory is not None else default_budget())
        # And one count of the fds and memory mappings its clients' objects hold, each against the process's
        # limit less a reserve (mpsd.runtime.limits).
        limits = config.client_limits
        self.fds = ProcessBudget(FDS, limits, fd_limit)
        max_maps = map_limit()
        self.maps = ProcessBudget(MAPS, limits, lambda: max_maps)
        self.devices = [Device(i, self._backend(i, device), containment=config.fault_containment, log=self.log,
                               host_memory=self.host_memory, shared_process=config.shared_process, limits=limits,
                               fds=self.fds, maps=self.maps, module_path=config.module_path)
                        for i, device in enumerate(config.devices)]
        self.ipc = IpcRegistry(config.ipc_access, self.log, self.peers)
        self.owner_uid = os.geteuid()
        self.settings = Settings(config.active_thread_percentage, {
            i: limit for i in range(len(self.devices)) if (limit := config.pinned_mem_limit(i)) is not None
        }, config.client_priority)
        self.sm_partitions: SmPartitions | None = None  # MPS's -S, or the -a file's SM partitions
        try:
            self._set_up_partitions_and_named_servers()
        except DaemonError:
            self.log.close()  # the daemon never served: nothing will close its logs
            raise
        for named in config.servers:
            if named.client_priority is not None:  # what its user's clients get, as a per-user setting
                self.settings.priorities[("uid", named.uid)] = named.client_priority
        # A caller in this process may take each device's trace as data at exit instead of a file (open_daemon).
        self.keep_traces = False
        self.traces: list[tuple[Any, dict[str, Any]] | None] = []
        self._grace = SHUTDOWN_GRACE
        self.sessions: set[Session] = set()
        self.spin = Spin(config.spin, self.sessions.__len__)  # how long a session reads an emptied socket on
        self.greetings = Greetings(config.handshake_timeout)
        self.controls = ControlConnections()
        self._stop = trio.Event()
        self.routes: dict[Route, RouteSockets] = {}  # MPS v3's per-server and per-namespace sockets
        self.front: trio.Nursery | None = None  # where accept loops run while the daemon takes clients
        self._sessions: trio.Nursery | None = None
        self.exporter: Any = None  # the Prometheus exporter (mpsd.daemon.metrics) while --metrics serves

    def _set_up_partitions_and_named_servers(self) -> None:
        """Static SM partitioning (-S, or the -a file's partitions), the control plane, and the -a file's
        devices checked against ours and its partitions made.

        Raises:
            DaemonError: the devices cannot be pinned, or the file names a device we lack or a partition that
                does not fit.
        """
        config = self.config
        if config.static_partitioning or any(named.sm_partitions for named in config.servers):
            # The simulator's mps policy is what pins a client to its partition's SMs.
            unpinnable = [d.index for d in self.devices
                          if not isinstance(d.backend, SimBackend) or d.backend.policy != "mps"]
            if unpinnable:
                raise DaemonError("static SM partitioning (-S, or the -a file's sm_partitions) needs simulated "
                                  "devices under the mps policy; not device " + ", ".join(map(str, unpinnable)))
            self.sm_partitions = SmPartitions([d.properties["multiprocessor_count"] for d in self.devices])
        self.control = ControlPlane(self)
        self.admission = self.control.admission  # what a new client may get: the session's view of the control plane
        self.clients = Clients(config, self.devices, self.log, self.ipc, self.settings, self.control,
                               self.sm_partitions, self.host_memory)
        by_uuid = {device.properties["uuid"]: device.index for device in self.devices}
        for named in config.servers:  # MPS v3's named servers: their devices must be ours
            tables = [(f"servers.{named.name}.allowed_devices", named.allowed_devices),
                      (f"servers.{named.name}.devices", tuple(device.uuid for device in named.devices))]
            tables += [(f"servers.{named.name}.namespaces.{ns.name}.devices", tuple(d.uuid for d in ns.devices))
                       for ns in named.namespaces]
            for where, uuids in tables:
                missing = [uuid for uuid in uuids if uuid not in by_uuid]
                if missing:
                    raise DaemonError(f"{config.apply}: {where} names no device of this daemon: {', '.join(missing)}")
            # Those that take the SMs past the last chunk first: they must lie at their device's end.
            for uuid, spec in sorted(named.sm_partitions, key=lambda entry: not entry[1].include_remainder):
                assert self.sm_partitions is not None
                try:
                    self.sm_partitions.add(by_uuid[uuid], spec.chunks, name=spec.name,
                                           include_remainder=spec.include_remainder, server=named.name)
                except PartitionError as exc:
                    raise DaemonError(f"{config.apply}: servers.{named.name}'s SM partition "
                                      f"{spec.name}: {exc}") from None

    def _backend(self, index: int, device: DeviceDescription) -> Backend:
        """What runs device `index`: a real GPU, or the simulator.

        Raises:
            DaemonError: the real GPU cannot be opened.
        """
        config = self.config
        # Under kernel dispatch the simulator models the hardware the dispatcher feeds: MPS's block scheduler.
        policy, options = ("mps", {}) if config.dispatch == "kernel" else config.device_policy(index)
        try:
            backend = open_backend(device, policy=policy, policy_options=options, clock=config.clock,
                                   time_scale=config.time_scale, idle_grace=config.idle_grace,
                                   trace=config.trace_path(index), host_memory=self.host_memory)
        except GpuUnavailableError as exc:
            raise DaemonError(str(exc)) from None
        if config.kernel_dispatch:
            return Dispatcher(backend, kernel_policy(config.policy, config.policy_options),
                              config.kernels_in_flight, config.dispatch_reaction)
        return backend

    def peers(self, exporter: int, importer: int) -> bool:
        """Whether a context on device `importer` may map device `exporter`'s memory, and copies between them go
        over NVLink: simulated devices (their memory is the host's) unless --peer-access none, or either runs
        MIG partitions (MIG has no peer-to-peer access over NVLink or PCIe); a real GPU's peers are not built
        yet (it takes two)."""
        if self.config.peer_access != "all":
            return False
        devices = [self.devices[index] for index in (exporter, importer)]
        return all(HOST_VIEW in d.backend.capabilities and d.backend.policy != "mig" for d in devices)

    # -- clients (mpsd.daemon.clients): what the control plane, the stress runner and the tests reach here --------
    def status(self) -> dict[str, Any]:
        return self.clients.status()

    def reconfigure(self, context: Context) -> None:
        self.clients.reconfigure(context)

    def terminate(self, context: Context, why: str) -> None:
        self.clients.terminate(context, why)

    def now(self) -> float:
        return trio.current_time()

    @staticmethod
    def device_of(context: Context) -> Device:
        return context.device

    # -- serving ---------------------------------------------------------------------------------------
    async def wait_stopped(self) -> None:
        """Return once stop() has been called."""
        await self._stop.wait()

    def stop(self, grace: float | None = None) -> None:
        """Begin a clean shutdown; in-flight replies get `grace` seconds (default 5) to finish."""
        if grace is not None:
            self._grace = grace
        self._stop.set()

    async def serve(self, *, handle_signals: bool = True,
                    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until `stop()` or SIGTERM/SIGINT; reports the socket path to `nursery.start` when listening.

        Raises:
            DaemonError: the pipe directory or socket cannot be set up.
        """
        was, limit = raise_fd_limit()
        try:
            listeners = await open_listeners(self.config.pipe_dir, multiuser=self.config.multiuser)
        except ListenError as exc:
            self.log.close()  # the daemon never served: nothing below will close its logs
            raise DaemonError(str(exc)) from None
        try:
            protocol_file = write_protocol_file(self.config.pipe_dir, self.config.protocol)
        except ListenError as exc:
            listeners.close()
            self.log.close()
            raise DaemonError(str(exc)) from None
        if protocol_file is not None:
            listeners.bound.append(protocol_file)
        try:
            for named in self.config.servers:  # $PIPE/<server>/ and $PIPE/<server>/<namespace>/
                self.add_route(Route(named.name, self.control.state.server_key(named.uid)))
                self.add_route(Route(named.name, self.control.state.server_key(named.uid), named_default=True))
                for namespace in self.control.namespaces.get(self.control.state.server_key(named.uid), {}).values():
                    self.add_route(Route(named.name, self.control.state.server_key(named.uid), namespace.name))
        except ListenError as exc:
            self.close_routes()
            listeners.close()
            self.log.close()  # the daemon never served: nothing below will close its logs
            raise DaemonError(str(exc)) from None
        if self.config.metrics is not None:
            try:
                self.exporter = _open_exporter(self, *self.config.metrics)
            except OSError as exc:
                self.close_routes()
                listeners.close()
                self.log.close()
                where = ":".join(map(str, self.config.metrics))
                raise DaemonError(f"cannot serve --metrics on {where}: {exc.strerror or exc}") from None
        _log_start(self, listeners, was, limit)
        received = (trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) if handle_signals
                    else contextlib.nullcontext(None))
        failure: BaseException | None = None
        try:
            # The signal receiver is installed before we say we are ready, so an early SIGTERM is never lost.
            with received as signals:
                async with trio.open_nursery() as engines:
                    for device in self.devices:
                        await engines.start(device.backend.run)
                    await self._serve_clients(listeners, signals, task_status)
                    engines.cancel_scope.cancel()
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if handle_signals:  # we are on our way out: a second signal must not cut the clean-up short
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            listeners.close()
            self.close_routes()
            self.control.close_server_processes()
            self._write_traces()
            self.log.server("Server exited")
            self.log.control(f"Exit with status {_exit_status(failure)}")
            self.log.close()

    def _write_traces(self) -> None:
        # Drawing a trace makes millions of objects, none of them in cycles, so the collector's scans of the whole
        # heap while it draws found nothing; they took up to a second each (a DISB-C run of 2 s spent 3.6 s of
        # its daemon's exit in them). No collection runs meanwhile.
        if self.keep_traces:
            self.traces = [device.backend.timeline(device.index) for device in self.devices]
            return
        self.write_traces()

    def write_traces(self) -> list[str]:
        """Write each traced device's timeline so far where --trace says (at exit, or when an operator asks:
        mpsd-control's mpsd_trace); what was written, as server.log says it."""
        said = []
        collecting = gc.isenabled()
        gc.disable()  # (see _write_traces)
        try:
            for device in self.devices:
                try:
                    path = device.backend.write_trace(device.index)
                    if path is not None:
                        said.append(f"Trace of device {device.index} written to {path}")
                except OSError as exc:
                    said.append(f"Cannot write the trace of device {device.index}: {exc}")
        finally:
            if collecting:
                gc.enable()
        for line in said:
            self.log.server(line)
        return said

    async def _serve_clients(self, listeners: Listeners, signals: Any,
                             task_status: trio.TaskStatus[Path]) -> None:
        async with trio.open_nursery() as sessions:
            async with trio.open_nursery() as front:  # the tasks that end when shutdown begins
                self.front, self._sessions = front, sessions
                front.start_soon(self._accept, listeners.clients, sessions, self._serve_session)
                front.start_soon(self._accept, listeners.control, sessions, self.control.serve)
                for sockets in self.routes.values():
                    front.start_soon(self._accept_route, sockets)
                front.start_soon(self.control.run_shutdown_retries)
                if self.exporter is not None:  # scrapes are answered from here until shutdown begins
                    await front.start(self.exporter.run)
                if signals is not None:
                    front.start_soon(self._watch_signals, signals)
                watchdog = _watchdog_interval()
                if watchdog:
                    front.start_soon(_keep_watchdog_fed, watchdog)
                notify("READY=1\nSTATUS=accepting clients")
                task_status.started(self.config.socket_path)
                await self._stop.wait()
                front.cancel_scope.cancel()
            self.front = None
            notify("STOPPING=1")
            self.log.server("Shutting down")
            # No new client may wait in the listen queue for a handshake that never comes: it is refused now.
            listeners.close()
            self.close_routes()
            for session in list(self.sessions):
                session.reader_scope.cancel()
            sessions.cancel_scope.deadline = trio.current_time() + self._grace

    async def _accept(self, listener: trio.socket.SocketType, nursery: trio.Nursery, serve: Any) -> None:
        failed = 0  # accepts refused in a row: said once when it begins, then once a minute with the count
        said = -math.inf
        while True:
            try:
                sock, _ = await listener.accept()
            except trio.ClosedResourceError:
                return  # a namespace's socket, closed by namespace delete
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    failed += 1
                    if trio.current_time() - said >= 60:  # (it is tried ten times a second)
                        log.warning("accept failed (%s), %d time%s in a row; trying again every 0.1 s", exc,
                                    failed, "" if failed == 1 else "s")
                        said = trio.current_time()
                    await trio.sleep(0.1)
                    continue
                raise
            if failed:
                log.warning("accepting again after %d failed accept%s", failed, "" if failed == 1 else "s")
                failed, said = 0, -math.inf
            nursery.start_soon(serve, sock)

    # -- MPS v3's routed sockets --------------------------------------------------------------------------
    def add_route(self, route: Route) -> None:
        """Listen on `route`'s sockets ($PIPE/<server>[/<namespace>]/), from now on where clients are taken.

        Raises:
            ListenError: its directory is not safely ours, or a socket cannot be bound.
        """
        if route in self.routes:
            return
        sockets = open_route(self.config.pipe_dir, route, multiuser=self.config.multiuser)
        self.routes[route] = sockets
        if self.front is not None:
            self.front.start_soon(self._accept_route, sockets)

    def remove_route(self, route: Route) -> None:
        """Stop listening on `route`'s sockets and remove them (clients that came by them stay)."""
        sockets = self.routes.pop(route, None)
        if sockets is not None:
            sockets.close()

    def close_routes(self) -> None:
        # Namespaces' directories before their servers', which hold them.
        for route in sorted(self.routes, key=lambda r: r.is_server):
            self.remove_route(route)

    async def _accept_route(self, sockets: RouteSockets) -> None:
        assert self._sessions is not None
        with sockets.scope:
            async with trio.open_nursery() as loops:
                loops.start_soon(self._accept, sockets.clients, self._sessions,
                                 functools.partial(self._serve_session, route=sockets.route))
                loops.start_soon(self._accept, sockets.control, self._sessions,
                                 functools.partial(self.control.serve, route=sockets.route))

    async def _serve_session(self, tsock: trio.socket.SocketType, route: Route | None = None) -> None:
        # Sessions drive the plain socket themselves (see mpsd.daemon.channel), without trio's wrapper.
        sock = socket.socket(fileno=tsock.detach())
        try:
            session = Session(self, sock, route)
        except OSError:
            sock.close()
            return
        if self.greetings.admit(session.uid) == 1:
            self.log.server(f"User {session.uid} has {self.greetings.limit} connections that have not said hello; "
                            "closing the oldest of them for each new one until one does or is closed")
        self.sessions.add(session)
        try:
            async with self.greetings.open_handshake(session.uid, session, sock) as handshake:
                await session.run()
            if self.greetings.evicted(session):
                pass  # (the line above said so, once for the run of them)
            elif handshake.cancelled_caught:
                self.log.server(f"Client {session.pid}: no hello within {self.greetings.timeout:g} s; its "
                                "connection was closed")
            elif session.channel.overflowed:
                self.log.server(f"Client {session.pid}: {session.channel.overflowed}; its connection was closed")
        except Exception:
            # A bug met by one client's input ends that client's session, never the daemon.
            log.exception("session of client %d failed", session.pid)
            self.log.complaint(("uid", session.uid), f"Client {session.pid}: internal error; its connection was closed")
        finally:
            self.sessions.discard(session)

    def greeted(self, session: Session) -> None:
        """`session` has said hello: it no longer counts against its uid's bound, nor has a deadline."""
        self.greetings.greeted(session.uid, session)

    async def _watch_signals(self, signals: Any) -> None:
        async for signum in signals:
            self.log.server(f"Received {signal.Signals(signum).name}")
            self.stop()
            return



def _log_start(daemon: Daemon, listeners: Listeners, was: int, limit: int) -> None:
    """What the daemon logs once it listens: MPS's control.log lines, then its own in server.log (its devices,
    and whether the fd and mapping limits leave room for their memory)."""
    control_path = daemon.config.pipe_dir / "control"
    daemon.log.control(f"Starting control daemon using socket {control_path}"
                       + (" (sockets from systemd)" if listeners.activated else ""))
    daemon.log.control("To connect CUDA applications to this daemon, set env "
                       f"CUDA_MPS_PIPE_DIRECTORY={daemon.config.pipe_dir}")
    daemon.log.control(f"CUDA MPS Control binary version: {MPS_VERSION}")
    if daemon.config.apply is not None:  # mpsd's line: what MPS v3 logs of its -a file is not documented
        daemon.log.control(f"Applied configuration {daemon.config.apply}: servers "
                           + (", ".join(named.name for named in daemon.config.servers) or "none"))
    daemon.log.server(f"Server {daemon.log.pid} started on {len(daemon.devices)} device(s): "
                      + ", ".join(d.name for d in daemon.devices)
                      + "; policy " + ", ".join(dict.fromkeys(d.backend.policy for d in daemon.devices))
                      + (f", virtual clock (idle grace {daemon.config.idle_grace:g} s)"
                         if daemon.config.clock == "virtual" else f", time scale {daemon.config.time_scale}"))
    # Two fds per 2 MiB of device memory at most (a segment and its mapping): what the fds must cover so
    # that memory, not fds, is what runs out.
    needed = sum(2 * (device.total_memory // CHUNK) for device in daemon.devices)
    daemon.log.server(f"File descriptor limit {limit}" + (f" (raised from {was})" if was != limit else "")
                      + f", {daemon.fds.kept(limit)} of them kept from clients (--fd-reserve)"
                      + (f"; the devices' memory in 2 MiB allocations would need {needed}, so raise the hard "
                         "limit (LimitNOFILE= under systemd)" if limit < needed else ""))
    # And a mapping per 2 MiB on the simulated device (none on a GPU).
    maps, needed = daemon.maps.limit(), sum(d.backend.host_maps * (d.total_memory // CHUNK) for d in daemon.devices)
    daemon.log.server(f"Memory map limit {maps} (vm.max_map_count), {daemon.maps.kept(maps)} of them kept from "
                      "clients (--map-reserve)" + (f"; the devices' memory in 2 MiB allocations would need {needed}, "
                                                   "so raise it (sysctl)" if maps < needed else ""))
    if daemon.exporter is not None:
        daemon.log.server(f"Metrics for Prometheus at {daemon.exporter.url}" + (
            ": reachable from other hosts (--metrics-allow-remote), and they show every client's pid and uid"
            if daemon.exporter.remote else ""))


def _open_exporter(daemon: Daemon, host: str, port: int) -> Any:
    """The Prometheus exporter, bound to HOST:PORT; imported only when asked for, as prometheus-client's HTTP
    server costs every other start about 50 ms to import.

    Raises:
        OSError: the address cannot be bound.
    """
    from mpsd.daemon.metrics import Exporter

    return Exporter(daemon, host, port)


def _exit_status(failure: BaseException | None) -> int:
    """The status mpsd.daemon.cli exits with when `serve` ends with `failure`: 0 when serving ended cleanly (or our
    caller cancelled it, which is no failure of ours), 1 for any exception (mpsd.daemon.cli turns a DaemonError into
    exit 1, and Python exits 1 on any other)."""
    if failure is None or isinstance(failure, trio.Cancelled):
        return 0
    if isinstance(failure, BaseExceptionGroup) and failure.split(trio.Cancelled)[1] is None:
        return 0
    return 1


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit, as a server that holds an fd per client and per
    allocation should (systemd gives services a soft limit of 1024 unless the unit says LimitNOFILE=).

    Returns:
        The soft limit before and after (the same when it could not be raised).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:  # Linux caps the fd table at fs.nr_open, whatever the limit says
        try:
            hard = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            return soft, soft
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the file descriptor limit from %d to %d: %s", soft, hard, exc)
            return soft, soft
        return soft, hard
    return soft, soft


def _watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings when systemd asked for them (WatchdogSec=), else None."""
    usec, pid = os.environ.get("WATCHDOG_USEC", ""), os.environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        return parse_integer(usec, max_digits=20) / 1e6 / 2  # twice per period, as sd_watchdog_enabled(3) advises
    except ValueError:
        return None


async def _keep_watchdog_fed(interval: float) -> None:
    # Runs on the event loop, so a loop that stops turning stops the pings and systemd notices.
    while True:
        notify("WATCHDOG=1")
        await trio.sleep(interval)
