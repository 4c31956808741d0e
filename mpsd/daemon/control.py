# The nvidia-cuda-mps-control command language, over the daemon's state. One line in, the tool's output out
# (often nothing), with each command and its outcome in control.log. Settings change what clients created
# afterwards get, as in MPS; running clients keep their quotas. The socket that carries the lines lives in
# the server module; this one holds only the language.
#
# Servers as MPS runs them: one logical server at a time, started on demand for the user of its first client,
# serving only that user's clients; a client of another user waits (pending) until the server's last client
# has gone and the server has exited, then a server for the next user starts. With --multiuser one server
# serves every user. A server's PID is the daemon's own (the daemon plays every server in turn).
#
# mpsd's extensions to the language (MPS has no such commands) set, per client pid or per user, a finer
# priority level (for the priority policy) and a fair-share weight (for the fair policy). Unlike MPS's
# settings they reach running clients too, from their next block on, since the scheduler can re-read them
# at any time; a tester can re-prioritise a job mid-run.
#
# MPS's own commands answer as nvidia-cuda-mps-control does, byte for byte (bench/fidelity/mps_control_h200
# holds what an H200's printed): its texts, its C parsing (a pid or a priority is atoi's, so "abc" is 0 and
# "1.0" is 1; a percentage is strtod's, "50abc" is 50; a memory limit is strtoull's number in MiB, or GiB when
# a G follows, and 0 means none), extra words ignored, and control.log's lines: each command, then what it
# logs, then its answer line by line. The mpsd extensions keep their strict parsing (mpsd_protocol's
# parse_integer and parse_decimal), so no line any user sends can raise anything but a CommandError there; the
# server still answers any other exception with an error line, as the last line of defence.
#
# A daemon started with protocol 3 (mpsd --protocol 3, nvidia-cuda-mps-control -p 3) also takes MPS v3's
# module-verb commands (mpsd.daemon.control_v3); protocol 2, the default, is exactly the legacy language.
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from mpsd.daemon.namespaces import DEFAULT, Namespace, cgroup_of
from mpsd.daemon.sm_partitions import PartitionError
from mpsd.runtime.device import COMPUTE_MODES
from mpsd_protocol import parse_decimal, parse_integer

if TYPE_CHECKING:
    from mpsd.daemon.routes import Route
    from mpsd.daemon.server import Daemon

# Commands any user may send; the rest change state and need root or the daemon's owner.
READ_ONLY = frozenset({
    "mpsd_status",
    "get_server_list", "get_server_status", "get_client_list", "get_device_client_list", "ps", "device_query",
    "get_default_active_thread_percentage", "get_active_thread_percentage", "get_default_device_pinned_mem_limit",
    "get_device_pinned_mem_limit", "get_default_client_priority", "get_client_priority", "get_client_weight",
    "lspart",
})
MAX_LEVEL = 1 << 31  # priority levels are plain integers, kept to a sane range


class CommandError(Exception):
    """A command's arguments are wrong: the message is printed, as the real tool prints its complaints."""


@dataclass
class Settings:
    """What new clients get: the daemon's options, changed at run time by control commands."""

    active_thread_percentage: float
    pinned_mem_limits: dict[int, int] = field(default_factory=dict)  # device -> bytes; absent: none
    client_priority: int = 0
    # mpsd extensions, keyed by ("pid", n) or ("uid", n), and ("client", id) for one context (set by a program
    # that plays many clients in one process, as mpsd-stress --virtual-time does); the narrower key wins.
    priorities: dict[tuple[str, int], int] = field(default_factory=dict)
    weights: dict[tuple[str, int], float] = field(default_factory=dict)

    def priority_for(self, pid: int, uid: int, client: int | None = None) -> int:
        """The daemon-side priority level of client `client` of `pid` and `uid`."""
        return _narrowest(self.priorities, pid, uid, client, self.client_priority)

    def weight_for(self, pid: int, uid: int, client: int | None = None) -> float:
        """The fair-share weight of client `client` of `pid` and `uid`."""
        return _narrowest(self.weights, pid, uid, client, 1.0)


def _narrowest(settings: dict[tuple[str, int], Any], pid: int, uid: int, client: int | None, default: Any) -> Any:
    for key in (("client", client), ("pid", pid), ("uid", uid)):
        if key in settings:
            return settings[key]
    return default


@dataclass
class Server:
    """The logical MPS server: its own overrides of the defaults, for its clients created afterwards."""

    pid: int
    uid: int | None = None  # the user it serves (None: every user, --multiuser)
    name: str | None = None  # the named server (MPS v3's -a file) it is, if one is for its user
    active_thread_percentage: float | None = None
    pinned_mem_limits: dict[int, int] = field(default_factory=dict)
    started: bool = False
    shutting_down: bool = False
    clients_seen: int = 0  # client processes this server has had: ps's ID column
    ids: dict[int, int] = field(default_factory=dict)  # client pid -> its ID


def _integer(text: str, complaint: str, *, signed: bool = False) -> int:
    """`text` as parse_integer reads it, or a CommandError saying `complaint`."""
    try:
        return parse_integer(text, signed=signed)
    except ValueError:
        raise CommandError(complaint) from None


