# The control languages' words and texts: C's number parsing as MPS reads its arguments (atoi, strtod,
# strtoull for limits), mpsd's strict parsing for its own extensions, and MPS's printed layouts (ps, device_query,
# limits), shared by the v2 and v3 interpreters and read by the corpus tests against the H200's recording.
from __future__ import annotations

import re

from mpsd_protocol import parse_decimal, parse_integer

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


def integer_arg(text: str, complaint: str, *, signed: bool = False) -> int:
    """`text` as parse_integer reads it, or a CommandError saying `complaint`."""
    try:
        return parse_integer(text, signed=signed)
    except ValueError:
        raise CommandError(complaint) from None


def parse_target(text: str) -> tuple[str, int]:
    """A client pid (``1234``) or a user (``uid:1000``), as the extension commands name whom they set."""
    kind, _, number = text.rpartition(":")
    complaint = f"Invalid client {brief(text)!r}: a pid, or uid:<uid>"
    if kind not in ("", "uid"):
        raise CommandError(complaint)
    return ("uid" if kind else "pid", integer_arg(number, complaint))


def parse_level(text: str) -> int:
    value = integer_arg(text, f"Invalid client priority {brief(text)!r}", signed=True)
    if abs(value) >= MAX_LEVEL:
        raise CommandError(f"Invalid client priority {brief(text)!r}")
    return value


def parse_weight(text: str) -> float:
    complaint = f"Invalid client weight {brief(text)!r}"
    try:
        value = parse_decimal(text)
    except ValueError:
        raise CommandError(complaint) from None
    if not 0 < value < float("inf"):
        raise CommandError(complaint)
    return value



def brief(text: str) -> str:
    """An argument as a complaint quotes it: whole, unless it is long."""
    return text if len(text) <= 24 else text[:20] + "..."


WORDS = re.compile(r"[^ \t\n\r\v\f]+")
ATOI = re.compile(r"[ \t]*([+-]?[0-9]+)")
STRTOD = re.compile(r"[ \t]*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf(?:inity)?|nan))",
                     re.IGNORECASE)
GiB, MiB = 1 << 30, 1 << 20
U64 = (1 << 64) - 1
MPS_VERSION = 13000  # what the H200's control daemon and server call their binary version
DRIVER_VERSION = 580


def digits(text: str, most: int) -> int:
    """Decimal digits as a number no larger than `most` (past 20 digits it is larger whatever they are; Python
    would not even convert a few thousand)."""
    return most if len(text.lstrip("0")) > 20 else min(int(text), most)


def atoi(text: str | None) -> int:
    """C's atoi, as MPS reads pids and priorities: the leading number, 0 where there is none."""
    match = ATOI.match(text or "")
    if not match:
        return 0
    number = match.group(1)
    value = digits(number.lstrip("+-"), 1 << 63)
    return -value if number.startswith("-") else min(value, (1 << 63) - 1)


def strtod(text: str | None) -> float | None:
    """C's strtod on the leading number, None where there is none (MPS then says the value is invalid)."""
    match = STRTOD.match(text or "")
    return float(match.group(1)) if match else None


def memory_limit(text: str) -> int:
    """A pinned memory limit as MPS reads one: strtoull's number (a minus wraps, too many digits saturate)
    in MiB, or in GiB when the next character is G or g; anything else after it is ignored. 0: no limit."""
    match = ATOI.match(text)
    if not match:
        return 0
    number, rest = match.group(1), text[match.end():]
    value = digits(number.lstrip("+-"), U64)
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




def store(limits: dict[int, int], device: int, limit: int) -> None:
    if limit:
        limits[device] = limit
    else:
        limits.pop(device, None)

