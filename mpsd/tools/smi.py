# `mpsd-smi`: a status table in the spirit of nvidia-smi, from the daemon's control socket. Devices (memory,
# SM utilisation since the last look, counted from the blocks that ended; SMs busy now; the device's own
# policy), the host RAM that simulated memory takes (device memory is sparse memfds: only touched pages cost
# RAM, within the daemon's --host-memory budget), and processes (type M+C as MPS clients show, memory, SM cap,
# priority, sticky error). `--json` prints the same data, with each process's fair-share weight and MIG
# instance, for programs; `-l SECONDS` refreshes. `-L`, `--query-gpu=`, `--query-compute-apps=`, `-q [-d ...]` and
# `-i` print what nvidia-smi prints for them (mpsd.tools.smi_query, smi_views), for scripts that parse it; run
# as `nvidia-smi` (a link of that name, made on request) or with `--smi-name`, the plain view is nvidia-smi's
# table too, so such scripts need no change at all.
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from mpsd.tools.smi_query import APP_FIELDS, GPU_FIELDS, QueryError, csv, list_gpus
from mpsd.tools.smi_views import DISPLAY_SECTIONS, NoDevices, query_report, select, table
from mpsd_protocol import (
    CONTROL_PACKET,
    MpsConnectionError,
    check_server,
    pipe_directory,
    format_size,
    read_control_reply,
)


def query(pipe_dir: Path) -> dict[str, Any]:
    """The daemon's status.

    Raises:
        OSError: no daemon answers at `pipe_dir`.
        MpsConnectionError: the control socket there is served by a user other than root or ours.
        ValueError: its reply is not the status this mpsd-smi reads.
    """
    status = json.loads(command(pipe_dir, "mpsd_status"))
    _check_shape(status)
    return status


# -c's modes, by name or number as nvidia-smi takes them (1, EXCLUSIVE_THREAD, is long gone)
COMPUTE_MODES = {"0": "DEFAULT", "DEFAULT": "DEFAULT", "2": "PROHIBITED", "PROHIBITED": "PROHIBITED",
                 "3": "EXCLUSIVE_PROCESS", "EXCLUSIVE_PROCESS": "EXCLUSIVE_PROCESS"}


