# A bounded fuzz of the client socket against one real daemon (issue 13, "Show it"): random frames after a
# valid hello (every call of mpsd_protocol's table with arguments of every msgpack shape), raw garbage, and
# frames cut short, while a healthy tenant process beside them makes round trips. Every attack connection
# gets an answer or a clean close; the healthy tenant never stops; the daemon's fds and RSS come back.
from __future__ import annotations

import socket

import psutil
import pytest
from hypothesis import HealthCheck, given, settings

from daemons import spawn_worker, start_daemon
from fuzzing import GARBAGE, HELLO, MESSAGES, frame

HEALTHY = """
import sys, mpsd_client
with mpsd_client.connect() as ctx:
    p = ctx.malloc(1 << 20)
    print("ready", flush=True)
    rounds = 0
    while not sys.stdin.closed:
        ctx.memset(p, rounds & 0xFF, 4096)
        ctx.synchronize()
        assert ctx.host_view(p)[0] == rounds & 0xFF
        rounds += 1
        if rounds % 50 == 0:
            print(rounds, flush=True)
        if rounds == 100000:
            break
"""


def _attack(path, data: bytes) -> None:
    """Send `data` and read until the daemon closes the connection or has nothing more to say."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)  # end of our input: the daemon must answer and close, never hang
            while sock.recv(1 << 16):
                pass
        except (BrokenPipeError, ConnectionResetError):
            pass  # it closed on us: a protocol error


@pytest.fixture(scope="module")
def target():
    daemon = start_daemon("--time-scale", "100")
    healthy = spawn_worker(HEALTHY, daemon.pipe_dir)
    assert healthy.stdout.readline().strip() == "ready"
    proc = psutil.Process(daemon.proc.pid)
    yield daemon, healthy, proc
    healthy.kill()
    healthy.communicate()
    assert daemon.stop() == 0
    assert not [line for line in daemon.stderr_lines if "Traceback" in line]


def _healthy_goes_on(healthy) -> None:
    before = int(healthy.stdout.readline())
    assert int(healthy.stdout.readline()) == before + 50  # it keeps making round trips
    assert healthy.poll() is None


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


def test_random_calls_after_hello(target):
    """Random calls with random arguments after a valid hello: no traceback, the daemon and the healthy
    tenant go on."""
    daemon, healthy, _ = target

    @FUZZ
    @given(MESSAGES)
    def one_connection(messages) -> None:
        _attack(daemon.socket_path, frame(HELLO) + b"".join(frame(list(m)) for m in messages))
        assert daemon.proc.poll() is None

    one_connection()
    _healthy_goes_on(healthy)


def test_garbage_and_cut_frames(target):
    """Random bytes, random headers, frames cut short or claiming fds they lack: the same."""
    daemon, healthy, _ = target

    @FUZZ
    @given(GARBAGE)
    def one_connection(data: bytes) -> None:
        _attack(daemon.socket_path, data)
        assert daemon.proc.poll() is None

    one_connection()
    _healthy_goes_on(healthy)


def test_fds_and_rss_come_back_after_the_fuzz(target):
    """After the attacks (and a thousand more connections of garbage), the daemon holds the fds it held and
    no more than a little more RSS."""
    daemon, healthy, proc = target
    fds, rss = proc.num_fds(), proc.memory_info().rss
    for i in range(1000):
        _attack(daemon.socket_path, frame(HELLO) + frame([0, 2, "malloc", {"nbytes": 512}]) + bytes([i % 256]) * 9)
    assert proc.num_fds() <= fds + 2
    assert proc.memory_info().rss - rss < 32 << 20
    _healthy_goes_on(healthy)
