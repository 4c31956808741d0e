# The daemon's half of the control plane: the control sockets' connections, the clock of shutdown retries,
# clients waiting their turn, and the actions the interpreters (mpsd.daemon.control, control_v3) return,
# applied here in order to the daemon (its logs, its server processes, its clients, its routed sockets). The
# interpreters know nothing of this module: all they read is the ControlState built here from the daemon's
# configuration, which keeps the daemon's own devices, settings and partitions, and the clients it attaches.
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import TYPE_CHECKING, Any

import trio

from mpsd.daemon.control import Control, Outcome, answer_lines
from mpsd.daemon.control_state import (
    Action,
    AddRoute,
    Answer,
    Defer,
    ControlState,
    CutOff,
    EndServer,
    Log,
    Reconfigure,
    RemoveRoute,
    Report,
    ServerChanged,
    SetComputeMode,
    StartServer,
    Stop,
    Terminate,
    Then,
    Wake,
)
from mpsd.daemon.listeners import ListenError
from mpsd.daemon.routes import Route
from mpsd.runtime.device import COMPUTE_MODES
from mpsd.daemon.server_process import ServerProcess, ServerProcesses, ServerProcessError
from mpsd_protocol import CONTROL_PACKET, control_packets, peer_credentials

if TYPE_CHECKING:
    from mpsd.daemon.server import Daemon

log = logging.getLogger("mpsd")


class ProcFs:
    """The ProcessTable of this host, read from /proc."""

    def namespace(self, pid: int) -> str:
        try:
            return os.readlink(f"/proc/{pid}/ns/pid").split("[")[-1].rstrip("]")
        except OSError:
            return "-"

    def command(self, pid: int) -> str:
        """argv[0], as MPS's ps shows it (the path the process was started by, not its executable's)."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                first = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            return "-"
        return first or "-"

    def cgroup(self, pid: int) -> str | None:
        """The cgroup v2 path of process `pid`, or None (gone, or no unified hierarchy)."""
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                for line in f:
                    if line.startswith("0::"):
                        return line[3:].rstrip("\n")
        except OSError:
            pass
        return None

    def owner(self, pid: int) -> int | None:
        try:
            return os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return None


class _Answer:
    """A command's answer that comes later."""

    def __init__(self) -> None:
        self._event, self._reply = trio.Event(), ""

    def give(self, reply: str) -> None:
        self._reply = reply
        self._event.set()

    async def wait(self) -> str:
        await self._event.wait()
        return self._reply


