# How a blocking client's thread waits for the daemon's reply: the way the CUDA runtime's host thread waits for
# the GPU, by the device flags of cudaSetDeviceFlags.
#
# A thread that blocks in recv costs a wake-up when the reply comes: the scheduler's, and on a virtual machine
# the hypervisor's for an idle vCPU. On this project's 2-core machines that is 30 us or more of a 17 us round
# trip, and any mmap or munmap just before a call makes it likelier. So, as cudaDeviceScheduleAuto does while
# a process has no more contexts than the host has cores, the thread first keeps reading the socket without
# blocking, letting any process that waits for its core go first (sched_yield) between reads. Unlike CUDA's,
# our Auto spins for AUTO_WINDOW at most (the daemon shares the host's cores; a reply later than that is a call
# that waits for the device, and a core is worth more than its wake-up), and, like the daemon's own wait for
# its client's next call, spins only now and then once its spins have lately missed (mpsd_protocol.SpinOdds).
# Spin and Yield spin until the reply comes, as CUDA's do; BlockingSync blocks at once.
from __future__ import annotations

from typing import Any

import os
import socket
import time

from mpsd_protocol import ANCILLARY_SIZE, RECV_FLAGS, InvalidValueError, SpinOdds, brief

# cudaDeviceFlags: one scheduling choice, and bits that have no effect here. As the H200's runtime does
# (bench/fidelity/device_flags_h200.txt), cudaSetDeviceFlags takes any bits of the low byte with at most one
# scheduling choice, at any time, and cudaGetDeviceFlags reports MapHost always and, of the rest, only the
# scheduling choice, LmemResizeToMax and SyncMemops.
DEVICE_SCHEDULE_AUTO, DEVICE_SCHEDULE_SPIN, DEVICE_SCHEDULE_YIELD = 0x00, 0x01, 0x02
DEVICE_SCHEDULE_BLOCKING_SYNC = 0x04
DEVICE_SCHEDULE_MASK = 0x07
DEVICE_MAP_HOST, DEVICE_LMEM_RESIZE_TO_MAX, DEVICE_SYNC_MEMOPS = 0x08, 0x10, 0x80
FLAGS = 0xFF
REPORTED = DEVICE_SCHEDULE_MASK | DEVICE_LMEM_RESIZE_TO_MAX | DEVICE_SYNC_MEMOPS
AUTO_WINDOW = 200e-6  # seconds that cudaDeviceScheduleAuto spins for a reply, at most

READ_SIZE = 1 << 16
_NOW = RECV_FLAGS | socket.MSG_DONTWAIT
# What socket.recvmsg gives: the bytes, the ancillary data (level, type, data), the flags, the address.
_Received = tuple[bytes, list[tuple[int, int, bytes]], int, Any]


def check_flags(flags: object) -> int:
    """`flags` for cudaSetDeviceFlags, checked as CUDA checks them: what cudaGetDeviceFlags will report of them.

    Raises:
        InvalidValueError: not an int, a bit above the low byte, or more than one scheduling choice.
    """
    if type(flags) is not int or flags & ~FLAGS or flags & DEVICE_SCHEDULE_MASK not in (
            DEVICE_SCHEDULE_AUTO, DEVICE_SCHEDULE_SPIN, DEVICE_SCHEDULE_YIELD, DEVICE_SCHEDULE_BLOCKING_SYNC):
        raise InvalidValueError(f"device flags {brief(flags, 20)} are not one of cudaDeviceScheduleAuto, Spin, "
                                "Yield or BlockingSync with flags of the low byte")
    return flags & REPORTED


class ReplyWait:
    """Reads a blocking socket for a reply, spinning first as the scheduling flags say."""

    __slots__ = ("sock", "odds")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.odds = SpinOdds()

    def read(self, schedule: int) -> _Received:
        """The next bytes (and ancillary data) from the socket, waited for as `schedule` (a
        DEVICE_SCHEDULE_* choice) says; b"" at end of file."""
        if schedule != DEVICE_SCHEDULE_BLOCKING_SYNC and (schedule != DEVICE_SCHEDULE_AUTO or self.odds.worth()):
            got = self._spun(schedule)
            if got is not None:
                return got
        return self.sock.recvmsg(READ_SIZE, ANCILLARY_SIZE, RECV_FLAGS)

    def now(self) -> _Received:
        """What the socket has now.

        Raises:
            BlockingIOError: nothing.
        """
        return self.sock.recvmsg(READ_SIZE, ANCILLARY_SIZE, _NOW)

    def _spun(self, schedule: int) -> _Received | None:
        """What the socket gave while the thread kept reading it; None if Auto's window ended first."""
        recvmsg, clock = self.sock.recvmsg, time.perf_counter
        end = clock() + AUTO_WINDOW if schedule == DEVICE_SCHEDULE_AUTO else float("inf")
        pause = os.sched_yield if schedule != DEVICE_SCHEDULE_SPIN else None
        while True:
            try:
                got = recvmsg(READ_SIZE, ANCILLARY_SIZE, _NOW)
            except BlockingIOError:
                if clock() < end:
                    if pause is not None:
                        pause()
                    continue
                self.odds.miss()
                return None
            if schedule == DEVICE_SCHEDULE_AUTO:
                self.odds.hit()
            return got
