# Malformed frames and the logs (issue 13, items 8 and 9): whatever a client sends gets a clear error and
# closes only its own connection, never a traceback; nothing it sends can forge a log line or flood the logs.
# Raw frames over the daemon's real socket, a real daemon whose stderr is read at the end.
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import pytest

import mpsd_client
from daemons import short_tempdir, start_daemon
from mpsd.daemon.servlog import COMPLAINT_BURST, MAX_LINE
from mpsd_protocol import PROTOCOL_VERSION

BIN = Path(sys.executable).parent
HELLO = {"version": PROTOCOL_VERSION, "pid": 1, "device": 0, "visible": None, "limits": {}}
DEEP: list = []
for _ in range(1000):
    DEEP = [DEEP]


def _frame(message) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return struct.pack("<II", len(body), 0) + body


def _exchange(path, *messages) -> list:
    """Send `messages` on a fresh connection; every message the daemon sent back before closing it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(str(path))
        for message in messages:
            sock.sendall(_frame(message))
        unpacker, data, out = msgpack.Unpacker(raw=False), b"", []
        while chunk := sock.recv(1 << 16):
            data += chunk
            while len(data) >= 8:
                length, _ = struct.unpack("<II", data[:8])
                if len(data) < 8 + length:
                    break
                out.append(msgpack.unpackb(data[8:8 + length], raw=False))
                data = data[8 + length:]
            if out and out[-1][0] == 1 and out[-1][1] == messages[-1][1]:
                break  # the last request's answer is in
        del unpacker
        return out


@pytest.fixture
def watched(daemon_factory):
    """A daemon whose stderr the test reads at its end (no traceback may appear there)."""
    daemon = start_daemon("--time-scale", "100")
    yield daemon
    assert daemon.stop() == 0
    assert not [line for line in daemon.stderr_lines if "Traceback" in line], daemon.stderr_lines


@pytest.mark.parametrize("messages,reply", [
    ([[0, 1, "hello", HELLO], [0, 2, "malloc", {"nbytes": DEEP}]], "cudaErrorInvalidValue"),
    ([[0, 1, "hello", dict(HELLO, limits={"priority": True})]], "cudaErrorInvalidValue"),
    ([[0, 1, "hello", dict(HELLO, limits={"priority": 1.0})]], "cudaErrorInvalidValue"),
    ([[0, 1, "hello", dict(HELLO, limits={"pinned_mem_limit": True})]], "cudaErrorInvalidValue"),
    ([[0, 1, "hello", dict(HELLO, device=True)]], "cudaErrorInvalidDevice"),
    ([[0, 1, "hello", dict(HELLO, version=DEEP)]], "cudaErrorMpsConnectionFailed"),
    ([[0, 1, "hello", dict(HELLO, pid=DEEP)],
      [0, 2, "launch", {"name": "x" * (1 << 19), "grid": 1, "block": 1, "args": []}]],
     "cudaErrorInvalidDeviceFunction"),
], ids=["nested 1000 deep", "priority True", "priority 1.0", "limit True", "device True", "deep version",
        "claimed pid deep, long kernel name"])
def test_malformed_requests_get_a_cuda_error_and_no_traceback(watched, messages, reply):
    """Each gets the CUDA error a bad argument gets (quoting the value briefly), the daemon goes on."""
    answers = _exchange(watched.socket_path, *messages)
    error = answers[-1][2]
    assert error["name"] == reply and len(error["message"]) < 300
    with mpsd_client.connect(watched.pipe_dir) as ctx:
        assert ctx.mem_get_info()[1] > 0


def test_a_huge_request_id_is_a_protocol_error_small_enough_to_send(watched):
    """A 512 KiB request id: the protocol-error notice quotes it briefly, so it is sent; the log line too."""
    answers = _exchange(watched.socket_path, [0, 1, "hello", HELLO], [0, "x" * (1 << 19), "malloc", {"nbytes": 1}])
    notice = answers[-1]
    assert notice[0] == 2 and notice[1] == "protocol_error" and len(notice[2]["message"]) < 300
    assert max(len(line) for line in watched.server_log().splitlines()) < MAX_LINE + 100


def test_a_command_cannot_forge_a_log_line(watched):
    """A control packet carrying a newline and a fake log line is logged on one line, escaped."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(20)
        sock.connect(str(watched.pipe_dir / "control"))
        sock.send(b"get_server_list\n[2020-01-01 00:00:00.000 Control   1] forged\x1b[2J")
        sock.recv(1 << 16)
    log = (watched.log_dir / "control.log").read_text()
    assert not re.search(r"^\[2020-01-01", log, re.M)
    assert "\\n[2020-01-01" in log and "\\x1b[2J" in log


