# The work the runtime hands a backend, in CUDA's terms and nobody else's: a kernel launch (of a plan: its
# kernel, 3-D grid and block, shared memory and arguments, checked once); a copy from one place to another; a
# memset; an event record (or a stream's wait on one); an instantiated graph's launch, whose nodes are such work.
# Where bytes are involved they are already resolved to
# extents of memory (device memory the backend made, or a pinned host buffer), checked against the client's
# address space, so a backend never sees an address it has to look up. What the work costs and how its effect
# lands on the bytes is the backend's business: the simulator models the first and computes the second with
# numpy, a GPU just runs it.
#
# Work items are compared by identity: two launches with equal fields stay two launches. A backend keeps its
# own record of each in `handle`, and `done`, `ended` and `cancelled` read from it.
"""The backend-neutral vocabulary of device work."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from typing import Any, TypedDict

from mpsd.builtin_kernels import BUILTIN
from mpsd.modules import Kernel

__all__ = ["Copy", "Extent", "GraphLaunch", "Launch", "Memset", "OnStream", "Plan", "Record", "Work", "stage"]
_new = object.__new__


@dataclass(frozen=True, slots=True)
class Extent:
    """`nbytes` bytes at `offset` of `memory`: a backend's device memory, or a pinned host buffer (HostBuffer).
    None in a launch: the pointer lies in no live allocation, and running the kernel is an illegal address."""

    memory: Any
    offset: int
    nbytes: int


class OnStream(TypedDict):
    """The fields every piece of work queued on one stream shares (`Work`'s first four), as keywords."""

    client: int
    stream: tuple[int, int]
    priority: int
    sm_cap: int | None


@dataclass(eq=False, slots=True, kw_only=True)
class Work:
    """One unit of device work on one stream of one client.

    Attributes:
        client: the client's id.
        stream: (client, stream id): work with equal streams runs in submission order.
        priority: the stream's CUDA priority (lower is more urgent).
        sm_cap: most SMs the client may hold at once (its active thread percentage).
        after: other work that must complete first (the legacy default stream's rules, event waits).
        handle: the backend's record of it, once submitted.
    """

    client: int
    stream: tuple[int, int]
    priority: int = 0
    sm_cap: int | None = None
    after: tuple[Work, ...] = field(default=(), repr=False)
    handle: Any = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        """It completed, or was cancelled (its client's work was torn down)."""
        return self.handle is not None and self.handle.done

    @property
    def ended(self) -> float:
        """When it completed, in the backend's seconds (NaN until then)."""
        return self.handle.ended if self.handle is not None else math.nan

    @property
    def cancelled(self) -> bool:
        return self.handle is not None and self.handle.cancelled


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """A checked launch: a kernel (a built-in, or one of a module a client loaded: mpsd.modules) over `grid`
    blocks of `block` threads, with `shared_mem` bytes of dynamic shared memory and its arguments as the kernel
    takes them. It depends on nothing that changes (the kernel's declaration, the device's limits, the backend's
    fit), so the runtime resolves a launch call's arguments to a plan once and launches the plan again and again;
    a backend may keep what it works out from one by `key`.

    Attributes:
        kernel: the name launches give it (``module.kernel``; a built-in's bare name).
        touches: for each pointer argument the kernel touches, (argument index, the bytes it touches): where
            those bytes lie is looked up at each launch, as memory comes and goes.
        function: the kernel's declaration (mpsd.modules.Kernel): its resources, cost and reference; None, the
            built-in named `kernel`.
        key: (kernel, grid, block, args, function), the values a backend's own figures for the plan depend on
            (two modules' kernels of one name are two functions).
    """

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    args: tuple[int | float, ...]
    touches: tuple[tuple[int, int], ...] = ()
    function: Kernel = field(default=None, repr=False)  # type: ignore[assignment]  # (None: set below)
    key: tuple[object, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.function is None:
            object.__setattr__(self, "function", BUILTIN.kernels[self.kernel])
        object.__setattr__(self, "key", (self.kernel, self.grid, self.block, self.args, self.function))

    @property
    def smem(self) -> int:
        """Shared memory a block holds: the kernel's static and the launch's dynamic."""
        return self.function.shared + self.shared_mem

    @property
    def threads(self) -> int:
        """Threads per block."""
        bx, by, bz = self.block
        return bx * by * bz

    @property
    def blocks(self) -> int:
        gx, gy, gz = self.grid
        return gx * gy * gz


@dataclass(eq=False, slots=True, kw_only=True)
class Launch(Work):
    """`plan`, launched on a stream.

    Attributes:
        extents: for each pointer argument the plan touches, (argument index, the bytes it touches now, None
            where the pointer lies in no live allocation).
    """

    plan: Plan
    extents: tuple[tuple[int, Extent | None], ...] = ()

    @classmethod
    def of(cls, client: int, stream: tuple[int, int], priority: int, sm_cap: int | None, plan: Plan,
           extents: tuple[tuple[int, Extent | None], ...]) -> Launch:
        """``Launch(client=client, stream=stream, ...)`` with these fields in this order, `after` and `handle`
        their defaults: what the runtime calls for every launch, as a call with keywords costs several times
        as much in CPython 3.11 (tests/test_op_builders.py holds the two to the same fields)."""
        work = _new(cls)
        work.client, work.stream, work.priority, work.sm_cap, work.after, work.handle = (
            client, stream, priority, sm_cap, (), None)
        work.plan, work.extents = plan, extents
        return work


@dataclass(eq=False, slots=True, kw_only=True)
class Copy(Work):
    """``kind`` is "h2d", "d2h" or "d2d". A staged (pageable) host source is `data`, copied when the call was
    made; otherwise `src` is a pinned host buffer or device memory, read when the copy runs.

    A "d2d" copy between devices, as cudaMemcpyPeer's srcDevice and dstDevice say: `src_device` or `dst_device`
    is the other device's index where that end lies in another device's memory (None: the queuing client's own
    device), and `peer_access` whether the two are peers (NVLink; otherwise it is staged through host memory).
    """

    kind: str
    dst: Extent
    src: Extent | None = None
    data: mmap.mmap | bytes | None = field(default=None, repr=False)  # made by `stage`
    src_device: int | None = None
    dst_device: int | None = None
    peer_access: bool = True

    @property
    def nbytes(self) -> int:
        return self.dst.nbytes


@dataclass(eq=False, slots=True, kw_only=True)
class Memset(Work):
    """Set every byte of `dst` to `value` (0 to 255)."""

    dst: Extent
    value: int


@dataclass(eq=False, slots=True, kw_only=True)
class Record(Work):
    """Completes when it reaches its stream's head and its `after` work is done: an event record, or a
    stream's wait on another stream's event."""


@dataclass(eq=False, slots=True, kw_only=True)
class GraphLaunch(Work):
    """An instantiated graph launched on a stream, as one unit of work (cudaGraphLaunch): its nodes run in
    dependency order, the roots after `after` and the stream's earlier work, and it is done when all of them are.

    Attributes:
        nodes: each node's work, fresh for this launch (a Launch, Copy, Memset, or a Record for an empty node), in
            an order where every node comes after those it depends on. Its fields other than the node's own (its
            client, stream, priority and quotas) are the graph launch's; a backend may put it on a stream of its
            own (branches of a graph run side by side).
        deps: for each node, the indices in `nodes` of the nodes it depends on (all earlier).
        graph: the executable graph launched: the same object for every launch of it, so that a backend may keep
            what it works out from its shape (lanes, a graph of its own) by it.
    """

    nodes: tuple[Work, ...] = ()
    deps: tuple[tuple[int, ...], ...] = ()
    graph: Any = field(default=None, repr=False)


def stage(source: memoryview) -> mmap.mmap | bytes:
    """The daemon's own copy of a pageable source, held until its copy runs: in an anonymous mapping, so that
    its pages go back to the system the moment the copy lets go of it. As heap memory (bytes) they may not:
    once glibc's malloc has freed a mapping larger than a piece (8 MiB), it puts pieces that size on its heap
    and keeps what is freed there: a daemon whose three clients each left 256 MiB of staged copies behind kept
    269 MiB of it (tests/test_reclaim.py forces that heap to show it)."""
    if not len(source):
        return b""
    buffer = mmap.mmap(-1, len(source))
    buffer[:] = source
    return buffer
