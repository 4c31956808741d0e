# The control plane's state and its actions, without I/O (as h11 keeps a connection's state apart from its
# sockets): the servers, clients, namespaces and partitions the control languages read and change
# (ControlState), and what they ask of the daemon (the actions below), which the daemon applies in order
# (mpsd.daemon.control_plane). The interpreters (mpsd.daemon.control for v2, control_v3) see nothing else, so
# a command line runs in-process on a ControlState built by hand, as tests/test_control_corpus.py replays the
# H200's recording.
#
# Devices and clients are seen through the small views below: the daemon's own Device and Context objects
# fit them, as do the plain records a test builds. What only the host knows of a client process (its pid
# namespace, argv[0], cgroup, the owner of a pid not connected) comes through a ProcessTable for the same
# reason: the daemon's reads /proc, a test's is a dict.
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from mpsd.daemon.mps_config import NamedServer
    from mpsd.daemon.namespaces import Namespace
    from mpsd.daemon.sm_partitions import SmPartitions


class DeviceView(Protocol):
    """What the control plane reads of a device (the daemon's mpsd.runtime.device.Device is one)."""

    @property
    def index(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def properties(self) -> dict[str, Any]: ...
    @property
    def faulted(self) -> Collection[int]: ...


class ClientView(Protocol):
    """What the control plane reads of a client context (the daemon's mpsd.runtime.context.Context is one)."""

    @property
    def id(self) -> int: ...
    @property
    def pid(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def device(self) -> Any: ...  # its DeviceView
    @property
    def namespace(self) -> str: ...
    @property
    def sm_partition(self) -> Any: ...


class ProcessTable(Protocol):
    """What the host knows of a process by its pid."""

    def namespace(self, pid: int) -> str: ...
    def command(self, pid: int) -> str: ...
    def cgroup(self, pid: int) -> str | None: ...
    def owner(self, pid: int) -> int | None: ...


class NoProcesses:
    """A ProcessTable that knows no process (ps then shows "-")."""

    def namespace(self, pid: int) -> str:
        return "-"

    def command(self, pid: int) -> str:
        return "-"

    def cgroup(self, pid: int) -> str | None:
        return None

    def owner(self, pid: int) -> int | None:
        return None


@dataclass
class Settings:
    """What new clients get: the daemon's options, changed at run time by control commands."""

    active_thread_percentage: float
    pinned_mem_limits: dict[int, int] = field(default_factory=dict)  # device -> bytes; absent: none
    client_priority: int = 0
    # mpsd extensions, keyed by ("pid", n) or ("uid", n), and ("client", id) for one context (set by a program
    # that plays many clients in one process, as mpsd-stress --virtual-time does); the narrower key wins.
    priorities: dict[tuple[str, int], int] = field(default_factory=dict)
    weights: dict[tuple[str, int], float] = field(default_factory=dict)

    def priority_for(self, pid: int, uid: int, client: int | None = None) -> int:
        """The daemon-side priority level of client `client` of `pid` and `uid`."""
        return _narrowest(self.priorities, pid, uid, client, self.client_priority)

    def weight_for(self, pid: int, uid: int, client: int | None = None) -> float:
        """The fair-share weight of client `client` of `pid` and `uid`."""
        return _narrowest(self.weights, pid, uid, client, 1.0)


def _narrowest(settings: dict[tuple[str, int], Any], pid: int, uid: int, client: int | None, default: Any) -> Any:
    for key in (("client", client), ("pid", pid), ("uid", uid)):
        if key in settings:
            return settings[key]
    return default


@dataclass
class Server:
    """The logical MPS server: its own overrides of the defaults, for its clients created afterwards."""

    pid: int
    uid: int | None = None  # the user it serves (None: every user, --multiuser)
    name: str | None = None  # the named server (MPS v3's -a file) it is, if one is for its user
    active_thread_percentage: float | None = None
    pinned_mem_limits: dict[int, int] = field(default_factory=dict)
    started: bool = False
    shutting_down: bool = False
    clients_seen: int = 0  # client processes this server has had: ps's ID column
    ids: dict[int, int] = field(default_factory=dict)  # client pid -> its ID


@dataclass
class ControlState:
    """Everything the control languages read and change; the daemon keeps the clients and devices in it."""

    pid: int  # the control daemon's (and a server's, where it has no process of its own)
    devices: Sequence[Any]  # DeviceViews, by index
    settings: Settings
    owner_uid: int
    pipe_dir: Path
    multiuser: bool = False
    protocol: int = 2
    shutdown_retry: float = 0.2  # MPS tries a refused shutdown again after 200 ms, then 400, 800...
    tracing: bool = False  # whether the daemon was started with --trace
    compute_modes: tuple[str, ...] = ()  # what mpsd_compute_mode may set (mpsd.runtime.device's names)
    named: dict[int, NamedServer] = field(default_factory=dict)  # MPS v3's named servers, by user
    # MPS v3's namespaces, by the server they subdivide (its user: server_key), in the order they were made.
    namespaces: dict[int | None, dict[str, Namespace]] = field(default_factory=dict)
    partitions: SmPartitions | None = None  # -S's static SM partitions
    processes: ProcessTable = field(default_factory=NoProcesses)  # the daemon's reads /proc
    clients: dict[int, Any] = field(default_factory=dict)  # ClientViews by id, in the order they came
    waiting: list[tuple[int, int]] = field(default_factory=list)  # (pid, uid) of clients waiting their turn
    orphans: set[int] = field(default_factory=set)  # contexts of a server shut down with -f: no server's
    terminated: set[int] = field(default_factory=set)  # contexts terminate_client has terminated
    # A terminate_client of contexts terminated already is answered once they have gone, as MPS's is: context
    # id -> the ticket of the command waiting for it.
    awaiting: dict[int, int] = field(default_factory=dict)
    tickets: int = 0  # the last ticket given
    server: Server = field(init=False)
    quitting: bool = False
    retry_at: float | None = None  # when the shutdown in progress tries again (the daemon's clock)
    backoff: float = field(init=False)
    force_at: float | None = None  # quit -t: when the server is shut down whatever its clients

    def __post_init__(self) -> None:
        self.server = Server(self.pid)
        self.backoff = self.shutdown_retry

    def server_key(self, uid: int | None) -> int | None:
        """What a server's namespaces are kept by: the user it serves (None for --multiuser's one server)."""
        return None if self.multiuser else uid

    def contexts(self) -> list[Any]:
        """The server's client contexts, by device, then in the order they came."""
        return sorted((ctx for ctx in self.clients.values() if ctx.id not in self.orphans),
                      key=lambda ctx: (ctx.device.index, ctx.id))

    def processes_of_server(self) -> dict[int, list[Any]]:
        """The server's client processes (pid -> its contexts), in the order they came."""
        processes: dict[int, list[Any]] = {}
        for ctx in sorted(self.contexts(), key=lambda c: c.id):
            processes.setdefault(ctx.pid, []).append(ctx)
        return processes

    def next_retry(self) -> float | None:
        """When the shutdown in progress tries again, if one is."""
        if self.retry_at is None:
            return None
        return self.retry_at if self.force_at is None else min(self.retry_at, self.force_at)


# -- actions: what the daemon does for a command, in order ---------------------------------------------------

@dataclass(frozen=True)
class Log:
    """A line of control.log (`stream` "control") or server.log ("server")."""

    stream: str
    text: str
    pid: int | None = None  # the prefix's pid where not the writer's
    source: str | None = None  # server.log's source column where not "Server"
    verbatim: bool = False  # text that holds newlines on purpose (device_query's)


@dataclass(frozen=True)
class StartServer:
    """The server starts for `uid` (None: every user): its process, whose pid becomes state.server.pid."""

    uid: int | None


@dataclass(frozen=True)
class EndServer:
    """The server ends, and its process with it."""


@dataclass(frozen=True)
class ServerChanged:
    """The server started or exited: clients waiting their turn look again."""


@dataclass(frozen=True)
class Wake:
    """The time of the next shutdown retry (state.next_retry) changed."""


@dataclass(frozen=True)
class Stop:
    """The control daemon exits (quit)."""


@dataclass(frozen=True)
class Terminate:
    """terminate_client: every later call of the client fails with cudaErrorMpsClientTerminated."""

    client: Any
    why: str


@dataclass(frozen=True)
class CutOff:
    """The client's server was shut down by force: its later calls fail with cudaErrorMpsRpcFailure."""

    client: Any


@dataclass(frozen=True)
class Reconfigure:
    """The client's priority level or weight may have changed: the scheduler gets them now."""

    client: Any


@dataclass(frozen=True)
class SetComputeMode:
    device: int
    mode: str


@dataclass(frozen=True)
class AddRoute:
    """Listen on the sockets of namespace `name` of named server `server` (its namespaces' key `key`:
    mpsd.daemon.routes.Route). Binding them can fail: then the namespace is taken back out of the state, the
    command fails with the reason, and the actions after this one are dropped."""

    server: str
    key: int | None
    name: str


@dataclass(frozen=True)
class RemoveRoute:
    """Stop listening on a namespace's sockets (AddRoute's)."""

    server: str
    key: int | None
    name: str


@dataclass(frozen=True)
class Report:
    """The command's answer is what only the daemon can say: "status" (mpsd_status's JSON) or "traces" (the
    traces written, one line each)."""

    what: str


@dataclass(frozen=True)
class Defer:
    """The command's answer comes later, as Answer(`ticket`): its connection waits for it."""

    ticket: int


@dataclass(frozen=True)
class Answer:
    """The answer of the command Defer(`ticket`) left waiting."""

    ticket: int
    reply: str


@dataclass(frozen=True)
class Then:
    """More actions, made when this one is applied: the lines that name a server's pid once it has one."""

    actions: Callable[[], list[Any]]


Action = Log | StartServer | EndServer | ServerChanged | Wake | Stop | Terminate | CutOff | Reconfigure | \
    SetComputeMode | AddRoute | RemoveRoute | Report | Defer | Answer | Then


class Out:
    """The actions one step of the control plane has asked for so far."""

    def __init__(self) -> None:
        self.actions: list[Action] = []

    def control(self, text: str, pid: int | None = None, verbatim: bool = False) -> None:
        self.actions.append(Log("control", text, pid, verbatim=verbatim))

    def server(self, text: str, source: str | None = None, pid: int | None = None) -> None:
        self.actions.append(Log("server", text, pid, source))

    def do(self, action: Action) -> None:
        self.actions.append(action)

    def take(self) -> list[Action]:
        actions, self.actions = self.actions, []
        return actions
