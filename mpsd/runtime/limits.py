# What one client may make the daemon hold. Every stream, event, allocation, reservation and host buffer a client
# creates is an object in the daemon's memory, every wait it leaves pending is a callback there, and segments and
# host buffers hold fds of the daemon's one fd table: without a bound, one client grows the daemon's RSS without
# refusal, or takes the fds that every other client's allocations and connections need (issue 29, item 4).
#
# So each kind has a per-client limit, counted where such an object is made and where it goes, never on a launch's
# path: a call past one gets cudaErrorMemoryAllocation, what a real runtime returns when it cannot create a stream or
# an event, back an allocation or pin a buffer, with a message naming the setting. The defaults are far above what
# programs make (PyTorch holds a few streams, events by the hundred, allocations by the thousand), so that only a
# runaway or hostile client meets them.
#
# Two of those are the daemon process's own resources, shared by every client and by the daemon itself: fds (its
# soft RLIMIT_NOFILE) and memory mappings (vm.max_map_count: each segment, host buffer and reserved range is one, each
# piece mapped into a range two, and past the count every mmap of the process fails, Python's own heap's included).
# Each is counted for the whole daemon too (ProcessBudget): what all clients' objects hold, against the process's
# limit less a reserve, and no client may hold more than half of what that leaves. The reserve is for what the
# daemon itself needs to go on serving (its listening sockets and logs, a socket per connection, fds in flight over
# SCM_RIGHTS; its libraries and heap), and the half for the other clients' allocations: a client that has taken all
# it may still leaves another room to allocate and a new one room to connect.
"""Per-client limits on the objects a client makes the daemon hold, and the daemon's fd reserve."""

from __future__ import annotations

import resource
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

from mpsd_protocol import OutOfMemoryError

__all__ = ["ClientLimits", "FDS", "LIMIT_SETTINGS", "MAPS", "ProcessBudget", "Resource", "fd_limit", "map_limit",
           "refused"]


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """The most of each kind of object one client may hold at once, and the fds the daemon keeps for itself."""

    streams: int = 65_536  # created streams (the default stream is not counted)
    events: int = 262_144  # events, its own and those opened from IPC handles
    waits: int = 4_096  # calls waiting for the device at once (a synchronize, a free, a blocking copy)
    allocations: int = 1_048_576  # malloc's, pool reservations, mem_create's handles and IPC imports
    reservations: int = 65_536  # mem_address_reserve's ranges
    host_buffers: int = 65_536  # host_alloc's and host_register's buffers
    graphs: int = 16_384  # graphs and executable graphs (an inference server captures dozens to hundreds)
    graph_nodes: int = 1_048_576  # the nodes of all of them (a decode step's graph has some thousands)
    # Two fds per 2 MiB segment on the simulated device (its memfd and its mapping's), one per host buffer: enough
    # to fill an H200's 150 GB with 2 MiB allocations (143,156 fds) beside thousands of host buffers.
    fds: int = 150_000
    fd_reserve: int = 1_024  # fds of the daemon's limit no client may take (at most a quarter of the limit)
    # One mapping per segment and per host buffer, one per reserved range and two per piece mapped into one: as many
    # as the fds, though vm.max_map_count (65,530 by default) makes half of what it leaves the bound that counts.
    maps: int = 150_000
    map_reserve: int = 8_192  # mappings of vm.max_map_count no client may take (at most a quarter of it)


# Each limit's setting: (field, option, what it counts in a refusal's words, what the option's help says). The
# daemon's options and [mpsd] keys are these (mpsd.daemon.config), so the option a refusal names is the one that
# raises it.
LIMIT_SETTINGS: tuple[tuple[str, str, str, str], ...] = (
    ("streams", "--max-streams", "streams", "streams one client may create"),
    ("events", "--max-events", "events", "events one client may hold, its own and those it opened by IPC"),
    ("waits", "--max-pending-waits", "calls waiting for the device",
     "calls of one client that may wait for the device at once (synchronize, free, a blocking copy)"),
    ("allocations", "--max-allocations", "allocations",
     "allocations one client may hold: malloc's, pool reservations, mem_create's and IPC imports"),
    ("reservations", "--max-reservations", "reserved address ranges",
     "address ranges one client may hold reserved (mem_address_reserve)"),
    ("host_buffers", "--max-host-buffers", "pinned host buffers",
     "pinned host buffers one client may hold (host_alloc, host_register)"),
    ("graphs", "--max-graphs", "graphs and executable graphs",
     "CUDA graphs one client may hold: its graphs (made, cloned or captured) and executable graphs"),
    ("graph_nodes", "--max-graph-nodes", "graph nodes",
     "nodes of one client's graphs and executable graphs together (a child graph's count with its node)"),
    ("fds", "--max-fds", "file descriptors of the daemon",
     "file descriptors the daemon may hold for one client: two per 2 MiB segment of simulated memory, one per "
     "pinned host buffer; never more than half of what the fd limit leaves clients"),
    ("fd_reserve", "--fd-reserve", "",
     "file descriptors of the daemon's limit (RLIMIT_NOFILE) that no client may take, so that others still "
     "allocate and connect (at most a quarter of the limit)"),
    ("maps", "--max-maps", "memory mappings of the daemon",
     "memory mappings the daemon may hold for one client: one per segment of simulated memory, host buffer and "
     "reserved range, two per piece mapped into a range; never more than half of what vm.max_map_count leaves "
     "clients"),
    ("map_reserve", "--map-reserve", "",
     "memory mappings of the daemon's vm.max_map_count that no client may take (at most a quarter of it)"),
)
_OPTIONS = {name: (option, what) for name, option, what, _ in LIMIT_SETTINGS}
assert {f.name for f in fields(ClientLimits)} == set(_OPTIONS)


