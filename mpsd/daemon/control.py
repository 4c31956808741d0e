# The nvidia-cuda-mps-control command language (v2), as an interpreter without I/O: a line (bytes) and the
# control plane's state (mpsd.daemon.control_state) in, the tool's output (often nothing) and the actions the
# daemon is to take out, each command and its outcome among them as control.log's lines. Settings change what
# clients created afterwards get, as in MPS; running clients keep their quotas. The socket that carries the
# lines, and what the actions do, are the daemon's (mpsd.daemon.control_plane); so a test replays a recording
# of the real tool on a ControlState of its own, in-process (tests/test_control_corpus.py).
#
# The commands live where what they hold does: servers and clients here (mpsd.daemon.control_servers starts and
# stops servers for both languages), defaults, limits and mpsd's extensions in control_settings, -S's
# partitions in control_partitions; a server's PID is the daemon's own, or its server process's (--mps-names).
#
# MPS's own commands answer as nvidia-cuda-mps-control does, byte for byte (bench/fidelity/mps_control_h200
# holds what an H200's printed): its texts, its C parsing (mpsd.daemon.control_text: a pid or a priority is
# atoi's, so "abc" is 0 and "1.0" is 1; a percentage is strtod's, "50abc" is 50; a memory limit is strtoull's
# number in MiB, or GiB when a G follows, and 0 means none), extra words ignored, and control.log's lines: each
# command, then what it logs, then its answer line by line. mpsd's extensions (MPS has no such commands) keep
# their strict parsing (mpsd_protocol's parse_integer and parse_decimal), so no line any user sends can raise
# anything but a CommandError there; the daemon still answers any other exception with an error line, as the
# last line of defence.
#
# A daemon started with protocol 3 (mpsd --protocol 3, nvidia-cuda-mps-control -p 3) also takes MPS v3's
# module-verb commands (mpsd.daemon.control_v3); protocol 2, the default, is exactly the legacy language.
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from mpsd.daemon.control_partitions import PartitionCommands
from mpsd.daemon.control_servers import Commands, Servers
from mpsd.daemon.control_settings import SettingsCommands
from mpsd.daemon.control_state import Action, ControlState, Defer, Out, Stop, Terminate
from mpsd.daemon.control_text import (
    ATOI,
    PS_HEADER,
    READ_ONLY,
    WORDS,
    CommandError,
    atoi,
    device_table,
    pci_id,
    ps_row,
)

if TYPE_CHECKING:
    from mpsd.daemon.routes import Route


@dataclass
class Outcome:
    """What one step of the control plane came to: the tool's output, the actions, and (v3) whether the
    command failed (the tool then exits 1)."""

    reply: bytes = b""
    actions: list[Action] = field(default_factory=list)
    failed: bool = False

    @property
    def text(self) -> str:
        return self.reply.decode(errors="surrogateescape")


def answer_lines(reply: str) -> list[str]:
    """control.log's lines for an answer: one per line, none for nothing."""
    if not reply:
        return []
    return reply.split("\n")[:-1] if reply.endswith("\n") else reply.split("\n")


