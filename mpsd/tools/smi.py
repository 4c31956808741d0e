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
from mpsd_protocol import (  # type: ignore[attr-defined]
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
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(str(pipe_dir / "control"))
        check_server(sock, pipe_dir / "control")
        sock.send(b"mpsd_status")
        reply = read_control_reply(lambda: sock.recv(CONTROL_PACKET))
    if reply is None:
        raise ConnectionError("the daemon closed the control connection")
    status = json.loads(reply)
    _check_shape(status)
    return status


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
        lines.append(f"Host RAM holding simulated device memory: {format_size(host['resident'])} of a "
                     f"{format_size(host['budget'])} budget ({format_size(host['reserved'])} reserved by queued work)")
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
            except (OSError, ValueError) as exc:
                print(f"mpsd-smi: no mpsd daemon answers at {pipe_dir}: {exc}", file=sys.stderr)
                return 1
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
