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
# The fds are also counted for the whole daemon (FdBudget): what all clients' objects hold, against the process's
# soft RLIMIT_NOFILE less a reserve, and no client may hold more than half of what that leaves. The reserve is for
# what the daemon itself needs to go on serving (its listening sockets and logs, a socket per connection, fds in
# flight over SCM_RIGHTS), and the half for the other clients' allocations: a client that has taken every fd it
# may still leaves another room to allocate and a new one room to connect.
"""Per-client limits on the objects a client makes the daemon hold, and the daemon's fd reserve."""

from __future__ import annotations

import resource
from dataclasses import dataclass, fields
from typing import Protocol

from mpsd_protocol import OutOfMemoryError  # type: ignore[attr-defined]

__all__ = ["ClientLimits", "FdBudget", "LIMIT_SETTINGS", "refused"]


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """The most of each kind of object one client may hold at once, and the fds the daemon keeps for itself."""

    streams: int = 65_536  # created streams (the default stream is not counted)
    events: int = 262_144  # events, its own and those opened from IPC handles
    waits: int = 4_096  # calls waiting for the device at once (a synchronize, a free, a blocking copy)
    allocations: int = 1_048_576  # malloc's, pool reservations, mem_create's handles and IPC imports
    reservations: int = 65_536  # mem_address_reserve's ranges
    host_buffers: int = 65_536  # host_alloc's and host_register's buffers
    # Two fds per 2 MiB segment on the simulated device (its memfd and its mapping's), one per host buffer: enough
    # to fill an H200's 150 GB with 2 MiB allocations (143,156 fds) beside thousands of host buffers.
    fds: int = 150_000
    fd_reserve: int = 1_024  # fds of the daemon's limit no client may take (at most a quarter of the limit)


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
    ("fds", "--max-fds", "file descriptors of the daemon",
     "file descriptors the daemon may hold for one client: two per 2 MiB segment of simulated memory, one per "
     "pinned host buffer; never more than half of what the fd limit leaves clients"),
    ("fd_reserve", "--fd-reserve", "",
     "file descriptors of the daemon's limit (RLIMIT_NOFILE) that no client may take, so that others still "
     "allocate and connect (at most a quarter of the limit)"),
)
_OPTIONS = {name: (option, what) for name, option, what, _ in LIMIT_SETTINGS}
assert {f.name for f in fields(ClientLimits)} == set(_OPTIONS)


def refused(kind: str, limit: int, held: int | None = None) -> OutOfMemoryError:
    """The error for a call that would take its client past `limit` objects of `kind` (a ClientLimits field);
    `held`: what it holds, where that is not the limit itself (fds come several to an object)."""
    option, what = _OPTIONS[kind]
    return OutOfMemoryError(f"this client holds {limit if held is None else held} {what}, and one client may hold "
                            f"{limit} (mpsd {option})")


class _Holder(Protocol):
    fds: int  # the fds the daemon holds for this client's objects


class FdBudget:
    """The fds the daemon holds for its clients' objects, each client's and in all, against their limits.

    Of the process's limit, the reserve is the daemon's; of the rest, one client may hold at most half (and at most
    its own limit), so that a client that has taken all it may leaves the others room to allocate. The limit is
    read at each new object (a system call, about 0.3 us beside a malloc's tens), so that one raised or lowered
    while the daemon runs (prlimit) is the one that counts.

    Args:
        per_client: the most one client's objects may hold.
        reserve: fds of the process's limit left to the daemon itself (at most a quarter of it).
    """

    def __init__(self, per_client: int, reserve: int) -> None:
        self.per_client = per_client
        self.reserve = reserve
        self.held = 0

    def kept(self, limit: int) -> int:
        """The fds of a process limit of `limit` that no client may take."""
        return min(self.reserve, limit // 4)

    def take(self, holder: _Holder, count: int) -> None:
        """Count `count` more fds for `holder`'s new object.

        Raises:
            OutOfMemoryError: past the client's limit or its half, or into the daemon's reserve.
        """
        if holder.fds + count > self.per_client:
            raise refused("fds", self.per_client, holder.fds)
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limit == resource.RLIM_INFINITY:
            limit = 1 << 30  # Linux's fd table stops at fs.nr_open well before this
        kept = self.kept(limit)
        if holder.fds + count > (limit - kept) // 2:
            raise OutOfMemoryError(
                f"this client holds {holder.fds} file descriptors of the daemon, half of what its limit of {limit} "
                f"leaves clients beside the {kept} it keeps for itself (mpsd --fd-reserve; the limit is "
                "RLIMIT_NOFILE, LimitNOFILE= under systemd)")
        if self.held + count > limit - kept:
            raise OutOfMemoryError(
                f"the daemon's clients hold {self.held} file descriptors, all that its limit of {limit} leaves them "
                f"beside the {kept} it keeps for itself (mpsd --fd-reserve; the limit is RLIMIT_NOFILE, "
                "LimitNOFILE= under systemd)")
        holder.fds += count
        self.held += count

    def give(self, holder: _Holder, count: int) -> None:
        """`holder`'s object that `take` counted as `count` fds has closed them."""
        holder.fds -= count
        self.held -= count
