# cudaSetDeviceFlags' scheduling choices: how a blocking client's thread waits for the daemon's reply
# (mpsd_client._wait). Whether a wait blocked is read from the thread's voluntary context switches
# (getrusage): a thread that spins on a non-blocking socket makes none, one that sleeps in recv makes one.
# The peer that answers is another process, so that no lock of this one (the GIL) can make the reader sleep.
from __future__ import annotations

import os
import resource
import socket
import time

import pytest

from daemons import run_worker
from mpsd_client import (
    DEVICE_LMEM_RESIZE_TO_MAX,
    DEVICE_MAP_HOST,
    DEVICE_SCHEDULE_AUTO,
    DEVICE_SCHEDULE_BLOCKING_SYNC,
    DEVICE_SCHEDULE_SPIN,
    DEVICE_SCHEDULE_YIELD,
    DEVICE_SYNC_MEMOPS,
    InvalidValueError,
)
from mpsd_client._wait import ReplyWait
from mpsd_protocol._spin import PROBE

SCHEDULES = {"auto": DEVICE_SCHEDULE_AUTO, "spin": DEVICE_SCHEDULE_SPIN, "yield": DEVICE_SCHEDULE_YIELD,
             "blocking": DEVICE_SCHEDULE_BLOCKING_SYNC}


def _read_late(wait: ReplyWait, sock: socket.socket, delay: float, schedule: int = DEVICE_SCHEDULE_AUTO
               ) -> tuple[bytes, int]:
    """What `wait` reads when another process writes a byte to `sock`'s peer after `delay` seconds, and how
    many times the reading thread slept meanwhile."""
    peer = sock.dup()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        time.sleep(delay)
        os.write(peer.fileno(), b"x")
        os._exit(0)
    peer.close()
    try:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        data = wait.read(schedule)[0]
        return data, resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before
    finally:
        os.waitpid(pid, 0)


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


@pytest.mark.parametrize("schedule, sleeps", [("spin", False), ("yield", False), ("blocking", True),
                                              ("auto", True)])
def test_each_schedule_waits_as_cuda_says(pair, schedule, sleeps):
    """A reply 50 ms away: Spin and Yield keep reading until it comes; BlockingSync sleeps at once; Auto spins
    for its window (200 us) and then sleeps."""
    data, slept = _read_late(ReplyWait(pair[0]), pair[1], 0.05, SCHEDULES[schedule])
    assert data == b"x"
    assert (slept > 0) == sleeps, slept


def test_auto_spins_only_now_and_then_for_replies_that_keep_coming_late(pair):
    """After its spins have missed often enough Auto stops spinning, but for one wait in PROBE, and a reply
    that is there when it looks keeps its spins going."""
    wait = ReplyWait(pair[0])
    # Each late reply lowers the share of hits by an eighth: 11 do it, or more where the machine is so busy that
    # the reader, put off the core during its 200-us window, finds a reply 20 ms late there when it is back.
    for _ in range(60):
        _read_late(wait, pair[1], 0.02)
        if wait.odds.rate < 0.25:
            break
    assert wait.odds.rate < 0.25
    rates = []
    for _ in range(PROBE):
        _read_late(wait, pair[1], 0.02)
        rates.append(wait.odds.rate)
    changed = [i for i in range(1, PROBE) if rates[i] != rates[i - 1]]
    assert len(changed) <= 1  # one probe in PROBE waits spun (and missed); the others went to sleep at once
    pair[1].send(b"y")
    low = wait.odds.rate
    wait.odds.waits = PROBE - 1  # the next wait is a probe: it finds the reply there, a hit
    assert wait.read(DEVICE_SCHEDULE_AUTO)[0] == b"y"
    assert wait.odds.rate > low


def test_device_flags_are_checked_as_cuda_checks_them(ctx):
    assert ctx.get_device_flags() == DEVICE_SCHEDULE_AUTO | DEVICE_MAP_HOST
    for flags in (DEVICE_SCHEDULE_SPIN, DEVICE_SCHEDULE_YIELD | DEVICE_SYNC_MEMOPS,
                  DEVICE_SCHEDULE_BLOCKING_SYNC | DEVICE_LMEM_RESIZE_TO_MAX, DEVICE_SCHEDULE_AUTO):
        ctx.set_device_flags(flags)
        assert ctx.get_device_flags() == flags | DEVICE_MAP_HOST
        assert ctx.mem_get_info()[1] > 0  # and calls still get their replies
    # Bits 0x20 and 0x40 are taken and dropped, as the H200's runtime does.
    ctx.set_device_flags(DEVICE_SCHEDULE_SPIN | 0x20 | 0x40)
    assert ctx.get_device_flags() == DEVICE_SCHEDULE_SPIN | DEVICE_MAP_HOST
    ctx.set_device_flags(DEVICE_SCHEDULE_AUTO)
    for bad in (DEVICE_SCHEDULE_SPIN | DEVICE_SCHEDULE_YIELD, 0x3 | DEVICE_SCHEDULE_BLOCKING_SYNC, 0x100, -1, "spin",
                1.0, True):
        with pytest.raises(InvalidValueError):
            ctx.set_device_flags(bad)
        assert ctx.get_device_flags() == DEVICE_MAP_HOST  # unchanged


async def test_the_trio_context_keeps_the_flags(actx):
    actx.set_device_flags(DEVICE_SCHEDULE_BLOCKING_SYNC)
    assert actx.get_device_flags() == DEVICE_SCHEDULE_BLOCKING_SYNC | DEVICE_MAP_HOST
    assert (await actx.mem_get_info())[1] > 0
    with pytest.raises(InvalidValueError):
        actx.set_device_flags(0x100)


SYNCHRONIZE = """
import resource, sys, mpsd_client
with mpsd_client.connect() as ctx:
    ctx.set_device_flags(int(sys.argv[1]))
    slept = []
    for _ in range(3):
        ctx.launch("spin", 1, 32, [int(0.05 * 1.98e9)])   # 50 ms of simulated time, 50 ms at --time-scale 1
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        ctx.synchronize()
        slept.append(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before)
    print(min(slept), max(slept))
"""


@pytest.mark.parametrize("schedule", ["spin", "blocking"])
def test_a_real_clients_synchronize_waits_as_its_flags_say(realtime_daemon, schedule):
    """A worker process that waits 50 ms for its kernel: with Spin its thread never sleeps, with BlockingSync
    it sleeps in every wait."""
    result = run_worker(SYNCHRONIZE, realtime_daemon.pipe_dir, str(SCHEDULES[schedule]))
    assert result.returncode == 0, result.stderr
    fewest, most = map(int, result.stdout.split())
    if schedule == "spin":
        assert most == 0, result.stdout
    else:
        assert fewest > 0, result.stdout
