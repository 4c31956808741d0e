# Servers and their clients as MPS runs them, over the control plane's state (mpsd.daemon.control_state): one
# logical server at a time, started on demand for the user of its first client, serving only that user's
# clients; a client of another user waits (pending) until the server's last client has gone and the server has
# exited, then a server for the next user starts. With --multiuser one server serves every user. Shutting a
# server down is MPS's: refused while it has clients, tried again after a backoff (200 ms, 400, 800...), by
# force with -f or once quit's timeout has passed.
#
# Both languages start and stop servers through this, and the daemon tells it of clients that come and go;
# each step's log lines and effects go out as actions (control_state.Out), never done here. What a client
# that comes now may get (its server, its limits) is Admission's, the narrow interface the session sees.
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from mpsd.daemon.control_state import (
    Answer,
    ControlState,
    CutOff,
    EndServer,
    Out,
    ServerChanged,
    StartServer,
    Stop,
    Then,
    Wake,
)
from mpsd.daemon.control_text import DRIVER_VERSION, MPS_VERSION, U64, CommandError, atoi, digits
from mpsd.daemon.namespaces import DEFAULT, Namespace

if TYPE_CHECKING:
    from mpsd.daemon.routes import Route


class Admission:
    """What a client that comes now may get: whether it may attach yet, its namespace, its limits. Reads only."""

    def __init__(self, state: ControlState) -> None:
        self.state = state

    @property
    def quitting(self) -> bool:
        return self.state.quitting

    def admits(self, uid: int) -> bool:
        """Whether a client of `uid` may attach now (else it waits for the current server to exit)."""
        server = self.state.server
        return not server.started or server.uid is None or server.uid == uid or not self.state.contexts()

    def named(self, uid: int) -> Any:
        """The named server (MPS v3's -a file) of `uid`'s clients, if one is."""
        return None if self.state.multiuser else self.state.named.get(uid)

    def namespace_for(self, pid: int, uid: int, route: Route | None) -> Namespace | None:
        """The namespace a new client `pid` of `uid` goes in (None: its server's default one): the one its
        routed socket names, else the first whose cgroup holds the client's."""
        spaces = self.state.namespaces.get(self.state.server_key(uid), {})
        if route is not None:
            return None if route.namespace == DEFAULT else spaces.get(route.namespace)
        if not any(ns.cgroup for ns in spaces.values()):
            return None
        cgroup = self.state.processes.cgroup(pid)
        return next((ns for ns in spaces.values() if ns.holds_cgroup(cgroup)), None)

    def namespace_of(self, ctx: Any) -> Namespace | None:
        """The namespace a connected client is in (None: the default one)."""
        return self.state.namespaces.get(self.state.server_key(ctx.uid), {}).get(ctx.namespace)

    def percentage_for_new_client(self, uid: int | None = None) -> float:
        """The active thread percentage of a client that comes now (of `uid`: where no server runs, the one
        that will start for it, a named server's if its user has one)."""
        named = self._named_next(uid)
        if named is not None and named.active_thread_percentage is not None:
            return named.active_thread_percentage
        server = self.state.server
        value = server.active_thread_percentage if server.started else None
        return self.state.settings.active_thread_percentage if value is None else value

    def memory_limit_for_new_client(self, device: int, uid: int | None = None) -> int | None:
        named = self._named_next(uid)
        if named is not None and named.pinned_memory_limit is not None:
            if self.refused_by(named.uid, self.state.devices[device]) is None:
                return named.pinned_memory_limit
        server = self.state.server
        limits = server.pinned_mem_limits if server.started else self.state.settings.pinned_mem_limits
        return limits.get(device) or None

    def _named_next(self, uid: int | None) -> Any:
        """The named server a client of `uid` starts, where it starts one (none runs for it yet)."""
        server = self.state.server
        if uid is None or self.state.multiuser or (server.started and server.uid == uid):
            return None
        return self.state.named.get(uid)

    def refused_by(self, uid: int, device: Any) -> str | None:
        """The named server (MPS v3's -a file) of `uid` whose allowed devices leave `device` out, if one does."""
        named = self.named(uid)
        if named is None or not named.allowed_devices or device.properties["uuid"] in named.allowed_devices:
            return None
        return named.name


