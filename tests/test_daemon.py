# The daemon as a process: start-up, options, shutdown, bad input from a peer, and reclaiming what a killed
# client held. Everything runs over the real socket of a real `python -m mpsd`.
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import msgpack
import pytest
import trio

import mpsd_client
import mpsd_protocol as p
from daemons import as_user, second_user, short_tempdir, spawn_worker, start_daemon
from mpsd.daemon.listeners import open_listeners


def raw_socket(daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(str(daemon.socket_path))
    return sock


def read_until_closed(sock: socket.socket) -> list[object]:
    """Every message the daemon sends until it closes the connection."""
    conn = p.Connection(p.Role.CLIENT)
    conn._sent_first = True  # this raw peer sent its own bytes
    messages = []
    while True:
        event = conn.next_event()
        if event is p.NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif event is p.CLOSED:
            return messages
        else:
            messages.append(event)


def wait_for_log(daemon, text: str, timeout: float = 20.0, count: int = 1) -> str:
    """The server log once it contains `text` (`count` times; the daemon writes whole lines, flushed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = daemon.server_log()
        if log.count(text) >= count:
            return log
        time.sleep(0.02)
    raise AssertionError(f"{text!r} never appeared in server.log:\n{daemon.server_log()}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_cleanly(daemon_factory, signum):
    """SIGTERM and SIGINT end the daemon with exit 0, its socket file removed and the exit logged."""
    d = start_daemon()
    ctx = mpsd_client.connect(d.pipe_dir)
    ctx.malloc(1 << 20)
    assert d.stop(signum=signum) == 0
    assert not d.socket_path.exists()
    assert "Server exited" in d.server_log()
    with pytest.raises(mpsd_client.MpsRpcFailureError):
        ctx.mem_get_info()
    ctx.close()


def test_in_flight_reply_finishes_during_shutdown(daemon_factory):
    """A synchronize already waiting when SIGTERM arrives still gets its reply before the daemon exits."""
    d = start_daemon("--time-scale", "1")
    worker = spawn_worker("""
        import mpsd_client, time
        ctx = mpsd_client.connect()
        ctx.launch("spin", 264, 1024, [int(2 * 1.98e9)])   # 2 s of simulated (= wall) time
        print("synchronizing", flush=True)
        t = time.monotonic(); ctx.synchronize(); print("synchronized", round(time.monotonic() - t, 2))
    """, d.pipe_dir)
    assert worker.stdout.readline().strip() == "synchronizing"
    # The launch is fire-and-forget, so "synchronizing" can come before the daemon has even seen it: give the
    # synchronize request time to arrive (the kernel still has well over a second to run).
    time.sleep(0.3)
    d.proc.send_signal(signal.SIGTERM)
    out, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err
    assert out.startswith("synchronized")
    assert d.stop(signum=None) == 0


def test_a_client_connecting_during_shutdown_is_refused_at_once(daemon_factory):
    """While a shutting-down daemon finishes the replies in flight, a new client is refused at once (it used
    to sit in the listen queue until its handshake timed out)."""
    d = start_daemon("--time-scale", "1")
    worker = spawn_worker("""
        import mpsd_client
        ctx = mpsd_client.connect()
        ctx.launch("spin", 264, 1024, [int(3 * 1.98e9)])   # 3 s of simulated (= wall) time
        print("synchronizing", flush=True)
        ctx.synchronize()
    """, d.pipe_dir)
    assert worker.stdout.readline().strip() == "synchronizing"
    time.sleep(0.3)  # the synchronize is in flight (see the test above)
    d.proc.send_signal(signal.SIGTERM)
    wait_for_log(d, "Shutting down")
    with pytest.raises(mpsd_client.MpsConnectionError) as refused:
        mpsd_client.connect(d.pipe_dir, timeout=30)
    assert "handshake" not in str(refused.value)
    worker.communicate(timeout=30)
    assert d.stop(signum=None) == 0


def test_second_daemon_on_the_same_pipe_directory_is_refused(daemon):
    """Starting a daemon where one listens fails with exit 1 and one line, leaving the first untouched."""
    proc = subprocess.run([sys.executable, "-m", "mpsd", "--pipe-dir", str(daemon.pipe_dir)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"mpsd: another mpsd is already listening on {daemon.socket_path}"
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        assert ctx.mem_get_info()[1] > 0


def test_stale_socket_file_is_replaced_and_pipe_dir_is_as_mps_makes_it(daemon_factory):
    """A socket file left by a dead daemon is replaced. Root's daemon makes its pipe directory 0755 and its
    sockets 0666, as real MPS's control daemon does (the H200's recorded listing: control 0666), since it serves
    every user's clients, one user at a time; a user's own daemon makes it 0700 (the next test)."""
    assert os.geteuid() == 0 or pytest.skip("the tests' daemons run as root here, as MPS's does")
    pipe = short_tempdir() / "pipe"
    pipe.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(pipe / "mpsd.sock"))
    stale.close()
    d = start_daemon(pipe_dir=pipe)
    daemon_factory.append(d)
    assert stat.S_IMODE(os.stat(pipe).st_mode) == 0o755
    assert [stat.S_IMODE(os.stat(pipe / name).st_mode) for name in ("mpsd.sock", "control")] == [0o666, 0o666]
    with mpsd_client.connect(pipe) as ctx:
        assert ctx.device_properties()["name"] == "NVIDIA H200"



def test_a_users_own_daemon_keeps_its_pipe_dir_to_that_user():
    """Listening as another user than root, without --multiuser, the daemon makes its pipe directory 0700 and
    leaves its sockets as bound, with nothing for group or others: no other user reaches them. With --multiuser
    they are 0755 and 0666, as a root daemon's."""
    user = second_user() or pytest.skip("needs root to create a second user (useradd)")
    base = short_tempdir()
    os.chown(base, user.pw_uid, user.pw_gid)

    def listen() -> str:
        os.umask(0o077)
        modes = []
        for multiuser in (False, True):
            pipe = base / f"pipe-{multiuser}"

            async def open_and_close() -> None:
                listeners = await open_listeners(pipe, environ={}, multiuser=multiuser)
                listeners.clients.close()
                listeners.control.close()

            trio.run(open_and_close)
            modes.append([stat.S_IMODE(os.stat(path).st_mode) for path in (pipe, pipe / "mpsd.sock", pipe / "control")])
        return json.dumps(modes)

    try:
        private, multiuser = json.loads(as_user(user, listen))
        assert private[0] == 0o700 and not any(mode & 0o077 for mode in private)
        assert multiuser == [0o755, 0o666, 0o666]
    finally:
        shutil.rmtree(base, ignore_errors=True)

