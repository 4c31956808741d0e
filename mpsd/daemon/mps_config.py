# MPS v3's configuration file (NVIDIA's MPS documentation, releases 615 and 620, "MPS v3 Configuration File"),
# which `nvidia-cuda-mps-control -d -p 3 -a FILE` applies once at start: its named servers, as far as mpsd's
# servers can be them. What the documentation says and mpsd follows: TOML, `schema_version = "1.0"`,
# `[servers.<name>]` with allowed_devices (GPU UUIDs, comma-separated), pinned_memory_limit ("10G"),
# active_thread_percentage ("50"), client_priority ("0"), uid and locality_domains (a boolean), and any other
# key a configuration error; `[servers.<name>.namespaces.<ns>]` with pinned_memory_limit, active_thread_percentage,
# client_priority and cgroup (mpsd.daemon.namespaces). What mpsd cannot do yet is an error too, saying so,
# rather than a setting silently dropped: [compute_policy], [features.*], a server's devices (SM partitions),
# timeslice_pct, locality_domains = true, and a namespace's cgroup_depth and devices.
#
# mpsd's guesses (NVIDIA documents none of them): every error text; that a server needs a uid (mpsd's servers
# serve one user each) and that two servers may not share one; that the values may also be TOML numbers; that
# a limit is a number of MiB, or of GiB with G, as the legacy language writes it; that a server's and a
# namespace's name must be a plain path component (they name directories of the pipe directory); that a
# namespace's cgroup is an absolute cgroup v2 path.
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpsd.daemon.namespaces import Namespace, check_name
from mpsd_protocol import parse_decimal
from mpsd_protocol._units import MAX_SIZE

SCHEMA_VERSION = "1.0"
SERVER_KEYS = frozenset({"allowed_devices", "pinned_memory_limit", "active_thread_percentage", "client_priority",
                         "uid", "locality_domains", "namespaces"})
NOT_YET = frozenset({"compute_policy", "features"})  # documented top-level tables mpsd does not do yet
SERVER_NOT_YET = frozenset({"devices", "timeslice_pct"})
NAMESPACE_KEYS = frozenset({"pinned_memory_limit", "active_thread_percentage", "client_priority", "cgroup"})
NAMESPACE_NOT_YET = frozenset({"cgroup_depth", "devices"})
_LIMIT = re.compile(r"([0-9]{1,20})([MmGg]?)", re.ASCII)
GiB, MiB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class NamedServer:
    """One [servers.<name>] table: what a server for its user starts with."""

    name: str
    uid: int
    allowed_devices: tuple[str, ...] = ()  # GPU UUIDs; none: every device
    pinned_memory_limit: int | None = None  # bytes, on each allowed device; None: the defaults'
    active_thread_percentage: float | None = None
    client_priority: int | None = None
    namespaces: tuple[Namespace, ...] = ()  # [servers.<name>.namespaces.<ns>], in the file's order


def parse_limit(text: str) -> int:
    """A pinned memory limit as the legacy language writes one, strictly: a number of MiB, or of GiB with G.

    Raises:
        ValueError: anything else.
    """
    match = _LIMIT.fullmatch(text)
    if not match:
        raise ValueError(f"not a limit: {text[:24]!r} (e.g. 900M or 10G)")
    nbytes = int(match.group(1)) * (GiB if match.group(2) in ("G", "g") else MiB)
    if nbytes > MAX_SIZE:  # what the wire (msgpack's signed 64 bits) can carry to a client
        raise ValueError(f"limit too large: {text[:24]!r}")
    return nbytes


def _text(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where} must be a string or a number")
    return value if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)