class Servers:
    """Starts and stops the server, and follows its clients, writing what MPS logs as it does."""

    def __init__(self, state: ControlState, out: Out) -> None:
        self.state, self.out = state, out
        self.admission = Admission(state)
        self.in_command = False  # whether a command is being run (what it causes is logged after its answer)
        self.later: list[Callable[[], None]] = []  # lines to log once the command's connection is done

    def note(self, text: str) -> None:
        """A control.log line that is no part of the answer."""
        self.out.control(text)

    def after_command(self) -> None:
        """What MPS logs once the command that caused it has been answered: a server's start comes from the
        server's own process, after the tool has had its answer."""
        later, self.later = self.later, []
        for write in later:
            write()

    def workers(self) -> int:
        """What MPS counts as a server's active worker threads: one per client process and one per context."""
        return sum(1 + len(contexts) for contexts in self.state.processes_of_server().values())

    # -- starting -------------------------------------------------------------------------------------------
    def start(self, uid: int) -> Callable[[], None]:
        """The server comes up for `uid`, with the defaults as they are now; returns what logs its start as
        MPS's does (once the daemon has given it its pid)."""
        state = self.state
        server, settings = state.server, state.settings
        server.started, server.shutting_down = True, False
        server.uid = None if state.multiuser else uid
        server.active_thread_percentage = settings.active_thread_percentage
        server.pinned_mem_limits = dict(settings.pinned_mem_limits)
        named = None if server.uid is None else state.named.get(uid)
        server.name = None if named is None else named.name
        if named is not None:  # MPS v3's named server for this user: its settings beat the defaults
            if named.active_thread_percentage is not None:
                server.active_thread_percentage = named.active_thread_percentage
            if named.pinned_memory_limit is not None:
                for device in state.devices:
                    if self.admission.refused_by(uid, device) is None:
                        server.pinned_mem_limits[device.index] = named.pinned_memory_limit
        server.clients_seen, server.ids = 0, {}
        state.retry_at = state.force_at = None
        self.out.do(StartServer(server.uid))
        return lambda: self.out.do(Then(functools.partial(self._start_lines, uid)))

    def _start_lines(self, uid: int) -> list[Any]:
        out, server, state = Out(), self.state.server, self.state
        out.control(f"Starting new server {server.pid} for user {uid}", pid=server.pid)
        out.control("Accepting connection...")
        for text in ("Startup", f"Connecting to control daemon on socket: {state.pipe_dir / 'control'}",
                     "Initializing server process"):
            out.server(text, source="Other")
        out.server(f"Creating server context on device 0 ({state.devices[0].name})")
        out.server(f"Created anonymous shared memory region mps.shm.0.{server.pid}")
        out.server(f"CUDA MPS Server for Linux/Unix. Binary version: {MPS_VERSION}")
        out.server(f"Display Driver version: {DRIVER_VERSION}")
        out.server(f"Active Threads Percentage set to {server.active_thread_percentage:.1f}")
        for device, limit in sorted(server.pinned_mem_limits.items(), reverse=True):
            out.server(f"Device pinned memory limit for device {device} set to {limit:#x} bytes")
        named = state.named.get(uid) if server.name is not None else None
        priority = named.client_priority if named is not None and named.client_priority is not None else None
        out.server(f"Server Priority set to {state.settings.client_priority if priority is None else priority}")
        out.server("Server has started")
        out.control(f"NEW SERVER {server.pid}: Ready")
        return out.take()

    def make_way(self) -> None:
        """The idle server, which serves another user, exits for the next one."""
        self.note(f"Try shutting down server {self.state.server.pid}, backoff is disabled")
        self.exit()

    # -- shutting down: MPS's retries with backoff -----------------------------------------------------------
    def try_shutdown(self, force: bool, now: float, backoff: bool = False) -> None:
        """One try at shutting the server down; with clients it is refused, and tried again later (with -f, or
        once quit's timeout has passed, it goes anyway and its clients' calls fail)."""
        state, out = self.state, self.out
        server = state.server
        if not server.started:
            return
        if state.force_at is not None and now >= state.force_at:
            force, backoff = True, False
        self.note(f"Try shutting down server {server.pid}, backoff is {'enabled' if backoff else 'disabled'}")
        out.server("Server has been notified to shutdown")
        workers = self.workers()
        if workers:
            self.note(f"Server {server.pid} has {workers} active worker threads. Server will not shutdown.")
            out.server(f"Server was unable to shutdown due to {workers} active clients")
            if not force:
                if backoff or state.retry_at is None:
                    if state.retry_at is not None:
                        state.backoff *= 2
                    state.retry_at = now + state.backoff
                    out.do(Wake())
                self.note(f"Control will try shutting down server {server.pid} again in at most "
                          f"{round(state.backoff * 1000)}ms")
                server.shutting_down = True
                return
            self.note(f"Force shutting down server {server.pid}")
            self._cut_off_clients()
        else:
            out.server("Waiting for current clients to finish")
            out.server("Exiting")
        self.exit()
        if state.quitting:
            out.do(Stop())

    def _cut_off_clients(self) -> None:
        for ctx in self.state.contexts():
            self.out.do(CutOff(ctx))
            self.state.orphans.add(ctx.id)

    def exit(self, status: int = 0) -> None:
        state = self.state
        server = state.server
        self.out.do(EndServer())
        server.started = server.shutting_down = False
        state.retry_at = None
        state.backoff = state.shutdown_retry
        self.out.do(ServerChanged())
        exited = functools.partial(self.note, f"Server {server.pid} exited with status {status}")
        if self.in_command:  # MPS sees its server go after it has answered the command that stopped it
            self.later.append(exited)
        else:
            exited()

    def server_died(self, pid: int, status: int) -> None:
        """The server's process (--mps-names) ended by itself, killed: the server is gone as MPS's is when its
        process dies, its clients' calls fail (cudaErrorMpsRpcFailure) and the next client starts a new one."""
        server = self.state.server
        if not server.started or server.pid != pid:
            return
        self.out.server(f"Server process {pid} ended with status {status}: its clients are cut off",
                        pid=self.state.pid)
        self._cut_off_clients()
        self.exit(status)

    # -- clients ---------------------------------------------------------------------------------------------
    def client_arrived(self, ctx: Any) -> None:
        """A context connected: control.log and server.log say what MPS's say when a client process opens one
        (its first context: the process's connection, numbered 0, then the CUDA context)."""
        state, out, pid, uid = self.state, self.out, ctx.pid, ctx.uid
        server = state.server
        state.clients[ctx.id] = ctx
        processes = state.processes_of_server()
        first = pid not in processes or [c.id for c in processes[pid]] == [ctx.id]
        out.control("Accepting connection...")
        if first:
            out.control("User did not send valid credentials")
            out.control("Accepting connection...")
            if not (server.started and (server.uid is None or server.uid == uid)):
                if server.started:  # idle, serving another user: it makes way
                    self.note(f"Try shutting down server {server.pid}, backoff is disabled")
                    out.server("Server has been notified to shutdown")
                    out.server("Waiting for current clients to finish")
                    out.server("Exiting")
                    self.exit()
                out.control(f"NEW CLIENT {pid} from user {uid}: Server is not ready, push client to pending list")
                self.after_command()
                self.start(uid)()
            else:
                out.control(f"NEW CLIENT {pid} from user {uid}: Server already exists")
            out.control("Accepting connection...")
        out.control(f"NEW CLIENT {pid} from user {uid}: Server already exists")
        number = len(state.processes_of_server().get(pid, ()))
        if first:
            server.clients_seen += 1
            server.ids[pid] = server.clients_seen
            out.server(f"Received new client request for {{PID: {pid}, Context ID: 0}}")
            out.server(f"Client {{PID: {pid}, Context ID: 0}} connected")
            out.server(f"Creating worker thread for client {{PID: {pid}, Context ID: 0}}")
        out.server(f"Received new client request for {{PID: {pid}, Context ID: 0}}")
        out.server(f"Client {{PID: {pid}, Context ID: {number}}} connected")
        out.server(f"Creating worker thread for client {{PID: {pid}, Context ID: {number}}}")
        out.server(f"Device {ctx.device.name} (uuid {ctx.device.properties['uuid']}) is associated")
        out.server(f"Status of client {{PID: {pid}, Context ID: {number}}} is ACTIVE")

    def client_leaving(self, ctx: Any) -> None:
        """A context is going (its teardown begins; the daemon forgets it at client_left): server.log says so
        as MPS's does."""
        if ctx.id in self.state.orphans:
            return
        out, pid = self.out, ctx.pid
        mine = [c.id for c in self.state.processes_of_server().get(pid, [])]
        number = mine.index(ctx.id) + 1 if ctx.id in mine else 1
        left = len(self.state.contexts()) - 1
        out.server(f"Server failed to recevie command with status 806, assuming client {{PID: {pid}, Context ID: "
                   f"{number}}} exit")
        self._gone(ctx)
        out.server(f"Client {{PID: {pid}, Context ID: {number}}} exiting. Number of active client contexts is "
                   f"{left}.")
        if len(mine) <= 1:
            out.server(f"Server failed to recevie command with status 806, assuming client {{PID: {pid}, Context "
                       "ID: 0} exit")
            out.server(f"Client process {pid} disconnected")

    def client_waiting(self, pid: int, uid: int) -> None:
        """A client of another user than the server's waits its turn (until client_done)."""
        server = self.state.server
        self.out.control(f"NEW CLIENT {pid} from user {uid}: Server {server.pid} serves user {server.uid}, push "
                         "client to pending list")
        self.state.waiting.append((pid, uid))

    def client_done_waiting(self, pid: int, uid: int) -> None:
        self.state.waiting.remove((pid, uid))

    def _gone(self, ctx: Any) -> None:
        """A context terminate_client waits for has gone: once the last of its contexts has, the command that
        waits is answered."""
        state = self.state
        ticket = state.awaiting.pop(ctx.id, None)
        if ticket is None:
            return
        self.out.server("Client termination succeeded.")
        if ticket not in state.awaiting.values():
            self.out.control("0")
            self.out.do(Answer(ticket, "0"))

    def client_left(self, ctx: Any) -> None:
        state = self.state
        self._gone(ctx)  # (where client_leaving said nothing: a server cut off by force)
        state.clients.pop(ctx.id, None)
        state.orphans.discard(ctx.id)
        state.terminated.discard(ctx.id)
        if state.contexts():
            return
        if state.waiting and not state.server.shutting_down:
            self.make_way()


class Commands:
    """What a language's commands share: the state, where their actions go, and MPS's ways of reading a
    server pid, a device and a count of arguments."""

    def __init__(self, state: ControlState, servers: Servers) -> None:
        self.state, self.servers, self.out = state, servers, servers.out
        self.admission = servers.admission

    def server_pid(self, text: str | None) -> Any:
        """The running server, named by its pid as atoi reads it.

        Raises:
            CommandError: no such server runs.
        """
        pid = atoi(text)
        server = self.state.server
        if pid != server.pid or not server.started:
            raise CommandError(f"Server {pid} not found")
        return server

    @staticmethod
    def args(args: list[str], count: int, usage: str) -> list[str]:
        """Exactly `count` arguments (mpsd's own commands), else a CommandError with the usage."""
        if len(args) != count:
            raise CommandError(f"Usage: {usage}")
        return args

    def device(self, text: str) -> int | None:
        """A device as MPS reads one for a limit: decimal digits (a device it has not is fine), else None."""
        if not text.isascii() or not text.isdigit():
            self.servers.note(f"Invalid device identifier format: {text}")
            return None
        return digits(text, U64)
