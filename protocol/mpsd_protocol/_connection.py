# The sans-IO connection, in the manner of h11: bytes and file descriptors in, messages out; messages in,
# bytes and file descriptors out. The daemon, the blocking client and the trio client are thin loops around it.
#
# Frames: an 8-byte header (body length, number of fds, both u32 little-endian) then a msgpack body. The
# bytes and the codec are compiled (protocol/src/wire.rs, bound in python_wire.rs, as this package's _wire):
# _wire.Frames holds what was received, splits it into frames and decodes each body where it lies straight into
# the message it holds; _wire.Codec encodes a message into its whole frame. Both keep msgpack's rules as mpsd
# held msgpack-python to them (str or bytes map keys, no extension types, nothing after the body, lengths within
# the frame limit, nesting within _wire.MAX_DEPTH containers, as msgpack-python's stack allowed); the fd
# FIFO, the handshake and every error a message's shape earns stay here and in _messages.py.
# File descriptors arrive from SCM_RIGHTS attached to byte ranges, and reads coalesce frames, so received fds
# go into a FIFO and each frame takes as many from its head as its header says. A sender attaches a frame's fds
# to the frame's first byte, and the kernel hands them over with the read that holds that byte (a read ends
# with the write that carried fds), so the fds of one read belong to frames that begin in that read. Fds that
# no such frame declares can never be claimed: the connection fails as soon as that is certain (the frames of
# their read are complete), and no more than MAX_QUEUED_FDS wait at any time, so a peer cannot make this side
# hold fds without bound. Once this side has seen a protocol error, the connection is dead: every queued fd is
# closed and every later call raises.
#
# Rule: the handshake is the only state. A client's first message is the `hello` request; a server's first
# event is that request and its first message out is the reply to it (or, at any time, the protocol_error
# notice before it closes the connection). All of it lives in this file.
from __future__ import annotations

import struct
from collections import deque
from enum import Enum
from collections.abc import Collection
from typing import Final

from ._wire import Codec, Frames

from ._fds import close_fds as _close_all

from ._messages import (
    MAX_FDS_PER_FRAME,
    LocalProtocolError,
    Message,
    Notification,
    RemoteProtocolError,
    Reply,
    Request,
    from_wire,
)

HEADER = struct.Struct("<II")
_HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME = 1 << 20  # bulk data travels through shared memory, never in frames
HELLO = "hello"
PROTOCOL_ERROR = "protocol_error"  # the notice a server sends before closing a connection that broke the rules
IPC_FREED = "ipc_memory_freed"  # the notice that an IPC mapping's exporter has freed it: {"ptr": the mapping}
# Fds that may wait for their frames: one frame's, still arriving, and the next one's, which came with the
# read that completes it (a read never brings the fds of two writes).
MAX_QUEUED_FDS = 2 * MAX_FDS_PER_FRAME
# Wrong shapes go to from_wire whole, so that every malformed message is worded where it is today.
_CODEC = Codec(Request, Reply, Notification, from_wire, RemoteProtocolError, LocalProtocolError, MAX_FDS_PER_FRAME)
_encode = _CODEC.encode


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"


class _Sentinel(Enum):
    # Members of an enum, so that `event is NEED_DATA` narrows the type of what next_event returned.
    NEED_DATA = "NEED_DATA"
    CLOSED = "CLOSED"

    def __repr__(self) -> str:
        return self.value

    __str__ = __repr__


NEED_DATA: Final = _Sentinel.NEED_DATA  # feed more bytes with receive_data
CLOSED: Final = _Sentinel.CLOSED  # the peer closed its end cleanly, between frames


