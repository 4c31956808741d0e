# One connected Unix socket, driven from trio without trio's socket wrapper. A request's round trip should
# cost one pass of the scheduler: read what is there, handle it, write the reply, and only when the socket
# has nothing more (EAGAIN) park on wait_readable. Replies are written at once from synchronous code; only
# when the socket buffer is full does the rest wait for a flush task, so the order of bytes is kept.
#
# Parking costs more than the call: trio re-arms epoll, runs its loop, sleeps in epoll_wait and reschedules
# the task (about 20 us of CPU and a wake-up from idle, where a blocking peer makes one recv), and a client's
# next call often comes a few tens of microseconds after its reply. So a channel whose socket has just emptied
# keeps reading it for a short while first (`Spin`), as the CUDA runtime spins on a result rather than yield
# while a process has no more active contexts than the host has cores (cudaDeviceScheduleAuto): only while the
# daemon has no more clients than cores; and a channel whose client has lately called within the window less
# than a quarter of the time spins only once in 32 waits (mpsd_protocol.SpinOdds, which a blocking client's
# wait for its reply shares), so an idle or slow client costs a window now and then, not each time. Between
# reads the channel lets every other task run (a checkpoint: trio polls every socket and runs what is due
# meanwhile, so no other client waits for the window to end) and every other process waiting for the core
# (sched_yield).
#
# What waits here is what the peer has not read (the kernel's buffer is full), and each reply that carries
# an fd holds a dup of it, so a client that sends requests and reads no replies could make the daemon hold
# bytes and fds without end. Past MAX_UNSENT_BYTES or MAX_UNSENT_FDS the channel gives up on that peer: it
# drops what waits, closes the fds and shuts the socket down, so the reader sees the end of the connection.
from __future__ import annotations

import os
import socket
import time
from collections import deque
from typing import Callable

import trio

from mpsd_protocol import ANCILLARY_SIZE, RECV_FLAGS, SpinOdds, close_fds, pack_fds, unpack_fds

READ_SIZE = 1 << 16
_FAIR_READS = 16  # after this many reads that did not have to wait, let other tasks run
MAX_UNSENT_BYTES = 8 << 20  # eight frames of the largest size, or about 100,000 small replies
MAX_UNSENT_FDS = 64  # replies with fds (mem_fd, ipc_open_mem_handle) the peer has not taken
DEFAULT_SPIN = 100e-6  # seconds a channel keeps reading an emptied socket (the daemon's --spin)
# On a real GPU the daemon's wake-up from epoll is on a request's path: a lone latency tenant's requests 2 ms apart
# took 0.37 ms at the median beside real MPS's 0.13 with a 1-ms spin, 0.22 with a 5-ms one
# (bench/fidelity/probe_wake.py, h200_dec03/probe_wake), so --spin goes to 10 ms. It stays 100 us by default: with
# 5 ms on a real GPU, DISB-C's best-effort tenants under priority lost a third of their throughput (six channels
# spinning in the daemon's one thread, it seems; h200_dec03/quick).
MAX_SPIN = 10e-3  # a bound on --spin: a client whose calls come further apart than this has its core back


class Spin:
    """When the channels of one daemon may keep reading an emptied socket before parking, and for how long.

    Args:
        window: seconds at most (0: never).
        clients: how many clients the daemon serves now.
        cores: how many cores the daemon may run on (default: its CPU affinity's as it starts; pinning it to
            fewer later does not change the rule).
    """

    def __init__(self, window: float, clients: Callable[[], int], cores: int | None = None) -> None:
        self.window = window
        self.clients = clients
        self.cores = cores if cores is not None else len(os.sched_getaffinity(0))

    def now(self) -> float:
        """Seconds a channel may spin from now: 0 where it must park at once (more clients than cores)."""
        if not self.window or self.clients() > self.cores:
            return 0.0
        return self.window