def _target(text: str) -> tuple[str, int]:
    """A client pid (``1234``) or a user (``uid:1000``), as the extension commands name whom they set."""
    kind, _, number = text.rpartition(":")
    complaint = f"Invalid client {_brief(text)!r}: a pid, or uid:<uid>"
    if kind not in ("", "uid"):
        raise CommandError(complaint)
    return ("uid" if kind else "pid", _integer(number, complaint))


def _level(text: str) -> int:
    value = _integer(text, f"Invalid client priority {_brief(text)!r}", signed=True)
    if abs(value) >= MAX_LEVEL:
        raise CommandError(f"Invalid client priority {_brief(text)!r}")
    return value


def _weight(text: str) -> float:
    complaint = f"Invalid client weight {_brief(text)!r}"
    try:
        value = parse_decimal(text)
    except ValueError:
        raise CommandError(complaint) from None
    if not 0 < value < float("inf"):
        raise CommandError(complaint)
    return value



def _brief(text: str) -> str:
    """An argument as a complaint quotes it: whole, unless it is long."""
    return text if len(text) <= 24 else text[:20] + "..."


_WORDS = re.compile(r"[^ \t\n\r\v\f]+")
_ATOI = re.compile(r"[ \t]*([+-]?[0-9]+)")
_STRTOD = re.compile(r"[ \t]*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf(?:inity)?|nan))",
                     re.IGNORECASE)
GiB, MiB = 1 << 30, 1 << 20
U64 = (1 << 64) - 1
MPS_VERSION = 13000  # what the H200's control daemon and server call their binary version
DRIVER_VERSION = 580


def _digits(text: str, most: int) -> int:
    """Decimal digits as a number no larger than `most` (past 20 digits it is larger whatever they are; Python
    would not even convert a few thousand)."""
    return most if len(text.lstrip("0")) > 20 else min(int(text), most)


def atoi(text: str | None) -> int:
    """C's atoi, as MPS reads pids and priorities: the leading number, 0 where there is none."""
    match = _ATOI.match(text or "")
    if not match:
        return 0
    number = match.group(1)
    value = _digits(number.lstrip("+-"), 1 << 63)
    return -value if number.startswith("-") else min(value, (1 << 63) - 1)


def strtod(text: str | None) -> float | None:
    """C's strtod on the leading number, None where there is none (MPS then says the value is invalid)."""
    match = _STRTOD.match(text or "")
    return float(match.group(1)) if match else None


def memory_limit(text: str) -> int:
    """A pinned memory limit as MPS reads one: strtoull's number (a minus wraps, too many digits saturate)
    in MiB, or in GiB when the next character is G or g; anything else after it is ignored. 0: no limit."""
    match = _ATOI.match(text)
    if not match:
        return 0
    number, rest = match.group(1), text[match.end():]
    value = _digits(number.lstrip("+-"), U64)
    if number.startswith("-"):
        value = -value & U64
    return (value * (GiB if rest[:1] in ("G", "g") else MiB)) & U64


def limit_text(nbytes: int) -> str:
    """A limit as MPS prints it: whole GiB from 1 GiB up, else whole MiB."""
    return f"{nbytes >> 30}G" if nbytes >= GiB else f"{nbytes >> 20}M"


def ps_row(pid: object, client_id: object, server: object, device: object, namespace: object, command: object) -> str:
    """One row of ps (the header too) in MPS's columns, each padded, none cut but the device: its UUID's first
    22 characters."""
    return f"{pid!s:<10}{client_id!s:<10}{server!s:<15}{str(device)[:22]:<26}{namespace!s:<15}{command!s:<15}"


PS_HEADER = ps_row("PID", "ID", "SERVER", "DEVICE", "NAMESPACE", "COMMAND")


def device_table(devices: list[tuple[int, str, str, str]], csv: bool) -> list[str]:
    """device_query's table of (ordinal, PCI id, UUID, name), as MPS prints it."""
    header = ("Device Ordinal", "PCI IDs", "UUID", "Name", "Attributes")
    rows = [header] + [(str(ordinal), pci, uuid, name, "N/A") for ordinal, pci, uuid, name in devices]
    if csv:
        return [",".join(row) for row in rows]
    return [f"{a:<16}{b:<15}{c:<42}{d:<34}{e}" for a, b, c, d, e in rows]


def pci_id(properties: dict) -> tuple[int, int, int, int]:
    """(domain, bus, device, function) of a device: its own where the backend gives a PCI bus id, else the
    simulator's, one bus per device."""
    text = str(properties.get("pci_bus_id", ""))
    match = re.fullmatch(r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F])", text)
    if match:
        domain, bus, device, function = (int(part, 16) for part in match.groups())
        return domain, bus, device, function
    return 0, int(properties.get("index", 0)), 0, 0


