# The adversarial suite: what a hostile local user, or a careless one, can do to a real daemon and its real
# clients (issue 13). Each test pins one defence. The packets, directories and fake servers are real; where an
# attack needs another owner, a real second user plays it (as in test_ipc), and the test is skipped without one.
from __future__ import annotations

import os
import pwd
import resource
import shutil
import socket
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import msgpack
import psutil
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import mpsd_client
import mpsd_protocol
from daemons import DaemonProcess, short_tempdir, start_daemon
from fuzzing import COMMANDS, command_lines, control_packets, ends_nothing
from test_daemon import raw_socket, read_until_closed
from test_ipc import _as_user, _second_user

BIN = Path(sys.executable).parent
PACKET = 1 << 16


def _control_socket(daemon: DaemonProcess) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(20)
    sock.connect(str(daemon.pipe_dir / "control"))
    return sock


def _ask(sock: socket.socket, packet: bytes) -> str:
    """The daemon's answer to one raw control packet (the wire format of mpsd-control: b"=" + output)."""
    sock.send(packet)
    reply = sock.recv(PACKET)
    assert reply[:1] == b"=", f"no reply to {packet[:60]!r}: the daemon closed the connection"
    return reply[1:].decode(errors="surrogateescape")


@pytest.fixture
def base() -> Iterator[Path]:
    """A short private scratch directory (socket paths are limited to 107 bytes), removed afterwards."""
    path = short_tempdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _needs_second_user() -> pwd.struct_passwd:
    user = _second_user()
    if user is None:
        pytest.skip("needs root to create a second user (useradd)")
    return user


# -- item 1: no control packet takes the daemon down ----------------------------------------------------------

def _hostile_packets(pid: int) -> list[tuple[bytes, str]]:
    """Packets that each once ended the daemon (or were taken as numbers they are not), with their answers."""
    many = "9" * 5000
    # MPS's own commands read numbers as C does (atoi, strtod, strtoull: a digit that is not ASCII is no
    # digit, too many digits saturate), as the H200's nvidia-cuda-mps-control does; mpsd's own stay strict.
    texts = [
        ("get_server_status ²", "A server PID is required"),
        ("get_server_status ①", "A server PID is required"),
        (f"get_server_status {many}", f"Server {(1 << 63) - 1} not found"),
        ("shutdown_server ²", "Server 0 not found"),
        ("set_client_priority uid:² 1", "Invalid client 'uid:²': a pid, or uid:<uid>"),
        ("get_client_priority ²", "Invalid client '²': a pid, or uid:<uid>"),
        (f"get_client_weight {many}", f"Invalid client '{many[:20]}...': a pid, or uid:<uid>"),
        ("set_client_priority 1 ٥", "Invalid client priority '٥'"),
        ("set_client_priority 1 1_0", "Invalid client priority '1_0'"),
        ("set_client_weight 1 ١", "Invalid client weight '١'"),
        ("set_default_active_thread_percentage ٥٠", "100.0"),
        (f"get_device_pinned_mem_limit {pid} ²", ""),
        ("get_default_device_pinned_mem_limit ①", ""),
        (f"set_default_device_pinned_mem_limit 0 {many}", ""),
        ("get_default_device_pinned_mem_limit 0", "17179869183G"),
        ("set_default_device_pinned_mem_limit 0 ٥G", ""),
        ("start_server -uid ²", "A user id (UID) is required to start a new server"),
        ("get_default_client_priority\u00a0", 'Unknown command "get_default_client_priority\u00a0"'),  # no C space
    ]
    return [(text.encode(), answer) for text, answer in texts] + [
        (b"get_server_status \xff\xfe", "A server PID is required"),
        (b"\xc3\x28", 'Unknown command "\udcc3("'),  # the bytes as they came, which are not UTF-8
    ]


def test_hostile_control_packets_are_answered_and_the_daemon_stays_up(ctx, daemon):
    """Each hostile control packet gets its error line; the daemon, its settings and a tenant's allocation
    survive all of them."""
    p = ctx.malloc(4096)
    ctx.memset(p, 0x5A, 4096)
    ctx.synchronize()
    with _control_socket(daemon) as sock:
        for packet, answer in _hostile_packets(daemon.proc.pid):
            assert _ask(sock, packet) == answer, packet[:60]
            assert daemon.proc.poll() is None, f"{packet[:60]!r} ended the daemon"
        assert _ask(sock, b"get_default_active_thread_percentage") == "100.0"
        assert _ask(sock, b"get_default_device_pinned_mem_limit 0") == ""
        assert _ask(sock, b"get_client_priority 1") == "0"
    assert bytes(ctx.host_view(p)[:8]) == b"\x5a" * 8
    q = ctx.malloc(1 << 20)
    ctx.memset(q, 1, 1 << 20)
    ctx.synchronize()
    assert bytes(ctx.host_view(q)[-4:]) == b"\x01" * 4


