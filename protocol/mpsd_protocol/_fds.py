# File descriptors ride on SCM_RIGHTS ancillary data. Packing and unpacking that data is pure, so it lives
# beside the protocol; the sockets themselves belong to the thin I/O loops. Truncated ancillary data
# (MSG_CTRUNC) means fds were lost in the kernel: the connection cannot pair fds with frames any more.
from __future__ import annotations

import array
import os
import socket
from typing import Any, Iterable

from ._messages import MAX_FDS_PER_FRAME, RemoteProtocolError

# Room for a few frames' worth of fds per read; reads coalesce frames, and each frame carries at most
# MAX_FDS_PER_FRAME.
ANCILLARY_SIZE = socket.CMSG_SPACE(4 * MAX_FDS_PER_FRAME * 4)
RECV_FLAGS = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))
_CTRUNC = int(socket.MSG_CTRUNC)  # a plain int: the enum's & costs microseconds on every read
_RIGHTS = (socket.SOL_SOCKET, socket.SCM_RIGHTS)


def pack_fds(fds: Iterable[int]) -> list[tuple[int, int, bytes]]:
    """Ancillary data carrying `fds`, for sendmsg (empty when there are none)."""
    fds = list(fds)
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []


def unpack_fds(ancdata: list[tuple[int, int, bytes]], msg_flags: int) -> list[int]:
    """The fds in data from recvmsg.

    Raises:
        RemoteProtocolError: the ancillary data was truncated (the fds that did arrive are closed).
    """
    if not ancdata and not msg_flags & _CTRUNC:
        return []
    fds: list[int] = []
    for level, kind, data in ancdata:
        if (level, kind) == _RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(array.array("i", data[:usable]))
    if msg_flags & _CTRUNC:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        raise RemoteProtocolError("file descriptors were truncated in transit (MSG_CTRUNC)")
    return fds


def close_fds(fds: Iterable[Any]) -> None:
    """Close each fd, ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
