#!/usr/bin/env python3
# Records what the real nvidia-cuda-mps-control (MPS's legacy, v2, control language) prints for a corpus of
# commands, in each phase of a server's life, for tests/test_control_corpus.py to replay against mpsd.
#
# It runs on the H200 machine, as root, with the standard library only (that machine has no trio and no
# network): every daemon it starts gets fresh CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY directories
# under /tmp, so it neither meets nor disturbs another MPS. For each invocation of the tool it keeps the
# argv, the bytes given on stdin, stdout, stderr, the exit status, the wall time, and the lines that
# control.log and server.log gained (read once both logs have been still for a moment, since the server
# writes its lines from another process). Clients are small ctypes programs over libcuda (cuInit, the primary
# context, one cuMemAlloc), which start in a fraction of the time torch takes and whose later calls report the
# driver's error codes as they are.
#
# Bytes are kept as latin-1 text in the JSON, which maps every byte to one character and back.
from __future__ import annotations

import json
import os
import platform
import pty
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time

OUT = os.environ.get("OUT") or "out"
START = time.monotonic()
DEADLINE = float(os.environ.get("RECORD_SECONDS", "480"))  # leave the run's limit room for the copy back
RECORDS: list[dict] = []
NOTES: list[str] = []
BOGUS = "99999"  # a pid no server has
DAEMONS: list = []


def find_tool(name: str) -> str:
    for path in (shutil.which(name), f"/usr/local/nvidia/bin/{name}", f"/usr/bin/{name}"):
        if path and os.path.exists(path):
            return path
    raise SystemExit(f"{name} not found")


MPS = find_tool("nvidia-cuda-mps-control")

CLIENT = r'''
import ctypes, json, os, sys
cuda = ctypes.CDLL("libcuda.so.1")
out = {"pid": os.getpid()}
out["cuInit"] = cuda.cuInit(0)
dev = ctypes.c_int()
out["cuDeviceGet"] = cuda.cuDeviceGet(ctypes.byref(dev), 0)
ctx = ctypes.c_void_p()
out["cuDevicePrimaryCtxRetain"] = cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
out["cuCtxSetCurrent"] = cuda.cuCtxSetCurrent(ctx)
ptr = ctypes.c_uint64()
out["cuMemAlloc"] = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20))
print(json.dumps(out), flush=True)
for line in sys.stdin:
    word = line.split()[0] if line.split() else ""
    if word == "exit":
        break
    if word == "alloc":
        size = int(line.split()[1]) if len(line.split()) > 1 else 1 << 20
        p = ctypes.c_uint64()
        r = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size))
        print(json.dumps({"cuMemAlloc": r, "cuCtxSynchronize": cuda.cuCtxSynchronize()}), flush=True)
'''


def text(data: bytes | None) -> str:
    return (data or b"").decode("latin-1")


def elapsed() -> float:
    return time.monotonic() - START


