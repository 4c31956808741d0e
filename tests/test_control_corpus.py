# What the real nvidia-cuda-mps-control printed on an H200 (bench/fidelity/mps_control_h200: record.py, run
# as root against driver 580, and its corpus.json and corpus_extra.json), replayed against mpsd: the same
# commands, in the same order, each record's stdout, stderr, exit status and log lines compared. Two tiers:
# every record of a daemon's life runs on mpsd's control interpreters alone, in-process (the control plane is
# sans-IO: a line and the state in, the reply and the actions out), with a fake H200 and fake clients whose
# arrivals and exits are what the daemon tells the control plane; and a dozen records, the daemon's start,
# the tool's own ways (a terminal, a pipe held open) and a server's life with a client, run on one mpsd daemon
# started with `nvidia-cuda-mps-control -d`, with client processes, so that the daemon is seen to apply the
# actions over its sockets as MPS behaves. The options, quit's forms and its timed retries run on real daemons.
#
# What differs by nature is normalised on both sides, and only that: times; pids (the control daemon's and
# every server's become <mps>: each server has its nvidia-cuda-mps-server process, as MPS's, whose pid a
# record's command is given where the recording gave its server's; each client's its label); GPU UUIDs and PCI
# ids; the namespace inode and command ps shows; the temporary directories; the junk MPS's server logs as the
# pid of a client's first request; the delay MPS names when it will try a refused shutdown again (the replay's
# daemon waits a minute, so that a retry's timing cannot change the state a later record sees; test_quit_* check
# the retries themselves). A normalised value keeps its column's width, so ps's and device_query's columns are
# still compared byte for byte. control.log is compared line for line, without the lines of timed retries;
# server.log must hold MPS's lines in MPS's order (mpsd writes lines of its own there too, which its other tests
# read). A client's calls compare by the CUDA errors they got.
from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from daemons import short_tempdir
from mpsd.daemon.control import Control
from mpsd.daemon.control_state import (
    Answer,
    ControlState,
    CutOff,
    Defer,
    EndServer,
    Log,
    Reconfigure,
    ServerChanged,
    Settings,
    StartServer,
    Stop,
    Terminate,
    Then,
    Wake,
)
from mpsd.daemon.control_text import PS_HEADER, atoi, device_table, limit_text, memory_limit, ps_row
from mpsd.daemon.servlog import log_line
from mpsd.tools.control import LINE, talk

DATA = Path(__file__).parent.parent / "bench" / "fidelity" / "mps_control_h200"
CORPUS = json.loads((DATA / "corpus.json").read_text())["records"]
EXTRA = json.loads((DATA / "corpus_extra.json").read_text())["records"]
BIN = Path(sys.executable).parent
TOOL = BIN / "nvidia-cuda-mps-control"
BOGUS = "99999"
RETRY = "60"  # the replay daemon's first shutdown retry, in seconds: none falls due during the replay

# Where mpsd knowingly differs from what was recorded, and why (strict xfail: each must still differ).
DIFFERENT = {
    169: "MPS's server for uid 65534 exited at once (its log does not say why: likely the root-only pipe "
         "directory); mpsd's serves that user",
    327: "MPS's daemon crashed on the 4,113-byte answer to a 5000-byte line (its answer was cut at 4096 bytes, "
         "then nothing); mpsd answers the whole of it and the line's rest",
}
# The H200's tool (binary version 13000, driver 580) predates MPS v3 and took -p/--protocol for an unknown
# option; NVIDIA's v3 documentation (releases 615 and 620) gives it -p/--protocol 2|3, which mpsd follows
# (issue 16, item 3): without a daemon, -p 2 and -p 3 now say that there is none.
PROTOCOL_OPTION = ("-p/--protocol selects MPS v3's protocol in NVIDIA's documentation (releases 615, 620); the "
                   "H200's older tool did not know the option")
DIFFERENT.update({358: PROTOCOL_OPTION, 359: PROTOCOL_OPTION, 364: PROTOCOL_OPTION})
# Likewise -S/--static-partitioning, CUDA 13.1's (control 13010) in NVIDIA's documentation, which mpsd follows
# (issue 16, item 3); the H200's tool took it for an unknown option.
DIFFERENT[357] = ("-S/--static-partitioning is CUDA 13.1's option in NVIDIA's documentation; the H200's older "
                  "tool did not know it")
LAST = 327  # the main daemon died there: what came after it is the recorder's clean-up


def _main_records() -> list[tuple[int, dict]]:
    return [(i, r) for i, r in enumerate(CORPUS) if r["daemon"] == "main" and 3 <= i <= LAST]


# -- normalisation ---------------------------------------------------------------------------------------

_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (\w+) +(-?\d+)\] ")
_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_UUID22 = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}(?![-0-9a-f])")
_PCI = re.compile(r"\b[0-9a-f]{4}:[0-9a-f]{2}\.[0-9a-f]{2}\.[0-9a-f]{2}\b")
_PCI_SHORT = re.compile(r"^(\[\d+\] )[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f],", re.M)
_REQUEST = re.compile(r"Received new client request for \{PID: -?\d+, Context ID: -?\d+\}")
_AGAIN = re.compile(r"again in at most \d+ms")
_SHM = re.compile(r"mps\.shm\.0\.\d+")
_TIMED = ("Server has been notified to shutdown", "Server was unable to shutdown due to")


