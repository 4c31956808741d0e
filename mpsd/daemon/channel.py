# One connected Unix socket, driven from trio without trio's socket wrapper. A request's round trip should
# cost one pass of the scheduler: read what is there, handle it, write the reply, and only when the socket
# has nothing more (EAGAIN) park on wait_readable. Replies are written at once from synchronous code; only
# when the socket buffer is full does the rest wait for a flush task, so the order of bytes is kept.
#
# What waits here is what the peer has not read (the kernel's buffer is full), and each reply that carries
# an fd holds a dup of it, so a client that sends requests and reads no replies could make the daemon hold
# bytes and fds without end. Past MAX_UNSENT_BYTES or MAX_UNSENT_FDS the channel gives up on that peer: it
# drops what waits, closes the fds and shuts the socket down, so the reader sees the end of the connection.
from __future__ import annotations

import socket
from collections import deque

import trio

from mpsd_protocol import ANCILLARY_SIZE, RECV_FLAGS, close_fds, pack_fds, unpack_fds

READ_SIZE = 1 << 16
_FAIR_READS = 16  # after this many reads that did not have to wait, let other tasks run
MAX_UNSENT_BYTES = 8 << 20  # eight frames of the largest size, or about 100,000 small replies
MAX_UNSENT_FDS = 64  # replies with fds (mem_fd, ipc_open_mem_handle) the peer has not taken


class Channel:
    """A non-blocking socket with fd passing, read and written from trio tasks."""

    def __init__(self, sock: socket.socket) -> None:
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
                await trio.lowlevel.wait_readable(self.sock)
            try:
                data, ancdata, flags, _ = self.sock.recvmsg(READ_SIZE, ANCILLARY_SIZE, RECV_FLAGS)
            except BlockingIOError:
                self._drained = True
                continue
            self._drained = 0 < len(data) < READ_SIZE
            self._eager_reads += 1
            if self._eager_reads >= _FAIR_READS:
                self._eager_reads = 0
                await trio.lowlevel.checkpoint()
            return data, unpack_fds(ancdata, flags)

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