class Control(Commands):
    """The v2 language (and v3's, where the daemon speaks protocol 3) over one ControlState."""

    def __init__(self, state: ControlState) -> None:
        super().__init__(state, Servers(state, Out()))
        self.caller = 0  # the uid of the command being run
        self.now = 0.0  # the daemon's clock when it began
        self.entries: list[str] | None = None  # control.log's lines for a command, where not its answer's
        self.route: Route | None = None  # the routed control socket the command being run came by
        self.settings = SettingsCommands(self)
        self.partitions = PartitionCommands(self)
        self._commands: dict[str, Callable[[list[str]], str]] = {
            name[4:]: getattr(part, name) for part in (self, self.settings, self.partitions)
            for name in dir(part) if name.startswith("cmd_")
        }
        from mpsd.daemon.control_v3 import MODULES, V3  # it builds on this module's helpers

        self._v3 = V3(self) if state.protocol == 3 else None
        self._v3_modules = MODULES

    def receive(self, packet: bytes, uid: int, now: float, route: Route | None = None) -> Outcome:
        """One control packet from a client of uid `uid` (by the routed control socket `route`, MPS v3's
        $PIPE/<server>[/<namespace>]/control, if it came by one), at the daemon's time `now`. As MPS reads a
        command as a C string, it ends at a NUL; bytes that are not UTF-8 are kept as they came."""
        return self.execute(packet.split(b"\0", 1)[0].decode(errors="surrogateescape"), uid, now, route)

    def execute(self, line: str, uid: int, now: float, route: Route | None = None) -> Outcome:
        """Run one command line (receive's, decoded)."""
        out = self.out
        self.servers.after_command()
        out.control(f"Cmd:{line}")
        words = WORDS.findall(line)  # C's whitespace only: a Unicode space is part of a word
        name, args = (words[0], words[1:]) if words else ("", [])
        command = self._commands.get(name)
        if name in ("sm_partition", "lspart") and self.state.partitions is None:
            command = None  # as the H200's tool (driver 580, no -S) answered them: unknown commands
        failed = False
        self.caller, self.now, self.servers.in_command, self.route = uid, now, True, route
        try:
            if self._v3 is not None and name in self._v3_modules:  # MPS v3's module-verb commands
                reply, failed = self._v3.run(name, args, uid)
            elif command is None:
                reply = f'Unknown command "{name}"'
            elif name not in READ_ONLY and uid not in (0, self.state.owner_uid):
                out.control(f"User {uid} is not allowed to run {name}")
                reply = f"Permission denied: {name} needs root or the daemon's owner"
            else:
                try:
                    reply = command(args)
                except CommandError as exc:
                    reply = str(exc)
        finally:
            self.servers.in_command, self.route = False, None
        entries, self.entries = self.entries, None
        if entries is not None:  # a command whose log lines are not its answer's lines
            for text in entries:
                out.control(text, verbatim=True)
        else:
            for text in answer_lines(reply):
                out.control(text)
        return Outcome(reply.encode(errors="surrogateescape"), out.take(), failed)

    # -- what the daemon tells the control plane ------------------------------------------------------------
    def after_command(self) -> list[Action]:
        """The command's connection is done: what MPS logs once the command that caused it was answered."""
        self.servers.after_command()
        return self.out.take()

    def retry_due(self, now: float) -> list[Action]:
        """The scheduled retry of the shutdown in progress (state.next_retry) fell due."""
        self.servers.try_shutdown(False, now, backoff=True)
        return self.out.take()

    def client_arrived(self, ctx: object) -> list[Action]:
        """A context connected (the daemon has attached it)."""
        self.servers.client_arrived(ctx)
        return self.out.take()

    def client_leaving(self, ctx: object) -> list[Action]:
        """A context's teardown begins."""
        self.servers.client_leaving(ctx)
        return self.out.take()

    def client_left(self, ctx: object) -> list[Action]:
        """A context is gone (the daemon has forgotten it)."""
        self.servers.client_left(ctx)
        return self.out.take()

    def client_waiting(self, pid: int, uid: int) -> list[Action]:
        """A client of another user than the server's waits its turn."""
        self.servers.client_waiting(pid, uid)
        return self.out.take()

    def server_died(self, pid: int, status: int) -> list[Action]:
        """The server's process (--mps-names) ended by itself."""
        self.servers.server_died(pid, status)
        return self.out.take()

    # -- servers and clients ---------------------------------------------------------------------------
    def cmd_get_server_list(self, args: list[str]) -> str:
        return str(self.state.server.pid) if self.state.server.started else ""

    def cmd_get_server_status(self, args: list[str]) -> str:
        if atoi(args[0] if args else None) == 0:
            return "A server PID is required"
        self.server_pid(args[0])
        return "FAULT" if any(device.faulted for device in self.state.devices) else "ACTIVE"

    def cmd_start_server(self, args: list[str]) -> str:
        required = "A user id (UID) is required to start a new server"
        if len(args) < 2:
            return required
        if args[0] != "-uid":
            return "Invalid start_server cmd. Expected cmd: start_server -uid <user id>"
        match = ATOI.match(args[1])
        if not match:
            return required
        uid = atoi(match.group(1))
        server = self.state.server
        if server.started and (server.uid is None or server.uid == uid):
            return ""
        if server.started:
            if self.state.contexts():
                return ""  # it waits its turn, as a client of that user would
            self.servers.note(f"Try shutting down server {server.pid}, backoff is disabled")
            self.servers.exit()
        if not 0 <= uid < (1 << 32) - 1:  # what setuid refuses

            def failed() -> None:
                self.out.control(f"Starting new server {server.pid} for user {uid}", pid=server.pid)
                self.out.control(f"Failed to start server using uid {uid}, error: Invalid argument",
                                 pid=server.pid)
                self.servers.note(f"Server {server.pid} exited with status 1")

            self.servers.later.append(failed)
            return ""
        self.servers.later.append(self.servers.start(uid))
        return ""

    def cmd_shutdown_server(self, args: list[str]) -> str:
        self.server_pid(args[0] if args else None)
        self.servers.try_shutdown(args[1:2] == ["-f"], self.now)
        return ""

    def cmd_get_client_list(self, args: list[str]) -> str:
        self.server_pid(args[0] if args else None)
        return "\n".join(str(pid) for pid in self.state.processes_of_server())

    def cmd_get_device_client_list(self, args: list[str]) -> str:
        if args:
            self.server_pid(args[0])
        lines = []
        for device in self.state.devices:
            contexts = [ctx for ctx in self.state.contexts() if ctx.device is device]
            if contexts:
                _, bus, slot, function = pci_id(device.properties)
                lines.append(f"[{device.index}] {bus:02x}:{slot:02x}.{function:x}, {device.name}")
                for pid, mine in self.state.processes_of_server().items():
                    lines.extend(f"{pid}.{n}" for n, ctx in enumerate(mine, 1) if ctx.device is device)
        return "\n".join(lines)

    def cmd_terminate_client(self, args: list[str]) -> str:
        server = atoi(args[0] if args else None)
        if server != self.state.server.pid or not self.state.server.started:
            return f"Server {server} not found\nServer {server} not found!\n1"
        pid = atoi(args[1] if len(args) > 1 else None)
        state = self.state
        victims = state.processes_of_server().get(pid, [])
        if not victims:
            return f"Invalid process {pid}!\n1"
        waiting = []
        for n, ctx in enumerate(victims, 1):
            self.out.server(f"MPS server requesting client {{PID: {pid}, Context ID: {n}}} to exit")
            if ctx.id in state.terminated:  # it was told to exit already: MPS waits until it has
                waiting.append(ctx)
                continue
            self.out.do(Terminate(ctx, "terminate_client"))
            state.terminated.add(ctx.id)
            self.out.server("Client termination succeeded.")
        if not waiting:
            return "0"
        state.tickets += 1
        for ctx in waiting:
            state.awaiting[ctx.id] = state.tickets
        self.out.do(Defer(state.tickets))  # the answer, 0, comes as they go (Servers.client_leaving)
        return ""

    def cmd_ps(self, args: list[str]) -> str:
        if args[:1] == ["-p"]:
            pid = atoi(args[1] if len(args) > 1 else None)
            if pid != self.state.server.pid or not self.state.server.started:
                return f"Server {pid} not found\nServer {pid} not found\n"
        if not self.state.server.started:
            return "Server not found"
        everyone = self.caller in (0, self.state.owner_uid)  # others see their own processes only
        server, processes = self.state.server, self.state.processes
        rows = [ps_row(pid, server.ids.get(pid, "-"), server.pid, mine[0].device.properties["uuid"],
                       processes.namespace(pid), processes.command(pid))
                for pid, mine in self.state.processes_of_server().items() if everyone or mine[0].uid == self.caller]
        return "\n".join([PS_HEADER] + rows) if rows else ""

    def cmd_device_query(self, args: list[str]) -> str:
        csv = "--csv" in args
        named = [arg for arg in args if arg != "--csv"]
        if named:
            self.server_pid(named[0])
        devices = [(d.index, "{:04x}:{:02x}.{:02x}.{:02x}".format(*pci_id(d.properties)), d.properties["uuid"],
                    d.name) for d in self.state.devices]
        entries = ["Default", *device_table(devices, csv)]
        if self.state.server.started:  # MPS logs the server's part as one message that begins with a newline
            entries += [f"\nServer {self.state.server.pid}", *device_table(devices, csv)]
            self.out.server(f"Received device query command. There are {len(devices)} devices")
        self.entries = entries
        return "\n".join(entries)

    # -- shutting down: MPS's retries with backoff --------------------------------------------------------
    def cmd_quit(self, args: list[str]) -> str:
        """quit [-t N]: the server is shut down as shutdown_server does it (after N seconds by force), then the
        daemon exits. The tool that sent it gets no answer: its connection closes when the daemon is gone."""
        if args[:1] == ["-t"] and ATOI.match(args[1] if len(args) > 1 else ""):  # else a plain quit
            timeout = atoi(args[1])
            self.servers.note(f"quit command issued with timeout of {timeout}")
            self.state.force_at = self.now + max(timeout, 0)
        self.state.quitting = True
        if self.state.server.started:
            self.servers.try_shutdown(False, self.now)
            self.servers.after_command()  # no answer comes, nor "UI closed": what it caused is logged now
        else:
            self.out.do(Stop())
        return ""