def test_a_number_of_thousands_of_digits_gets_an_answer_not_an_internal_error(ctx, daemon):
    """Python converts no more than 4,300 digits to an int: every argument of every command, given 4,301 of them,
    is read as MPS reads it (a number too large, or no number), and no answer is the daemon's internal error."""
    commands = {**COMMANDS, "mpsd_compute_mode": 2, "sm_partition": 2}
    with _control_socket(daemon) as sock:
        for name, count in sorted(commands.items()):
            for i in range(count):
                line = " ".join([name, *("9" * 4301 if j == i else "0" for j in range(count))])
                answer = _ask(sock, line.encode())
                assert not answer.startswith("Internal error"), (name, i, answer)
        assert daemon.proc.poll() is None


def test_fuzzed_control_packets_all_get_a_reply(ctx, daemon):
    """Random command lines of every command with random arguments, and random bytes: every packet is
    answered and the daemon stays up."""
    pid = str(daemon.proc.pid)
    sock = _control_socket(daemon)

    @settings(max_examples=200, deadline=None)
    @given(command_lines(pid) | st.binary(min_size=1, max_size=64).filter(ends_nothing))
    def one_packet(packet: bytes) -> None:
        sock.send(packet)
        reply = sock.recv(PACKET)
        assert reply[:1] == b"=", f"no reply to {packet[:80]!r}"
        assert daemon.proc.poll() is None, f"{packet[:80]!r} ended the daemon"

    with sock:
        one_packet()
        assert _ask(sock, b"get_server_list") == pid
    assert ctx.malloc(64) > 0


def test_fuzzed_v3_and_long_control_packets_all_get_a_reply(daemon_factory):
    """On a protocol 3 daemon, which takes both languages: random v3 module-verb lines, legacy lines, random bytes
    and lines of up to 70,000 bytes (more than a packet the daemon reads) each get their whole answer, none an
    internal error, and the daemon stays up and serves a new client."""
    d = start_daemon("--protocol", "3", "--time-scale", "100")
    daemon_factory.append(d)
    sock = _control_socket(d)

    @settings(max_examples=200, deadline=None)
    @given(control_packets(str(d.proc.pid)))
    def one_packet(packet: bytes) -> None:
        sock.send(packet)
        answer = mpsd_protocol.read_control_answer(lambda: sock.recv(PACKET))
        assert answer is not None, f"no reply to {packet[:80]!r}"
        assert not answer[0].startswith(b"Internal error"), (packet[:80], answer)
        assert d.proc.poll() is None, f"{packet[:80]!r} ended the daemon"

    with sock:
        one_packet()
    # Served, under whatever settings the fuzzed lines left (a default pinned limit of 1 MiB, say, which a
    # malloc would then rightly be refused under): a round trip the limits do not decide.
    with mpsd_client.connect(d.pipe_dir) as ctx:
        free, total = ctx.mem_get_info()
        assert 0 <= free <= total and total > 0


def test_control_log_states_the_true_exit_status(base):
    """control.log ends "Exit with status 0" after a clean SIGTERM, and "Exit with status 1" when the daemon
    fails (here: the socket it was handed does not accept connections) and exits 1."""
    clean = start_daemon()
    assert clean.stop() == 0
    assert (clean.log_dir / "control.log").read_text().splitlines()[-1].endswith("] Exit with status 0")
    shutil.rmtree(clean.pipe_dir.parent)

    pipe = base / "pipe"
    pipe.mkdir(mode=0o700)
    broken = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    broken.bind(str(pipe / "mpsd.sock"))  # bound but never listening: the first accept fails
    # The activation environment names the daemon's own pid, so a wrapper sets it and execs the daemon.
    activate = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.environ.update(LISTEN_PID=str(os.getpid()), "
                "LISTEN_FDS='1', LISTEN_FDNAMES='mpsd'); os.execv(sys.executable, [sys.executable, '-m', 'mpsd', "
                "*sys.argv[2:]])")
    proc = subprocess.run([sys.executable, "-c", activate, str(broken.fileno()), "--pipe-dir", str(pipe)],
                          pass_fds=[broken.fileno()], capture_output=True, text=True, timeout=60)
    broken.close()
    assert proc.returncode == 1, proc.stderr
    assert (pipe / "control.log").read_text().splitlines()[-1].endswith("] Exit with status 1")