@dataclass
class Names:
    """What one side's values stand for: pid -> token, and text -> token for directories and the like."""

    pids: dict[str, str] = field(default_factory=dict)
    words: dict[str, str] = field(default_factory=dict)

    def text(self, value: str) -> str:
        for word, token in sorted(self.words.items(), key=lambda item: -len(item[0])):
            value = _keep_width(value, re.escape(word), token, boundary=False)
        value = _UUID.sub("GPU-<uuid>".ljust(40), value)
        value = _UUID22.sub("GPU-<uuid>".ljust(22), value)
        value = _PCI.sub("<pci>".ljust(13), value)
        value = _PCI_SHORT.sub(r"\1<pci>,", value)
        value = _REQUEST.sub("Received new client request for {<junk>}", value)
        value = _AGAIN.sub("again in at most <n>ms", value)
        value = _SHM.sub("mps.shm.0.<mps>", value)
        for pid, token in self.pids.items():
            value = _keep_width(value, pid, token)
        return value

    def line(self, value: str) -> str:
        match = _PREFIX.match(value)
        if match:
            source, pid = match.groups()
            token = "<mps>" if source == "Other" else self.pids.get(pid, pid)
            value = f"[<time> {source} {token}] " + value[match.end():]
        return self.text(value)


def _keep_width(text: str, word: str, token: str, boundary: bool = True) -> str:
    """`word` replaced by `token` everywhere, in the width `word` and the spaces after it took, where the
    token fits (so that a padded column keeps its width)."""
    pattern = rf"(?<![\w.]){word}(?!\w)( *)" if boundary else rf"{word}( *)"

    def replace(match: re.Match[str]) -> str:
        width = len(match.group(0))
        return token.ljust(width) if match.group(1) and len(token) < width else token + match.group(1)[:1]

    return re.sub(pattern, replace, text)


def _untimed(lines: list[str]) -> list[str]:
    """control.log lines without those of timed shutdown retries (from a "backoff is enabled" try through the
    line that says what became of it)."""
    kept, skipping = [], False
    for line in lines:
        if "backoff is enabled" in line:
            skipping = True
        if not skipping:
            kept.append(line)
        if skipping and ("Control will try" in line or "exited with status" in line):
            skipping = False
    return kept


def _subsequence(needles: list[str], haystack: list[str]) -> bool:
    it = iter(haystack)
    return all(any(line == candidate for candidate in it) for line in needles)


# -- the real side's names -----------------------------------------------------------------------------------

def _real_names() -> Names:
    names = Names()
    for record in CORPUS + EXTRA:
        if record.get("pid_file"):
            names.pids[record["pid_file"].strip()] = "<mps>"
        for line in record["control_log"]:
            match = re.search(r"Starting new server (\d+)", line)
            if match:
                names.pids[match.group(1)] = "<mps>"
        if (record["kind"] == "control" and record["stdin"].startswith("get_server_list")
                and record["stdout"][:1].isdigit()):
            names.pids[record["stdout"].split()[0]] = "<mps>"
        if record.get("what", "").startswith("client ") and record["what"].endswith(" started"):
            names.pids[record["client_pid"]] = f"<client:{record['what'].split()[1]}>"
        if record.get("what") == "-f exited":  # the foreground daemon's lines name only its own pid
            names.pids.update({pid: "<mps>" for pid in re.findall(r"Control +(\d+)\]", record["stdout"])})
        if record.get("what") == "the new client's fate":
            names.pids[str(json.loads(record["stdout"].splitlines()[0])["pid"])] = "<client:late>"
        for key in ("pipe", "log"):
            for path in re.findall(rf"/tmp/mpsrec-[\w-]+/{key}", json.dumps(record)):
                names.words[path] = f"<{key}>"
    names.words["4026531836"] = "<ns>"
    names.words["/opt/torch/.venv/bin/python3"] = "<command>"
    names.pids.pop(BOGUS, None)
    return names


REAL = _real_names()


# -- the replay ----------------------------------------------------------------------------------------------

WORKER = """
import json, sys, mpsd_client
ctx = mpsd_client.connect()
ctx.malloc(1 << 20)
print("ready", flush=True)
for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "exit":
        break
    codes = []
    for call in (lambda: ctx.malloc(int(words[1]) if len(words) > 1 else 1 << 20), ctx.synchronize):
        try:
            call()
            codes.append(0)
        except mpsd_client.CudaError as exc:
            codes.append(exc.code)
    print(json.dumps(codes), flush=True)
"""


@dataclass
class Replayed:
    """What mpsd did for one record."""

    stdout: str = ""
    stderr: str = ""
    rc: object = 0
    control_log: list[str] = field(default_factory=list)
    server_log: list[str] = field(default_factory=list)
    codes: list[int] | None = None
    transcript: str = ""


