# Message shapes, after msgpack-rpc: request [0, id, op, args], reply [1, id, error, result],
# notification [2, op, args]. Messages are dataclasses checked when they are built, so a message that exists is a
# message that can be sent; `from_wire` is the one place that judges what a peer sent. They are values, never
# changed once built, but not frozen: a frozen dataclass costs twice the instructions to build, and every call
# builds two or three (bench/daemon_instructions.py). The compiled codec (protocol/src/python_wire.rs) fills
# these dataclasses slot by slot for the common shapes, making the checks their __post_init__ makes: a field or
# a check changed here is changed there too (tests/test_wire_codec.py holds the fields to it).
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._brief import brief

PROTOCOL_VERSION = 1
REQUEST, REPLY, NOTIFICATION = 0, 1, 2
MAX_ID = 2**32 - 1
MAX_FDS_PER_FRAME = 16  # SCM_MAX_FD is 253; no message of ours needs more than a few


class ProtocolError(Exception):
    """The conversation broke the protocol's rules; the connection cannot go on."""


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol forbids."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids."""


def _check_fds(fds: tuple[int, ...]) -> None:
    if fds and (len(fds) > MAX_FDS_PER_FRAME or not all(isinstance(fd, int) and fd >= 0 for fd in fds)):
        raise LocalProtocolError(f"bad file descriptors {brief(fds)}")


@dataclass(slots=True)
class Request:
    """A call that expects exactly one `Reply` with the same id."""

    id: int
    op: str
    args: dict[str, Any]
    fds: tuple[int, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.id, int) and 0 <= self.id <= MAX_ID):
            raise LocalProtocolError(f"request id {brief(self.id)} out of range")
        if not isinstance(self.op, str) or not isinstance(self.args, dict):
            raise LocalProtocolError("a request needs a str op and dict args")
        if self.fds:
            _check_fds(self.fds)

    def to_wire(self) -> list[Any]:
        return [REQUEST, self.id, self.op, self.args]


@dataclass(slots=True)
class Reply:
    """The answer to one `Request`: `error` is None or ``{code, name, message}``."""

    id: int
    error: dict[str, Any] | None
    result: Any
    fds: tuple[int, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.id, int) and 0 <= self.id <= MAX_ID):
            raise LocalProtocolError(f"reply id {brief(self.id)} out of range")
        if self.error is not None and not isinstance(self.error, dict):
            raise LocalProtocolError("a reply's error is None or a dict")
        if self.fds:
            _check_fds(self.fds)

    def to_wire(self) -> list[Any]:
        return [REPLY, self.id, self.error, self.result]


@dataclass(slots=True)
class Notification:
    """A one-way message: fire-and-forget work, whose errors surface at the next synchronising call."""

    op: str
    args: dict[str, Any]
    fds: tuple[int, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not isinstance(self.args, dict):
            raise LocalProtocolError("a notification needs a str op and dict args")
        if self.fds:
            _check_fds(self.fds)

    def to_wire(self) -> list[Any]:
        return [NOTIFICATION, self.op, self.args]


Message = Request | Reply | Notification


def from_wire(obj: Any, fds: tuple[int, ...]) -> Message:
    """Build a message from a decoded msgpack body, or raise `RemoteProtocolError` naming the problem."""
    if not isinstance(obj, list) or not obj:
        raise RemoteProtocolError("a message must be a non-empty array")
    kind = obj[0]
    try:
        if kind == REQUEST and len(obj) == 4:
            return Request(obj[1], obj[2], obj[3], fds)
        if kind == REPLY and len(obj) == 4:
            return Reply(obj[1], obj[2], obj[3], fds)
        if kind == NOTIFICATION and len(obj) == 3:
            return Notification(obj[1], obj[2], fds)
    except LocalProtocolError as exc:
        raise RemoteProtocolError(f"malformed message: {exc}") from None
    raise RemoteProtocolError(f"unknown message shape (type {brief(kind, 20)}, {len(obj)} fields)")
