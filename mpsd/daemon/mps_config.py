# MPS v3's configuration file (NVIDIA's MPS documentation, releases 615 and 620, "MPS v3 Configuration File"),
# which `nvidia-cuda-mps-control -d -p 3 -a FILE` applies once at start: its named servers, as far as mpsd's
# servers can be them. What the documentation says and mpsd follows: TOML, `schema_version = "1.0"`,
# `[servers.<name>]` with allowed_devices (GPU UUIDs, comma-separated), pinned_memory_limit ("10G"),
# active_thread_percentage ("50"), client_priority ("0"), uid and locality_domains (a boolean), and any other
# key a configuration error; `[servers.<name>.namespaces.<ns>]` with pinned_memory_limit, active_thread_percentage,
# client_priority and cgroup (mpsd.daemon.namespaces); release 620's per-device SM partitions,
# `[[servers.<name>.devices]]` (a GPU `uuid`) with `[[servers.<name>.devices.sm_partitions]]` (`name`, `chunks`,
# `include_remainder`: mpsd.daemon.sm_partitions), and a namespace's `[[...namespaces.<ns>.devices]]` (`uuid`,
# `sm_partition`). What mpsd cannot do is an error too, saying so, rather than a setting silently dropped:
# [compute_policy], [features.*], timeslice_pct, locality_domains = true, a partition's `shareable = false` and
# `max_chunks` (mpsd's partitions are fixed, and every client that names one shares it), and a namespace's
# `cgroup_depth` (the documentation shows it, `cgroup_depth = 1`, but does not say what it does).
#
# mpsd's guesses (NVIDIA documents none of them): every error text; that a server needs a uid (mpsd's servers
# serve one user each) and that two servers may not share one; that the values may also be TOML numbers; that
# a limit is a number of MiB, or of GiB with G, as the legacy language writes it; that a server's and a
# namespace's name must be a plain path component (they name directories of the pipe directory); that a
# namespace's cgroup is an absolute cgroup v2 path (or one under /sys/fs/cgroup, as the example writes it);
# that a server's devices table and a namespace's name devices of the server's allowed_devices, where it has
# them; that a namespace's sm_partition names a partition of its server's on the same device; that partition
# names are unique in the file; that a file with partitions turns static partitioning on, as -S does.
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpsd.daemon.namespaces import Namespace, NamespaceDevice, cgroup_path, check_name
from mpsd.daemon.sm_partitions import check_partition_name
from mpsd_protocol import parse_percentage
from mpsd_protocol._units import MAX_SIZE

SCHEMA_VERSION = "1.0"
SERVER_KEYS = frozenset({"allowed_devices", "pinned_memory_limit", "active_thread_percentage", "client_priority",
                         "uid", "locality_domains", "namespaces", "devices"})
NOT_YET = frozenset({"compute_policy", "features"})  # documented top-level tables mpsd does not do yet
SERVER_NOT_YET = frozenset({"timeslice_pct"})
NAMESPACE_KEYS = frozenset({"pinned_memory_limit", "active_thread_percentage", "client_priority", "cgroup",
                            "devices"})
NAMESPACE_UNDEFINED = frozenset({"cgroup_depth"})  # in NVIDIA's example, with no word on what it does
DEVICE_KEYS = frozenset({"uuid", "sm_partitions"})
PARTITION_KEYS = frozenset({"name", "chunks", "include_remainder"})
PARTITION_NOT_YET = frozenset({"shareable", "max_chunks"})
NAMESPACE_DEVICE_KEYS = frozenset({"uuid", "sm_partition"})
_LIMIT = re.compile(r"([0-9]{1,20})([MmGg]?)", re.ASCII)
GiB, MiB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class PartitionSpec:
    """One [[servers.<name>.devices.sm_partitions]] entry: a static SM partition made as the daemon starts."""

    name: str
    chunks: int
    include_remainder: bool = False


@dataclass(frozen=True)
class ServerDevice:
    """One [[servers.<name>.devices]] entry: a device of the server's and the SM partitions it is cut into."""

    uuid: str
    sm_partitions: tuple[PartitionSpec, ...] = ()


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
    devices: tuple[ServerDevice, ...] = ()  # [[servers.<name>.devices]], in the file's order

    @property
    def sm_partitions(self) -> list[tuple[str, PartitionSpec]]:
        """(device UUID, partition) for every SM partition of the server's devices table."""
        return [(device.uuid, spec) for device in self.devices for spec in device.sm_partitions]


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
    own = _devices(table.get("devices", []), where, devices)
    partitions = {spec.name: uuid for device in own for spec in device.sm_partitions for uuid in [device.uuid]}
    namespaces: list[Namespace] = []
    tables = table.get("namespaces", {})
    if not isinstance(tables, dict):
        raise ValueError(f"{where}.namespaces must be a table of namespaces")
    for ns_name, ns_table in tables.items():
        namespace = _namespace(ns_name, ns_table, f"{where}.namespaces.{ns_name}")
        for n, device in enumerate(namespace.devices):
            there = f"{where}.namespaces.{ns_name}.devices[{n}]"
            if devices and device.uuid not in devices:
                raise ValueError(f"{there}.uuid {device.uuid[:48]} is not among {where}.allowed_devices")
            if device.sm_partition is not None and partitions.get(device.sm_partition) != device.uuid:
                raise ValueError(f"{there}.sm_partition {device.sm_partition!r} is no partition of {where}.devices "
                                 f"on {device.uuid[:48]}")
        namespaces.append(namespace)
    return NamedServer(name, uid, devices, limit or None, percentage, priority, tuple(namespaces), own)


