# The v2 language's settings: the defaults a server starts with and a running server's own (active thread
# percentage, pinned memory limits, client priority), as MPS reads and prints them, and mpsd's extensions (MPS
# has no such commands), which set, per client pid or per user, a finer priority level (for the priority
# policy) and a fair-share weight (for the fair policy). Unlike MPS's settings those reach running clients too,
# from their next block on, since the scheduler can re-read them at any time (a Reconfigure action each); a
# tester can re-prioritise a job mid-run. The mpsd_* commands are the daemon's own: its status, its traces, a
# device's compute mode.
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from mpsd.daemon.control_servers import Commands
from mpsd.daemon.control_state import Reconfigure, Report, SetComputeMode
from mpsd.daemon.control_text import U64, CommandError, atoi, digits, limit_text, memory_limit, parse_level, \
    parse_target, parse_weight, store, strtod

if TYPE_CHECKING:
    from mpsd.daemon.control import Control


class SettingsCommands(Commands):
    """The commands that read and change what clients get."""

    def __init__(self, control: Control) -> None:
        super().__init__(control.state, control.servers)

    def extension_args(self, name: str, args: list[str], count: int, usage: str) -> list[str]:
        """An mpsd extension's arguments: given none, it answers as MPS, which has no such command, does."""
        if not args:
            raise CommandError(f'Unknown command "{name}"')
        return self.args(args, count, usage)

    # -- settings --------------------------------------------------------------------------------------
    def _percentage(self, text: str | None) -> float | None:
        value = strtod(text)
        if value is None or not 0 < value <= 100:
            self.servers.note("Invalid percentage, expected between (0.0, 100.0]")
            return None
        return value

    def cmd_get_default_active_thread_percentage(self, args: list[str]) -> str:
        return f"{self.state.settings.active_thread_percentage:.1f}"

    def cmd_set_default_active_thread_percentage(self, args: list[str]) -> str:
        value = self._percentage(args[0] if args else None)
        if value is not None:
            self.state.settings.active_thread_percentage = value
        return f"{self.state.settings.active_thread_percentage:.1f}"

    def cmd_get_active_thread_percentage(self, args: list[str]) -> str:
        self.server_pid(args[0] if args else None)
        return f"{self.admission.percentage_for_new_client():.1f}"

    def cmd_set_active_thread_percentage(self, args: list[str]) -> str:
        server = self.server_pid(args[0] if args else None)
        value = self._percentage(args[1] if len(args) > 1 else None)
        if value is not None:
            server.active_thread_percentage = value
        return f"{self.admission.percentage_for_new_client():.1f}"

    def cmd_get_default_device_pinned_mem_limit(self, args: list[str]) -> str:
        if not args:
            self.servers.note("Invalid command format.")
            return ""
        device = self.device(args[0])
        if device is None:
            return ""
        limit = self.state.settings.pinned_mem_limits.get(device)
        if limit is None:
            self.servers.note("No default pinned memory limit set for the device!")
            return ""
        return limit_text(limit)

    def cmd_set_default_device_pinned_mem_limit(self, args: list[str]) -> str:
        if len(args) < 2:
            self.servers.note("Invalid command format.")
            return ""
        self.servers.note(f"set_default_device_pinned_mem_limit {args[0]} {args[1]}.")
        device = self.device(args[0])
        if device is not None:
            store(self.state.settings.pinned_mem_limits, device, memory_limit(args[1]))
        return ""

    def cmd_get_device_pinned_mem_limit(self, args: list[str]) -> str:
        if len(args) < 2:
            self.servers.note("Invalid command format.")
            return ""
        server = self.server_pid(args[0])
        device = self.device(args[1])
        limit = None if device is None else server.pinned_mem_limits.get(device)
        return "" if limit is None else limit_text(limit)

    def cmd_set_device_pinned_mem_limit(self, args: list[str]) -> str:
        if len(args) < 3:
            self.servers.note("Invalid command format.")
            return ""
        server = self.server_pid(args[0])
        device = self.device(args[1])
        if device is not None:
            limit = memory_limit(args[2])
            store(server.pinned_mem_limits, device, limit)
            self.out.server(f"Device pinned memory limit for device {device} set to {limit:#x} bytes")
        return ""

    def cmd_get_default_client_priority(self, args: list[str]) -> str:
        return str(self.state.settings.client_priority)

    def cmd_set_default_client_priority(self, args: list[str]) -> str:
        if not args:
            return ""
        value = atoi(args[0])
        if value not in (0, 1):
            return "Invalid priority value - must be 0 or 1!"
        self.state.settings.client_priority = value
        return ""

    # -- mpsd extensions: finer priorities and fair-share weights, per client pid or per user ---------------
    def cmd_set_client_priority(self, args: list[str]) -> str:
        """Not MPS's: the priority level (lower is more urgent) of a pid's or a user's clients."""
        target, text = self.extension_args("set_client_priority", args, 2, "set_client_priority <PID|uid:UID> <level>")
        self.state.settings.priorities[parse_target(target)] = parse_level(text)
        self._reconfigure(parse_target(target))
        return ""

    def cmd_get_client_priority(self, args: list[str]) -> str:
        (target,) = self.extension_args("get_client_priority", args, 1, "get_client_priority <PID|uid:UID>")
        return str(self._resolve(parse_target(target), self.state.settings.priority_for))

    def cmd_set_client_weight(self, args: list[str]) -> str:
        """Not MPS's: the fair-share weight (> 0) of a pid's or a user's clients."""
        target, text = self.extension_args("set_client_weight", args, 2, "set_client_weight <PID|uid:UID> <weight>")
        self.state.settings.weights[parse_target(target)] = parse_weight(text)
        self._reconfigure(parse_target(target))
        return ""

    def cmd_get_client_weight(self, args: list[str]) -> str:
        (target,) = self.extension_args("get_client_weight", args, 1, "get_client_weight <PID|uid:UID>")
        return f"{self._resolve(parse_target(target), self.state.settings.weight_for):g}"

    def _resolve(self, target: tuple[str, int], setting: Callable[[int, int], Any]) -> Any:
        """A setting as a client of `target` gets it; for a pid, through its user's when it is connected."""
        kind, number = target
        if kind == "uid":
            return setting(-1, number)
        uid = next((ctx.uid for ctx in self.state.contexts() if ctx.pid == number), None)
        if uid is None:  # not connected (yet): the user of the process with that pid, if there is one
            uid = self.state.processes.owner(number)
        return setting(number, -1 if uid is None else uid)

    def _reconfigure(self, target: tuple[str, int]) -> None:
        """Give the connected clients of `target` their new level and weight."""
        kind, number = target
        for ctx in self.state.contexts():
            if (ctx.pid if kind == "pid" else ctx.uid) == number:
                self.out.do(Reconfigure(ctx))

    def cmd_mpsd_status(self, args: list[str]) -> str:
        """Not MPS's: the state mpsd-smi shows, as JSON."""
        self.out.do(Report("status"))
        return ""

    def cmd_mpsd_trace(self, args: list[str]) -> str:
        """Not MPS's: write each traced device's timeline so far where --trace says, while the daemon runs (it
        pauses while a trace is drawn: about a second for a busy 2-s run); the files written."""
        self.args(args, 0, "mpsd_trace")
        if not self.state.tracing:
            raise CommandError("No trace: the daemon was started without --trace")
        self.out.do(Report("traces"))
        return ""

    def cmd_mpsd_compute_mode(self, args: list[str]) -> str:
        """Not MPS's: a device's compute mode, as nvidia-smi -c sets it (mpsd-smi -c sends this)."""
        usage = f"mpsd_compute_mode <device> <{'|'.join(self.state.compute_modes)}>"
        device, mode = self.args(args, 2, usage)
        if mode not in self.state.compute_modes:
            raise CommandError(f"Usage: {usage}")
        index = digits(device, U64) if device.isascii() and device.isdigit() else len(self.state.devices)
        if index >= len(self.state.devices):
            raise CommandError(f"Invalid device {device}")
        self.out.do(SetComputeMode(index, mode))
        return ""

