# nvidia-smi's two views for people and the scripts that scrape them, from mpsd's status: the default table
# and `-q` (with `-d` sections), plus `-i` to pick devices. Their shapes follow what an H200's nvidia-smi
# printed on the H200 machine (bench/fidelity/nvidia_smi_q_h200.txt): the table's borders and column widths,
# -q's 55-column keys, "No devices were found" and exit status 6 for an id that names none, "Failed to parse
# --display/-d flags" and 2 for a section it does not know. What a simulated GPU does not have (temperature,
# power, fans, a driver) reads N/A, as nvidia-smi prints for what a board does not report. Under MPS the server
# is a process of type C on each device it serves and every client one of type M+C, as nvidia-smi shows them.
"""nvidia-smi's table and -q report, from mpsd's status."""

from __future__ import annotations

import time
from typing import Any

from mpsd.tools.smi_query import MiB, QueryError, compute_apps, process_name

__all__ = ["DISPLAY_SECTIONS", "NoDevices", "query_report", "select", "table"]

# -d's sections that mpsd can fill, and the -q groups each prints
DISPLAY_SECTIONS = ("MEMORY", "UTILIZATION", "COMPUTE", "PIDS")
_KEY = 55  # -q's keys are padded to this column before ": "
# Compute capability major -> the architecture -q names
_ARCHITECTURES = {7: "Volta", 8: "Ampere", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}
_TABLE_MODES = {"Default": "Default", "Exclusive_Process": "E. Process", "Prohibited": "Prohibited"}
_RULE = "+" + "-" * 89 + "+"
_CELLS = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"


class NoDevices(LookupError):
    """`-i` names no device; nvidia-smi says "No devices were found" and exits with 6."""


def select(status: dict[str, Any], ids: str | None) -> dict[str, Any]:
    """`status` with only the devices `-i` names (indices, full UUIDs or PCI bus ids, comma-separated) and
    their processes.

    Raises:
        NoDevices: one of the ids names no device (a UUID prefix does not count, as nvidia-smi takes none).
    """
    if ids is None:
        return status
    chosen = []
    for token in (t.strip() for t in ids.split(",")):
        found = [d for d in status["devices"] if token in (str(d["index"]), d["uuid"], d.get("pci_bus_id"))
                 or (d.get("pci_bus_id") and token.upper() == d["pci_bus_id"][4:])]
        if not found:
            raise NoDevices(token)
        chosen += [d for d in found if d not in chosen]
    indices = {d["index"] for d in chosen}
    return {**status, "devices": chosen, "processes": [p for p in status["processes"] if p["device"] in indices]}


def _mib(nbytes: int) -> int:
    return round(nbytes / MiB)


def _versions(status: dict[str, Any]) -> tuple[str, str]:
    return str(status.get("driver_version") or "N/A"), str(status.get("cuda_version") or "N/A")


def table(status: dict[str, Any], smi_version: str) -> str:
    """nvidia-smi with no arguments."""
    driver, cuda = _versions(status)
    lines = [time.strftime("%a %b %e %H:%M:%S %Y") + " " * 7, _RULE,
             f"| NVIDIA-SMI {smi_version:<23}Driver Version: {driver:<15}CUDA Version: {cuda:<9}|", _CELLS,
             "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
             "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
             "|                                         |                        |               MIG M. |",
             "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|"]
    for n, d in enumerate(status["devices"]):
        if n:
            lines.append("|" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "|")
        memory = f"{_mib(d['memory_used'])}MiB / {_mib(d['memory_total'])}MiB"
        util = f"{round(d['sm_utilization'] * 100)}%"
        lines += [f"| {d['index']:>3}  {d['name'][:29]:<29}{'N/A':>4}  |   {d.get('pci_bus_id', 'N/A'):<16} Off |"
                  f"{'0':>21} |",
                  f"| {'N/A':>3}{'N/A':>6}{'N/A':>6}{'N/A':>16} / {'N/A':>5} |{memory:>23} |{util:>8}"
                  f"{_TABLE_MODES.get(d.get('compute_mode', 'Default'), 'Default'):>13} |",
                  f"|{'':41}|{'':24}|{'Enabled' if d.get('mig') else 'Disabled':>21} |"]
    lines += [_CELLS, "", _RULE, "| Processes:" + " " * 78 + "|",
              "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
              "|        ID   ID                                                               Usage      |",
              "|" + "=" * 89 + "|"]
    apps = compute_apps(status)
    if not apps:
        lines.append("|  No running processes found" + " " * 61 + "|")
    for p in apps:
        name = process_name(p["pid"])
        name = name if len(name) <= 36 else name[:33] + "..."
        lines.append(f"|{p['device']:>5}{'N/A':>5}{'N/A':>5}{p['pid']:>17}{p['type']:>7}   {name:<36}"
                     f"{str(_mib(p['memory'])) + 'MiB':>10} |")
    lines.append(_RULE)
    return "\n".join(lines)


