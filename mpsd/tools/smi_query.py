# nvidia-smi's own outputs, for the scripts that parse them: `-L`, and `--query-gpu=` / `--query-compute-apps=`
# with `--format=csv[,noheader][,nounits]`, in the shapes an H200's nvidia-smi prints (recorded on the H200
# machine: "GPU 0: NVIDIA H200 (UUID: GPU-...)"; "index, name, memory.total [MiB]" over
# "0, NVIDIA H200, 143771 MiB"; a field it does not know is an error, exit status 2).
"""nvidia-smi's list and CSV queries, from mpsd's status."""

from __future__ import annotations

from typing import Any, Callable

import psutil

__all__ = ["APP_FIELDS", "GPU_FIELDS", "MiB", "QueryError", "compute_apps", "csv", "list_gpus", "process_name"]

MiB = 1 << 20


class QueryError(ValueError):
    """A query names a field nvidia-smi would refuse; the message is nvidia-smi's."""


def _mib(nbytes: int) -> int:
    return round(nbytes / MiB)  # to the nearest, as nvidia-smi showed 150,109,880,320 bytes free as 143156 MiB


def process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except (psutil.Error, OSError):
        return "[Not Found]"


# The driver the simulated H200 was measured with (bench/fidelity/nvidia_smi_q_h200.txt): what a script that
# reads driver_version, to check what it may use, is told of a device calibrated against it.
DRIVER_VERSION = "580.159.04"
NA = "[N/A]"  # nvidia-smi's answer for a figure the device does not report (no unit after it)

# field -> (its header, its unit, its value from a device or process of the status)
Field = tuple[str, str, Callable[[dict[str, Any], dict[str, Any]], Any]]
GPU_FIELDS: dict[str, Field] = {
    "index": ("index", "", lambda d, s: d["index"]),
    "name": ("name", "", lambda d, s: d["name"]),
    "uuid": ("uuid", "", lambda d, s: d["uuid"]),
    "memory.total": ("memory.total", "MiB", lambda d, s: _mib(d["memory_total"])),
    "memory.used": ("memory.used", "MiB", lambda d, s: _mib(d["memory_used"])),
    "memory.free": ("memory.free", "MiB", lambda d, s: _mib(d["memory_total"] - d["memory_used"])),
    "utilization.gpu": ("utilization.gpu", "%", lambda d, s: round(d["sm_utilization"] * 100)),
    "pci.bus_id": ("pci.bus_id", "", lambda d, s: d.get("pci_bus_id", "[N/A]")),
    "compute_mode": ("compute_mode", "", lambda d, s: d.get("compute_mode", "Default")),
    "count": ("count", "", lambda d, s: len(s["devices"])),
    "driver_version": ("driver_version", "", lambda d, s: d.get("driver_version", DRIVER_VERSION)),
    # A model with no thermals, power or memory-controller counters, and no driver reserve of its own: what
    # nvidia-smi prints for a figure a device does not give.
    "temperature.gpu": ("temperature.gpu", "", lambda d, s: NA),
    "power.draw": ("power.draw", "W", lambda d, s: NA),
    "utilization.memory": ("utilization.memory", "%", lambda d, s: NA),
    "memory.reserved": ("memory.reserved", "MiB", lambda d, s: NA),
    "mig.mode.current": ("mig.mode.current", "", lambda d, s: "Enabled" if d.get("mig") else "Disabled"),
    "clocks.sm": ("clocks.current.sm", "MHz", lambda d, s: d.get("clock_sm_mhz", NA)),
    "clocks.current.sm": ("clocks.current.sm", "MHz", lambda d, s: d.get("clock_sm_mhz", NA)),
}
APP_FIELDS: dict[str, Field] = {
    "pid": ("pid", "", lambda p, s: p["pid"]),
    "process_name": ("process_name", "", lambda p, s: process_name(p["pid"])),
    "used_memory": ("used_gpu_memory", "MiB", lambda p, s: _mib(p["memory"])),
    "used_gpu_memory": ("used_gpu_memory", "MiB", lambda p, s: _mib(p["memory"])),
    "gpu_uuid": ("gpu_uuid", "", lambda p, s: next(d["uuid"] for d in s["devices"] if d["index"] == p["device"])),
}


def compute_apps(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The compute processes nvidia-smi lists: on each device with clients the MPS server (type C), then its
    clients (M+C)."""
    apps = []
    for device in status["devices"]:
        clients = [p for p in status["processes"] if p["device"] == device["index"]]
        if clients:
            apps.append({"pid": status["server_pid"], "device": device["index"], "type": "C",
                         "memory": device.get("server_memory", 0)})
            apps += clients
    return apps


def list_gpus(status: dict[str, Any]) -> str:
    """`nvidia-smi -L`."""
    lines = []
    for d in status["devices"]:
        lines.append(f"GPU {d['index']}: {d['name']} (UUID: {d['uuid']})")
        lines += [f"  MIG {m['profile']:<11} Device {n:>2}: (UUID: {m['uuid']})"
                  for n, m in enumerate(d.get("mig_devices", ()))]
    return "\n".join(lines)


def csv(status: dict[str, Any], kind: str, fields: str, options: str) -> str:
    """`--query-gpu=FIELDS` (kind "gpu") or `--query-compute-apps=FIELDS` (kind "apps"), with `--format`'s
    options after csv (``noheader``, ``nounits``).

    Raises:
        QueryError: a field that does not exist, or a format other than csv.
    """
    table = GPU_FIELDS if kind == "gpu" else APP_FIELDS
    names = [name.strip() for name in fields.split(",") if name.strip()]
    for name in names:
        if name not in table:
            raise QueryError(f'Field "{name}" is not a valid field to query.\n')
    format_options = [o.strip() for o in options.split(",")]
    if format_options[0] != "csv" or not set(format_options[1:]) <= {"noheader", "nounits"}:
        raise QueryError(f'"{options}" is not a valid format: csv, with noheader and nounits')
    units = "nounits" not in format_options
    rows = status["devices"] if kind == "gpu" else compute_apps(status)
    lines = [] if "noheader" in format_options else [", ".join(
        f"{table[n][0]} [{table[n][1]}]" if table[n][1] else table[n][0] for n in names)]
    for row in rows:
        values = []
        for name in names:
            _, unit, value = table[name]
            shown = value(row, status)
            values.append(f"{shown} {unit}" if unit and units and shown != NA else str(shown))
        lines.append(", ".join(values))
    return "\n".join(lines)