class Replay:
    """One mpsd daemon, started as MPS's is, and its clients, driven through the recorded records."""

    def __init__(self) -> None:
        base = short_tempdir()
        self.pipe, self.logs = base / "pipe", base / "log"
        self.env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe),
                    "CUDA_MPS_LOG_DIRECTORY": str(self.logs)}
        self.names = Names(words={str(self.pipe): "<pipe>", str(self.logs): "<log>", sys.executable: "<command>",
                                  os.readlink("/proc/self/ns/pid").split("[")[1].rstrip("]"): "<ns>"})
        self.offsets = {"control": 0, "server": 0}
        self.clients: dict[str, subprocess.Popen[str]] = {}
        self.real_to_ours: dict[str, str] = {}
        self.daemon_pid = ""
        self.server_pid = ""  # the running server's: each has a process of its own, as MPS's servers do

    def log_lines(self) -> dict[str, list[str]]:
        lines = {}
        for name in ("control", "server"):
            path = self.logs / f"{name}.log"
            data = path.read_bytes()[self.offsets[name]:] if path.exists() else b""
            self.offsets[name] += len(data)
            lines[name] = data.decode("latin-1").splitlines()
        for line in lines["control"]:  # every server's pid is <mps>, as on the real side
            match = re.search(r"Starting new server (\d+)", line)
            if match:
                self.server_pid = match.group(1)
                self.names.pids[self.server_pid] = "<mps>"
        return lines

    def settle(self, until: str | None = None, quiet: float = 0.1, limit: float = 10.0) -> None:
        """Wait for `until` in what control.log gained, or for both logs to be still for `quiet` seconds."""
        def sizes() -> tuple[int, ...]:
            return tuple((self.logs / f"{n}.log").stat().st_size if (self.logs / f"{n}.log").exists() else 0
                         for n in ("control", "server"))
        end, last, still = time.monotonic() + limit, sizes(), time.monotonic()
        while time.monotonic() < end:
            if until is not None:
                path = self.logs / "control.log"
                if path.exists() and until.encode() in path.read_bytes()[self.offsets["control"]:]:
                    time.sleep(0.002)  # what the daemon logs once the command is done follows in the same step
                    return
            time.sleep(0.002)
            now = sizes()
            if now != last:
                last, still = now, time.monotonic()
            elif until is None and time.monotonic() - still >= quiet:
                return

    def fill(self, template: str, values: dict[str, str]) -> str:
        ours = {key: ((self.server_pid or self.daemon_pid) if key == "server" else self.real_to_ours.get(value, BOGUS))
                if value != BOGUS else BOGUS for key, value in values.items()}
        return template.format(**ours)

    def control(self, record: dict) -> Replayed:
        self.log_lines()
        if record["args"] == ["-d"]:
            done = subprocess.run([TOOL, "-d", "--shutdown-retry", RETRY], capture_output=True, text=True,
                                  env=self.env, timeout=60)
            self.daemon_pid = (self.pipe / "nvidia-cuda-mps-control.pid").read_text().strip()
            self.names.pids[self.daemon_pid] = "<mps>"
            self.settle()
            return Replayed(done.stdout, done.stderr, done.returncode, **self._logs())
        stdin = self.fill(record["template"], record["vars"]).encode("latin-1")
        out, err = io.BytesIO(), io.StringIO()
        rc = talk(self.pipe, io.BytesIO(stdin), out, err)
        self.settle(until=None if stdin.startswith(b"quit") else "UI closed")  # quit's connection just ends
        return Replayed(out.getvalue().decode("latin-1"), err.getvalue(), rc, **self._logs())

    def _logs(self) -> dict[str, list[str]]:
        lines = self.log_lines()
        return {"control_log": lines["control"], "server_log": lines["server"]}

    def event(self, record: dict) -> Replayed:
        what, done = record["what"], Replayed()
        if what.startswith("client ") and what.endswith(" started") or what == "a new client meanwhile":
            label = "late" if what == "a new client meanwhile" else what.split()[1]
            worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=self.env)
            assert worker.stdout.readline() == "ready\n", worker.stderr.read()
            self.clients[label] = worker
            self.names.pids[str(worker.pid)] = f"<client:{label}>"
            if "client_pid" in record:
                self.real_to_ours[record["client_pid"]] = str(worker.pid)
        elif ": alloc" in what:
            worker = self.clients[what.split()[1].rstrip(":")]
            worker.stdin.write("alloc" + what.partition("alloc")[2] + "\n")
            worker.stdin.flush()
            done.codes = json.loads(worker.stdout.readline())
        elif what.endswith(" exited") or what == "the new client's fate":
            label = "late" if what == "the new client's fate" else what.split()[1]
            worker = self.clients.pop(label)
            if label == "late":
                worker.stdin.write("alloc\n")
                worker.stdin.flush()
                done.codes = json.loads(worker.stdout.readline())
            worker.communicate("exit\n", timeout=60)
        elif what == "interactive on a pty":
            done.transcript = self._on_a_terminal(record)
        elif what == "stdin a pipe held open":
            done.transcript = self._held_open(record)
        self.settle()
        lines = self._logs()
        done.control_log, done.server_log = lines["control_log"], lines["server_log"]
        return done

    def _on_a_terminal(self, record: dict) -> str:
        """The tool on a terminal, typed at as the recording did: each line's answer is read before the next
        line is typed (as much as the recording got back for it, or whatever came in two seconds)."""
        master, slave = pty.openpty()
        proc = subprocess.Popen([TOOL], stdin=slave, stdout=slave, stderr=slave, env=self.env, close_fds=True)
        os.close(slave)
        steps: list[list[str]] = []  # each typed line and what came back for it
        for _, direction, data in record["transcript"]:
            if direction == "in":
                steps.append([data, ""])
            elif steps:
                steps[-1][1] += data
        out = []
        for typed, expected in steps:
            os.write(master, typed.encode("latin-1"))
            out.append(_read(master, len(expected.encode("latin-1"))))
        proc.wait(30)
        os.close(master)
        return "".join(out)

    def _held_open(self, record: dict) -> str:
        proc = subprocess.Popen([TOOL], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=self.env)
        early = []
        for _, direction, data in record["transcript"]:
            if direction == "in" and data != "(close)":
                proc.stdin.write(data.encode("latin-1"))
                proc.stdin.flush()
                self.settle(quiet=0.05)
                ready, _, _ = select.select([proc.stdout], [], [], 0)
                early.append("(early output)" if ready else "")
        out, _ = proc.communicate(timeout=30)
        return "".join(early) + out.decode("latin-1")

    def close(self) -> None:
        for worker in self.clients.values():
            worker.kill()
            worker.communicate()
        subprocess.run([TOOL], input=b"quit\n", env=self.env, timeout=60, capture_output=True)