def _tables(value: Any, where: str) -> list[dict[str, Any]]:
    """An array of tables ([[...]])."""
    if not isinstance(value, list) or not all(isinstance(entry, dict) for entry in value):
        raise ValueError(f"{where} must be an array of tables ([[{where}]])")
    return value


def _keys(table: dict[str, Any], known: frozenset[str], where: str, not_yet: frozenset[str] = frozenset()) -> None:
    for key in sorted(table):
        if key in not_yet:
            raise ValueError(f"{where}.{key} is not supported by mpsd yet")
        if key not in known:
            raise ValueError(f"unknown key {where}.{key}")


def _uuid(table: dict[str, Any], where: str) -> str:
    uuid = table.get("uuid")
    if not isinstance(uuid, str) or not uuid.strip():
        raise ValueError(f"{where} needs a uuid (a GPU UUID)")
    return uuid.strip()


def _devices(value: Any, where: str, allowed: tuple[str, ...]) -> tuple[ServerDevice, ...]:
    """[[<where>.devices]]: the server's devices and their SM partitions (names unique in the server)."""
    out: list[ServerDevice] = []
    names: set[str] = set()
    for n, table in enumerate(_tables(value, f"{where}.devices")):
        there = f"{where}.devices[{n}]"
        _keys(table, DEVICE_KEYS, there)
        uuid = _uuid(table, there)
        if allowed and uuid not in allowed:
            raise ValueError(f"{there}.uuid {uuid[:48]} is not among {where}.allowed_devices")
        if any(device.uuid == uuid for device in out):
            raise ValueError(f"{there}.uuid {uuid[:48]} is given twice")
        specs: list[PartitionSpec] = []
        for m, entry in enumerate(_tables(table.get("sm_partitions", []), f"{there}.sm_partitions")):
            at = f"{there}.sm_partitions[{m}]"
            _keys(entry, PARTITION_KEYS, at, PARTITION_NOT_YET)
            name = entry.get("name")
            if not isinstance(name, str):
                raise ValueError(f"{at} needs a name")
            try:
                check_partition_name(name)
            except ValueError as exc:
                raise ValueError(f"{at}.name: {exc}") from None
            if name in names:
                raise ValueError(f"{at}.name {name!r} is given twice")
            names.add(name)
            chunks = entry.get("chunks")
            if type(chunks) is not int or chunks <= 0:
                raise ValueError(f"{at}.chunks must be a whole number of chunks above 0, not {chunks!r}")
            remainder = entry.get("include_remainder", False)
            if type(remainder) is not bool:
                raise ValueError(f"{at}.include_remainder must be true or false")
            specs.append(PartitionSpec(name, chunks, remainder))
        out.append(ServerDevice(uuid, tuple(specs)))
    return tuple(out)


def _settings(table: dict[str, Any], where: str) -> tuple[int | None, float | None, int | None]:
    """A server's or a namespace's pinned_memory_limit (bytes; 0 is none), active_thread_percentage and
    client_priority, None where not given."""
    limit = percentage = priority = None
    if "pinned_memory_limit" in table:
        limit = parse_limit(_text(table["pinned_memory_limit"], f"{where}.pinned_memory_limit"))
    if "active_thread_percentage" in table:
        text = _text(table["active_thread_percentage"], f"{where}.active_thread_percentage")
        percentage = parse_percentage(text)
        if percentage is None:
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
        if key in NAMESPACE_UNDEFINED:
            raise ValueError(f"{where}.{key} is not supported by mpsd: NVIDIA's documentation shows the key but "
                             "does not say what it does")
        if key not in NAMESPACE_KEYS:
            raise ValueError(f"unknown key {where}.{key}")
    cgroup = table.get("cgroup")
    if cgroup is not None:
        try:
            cgroup = cgroup_path(cgroup if isinstance(cgroup, str) else "")
        except ValueError:
            raise ValueError(f"{where}.cgroup must be a cgroup path such as /user.slice/job1") from None
    limit, percentage, priority = _settings(table, where)
    devices: list[NamespaceDevice] = []
    for n, entry in enumerate(_tables(table.get("devices", []), f"{where}.devices")):
        there = f"{where}.devices[{n}]"
        _keys(entry, NAMESPACE_DEVICE_KEYS, there)
        uuid = _uuid(entry, there)
        if any(device.uuid == uuid for device in devices):
            raise ValueError(f"{there}.uuid {uuid[:48]} is given twice")
        partition = entry.get("sm_partition")
        if partition is not None and not isinstance(partition, str):
            raise ValueError(f"{there}.sm_partition must be a partition's name")
        devices.append(NamespaceDevice(uuid, partition))
    return Namespace(name, percentage, limit, priority, cgroup, tuple(devices))


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
    partitions: dict[str, str] = {}
    for server in servers:
        for _, spec in server.sm_partitions:  # CUDA_MPS_SM_PARTITION names one in the whole daemon
            if spec.name in partitions:
                raise ValueError(f"servers.{partitions[spec.name]} and servers.{server.name} both have an SM "
                                 f"partition {spec.name!r}")
            partitions[spec.name] = server.name
        if server.uid in seen:
            raise ValueError(f"servers.{seen[server.uid]} and servers.{server.name} both serve uid {server.uid}")
        seen[server.uid] = server.name
    return servers
