# Who is at the other end of a connected Unix socket. The kernel records the peer's pid, uid and gid when the
# connection is made (SO_PEERCRED), so unlike anything said over the socket they cannot be forged: the daemon
# trusts them to know its clients, and a client trusts them to know its daemon before it hands it a single byte
# (its data, its memfds). A daemon is trusted when root runs it (the system service) or the client's own user
# does; anyone else's socket in the pipe directory is an impostor's, whatever its path says.
from __future__ import annotations

import os
import socket
import struct
from pathlib import Path
from typing import Any

from ._errors import make_error

_UCRED = struct.Struct("3i")


def peer_credentials(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of the connected Unix socket `sock` (a socket.socket
    or a trio socket)."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def check_server(sock: Any, path: str | os.PathLike[str]) -> None:
    """Make sure the daemon at the other end of `sock` (connected to `path`) runs as root or as our euid.

    Raises:
        MpsConnectionError: it runs as another user (the message names its uid and the path), or its
            credentials cannot be read.
    """
    try:
        uid = peer_credentials(sock)[1]
    except OSError as exc:
        raise make_error(805, f"cannot tell who serves {Path(path)}: {exc.strerror or exc}") from None
    mine = os.geteuid()
    if uid not in (0, mine):
        raise make_error(805, f"refusing the mpsd daemon at {Path(path)}: it runs as uid {uid}, and a client "
                              "trusts only a daemon run by root" + (f" or by its own uid {mine}" if mine else ""))