def _read(fd: int, size: int, timeout: float = 2.0) -> str:
    """At least `size` bytes from `fd`, or what came before `timeout`."""
    data, end = b"", time.monotonic() + timeout
    while len(data) < size and select.select([fd], [], [], max(0.0, end - time.monotonic()))[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data.decode("latin-1")


# -- the replay on the interpreters alone -------------------------------------------------------------------

@dataclass
class FakeDevice:
    """The H200 as the control plane sees it (a DeviceView)."""

    index: int = 0
    name: str = "NVIDIA H200"
    properties: dict = field(default_factory=lambda: {
        "uuid": "GPU-00000000-1111-2222-3333-444444444444", "index": 0})
    faulted: set = field(default_factory=set)


@dataclass
class FakeClient:
    """A client process's one context (a ClientView), with what its calls need: its memory limit, what it
    holds, and the sticky error a Terminate or a CutOff gave it."""

    id: int
    pid: int
    uid: int
    device: FakeDevice
    limit: int | None
    used: int = 1 << 20  # the worker's first allocation
    sticky: int = 0
    namespace: str = "default"
    sm_partition: object = None


@dataclass
class FakeProcesses:
    """What the recording's host said of its clients: ps's NAMESPACE, and its COMMAND (argv[0]: the python
    that ran the recorder's clients, unless a client renamed itself)."""

    commands: dict[int, str] = field(default_factory=dict)

    def namespace(self, pid: int) -> str:
        return "4026531836"

    def command(self, pid: int) -> str:
        return self.commands.get(pid, "/opt/torch/.venv/bin/python3")

    def cgroup(self, pid: int) -> str | None:
        return None

    def owner(self, pid: int) -> int | None:
        return None


class InProcess:
    """The recorded records run on mpsd's control interpreters and a ControlState, with no daemon: a command
    is the tool's connection (its lines, each answered, between "NEW UI" and "UI closed"), a client's arrival
    and exit are what the daemon tells the control plane, and the actions are applied to the logs and the
    clients here."""

    DAEMON, UID = 30001, os.getuid()

    def __init__(self) -> None:
        self.device, self.processes = FakeDevice(), FakeProcesses()
        self.state = ControlState(self.DAEMON, [self.device], Settings(100.0), self.UID, Path("/tmp/replay/pipe"),
                                  shutdown_retry=float(RETRY), processes=self.processes)
        self.control = Control(self.state)
        self.names = Names(pids={str(self.DAEMON): "<mps>"},
                           words={"/tmp/replay/pipe": "<pipe>", "4026531836": "<ns>",
                                  "/opt/torch/.venv/bin/python3": "<command>"})
        self.lines: dict[str, list[str]] = {"control": [], "server": []}
        self.server_pid = self.DAEMON  # whose server.log lines are the server's
        self.pids = iter(range(31001, 40000))
        self.ids = iter(range(1, 10000))
        self.clients: dict[str, FakeClient] = {}
        self.real_to_ours: dict[str, str] = {}
        self.now = 0.0
        # A connection whose command waits for its answer (Defer): its ticket, the lines after it, its output.
        self.waiting: tuple[int, io.BytesIO, io.BytesIO] | None = None
        self.answers: dict[int, str] = {}

    def log(self, stream: str, text: str, pid: int | None = None, source: str | None = None,
            verbatim: bool = False) -> None:
        source = source or ("Control" if stream == "control" else "Server")
        pid = pid if pid is not None else self.DAEMON if stream == "control" else self.server_pid
        line = log_line(source, pid, text, verbatim=verbatim)  # as the file holds it, read as the real tier reads it
        self.lines[stream].extend(line.encode(errors="surrogateescape").decode("latin-1").split("\n"))

    def apply(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Log):
                self.log(action.stream, action.text, action.pid, action.source, action.verbatim)
            elif isinstance(action, Then):
                self.apply(action.actions())
            elif isinstance(action, StartServer):
                self.state.server.pid = self.server_pid = next(self.pids)
                self.names.pids[str(self.server_pid)] = "<mps>"
            elif isinstance(action, EndServer):
                self.server_pid = self.DAEMON
            elif isinstance(action, Terminate):
                action.client.sticky = 810  # cudaErrorMpsClientTerminated
            elif isinstance(action, CutOff):
                action.client.sticky = 806  # cudaErrorMpsRpcFailure
            elif isinstance(action, Answer):
                self.answers[action.ticket] = action.reply
            else:  # the rest change nothing a record sees: no retry falls due, no route is bound here
                assert isinstance(action, (ServerChanged, Wake, Stop, Reconfigure, Defer)), action

    def fill(self, template: str, values: dict[str, str]) -> str:
        server = str(self.state.server.pid if self.state.server.started else self.DAEMON)
        return template.format(**{key: value if value == BOGUS else server if key == "server"
                                  else self.real_to_ours.get(value, BOGUS) for key, value in values.items()})

    def connection(self, stdin: bytes) -> Replayed:
        """The tool's one connection: each line of `stdin` a command (as mpsd.tools.control.talk sends them)."""
        self.log("control", "Accepting connection...")
        self.log("control", "NEW UI")
        return self._talk(io.BytesIO(stdin), io.BytesIO())

    def _talk(self, stream: io.BytesIO, out: io.BytesIO) -> Replayed:
        done = Replayed()
        while line := stream.readline(LINE - 1):
            command = line[:-1] if line.endswith(b"\n") else line
            command = command[:-1] if command.endswith(b"\r") else command
            outcome = self.control.receive(command.split(b"\0", 1)[0] + b"\0", self.UID, self.now)
            self.apply(outcome.actions)
            deferred = [a.ticket for a in outcome.actions if isinstance(a, Defer)]
            if deferred:  # the tool waits for the answer: the recorder gave up on it (its record's rc)
                self.waiting = deferred[0], stream, out
                done.rc = "timeout"
                break
            if outcome.failed:
                done.stderr += outcome.text + "\n"
                done.rc = 1
            elif outcome.reply:
                out.write(outcome.reply + b"\n")
        else:
            self.log("control", "UI closed")
            self.apply(self.control.after_command())
        done.stdout = out.getvalue().decode("latin-1")
        return done

    def _answered(self) -> None:
        """The waiting connection's answer came: the tool prints it and goes on with its lines."""
        if self.waiting is not None and self.waiting[0] in self.answers:
            ticket, stream, out = self.waiting
            self.waiting = None
            out.write(self.answers.pop(ticket).encode() + b"\n")
            self._talk(stream, out)

    def record(self, record: dict) -> Replayed:
        self.lines = {"control": [], "server": []}
        if record["kind"] == "control":
            done = self.connection(self.fill(record["template"], record["vars"]).encode("latin-1"))
        else:
            done = self.event(record)
        self._answered()
        done.control_log, done.server_log = self.lines["control"], self.lines["server"]
        return done

    def event(self, record: dict) -> Replayed:
        what, done = record["what"], Replayed()
        if what.startswith("client ") and what.endswith(" started") or what == "a new client meanwhile":
            label = "late" if what == "a new client meanwhile" else what.split()[1]
            assert self.control.admission.admits(self.UID)  # (the recording's clients never waited)
            client = FakeClient(next(self.ids), next(self.pids), self.UID, self.device,
                                self.control.admission.memory_limit_for_new_client(0, self.UID))
            self.clients[label] = client
            if label == "argv0":  # corpus_extra's client that set its argv[0]
                self.processes.commands[client.pid] = "renamed-client"
            self.names.pids[str(client.pid)] = f"<client:{label}>"
            if "client_pid" in record:
                self.real_to_ours[record["client_pid"]] = str(client.pid)
            self.apply(self.control.client_arrived(client))
        elif ": alloc" in what or what == "the new client's fate":
            client = self.clients[what.split()[1].rstrip(":") if ": alloc" in what else "late"]
            size = int(what.partition("alloc")[2] or 1 << 20)
            done.codes = [client.sticky or self._malloc(client, size), client.sticky]
        if what.endswith(" exited") or what == "the new client's fate":
            client = self.clients.pop("late" if what == "the new client's fate" else what.split()[1])
            self.apply(self.control.client_leaving(client))
            self.apply(self.control.client_left(client))
        elif what in ("interactive on a pty", "stdin a pipe held open"):  # the tool's part: the real tier's
            typed = "".join(data for _, direction, data in record["transcript"]
                            if direction == "in" and data not in ("(close)", "\x04"))
            self.connection(typed.encode("latin-1"))
        return done

    @staticmethod
    def _malloc(client: FakeClient, size: int) -> int:
        if client.limit is not None and client.used + size > client.limit:
            return 2  # cudaErrorMemoryAllocation: past the pinned memory limit
        client.used += size
        return 0


TOOL_RECORDS = (3, 4)  # the daemon's start, and a second -d: the real tier's alone


@pytest.fixture(scope="module")
def replayed() -> dict[int, Replayed]:
    replay, results = InProcess(), {}
    for i, record in _main_records():
        if i in TOOL_RECORDS:
            continue
        results[i] = replay.record(record)
        if i == 169:  # MPS's uid-65534 server went at once; ours goes now, so that the states agree again
            replay.connection(f"shutdown_server {replay.state.server.pid}\n".encode())
    results["names"] = replay.names  # type: ignore[index]
    return results


def _marks(i: int) -> list[pytest.MarkDecorator]:
    return [pytest.mark.xfail(reason=DIFFERENT[i], strict=True)] if i in DIFFERENT else []


def _compare(record: dict, ours: Replayed, names: Names) -> None:
    """A record's output, exit status and log lines, normalised, as MPS's; the client's CUDA errors; the
    terminal's and the pipe's bytes where `ours` has them (the real tier's)."""
    if record["kind"] == "control":
        assert names.text(ours.stdout) == REAL.text(record["stdout"])
        assert (ours.stderr, ours.rc) == (record["stderr"], record["rc"])
    elif "reply" in record and ours.codes is not None:  # a client's calls: the CUDA errors they got
        real = json.loads(record["reply"])
        assert {c for c in ours.codes if c} == {c for c in real.values() if c}
    elif record["what"] == "the new client's fate":
        real = json.loads(record["stdout"].splitlines()[1])
        assert {c for c in ours.codes or () if c} == {c for c in real.values() if c}
    elif record["what"] == "interactive on a pty" and ours.transcript:
        typed = "".join(d for _, k, d in record["transcript"] if k == "out")
        assert names.text(ours.transcript) == REAL.text(typed)
    elif record["what"] == "stdin a pipe held open" and ours.transcript:  # nothing before the end: block-buffered
        assert ours.transcript == "".join(d for _, k, d in record["transcript"] if k == "out")
    real_control = [REAL.line(line) for line in _untimed(record["control_log"])]
    assert [names.line(line) for line in _untimed(ours.control_log)] == real_control
    real_server = [REAL.line(line) for line in record["server_log"] if not line.endswith(_TIMED, 0) and
                   not any(t in line for t in _TIMED)]
    ours_server = [names.line(line) for line in ours.server_log]
    assert _subsequence(real_server, ours_server), (real_server, ours_server)


@pytest.mark.parametrize("i", [pytest.param(i, marks=_marks(i),
                                            id=f"{i}-{(r.get('stdin') or r.get('what') or '')[:40]}")
                               for i, r in _main_records() if i not in TOOL_RECORDS])
def test_each_record_replays_as_recorded(replayed, i):
    """Record i of the main daemon's life, on the control interpreters alone: the same output, exit status
    and log lines, normalised."""
    _compare(CORPUS[i], replayed[i], replayed["names"])


def test_the_replay_compares_every_record():
    """The in-process replay covers the main daemon's whole recorded life but the daemon's own start, and the
    corpus still holds it (a changed corpus must not leave the parametrised test with nothing to compare)."""
    records = _main_records()
    assert len(records) == LAST - 2 and sum(r["kind"] == "control" for _, r in records) >= 300
    assert {r.get("what") for _, r in records} >= {"client a started", "client b: alloc", "the new client's fate"}


LIMITS = range(21, 49)  # corpus_extra's "limits" daemon, between its -d and its quit


@pytest.fixture(scope="module")
def replayed_limits() -> dict[int, Replayed]:
    replay = InProcess()
    results: dict = {i: replay.record(EXTRA[i]) for i in LIMITS}
    results["names"] = replay.names
    return results


@pytest.mark.parametrize("i", [pytest.param(i, id=f"{i}-{(EXTRA[i].get('stdin') or EXTRA[i].get('what'))[:40]}")
                               for i in LIMITS])
def test_each_limits_record_replays_as_recorded(replayed_limits, i):
    """corpus_extra's second daemon, on the interpreters alone: limits printed past and below 1 GiB, ps of a
    client whose argv[0] is not its executable, terminate_client of a process that is no client."""
    assert EXTRA[i]["daemon"] == "limits"
    _compare(EXTRA[i], replayed_limits[i], replayed_limits["names"])


# -- the interpreters' interface ------------------------------------------------------------------------------

def test_a_command_is_a_line_in_and_its_reply_and_actions_out():
    """start_server: the reply (nothing) and a StartServer action; the server's start lines come only once the
    connection is done, and name the pid the daemon gave it (they are made when applied)."""
    replay = InProcess()
    outcome = replay.control.receive(b"start_server -uid 0\0ignored", replay.UID, 0.0)
    assert (outcome.reply, outcome.failed) == (b"", False)
    assert StartServer(0) in outcome.actions
    assert not any(isinstance(a, Log) and "Starting new server" in a.text for a in outcome.actions)
    assert [a.text for a in outcome.actions if isinstance(a, Log)] == ["Cmd:start_server -uid 0"]
    replay.state.server.pid = 4242  # as the daemon's StartServer sets it
    (then,) = [a for a in replay.control.after_command() if isinstance(a, Then)]
    assert Log("control", "Starting new server 4242 for user 0", 4242) in then.actions()


def test_terminate_client_asks_the_daemon_to_terminate_that_client():
    """terminate_client answers 0 and returns a Terminate of the client's context between MPS's two
    server.log lines, in that order; the state does not change the client itself (the daemon does)."""
    replay = InProcess()
    client = FakeClient(1, 5555, replay.UID, replay.device, None)
    replay.apply(replay.control.client_arrived(client))
    outcome = replay.control.receive(f"terminate_client {replay.state.server.pid} 5555".encode(), replay.UID, 0.0)
    assert outcome.reply == b"0"
    kinds = [(type(a).__name__, getattr(a, "text", None)) for a in outcome.actions if not isinstance(a, Log)
             or a.stream == "server"]
    assert kinds == [("Log", "MPS server requesting client {PID: 5555, Context ID: 1} to exit"),
                     ("Terminate", None), ("Log", "Client termination succeeded.")]
    assert client.sticky == 0


def test_bytes_that_are_not_utf8_come_back_as_they_came():
    """A command ends at its NUL as C's string does, and the reply quotes its bytes unchanged."""
    outcome = InProcess().control.receive(b"\xff\xfe\0rest", 0, 0.0)
    assert outcome.reply == b'Unknown command "\xff\xfe"'


# -- the real-daemon tier: the daemon applies the actions, over its sockets ----------------------------------

# The daemon's start and a second -d, the tool on a terminal and on a pipe held open, and a server's life
# with clients in it: started by a client, shut down by force (its client's calls fail with 806), started
# again, a client terminated (810) and listed by ps from /proc; each server in a process of its own.
REAL_TIER = (3, 4, 164, 165, *range(303, 311))


@pytest.fixture(scope="module")
def replayed_by_the_daemon() -> dict[int, Replayed]:
    replay, results = Replay(), {}
    try:
        for i in REAL_TIER:
            record = CORPUS[i]
            if i == 303:  # the defaults that the records between left for the next server (1 GiB on 0 and 5)
                replay.control({"args": [], "vars": {}, "template": "set_default_device_pinned_mem_limit 0 1G\n"
                                "set_default_device_pinned_mem_limit 5 1G\n"})
            results[i] = replay.control(record) if record["kind"] == "control" else replay.event(record)
    finally:
        replay.close()
    results["names"] = replay.names  # type: ignore[index]
    return results


@pytest.mark.parametrize("i", [pytest.param(i, id=f"{i}-{(CORPUS[i].get('stdin') or CORPUS[i].get('what') or '')[:40]}")
                               for i in REAL_TIER])
def test_the_daemon_replays_records_as_recorded(replayed_by_the_daemon, i):
    """Record i on a real daemon, through the tool and real client processes: the same output, exit status,
    log lines and CUDA errors as MPS's, so the daemon applies what the interpreters ask as MPS behaves."""
    ours = replayed_by_the_daemon[i]
    if CORPUS[i].get("what") in ("interactive on a pty", "stdin a pipe held open"):
        assert ours.transcript  # the tool's bytes are compared, not left out
    _compare(CORPUS[i], ours, replayed_by_the_daemon["names"])


# -- the tool without a daemon --------------------------------------------------------------------------------

@pytest.mark.parametrize("i", [pytest.param(i, marks=_marks(i)) for i, r in enumerate(CORPUS)
                               if r["phase"] in ("no daemon", "flags") and r["args"] not in (["-d", "extra"],)
                               and not r.get("note")])
def test_the_tool_alone_prints_what_mps_prints(i):
    """Options and a missing daemon: MPS's texts, byte for byte, and its exit status."""
    record = CORPUS[i]
    pipe = short_tempdir() / "pipe"
    done = subprocess.run([TOOL, *record["args"]], input=record["stdin"].encode("latin-1"), capture_output=True,
                          env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}, timeout=60)
    assert (done.stdout.decode("latin-1"), done.stderr.decode("latin-1"), done.returncode) == (
        record["stdout"], record["stderr"], record["rc"])


