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
# Every argument is parsed strictly (mpsd_protocol's parse_integer and parse_decimal: ASCII digits, bounded
# length), so no line any user sends can raise anything but a CommandError here; the server still answers any
# other exception with an error line, as the last line of defence.
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from mpsd.runtime.device import COMPUTE_MODES
from mpsd_protocol import parse_decimal, parse_integer, parse_size

if TYPE_CHECKING:
    from mpsd.daemon.server import Daemon

# Commands any user may send; the rest change state and need root or the daemon's owner.
READ_ONLY = frozenset({
    "mpsd_status",
    "get_server_list", "get_server_status", "get_client_list", "get_device_client_list", "ps",
    "get_default_active_thread_percentage", "get_active_thread_percentage", "get_default_device_pinned_mem_limit",
    "get_device_pinned_mem_limit", "get_default_client_priority", "get_client_priority", "get_client_weight",
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
    active_thread_percentage: float | None = None
    pinned_mem_limits: dict[int, int] = field(default_factory=dict)
    started: bool = False
    shutting_down: bool = False


def _shown(text: str) -> str:
    """An argument as a complaint quotes it: whole, unless it is long."""
    return text if len(text) <= 24 else text[:20] + "..."


def _integer(text: str, complaint: str, *, signed: bool = False) -> int:
    """`text` as parse_integer reads it, or a CommandError saying `complaint`."""
    try:
        return parse_integer(text, signed=signed)
    except ValueError:
        raise CommandError(complaint) from None


def _percentage(text: str) -> float:
    complaint = f"Invalid active thread percentage {_shown(text)!r}"
    try:
        value = parse_decimal(text)
    except ValueError:
        raise CommandError(complaint) from None
    if not 0 < value <= 100:
        raise CommandError(complaint)
    return value


def _limit(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise CommandError(f"Invalid memory limit {_shown(text)!r}") from None


def _target(text: str) -> tuple[str, int]:
    """A client pid (``1234``) or a user (``uid:1000``), as the extension commands name whom they set."""
    kind, _, number = text.rpartition(":")
    complaint = f"Invalid client {_shown(text)!r}: a pid, or uid:<uid>"
    if kind not in ("", "uid"):
        raise CommandError(complaint)
    return ("uid" if kind else "pid", _integer(number, complaint))


def _level(text: str) -> int:
    value = _integer(text, f"Invalid client priority {_shown(text)!r}", signed=True)
    if abs(value) >= MAX_LEVEL:
        raise CommandError(f"Invalid client priority {_shown(text)!r}")
    return value


def _weight(text: str) -> float:
    complaint = f"Invalid client weight {_shown(text)!r}"
    try:
        value = parse_decimal(text)
    except ValueError:
        raise CommandError(complaint) from None
    if not 0 < value < float("inf"):
        raise CommandError(complaint)
    return value


def _size_text(nbytes: int) -> str:
    """A limit as MPS prints it: the largest whole unit (10G, 900M, 4096)."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


class Control:
    """Executes control commands against a daemon."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.server = Server(daemon.log.pid)
        self._caller = 0  # the uid of the command being run
        self._commands: dict[str, Callable[[list[str]], str]] = {
            name[4:]: getattr(self, name) for name in dir(self) if name.startswith("cmd_")
        }

    def execute(self, line: str, uid: int) -> str:
        """Run one command line from a client of uid `uid`; returns what the tool prints (maybe nothing)."""
        log = self.daemon.log
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        if not words:
            return ""
        name, args = words[0], words[1:]
        log.control(f"Cmd:{line.strip()}")
        command = self._commands.get(name)
        if command is None:
            return f'Unknown command "{_shown(name)}"'
        if name not in READ_ONLY and uid not in (0, self.daemon.owner_uid):
            log.control(f"User {uid} is not allowed to run {name}")
            return f"Permission denied: {name} needs root or the daemon's owner"
        self._caller = uid
        try:
            return command(args)
        except CommandError as exc:
            log.control(str(exc))
            return str(exc)

    # -- helpers ---------------------------------------------------------------------------------------
    def _server_pid(self, text: str) -> Server:
        if _integer(text, f"Server {_shown(text)} not found") != self.server.pid or not self.server.started:
            raise CommandError(f"Server {_shown(text)} not found")
        return self.server

    @staticmethod
    def _args(args: list[str], count: int, usage: str) -> list[str]:
        if len(args) != count:
            raise CommandError(f"Usage: {usage}")
        return args

    def _device(self, text: str) -> int:
        index = _integer(text, f"Invalid device {_shown(text)!r}")
        if index >= len(self.daemon.devices):
            raise CommandError(f"Invalid device {_shown(text)!r}")
        return index

    def _contexts(self):
        return [ctx for device in self.daemon.devices for ctx in device.contexts.values()]

    # -- servers and clients ---------------------------------------------------------------------------
    def cmd_get_server_list(self, args: list[str]) -> str:
        return str(self.server.pid) if self.server.started else ""

    def cmd_get_server_status(self, args: list[str]) -> str:
        (pid,) = self._args(args, 1, "get_server_status <PID>")
        self._server_pid(pid)
        return "FAULT" if any(device.faulted for device in self.daemon.devices) else "ACTIVE"

    def cmd_start_server(self, args: list[str]) -> str:
        usage = "Usage: start_server -uid <uid>"
        if len(args) != 2 or args[0] != "-uid":
            raise CommandError(usage)
        uid = _integer(args[1], usage)
        if not self.server.started:
            self.server.started = True
            self.server.uid = None if self.daemon.config.multiuser else uid
            self.daemon.log.control(f"Starting new server {self.server.pid} for user {uid}")
        return ""

    def cmd_shutdown_server(self, args: list[str]) -> str:
        if not args or len(args) > 2 or (len(args) == 2 and args[1] != "-f"):
            raise CommandError("Usage: shutdown_server <PID> [-f]")
        server = self._server_pid(args[0])
        if len(args) == 2:  # -f: its clients are terminated now
            for ctx in self._contexts():
                self.daemon.terminate(ctx, "the server was shut down with -f")
            server.started = False
        else:
            server.shutting_down = True  # new clients are refused; it goes when its clients have
            if not self._contexts():
                server.started = server.shutting_down = False
        self.daemon.log.control(f"Server {server.pid} is shutting down")
        return ""

    def cmd_get_client_list(self, args: list[str]) -> str:
        (pid,) = self._args(args, 1, "get_client_list <PID>")
        self._server_pid(pid)
        return "\n".join(str(ctx.pid) for ctx in self._contexts())

    def cmd_get_device_client_list(self, args: list[str]) -> str:
        if len(args) > 1:
            raise CommandError("Usage: get_device_client_list [<PID>]")
        if args:
            self._server_pid(args[0])
        lines = []
        for device in self.daemon.devices:
            pids = [str(ctx.pid) for ctx in device.contexts.values()]
            if pids:
                lines.append(f"{device.properties['uuid']}:")
                lines.extend(f"    {pid}" for pid in pids)
        return "\n".join(lines)

    def cmd_terminate_client(self, args: list[str]) -> str:
        server_pid, client_pid = self._args(args, 2, "terminate_client <server PID> <client PID>")
        self._server_pid(server_pid)
        victims = [ctx for ctx in self._contexts() if str(ctx.pid) == client_pid]
        if not victims:
            raise CommandError(f"Client {_shown(client_pid)} not found")
        for ctx in victims:
            self.daemon.terminate(ctx, "terminate_client")
        return "0"

    def cmd_ps(self, args: list[str]) -> str:
        if args and (len(args) != 2 or args[0] != "-p"):
            raise CommandError("Usage: ps [-p PID]")
        rows = ["PID ID SERVER DEVICE NAMESPACE COMMAND"]
        everyone = self._caller in (0, self.daemon.owner_uid)  # others see their own processes only
        for ctx in self._contexts():
            if (args and str(ctx.pid) != args[1]) or not (everyone or ctx.uid == self._caller):
                continue
            rows.append(f"{ctx.pid} {ctx.id} {self.server.pid} {ctx.device.properties['uuid']} "
                        f"{_namespace(ctx.pid)} {_command(ctx.pid)}")
        return "\n".join(rows)

    # -- settings --------------------------------------------------------------------------------------
    def cmd_get_default_active_thread_percentage(self, args: list[str]) -> str:
        self._args(args, 0, "get_default_active_thread_percentage")
        return f"{self.daemon.settings.active_thread_percentage:.1f}"

    def cmd_set_default_active_thread_percentage(self, args: list[str]) -> str:
        (text,) = self._args(args, 1, "set_default_active_thread_percentage <percentage>")
        self.daemon.settings.active_thread_percentage = _percentage(text)
        return f"{self.daemon.settings.active_thread_percentage:.1f}"

    def cmd_get_active_thread_percentage(self, args: list[str]) -> str:
        (pid,) = self._args(args, 1, "get_active_thread_percentage <PID>")
        server = self._server_pid(pid)
        value = server.active_thread_percentage
        return f"{self.daemon.settings.active_thread_percentage if value is None else value:.1f}"

    def cmd_set_active_thread_percentage(self, args: list[str]) -> str:
        pid, text = self._args(args, 2, "set_active_thread_percentage <PID> <percentage>")
        server = self._server_pid(pid)
        server.active_thread_percentage = _percentage(text)
        return f"{server.active_thread_percentage:.1f}"

    def cmd_get_default_device_pinned_mem_limit(self, args: list[str]) -> str:
        (device,) = self._args(args, 1, "get_default_device_pinned_mem_limit <device>")
        limit = self.daemon.settings.pinned_mem_limits.get(self._device(device))
        if limit is None:
            self.daemon.log.control("No default pinned memory limit set for the device!")
            return ""
        return _size_text(limit)

    def cmd_set_default_device_pinned_mem_limit(self, args: list[str]) -> str:
        device, text = self._args(args, 2, "set_default_device_pinned_mem_limit <device> <value>")
        self.daemon.settings.pinned_mem_limits[self._device(device)] = _limit(text)
        return ""

    def cmd_get_device_pinned_mem_limit(self, args: list[str]) -> str:
        pid, device = self._args(args, 2, "get_device_pinned_mem_limit <PID> <device>")
        server = self._server_pid(pid)
        index = self._device(device)
        limit = server.pinned_mem_limits.get(index, self.daemon.settings.pinned_mem_limits.get(index))
        if limit is None:
            self.daemon.log.control("No pinned memory limit set for the device!")
            return ""
        return _size_text(limit)

    def cmd_set_device_pinned_mem_limit(self, args: list[str]) -> str:
        pid, device, text = self._args(args, 3, "set_device_pinned_mem_limit <PID> <device> <value>")
        self._server_pid(pid).pinned_mem_limits[self._device(device)] = _limit(text)
        return ""

    def cmd_get_default_client_priority(self, args: list[str]) -> str:
        self._args(args, 0, "get_default_client_priority")
        return str(self.daemon.settings.client_priority)

    def cmd_set_default_client_priority(self, args: list[str]) -> str:
        (text,) = self._args(args, 1, "set_default_client_priority <0|1>")
        if text not in ("0", "1"):
            raise CommandError(f"Invalid client priority {_shown(text)!r}")
        self.daemon.settings.client_priority = int(text)
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

    def cmd_mpsd_compute_mode(self, args: list[str]) -> str:
        """Not MPS's: a device's compute mode, as nvidia-smi -c sets it (mpsd-smi -c sends this)."""
        usage = f"mpsd_compute_mode <device> <{'|'.join(COMPUTE_MODES)}>"
        device, mode = self._args(args, 2, usage)
        if mode not in COMPUTE_MODES:
            raise CommandError(f"Usage: {usage}")
        self.daemon.devices[self._device(device)].compute_mode = mode
        return ""

    def cmd_quit(self, args: list[str]) -> str:
        usage = "Usage: quit [-t <timeout in seconds>]"
        if args and (len(args) != 2 or args[0] != "-t"):
            raise CommandError(usage)
        self.daemon.stop(float(_integer(args[1], usage)) if args else None)
        return ""

    # -- what new clients get --------------------------------------------------------------------------
    def percentage_for_new_client(self) -> float:
        value = self.server.active_thread_percentage
        return self.daemon.settings.active_thread_percentage if value is None else value

    def memory_limit_for_new_client(self, device: int) -> int | None:
        return self.server.pinned_mem_limits.get(device, self.daemon.settings.pinned_mem_limits.get(device))

    def admits(self, uid: int) -> bool:
        """Whether a client of `uid` may attach now (else it waits for the current server to exit)."""
        server = self.server
        return not server.started or server.uid is None or server.uid == uid or (
            not self._contexts() and not server.shutting_down)

    def client_arrived(self, pid: int, uid: int) -> None:
        server = self.server
        if server.started and (server.uid is None or server.uid == uid):
            self.daemon.log.control(f"NEW CLIENT {pid} from user {uid}: Server already exists")
            return
        if server.started:  # idle, serving another user: it makes way
            self._exit_server()
        self.daemon.log.control(f"NEW CLIENT {pid} from user {uid}: Server is not ready, push client to "
                                "pending list")
        server.started = True
        server.uid = None if self.daemon.config.multiuser else uid
        self.daemon.log.control(f"Starting new server {server.pid} for user {uid}")

    def client_waiting(self, pid: int, uid: int) -> None:
        self.daemon.log.control(f"NEW CLIENT {pid} from user {uid}: Server {self.server.pid} serves user "
                                f"{self.server.uid}, push client to pending list")

    def client_left(self) -> None:
        if self._contexts():
            return
        if self.server.shutting_down or self.daemon.pending_clients:
            self._exit_server()

    def _exit_server(self) -> None:
        server = self.server
        server.started = server.shutting_down = False
        self.daemon.log.control(f"Server {server.pid} exited with status 0")
        self.daemon.server_changed()


def _namespace(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid").split("[")[-1].rstrip("]")
    except OSError:
        return "-"


def _command(pid: int) -> str:
    """The client's command line on one line, shortened, as ps shows it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().decode(errors="replace").split("\0")
    except OSError:
        return "-"
    text = " ".join(" ".join(words).split())
    return (text[:77] + "...") if len(text) > 80 else text or "-"

