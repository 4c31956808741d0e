# Where the daemon listens: `mpsd.sock` (clients, a stream socket) and `control` (the MPS control language, a
# SEQPACKET socket, one command per packet, as nvidia-cuda-mps-control's) in the pipe directory. Under
# systemd socket activation the sockets come ready-made from fd 3 on (LISTEN_PID, LISTEN_FDS, LISTEN_FDNAMES
# "mpsd" and "control"); those belong to systemd, so they are neither bound nor removed here.
#
# A directory we bind in must be the daemon's own (mpsd.ownership): a directory another user made first, or can
# write, could hold their socket in place of ours. Under systemd it is the unit's RuntimeDirectory=, 0700 and
# root's, which passes. In our own directory only our uid can have left anything, so a stale socket is
# replaced, but anything else at a socket's path is left alone and named: it may be someone's data.
from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import trio

from mpsd.ownership import UnsafePathError, describe, private_directory

SD_LISTEN_FDS_START = 3


class ListenError(Exception):
    """A socket cannot be set up; the message says which and why."""


@dataclass
class Listeners:
    clients: trio.socket.SocketType
    control: trio.socket.SocketType
    activated: bool
    bound: list[Path] = field(default_factory=list)  # socket files we made, removed on close

    def close(self) -> None:
        self.clients.close()
        self.control.close()
        for path in self.bound:
            _unlink(path)


def inherited_sockets(environ: Mapping[str, str] = os.environ) -> dict[str, socket.socket]:
    """Sockets passed by systemd socket activation, by name (unnamed ones are "unknown", "unknown2", ...)."""
    if environ.get("LISTEN_PID") != str(os.getpid()):
        return {}
    try:
        count = int(environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return {}
    names = environ.get("LISTEN_FDNAMES", "").split(":")
    found: dict[str, socket.socket] = {}
    for i in range(count):
        fd = SD_LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        name = names[i] if i < len(names) and names[i] else "unknown"
        while name in found:
            name += "2"
        found[name] = socket.socket(fileno=fd)
    return found


async def open_listeners(pipe_dir: Path, environ: Mapping[str, str] = os.environ,
                         multiuser: bool = False) -> Listeners:
    """The client and control sockets: inherited from systemd if it passed them, else bound in `pipe_dir`.
    With `multiuser` every user's clients must reach them, as real MPS's pipe directory lets them: the
    directory is 0755 and the sockets 0666 (the daemon still checks each peer's uid over SO_PEERCRED);
    otherwise the directory is 0700, and reaching it is the operator's grant.

    Raises:
        ListenError: the pipe directory or a socket cannot be set up, or another daemon is listening there.
    """
    inherited = inherited_sockets(environ)
    if inherited:
        clients = inherited.pop("mpsd", None) or next(
            (s for s in inherited.values() if s.type == socket.SOCK_STREAM), None)
        if clients is None:
            raise ListenError("socket activation passed no stream socket for clients")
        control = inherited.pop("control", None)
        bound: list[Path] = []
        if control is None:
            control_path = Path(clients.getsockname()).parent / "control"
            _check(control_path.parent)
            control = await _bind(control_path, socket.SOCK_SEQPACKET)
            bound.append(control_path)
        for unused in inherited.values():
            unused.close()
        return Listeners(trio.socket.from_stdlib_socket(clients), _trio(control), True, bound)
    _check(pipe_dir, tighten=True, mode=0o755 if multiuser else 0o700)
    clients_path, control_path = pipe_dir / "mpsd.sock", pipe_dir / "control"
    clients_sock = await _bind(clients_path, socket.SOCK_STREAM)
    try:
        control_sock = await _bind(control_path, socket.SOCK_SEQPACKET)
        for path in (clients_path, control_path) if multiuser else ():
            os.chmod(path, 0o666)  # in our own directory: no link to follow
    except (ListenError, OSError) as exc:
        clients_sock.close()
        _unlink(clients_path)
        if isinstance(exc, ListenError):
            raise
        raise ListenError(f"cannot set the mode of the sockets in {pipe_dir}: {exc.strerror}") from None
    return Listeners(clients_sock, control_sock, False, [clients_path, control_path])


def _trio(sock: socket.socket | trio.socket.SocketType) -> trio.socket.SocketType:
    return trio.socket.from_stdlib_socket(sock) if isinstance(sock, socket.socket) else sock


def _check(directory: Path, *, tighten: bool = False, mode: int = 0o700) -> None:
    """Create the pipe directory, or make sure the one that exists is the daemon's own (and, with `tighten`,
    give it `mode`).

    Raises:
        ListenError: it cannot be created, or it is not safely ours.
    """
    try:
        private_directory(directory, "pipe directory", tighten=tighten, mode=mode)
    except UnsafePathError as exc:
        raise ListenError(str(exc)) from None
    except OSError as exc:
        raise ListenError(f"cannot create the pipe directory {directory}: {exc.strerror}") from None


async def _bind(path: Path, kind: int) -> trio.socket.SocketType:
    try:
        mode: int | None = path.lstat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise ListenError(f"{path} exists and is {describe(mode)}, not a socket; mpsd removes only stale "
                              "sockets, so remove it or choose another --pipe-dir")
        probe = socket.socket(socket.AF_UNIX, kind)
        try:
            probe.connect(str(path))
        except OSError:
            _unlink(path)  # a stale socket from a daemon that died
        else:
            raise ListenError(f"another mpsd is already listening on {path}")
        finally:
            probe.close()
    sock = trio.socket.socket(socket.AF_UNIX, kind)
    try:
        await sock.bind(str(path))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {path}: {exc.strerror}") from None
    return sock


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
