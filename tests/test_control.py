# The control plane as operators use it: mpsd-control and mpsd-smi run as subprocesses against a real daemon,
# with exact outputs and exit codes; settings that apply to clients created afterwards; terminate_client;
# quit; the background mode; privileges with a real second user; and systemd socket activation.
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import mpsd_client
from daemons import short_tempdir, start_daemon
from mpsd.daemon.control_text import PS_HEADER
from test_daemon import wait_for_log
from test_ipc import _as_user, _second_user

BIN = Path(sys.executable).parent
UNITS = Path(__file__).parent.parent / "systemd"


def control(daemon_or_dir, commands: str, **kwargs) -> subprocess.CompletedProcess[str]:
    pipe_dir = getattr(daemon_or_dir, "pipe_dir", daemon_or_dir)
    return subprocess.run([BIN / "mpsd-control"], input=commands, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MPSD_PIPE_DIRECTORY": str(pipe_dir)}, **kwargs)


def test_outputs_match_the_real_tool(daemon):
    """Defaults echo as nvidia-cuda-mps-control prints them; unknown commands and unset limits too."""
    result = control(daemon, "get_server_list\nget_default_active_thread_percentage\n"
                             "set_default_active_thread_percentage 50\nget_default_active_thread_percentage\n"
                             "help\nget_default_device_pinned_mem_limit 0\nget_default_client_priority\n")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == '100.0\n50.0\n50.0\nUnknown command "help"\n0\n'  # no server yet; no limit set
    log = (daemon.log_dir / "control.log").read_text()
    assert "Cmd:set_default_active_thread_percentage 50" in log
    assert "No default pinned memory limit set for the device!" in log


def test_settings_apply_to_clients_created_afterwards(daemon):
    """As in MPS: the defaults are what the next server starts with (a running server keeps its own, and so do
    its clients); set_active_thread_percentage and set_device_pinned_mem_limit change the running server's,
    for its clients that connect afterwards; a client already connected keeps its quotas."""
    with mpsd_client.connect(daemon.pipe_dir) as before:
        result = control(daemon, "set_default_active_thread_percentage 25\n"
                                 "set_default_device_pinned_mem_limit 0 2G\nget_default_device_pinned_mem_limit 0\n"
                                 "set_default_client_priority 1\n")
        assert result.stdout == "25.0\n2G\n"
        with mpsd_client.connect(daemon.pipe_dir) as same_server:
            assert same_server.device_properties()["multiprocessor_count"] == 132
            assert same_server.quotas["priority"] == 1  # the priority is the incoming client's
        server = control(daemon, "get_server_list\n").stdout.strip()
        assert server == str(daemon.proc.pid)
        result = control(daemon, f"set_active_thread_percentage {server} 50\nget_active_thread_percentage {server}\n"
                                 f"set_device_pinned_mem_limit {server} 0 4G\nget_device_pinned_mem_limit {server} 0\n")
        assert result.stdout == "50.0\n50.0\n4G\n"
        with mpsd_client.connect(daemon.pipe_dir) as third:
            assert third.quotas["sm_cap"] == 66 and third.quotas["pinned_mem_limit"] == 4 << 30
        assert before.device_properties()["multiprocessor_count"] == 132
    assert control(daemon, f"shutdown_server {server}\n").stdout == ""
    with mpsd_client.connect(daemon.pipe_dir) as next_server:
        assert next_server.device_properties()["multiprocessor_count"] == 32
        assert next_server.mem_get_info()[0] == 1_609_144_176  # 2G less the context, as measured


def test_priority_and_weight_extensions_outputs(daemon):
    """mpsd's own commands: per-pid and per-uid settings, a pid's beating its user's, and the complaints."""
    uid, pid = os.getuid(), os.getpid()
    result = control(daemon, f"get_client_priority {pid}\nget_client_weight uid:{uid}\n"
                             f"set_client_priority uid:{uid} 2\nset_client_weight uid:{uid} 0.5\n"
                             f"get_client_priority {pid}\nget_client_weight {pid}\n"
                             f"set_client_priority 99999 -3\nget_client_priority 99999\nget_client_priority uid:{uid}\n"
                             "set_client_priority x 1\nset_client_priority 1 high\nset_client_weight 1 0\n"
                             "set_client_priority 1\n")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.splitlines() == [
        "0", "1", "2", "0.5", "-3", "2",
        "Invalid client 'x': a pid, or uid:<uid>", "Invalid client priority 'high'", "Invalid client weight '0'",
        "Usage: set_client_priority <PID|uid:UID> <level>"]


def test_priority_and_weight_reach_running_and_later_clients(daemon, monkeypatch):
    """set_client_priority/weight change a connected client's quotas at once and a later client's at
    connect; CUDA_MPS_CLIENT_PRIORITY can only make a client less urgent than the daemon says."""
    pid = os.getpid()
    with mpsd_client.connect(daemon.pipe_dir) as running:
        assert control(daemon, f"set_client_priority {pid} -3\nset_client_weight {pid} 2.5\n").stdout == ""
        stats = running.statistics()
        assert (stats["priority"], stats["weight"]) == (-3, 2.5)
        with mpsd_client.connect(daemon.pipe_dir) as later:
            assert (later.quotas["priority"], later.quotas["weight"]) == (-3, 2.5)
            status = json.loads(subprocess.run(
                [BIN / "mpsd-smi", "--json"], capture_output=True, text=True, timeout=60,
                env={**os.environ, "MPSD_PIPE_DIRECTORY": str(daemon.pipe_dir)}).stdout)
            assert [(p["priority"], p["weight"]) for p in status["processes"]] == [(-3, 2.5)] * 2
    monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "1")
    with mpsd_client.connect(daemon.pipe_dir) as lowered:
        assert lowered.quotas["priority"] == 1
    control(daemon, f"set_client_priority {pid} 3\n")
    monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "0")
    with mpsd_client.connect(daemon.pipe_dir) as kept:
        assert kept.quotas["priority"] == 3
    assert f"Client {pid}: priority -3, weight 2.5" in daemon.server_log()


