# Where the daemon listens: `mpsd.sock` (clients, a stream socket) and `control` (the MPS control language, a
# SEQPACKET socket, one command per packet, as nvidia-cuda-mps-control's) in the pipe directory. Under
# systemd socket activation the sockets come ready-made from fd 3 on (LISTEN_PID, LISTEN_FDS, LISTEN_FDNAMES
# "mpsd" and "control"); those belong to systemd, so they are neither bound nor removed here.
#
# A directory we bind in must be the daemon's own (mpsd.daemon.ownership): a directory another user made first, or can
# write, could hold their socket in place of ours. Under systemd it is the unit's RuntimeDirectory=, 0700 and
# root's, which passes. In our own directory only our uid can have left anything, so a stale socket is
# replaced, but anything else at a socket's path is left alone and named: it may be someone's data.
#
# A connection costs the daemon an fd before it has said who it is, so connections that have not said hello
# are counted per uid and bounded (Greetings), and each has the handshake timeout to say it; the timeout
# runs in a task beside the session, which looks at the socket before closing it, so that hello the daemon
# was too busy to read is never held against the client. A control connection costs an fd too, for as long as its
# peer keeps it open, and on a --multiuser daemon every user may open one: they are bounded per uid the same way
# (ControlConnections), so that no user can fill the daemon's fd table with idle ones.
from __future__ import annotations

import array
import fcntl
import logging
import os
import socket
import stat
import tempfile
import termios
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Hashable, Iterator, Mapping

import trio

from mpsd.daemon.ownership import UnsafePathError, describe, private_directory
from mpsd_protocol import PROTOCOL_FILE

SD_LISTEN_FDS_START = 3
MAX_UNGREETED = 64  # connections of one uid that may be waiting to say hello at once
MAX_CONTROL = 64  # control connections of one uid that may be open at once (a tool holds one while it runs)

PID_FILE = "nvidia-cuda-mps-control.pid"  # as MPS names it, in the pipe directory


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
            unlink(path)


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
    Where other users' clients are served (see `shared`), every user reaches them, as real MPS's pipe
    directory lets them: the directory is 0755 and the sockets 0666 (the daemon still checks each peer's uid
    over SO_PEERCRED); otherwise the directory is 0700, and reaching it is the operator's grant.

    Raises:
        ListenError: the pipe directory or a socket cannot be set up, or another daemon is listening there.
    """
    inherited = inherited_sockets(environ)
    if inherited:
        clients = inherited.pop("mpsd", None) or next(
            (s for s in inherited.values() if s.type == socket.SOCK_STREAM), None)
        if clients is None:
            raise ListenError("socket activation passed no stream socket for clients")
        control: socket.socket | trio.socket.SocketType | None = inherited.pop("control", None)
        directory = Path(clients.getsockname()).parent
        check_directory(directory)
        bound: list[Path] = []
        if control is None:
            control = bind_socket(directory / "control", socket.SOCK_SEQPACKET)
            bound.append(directory / "control")
            if shared(multiuser):  # as reachable as the clients' socket systemd made (mpsd.socket: 0666)
                os.chmod(directory / "control", 0o666)
        bound.append(_pid_file(directory))  # launch scripts wait for it, socket activation or not
        for unused in inherited.values():
            unused.close()
        return Listeners(trio.socket.from_stdlib_socket(clients), _trio(control), True, bound)
    multiuser = shared(multiuser)
    check_directory(pipe_dir, tighten=True, mode=0o755 if multiuser else 0o700)
    clients_path, control_path = pipe_dir / "mpsd.sock", pipe_dir / "control"
    clients_sock = bind_socket(clients_path, socket.SOCK_STREAM)
    control_sock = None
    try:
        control_sock = bind_socket(control_path, socket.SOCK_SEQPACKET)
        for path in (clients_path, control_path) if multiuser else ():
            os.chmod(path, 0o666)  # in our own directory: no link to follow
        pid_path = _pid_file(pipe_dir)
    except (ListenError, OSError) as exc:
        clients_sock.close()
        unlink(clients_path)
        if control_sock is not None:
            control_sock.close()
            unlink(control_path)
        if isinstance(exc, ListenError):
            raise
        raise ListenError(f"cannot set the mode of the sockets in {pipe_dir}: {exc.strerror}") from None
    return Listeners(clients_sock, control_sock, False, [clients_path, control_path, pid_path])


def shared(multiuser: bool) -> bool:
    """Whether other users' clients are to reach the daemon's sockets: on a --multiuser daemon, which serves
    them all at once, and on root's, which serves one user's clients at a time and queues the others', as real
    MPS's control daemon (run by root) does with its sockets 0666. A user's own daemon is that user's: its
    directory stays 0700, and reaching it is the operator's grant."""
    return multiuser or os.geteuid() == 0