def _server(name: str, table: Any) -> NamedServer:
    where = f"servers.{name}"
    check_name(name, "server")  # it names a directory in the pipe directory ($PIPE/<server>/control)
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    for key in sorted(table):
        if key in SERVER_NOT_YET:
            raise ValueError(f"{where}.{key} is not supported by mpsd yet")
        if key not in SERVER_KEYS:
            raise ValueError(f"unknown key {where}.{key}")
    uid = table.get("uid")
    if uid is None:
        raise ValueError(f"{where} needs a uid (each of mpsd's servers serves one user)")
    if type(uid) is not int or not 0 <= uid < (1 << 32) - 1:
        raise ValueError(f"{where}.uid must be a user id, not {uid!r}")
    locality = table.get("locality_domains", False)
    if type(locality) is not bool:
        raise ValueError(f"{where}.locality_domains must be true or false")
    if locality:
        raise ValueError(f"{where}.locality_domains = true is not supported by mpsd yet")
    devices: tuple[str, ...] = ()
    if "allowed_devices" in table:
        if not isinstance(table["allowed_devices"], str):
            raise ValueError(f"{where}.allowed_devices must be a string of GPU UUIDs, comma-separated")
        devices = tuple(part.strip() for part in table["allowed_devices"].split(","))
        if not all(devices):
            raise ValueError(f"{where}.allowed_devices has an empty UUID")
    limit, percentage, priority = _settings(table, where)
    namespaces: list[Namespace] = []
    tables = table.get("namespaces", {})
    if not isinstance(tables, dict):
        raise ValueError(f"{where}.namespaces must be a table of namespaces")
    for ns_name, ns_table in tables.items():
        namespaces.append(_namespace(ns_name, ns_table, f"{where}.namespaces.{ns_name}"))
    return NamedServer(name, uid, devices, limit or None, percentage, priority, tuple(namespaces))


def _settings(table: dict[str, Any], where: str) -> tuple[int | None, float | None, int | None]:
    """A server's or a namespace's pinned_memory_limit (bytes; 0 is none), active_thread_percentage and
    client_priority, None where not given."""
    limit = percentage = priority = None
    if "pinned_memory_limit" in table:
        limit = parse_limit(_text(table["pinned_memory_limit"], f"{where}.pinned_memory_limit"))
    if "active_thread_percentage" in table:
        text = _text(table["active_thread_percentage"], f"{where}.active_thread_percentage")
        try:
            percentage = parse_decimal(text)
        except ValueError:
            percentage = -1.0
        if not 0 < percentage <= 100:
            raise ValueError(f"{where}.active_thread_percentage must be in (0, 100], not {text[:24]!r}")
    if "client_priority" in table:
        text = _text(table["client_priority"], f"{where}.client_priority")
        if text not in ("0", "1"):
            raise ValueError(f"{where}.client_priority must be 0 or 1, not {text[:24]!r}")
        priority = int(text)
    return limit or None, percentage, priority


def _namespace(name: str, table: Any, where: str) -> Namespace:
    check_name(name)
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    for key in sorted(table):
        if key in NAMESPACE_NOT_YET:
            raise ValueError(f"{where}.{key} is not supported by mpsd yet")
        if key not in NAMESPACE_KEYS:
            raise ValueError(f"unknown key {where}.{key}")
    cgroup = table.get("cgroup")
    if cgroup is not None and not (isinstance(cgroup, str) and cgroup.startswith("/")):
        raise ValueError(f"{where}.cgroup must be a cgroup path such as /user.slice/job1")
    limit, percentage, priority = _settings(table, where)
    return Namespace(name, percentage, limit, priority, cgroup)


def load_mps_config(path: Path) -> tuple[NamedServer, ...]:
    """The named servers of the v3 configuration file at `path`.

    Raises:
        ValueError: it cannot be read, is not TOML, or is not a configuration mpsd can apply (the message says
            where, prefixed with the path).
    """
    try:
        document = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    try:
        return _servers(document)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _servers(document: dict[str, Any]) -> tuple[NamedServer, ...]:
    for key in sorted(document):
        if key in NOT_YET:
            raise ValueError(f"[{key}] is not supported by mpsd yet")
        if key not in ("schema_version", "servers"):
            raise ValueError(f"unknown key {key}")
    if document.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f'schema_version must be "{SCHEMA_VERSION}", not {document.get("schema_version")!r}')
    tables = document.get("servers", {})
    if not isinstance(tables, dict):
        raise ValueError("servers must be a table of named servers")
    servers = tuple(_server(name, table) for name, table in tables.items())
    seen: dict[int, str] = {}
    for server in servers:
        if server.uid in seen:
            raise ValueError(f"servers.{seen[server.uid]} and servers.{server.name} both serve uid {server.uid}")
        seen[server.uid] = server.name
    return servers