class Channel:
    """A non-blocking socket with fd passing, read and written from trio tasks."""

    def __init__(self, sock: socket.socket, spin: Spin | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.closed = False
        self.overflowed: str | None = None  # why the channel gave up on a peer that did not read
        self._out: deque[tuple[bytes, tuple[int, ...]]] = deque()
        self._unsent_bytes = 0
        self._unsent_fds = 0
        self._flushing = False
        self._eager_reads = 0
        self._drained = False  # the last read returned less than asked for: the socket is empty
        self._spin = spin
        self._odds = SpinOdds()  # how often a spin has lately ended with a call

    async def receive(self) -> tuple[bytes, list[int]]:
        """The next bytes and fds (b"" at end of file).

        Raises:
            RemoteProtocolError: fds were truncated (MSG_CTRUNC).
            OSError: the connection failed.
        """
        while True:
            if self._drained:
                # A short read emptied the socket: wait first rather than spend a syscall on EAGAIN.
                self._drained = False
                self._eager_reads = 0
                spin = self._spin
                got = await self._spun(window) if spin is not None and (window := self._spins(spin)) else None
                if got is None:
                    await trio.lowlevel.wait_readable(self.sock)
            else:
                got = None
            try:
                data, ancdata, flags, _ = got or self.sock.recvmsg(READ_SIZE, ANCILLARY_SIZE, RECV_FLAGS)
            except BlockingIOError:
                self._drained = True
                continue
            self._drained = 0 < len(data) < READ_SIZE
            self._eager_reads += 1
            if self._eager_reads >= _FAIR_READS:
                self._eager_reads = 0
                await trio.lowlevel.checkpoint()
            return data, unpack_fds(ancdata, flags)

    def _spins(self, spin: Spin) -> float:
        """Seconds this channel spins for the next call this time: its Spin's (`spin`), unless its client's calls
        have lately come too late (see the top of this file)."""
        return spin.now() if self._odds.worth() else 0.0

    async def _spun(self, window: float) -> tuple | None:
        """What the socket gave while this channel kept reading it for `window` seconds, letting every other task
        and process run between reads; None if it gave nothing in time."""
        sock, clock = self.sock, time.perf_counter
        end = clock() + window
        while True:
            await trio.lowlevel.checkpoint()
            try:
                got = sock.recvmsg(READ_SIZE, ANCILLARY_SIZE, RECV_FLAGS)
            except BlockingIOError:
                if clock() < end:
                    os.sched_yield()  # a process waiting for this core goes first
                    continue
                self._odds.miss()
                return None
            self._odds.hit()
            return got

    def send_nowait(self, data: bytes, fds: tuple[int, ...], nursery: trio.Nursery) -> None:
        """Write `data` (with `fds` on its first byte) now, or queue what does not fit for a flush task.

        The channel owns `fds` from here on and closes them once they are sent (or dropped). A peer that has
        gone away is noticed by the reader; writes to it are dropped here.
        """
        if self.closed:
            close_fds(fds)
            return
        if not self._out:
            try:
                sent = self.sock.sendmsg([data], pack_fds(fds)) if fds else self.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.closed = True
                close_fds(fds)
                return
            if sent:
                if fds:
                    close_fds(fds)  # the kernel has passed them on with the first byte
                if sent == len(data):
                    return
                data, fds = data[sent:], ()
        self._out.append((data, fds))
        self._unsent_bytes += len(data)
        self._unsent_fds += len(fds)
        if self._unsent_bytes > MAX_UNSENT_BYTES or self._unsent_fds > MAX_UNSENT_FDS:
            self._overflow()
            return
        if not self._flushing:
            self._flushing = True
            nursery.start_soon(self._flush)

    async def _flush(self) -> None:
        try:
            while self._out and not self.closed:
                await trio.lowlevel.wait_writable(self.sock)
                if self.closed:  # given up on meanwhile (_overflow): nothing is left to send
                    break
                data, fds = self._out[0]
                try:
                    sent = self.sock.sendmsg([data], pack_fds(fds))
                except BlockingIOError:
                    continue
                except OSError:
                    self.closed = True
                    break
                if sent:
                    close_fds(fds)
                    self._unsent_fds -= len(fds)
                    self._unsent_bytes -= sent
                if sent == len(data):
                    self._out.popleft()
                elif sent:
                    self._out[0] = (data[sent:], ())
        finally:
            self._flushing = False
            if self.closed:
                self._drop()

    def _overflow(self) -> None:
        """The peer has left too much unread: drop it all and end the connection (the reader sees EOF)."""
        self.overflowed = (f"{self._unsent_bytes} bytes and {self._unsent_fds} file descriptors of replies "
                           f"unread (at most {MAX_UNSENT_BYTES} and {MAX_UNSENT_FDS} may wait)")
        self.closed = True
        self._drop()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _drop(self) -> None:
        for _, fds in self._out:
            close_fds(fds)
        self._out.clear()
        self._unsent_bytes = self._unsent_fds = 0

    def close(self) -> None:
        self._drop()
        if self.sock.fileno() >= 0:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()
        self.closed = True
