# MPS v3's routing by socket path (NVIDIA's MPS documentation, releases 615 and 620): beside the main sockets,
# each named server has a directory in the pipe directory, $PIPE/<server>/, whose sockets lead to its default
# namespace, and each of its namespaces one below it, $PIPE/<server>/<namespace>/. A client (or a control
# invocation) given such a directory as its CUDA_MPS_PIPE_DIRECTORY lands in that server and namespace: each
# directory holds what the main one does, `mpsd.sock` for clients and `control` for the control language.
#
# The daemon makes these directories itself, in its own pipe directory, as the main ones are made
# (mpsd.daemon.listeners): each is created by us or must already be ours and not writable by others, never
# through a symlink, with the pipe directory's mode; only stale sockets are replaced. A namespace's directory
# comes with `namespace create` and goes with `namespace delete`; all go when the daemon stops.
#
# Release 620's pages show the default namespace's sockets twice: $PIPE/<server>/control (the server's listener,
# which routes to its default namespace) and $PIPE/<server>/default/control; mpsd makes both. Only named
# servers (the -a file's) have directories: NVIDIA names them by the server's name and says nothing of a
# server without one (one started for a user's first client, or by server create), so those have none.
#
# mpsd's guesses: that a routed directory has the same two sockets as the main one (MPS's
# client library finds its server over `control`; mpsd's clients use `mpsd.sock`); that a client of another
# user than the server's is refused there (cudaErrorMpsConnectionFailed) rather than queued.
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

import trio

from mpsd.daemon.listeners import bind_socket, check_directory, shared, unlink
from mpsd.daemon.namespaces import DEFAULT


@dataclass(frozen=True)
class Route:
    """Where a routed socket leads: a named server, the user it serves, and one of its namespaces."""

    server: str
    uid: int | None  # None: a --multiuser daemon's, which serves every user
    namespace: str = DEFAULT
    # The default namespace's own directory, $PIPE/<server>/default/, rather than the server's.
    named_default: bool = False

    def directory(self, pipe_dir: Path) -> Path:
        base = pipe_dir / self.server
        return base if self.namespace == DEFAULT and not self.named_default else base / self.namespace

    @property
    def is_server(self) -> bool:
        """Whether its directory is the server's own, which holds its namespaces' (they go first)."""
        return self.namespace == DEFAULT and not self.named_default


@dataclass
class RouteSockets:
    """The listening sockets of one route, and the scope their accept loops run in."""

    route: Route
    directory: Path
    clients: trio.socket.SocketType
    control: trio.socket.SocketType
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def close(self) -> None:
        """Stop accepting, remove the sockets, and the directory where nothing else is left in it."""
        self.scope.cancel()
        self.clients.close()
        self.control.close()
        for name in ("mpsd.sock", "control"):
            unlink(self.directory / name)
        try:
            self.directory.rmdir()
        except OSError:
            pass  # a namespace's directory is still in it, or something of the operator's: it stays


def open_route(pipe_dir: Path, route: Route, *, multiuser: bool = False) -> RouteSockets:
    """Make `route`'s directory in `pipe_dir` (or check the one there is ours) and listen in it.

    Raises:
        ListenError: the directory is not safely ours, or a socket cannot be bound.
    """
    directory = route.directory(pipe_dir)
    multiuser = shared(multiuser)  # as the daemon's own sockets
    mode = 0o755 if multiuser else 0o700
    check_directory(directory, tighten=True, mode=mode)
    clients = bind_socket(directory / "mpsd.sock", socket.SOCK_STREAM)
    try:
        control = bind_socket(directory / "control", socket.SOCK_SEQPACKET)
    except BaseException:
        clients.close()
        unlink(directory / "mpsd.sock")
        raise
    if multiuser:
        for name in ("mpsd.sock", "control"):
            (directory / name).chmod(0o666)  # our own directory, our own fresh socket: no link to follow
    return RouteSockets(route, directory, clients, control)