class Control:
    """Executes control commands against a daemon."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.server = Server(daemon.log.pid)
        self._caller = 0  # the uid of the command being run
        self._commands: dict[str, Callable[[list[str]], str]] = {
            name[4:]: getattr(self, name) for name in dir(self) if name.startswith("cmd_")
        }
        self._retry_at: float | None = None  # when the shutdown in progress tries again (trio time)
        self._backoff = daemon.config.shutdown_retry  # MPS tries again after 200 ms, then 400, 800...
        self._force_at: float | None = None  # quit -t: when the server is shut down whatever its clients
        self._quitting = False
        self._entries: list[str] | None = None  # control.log's lines for a command, where not its answer's
        self._later: list[Callable[[], None]] = []  # lines to log once the command's connection is done
        self._in_command = False
        self.orphans: set[int] = set()  # contexts of a server shut down with -f: no server's clients any more
        self.failed = False  # whether the last command failed (MPS v3's commands only: the tool exits 1)
        from mpsd.daemon.control_v3 import MODULES, V3  # it builds on this module's helpers

        self._v3 = V3(self) if daemon.config.protocol == 3 else None
        self.named = {named.uid: named for named in daemon.config.servers}  # MPS v3's named servers, by user
        # MPS v3's namespaces, by the server they subdivide (its user: server_key), in the order they were made;
        # copies of the -a file's, which namespace set changes.
        self.namespaces: dict[int | None, dict[str, Namespace]] = {}
        for named in daemon.config.servers:
            self.namespaces[self.server_key(named.uid)] = {ns.name: dataclasses.replace(ns) for ns in named.namespaces}
        self.route: Route | None = None  # the routed control socket the command being run came by
        self._v3_modules = MODULES

    @property
    def quitting(self) -> bool:
        return self._quitting

    def execute(self, line: str, uid: int, route: Route | None = None) -> str:
        """Run one command line from a client of uid `uid` (by the routed control socket `route`, MPS v3's
        $PIPE/<server>[/<namespace>]/control, if it came by one); returns what the tool prints (maybe nothing)."""
        log = self.daemon.log
        self.after_command()
        log.control(f"Cmd:{line}")
        words = _WORDS.findall(line)  # C's whitespace only: a Unicode space is part of a word
        name, args = (words[0], words[1:]) if words else ("", [])
        command = self._commands.get(name)
        if name in ("sm_partition", "lspart") and self.daemon.sm_partitions is None:
            command = None  # as the H200's tool (driver 580, no -S) answered them: unknown commands
        self.failed = False
        if self._v3 is not None and name in self._v3_modules:  # MPS v3's module-verb commands
            self._caller, self._in_command, self.route = uid, True, route
            try:
                reply, self.failed = self._v3.run(name, args, uid)
            finally:
                self._in_command, self.route = False, None
        elif command is None:
            reply = f'Unknown command "{name}"'
        elif name not in READ_ONLY and uid not in (0, self.daemon.owner_uid):
            log.control(f"User {uid} is not allowed to run {name}")
            reply = f"Permission denied: {name} needs root or the daemon's owner"
        else:
            self._caller, self._in_command = uid, True
            try:
                reply = command(args)
            except CommandError as exc:
                reply = str(exc)
            finally:
                self._in_command = False
        entries, self._entries = self._entries, None
        if entries is not None:  # a command whose log lines are not its answer's lines
            for text in entries:
                log.control(text, verbatim=True)
        else:
            for text in reply.split("\n")[:-1] if reply.endswith("\n") else reply.split("\n") if reply else ():
                log.control(text)
        return reply

    def after_command(self) -> None:
        """What MPS logs once the command that caused it has been answered: a server's start comes from the
        server's own process, after the tool has had its answer."""
        later, self._later = self._later, []
        for write in later:
            write()

    # -- helpers ---------------------------------------------------------------------------------------
    def _note(self, text: str) -> None:
        """A control.log line that is no part of the answer."""
        self.daemon.log.control(text)

    def _server_pid(self, text: str | None) -> Server:
        pid = atoi(text)
        if pid != self.server.pid or not self.server.started:
            raise CommandError(f"Server {pid} not found")
        return self.server

    @staticmethod
    def _args(args: list[str], count: int, usage: str) -> list[str]:
        if len(args) != count:
            raise CommandError(f"Usage: {usage}")
        return args

    def _device(self, text: str) -> int | None:
        """A device as MPS reads one for a limit: decimal digits (a device it has not is fine), else None."""
        if not text.isascii() or not text.isdigit():
            self._note(f"Invalid device identifier format: {text}")
            return None
        return _digits(text, U64)

    def _contexts(self):
        return [ctx for device in self.daemon.devices for ctx in device.contexts.values()
                if ctx.id not in self.orphans]

    def _processes(self) -> dict[int, list]:
        """The server's client processes (pid -> its contexts), in the order they came."""
        processes: dict[int, list] = {}
        for ctx in sorted(self._contexts(), key=lambda c: c.id):
            processes.setdefault(ctx.pid, []).append(ctx)
        return processes

    def _workers(self) -> int:
        """What MPS counts as a server's active worker threads: one per client process and one per context."""
        return sum(1 + len(contexts) for contexts in self._processes().values())

    # -- servers and clients ---------------------------------------------------------------------------
    def cmd_get_server_list(self, args: list[str]) -> str:
        return str(self.server.pid) if self.server.started else ""

    def cmd_get_server_status(self, args: list[str]) -> str:
        if atoi(args[0] if args else None) == 0:
            return "A server PID is required"
        self._server_pid(args[0])
        return "FAULT" if any(device.faulted for device in self.daemon.devices) else "ACTIVE"

    def cmd_start_server(self, args: list[str]) -> str:
        required = "A user id (UID) is required to start a new server"
        if len(args) < 2:
            return required
        if args[0] != "-uid":
            return "Invalid start_server cmd. Expected cmd: start_server -uid <user id>"
        match = _ATOI.match(args[1])
        if not match:
            return required
        uid = atoi(match.group(1))
        server = self.server
        if server.started and (server.uid is None or server.uid == uid):
            return ""
        if server.started:
            if self._contexts():
                return ""  # it waits its turn, as a client of that user would
            self._note(f"Try shutting down server {server.pid}, backoff is disabled")
            self._exit_server()
        if not 0 <= uid < (1 << 32) - 1:  # what setuid refuses

            def failed() -> None:
                self.daemon.log.control(f"Starting new server {server.pid} for user {uid}", pid=server.pid)
                self.daemon.log.control(f"Failed to start server using uid {uid}, error: Invalid argument",
                                        pid=server.pid)
                self._note(f"Server {server.pid} exited with status 1")

            self._later.append(failed)
            return ""
        self._later.append(self._start_server(uid))
        return ""

    def _start_server(self, uid: int) -> Callable[[], None]:
        """The server comes up for `uid`, with the defaults as they are now; returns what logs its start as
        MPS's does."""
        server, settings = self.server, self.daemon.settings
        server.started, server.shutting_down = True, False
        server.uid = None if self.daemon.config.multiuser else uid
        server.active_thread_percentage = settings.active_thread_percentage
        server.pinned_mem_limits = dict(settings.pinned_mem_limits)
        named = None if server.uid is None else self.named.get(uid)
        server.name = None if named is None else named.name
        if named is not None:  # MPS v3's named server for this user: its settings beat the defaults
            if named.active_thread_percentage is not None:
                server.active_thread_percentage = named.active_thread_percentage
            if named.pinned_memory_limit is not None:
                for device in self.daemon.devices:
                    if self.refused_by(uid, device) is None:
                        server.pinned_mem_limits[device.index] = named.pinned_memory_limit
        server.clients_seen, server.ids = 0, {}
        self._retry_at = self._force_at = None
        server.pid = self.daemon.start_server_process(server.uid)
        return lambda: self._log_start(uid)

    def _log_start(self, uid: int) -> None:
        server, log, settings = self.server, self.daemon.log, self.daemon.settings
        log.control(f"Starting new server {server.pid} for user {uid}", pid=server.pid)
        log.control("Accepting connection...")
        for text in ("Startup", f"Connecting to control daemon on socket: {self.daemon.config.pipe_dir / 'control'}",
                     "Initializing server process"):
            log.server(text, source="Other")
        first = self.daemon.devices[0]
        log.server(f"Creating server context on device 0 ({first.name})")
        log.server(f"Created anonymous shared memory region mps.shm.0.{server.pid}")
        log.server(f"CUDA MPS Server for Linux/Unix. Binary version: {MPS_VERSION}")
        log.server(f"Display Driver version: {DRIVER_VERSION}")
        log.server(f"Active Threads Percentage set to {server.active_thread_percentage:.1f}")
        for device, limit in sorted(server.pinned_mem_limits.items(), reverse=True):
            log.server(f"Device pinned memory limit for device {device} set to {limit:#x} bytes")
        named = self.named.get(uid) if server.name is not None else None
        priority = named.client_priority if named is not None and named.client_priority is not None else None
        log.server(f"Server Priority set to {settings.client_priority if priority is None else priority}")
        log.server("Server has started")
        self._note(f"NEW SERVER {server.pid}: Ready")

    def cmd_shutdown_server(self, args: list[str]) -> str:
        self._server_pid(args[0] if args else None)
        self.try_shutdown(force=args[1:2] == ["-f"])
        return ""

    def cmd_get_client_list(self, args: list[str]) -> str:
        self._server_pid(args[0] if args else None)
        return "\n".join(str(pid) for pid in self._processes())

    def cmd_get_device_client_list(self, args: list[str]) -> str:
        if args:
            self._server_pid(args[0])
        lines = []
        for device in self.daemon.devices:
            contexts = [ctx for ctx in device.contexts.values() if ctx.id not in self.orphans]
            if contexts:
                _, bus, slot, function = pci_id(device.properties)
                lines.append(f"[{device.index}] {bus:02x}:{slot:02x}.{function:x}, {device.name}")
                for pid, mine in self._processes().items():
                    lines.extend(f"{pid}.{n}" for n, ctx in enumerate(mine, 1) if ctx.device is device)
        return "\n".join(lines)

    def cmd_terminate_client(self, args: list[str]) -> str:
        server = atoi(args[0] if args else None)
        if server != self.server.pid or not self.server.started:
            return f"Server {server} not found\nServer {server} not found!\n1"
        pid = atoi(args[1] if len(args) > 1 else None)
        victims = self._processes().get(pid, [])
        if not victims:
            return f"Invalid process {pid}!\n1"
        for n, ctx in enumerate(victims, 1):
            self.daemon.log.server(f"MPS server requesting client {{PID: {pid}, Context ID: {n}}} to exit")
            self.daemon.terminate(ctx, "terminate_client")
            self.daemon.log.server("Client termination succeeded.")
        return "0"

    def cmd_ps(self, args: list[str]) -> str:
        if args[:1] == ["-p"]:
            pid = atoi(args[1] if len(args) > 1 else None)
            if pid != self.server.pid or not self.server.started:
                return f"Server {pid} not found\nServer {pid} not found\n"
        if not self.server.started:
            return "Server not found"
        everyone = self._caller in (0, self.daemon.owner_uid)  # others see their own processes only
        rows = [ps_row(pid, self.server.ids.get(pid, "-"), self.server.pid, mine[0].device.properties["uuid"],
                       _namespace(pid), _command(pid))
                for pid, mine in self._processes().items() if everyone or mine[0].uid == self._caller]
        return "\n".join([PS_HEADER] + rows) if rows else ""

    # -- static SM partitioning (-S; mpsd.daemon.sm_partitions has the texts' sources and guesses) ---------
    def _partitions(self) -> Any:
        assert self.daemon.sm_partitions is not None  # execute answers these commands only under -S
        return self.daemon.sm_partitions

    def cmd_sm_partition(self, args: list[str]) -> str:
        usage = "Usage: sm_partition add <device> <chunks> | sm_partition rm <partition id>"
        verb = args[0] if args else None
        if verb == "add" and len(args) >= 3:
            devices = self.daemon.devices
            device = next((d.index for d in devices if args[1] in (str(d.index), d.properties["uuid"])), None)
            if device is None:  # an index or a GPU UUID, of a device the daemon has
                raise CommandError(f'Invalid device "{_brief(args[1])}"')
            chunks = _integer(args[2], f'Invalid number of chunks "{_brief(args[2])}"')
            try:
                return self.add_sm_partition(device, chunks).id
            except PartitionError as exc:
                raise CommandError(str(exc)) from None
        if verb == "rm" and len(args) >= 2:
            try:
                self.remove_sm_partition(args[1])
            except PartitionError as exc:
                raise CommandError(str(exc)) from None
            return ""
        raise CommandError(usage)

    # The legacy commands and v3's `partition` module share these: one set of partitions, one set of rules.
    def add_sm_partition(self, device: int, chunks: int, **options: Any) -> Any:
        """Make a partition (SmPartitions.add's `options`) and say so in control.log.

        Raises:
            PartitionError: it cannot be made.
        """
        partition = self._partitions().add(device, chunks, **options)
        self._note(f"SM partition {partition.id} added on device {device}: chunks {partition.first_chunk}-"
                   f"{partition.first_chunk + partition.chunks - 1}, SMs {partition.first_sm}-"
                   f"{partition.first_sm + partition.sm_count - 1}")
        return partition

    def remove_sm_partition(self, key: str) -> Any:
        """Remove the partition whose id or name is `key`, unless clients run in it.

        Raises:
            PartitionError: no such partition, or it has clients.
        """
        found = self._partitions().find(key)
        users = self.sm_partition_clients(found) if found is not None else 0
        if users:
            raise PartitionError(f"Partition {found.id} has {users} client(s)")
        # mpsd's guess: a namespace's devices table that puts its clients in it keeps it.
        holders = [space.name for spaces in self.namespaces.values() for space in spaces.values()
                   if found is not None and found.name is not None
                   and any(device.sm_partition == found.name for device in space.devices)]
        if holders:
            raise PartitionError(f"Partition {found.id} is namespace {holders[0]}'s")
        return self._partitions().remove(key)

    def sm_partition_clients(self, partition: Any) -> int:
        return sum(1 for ctx in self._contexts() if ctx.sm_partition is partition)

    def cmd_lspart(self, args: list[str]) -> str:
        partitions = self._partitions()
        rows: list[tuple[object, ...]] = [
            (p.id, self.daemon.devices[p.device].properties["uuid"], p.chunks, p.sm_count, p.first_sm,
             self.sm_partition_clients(p))
            for p in partitions.partitions.values()]
        if not rows:
            return ""
        rows.insert(0, ("ID", "DEVICE", "CHUNKS", "SMS", "FIRST_SM", "CLIENTS"))
        return "\n".join(f"{pid!s:<8}{device!s:<44}{chunks!s:<8}{sms!s:<6}{first!s:<10}{users}"
                         for pid, device, chunks, sms, first, users in rows)

    def cmd_device_query(self, args: list[str]) -> str:
        csv = "--csv" in args
        named = [arg for arg in args if arg != "--csv"]
        if named:
            self._server_pid(named[0])
        devices = [(d.index, "{:04x}:{:02x}.{:02x}.{:02x}".format(*pci_id(d.properties)), d.properties["uuid"],
                    d.name) for d in self.daemon.devices]
        entries = ["Default", *device_table(devices, csv)]
        if self.server.started:  # MPS logs the server's part as one message that begins with a newline
            entries += [f"\nServer {self.server.pid}", *device_table(devices, csv)]
            self.daemon.log.server(f"Received device query command. There are {len(devices)} devices")
        self._entries = entries
        return "\n".join(entries)

    # -- settings --------------------------------------------------------------------------------------
    def _percentage(self, text: str | None) -> float | None:
        value = strtod(text)
        if value is None or not 0 < value <= 100:
            self._note("Invalid percentage, expected between (0.0, 100.0]")
            return None
        return value

    def cmd_get_default_active_thread_percentage(self, args: list[str]) -> str:
        return f"{self.daemon.settings.active_thread_percentage:.1f}"

    def cmd_set_default_active_thread_percentage(self, args: list[str]) -> str:
        value = self._percentage(args[0] if args else None)
        if value is not None:
            self.daemon.settings.active_thread_percentage = value
        return f"{self.daemon.settings.active_thread_percentage:.1f}"

    def cmd_get_active_thread_percentage(self, args: list[str]) -> str:
        self._server_pid(args[0] if args else None)
        return f"{self.percentage_for_new_client():.1f}"

    def cmd_set_active_thread_percentage(self, args: list[str]) -> str:
        server = self._server_pid(args[0] if args else None)
        value = self._percentage(args[1] if len(args) > 1 else None)
        if value is not None:
            server.active_thread_percentage = value
        return f"{self.percentage_for_new_client():.1f}"

    def cmd_get_default_device_pinned_mem_limit(self, args: list[str]) -> str:
        if not args:
            self._note("Invalid command format.")
            return ""
        device = self._device(args[0])
        if device is None:
            return ""
        limit = self.daemon.settings.pinned_mem_limits.get(device)
        if limit is None:
            self._note("No default pinned memory limit set for the device!")
            return ""
        return limit_text(limit)

    def cmd_set_default_device_pinned_mem_limit(self, args: list[str]) -> str:
        if len(args) < 2:
            self._note("Invalid command format.")
            return ""
        self._note(f"set_default_device_pinned_mem_limit {args[0]} {args[1]}.")
        device = self._device(args[0])
        if device is not None:
            _store(self.daemon.settings.pinned_mem_limits, device, memory_limit(args[1]))
        return ""

    def cmd_get_device_pinned_mem_limit(self, args: list[str]) -> str:
        if len(args) < 2:
            self._note("Invalid command format.")
            return ""
        server = self._server_pid(args[0])
        device = self._device(args[1])
        limit = None if device is None else server.pinned_mem_limits.get(device)
        return "" if limit is None else limit_text(limit)

    def cmd_set_device_pinned_mem_limit(self, args: list[str]) -> str:
        if len(args) < 3:
            self._note("Invalid command format.")
            return ""
        server = self._server_pid(args[0])
        device = self._device(args[1])
        if device is not None:
            limit = memory_limit(args[2])
            _store(server.pinned_mem_limits, device, limit)
            self.daemon.log.server(f"Device pinned memory limit for device {device} set to {limit:#x} bytes")
        return ""

    def cmd_get_default_client_priority(self, args: list[str]) -> str:
        return str(self.daemon.settings.client_priority)

    def cmd_set_default_client_priority(self, args: list[str]) -> str:
        if not args:
            return ""
        value = atoi(args[0])
        if value not in (0, 1):
            return "Invalid priority value - must be 0 or 1!"
        self.daemon.settings.client_priority = value
        return ""

    # -- mpsd extensions: finer priorities and fair-share weights, per client pid or per user ---------------
    def cmd_set_client_priority(self, args: list[str]) -> str:
        """Not MPS's: the priority level (lower is more urgent) of a pid's or a user's clients."""
        target, text = self._args(args, 2, "set_client_priority <PID|uid:UID> <level>")
        self.daemon.settings.priorities[_target(target)] = _level(text)
        self._reconfigure(_target(target))
        return ""

    def cmd_get_client_priority(self, args: list[str]) -> str:
        (target,) = self._args(args, 1, "get_client_priority <PID|uid:UID>")
        return str(self._resolve(_target(target), self.daemon.settings.priority_for))

    def cmd_set_client_weight(self, args: list[str]) -> str:
        """Not MPS's: the fair-share weight (> 0) of a pid's or a user's clients."""
        target, text = self._args(args, 2, "set_client_weight <PID|uid:UID> <weight>")
        self.daemon.settings.weights[_target(target)] = _weight(text)
        self._reconfigure(_target(target))
        return ""

    def cmd_get_client_weight(self, args: list[str]) -> str:
        (target,) = self._args(args, 1, "get_client_weight <PID|uid:UID>")
        return f"{self._resolve(_target(target), self.daemon.settings.weight_for):g}"

    def _resolve(self, target: tuple[str, int], setting: Callable[[int, int], Any]) -> Any:
        """A setting as a client of `target` gets it; for a pid, through its user's when it is connected."""
        kind, number = target
        if kind == "uid":
            return setting(-1, number)
        uid = next((ctx.uid for ctx in self._contexts() if ctx.pid == number), None)
        if uid is None:
            try:  # not connected (yet): the user of the process with that pid, if there is one
                uid = os.stat(f"/proc/{number}").st_uid
            except OSError:
                uid = -1
        return setting(number, uid)

    def _reconfigure(self, target: tuple[str, int]) -> None:
        """Give the connected clients of `target` their new level and weight."""
        kind, number = target
        for ctx in self._contexts():
            if (ctx.pid if kind == "pid" else ctx.uid) == number:
                self.daemon.reconfigure(ctx)

    def cmd_mpsd_status(self, args: list[str]) -> str:
        """Not MPS's: the state mpsd-smi shows, as JSON."""
        return json.dumps(self.daemon.status())

    def cmd_mpsd_trace(self, args: list[str]) -> str:
        """Not MPS's: write each traced device's timeline so far where --trace says, while the daemon runs (it
        pauses while a trace is drawn: about a second for a busy 2-s run); the files written."""
        self._args(args, 0, "mpsd_trace")
        if self.daemon.config.trace is None:
            raise CommandError("No trace: the daemon was started without --trace")
        return "\n".join(self.daemon.write_traces())

    def cmd_mpsd_compute_mode(self, args: list[str]) -> str:
        """Not MPS's: a device's compute mode, as nvidia-smi -c sets it (mpsd-smi -c sends this)."""
        usage = f"mpsd_compute_mode <device> <{'|'.join(COMPUTE_MODES)}>"
        device, mode = self._args(args, 2, usage)
        if mode not in COMPUTE_MODES:
            raise CommandError(f"Usage: {usage}")
        index = _digits(device, U64) if device.isascii() and device.isdigit() else len(self.daemon.devices)
        if index >= len(self.daemon.devices):
            raise CommandError(f"Invalid device {device}")
        self.daemon.devices[index].compute_mode = mode
        return ""

    # -- shutting down: MPS's retries with backoff --------------------------------------------------------
    def cmd_quit(self, args: list[str]) -> str:
        """quit [-t N]: the server is shut down as shutdown_server does it (after N seconds by force), then the
        daemon exits. The tool that sent it gets no answer: its connection closes when the daemon is gone."""
        if args[:1] == ["-t"] and _ATOI.match(args[1] if len(args) > 1 else ""):  # else a plain quit
            timeout = atoi(args[1])
            self._note(f"quit command issued with timeout of {timeout}")
            self._force_at = self.daemon.now() + max(timeout, 0)
        self._quitting = True
        if self.server.started:
            self.try_shutdown(force=False)
            self.after_command()  # no answer comes, nor "UI closed": what it caused is logged now
        else:
            self.daemon.stop()
        return ""

    def try_shutdown(self, force: bool, backoff: bool = False) -> None:
        """One try at shutting the server down; with clients it is refused, and tried again later (with -f, or
        once quit's timeout has passed, it goes anyway and its clients' calls fail)."""
        server, log = self.server, self.daemon.log
        if not server.started:
            return
        if self._force_at is not None and self.daemon.now() >= self._force_at:
            force, backoff = True, False
        self._note(f"Try shutting down server {server.pid}, backoff is {'enabled' if backoff else 'disabled'}")
        log.server("Server has been notified to shutdown")
        workers = self._workers()
        if workers:
            self._note(f"Server {server.pid} has {workers} active worker threads. Server will not shutdown.")
            log.server(f"Server was unable to shutdown due to {workers} active clients")
            if not force:
                if backoff or self._retry_at is None:
                    if self._retry_at is not None:
                        self._backoff *= 2
                    self._retry_at = self.daemon.now() + self._backoff
                    self.daemon.wake_control()
                self._note(f"Control will try shutting down server {server.pid} again in at most "
                           f"{round(self._backoff * 1000)}ms")
                server.shutting_down = True
                return
            self._note(f"Force shutting down server {server.pid}")
            for ctx in self._contexts():
                self.daemon.server_gone(ctx)
                self.orphans.add(ctx.id)
        else:
            log.server("Waiting for current clients to finish")
            log.server("Exiting")
        self._exit_server()
        if self._quitting:
            self.daemon.stop()

    def next_retry(self) -> float | None:
        """When (trio time) the shutdown in progress tries again, if one is."""
        if self._retry_at is None:
            return None
        return self._retry_at if self._force_at is None else min(self._retry_at, self._force_at)

    def retry_due(self) -> None:
        """The daemon's timer: the scheduled retry of the shutdown in progress."""
        self.try_shutdown(force=False, backoff=True)

    # -- MPS v3's namespaces ----------------------------------------------------------------------------
    def server_key(self, uid: int | None) -> int | None:
        """What a server's namespaces are kept by: the user it serves (None for --multiuser's one server)."""
        return None if self.daemon.config.multiuser else uid

    def namespace_for(self, pid: int, uid: int, route: Route | None) -> Namespace | None:
        """The namespace a new client `pid` of `uid` goes in (None: its server's default one): the one its
        routed socket names, else the first whose cgroup holds the client's."""
        spaces = self.namespaces.get(self.server_key(uid), {})
        if route is not None:
            return None if route.namespace == DEFAULT else spaces.get(route.namespace)
        if not any(ns.cgroup for ns in spaces.values()):
            return None
        cgroup = cgroup_of(pid)
        return next((ns for ns in spaces.values() if ns.holds_cgroup(cgroup)), None)

    def namespace_of(self, ctx: Any) -> Namespace | None:
        """The namespace a connected client is in (None: the default one)."""
        return self.namespaces.get(self.server_key(ctx.uid), {}).get(ctx.namespace)

    # -- what new clients get --------------------------------------------------------------------------
    def percentage_for_new_client(self, uid: int | None = None) -> float:
        """The active thread percentage of a client that comes now (of `uid`: where no server runs, the one
        that will start for it, a named server's if its user has one)."""
        named = self._named_next(uid)
        if named is not None and named.active_thread_percentage is not None:
            return named.active_thread_percentage
        value = self.server.active_thread_percentage if self.server.started else None
        return self.daemon.settings.active_thread_percentage if value is None else value

    def memory_limit_for_new_client(self, device: int, uid: int | None = None) -> int | None:
        named = self._named_next(uid)
        if named is not None and named.pinned_memory_limit is not None:
            if self.refused_by(named.uid, self.daemon.devices[device]) is None:
                return named.pinned_memory_limit
        limits = self.server.pinned_mem_limits if self.server.started else self.daemon.settings.pinned_mem_limits
        return limits.get(device) or None

    def _named_next(self, uid: int | None) -> Any:
        """The named server a client of `uid` starts, where it starts one (none runs for it yet)."""
        if uid is None or self.daemon.config.multiuser or (self.server.started and self.server.uid == uid):
            return None
        return self.named.get(uid)

    def refused_by(self, uid: int, device: Any) -> str | None:
        """The named server (MPS v3's -a file) of `uid` whose allowed devices leave `device` out, if one does."""
        named = None if self.daemon.config.multiuser else self.named.get(uid)
        if named is None or not named.allowed_devices or device.properties["uuid"] in named.allowed_devices:
            return None
        return named.name

    def admits(self, uid: int) -> bool:
        """Whether a client of `uid` may attach now (else it waits for the current server to exit)."""
        server = self.server
        return not server.started or server.uid is None or server.uid == uid or not self._contexts()

    def client_arrived(self, ctx: Any) -> None:
        """A context connected: control.log and server.log say what MPS's say when a client process opens one
        (its first context: the process's connection, numbered 0, then the CUDA context)."""
        server, log, pid, uid = self.server, self.daemon.log, ctx.pid, ctx.uid
        first = pid not in self._processes() or [c.id for c in self._processes()[pid]] == [ctx.id]
        log.control("Accepting connection...")
        if first:
            log.control("User did not send valid credentials")
            log.control("Accepting connection...")
            if not (server.started and (server.uid is None or server.uid == uid)):
                if server.started:  # idle, serving another user: it makes way
                    self._note(f"Try shutting down server {server.pid}, backoff is disabled")
                    log.server("Server has been notified to shutdown")
                    log.server("Waiting for current clients to finish")
                    log.server("Exiting")
                    self._exit_server()
                log.control(f"NEW CLIENT {pid} from user {uid}: Server is not ready, push client to pending list")
                self.after_command()
                self._start_server(uid)()
            else:
                log.control(f"NEW CLIENT {pid} from user {uid}: Server already exists")
            log.control("Accepting connection...")
        log.control(f"NEW CLIENT {pid} from user {uid}: Server already exists")
        number = len(self._processes().get(pid, ()))
        if first:
            server.clients_seen += 1
            server.ids[pid] = server.clients_seen
            log.server(f"Received new client request for {{PID: {pid}, Context ID: 0}}")
            log.server(f"Client {{PID: {pid}, Context ID: 0}} connected")
            log.server(f"Creating worker thread for client {{PID: {pid}, Context ID: 0}}")
        log.server(f"Received new client request for {{PID: {pid}, Context ID: 0}}")
        log.server(f"Client {{PID: {pid}, Context ID: {number}}} connected")
        log.server(f"Creating worker thread for client {{PID: {pid}, Context ID: {number}}}")
        log.server(f"Device {ctx.device.name} (uuid {ctx.device.properties['uuid']}) is associated")
        log.server(f"Status of client {{PID: {pid}, Context ID: {number}}} is ACTIVE")

    def client_leaving(self, ctx: Any) -> None:
        """A context is going (before the daemon forgets it): server.log says so as MPS's does."""
        if ctx.id in self.orphans:
            return
        log, pid = self.daemon.log, ctx.pid
        mine = [c.id for c in self._processes().get(pid, [])]
        number = mine.index(ctx.id) + 1 if ctx.id in mine else 1
        left = len(self._contexts()) - 1
        log.server(f"Server failed to recevie command with status 806, assuming client {{PID: {pid}, Context ID: "
                   f"{number}}} exit")
        log.server(f"Client {{PID: {pid}, Context ID: {number}}} exiting. Number of active client contexts is "
                   f"{left}.")
        if len(mine) <= 1:
            log.server(f"Server failed to recevie command with status 806, assuming client {{PID: {pid}, Context "
                       "ID: 0} exit")
            log.server(f"Client process {pid} disconnected")

    def client_waiting(self, pid: int, uid: int) -> None:
        self.daemon.log.control(f"NEW CLIENT {pid} from user {uid}: Server {self.server.pid} serves user "
                                f"{self.server.uid}, push client to pending list")

    def client_left(self, ctx: Any) -> None:
        self.orphans.discard(ctx.id)
        if self._contexts():
            return
        if self.daemon.pending_clients and not self.server.shutting_down:
            self._note(f"Try shutting down server {self.server.pid}, backoff is disabled")
            self._exit_server()

    def server_died(self, pid: int, status: int) -> None:
        """The server's process (--mps-names) ended by itself, killed: the server is gone as MPS's is when its
        process dies, its clients' calls fail (cudaErrorMpsRpcFailure) and the next client starts a new one."""
        server = self.server
        if not server.started or server.pid != pid:
            return
        self.daemon.log.server(f"Server process {pid} ended with status {status}: its clients are cut off",
                               pid=self.daemon.log.pid)
        for ctx in self._contexts():
            self.daemon.server_gone(ctx)
            self.orphans.add(ctx.id)
        self._exit_server(status)

    def _exit_server(self, status: int = 0) -> None:
        server = self.server
        self.daemon.end_server_process()
        server.started = server.shutting_down = False
        self._retry_at = None
        self._backoff = self.daemon.config.shutdown_retry
        self.daemon.server_changed()
        exited = functools.partial(self._note, f"Server {server.pid} exited with status {status}")
        if self._in_command:  # MPS sees its server go after it has answered the command that stopped it
            self._later.append(exited)
        else:
            exited()


def _store(limits: dict[int, int], device: int, limit: int) -> None:
    if limit:
        limits[device] = limit
    else:
        limits.pop(device, None)


def _namespace(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid").split("[")[-1].rstrip("]")
    except OSError:
        return "-"


def _command(pid: int) -> str:
    """The client's command as MPS's ps shows it: its argv[0] (the path it was started by, not its executable's)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            first = f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "-"
    return first or "-"