def _key(indent: int, key: str, value: Any = None) -> str:
    pad = " " * (4 * indent)
    return pad + key if value is None else f"{pad}{key:<{_KEY - 4 * indent}}: {value}"


def query_report(status: dict[str, Any], display: str | None) -> str:
    """`nvidia-smi -q`, or with `-d SECTIONS` only those.

    Raises:
        QueryError: a section name nvidia-smi would not parse, or one mpsd cannot fill.
    """
    sections = set(DISPLAY_SECTIONS)
    if display is not None:
        sections = {s.strip().upper() for s in display.split(",")}
        if not sections or not sections <= set(DISPLAY_SECTIONS):
            raise QueryError("Failed to parse --display/-d flags")
    everything = display is None
    driver, cuda = _versions(status)
    lines = ["", "==============NVSMI LOG==============", "",
             _key(0, "Timestamp", time.strftime("%a %b %e %H:%M:%S %Y")),
             _key(0, "Driver Version", driver), _key(0, "CUDA Version", cuda), "",
             _key(0, "Attached GPUs", len(status["devices"]))]
    apps = compute_apps(status)
    for d in status["devices"]:
        lines.append(f"GPU {d.get('pci_bus_id', d['index'])}")
        mig = "Enabled" if d.get("mig") else "Disabled"
        if everything:
            lines += [_key(1, "Product Name", d["name"]),
                      _key(1, "Product Architecture", _ARCHITECTURES.get(d.get("compute_capability", [0])[0], "N/A")),
                      _key(1, "MIG Mode"), _key(2, "Current", mig), _key(2, "Pending", mig),
                      _key(1, "GPU UUID", d["uuid"]), _key(1, "Minor Number", d["index"])]
            if d.get("pci_bus_id"):
                domain, bus, device = d["pci_bus_id"].replace(".", ":").split(":")[:3]
                lines += [_key(1, "PCI"), _key(2, "Bus", f"0x{bus}"), _key(2, "Device", f"0x{device}"),
                          _key(2, "Domain", f"0x{domain[-4:]}"), _key(2, "Bus Id", d["pci_bus_id"])]
        if "MEMORY" in sections:
            total, used = _mib(d["memory_total"]), _mib(d["memory_used"])
            lines += [_key(1, "FB Memory Usage"), _key(2, "Total", f"{total} MiB"), _key(2, "Reserved", "0 MiB"),
                      _key(2, "Used", f"{used} MiB"), _key(2, "Free", f"{total - used} MiB")]
        if "COMPUTE" in sections:
            lines.append(_key(1, "Compute Mode", d.get("compute_mode", "Default")))
        if "UTILIZATION" in sections:
            lines += [_key(1, "Utilization"), _key(2, "GPU", f"{round(d['sm_utilization'] * 100)} %"),
                      _key(2, "Memory", "N/A")]
        if "PIDS" in sections:
            mine = [p for p in apps if p["device"] == d["index"]]
            if not mine:
                lines.append(_key(1, "Processes", "None"))
            else:
                lines.append(_key(1, "Processes"))
            for p in mine:
                lines += [_key(2, "GPU instance ID", "N/A"), _key(2, "Compute instance ID", "N/A"),
                          _key(2, "Process ID", p["pid"]), _key(3, "Type", p["type"]),
                          _key(3, "Name", process_name(p["pid"])),
                          _key(3, "Used GPU Memory", f"{_mib(p['memory'])} MiB")]
        lines.append("")
    return "\n".join(lines)