@pytest.mark.parametrize("variable,value,outcome", [
    ("CUDA_VISIBLE_DEVICES", "0,²", "connected"),  # as in CUDA, the list ends at what is not a device index
    ("CUDA_VISIBLE_DEVICES", "①", "cudaErrorNoDevice"),
    ("MPSD_MIG_PARTITION", "²", "cudaErrorInvalidValue"),
    ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "٥٠", "cudaErrorInvalidValue"),
    ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=٥G", "cudaErrorInvalidValue"),
    ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=" + "9" * 5000, "cudaErrorInvalidValue"),
])
def test_client_environment_numbers_are_ascii(module_daemon, monkeypatch, variable, value, outcome):
    """The client reads the numbers in its environment as strictly as the daemon reads control arguments: a
    lookalike digit is a CUDA error (or ends CUDA_VISIBLE_DEVICES), never a ValueError or a different number."""
    monkeypatch.setenv(variable, value)
    try:
        with mpsd_client.connect(module_daemon.pipe_dir):
            result = "connected"
    except mpsd_client.CudaError as exc:
        result = exc.name
    assert result == outcome


# -- item 2: a pipe or log directory someone else controls is refused -----------------------------------------

def _refused(*args: str) -> str:
    """What the daemon says when it refuses to start (it must exit 1, with one line on stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "mpsd", "--time-scale", "100", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:  # it started (or hung): either way it did not refuse
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the daemon did not refuse to start: {err}") from None
    assert proc.returncode == 1 and err.count("\n") == 1, (proc.returncode, err)
    return err.rstrip("\n")


@pytest.mark.parametrize("logs_beside", [False, True], ids=["own-log-dir", "logs-in-pipe-dir"])
def test_pipe_dir_of_another_user_is_refused(logs_beside, base):
    """A pipe directory another user made first (as anyone can make /tmp/mpsd) is refused, and nothing in it
    is written: not even through control.log and server.log symlinks to a file of ours."""
    user = _needs_second_user()
    pipe, victim = base / "pipe", base / "victim"
    victim.write_text("precious\n")
    pipe.mkdir(mode=0o755)
    for name in ("control.log", "server.log"):
        (pipe / name).symlink_to(victim)
        os.lchown(pipe / name, user.pw_uid, user.pw_gid)
    os.chown(pipe, user.pw_uid, user.pw_gid)
    args = ["--pipe-dir", str(pipe)] + ([] if logs_beside else ["--log-dir", str(base / "log")])
    what = "log directory" if logs_beside else "pipe directory"
    assert _refused(*args) == (f"mpsd: the {what} {pipe} belongs to uid {user.pw_uid}, not to the daemon's uid "
                               f"{os.geteuid()}; remove it or choose another")
    assert victim.read_text() == "precious\n"
    assert sorted(os.listdir(pipe)) == ["control.log", "server.log"]


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777, 0o1777], ids=lambda mode: f"{mode:04o}")
def test_pipe_dir_writable_by_others_is_refused(mode, base):
    """A pipe directory that group or others may write is refused, and left as it was (not chmodded)."""
    pipe = base / "pipe"
    pipe.mkdir()
    pipe.chmod(mode)
    assert _refused("--pipe-dir", str(pipe), "--log-dir", str(base / "log")) == (
        f"mpsd: the pipe directory {pipe} is writable by its group or by others (mode {mode:04o}); make it "
        "0700 or 0755")
    assert stat.S_IMODE(pipe.stat().st_mode) == mode and not os.listdir(pipe)


@pytest.mark.parametrize("which", ["pipe", "log"])
def test_symlinked_pipe_or_log_dir_is_refused(which, base):
    """A pipe or log directory that is a symlink is refused; its target is neither chmodded nor written."""
    target = base / "target"
    target.mkdir()
    target.chmod(0o755)
    (base / which).symlink_to(target)
    other = "log" if which == "pipe" else "pipe"
    what = "pipe directory" if which == "pipe" else "log directory"
    assert _refused(f"--{which}-dir", str(base / which), f"--{other}-dir", str(base / other)) == (
        f"mpsd: the {what} {base / which} is a symbolic link; give the directory itself")
    assert stat.S_IMODE(target.stat().st_mode) == 0o755 and not os.listdir(target)


@pytest.mark.parametrize("name", ["control.log", "server.log"])
@pytest.mark.parametrize("planted", ["symlink", "dangling-symlink", "fifo"])
def test_planted_log_file_is_not_followed(name, planted, base):
    """A symlink (or a FIFO) in place of a log file is refused, never followed: the file it points at is not
    appended to, and the daemon says why it did not start (and does not hang on a FIFO)."""
    logs, victim = base / "log", base / "victim"
    logs.mkdir(mode=0o700)
    victim.write_text("precious\n")
    if planted == "fifo":
        os.mkfifo(logs / name)
    else:
        (logs / name).symlink_to(victim if planted == "symlink" else base / "nowhere")
    kind = "a FIFO" if planted == "fifo" else "a symbolic link"
    assert _refused("--pipe-dir", str(base / "pipe"), "--log-dir", str(logs)) == (
        f"mpsd: cannot write logs in {logs}: {logs / name} is {kind}, not a regular file")
    assert victim.read_text() == "precious\n" and not (base / "nowhere").exists()


def test_file_planted_at_the_socket_path_is_left_and_named(base):
    """A regular file where mpsd.sock goes is left alone (only our uid could have put it in our directory,
    and it may be someone's data), and the daemon says what to do."""
    pipe = base / "pipe"
    pipe.mkdir(mode=0o700)
    (pipe / "mpsd.sock").write_text("data\n")
    assert _refused("--pipe-dir", str(pipe), "--log-dir", str(base / "log")) == (
        f"mpsd: {pipe / 'mpsd.sock'} exists and is a regular file, not a socket; mpsd removes only stale "
        "sockets, so remove it or choose another --pipe-dir")
    assert (pipe / "mpsd.sock").read_text() == "data\n"


# -- item 2: a client talks only to a server run by root or by its own user -----------------------------------

@contextmanager
def _fake_server(user: pwd.struct_passwd, path: Path, kind: int) -> Iterator[list[str]]:
    """A server socket at `path`, run by `user` in a forked child, that counts the bytes its first caller
    sends; the count is in the yielded list once the block ends."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            with socket.socket(socket.AF_UNIX, kind) as server:
                server.bind(str(path))
                server.listen(1)
                os.write(write, b"ready\n")
                server.settimeout(30)
                conn, _ = server.accept()
                conn.settimeout(5)
                received = 0
                try:
                    while chunk := conn.recv(PACKET):
                        received += len(chunk)
                except OSError:
                    pass
                os.write(write, f"{received}\n".encode())
        except BaseException as exc:
            os.write(write, f"{exc!r}\n".encode())
        finally:
            os._exit(0)
    os.close(write)
    result: list[str] = []
    with os.fdopen(read) as pipe:
        assert pipe.readline() == "ready\n"
        try:
            yield result
        finally:
            result.append(pipe.readline().strip())
            os.waitpid(pid, 0)


def _connect_async(pipe: Path) -> None:
    async def main() -> None:
        async with mpsd_client.open_context(pipe, timeout=2):
            pass

    trio.run(main)


@pytest.mark.parametrize("client", ["connect", "open_context", "mpsd-control", "mpsd-smi"])
def test_client_refuses_a_server_of_another_user(client, base):
    """A socket in the pipe directory served by another (non-root) user gets nothing from our client: it
    fails with cudaErrorMpsConnectionFailed naming the uid, and the fake server receives zero bytes."""
    user = _needs_second_user()
    base.chmod(0o755)
    pipe = base / "pipe"
    pipe.mkdir()
    os.chown(pipe, user.pw_uid, user.pw_gid)
    name, kind = ("control", socket.SOCK_SEQPACKET) if client.startswith("mpsd-") else (
        "mpsd.sock", socket.SOCK_STREAM)
    refusal = (f"refusing the mpsd daemon at {pipe / name}: it runs as uid {user.pw_uid}, and a client trusts "
               "only a daemon run by root" + (f" or by its own uid {os.geteuid()}" if os.geteuid() else ""))
    with _fake_server(user, pipe / name, kind) as received:
        if client in ("connect", "open_context"):
            with pytest.raises(mpsd_client.MpsConnectionError) as caught:
                mpsd_client.connect(pipe, timeout=2) if client == "connect" else _connect_async(pipe)
            assert caught.value.code == 805 and caught.value.detail == refusal
        else:
            result = subprocess.run([BIN / client, "--pipe-dir", str(pipe)], input="get_server_list\n",
                                    capture_output=True, text=True, timeout=60)
            assert result.returncode == 1 and result.stderr == f"{client}: {refusal}\n"
    assert received == ["0"]


# -- item 3: one client cannot use up the daemon's file descriptors --------------------------------------------

def _daemon_fds(daemon: DaemonProcess) -> int:
    return psutil.Process(daemon.proc.pid).num_fds()


def _greeted(daemon: DaemonProcess) -> socket.socket:
    """A raw connection to the daemon that has said hello and read the reply."""
    sock = raw_socket(daemon)
    sock.sendall(mpsd_protocol.Connection(mpsd_protocol.Role.CLIENT).send(
        mpsd_protocol.Request(0, "hello", {"version": mpsd_protocol.PROTOCOL_VERSION})))
    return sock


@pytest.mark.parametrize("declared", [0, 1], ids=["none-declared", "fewer-declared"])
def test_fds_no_frame_declared_close_the_connection(ctx, daemon, declared):
    """Fds attached to a frame whose header declares fewer get a protocol error and a closed connection, and
    the daemon keeps none of them (they were kept without bound: 1,249 frames pinned 19,999 fds)."""
    before = _daemon_fds(daemon)
    memfd = os.memfd_create("undeclared")
    sock = _greeted(daemon)
    body = msgpack.packb([0, 1, "mem_get_info", {}])
    sock.sendmsg([mpsd_protocol.HEADER.pack(len(body), declared) + body], mpsd_protocol.pack_fds([memfd] * 16))
    os.close(memfd)
    messages = read_until_closed(sock)  # the old daemon answered and kept the connection: this timed out
    sock.close()
    assert isinstance(messages[0], mpsd_protocol.Reply) and messages[0].error is None  # hello's reply
    assert [(m.op, m.args["message"]) for m in messages[1:]] == [(
        "protocol_error", f"{16 - declared} file descriptors arrived with bytes of frames that declared none of them")]
    assert _daemon_fds(daemon) == before
    assert ctx.mem_get_info()[0] > 0


def test_small_allocations_share_their_chunks_fds(ctx, daemon):
    """4,100 allocations of 512 bytes cost the daemon the fds of their two 2 MiB chunks, not two fds each (at
    9,989 the fd table was full), and each is still its own 512 bytes: host_view, copies and memset stay
    within it, and freeing them all gives the fds back."""
    before = _daemon_fds(daemon)
    pointers = [ctx.malloc(512) for _ in range(4100)]
    assert _daemon_fds(daemon) - before == 4  # two chunks, two fds each (ours and the mapping's)
    for i in (0, 1, 4095, 4096, 4099):  # neighbours in one chunk, the last of it and the first of the next
        view = ctx.host_view(pointers[i])
        assert len(view) == 512 and bytes(view) == bytes(512)
        view[:] = bytes([i % 251 + 1]) * 512
        del view
    for i in (0, 1, 4095, 4096, 4099):
        out = bytearray(512)
        ctx.memcpy_dtoh(out, pointers[i])
        assert out == bytes([i % 251 + 1]) * 512
    out = bytearray(512)
    ctx.memcpy_dtoh(out, pointers[2])
    assert out == bytes(512)  # nothing spilled into the neighbour
    with pytest.raises(mpsd_client.InvalidValueError):
        ctx.memcpy_dtoh(bytearray(513), pointers[0])
    with pytest.raises(mpsd_client.InvalidValueError):
        ctx.memset(pointers[1] + 256, 0, 257)
    for p in pointers:
        ctx.free(p)
    assert _daemon_fds(daemon) == before + 1  # the staging buffer the copies registered


def _silent_connections(daemon: DaemonProcess, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(daemon.socket_path))
        sock.settimeout(30)
        sockets.append(sock)
    return sockets


def test_connections_that_never_say_hello_are_bounded_and_timed_out(daemon_factory):
    """Connections that say nothing are closed when the handshake timeout passes, and at most 64 of one uid
    wait at once (the 65th closes the first at once); a client that said hello is not hurried (they were all
    accepted without limit and kept for ever)."""
    d = start_daemon("--time-scale", "100", "--handshake-timeout", "3")
    daemon_factory.append(d)
    with mpsd_client.connect(d.pipe_dir) as ctx:
        before = _daemon_fds(d)
        silent = _silent_connections(d, 65)
        silent[0].settimeout(2)  # (well before the timeout)
        assert silent[0].recv(1) == b""  # closed for the 65th
        silent[0].settimeout(30)
        for sock in silent:
            assert sock.recv(1) == b""  # the old daemon kept them open: this timed out
            sock.close()
        deadline = time.monotonic() + 20  # every socket is closed; the last log lines may be a moment behind
        while (log := d.server_log()).count("no hello within 3 s") < 64 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert log.count("no hello within 3 s") == 64
        assert log.count(f"User {os.geteuid()} has 64 connections that have not said hello; closing the oldest") == 1
        assert _daemon_fds(d) == before
        assert ctx.malloc(16) > 0  # said hello more than 3 s ago, and still served
    with mpsd_client.connect(d.pipe_dir) as ctx:
        assert ctx.malloc(16) > 0


def test_a_worker_leaking_silent_connections_does_not_lock_out_its_own_user(daemon_factory):
    """A worker holds 64 connections that never say hello and opens one more each time the daemon closes one;
    a new client of the same uid still connects and is served, over and over (43 of 43 failed before)."""
    d = start_daemon("--time-scale", "100", "--handshake-timeout", "30")
    daemon_factory.append(d)
    silent = _silent_connections(d, 64)
    for _ in range(5):
        with mpsd_client.connect(d.pipe_dir) as ctx:  # it closes the oldest silent one to get in
            assert ctx.malloc(16) > 0
        gone = silent.pop(0)
        gone.settimeout(5)
        assert gone.recv(1) == b""
        gone.close()
        silent += _silent_connections(d, 1)  # the leak reopens what was closed: 64 waiting again
    for sock in silent:
        sock.close()


def test_other_users_connect_while_one_floods_the_handshake(daemon_factory):
    """64 silent connections use up their own uid's allowance only: another user's client connects."""
    user = _needs_second_user()
    d = start_daemon("--time-scale", "100", "--multiuser")  # both users at once
    daemon_factory.append(d)
    for path in (d.pipe_dir.parent, d.pipe_dir):
        os.chmod(path, 0o755)  # let the second user reach the socket at all
    os.chmod(d.socket_path, 0o777)
    silent = _silent_connections(d, 65)
    assert silent[0].recv(1) == b""  # closed for the 65th: its uid had 64 waiting already

    def connect() -> str:
        with mpsd_client.connect(d.pipe_dir) as ctx:
            return str(ctx.malloc(16) > 0)

    assert _as_user(user, connect) == "True"
    for sock in silent:
        sock.close()


def test_another_users_idle_control_connections_cannot_take_the_daemons_fds(daemon_factory):
    """Another uid that opens 1,000 control connections and sends nothing keeps at most 64 of them (each new one
    past that closes its oldest), so that on a daemon whose fd limit is 400 above what it holds a new client still
    connects and allocates, and the newest connection is answered (every one was kept without bound: the fd table
    filled, and no client of any user could connect)."""
    user = _needs_second_user()
    d = start_daemon("--time-scale", "100", "--multiuser")
    daemon_factory.append(d)
    for path in (d.pipe_dir.parent, d.pipe_dir):
        os.chmod(path, 0o755)
    process = psutil.Process(d.proc.pid)
    before = process.num_fds()
    process.rlimit(psutil.RLIMIT_NOFILE, (before + 400, before + 400))

    def flood() -> str:
        held = []
        deadline = time.monotonic() + 30
        while len(held) < 1000:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(5)
            try:
                sock.connect(str(d.pipe_dir / "control"))
            except BlockingIOError:  # the listen queue is full: the daemon is not accepting (it cannot, before)
                sock.close()
                if time.monotonic() > deadline:
                    return f"the daemon stopped accepting after {len(held)}"
                time.sleep(0.01)
                continue
            held.append(sock)
        try:
            first = held[0].recv(PACKET)  # closed by the daemon for a newer one
        except OSError as exc:
            first = repr(exc).encode()
        newest = _ask(held[-1], b"get_default_active_thread_percentage")
        with mpsd_client.connect(d.pipe_dir, timeout=5) as ctx:
            allocated = ctx.malloc(4 << 20) > 0
        return repr((first, newest, allocated))

    assert _as_user(user, flood) == repr((b"", "100.0", True))
    deadline = time.monotonic() + 20
    while process.num_fds() != before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.num_fds() == before
    assert f"User {user.pw_uid} has 64 control connections open; closing the oldest" in (
        d.log_dir / "control.log").read_text()


def test_another_users_denied_commands_cannot_flood_control_log(daemon_factory):
    """Another uid's control.log lines are rate-limited (a burst, then a hundred a second, and a count of what
    was left out); the owner's commands are all logged, as MPS logs them."""
    user = _needs_second_user()
    d = start_daemon("--time-scale", "100", "--multiuser")
    daemon_factory.append(d)
    for path in (d.pipe_dir.parent, d.pipe_dir):
        os.chmod(path, 0o755)
    os.chmod(d.pipe_dir / "control", 0o777)
    flood = 2000

    def deny() -> str:
        with _control_socket(d) as sock:
            answers = {_ask(sock, b"set_default_active_thread_percentage 50") for _ in range(flood)}
        time.sleep(0.05)  # (a token's worth later: the next line says how many were left out)
        with _control_socket(d) as sock:
            _ask(sock, b"get_server_list")
        return "|".join(sorted(answers))

    assert _as_user(user, deny).startswith("Permission denied")
    with _control_socket(d) as sock:
        for _ in range(3):
            _ask(sock, b"get_default_client_priority")
    text = (d.log_dir / "control.log").read_text()
    logged = text.count("Cmd:set_default_active_thread_percentage 50")
    assert 0 < logged < flood // 2, logged
    assert f"lines of user {user.pw_uid} left out)" in text
    assert text.count("Cmd:get_default_client_priority") == 3