def test_unwritable_log_directory_is_one_line_and_exit_1(tmp_path):
    """A log directory that cannot be created stops the daemon at start with one line, exit 1."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = subprocess.run([sys.executable, "-m", "mpsd", "--pipe-dir", str(short_tempdir()), "--log-dir",
                           str(blocker / "logs")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"mpsd: cannot write logs in {blocker / 'logs'}:") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("args,message", [
    (["--time-scale", "-1"], "mpsd: --time-scale must be positive, not -1.0"),
    (["--devices", "gpu9"], "mpsd: unknown device model 'gpu9' (known: h200, cuda:N, auto)"),
    (["--active-thread-percentage", "150"], "mpsd: --active-thread-percentage must be in (0, 100], not 150.0"),
    (["--pinned-mem-limit", "lots"], "mpsd: --pinned-mem-limit: not a size: 'lots' (expected e.g. 512M or 1G)"),
    (["--handshake-timeout", "0"], "mpsd: --handshake-timeout must be a positive number of seconds, not 0.0"),
])
def test_bad_options_exit_2_with_one_line(args, message):
    """A user mistake in the options gives exit 2 and one line, never a traceback."""
    proc = subprocess.run([sys.executable, "-m", "mpsd", "--pipe-dir", str(short_tempdir()), *args],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == message


def test_malformed_frame_closes_only_that_connection(ctx, daemon):
    """Garbage from one peer gets a protocol_error notice and a closed socket; other clients carry on."""
    p_before = ctx.malloc(4096)
    sock = raw_socket(daemon)
    hello = p.Connection(p.Role.CLIENT).send(p.Request(0, "hello", {"version": p.PROTOCOL_VERSION}))
    sock.sendall(hello + p.HEADER.pack(5, 0) + b"\xc1\xc1\xc1\xc1\xc1")
    messages = read_until_closed(sock)
    assert isinstance(messages[0], p.Reply) and messages[0].error is None
    assert isinstance(messages[-1], p.Notification) and messages[-1].op == "protocol_error"
    assert "undecodable" in messages[-1].args["message"]
    sock.close()
    ctx.memset(p_before, 1, 4096)
    ctx.synchronize()
    assert ctx.mem_get_info()[0] > 0


@pytest.mark.parametrize("frame", [
    p.HEADER.pack(len(b := msgpack.packb([0, 1, "malloc", {"nbytes": 4}])), 0) + b,   # no hello first
    p.HEADER.pack(0xFFFFFFFF, 0),                                                     # absurd length
    p.HEADER.pack(len(b := msgpack.packb([2, "launch", {}])), 9) + b,                 # fds that never came
    b"\x00" * 3,                                                                      # a torn header, then EOF
])
def test_bad_first_frames_never_hurt_the_daemon(module_daemon, frame):
    """Frames that break the rules close that connection; the daemon keeps serving (one daemon takes every
    frame in turn, so each case also shows the ones before it hurt nothing)."""
    sock = raw_socket(module_daemon)
    sock.sendall(frame)
    sock.shutdown(socket.SHUT_WR)
    read_until_closed(sock)
    sock.close()
    with mpsd_client.connect(module_daemon.pipe_dir) as ctx:
        assert ctx.malloc(16)


def test_protocol_version_mismatch_is_an_mps_connection_error(daemon):
    """A client speaking another protocol version is refused with cudaErrorMpsConnectionFailed."""
    sock = raw_socket(daemon)
    sock.sendall(p.Connection(p.Role.CLIENT).send(p.Request(0, "hello", {"version": 99})))
    (reply,) = read_until_closed(sock)
    assert reply.error["code"] == 805 and "version 99" in reply.error["message"]
    sock.close()


def test_unknown_requests_and_malformed_arguments_get_invalid_value(ctx):
    """Requests the daemon does not know, or with missing or mistyped arguments, get cudaErrorInvalidValue."""
    for op, args in [("no_such_call", {}), ("malloc", {}), ("malloc", {"nbytes": "many"}),
                     ("memset", {"ptr": 1, "value": 0, "nbytes": [1]}), ("free", {"ptr": None})]:
        with pytest.raises(mpsd_client.InvalidValueError):
            ctx._drive(ctx._core.call(op, args))
    assert ctx.malloc(16)


def test_peer_credentials_are_trusted_not_the_claimed_pid(daemon):
    """The daemon logs the pid from SO_PEERCRED, and notes a different pid the client claimed."""
    sock = raw_socket(daemon)
    sock.sendall(p.Connection(p.Role.CLIENT).send(p.Request(0, "hello", {"version": p.PROTOCOL_VERSION,
                                                                         "pid": 1})))
    wait_for_log(daemon, f"New client {os.getpid()} connected")
    assert "it claimed pid 1" in daemon.server_log()
    sock.close()


def test_killed_client_is_reclaimed(ctx, daemon):
    """SIGKILL mid-work frees the client's memory, streams, events and buffers, and the daemon logs it."""
    free_before = ctx.mem_get_info()[0]
    worker = spawn_worker("""
        import mpsd_client
        ctx = mpsd_client.connect()
        ptrs = [ctx.malloc(256 << 20) for _ in range(4)]
        streams = [ctx.create_stream() for _ in range(3)]
        events = [ctx.create_event() for _ in range(2)]
        host = ctx.host_alloc(1 << 20)
        for s in streams:
            ctx.launch("spin", 264, 1024, [10**12], stream=s)   # still running when we die
        print(ctx.mem_get_info()[0], flush=True)
        input()
    """, daemon.pipe_dir)
    free_during = int(worker.stdout.readline())
    assert free_during == free_before - (1 << 30) - 538_339_472  # its allocations and its context
    worker.kill()
    worker.communicate()
    log = wait_for_log(daemon, f"Client {worker.pid} disconnected")
    assert (f"Client {worker.pid} disconnected; reclaimed 4 allocations (1 GiB), 0 IPC imports, 3 streams, 2 events, "
            "1 host buffers") in log
    assert ctx.mem_get_info()[0] == free_before
    ctx.launch("spin", 264, 1024, [1000])
    ctx.synchronize()  # the dead client's endless kernels no longer hold the GPU's queues