# -- the formats, from the recorded values themselves ----------------------------------------------------------

def test_ps_rows_are_mps_columns_byte_for_byte():
    """The recorded ps rows come out of ps_row from their own values (argv[0] 14 characters: padded to 15)."""
    rows = {r["stdout"] for r in CORPUS + EXTRA if r.get("stdin") == "ps\n" and r["stdout"].startswith("PID")}
    assert len(rows) >= 5
    for text in rows:
        header, *lines = text.splitlines()
        assert header == PS_HEADER
        for line in lines:
            pid, client, server, device, namespace, command = line.split(maxsplit=5)
            uuid = next(u for u in _UUID.findall(json.dumps(CORPUS + EXTRA)) if u.startswith(device))
            assert ps_row(pid, client, server, uuid, namespace, command.rstrip()) == line


def test_device_query_is_mps_table_byte_for_byte():
    """device_query's table, both layouts, from the recorded device's ordinal, PCI id, UUID and name."""
    layouts = set()
    for record in CORPUS:
        if record.get("stdin") in ("device_query\n", "device_query --csv\n") and record["stdout"].startswith("Default"):
            rows = record["stdout"].split("\n")
            ordinal, pci, uuid = rows[2].replace(",", " ").split()[:3]
            table = device_table([(int(ordinal), pci, uuid, "NVIDIA H200")], "--csv" in record["stdin"])
            assert rows[1:3] == table
            layouts.add(record["stdin"])
    assert layouts == {"device_query\n", "device_query --csv\n"}  # both were recorded, and compared