# A worker whose pid the test sets rules for: it connects, says its pid, queues its backlog when told, says
# when the daemon has it, and reports its statistics once the backlog is done. Backlogs go round four
# streams, so a client always has more ready blocks than its share and the scheduler, not stream order,
# decides who runs.
BACKLOG = """
import json, os, sys, mpsd_client
with mpsd_client.connect() as ctx:
    print(os.getpid(), flush=True)
    streams = [ctx.create_stream() for _ in range(4)]
    sys.stdin.readline()
    for i in range(int(sys.argv[1])):
        ctx.launch("spin", 264, 1024, [int(sys.argv[2])], stream=streams[i % 4])
    ctx.mem_get_info()  # its reply comes after the launches are queued
    print("queued", flush=True)
    ctx.synchronize()
    print(json.dumps(ctx.statistics()), flush=True)
    sys.stdin.readline()
"""
# A worker that fills every SM with one endless kernel, so the backlogs queue behind it; terminating it
# frees the whole GPU at one instant, however long the queueing took.
BLOCKER = """
import os, sys, mpsd_client
ctx = mpsd_client.connect()
ctx.launch("spin", 264, 1024, [1 << 62])
ctx.mem_get_info()
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("policy,command", [("priority", "set_client_priority {pid} -1"),
                                            ("fair", "set_client_weight {pid} 9")])
def test_priority_and_weight_reach_the_scheduler(daemon_factory, policy, command):
    """A worker favoured through the control plane gets most of the GPU while another client competes: when
    its backlog is done the other client has done less than half of the same backlog (with equal settings
    the two would finish together)."""
    from daemons import spawn_worker
    from mpsd.sim import H200

    # Simulated time runs at a quarter of wall time, so the moment it takes to read the other client's
    # progress once the favoured one is done is worth little GPU work.
    d = start_daemon("--time-scale", "0.25", "--policy", policy)
    daemon_factory.append(d)
    kernels, cycles = 20, int(5e-3 * H200.clock_hz)  # full waves of 5 ms each
    blocker = spawn_worker(BLOCKER, d.pipe_dir)
    worker = spawn_worker(BACKLOG, d.pipe_dir, str(kernels), str(cycles))
    try:
        blocker_pid, wpid = int(blocker.stdout.readline()), int(worker.stdout.readline())
        assert control(d, command.format(pid=wpid) + "\n").stdout == ""
        with mpsd_client.connect(d.pipe_dir) as other:
            streams = [other.create_stream() for _ in range(4)]
            for i in range(kernels):
                other.launch("spin", 264, 1024, [cycles], stream=streams[i % 4])
            other.mem_get_info()
            worker.stdin.write("go\n")
            worker.stdin.flush()
            assert worker.stdout.readline() == "queued\n"
            assert control(d, f"terminate_client {d.proc.pid} {blocker_pid}\n").stdout == "0\n"
            favoured = json.loads(worker.stdout.readline())
            done = other.statistics()["kernels_completed"]
            worker.stdin.write("done\n")
            worker.stdin.flush()
            other.synchronize()
        assert favoured["kernels_completed"] == kernels
        assert done < kernels // 2
    finally:
        for process in (worker, blocker):
            process.communicate("\n", timeout=60)


def test_a_terminated_clients_sms_go_to_the_others_at_once(daemon):
    """terminate_client frees the SMs its client held: a kernel queued behind it runs without further ado."""
    from daemons import spawn_worker

    blocker = spawn_worker(BLOCKER, daemon.pipe_dir)
    blocker_pid = int(blocker.stdout.readline())  # the GPU is full before the waiter launches
    waiter = spawn_worker("""
        import mpsd_client
        with mpsd_client.connect() as ctx:
            ctx.launch("spin", 1, 32, [1000])
            ctx.mem_get_info()
            print("queued", flush=True)
            ctx.synchronize()
            print("ran", flush=True)
    """, daemon.pipe_dir)
    try:
        assert waiter.stdout.readline() == "queued\n"
        assert control(daemon, f"terminate_client {daemon.proc.pid} {blocker_pid}\n").stdout == "0\n"
        # communicate reads the pipe, not what readline buffered: "ran" must come after the terminate
        out, err = waiter.communicate(timeout=60)  # before the fix it waited forever: nothing else was due
        assert (out, err, waiter.returncode) == ("ran\n", "", 0)
    finally:
        for process in (waiter, blocker):
            if process.poll() is None:
                process.kill()
            process.communicate(timeout=60)


def test_clients_servers_and_ps(daemon):
    """get_server_list, get_server_status, get_client_list and ps describe the connected clients."""
    with mpsd_client.connect(daemon.pipe_dir):
        server = str(daemon.proc.pid)
        result = control(daemon, f"get_server_list\nget_server_status {server}\nget_client_list {server}\nps\n"
                                 "get_server_status 1\n")
        lines = result.stdout.splitlines()
        assert lines[:4] == [server, "ACTIVE", str(os.getpid()), PS_HEADER]
        assert lines[4].split()[:3] == [str(os.getpid()), "1", server]
        argv0 = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode()
        assert lines[4][76:] == f"{argv0:<15}"  # ps's last column: a client's argv[0], as MPS's shows it
        assert lines[5] == "Server 1 not found"
    assert "NEW CLIENT" in (daemon.log_dir / "control.log").read_text()


def test_terminate_client_makes_its_calls_fail(daemon):
    """terminate_client prints 0; the client then gets the sticky cudaErrorMpsClientTerminated."""
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        ctx.launch("spin", 264, 1024, [10**12])
        result = control(daemon, f"terminate_client {daemon.proc.pid} {os.getpid()}\n")
        assert result.stdout == "0\n"
        for _ in range(2):
            with pytest.raises(mpsd_client.MpsClientTerminatedError) as info:
                ctx.synchronize()
            assert info.value.code == 810
    assert control(daemon, f"terminate_client {daemon.proc.pid} 1\n").stdout == "Invalid process 1!\n1\n"


def test_a_second_terminate_client_is_answered_once_its_client_has_gone(daemon):
    """terminate_client of a client terminated already waits until that client has gone, then prints 0, as
    the H200's MPS did (corpus records 258 and 259): its "Client termination succeeded." comes with the exit."""
    requesting = f"MPS server requesting client {{PID: {os.getpid()}, Context ID: 1}} to exit"
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        ctx.synchronize()
        assert control(daemon, f"terminate_client {daemon.proc.pid} {os.getpid()}\n").stdout == "0\n"
        second = subprocess.Popen([BIN / "mpsd-control"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "MPSD_PIPE_DIRECTORY": str(daemon.pipe_dir)})
        second.stdin.write(f"terminate_client {daemon.proc.pid} {os.getpid()}\n")
        second.stdin.close()
        log = wait_for_log(daemon, requesting, count=2)
        assert log.count("Client termination succeeded.") == 1 and second.poll() is None
    with second.stdout:
        assert second.wait(60) == 0 and second.stdout.read() == "0\n"
    assert daemon.server_log().count("Client termination succeeded.") == 2