def test_many_clients_come_and_go(daemon):
    """Sixteen worker processes connect, work and exit; afterwards the device is as free as before and
    the daemon holds no more file descriptors than it did."""
    fd_dir = f"/proc/{daemon.proc.pid}/fd"
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        free = ctx.mem_get_info()[0]
        fds_before = len(os.listdir(fd_dir))
        workers = [spawn_worker("""
            import mpsd_client, numpy as np
            with mpsd_client.connect() as ctx:
                p = ctx.malloc(1 << 20)
                pinned = ctx.host_alloc(1 << 20)
                ctx.launch("fill_f32", 64, 256, [p, 3.0, 1 << 18])
                out = np.empty(1 << 18, np.float32)
                ctx.memcpy_dtoh(out, p)       # through a staging buffer: another memfd
                ctx.memcpy_dtoh(pinned, p)
                print(bool((out == 3.0).all()) and bytes(pinned[:4]) == b"\\x00\\x00\\x40\\x40")
        """, daemon.pipe_dir) for _ in range(16)]
        for w in workers:
            out, err = w.communicate(timeout=60)
            assert w.returncode == 0 and out.strip() == "True", err
        wait_for_log(daemon, "disconnected", timeout=20)
        deadline = time.monotonic() + 20
        while daemon.server_log().count("disconnected; reclaimed") < 16 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ctx.mem_get_info()[0] == free
        assert len(os.listdir(fd_dir)) == fds_before