def test_memory_limits_parse_and_print_as_mps():
    """Every limit the recordings set and read back: strtoull's number, MiB unless a G follows, wrapping at
    2**64, 0 for none, printed in whole GiB from 1 GiB up."""
    pairs = 0
    for record in CORPUS + EXTRA:
        match = re.fullmatch(r"set_default_device_pinned_mem_limit 0 (.+)\nget_default_device_pinned_mem_limit 0\n",
                             record.get("stdin", ""), re.S)
        if match and " " not in match.group(1).strip():
            value = memory_limit(match.group(1).split()[0])
            assert (limit_text(value) + "\n" if value else "") == record["stdout"], match.group(1)
            pairs += 1
    assert pairs >= 30
    assert atoi("1.0") == 1 and atoi("abc") == 0 and atoi("-7x") == -7


# -- quit with a client: the retries with backoff ---------------------------------------------------------------

RETRY_BLOCK = ("Try shutting down server N, backoff is enabled\n"
               "Server N has N active worker threads. Server will not shutdown.\n"
               "Control will try shutting down server N again in at most Nms\n")


def _shapes(lines: list[str]) -> list[str]:
    """control.log's lines without prefix, connection lines and numbers, each run of timed retries as one (the
    recorded run had more of them than ours)."""
    texts = [re.sub(r"\d+", "N", _PREFIX.sub("", line)) for line in lines]
    texts = [t for t in texts if t not in ("Accepting connection...", "NEW UI", "UI closed")]
    # A try that logged nothing more before the next began: MPS's recording has one (its daemon stalled
    # there, taking no commands, until its client had gone), which is no shape of its own.
    texts = [t for t, after in zip(texts, texts[1:] + [""]) if not (t == after == RETRY_BLOCK.split("\n")[0])]
    joined = "".join(t + "\n" for t in texts)
    return re.sub(f"(?:{re.escape(RETRY_BLOCK)})+", RETRY_BLOCK, joined).splitlines()