class Daemon:
    """One control daemon's directories and the logs' read positions."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.base = tempfile.mkdtemp(prefix=f"mpsrec-{name}-")
        self.pipe, self.log = f"{self.base}/pipe", f"{self.base}/log"
        os.makedirs(self.pipe)
        os.makedirs(self.log)
        self.env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": self.pipe, "CUDA_MPS_LOG_DIRECTORY": self.log}
        self.offsets = {"control": 0, "server": 0}
        self.vars = {"server": BOGUS, "client": BOGUS, "client2": BOGUS}
        self.clients: list[Client] = []
        DAEMONS.append(self)

    def sizes(self) -> tuple[int, int]:
        return tuple(os.path.getsize(f"{self.log}/{n}.log") if os.path.exists(f"{self.log}/{n}.log") else 0
                     for n in ("control", "server"))

    def settle(self, quiet: float = 0.2, limit: float = 3.0) -> None:
        """Wait until neither log has grown for `quiet` seconds (at most `limit`)."""
        end, last, still = time.monotonic() + limit, self.sizes(), time.monotonic()
        while time.monotonic() < end:
            time.sleep(0.05)
            now = self.sizes()
            if now != last:
                last, still = now, time.monotonic()
            elif time.monotonic() - still >= quiet:
                return

    def new_lines(self) -> dict[str, list[str]]:
        lines = {}
        for name in ("control", "server"):
            path = f"{self.log}/{name}.log"
            if not os.path.exists(path):
                lines[name] = []
                continue
            with open(path, "rb") as f:
                f.seek(self.offsets[name])
                data = f.read()
            self.offsets[name] += len(data)
            lines[name] = text(data).splitlines()
        return lines

    def listing(self) -> list[str]:
        rows = []
        for entry in sorted(os.listdir(self.pipe)):
            st = os.lstat(f"{self.pipe}/{entry}")
            rows.append(f"{oct(st.st_mode)} {st.st_uid} {entry}")
        return rows


def record(d: Daemon, phase: str, template: str | bytes, args: tuple[str, ...] = (), *, timeout: float = 20,
           settle: bool = True, note: str = "") -> dict:
    """Run the tool once with `template` (its {server}, {client}, {client2} filled in) on stdin."""
    raw = template if isinstance(template, bytes) else template.format(**d.vars).encode("latin-1")
    d.new_lines()  # whatever came in since the last record belongs to no command
    started = time.monotonic()
    # Output to files, not pipes: with -d the daemon it forks could hold a pipe open long after the tool exits.
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        try:
            rc = subprocess.run([MPS, *args], input=raw, stdout=out_file, stderr=err_file, env=d.env,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
    seconds = time.monotonic() - started
    if settle:
        d.settle()
    logs = d.new_lines()
    entry = {"kind": "control", "daemon": d.name, "phase": phase, "args": list(args),
             "template": text(template) if isinstance(template, bytes) else template, "stdin": text(raw),
             "vars": dict(d.vars), "stdout": text(out), "stderr": text(err), "rc": rc,
             "seconds": round(seconds, 3), "control_log": logs["control"], "server_log": logs["server"]}
    if note:
        entry["note"] = note
    RECORDS.append(entry)
    return entry


def event(d: Daemon, phase: str, what: str, **data) -> dict:
    d.settle()
    logs = d.new_lines()
    entry = {"kind": "event", "daemon": d.name, "phase": phase, "what": what, **data,
             "control_log": logs["control"], "server_log": logs["server"]}
    RECORDS.append(entry)
    return entry


class Client:
    def __init__(self, d: Daemon, phase: str, script: str, label: str) -> None:
        self.d, self.label = d, label
        self.proc = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=d.env)
        first = self._line(30)
        self.pid = str(self.proc.pid)
        event(d, phase, f"client {label} started", client_pid=self.pid, reply=first)
        d.clients.append(self)

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().decode().strip() if ready else "(no answer)"

    def ask(self, phase: str, command: str, timeout: float = 15) -> str:
        try:
            self.proc.stdin.write(command.encode() + b"\n")
            self.proc.stdin.flush()
            reply = self._line(timeout)
        except (BrokenPipeError, ValueError):
            reply = "(gone)"
        event(self.d, phase, f"client {self.label}: {command}", reply=reply)
        return reply

    def close(self, phase: str) -> None:
        try:
            self.proc.stdin.write(b"exit\n")
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = f"killed ({self.proc.wait()})"
        err = self.proc.stderr.read().decode(errors="replace")[-2000:]
        if self in self.d.clients:
            self.d.clients.remove(self)
        event(self.d, phase, f"client {self.label} exited", rc=rc, stderr=err)


def start(d: Daemon, phase: str = "start") -> dict:
    entry = record(d, phase, b"", ("-d",))
    entry["pipe_dir"] = d.listing()
    pid_file = f"{d.pipe}/nvidia-cuda-mps-control.pid"
    entry["pid_file"] = open(pid_file).read() if os.path.exists(pid_file) else None
    entry["processes"] = mps_processes()
    return entry


def mps_processes() -> list[str]:
    rows = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = open(f"/proc/{pid}/comm").read().strip()
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if "mps" in comm:
            rows.append(f"{pid} comm={comm} cmdline={cmdline}")
    return rows


def alive(d: Daemon) -> bool:
    """Whether the daemon runs: a zombie does not (the machine's init reaps no orphans, so a daemon that
    died stays a zombie, and kill(pid, 0) still succeeds on it)."""
    try:
        pid = int(open(f"{d.pipe}/nvidia-cuda-mps-control.pid").read())
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def stop(d: Daemon, phase: str) -> None:
    for client in list(d.clients):
        client.close(phase)
    if alive(d):
        record(d, phase, "quit\n", note="clean-up")
        for _ in range(50):
            if not alive(d):
                break
            time.sleep(0.1)
    event(d, phase, "stopped", pipe_dir=d.listing() if os.path.isdir(d.pipe) else None, processes=mps_processes())


def server_of(d: Daemon, phase: str) -> str:
    out = record(d, phase, "get_server_list\n")["stdout"].split()
    d.vars["server"] = out[0] if out else BOGUS
    return d.vars["server"]


# What every phase asks: commands that change nothing (and their wrong forms).
READ_ONLY = [
    "get_server_list\n",
    "get_server_list extra tokens\n",
    "get_server_status {server}\n",
    f"get_server_status {BOGUS}\n",
    "get_server_status\n",
    "get_server_status abc\n",
    "get_client_list {server}\n",
    f"get_client_list {BOGUS}\n",
    "get_client_list\n",
    "get_client_list {client}\n",
    "get_device_client_list\n",
    "get_device_client_list {server}\n",
    f"get_device_client_list {BOGUS}\n",
    "get_default_active_thread_percentage\n",
    "get_active_thread_percentage {server}\n",
    "get_active_thread_percentage {client}\n",
    f"get_active_thread_percentage {BOGUS}\n",
    "get_active_thread_percentage\n",
    "get_default_device_pinned_mem_limit 0\n",
    "get_default_device_pinned_mem_limit 1\n",
    "get_default_device_pinned_mem_limit\n",
    "get_default_device_pinned_mem_limit x\n",
    "get_device_pinned_mem_limit {server} 0\n",
    "get_device_pinned_mem_limit {server} 1\n",
    f"get_device_pinned_mem_limit {BOGUS} 0\n",
    "get_device_pinned_mem_limit {server}\n",
    "get_device_pinned_mem_limit\n",
    "get_default_client_priority\n",
    "get_client_priority\n",
    "ps\n",
    "ps -p {client}\n",
    f"ps -p {BOGUS}\n",
    "ps -p\n",
    "ps -x\n",
    "ps extra\n",
    "device_query\n",
    "device_query {server}\n",
    f"device_query {BOGUS}\n",
    "device_query --csv\n",
    "lspart\n",
    "sm_partition\n",
    "sm_partition list\n",
]

# Commands that change settings, each followed by the matching get, so that the value as stored shows.
SETTINGS = (
    [f"set_default_active_thread_percentage {v}\nget_default_active_thread_percentage\n"
     for v in ("50", "0", "100", "101", "-1", "12.5", "12.345", "abc", "1e1", "50abc", "0.0001", "050")]
    + ["set_default_active_thread_percentage\n", "set_default_active_thread_percentage 50 extra\n",
       "set_default_active_thread_percentage 100\n"]
    + [f"set_default_device_pinned_mem_limit 0 {v}\nget_default_device_pinned_mem_limit 0\n"
       for v in ("1G", "512M", "1024", "1.5G", "10g", "2048K", "2048k", "1T", "1GB", "1MB", "1B", "0", "-1", "abc",
                 "99999999999999999999", "0x10", "1e9", "900M", "G", "1 G", "1.5", "4096M")]
    + ["set_default_device_pinned_mem_limit 0\n", "set_default_device_pinned_mem_limit\n",
       "set_default_device_pinned_mem_limit 5 1G\nget_default_device_pinned_mem_limit 5\n",
       "set_default_device_pinned_mem_limit x 1G\n", "set_default_device_pinned_mem_limit -1 1G\n",
       "set_default_device_pinned_mem_limit 0 1G extra\nget_default_device_pinned_mem_limit 0\n"]
    + [f"set_default_client_priority {v}\nget_default_client_priority\n"
       for v in ("1", "0", "2", "-1", "abc", "1.0", "01", " 1")]
    + ["set_default_client_priority\n", "set_default_client_priority 0 extra\nget_default_client_priority\n"]
)

# Commands naming a server (its pid, {server}, or one that is not).
SERVER_SETTINGS = (
    [f"set_active_thread_percentage {{server}} {v}\nget_active_thread_percentage {{server}}\n"
     for v in ("50", "150", "abc", "25.5", "100")]
    + [f"set_active_thread_percentage {BOGUS} 50\n", "set_active_thread_percentage {client} 50\n",
       "set_active_thread_percentage {server}\n", "set_active_thread_percentage\n"]
    + [f"set_device_pinned_mem_limit {{server}} 0 {v}\nget_device_pinned_mem_limit {{server}} 0\n"
       for v in ("1G", "512M", "1024", "abc", "-1", "0")]
    + [f"set_device_pinned_mem_limit {BOGUS} 0 1G\n", "set_device_pinned_mem_limit {server} 0\n",
       "set_device_pinned_mem_limit {server} 5 1G\n", "set_device_pinned_mem_limit\n",
       "set_device_pinned_mem_limit {client} 0 1G\n"]
)

# The parser's edges: case, spacing, several lines, a last line without newline, odd bytes.
PARSING = [
    "GET_SERVER_LIST\n", "Get_Server_List\n", "help\n", "Help\n", "get_server_list\r\n",
    "  get_default_active_thread_percentage\n", "get_default_active_thread_percentage   \n",
    "\tget_default_active_thread_percentage\n", "get_default_active_thread_percentage\textra\n",
    "get_default_active_thread_percentage extra tokens\n", "\n", "\n\n\n", "   \n", "# a comment\n",
    "get_default_active_thread_percentage\nget_default_client_priority\nhelp\nget_server_list\n",
    "get_default_client_priority", "help", "get_default_active_thread_percentage\n\nget_default_client_priority",
    "x" * 300 + "\n", "get_default_client_priority " + "y" * 5000 + "\n", "w" * 4000 + "\n",
    "help me please\n", "unknown_command arg\nget_default_client_priority\n", '"help"\n', "'help'\n",
    "get_default_client_priority;help\n", "quit_not\n", "quitx\n",
    "start_server\n", "start_server -uid\n", "start_server -uid abc\n", "start_server 0\n", "start_server -u 0\n",
    "start_server -uid -1\n",
    "shutdown_server\n", f"shutdown_server {BOGUS}\n", "shutdown_server abc\n", f"shutdown_server {BOGUS} -f\n",
    "shutdown_server {server} -x\n",
    "terminate_client\n", "terminate_client {server}\n", f"terminate_client {BOGUS} 1\n",
    f"terminate_client {{server}} {BOGUS}\n", "terminate_client {server} abc\n",
    "quit -x\n", "quit -t\n", "quit -t abc\n", "quit extra\n",
]
# Lines that may end the daemon (a 5000-byte token did, on the first try: its answer passed 4096 bytes),
# and the variants of quit: each goes last, to a fresh daemon where the one before has gone.
LAST = [b"\xff\xfe\n", b"get_default_client_priority\x00junk\n", b"\x00\n", "z" * 5000 + "\n"]


def phase_commands(d: Daemon, phase: str, commands: list) -> None:
    for command in commands:
        if elapsed() > DEADLINE:
            NOTES.append(f"deadline: skipped the rest of {phase}")
            return
        if not alive(d):
            NOTES.append(f"{phase}: daemon {d.name} gone before {command!r}")
            return
        record(d, phase, command)


def flags() -> None:
    """The tool's options, each against a daemon of its own (an option may start one)."""
    for args in (("-h",), ("--help",), ("-v",), ("--version",), ("-q",), ("-S",), ("-p", "3"), ("-p", "2"),
                 ("-x",), ("-d", "extra"), ("-m",), ("--protocol", "3"), ("-multiuser-server",)):
        d = Daemon("flags")
        try:
            record(d, "flags", b"get_server_list\n", args, timeout=5)
        finally:
            RECORDS[-1]["pipe_dir"] = d.listing()
            RECORDS[-1]["processes"] = mps_processes()
            if alive(d):
                record(d, "flags", "quit\n", note="clean-up")
                time.sleep(0.5)
    # -f runs in the foreground: what it prints to the terminal, then quit from another invocation
    d = Daemon("foreground")
    proc = subprocess.Popen([MPS, "-f"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=d.env)
    time.sleep(1.5)
    record(d, "foreground", "get_default_active_thread_percentage\n")
    record(d, "foreground", "quit\n")
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    event(d, "foreground", "-f exited", rc=proc.returncode, stdout=text(out), stderr=text(err))


def interactive(d: Daemon, phase: str) -> None:
    """The tool on a terminal: what it prints (a prompt?) and when, one line at a time, then EOF."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([MPS], stdin=slave, stdout=slave, stderr=slave, env=d.env, close_fds=True)
    os.close(slave)
    t0, transcript = time.monotonic(), []

    def drain(quiet: float) -> None:
        while True:
            ready, _, _ = select.select([master], [], [], quiet)
            if not ready:
                return
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            transcript.append([round(time.monotonic() - t0, 3), "out", text(data)])

    drain(1.0)
    for line in (b"get_default_active_thread_percentage\n", b"help\n", b"get_server_list\n",
                 b"set_default_active_thread_percentage 60\n", b"get_default_active_thread_percentage\n",
                 b"set_default_active_thread_percentage 100\n", b"\n", b"get_default_client_priority\n"):
        transcript.append([round(time.monotonic() - t0, 3), "in", text(line)])
        os.write(master, line)
        drain(0.7)
    transcript.append([round(time.monotonic() - t0, 3), "in", "\x04"])
    os.write(master, b"\x04")
    drain(1.0)
    try:
        rc = proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = f"killed ({proc.wait()})"
    os.close(master)
    event(d, phase, "interactive on a pty", transcript=transcript, rc=rc)

    # stdin a pipe held open: does an answer come before EOF?
    proc = subprocess.Popen([MPS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=d.env)
    t0, transcript = time.monotonic(), []
    for line in (b"get_default_active_thread_percentage\n", b"help\n", b"get_default_client_priority"):
        transcript.append([round(time.monotonic() - t0, 3), "in", text(line)])
        proc.stdin.write(line)
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            transcript.append([round(time.monotonic() - t0, 3), "out", text(os.read(proc.stdout.fileno(), 65536))])
    transcript.append([round(time.monotonic() - t0, 3), "in", "(close)"])
    proc.stdin.close()
    proc.stdin = None  # closed here, so that communicate only reads
    out, err = proc.communicate(timeout=10)
    transcript.append([round(time.monotonic() - t0, 3), "out", text(out)])
    event(d, phase, "stdin a pipe held open", transcript=transcript, rc=proc.returncode, stderr=text(err))


def quit_while_clients(script: str) -> None:
    """quit, and quit -t, with a live client: how long they take, what they print, what the client sees."""
    for variant in ("quit\n", "quit -t 3\n"):
        d = Daemon("quit")
        phase = f"{variant.strip()} with a client"
        start(d, phase)
        client = Client(d, phase, script, "q")
        d.vars["client"] = client.pid
        server_of(d, phase)
        d.new_lines()
        started = time.monotonic()
        proc = subprocess.Popen([MPS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=d.env)
        proc.stdin.write(variant.encode())
        proc.stdin.close()
        proc.stdin = None
        polls = []
        for _ in range(12):  # 6 s: is quit still waiting? does the daemon still answer?
            time.sleep(0.5)
            polls.append([round(time.monotonic() - started, 2), proc.poll()])
            if proc.poll() is not None:
                break
        event(d, phase, f"{variant.strip()} sent", polls=polls, still_running=proc.poll() is None,
              processes=mps_processes())
        if alive(d):
            record(d, phase, "get_server_list\n", timeout=5, note="while quit waits")
            record(d, phase, "get_default_active_thread_percentage\n", timeout=5, note="while quit waits")
        client.ask(phase, "alloc")
        client.close(phase)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        event(d, phase, f"{variant.strip()} returned", rc=proc.returncode, stdout=text(out), stderr=text(err),
              seconds=round(time.monotonic() - started, 2), pipe_dir=d.listing(), processes=mps_processes())
        stop(d, phase)


def extra(script: str) -> None:
    """The third run's questions: quit's wrong forms (each on a fresh daemon, since the second run's
    5000-byte line ended its daemon before them), how limits print past 1G and below it, and where ps takes a
    client's COMMAND from (argv[0] or the executable)."""
    for command in ("quit -x\n", "quit -t\n", "quit -t abc\n", "quit extra\n", "quit -t 0\n"):
        d = Daemon("quit-forms")
        start(d, "quit forms")
        record(d, "quit forms", command)
        time.sleep(0.3)
        event(d, "quit forms", "after", alive=alive(d), pipe_dir=d.listing())
        stop(d, "quit forms")
    d = Daemon("limits")
    start(d, "limits")
    phase_commands(d, "limits", [
        f"set_default_device_pinned_mem_limit 0 {v}\nget_default_device_pinned_mem_limit 0\n"
        for v in ("1536M", "1025M", "2047M", "1023M", "512m", "0.5G", "3g", "+5G", " 7G", "1048575M",
                  "1048576M", "17179869184G", "5000000G", "12.7M", "0M", "-0")])
    # ps's COMMAND: a client whose argv[0] is not its executable
    proc_argv = ["renamed-client", script, "--an-argument"]
    client = Client.__new__(Client)
    client.d, client.label = d, "argv0"
    client.proc = subprocess.Popen(proc_argv, executable=sys.executable, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=d.env)
    client.pid = str(client.proc.pid)
    event(d, "limits", "client argv0 started", client_pid=client.pid, reply=client._line(30))
    d.clients.append(client)
    d.vars["client"] = client.pid
    server_of(d, "limits")
    phase_commands(d, "limits", ["ps\n", "ps -p {server}\n", "get_device_client_list {server}\n",
                                 f"terminate_client {{server}} {BOGUS}\n", "terminate_client {server} abc\n",
                                 "terminate_client {server}\n", "get_client_list {server} extra\n",
                                 "get_device_pinned_mem_limit {server} 0\n", "get_server_status {server}\n"])
    stop(d, "limits")


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    script = os.path.join(tempfile.mkdtemp(prefix="mpsrec-client-"), "mps_client.py")
    with open(script, "w") as f:
        f.write(CLIENT)
    if sys.argv[1:] == ["--extra"]:
        try:
            extra(script)
        except Exception:
            import traceback
            NOTES.append("failed: " + traceback.format_exc())
        finally:
            for left in DAEMONS:
                if alive(left):
                    stop(left, "final clean-up")
            with open(f"{OUT}/corpus_extra.json", "w") as f:
                json.dump({"meta": {"notes": NOTES, "seconds": round(elapsed(), 1)}, "records": RECORDS}, f,
                          indent=1)
        print(f"{len(RECORDS)} records in {elapsed():.0f} s; notes: {NOTES}")
        return 0
    meta = {"tool": MPS, "uname": platform.uname()._asdict(), "uid": os.getuid(), "python": sys.version,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    try:
        meta["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid,driver_version,memory.total",
                                             "--format=csv"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        meta["nvidia_smi"] = repr(exc)
    try:
        # the tool's own texts, which name every message it can print (facts to match, not code)
        for name in ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
            path = os.path.join(os.path.dirname(MPS), name)
            with open(path, "rb") as f:
                found = re.findall(rb"[\x20-\x7e\t]{4,}", f.read())
            with open(f"{OUT}/strings_{name.split('-')[-1]}.txt", "wb") as f:
                f.write(b"\n".join(found) + b"\n")
    except OSError as exc:
        NOTES.append(f"strings: {exc!r}")

    try:
        # 1. no daemon
        d = Daemon("main")
        record(d, "no daemon", "get_server_list\n")
        record(d, "no daemon", "get_default_active_thread_percentage\nhelp\n")
        record(d, "no daemon", "quit\n")
        # 2. the daemon up, no server yet
        start(d)
        record(d, "start", b"", ("-d",), note="a second -d")
        phase_commands(d, "idle", READ_ONLY + PARSING[:-4])
        phase_commands(d, "idle", SETTINGS + SERVER_SETTINGS)
        interactive(d, "idle")
        # 3. a server started by start_server, with no client
        record(d, "start_server", "start_server -uid 0\n")
        server_of(d, "start_server")
        record(d, "start_server", "start_server -uid 0\n", note="again, with a server")
        record(d, "start_server", "start_server -uid 65534\n", note="another user, with a server")
        phase_commands(d, "server, no client", READ_ONLY[:12] + ["ps\n", "device_query\n"])
        # 4. a client on it
        client = Client(d, "active", script, "a")
        d.vars["client"] = client.pid
        server_of(d, "active")
        phase_commands(d, "active", READ_ONLY + SERVER_SETTINGS)
        client2 = Client(d, "active", script, "b")
        d.vars["client2"] = client2.pid
        phase_commands(d, "two clients", ["get_client_list {server}\n", "ps\n", "ps -p {client2}\n",
                                          "get_device_client_list\n", "device_query\n",
                                          "terminate_client {server} {client2}\n"])
        client2.ask("two clients", "alloc")
        phase_commands(d, "two clients", ["get_client_list {server}\n", "ps\n",
                                          "terminate_client {server} {client2}\n"])
        client2.close("two clients")
        client.ask("active", "alloc")
        # 5. its client gone, the server still up
        client.close("client gone")
        phase_commands(d, "client gone", READ_ONLY[:14] + ["ps\n", "device_query\n"])
        # 6. shutdown_server with a live client: the server goes once its client has
        client = Client(d, "shutdown", script, "c")
        d.vars["client"] = client.pid
        server_of(d, "shutdown")
        record(d, "shutdown", "shutdown_server {server}\n")
        phase_commands(d, "shutting down", ["get_server_list\n", "get_server_status {server}\n",
                                            "get_client_list {server}\n", "ps\n", "device_query\n",
                                            "shutdown_server {server}\n"])
        client.ask("shutting down", "alloc")
        late = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=d.env)  # a new client while it shuts down
        time.sleep(2)
        event(d, "shutting down", "a new client meanwhile", still_starting=late.poll() is None)
        client.close("shutting down")
        time.sleep(1)
        phase_commands(d, "shut down", ["get_server_list\n", "ps\n"])
        try:
            late_out, late_err = late.communicate(b"alloc\nexit\n", timeout=30)
        except subprocess.TimeoutExpired:
            late.kill()
            late_out, late_err = late.communicate()
        event(d, "shut down", "the new client's fate", stdout=text(late_out), stderr=text(late_err)[-2000:],
              rc=late.returncode)
        server_of(d, "shut down")
        # 7. shutdown_server -f with a live client: what the client gets
        client = Client(d, "shutdown -f", script, "f")
        d.vars["client"] = client.pid
        server_of(d, "shutdown -f")
        record(d, "shutdown -f", "shutdown_server {server} -f\n")
        phase_commands(d, "shutdown -f", ["get_server_list\n", "get_server_status {server}\n", "ps\n"])
        client.ask("shutdown -f", "alloc")
        client.ask("shutdown -f", "alloc")
        client.close("shutdown -f")
        phase_commands(d, "shutdown -f", ["get_server_list\n"])
        # 8. terminate_client's client, afterwards
        client = Client(d, "terminate", script, "t")
        d.vars["client"] = client.pid
        server_of(d, "terminate")
        record(d, "terminate", "terminate_client {server} {client}\n")
        client.ask("terminate", "alloc")
        phase_commands(d, "terminate", ["get_client_list {server}\n", "ps\n"])
        client.close("terminate")
        # 9. settings a new server starts with: server.log's lines
        phase_commands(d, "settings then server", ["get_server_list\n", "shutdown_server {server}\n"])
        time.sleep(1)
        phase_commands(d, "settings then server", [
            "set_default_active_thread_percentage 40\n", "set_default_device_pinned_mem_limit 0 2G\n",
            "set_default_client_priority 1\n"])
        client = Client(d, "settings then server", script, "s")
        d.vars["client"] = client.pid
        server_of(d, "settings then server")
        phase_commands(d, "settings then server", ["get_active_thread_percentage {server}\n",
                                                   "get_device_pinned_mem_limit {server} 0\n", "ps\n",
                                                   "device_query\n"])
        client.ask("settings then server", f"alloc {3 << 30}")
        client.close("settings then server")
        for command in LAST + PARSING[-4:]:  # each of these may end the daemon: a fresh one where it did
            if not alive(d):
                stop(d, "end")
                d = Daemon("quit-parsing")
                start(d, "late parsing")
            record(d, "late parsing", command)
        stop(d, "end")
        # 10. quit with live clients; the options
        if elapsed() < DEADLINE:
            quit_while_clients(script)
        if elapsed() < DEADLINE:
            flags()
    except Exception as exc:  # keep what was recorded
        import traceback
        NOTES.append("failed: " + traceback.format_exc())
        print(f"failed: {exc!r}", file=sys.stderr)
    finally:
        for left in DAEMONS:
            if alive(left):
                try:
                    stop(left, "final clean-up")
                except Exception as exc:
                    NOTES.append(f"clean-up of {left.name}: {exc!r}")
        for proc_pid in [r.split()[0] for r in mps_processes()]:
            NOTES.append(f"left running at the end: {proc_pid}")
        meta["seconds"] = round(elapsed(), 1)
        meta["notes"] = NOTES
        with open(f"{OUT}/corpus.json", "w") as f:
            json.dump({"meta": meta, "records": RECORDS}, f, indent=1)
    print(f"{len(RECORDS)} records in {elapsed():.0f} s; notes: {NOTES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