def test_a_client_that_reads_no_replies_is_disconnected(ctx, daemon):
    """Requests whose replies are never read (each mem_fd reply holds a dup'd fd until it is sent) make the
    daemon close that connection once 64 fds' worth wait, and give every fd back; other clients carry on
    (5,000 such requests held 4,725 fds)."""
    before = _daemon_fds(daemon)
    sock = _greeted(daemon)
    body = msgpack.packb([0, 1, "malloc", {"nbytes": 4096}])
    sock.sendall(mpsd_protocol.HEADER.pack(len(body), 0) + body)
    conn = mpsd_protocol.Connection(mpsd_protocol.Role.CLIENT)
    conn._sent_first = True  # this raw peer sent its own bytes
    while not isinstance(reply := conn.next_event(), mpsd_protocol.Reply) or reply.id != 1:
        if reply is mpsd_protocol.NEED_DATA:
            conn.receive_data(sock.recv(65536))
    try:
        for i in range(2, 5000):
            body = msgpack.packb([0, i, "mem_fd", {"ptr": reply.result}])
            sock.sendall(mpsd_protocol.HEADER.pack(len(body), 0) + body)
    except OSError:
        pass  # the daemon has shut the connection: the point
    while sock.recv(1 << 16):  # what was sent before (its fds are dropped); the old daemon never closed
        pass
    sock.close()
    deadline = time.monotonic() + 20
    while "replies unread" not in (log := daemon.server_log()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "file descriptors of replies unread (at most 8388608 and 64 may wait); its connection was closed" in log
    assert _daemon_fds(daemon) == before
    assert ctx.mem_get_info()[0] > 0


def test_the_daemon_raises_its_soft_fd_limit_to_the_hard_one(daemon_factory):
    """Started with a soft limit of 256 (as systemd's 1024, under which 502 one-MiB allocations fitted), the
    daemon raises it to the hard limit, says so in server.log, and a client's 300 allocations of 4 MiB (600
    fds) fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        d = start_daemon("--time-scale", "100")  # inherits the low soft limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    daemon_factory.append(d)
    assert psutil.Process(d.proc.pid).rlimit(psutil.RLIMIT_NOFILE) == (hard, hard)
    assert f"] File descriptor limit {hard} (raised from 256)" in d.server_log()
    with mpsd_client.connect(d.pipe_dir) as ctx:
        pointers = [ctx.malloc(4 << 20) for _ in range(300)]
        for p in pointers:
            ctx.free(p)