class Connection:
    """One end of an mpsd conversation, without I/O.

    Args:
        role: which end this is; decides the handshake rules.
        max_frame_size: the largest body accepted or sent, in bytes.
    """

    def __init__(self, role: Role, max_frame_size: int = DEFAULT_MAX_FRAME) -> None:
        self.role = role
        self.max_frame_size = max_frame_size
        self._frames = Frames(_CODEC)  # bytes received, split into frames and decoded where they lie
        self._fds: deque[int] = deque()
        # Per read that brought fds: [stream offset of its first byte, of its end, its fds not yet claimed].
        self._batches: deque[list[int]] = deque()
        self._eof = False
        self._error: RemoteProtocolError | None = None
        self._sent_first = False
        self._received_first = False

    # -- incoming ---------------------------------------------------------------------------------------
    def receive_data(self, data: bytes, fds: Collection[int] = ()) -> None:
        """Feed bytes read from the socket (b"" for end of file) and the fds that came with them.

        The connection owns the fds from here on: they end up in a message or are closed. Fds beyond what
        may wait for their frames (MAX_QUEUED_FDS) break the protocol; the next `next_event` says so.

        Raises:
            RemoteProtocolError: data after end of file or after a protocol error.
        """
        if fds:  # (most reads bring none)
            fds = list(fds)
            self._fds.extend(fds)
        if self._error is not None or self._eof:
            self.close_fds()
            if data:
                raise RemoteProtocolError("data after end of file or a protocol error")
            return
        if fds:
            start = self._frames.end
            self._batches.append([start, start + len(data), len(fds)])
            if not data or len(self._fds) > MAX_QUEUED_FDS:
                self._fail(RemoteProtocolError(
                    f"{len(self._fds)} file descriptors arrived that no complete frame has claimed; "
                    f"at most {MAX_QUEUED_FDS} may wait for their frames"))
                return
        if data:
            self._frames.feed(data)
        else:
            self._eof = True

    def next_event(self) -> Message | _Sentinel:
        """The next complete message, `NEED_DATA`, or `CLOSED`.

        Raises:
            RemoteProtocolError: the peer broke the protocol; queued fds have been closed.
        """
        if self._error is not None:
            raise self._error
        try:  # (one Python frame, not two: this runs for every message either end receives)
            # A message, None, or a frame (first, end, fds) whose fds must be claimed before it is decoded.
            message: Message | tuple[int, int, int] | None = self._frames.next(self.max_frame_size, self._batches)
            if message is None:
                return self._no_frame()
            if isinstance(message, tuple):  # (the messages are dataclasses, never tuples)
                message = self._take(*message)
            if not self._received_first:
                self._check_incoming(message)
            return message
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise

    def remember(self, token: object) -> bool:
        """Remember the frame of the message `next_event` returned last as `token`: frames that repeat it byte
        for byte (the same message) come back from `repeats` undecoded. False, remembering nothing, where that
        frame had fds or a large body; a connection remembers a few dozen frames at most."""
        return self._frames.remember(token)

    def repeats(self, most: int) -> tuple[object, int] | None:
        """The complete frames next in line that repeat one remembered frame, up to `most` of them, taken
        undecoded: (its token, how many). None, taking nothing, where the next message must come from
        `next_event` (not a repeat, incomplete, or fds waiting for their frames)."""
        if self._batches or self._error is not None:
            return None
        return self._frames.repeats(self.max_frame_size, most)

    def _no_frame(self) -> _Sentinel:
        """NEED_DATA or CLOSED, where no complete frame is buffered.

        Raises:
            RemoteProtocolError: the peer closed its end inside a frame.
        """
        if self._eof:
            available = self._frames.pending
            if available >= _HEADER_SIZE:
                raise RemoteProtocolError("connection closed in the middle of a frame")
            if available:
                raise RemoteProtocolError("connection closed in the middle of a frame header")
            return CLOSED
        return NEED_DATA

    def _take(self, first: int, end: int, nfds: int) -> Message:
        """The message of the frame at stream offsets [first, end), which declares `nfds` fds or came while
        fds wait: its fds are claimed here, in order, before its body is decoded."""
        fds = self._claim(first, end, nfds)
        try:
            message: Message = self._frames.take(fds, self.max_frame_size)
            return message
        except RemoteProtocolError:
            _close_all(fds)
            raise

    def _claim(self, first: int, end: int, nfds: int) -> tuple[int, ...]:
        """The fds of the frame whose bytes are [first, end): they came with the read that brought its first
        byte (the head batch, if it began by then). Afterwards no read whose bytes all lie before `end` may
        hold fds: no later frame can begin in it.

        Raises:
            RemoteProtocolError: the frame claims fds that did not come with it, or fds came that no frame
                declared; the fds are closed (the caller fails the connection).
        """
        batch = self._batches[0] if self._batches and self._batches[0][0] <= first else None
        have = batch[2] if batch is not None else 0
        if nfds > have:
            # Fds travel with the first byte of the write that carried them, so they are here by now.
            raise RemoteProtocolError(f"frame claims {nfds} file descriptors but {have} arrived with it")
        fds = tuple(self._fds.popleft() for _ in range(nfds))
        if batch is not None:
            batch[2] -= nfds
            if not batch[2]:
                self._batches.popleft()
        if self._batches and self._batches[0][1] <= end:
            _close_all(fds)
            raise RemoteProtocolError(f"{self._batches[0][2]} file descriptors arrived with bytes of frames that "
                                      "declared none of them")
        return fds

    def _check_incoming(self, message: Message) -> None:
        """The first message in: the handshake's rules."""
        self._received_first = True
        if self.role is Role.SERVER and not (isinstance(message, Request) and message.op == HELLO):
            _close_all(message.fds)
            raise RemoteProtocolError(f"expected the {HELLO!r} request first")
        if self.role is Role.CLIENT and not (isinstance(message, Reply) or (
                isinstance(message, Notification) and message.op == PROTOCOL_ERROR)):
            _close_all(message.fds)
            raise RemoteProtocolError("expected the reply to hello first")

    def _fail(self, exc: RemoteProtocolError) -> None:
        self._error = exc
        self._frames.clear()
        self.close_fds()
        self._batches.clear()

    def close_fds(self) -> None:
        """Close every received fd not yet handed out in a message."""
        _close_all(self._fds)
        self._fds.clear()

    # -- outgoing ---------------------------------------------------------------------------------------
    def send(self, message: Message) -> bytes:
        """The frame for `message`; its ``fds`` must go out attached to the first byte of these bytes.

        Raises:
            LocalProtocolError: the message breaks the handshake or the size limit, or cannot be encoded.
        """
        if not self._sent_first and not (self.role is Role.SERVER and isinstance(message, Notification)
                                         and message.op == PROTOCOL_ERROR):
            if self.role is Role.CLIENT and not (isinstance(message, Request) and message.op == HELLO):
                raise LocalProtocolError(f"a client must send the {HELLO!r} request first")
            if self.role is Role.SERVER and not isinstance(message, Reply):
                raise LocalProtocolError("a server must answer hello before anything else")
            self._sent_first = True
        return _encode(message, self.max_frame_size)