def test_quit_stops_the_daemon_cleanly(daemon_factory):
    """quit ends the daemon with exit 0 and its sockets removed."""
    d = start_daemon()
    assert control(d, "quit\n").returncode == 0
    assert d.stop(signum=None) == 0
    assert not (d.pipe_dir / "mpsd.sock").exists() and not (d.pipe_dir / "control").exists()
    shutil.rmtree(d.pipe_dir.parent)


def test_background_mode_and_no_daemon():
    """mpsd-control -d returns once the daemon is ready; without a daemon a command exits 1 with one line."""
    pipe = short_tempdir() / "pipe"
    result = control(pipe, "get_server_list\n")
    assert (result.returncode, result.stdout, result.stderr) == (1, "", "Cannot find MPS control daemon process\n")
    started = subprocess.run([BIN / "mpsd-control", "-d", "--pipe-dir", str(pipe), "--time-scale", "100"],
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    with mpsd_client.connect(pipe) as ctx:
        assert ctx.malloc(16)
    assert control(pipe, "quit\n").returncode == 0
    again = subprocess.run([BIN / "mpsd-control", "-d", "--pipe-dir", str(pipe), "--time-scale", "-1"],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "--time-scale must be positive" in again.stderr
    shutil.rmtree(pipe.parent)


def test_privileged_commands_need_root_or_the_owner(daemon):
    """Another user may ask, but not change: set commands are refused and logged."""
    user = _second_user()
    if user is None:
        pytest.skip("needs root to create a second user (useradd)")
    for path in (daemon.pipe_dir.parent, daemon.pipe_dir):
        os.chmod(path, 0o755)
    os.chmod(daemon.pipe_dir / "control", 0o777)

    def ask() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(str(daemon.pipe_dir / "control"))
            answers = []
            for command in (b"get_default_active_thread_percentage", b"set_default_active_thread_percentage 10"):
                sock.send(command)
                answers.append(sock.recv(4096)[1:].decode())
            return "\n".join(answers)

    assert _as_user(user, ask) == ("100.0\nPermission denied: set_default_active_thread_percentage needs root or "
                                   "the daemon's owner")
    assert control(daemon, "get_default_active_thread_percentage\n").stdout == "100.0\n"


def test_multiuser_opens_the_pipe_dir_and_ps_shows_others_processes_only_to_root(daemon_factory):
    """--multiuser sets the modes other users' clients need (the pipe directory 0755, its sockets 0666: no
    chmod by hand), and `ps` lists another user's processes only to root and the daemon's owner."""
    user = _second_user()
    if user is None:
        pytest.skip("needs root to create a second user (useradd)")
    daemon = start_daemon("--time-scale", "100", "--multiuser")
    daemon_factory.append(daemon)
    os.chmod(daemon.pipe_dir.parent, 0o755)  # the test's temporary parent, which the operator would choose
    assert stat.S_IMODE(os.stat(daemon.pipe_dir).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o666
    with mpsd_client.connect(daemon.pipe_dir) as mine:

        def theirs() -> str:
            mine._sock.close()  # the fork's copy of root's connection
            with mpsd_client.connect(daemon.pipe_dir) as ctx:
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                    sock.connect(str(daemon.pipe_dir / "control"))
                    sock.send(b"ps")
                    rows = sock.recv(65536)[1:].decode().splitlines()
                return " ".join(row.split()[0] for row in rows[1:]) + f" | {ctx.client_id}"

        listed, _, their_id = _as_user(user, theirs).partition(" | ")
        assert str(os.getpid()) not in listed.split()  # root's client is not shown to the other user
        assert listed and their_id
        assert str(os.getpid()) in control(daemon, "ps\n").stdout


def test_another_users_client_waits_for_the_server(daemon):
    """One user's server at a time: a second user's client is pending until the first user's clients have
    gone and their server has exited; then a server for the second user starts."""
    user = _second_user()
    if user is None:
        pytest.skip("needs root to create a second user (useradd)")
    for path in (daemon.pipe_dir.parent, daemon.pipe_dir):
        os.chmod(path, 0o755)
    os.chmod(daemon.socket_path, 0o777)
    first = mpsd_client.connect(daemon.pipe_dir)

    def connect_when_admitted() -> str:
        import time

        first._sock.close()  # the fork's copy of root's connection: only the parent's close must count
        started = time.monotonic()
        with mpsd_client.connect(daemon.pipe_dir, timeout=30) as ctx:
            return f"{time.monotonic() - started:.2f} {ctx.malloc(16) > 0}"

    import threading

    threading.Timer(1.0, first.close).start()  # root's only client leaves after a second
    waited, worked = _as_user(user, connect_when_admitted).split()
    assert float(waited) >= 0.9 and worked == "True"
    log = (daemon.log_dir / "control.log").read_text()
    assert f"from user {user.pw_uid}: Server {daemon.proc.pid} serves user 0, push client to pending list" in log
    assert f"Starting new server {daemon.proc.pid} for user {user.pw_uid}" in log


def test_smi_shows_devices_and_processes(daemon):
    """mpsd-smi lists the device and each client with its memory, SM cap and priority; --json has it all."""
    env = {**os.environ, "MPSD_PIPE_DIRECTORY": str(daemon.pipe_dir)}
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        ctx.malloc(1 << 30)
        table = subprocess.run([BIN / "mpsd-smi"], capture_output=True, text=True, env=env, timeout=60)
        raw = subprocess.run([BIN / "mpsd-smi", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert table.returncode == 0 and "NVIDIA H200" in table.stdout
    row = next(line.split() for line in table.stdout.splitlines() if str(os.getpid()) in line.split())
    assert row[2:5] == ["M+C", str(os.getuid()), "1"] and row[5:7] == ["GiB", "132"]
    status = json.loads(raw.stdout)
    (process,) = status["processes"]
    assert process["pid"] == os.getpid() and process["memory"] == 1 << 30 and process["sticky_error"] is None
    assert status["devices"][0]["memory_total"] == 150_109_880_320
    missing = subprocess.run([BIN / "mpsd-smi", "--pipe-dir", str(short_tempdir())], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 1 and missing.stderr.startswith("mpsd-smi: no mpsd daemon answers")


def test_mpsd_trace_writes_the_trace_so_far_while_the_daemon_runs(daemon, daemon_factory, tmp_path):
    """mpsd_trace writes each traced device's timeline so far where --trace says, and the daemon serves on; a
    daemon without --trace says it has none."""
    from mpsd.record.trace import load_trace

    path = tmp_path / "trace.json"
    traced = start_daemon("--time-scale", "100", "--trace", str(path))
    daemon_factory.append(traced)
    with mpsd_client.connect(traced.pipe_dir) as ctx:
        ctx.launch("spin", 264, 1024, [1_000_000])
        ctx.synchronize()
        done = control(traced, "mpsd_trace\n")
        assert done.stdout == f"Trace of device 0 written to {path}\n"
        (kernel,) = load_trace(path).kernels
        assert kernel.blocks == 264
        ctx.launch("spin", 1, 32, [1000])  # served on
        ctx.synchronize()
    assert control(daemon, "mpsd_trace\n").stdout == "No trace: the daemon was started without --trace\n"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_socket_unit_verifies_without_a_word(tmp_path):
    """systemd-analyze verify accepts mpsd.socket with its service, with nothing on stderr."""
    for name in ("mpsd.service", "mpsd.socket"):
        text = (UNITS / name).read_text().replace("/usr/local/bin/mpsd", str(BIN / "mpsd"))
        (tmp_path / name).write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "mpsd.socket"),
                             str(tmp_path / "mpsd.service")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate is missing")
def test_socket_activation_serves_the_first_client():
    """Under systemd-socket-activate the daemon starts at the first connection, adopts the socket (LISTEN_FDS),
    serves that client, notifies READY=1 and STOPPING=1, and leaves the socket file to its owner."""
    base = short_tempdir()
    pipe = base / "pipe"
    pipe.mkdir(mode=0o700)
    notify_path = base / "notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(30)
    activator = subprocess.Popen(
        ["systemd-socket-activate", "-l", str(pipe / "mpsd.sock"), "--fdname=mpsd",
         "-E", f"NOTIFY_SOCKET={notify_path}", sys.executable, "-m", "mpsd", "--pipe-dir", str(pipe),
         "--time-scale", "100"],
        stderr=subprocess.PIPE, text=True)
    try:
        assert "Listening on" in activator.stderr.readline()
        with mpsd_client.connect(pipe) as ctx:  # this connection is what starts the daemon
            assert notify.recv(4096).decode().splitlines()[0] == "READY=1"
            p = ctx.malloc(64)
            ctx.memset(p, 7, 64)
            ctx.synchronize()
            assert bytes(ctx.host_view(p)[:4]) == b"\x07" * 4
            assert "control daemon" in wait_for_log_dir(pipe, "sockets from systemd")
            pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())  # MPS's pid file, as without systemd
            assert "mpsd" in Path(f"/proc/{pid}/cmdline").read_text()
        activator.send_signal(signal.SIGTERM)
        assert activator.wait(30) == 0
        states = []
        while "STOPPING=1" not in states:
            states.append(notify.recv(4096).decode())
        assert states == ["STATUS=1 clients", "STATUS=0 clients", "STOPPING=1"]
        assert (pipe / "mpsd.sock").exists()  # systemd's socket, not ours to remove
        assert not (pipe / "control").exists()  # ours: bound beside it, and removed
        assert not (pipe / "nvidia-cuda-mps-control.pid").exists()
    finally:
        if activator.poll() is None:
            activator.kill()
            activator.wait()
        activator.stderr.close()
        notify.close()
        shutil.rmtree(base)


def wait_for_log_dir(pipe: Path, text: str) -> str:
    class Logs:
        def server_log(self) -> str:
            path = pipe / "control.log"
            return path.read_text() if path.exists() else ""

    return wait_for_log(Logs(), text)