def _memfd(size: int, seals: int = 0) -> int:
    import fcntl

    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_host_buffers_must_be_sealed_memfds(ctx, daemon):
    """The daemon maps only memfds that cannot shrink under it; anything else is cudaErrorInvalidValue."""
    import fcntl

    register = lambda fd, n: ctx._drive(ctx._core.call("host_register", {"nbytes": n}, (fd,)))  # noqa: E731
    r, w = os.pipe()
    candidates = [(_memfd(4096), 4096), (r, 4096), (_memfd(4096, fcntl.F_SEAL_SHRINK), 8192)]
    for fd, n in candidates:
        with pytest.raises(mpsd_client.InvalidValueError):
            register(fd, n)
    sealed = _memfd(4096, fcntl.F_SEAL_SHRINK)
    assert register(sealed, 4096) > 0
    with pytest.raises(OSError):
        os.ftruncate(sealed, 0)  # the kernel refuses: the daemon's mapping cannot be pulled away
    for fd in [fd for fd, _ in candidates] + [w, sealed]:
        os.close(fd)


def test_fds_attached_to_any_request_are_not_kept(ctx, daemon):
    """Fds a client attaches to calls that take none are closed by the daemon, never leaked."""
    fd_dir = f"/proc/{daemon.proc.pid}/fd"
    ctx.malloc(16)
    before = len(os.listdir(fd_dir))
    for _ in range(20):
        fds = tuple(_memfd(16) for _ in range(4))
        ctx._drive(ctx._core.call("mem_get_info", {}, fds))
        with pytest.raises(mpsd_client.InvalidValueError):
            ctx._drive(ctx._core.call("no_such_call", {}, fds))
        for fd in fds:
            os.close(fd)
    assert len(os.listdir(fd_dir)) == before


def test_an_enormous_grid_does_not_make_the_daemon_deaf(daemon):
    """A grid of billions of empty blocks keeps the GPU busy, but other clients are still answered and the
    daemon still stops on SIGTERM."""
    worker = spawn_worker("""
        import mpsd_client
        ctx = mpsd_client.connect()
        ctx.launch("spin", (2**31 - 1, 65535, 1), 32, [0])
        print("launched", flush=True)
        ctx.synchronize()
    """, daemon.pipe_dir)
    assert worker.stdout.readline().strip() == "launched"
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        for _ in range(20):
            assert ctx.mem_get_info()[1] > 0
        worker.kill()  # while it waits in synchronize: its session must still end and be reclaimed at once
        worker.communicate()
        wait_for_log(daemon, f"Client {worker.pid} disconnected")
        ctx.launch("spin", 264, 1024, [1000])
        ctx.synchronize()


def test_client_limit_per_device(daemon_factory):
    """The client limit per device gives cudaErrorMpsMaxClientsReached to the one beyond it."""
    d = start_daemon("--time-scale", "100", "--max-clients", "3")
    daemon_factory.append(d)
    clients = [mpsd_client.connect(d.pipe_dir) for _ in range(3)]
    with pytest.raises(mpsd_client.MpsMaxClientsReachedError):
        mpsd_client.connect(d.pipe_dir)
    for c in clients:
        c.close()


def test_a_blocking_client_loads_neither_numpy_nor_trio(daemon):
    """A worker process that only blocks pays for what it uses: copies from bytes and from a pinned buffer work
    without numpy, and trio comes in only with the trio shell (the two were 26 MiB of a client's 39)."""
    from daemons import run_worker
    proc = run_worker("""
        import sys
        import mpsd_client
        with mpsd_client.connect() as ctx:
            p = ctx.malloc(1 << 16)
            ctx.memcpy_htod(p, b"x" * 4096)
            pinned = ctx.host_alloc(4096)
            ctx.memcpy_dtoh(pinned, p)
            ctx.synchronize()
            assert bytes(memoryview(pinned)[:4]) == b"xxxx"
        print(sorted(m for m in ("numpy", "trio") if m in sys.modules))
        mpsd_client.open_context
        print("trio" in sys.modules)
    """, daemon.pipe_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "True"]