def refused(kind: str, limit: int, held: int | None = None) -> OutOfMemoryError:
    """The error for a call that would take its client past `limit` objects of `kind` (a ClientLimits field);
    `held`: what it holds, where that is not the limit itself (fds come several to an object)."""
    option, what = _OPTIONS[kind]
    return OutOfMemoryError(f"this client holds {limit if held is None else held} {what}, and one client may hold "
                            f"{limit} (mpsd {option})")


@dataclass(frozen=True, slots=True)
class Resource:
    """A resource of the daemon's process that clients' objects hold: its ClientLimits fields (`name` is also the
    attribute of a holder that counts its share), its words, and how its limit is set."""

    name: str
    reserve: str  # the ClientLimits field of its reserve
    what: str
    limit_is: str


FDS = Resource("fds", "fd_reserve", "file descriptors", "RLIMIT_NOFILE, LimitNOFILE= under systemd")
MAPS = Resource("maps", "map_reserve", "memory mappings", "vm.max_map_count, a sysctl")


def fd_limit() -> int:
    """The process's soft RLIMIT_NOFILE, as it is now."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if limit == resource.RLIM_INFINITY else limit  # Linux's fd table stops at fs.nr_open before


def map_limit() -> int:
    """vm.max_map_count (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65_530


class ProcessBudget:
    """What the daemon holds of one resource of its process for its clients' objects, each client's and in all.

    Of the process's limit, the reserve is the daemon's; of the rest, one client may hold at most half (and at most
    its own limit), so that a client that has taken all it may leaves the others room to allocate.

    Args:
        kind: which resource (FDS or MAPS).
        limits: the daemon's ClientLimits: the per-client limit and the reserve.
        limit: the process's limit, asked at each new object: fd_limit reads it (a system call, about 0.3 us beside a
            malloc's tens), so that one raised or lowered while the daemon runs (prlimit) is the one that counts;
            the daemon reads vm.max_map_count once (a sysctl, seldom changed) and passes it as a constant.
    """

    def __init__(self, kind: Resource, limits: ClientLimits, limit: Callable[[], int]) -> None:
        self.kind = kind
        self.per_client: int = getattr(limits, kind.name)
        self.reserve: int = getattr(limits, kind.reserve)
        self.limit = limit
        self.held = 0

    def kept(self, limit: int) -> int:
        """What of a process limit of `limit` no client may take."""
        return min(self.reserve, limit // 4)

    def take(self, holder: object, count: int) -> None:
        """Count `count` more for `holder`'s new object (`holder` counts its share in the attribute named for the
        resource).

        Raises:
            OutOfMemoryError: past the client's limit or its half, or into the daemon's reserve.
        """
        name = self.kind.name
        mine = getattr(holder, name)
        if mine + count > self.per_client:
            raise refused(name, self.per_client, mine)
        limit = self.limit()
        kept = self.kept(limit)
        if mine + count > (limit - kept) // 2:
            raise self._refused(f"this client holds {mine} {self.kind.what} of the daemon, half of what", limit)
        if self.held + count > limit - kept:
            raise self._refused(f"the daemon's clients hold {self.held} {self.kind.what}, all that", limit)
        setattr(holder, name, mine + count)
        self.held += count

    def _refused(self, whose: str, limit: int) -> OutOfMemoryError:
        return OutOfMemoryError(f"{whose} its limit of {limit} leaves clients beside the {self.kept(limit)} it keeps "
                                f"for itself (mpsd --{self.kind.reserve.replace('_', '-')}; the limit is "
                                f"{self.kind.limit_is})")

    def give(self, holder: object, count: int) -> None:
        """`holder`'s object that `take` counted as `count` has let go of them."""
        setattr(holder, self.kind.name, getattr(holder, self.kind.name) - count)
        self.held -= count