def test_complaints_about_one_user_are_rate_limited(watched):
    """200 connections that break the protocol at once: a burst of log lines, then a count of the rest."""
    for _ in range(200):
        _exchange(watched.socket_path, [0, 1, "malloc", {"nbytes": 1}])  # no hello first
    complaints = [line for line in watched.server_log().splitlines() if "protocol error" in line]
    assert COMPLAINT_BURST <= len(complaints) < COMPLAINT_BURST + 20


def test_tools_work_with_hundreds_of_clients(daemon_factory):
    """The status of 500 contexts is larger than a control packet (64 KiB): it arrives whole, and mpsd-smi
    shows every client (from about 350 mpsd-smi said "no mpsd daemon answers"); mpsd-control's
    get_device_client_list lists every context of the one process, ps the process once, as MPS's do."""
    daemon = start_daemon("--time-scale", "100", "--devices", "h200:2", "--max-clients", "300")
    daemon_factory.append(daemon)
    contexts = [mpsd_client.connect(daemon.pipe_dir, device=i % 2) for i in range(500)]
    try:
        env = {**os.environ, "MPSD_PIPE_DIRECTORY": str(daemon.pipe_dir)}
        smi = subprocess.run([BIN / "mpsd-smi", "--json"], capture_output=True, text=True, timeout=60, env=env)
        assert smi.returncode == 0, smi.stderr
        assert len(smi.stdout) > 1 << 16 and len(json.loads(smi.stdout)["processes"]) == 500
        ps = subprocess.run([BIN / "mpsd-control"], input="ps\nget_device_client_list\n", capture_output=True,
                            text=True, timeout=60, env=env)
        lines = ps.stdout.splitlines()
        assert ps.returncode == 0 and len(lines) == 2 + 2 + 500
        assert lines[1].split()[0] == str(os.getpid()) and lines[-1] == f"{os.getpid()}.500"
    finally:
        for ctx in contexts:
            ctx.close()


def test_mpsd_control_takes_bytes_that_are_not_utf8(watched):
    """A line that is not UTF-8 is a command like any other, its bytes quoted back as they came (MPS's
    'Unknown command "\xff\xfe"'); the lines around it are served; no traceback."""
    env = {**os.environ, "MPSD_PIPE_DIRECTORY": str(watched.pipe_dir)}
    done = subprocess.run([BIN / "mpsd-control"], input=b"get_default_client_priority\n\xff\xfe\nget_server_list\n",
                          capture_output=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stderr == b""
    assert done.stdout.splitlines()[:2] == [b"0", b'Unknown command "\xff\xfe"']


@pytest.mark.parametrize("reply", [b"={}", b"=[1, 2]", b'={"server_pid": 1, "devices": [{}], "processes": []}',
                                   b"=not json", b"no marker"])
def test_mpsd_smi_says_one_line_about_a_reply_it_cannot_read(tmp_path, reply):
    """A control socket (of our own user) that answers something else than a status: one line, exit 1."""
    pipe = short_tempdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(str(pipe / "control"))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1 << 16)
            conn.send(reply)

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        done = subprocess.run([BIN / "mpsd-smi", "--pipe-dir", str(pipe)], capture_output=True, text=True,
                              timeout=60)
    finally:
        thread.join(timeout=10)
        server.close()
        shutil.rmtree(pipe, ignore_errors=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("mpsd-smi: ")