@pytest.mark.parametrize("command,first,last", [("quit\n", 337, 342), ("quit -t 3\n", 347, 350)])
def test_quit_with_a_live_client_retries_with_backoff(command, first, last):
    """quit while a client runs: MPS's tries, refused while the client has worker threads and tried again
    after 200 ms, 400, 800 (here 50, 100, 200: --shutdown-retry 0.05); other commands meanwhile are refused
    with "Cannot send command"; without -t the quit returns once the client has gone, with -t once the time
    is up, the server then shut down by force and the client's next call failing with cudaErrorMpsRpcFailure.
    control.log's lines are MPS's, the retries' runs aside."""
    base = short_tempdir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(base / "log")}
    timed = "-t" in command
    command = command.replace("3", "1")
    assert subprocess.run([TOOL, "-d", "--shutdown-retry", "0.05"], env=env, timeout=60).returncode == 0
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert worker.stdout.readline() == "ready\n"
        log = base / "log" / "control.log"
        start = len(log.read_text().splitlines())
        quitting = subprocess.Popen([TOOL], stdin=subprocess.PIPE, env=env)
        quitting.stdin.write(command.encode())
        quitting.stdin.close()
        time.sleep(0.6)
        assert quitting.poll() is None or timed  # it waits for the daemon to go
        meanwhile = subprocess.run([TOOL], input=b"get_server_list\n", capture_output=True, env=env, timeout=60)
        if not timed:
            assert (meanwhile.stderr, meanwhile.returncode) == (
                b"Cannot send command to MPS control daemon process\n", 1)
        if timed:  # the time is up before the client has gone: the server goes by force
            assert quitting.wait(60) == 0
        worker.stdin.write("alloc\n")
        worker.stdin.flush()
        codes = json.loads(worker.stdout.readline())
        assert (806 in codes) == timed
        worker.communicate("exit\n", timeout=60)
        assert quitting.wait(60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    ours = log.read_text().splitlines()[start:]
    delays = [int(m) for m in re.findall(r"again in at most (\d+)ms", "\n".join(ours))]
    assert delays[:3] == [50, 100, 200]
    real = [line for i in range(first, last + 1) for line in CORPUS[i]["control_log"]]
    assert "\n".join(_shapes(ours)) == "\n".join(_shapes(real))


@pytest.mark.parametrize("i", [9, 17])
def test_quit_forms(i):
    """quit takes -t only with a number (then it says so in control.log); any other words are ignored and it
    is a plain quit: the daemon exits at once without a server."""
    record = EXTRA[i]
    replay = Replay()
    try:
        start = replay.control(EXTRA[i - 1])
        assert start.rc == 0
        ours = replay.control(record)
        replay.settle()
        ours.control_log += replay.log_lines()["control"]
    finally:
        replay.close()
    assert (ours.stdout, ours.stderr, ours.rc) == (record["stdout"], record["stderr"], record["rc"])
    assert [replay.names.line(line) for line in ours.control_log] == [REAL.line(line) for line in record["control_log"]]


def test_foreground_prints_control_log():
    """-f: the daemon in the foreground prints control.log's lines on stdout as they come, and nothing on
    stderr; quit ends it with 0."""
    record = next(r for r in CORPUS if r.get("what") == "-f exited")
    replay = Replay()
    proc = subprocess.Popen([TOOL, "-f"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=replay.env, text=True)
    try:
        first = [proc.stdout.readline() for _ in range(3)]  # the start-up lines: it is ready
        talk(replay.pipe, io.BytesIO(b"get_default_active_thread_percentage\n"), io.BytesIO(), io.StringIO())
        while not first[-1].endswith("UI closed\n"):  # as the recording did, the next command after this one
            first.append(proc.stdout.readline())
        talk(replay.pipe, io.BytesIO(b"quit\n"), io.BytesIO(), io.StringIO())
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    replay.names.pids[str(proc.pid)] = "<mps>"
    assert (err, proc.returncode) == (record["stderr"], record["rc"])
    assert [replay.names.line(line) for line in "".join(first + [out]).splitlines()] == [
        REAL.line(line) for line in record["stdout"].splitlines()]