class ControlPlane:
    """The control languages over one daemon: what their actions do, and the sockets that carry them."""

    def __init__(self, daemon: Daemon) -> None:
        config = daemon.config
        self.daemon = daemon
        self.state = ControlState(
            daemon.log.pid, daemon.devices, daemon.settings, daemon.owner_uid, config.pipe_dir,
            multiuser=config.multiuser, protocol=config.protocol, shutdown_retry=config.shutdown_retry,
            tracing=config.trace is not None, compute_modes=tuple(COMPUTE_MODES), partitions=daemon.sm_partitions,
            processes=ProcFs(),
            named={named.uid: named for named in config.servers})
        for named in config.servers:  # copies of the -a file's, which namespace set changes
            self.state.namespaces[self.state.server_key(named.uid)] = {
                ns.name: dataclasses.replace(ns) for ns in named.namespaces}
        self.interpreter = Control(self.state)
        self.admission = self.interpreter.admission
        self.failed = False  # whether the last command failed (MPS v3's commands only: the tool exits 1)
        self.deferred: int | None = None  # the ticket of the last command's answer, where it comes later
        self._answers: dict[int, _Answer] = {}
        self._retry_wakeup = trio.Event()
        self._server_change = trio.Event()
        # With --mps-names each server has a process of its own named nvidia-cuda-mps-server (its pid the server's).
        self.server_processes = ServerProcesses() if config.mps_names else None
        self._server_process: ServerProcess | None = None

    @property
    def server(self) -> Any:
        return self.state.server

    @property
    def namespaces(self) -> Any:
        return self.state.namespaces

    @property
    def quitting(self) -> bool:
        return self.state.quitting

    # -- commands -------------------------------------------------------------------------------------------
    def execute(self, line: str, uid: int, route: Route | None = None) -> str:
        """Run one command line from a client of uid `uid` and apply what it asks; returns what the tool prints
        (maybe nothing)."""
        return self._finish(self.interpreter.execute(line, uid, self.daemon.now(), route))

    def receive(self, packet: bytes, uid: int, route: Route | None = None) -> str:
        """What one control packet gets back. Any user may send one, so nothing in it may end the daemon: a
        bug met while running the command answers that command with an error and is logged."""
        try:
            return self._finish(self.interpreter.receive(packet, uid, self.daemon.now(), route))
        except Exception as exc:
            log.exception("control command from uid %d failed", uid)
            self.apply(self.interpreter.out.take())  # what it did before it failed is done, as it was asked
            self.daemon.log.control(f"Internal error ({type(exc).__name__}) while running a command from user {uid}")
            self.failed = False
            return f"Internal error ({type(exc).__name__}); the daemon's log has the details"

    def _finish(self, outcome: Outcome) -> str:
        self.failed = outcome.failed
        self.deferred = next((a.ticket for a in outcome.actions if isinstance(a, Defer)), None)
        reply = outcome.text
        answer = self.apply(outcome.actions)
        if answer is not None:  # the daemon's own answer (Report), or a failure met applying an action
            reply, failed = answer
            self.failed = self.failed or failed
            for text in answer_lines(reply):
                self.daemon.log.control(text)
        return reply

    def after_command(self) -> None:
        self.apply(self.interpreter.after_command())

    # -- what the daemon tells the control plane --------------------------------------------------------------
    def client_arrived(self, ctx: Any) -> None:
        self.apply(self.interpreter.client_arrived(ctx))

    def client_leaving(self, ctx: Any) -> None:
        self.apply(self.interpreter.client_leaving(ctx))

    def client_left(self, ctx: Any) -> None:
        self.apply(self.interpreter.client_left(ctx))

    def server_died(self, pid: int, status: int) -> None:
        self.apply(self.interpreter.server_died(pid, status))

    async def wait_turn(self, pid: int, uid: int) -> None:
        """Return when a client of `uid` may attach: at once, or once the other user's server has exited."""
        if self.admission.admits(uid):
            return
        self.apply(self.interpreter.client_waiting(pid, uid))
        try:
            while not self.admission.admits(uid):
                await self._server_change.wait()
        finally:
            self.interpreter.servers.client_done_waiting(pid, uid)

    async def run_shutdown_retries(self) -> None:
        """Runs the shutdown retries (MPS's backoff) when they fall due."""
        while True:
            due = self.state.next_retry()
            if due is None:
                await self._retry_wakeup.wait()
                self._retry_wakeup = trio.Event()
                continue
            await trio.sleep_until(due)
            due = self.state.next_retry()
            if due is not None and trio.current_time() >= due:
                self.apply(self.interpreter.retry_due(trio.current_time()))

    # -- the actions -----------------------------------------------------------------------------------------
    def apply(self, actions: list[Action]) -> tuple[str, bool] | None:
        """Do `actions` in order; returns the command's answer where an action makes it (and whether it
        failed), else None."""
        daemon, answer = self.daemon, None
        for action in actions:
            if isinstance(action, Log):
                if action.stream == "control":
                    daemon.log.control(action.text, pid=action.pid, verbatim=action.verbatim)
                else:
                    daemon.log.server(action.text, source=action.source or "Server", pid=action.pid)
            elif isinstance(action, Then):
                answer = self.apply(action.actions()) or answer
            elif isinstance(action, StartServer):
                self.state.server.pid = self.start_server_process(action.uid)
            elif isinstance(action, EndServer):
                self.end_server_process()
            elif isinstance(action, ServerChanged):
                self._server_change.set()
                self._server_change = trio.Event()
            elif isinstance(action, Wake):
                self._retry_wakeup.set()
            elif isinstance(action, Stop):
                daemon.stop()
            elif isinstance(action, Terminate):
                daemon.clients.terminate(action.client, action.why)
            elif isinstance(action, CutOff):
                daemon.clients.server_gone(action.client)
            elif isinstance(action, Reconfigure):
                daemon.clients.reconfigure(action.client)
            elif isinstance(action, SetComputeMode):
                daemon.devices[action.device].compute_mode = action.mode
            elif isinstance(action, AddRoute):
                try:
                    daemon.add_route(Route(action.server, action.key, action.name))
                except ListenError as exc:  # the namespace is not made after all, nor is it logged
                    self.state.namespaces.get(action.key, {}).pop(action.name, None)
                    return str(exc), True
            elif isinstance(action, RemoveRoute):
                daemon.remove_route(Route(action.server, action.key, action.name))
            elif isinstance(action, Defer):
                self._answers.setdefault(action.ticket, _Answer())
            elif isinstance(action, Answer):
                self._answers.setdefault(action.ticket, _Answer()).give(action.reply)
            elif isinstance(action, Report):
                status = action.what == "status"
                answer = json.dumps(daemon.clients.status()) if status else "\n".join(daemon.write_traces()), False
        return answer

    # -- the servers' processes (--mps-names) ---------------------------------------------------------------
    def close_server_processes(self) -> None:
        """The daemon is going: so do the server's process and the directory they start from."""
        self.end_server_process()
        if self.server_processes is not None:
            self.server_processes.close()

    def start_server_process(self, uid: int | None) -> int:
        """The pid of the server that starts now: its own process's, or the daemon's where it has none."""
        self.end_server_process()
        if self.server_processes is None or self.daemon.front is None:
            return self.daemon.log.pid
        try:
            process = self.server_processes.start(uid)
        except ServerProcessError as exc:
            self.daemon.log.server(f"{exc}; the server's pid is the daemon's", pid=self.daemon.log.pid)
            return self.daemon.log.pid
        self._server_process = process
        self.daemon.log.server_pid = process.pid
        self.daemon.front.start_soon(self._watch_server, process)
        return process.pid

    def end_server_process(self) -> None:
        """The server ends: so does its process (it is reaped by its watcher)."""
        process, self._server_process = self._server_process, None
        self.daemon.log.server_pid = self.daemon.log.pid
        if process is not None:
            process.end()

    async def _watch_server(self, process: ServerProcess) -> None:
        status = await process.wait()
        if self._server_process is process:  # it died while its server ran: killed
            self._server_process = None
            self.daemon.log.server_pid = self.daemon.log.pid
            self.server_died(process.pid, status)

    # -- the control sockets ----------------------------------------------------------------------------------
    async def serve(self, sock: trio.socket.SocketType, route: Route | None = None) -> None:
        """One control connection: a command per packet in, its output back (mpsd_protocol.control_packets),
        with control.log's lines for it as MPS writes them. After quit it gets no answer: the connection
        closes when the daemon has gone, which is when the tool that sent quit returns; while quitting, the
        daemon takes no more commands."""
        daemon = self.daemon
        with sock:
            if self.quitting:
                return
            try:
                uid = peer_credentials(sock)[1]
            except OSError:
                return
            limited = None if uid in (0, daemon.owner_uid) else uid  # whose lines the log rate-limits
            with daemon.log.limiting(limited):
                daemon.log.control("Accepting connection...")
                daemon.log.control("NEW UI")
            try:
                with trio.CancelScope() as scope, daemon.controls.holding(uid, scope) as evicting:
                    if evicting == 1:
                        with daemon.log.limiting(limited):
                            daemon.log.control(f"User {uid} has {daemon.controls.limit} control connections open; "
                                               "closing the oldest")
                    while packet := await sock.recv(CONTROL_PACKET):
                        with daemon.log.limiting(limited):
                            reply = self.receive(packet, uid, route)
                        failed, ticket = self.failed, self.deferred  # (others' commands run while this waits)
                        if ticket is not None:  # the answer comes later (a terminate_client waits for its client)
                            try:
                                reply = await self._answers[ticket].wait()
                            finally:
                                del self._answers[ticket]
                        if self.quitting:
                            await daemon.wait_stopped()  # the daemon is on its way out: the tool sees it go
                            return
                        for part in control_packets(reply, failed=failed):
                            await sock.send(part)
            except OSError:
                pass  # the control client went away
            with daemon.log.limiting(limited):
                daemon.log.control("UI closed")
            self.after_command()