def command(pipe_dir: Path, line: str) -> str:
    """Run one control command at the daemon; what it printed (empty: done).

    Raises:
        OSError: no daemon answers at `pipe_dir`.
        MpsConnectionError: the control socket there is served by a user other than root or ours.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(str(pipe_dir / "control"))
        check_server(sock, pipe_dir / "control")
        sock.send(line.encode())
        reply = read_control_reply(lambda: sock.recv(CONTROL_PACKET))
    if reply is None:
        raise ConnectionError("the daemon closed the control connection")
    return reply.decode(errors="replace")


def set_compute_mode(pipe_dir: Path, status: dict[str, Any], mode: str) -> tuple[str, int]:
    """nvidia-smi -c MODE on the devices of `status`: what it prints, and its exit status."""
    wanted = COMPUTE_MODES.get(mode.upper())
    if wanted is None:
        return (f'ERROR: Invalid compute mode "{mode}". Valid modes are DEFAULT (0), PROHIBITED (2) and '
                "EXCLUSIVE_PROCESS (3).", 2)
    lines: list[str] = []
    for device in status["devices"]:
        refused = command(pipe_dir, f"mpsd_compute_mode {device['index']} {wanted}")
        if refused:
            return "\n".join(lines + [f"Setting compute mode to {wanted} for GPU {device.get('pci_bus_id')} "
                                       f"failed: {refused}"]), 4
        lines.append(f"Set compute mode to {wanted} for GPU {device.get('pci_bus_id')}.")
    return "\n".join(lines + ["All done."]), 0


def _check_shape(status: Any) -> None:
    """Raises ValueError unless `status` has what render() reads (an old or foreign daemon may differ)."""
    device_keys = {"index", "name", "memory_used", "memory_total", "sm_utilization", "sms_busy", "policy", "clients"}
    process_keys = {"device", "pid", "type", "uid", "memory", "sm_cap", "active_thread_percentage", "priority",
                    "sticky_error"}
    ok = (isinstance(status, dict) and "server_pid" in status
          and isinstance(status.get("devices"), list) and isinstance(status.get("processes"), list)
          and all(isinstance(d, dict) and device_keys <= d.keys() for d in status["devices"])
          and all(isinstance(p, dict) and process_keys <= p.keys() for p in status["processes"]))
    if not ok:
        raise ValueError("its status reply is not what this mpsd-smi reads")


def render(status: dict[str, Any]) -> str:
    """The table people read."""
    lines = [f"mpsd-smi   server pid {status['server_pid']}   {time.strftime('%Y-%m-%d %H:%M:%S')}", ""]
    lines.append(f"{'GPU':>3}  {'Name':<12} {'Memory used / total':>26}  {'SM util':>7}  {'SMs busy':>8}  "
                 f"{'Policy':<11} {'Clients':>7}")
    for d in status["devices"]:
        memory = f"{format_size(d['memory_used'])} / {format_size(d['memory_total'])}"
        lines.append(f"{d['index']:>3}  {d['name']:<12} {memory:>26}  {d['sm_utilization']:>6.0%}  "
                     f"{d['sms_busy']:>8}  {d['policy']:<11} {d['clients']:>7}")
    host = status.get("host_memory")
    if isinstance(host, dict) and {"resident", "reserved", "budget"} <= host.keys():
        pinned = f", {format_size(host['pinned'])} pinned by clients" if host.get("pinned") else ""
        lines.append(f"Host RAM holding simulated device memory: {format_size(host['resident'])} of a "
                     f"{format_size(host['budget'])} budget ({format_size(host['reserved'])} reserved by queued "
                     f"work{pinned})")
    lines += ["", f"{'GPU':>3}  {'PID':>8}  {'Type':<4}  {'UID':>6}  {'Memory':>10}  {'SMs':>4}  {'ATP':>6}  "
                  f"{'Prio':>4}  Sticky error"]
    if not status["processes"]:
        lines.append("     no processes")
    for p in status["processes"]:
        lines.append(f"{p['device']:>3}  {p['pid']:>8}  {p['type']:<4}  {p['uid']:>6}  {format_size(p['memory']):>10}  "
                     f"{p['sm_cap']:>4}  {p['active_thread_percentage']:>5.1f}%  {p['priority']:>4}  "
                     f"{p['sticky_error'] or '-'}")
    return "\n".join(lines)


def _output(status: dict[str, Any], options: argparse.Namespace) -> str:
    """What one look prints: nvidia-smi's list, CSV, report or table where asked for, else JSON or our table.

    Raises:
        QueryError: options nvidia-smi would refuse (its words).
        NoDevices: -i names no device.
    """
    if options.list_gpus:
        for flag, given in (("-i", options.id is not None), ("-q", options.query)):
            if given:
                raise QueryError(f"ERROR: Option {flag} is not valid for this command. Please run 'nvidia-smi -h' "
                                 "for help.\n")
        return list_gpus(status)
    status = select(status, options.id)
    if options.query_gpu is not None:
        return csv(status, "gpu", options.query_gpu, options.format)
    if options.query_compute_apps is not None:
        return csv(status, "apps", options.query_compute_apps, options.format)
    if options.query or options.display is not None:
        return query_report(status, options.display)
    if options.json:
        return json.dumps(status)
    return table(status, _version()) if options.smi_name else render(status)


def _version() -> str:
    try:
        return "mpsd-" + importlib.metadata.version("mpsd")
    except importlib.metadata.PackageNotFoundError:
        return "mpsd"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpsd-smi", description="Show mpsd's devices and client processes.")
    parser.add_argument("--pipe-dir",
                        help="the daemon's pipe directory (default $CUDA_MPS_PIPE_DIRECTORY, /tmp/nvidia-mps)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("-l", "--loop", type=float, metavar="SECONDS", help="refresh every SECONDS until stopped")
    parser.add_argument("-L", "--list-gpus", action="store_true", help="one line a device, as nvidia-smi -L")
    parser.add_argument("--query-gpu", metavar="FIELDS",
                        help=f"as nvidia-smi: the devices' {', '.join(GPU_FIELDS)}")
    parser.add_argument("--query-compute-apps", metavar="FIELDS",
                        help=f"as nvidia-smi: the client processes' {', '.join(APP_FIELDS)}")
    parser.add_argument("--format", default="csv", help="with a query: csv[,noheader][,nounits] (default csv)")
    parser.add_argument("-q", "--query", action="store_true", help="as nvidia-smi -q: a report of each device")
    parser.add_argument("-d", "--display", metavar="SECTIONS",
                        help=f"with -q: only these sections, comma-separated: {', '.join(DISPLAY_SECTIONS)}")
    parser.add_argument("-i", "--id", metavar="IDS",
                        help="only these devices: indices, UUIDs or PCI bus ids, comma-separated")
    parser.add_argument("-c", "--compute-mode", metavar="MODE",
                        help="set the devices' compute mode (with -i, only those): DEFAULT, PROHIBITED (new "
                             "clients are refused) or EXCLUSIVE_PROCESS, by name or number")
    parser.add_argument("--smi-name", action="store_true",
                        help="behave as nvidia-smi: the plain view is its table (the default when run as nvidia-smi)")
    options = parser.parse_args(argv)
    options.smi_name = options.smi_name or Path(sys.argv[0]).name == "nvidia-smi"
    if options.display is not None and not options.query:
        options.query = True  # nvidia-smi takes -d with -q; alone it means the same
    if options.loop is not None and not options.loop > 0:
        parser.error("-l needs a positive number of seconds")
    pipe_dir = pipe_directory(options.pipe_dir)
    try:
        while True:
            try:
                status = query(pipe_dir)
            except MpsConnectionError as exc:
                print(f"mpsd-smi: {exc.detail}", file=sys.stderr)
                return 1
            except OSError as exc:
                if options.compute_mode is None:
                    print(f"mpsd-smi: no mpsd daemon answers at {pipe_dir}: {exc}", file=sys.stderr)
                    return 1
                # mpsd's devices exist only while its daemon runs; a script that sets the mode before it
                # starts one (as NVIDIA's device plugin does, before nvidia-cuda-mps-control -d) goes on
                print(f"Compute mode not set: no mpsd daemon answers at {pipe_dir}, so it has no devices yet "
                      "(MPS runs them as EXCLUSIVE_PROCESS).")
                return 0
            except ValueError as exc:
                print(f"mpsd-smi: the daemon at {pipe_dir} does not answer as mpsd does: {exc}", file=sys.stderr)
                return 1
            if options.compute_mode is not None:
                try:
                    said, code = set_compute_mode(pipe_dir, select(status, options.id), options.compute_mode)
                except NoDevices:
                    said, code = "No devices were found", 6
                print(said)
                return code
            try:
                print(_output(status, options), flush=True)
            except QueryError as exc:  # nvidia-smi's words, and its exit status (on stdout, as it prints them)
                print(exc)
                return 2
            except NoDevices:
                print("No devices were found")
                return 6
            except BrokenPipeError:  # `mpsd-smi | head`: the reader has what it wanted
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
                return 0
            if options.loop is None:
                return 0
            time.sleep(options.loop)
            if not options.json:
                print()
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
