# A session's channel keeps reading its client's emptied socket for a short while before it parks its task
# (mpsd.daemon.channel.Spin): only while the daemon has no more clients than cores, with every other task let
# run meanwhile, and less and less often for a client that does not call within the window. Real sockets,
# trio's real clock (the window is wall time).
from __future__ import annotations

import socket

import pytest
import trio

from mpsd.daemon.channel import DEFAULT_SPIN, Channel, Spin
from mpsd.daemon.config import ConfigError, load_config

WINDOW = 0.05  # long enough that a loaded machine still sees the difference between spinning and parking


def _waiting_read() -> int:
    return trio.lowlevel.current_statistics().io_statistics.tasks_waiting_read


async def _receive_after(channel: Channel, peer: socket.socket, delay: float) -> tuple[bytes, float]:
    """What the channel receives when the peer sends `delay` seconds after it starts to wait, and how long the
    channel went before it parked (the whole wait if it never did)."""
    parked_after = None
    start, others = trio.current_time(), _waiting_read()  # (trio's own task waits to be woken from a thread)

    async def watch() -> None:
        nonlocal parked_after
        while parked_after is None:
            if _waiting_read() > others:
                parked_after = trio.current_time() - start
            await trio.lowlevel.checkpoint()

    async def send() -> None:
        await trio.sleep(delay)
        peer.send(b"call")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        nursery.start_soon(send)
        data, _ = await channel.receive()
        waited = trio.current_time() - start
        nursery.cancel_scope.cancel()
    return data, waited if parked_after is None else parked_after


async def _drained(channel: Channel, peer: socket.socket) -> None:
    """Leave the channel with an emptied socket, as after a read of the client's last call."""
    peer.send(b"x")
    assert (await channel.receive())[0] == b"x"


async def test_a_channel_spins_for_the_next_call_and_other_tasks_run_meanwhile():
    ours, peer = socket.socketpair()
    with ours, peer:
        channel = Channel(ours, Spin(WINDOW, lambda: 1, cores=2))
        await _drained(channel, peer)
        start = trio.current_time()
        data, before_parking = await _receive_after(channel, peer, WINDOW / 5)
        assert data == b"call" and before_parking >= WINDOW / 5  # it never parked: the call came while it read
        assert trio.current_time() - start < WINDOW  # and the sender's task ran while it read: the call came in time


async def test_with_more_clients_than_cores_a_channel_parks_at_once():
    ours, peer = socket.socketpair()
    with ours, peer:
        channel = Channel(ours, Spin(WINDOW, lambda: 3, cores=2))
        await _drained(channel, peer)
        data, before_parking = await _receive_after(channel, peer, WINDOW / 5)
        assert data == b"call" and before_parking < WINDOW / 5


async def test_a_client_that_calls_late_is_spun_for_once_in_32_waits():
    """Each call comes after the window: the channel spins the whole window, then parks; after about a dozen
    such misses it parks at once, but for one wait in 32, which tries again."""
    ours, peer = socket.socketpair()
    with ours, peer:
        window = 0.01
        channel = Channel(ours, Spin(window, lambda: 1, cores=2))
        await _drained(channel, peer)
        spun = []
        for _ in range(40):  # (each read of a call leaves the socket emptied)
            data, before_parking = await _receive_after(channel, peer, 2 * window)
            assert data == b"call"
            spun.append(before_parking > window / 2)
        first_parked = spun.index(False)
        assert 8 <= first_parked <= 16 and all(spun[:first_parked])
        assert sum(spun[first_parked:]) == 1  # the probe


async def test_a_channel_that_may_not_spin_reads_as_before():
    ours, peer = socket.socketpair()
    with ours, peer:
        for channel in (Channel(ours), Channel(ours, Spin(0.0, lambda: 1, cores=2))):
            await _drained(channel, peer)
            data, before_parking = await _receive_after(channel, peer, WINDOW / 5)
            assert data == b"call" and before_parking < WINDOW / 5


def test_the_spin_setting(tmp_path):
    base = ["--pipe-dir", str(tmp_path)]
    assert load_config(base, {}).spin == DEFAULT_SPIN
    assert load_config([*base, "--spin", "0"], {}).spin == 0
    assert load_config([*base, "--spin", "0.01"], {}).spin == 0.01
    for bad in ("-1e-6", "0.5", "nan"):
        with pytest.raises(ConfigError, match="--spin must be 0 to 0.01 seconds"):
            load_config([*base, f"--spin={bad}"], {})