def _pid_file(pipe_dir: Path) -> Path:
    """MPS's pid file, which launch scripts wait for: the daemon's pid, written whole (a temporary file renamed
    into place in our own directory, so that no reader sees half of it and nothing planted is followed)."""
    return _write_whole(pipe_dir / PID_FILE, f"{os.getpid()}\n")


def write_protocol_file(pipe_dir: Path, protocol: int) -> Path | None:
    """Say the daemon's control protocol in `pipe_dir` where it is not the legacy 2 (a stale file from an
    earlier daemon goes, so that a v2 daemon leaves the directory as MPS's); returns the file written."""
    path = pipe_dir / PROTOCOL_FILE
    if protocol == 2:
        unlink(path)
        return None
    return _write_whole(path, f"{protocol}\n")


def _write_whole(path: Path, text: str) -> Path:
    """`text` in `path`, world-readable, through a temporary file renamed into place in the same directory."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        unlink(Path(tmp))
        raise ListenError(f"cannot write {path}: {exc.strerror}") from None
    return path


def _trio(sock: socket.socket | trio.socket.SocketType) -> trio.socket.SocketType:
    return trio.socket.from_stdlib_socket(sock) if isinstance(sock, socket.socket) else sock


def check_directory(directory: Path, *, tighten: bool = False, mode: int = 0o700) -> None:
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


def bind_socket(path: Path, kind: int) -> trio.socket.SocketType:
    """A listening Unix socket of `kind` at `path` in a directory of ours (a stale socket there is replaced).

    Raises:
        ListenError: something other than a socket is at `path`, a daemon listens there, or it cannot be bound.
    """
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
            unlink(path)  # a stale socket from a daemon that died
        else:
            raise ListenError(f"another mpsd is already listening on {path}")
        finally:
            probe.close()
    # Bound synchronously (a Unix path needs no resolving), so that a namespace made by a control command
    # gets its sockets before the command is answered.
    sock = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(path))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {path}: {exc.strerror}") from None
    return trio.socket.from_stdlib_socket(sock)


def unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class Greetings:
    """Connections that have not said hello yet, by uid: at most `limit` of a uid at once, and none for
    longer than `timeout` wall seconds. A connection that comes while its uid has `limit` waiting closes the
    oldest of them: a worker that leaks connections which never say hello (reopened as they close) then costs
    its own uid only its oldest silent ones, never a new client's handshake, which takes milliseconds.

    Args:
        timeout: seconds from the connection to hello.
        limit: connections of one uid that may wait to say hello.
    """

    def __init__(self, timeout: float, limit: int = MAX_UNGREETED) -> None:
        self.timeout, self.limit = timeout, limit
        # uid -> connection -> (its timer, its handshake's scope), oldest first
        self._waiting: dict[int, dict[Hashable, tuple[trio.CancelScope, trio.CancelScope]]] = {}
        self._evicting: dict[int, int] = {}  # uid -> connections closed for newer ones since it was under its limit
        self._evicted: set[Hashable] = set()  # connections closed for a newer one, until their handshake ends

    def waiting(self, uid: int) -> int:
        """How many connections of `uid` have not said hello yet."""
        return len(self._waiting.get(uid, ()))

    def admit(self, uid: int) -> int:
        """Make room for a new connection of `uid`: 0 where there was room, else how many of its oldest have been
        closed for newer ones in a row (1 for the first, the one worth a log line)."""
        waiting = self._waiting.get(uid)
        if waiting is None or len(waiting) < self.limit:
            return 0
        oldest = next(iter(waiting))
        self._evicted.add(oldest)
        waiting[oldest][1].cancel()
        self.greeted(uid, oldest)
        self._evicting[uid] = self._evicting.get(uid, 0) + 1
        return self._evicting[uid]

    def evicted(self, key: Hashable) -> bool:
        """Whether connection `key` was closed to make room for a newer one (asked once, when it has ended)."""
        if key in self._evicted:
            self._evicted.discard(key)
            return True
        return False

    @asynccontextmanager
    async def open_handshake(self, uid: int, key: Hashable, sock: socket.socket) -> AsyncIterator[trio.CancelScope]:
        """Count the connection `key` of `uid` until `greeted` (or the block ends); the block is cancelled
        if the timeout passes first with nothing unread on `sock`, or a newer connection of `uid` needs its
        place. Yields that scope, whose ``cancelled_caught`` then says one of them closed it (`evicted` says
        which)."""
        timer = trio.CancelScope()
        try:
            with trio.CancelScope() as scope:
                self._waiting.setdefault(uid, {})[key] = (timer, scope)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._expire, timer, scope, sock)
                    yield scope
                    nursery.cancel_scope.cancel()
        finally:
            self.greeted(uid, key)

    def greeted(self, uid: int, key: Hashable) -> None:
        """The connection said hello (or is gone): it counts no more, and its time is not limited."""
        waiting = self._waiting.get(uid, {})
        found = waiting.pop(key, None)
        if found is not None:
            found[0].cancel()
        if len(waiting) < self.limit - 1:
            self._evicting.pop(uid, None)
        if not waiting:
            self._waiting.pop(uid, None)

    async def _expire(self, timer: trio.CancelScope, scope: trio.CancelScope, sock: socket.socket) -> None:
        with timer:
            await trio.sleep(self.timeout)
            while _unread(sock):  # the daemon, not the client, was slow: hello may be in there
                await trio.sleep(0.05)
            scope.cancel()


class ControlConnections:
    """Control connections open now, by uid: at most `limit` of a uid. One that comes while its uid has `limit`
    open closes the oldest of them (as Greetings does, so that a process leaking connections costs its own uid only
    its oldest, never the command of a tool run now).

    Args:
        limit: control connections of one uid that may be open at once.
    """

    def __init__(self, limit: int = MAX_CONTROL) -> None:
        self.limit = limit
        self._open: dict[int, dict[trio.CancelScope, None]] = {}  # uid -> its connections' scopes, oldest first
        self._evicting: dict[int, int] = {}  # uid -> its oldest closed for newer ones since it was under its limit

    @contextmanager
    def holding(self, uid: int, scope: trio.CancelScope) -> Iterator[int]:
        """Count the connection served inside `scope` for `uid` while the block runs; `scope` is cancelled if a
        newer connection of `uid` needs its place. Yields 0 where there was room, else how many of the uid's
        oldest have been closed for newer ones in a row (1 for the first, the one worth a log line)."""
        opened = self._open.setdefault(uid, {})
        evicted = 0
        if len(opened) >= self.limit:
            oldest = next(iter(opened))
            del opened[oldest]
            oldest.cancel()
            evicted = self._evicting[uid] = self._evicting.get(uid, 0) + 1
        opened[scope] = None
        try:
            yield evicted
        finally:
            opened.pop(scope, None)
            if len(opened) < self.limit - 1:
                self._evicting.pop(uid, None)
            if not opened:
                self._open.pop(uid, None)


def _unread(sock: socket.socket) -> int:
    """Bytes waiting in `sock`'s receive queue."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    except OSError:
        return 0
    return count[0]


def notify(state: str) -> None:
    """Tell systemd (Type=notify) about our state, if it is listening; a no-op otherwise."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError as exc:
            logging.getLogger("mpsd").warning("cannot notify systemd at %s: %s", address, exc)
