# A client's sub-context: its address space, pinned host buffers, streams, events, quotas and sticky error,
# with CUDA's rules for each call. Calls are plain methods that either return at once or return the ops the
# caller must wait on; the session does the waiting, so nothing here awaits and the rules stay in one place.
#
# Stream semantics are the legacy default stream's: work on stream 0 waits for all earlier work in the
# context's blocking streams, and work on a blocking stream waits for earlier work on stream 0. Work carries
# those dependencies to the backend (mpsd.backends.base), which keeps each stream in order. Every byte range a
# call names is resolved against the client's address space here, before the work is queued; the backend applies
# the effects when the work completes, so they land in stream order.
#
# An argument's kind (an int, a byte count, a string, a stream handle or None) is checked once, by its row in
# mpsd_protocol's table of calls, before a method here is called; what is checked here is what only the context
# can judge: values (ranges, live pointers, handles of this context) and what arrives inside a list the table
# passes whole (mem_pool_ops' operations).
from __future__ import annotations

import bisect
import functools
import mmap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from mpsd_protocol import (
    DEFAULT_CONNECTIONS,
    EVENT_EXTERNAL,
    POOL_ALLOC,
    POOL_FREE,
    POOL_GRAPH_FREE,
    POOL_RELEASE,
    CudaError,
    InvalidResourceHandleError,
    InvalidValueError,
    LaunchOutOfResourcesError,
    NotReadyError,
    NotSupportedError,
    OutOfMemoryError,
    brief,
    check_args,
    check_shape,
    format_size,
)
from mpsd.backends.base import HOST_VIEW, DeviceMemory
from mpsd.backends.ops import Copy, Extent, Launch, Memset, OnStream, Plan, Record, Work, stage
from mpsd.runtime.capture import CaptureCalls
from mpsd.runtime.graph_memory import GraphMemoryCalls
from mpsd.runtime.graphs import CAPTURED, EVENT_RECORD, EVENT_WAIT, GraphCalls
from mpsd.runtime.limits import refused
from mpsd.runtime.memory import CHUNK, AddressSpace, Allocation, HostBuffer
from mpsd.runtime.modules import ModuleCalls, check_extents
from mpsd.runtime.teardown import Teardown
from mpsd.runtime.vmm import VMM_BASE, MappedPiece, VirtualMemory, VirtualMemoryCalls

if TYPE_CHECKING:
    from mpsd.runtime.device import Device
    from mpsd.runtime.ipc import Export, IpcRegistry

STREAM_PRIORITY_GREATEST, STREAM_PRIORITY_LEAST = -5, 0  # cudaDeviceGetStreamPriorityRange on Hopper
NON_BLOCKING = 0x1  # cudaStreamNonBlocking
MAX_STAGED_COPY = 64 << 20  # the client stages pageable copies in pieces of 8 MiB
_MAX_PLANS = 1024  # plans kept, by kernel, shape and arguments


def _event_flags(flags: int, call: str) -> bool:
    """Whether a record's or a wait's flags are cudaEvent{Record,Wait}External, the one flag either takes."""
    if flags & ~EVENT_EXTERNAL:
        raise InvalidValueError(f"{call}: bad flags {flags:#x}")
    return bool(flags)


def _deaf(op: str, args: dict[str, Any]) -> None:
    """Where a context's notices go while no session hears them (a context made in process, for tests)."""


@dataclass(frozen=True, slots=True)
class Quotas:
    """What a client may use: effective values after the daemon's settings and the client's requests."""

    active_thread_percentage: float
    sm_cap: int
    pinned_mem_limit: int  # bytes
    priority: int  # CUDA_MPS_CLIENT_PRIORITY: 0 normal, 1 below normal; other levels set by the daemon only
    weight: float = 1.0  # share of SM-time under the fair policy, set by the daemon only
    connections: int = DEFAULT_CONNECTIONS  # hardware work queues its streams share (CUDA_DEVICE_MAX_CONNECTIONS)


@dataclass(eq=False, slots=True)
class Stream:
    id: int
    priority: int
    blocking: bool
    key: tuple[int, int]
    tail: Work | None = None


@dataclass(eq=False, slots=True)
class EventCell:
    """An event's latest record. IPC event handles share one cell among the processes that opened it."""

    record: Record | None = None
    users: int = 1  # events (in any context) that use this cell
    export: Export | None = None


@dataclass(eq=False, slots=True)
class Event:
    id: int
    timing: bool
    interprocess: bool
    cell: EventCell = field(default_factory=EventCell)
    captured: Any = None  # (capture, the nodes it marks) where it was last recorded in a capture (mpsd.runtime.capture)

    @property
    def record(self) -> Record | None:
        return self.cell.record


@dataclass(eq=False, slots=True)
class Reservation:
    """Memory a stream-ordered pool of the client holds, and the allocations the client made in it."""

    base: int
    size: int
    live: dict[int, int] = field(default_factory=dict)  # address -> bytes
    starts: list[int] = field(default_factory=list)  # the live addresses, sorted: no two may overlap
    in_use: int = 0

    def overlaps(self, ptr: int, nbytes: int) -> bool:
        """Whether [ptr, +nbytes) overlaps a live allocation (a forged batch could claim one range twice and
        make "in use" greater than what is reserved)."""
        i = bisect.bisect_right(self.starts, ptr)
        if i and self.starts[i - 1] + self.live[self.starts[i - 1]] > ptr:
            return True
        return i < len(self.starts) and self.starts[i] < ptr + nbytes


@dataclass(slots=True)
class Counters:
    """What the client did, for its statistics."""

    launches: int = 0
    copies: int = 0
    bytes_copied: int = 0
    mallocs: int = 0
    frees: int = 0
    async_mallocs: int = 0  # malloc_async and free_async, as the client reported them
    async_frees: int = 0
    # Of copies: those between this device and another (memcpy_peer, or memcpy_dtod of memory opened from another
    # device's IPC handle), by route: over NVLink between peers, staged through host memory between others.
    peer_copies_nvlink: int = 0
    peer_copies_staged: int = 0
    bytes_copied_peer: int = 0


class Context(VirtualMemoryCalls, CaptureCalls, GraphMemoryCalls, GraphCalls, ModuleCalls):
    """One client's sub-context on one device."""

    def __init__(self, device: Device, client_id: int, pid: int, uid: int, gid: int, quotas: Quotas,
                 ipc: IpcRegistry, partition: int | None = None, requested_priority: int | None = None,
                 namespace: str = "default") -> None:
        self.device = device
        self.namespace = namespace  # the MPS v3 namespace of its server it was placed in
        self.sm_partition: Any = None  # the static SM partition (-S) it is pinned to, if any
        self.visible_count = 0  # the devices its process sees (cuDeviceGetCount), set when it attaches
        self.partition = partition  # the MIG instance it is bound to (None: no MIG)
        self.requested_priority = requested_priority  # CUDA_MPS_CLIENT_PRIORITY, which daemon levels only tighten
        self.ipc = ipc
        self.imports: dict[int, Export] = {}  # address of an IPC mapping -> its export
        self.tell: Callable[[str, dict[str, Any]], None] = _deaf  # a notice to the client (its session's)
        self.id = client_id
        self.pid, self.uid, self.gid = pid, uid, gid
        # The process it stands for, as CUDA's same-process rules see it: its pid, or, where the daemon's
        # clients share one process (Config.shared_process), its own.
        self.process = -client_id if device.shared_process else pid
        self.quotas = quotas
        self.backend = device.backend
        self.limits = device.limits  # the most of each kind of object it may hold (mpsd.runtime.limits)
        # The daemon's fds and memory mappings its objects hold (the device's ProcessBudgets count them).
        self.fds = self.maps = 0
        self.vmm = VirtualMemory()  # reserved ranges and physical memory (the driver's VMM calls: mpsd.runtime.vmm)
        self.memory = AddressSpace(self._allocate, self.vmm)
        self.account = device.ledger.open(quotas.pinned_mem_limit, partition)  # what its memory is charged
        self.host: dict[int, HostBuffer] = {}
        self.streams: dict[int, Stream] = {0: Stream(0, 0, True, (client_id, 0))}
        self.events: dict[int, Event] = {}
        self.reservations: dict[int, Reservation] = {}  # stream-ordered pools' memory, by base address
        self._last_reservation: Reservation | None = None
        self._orphans: list[Work] = []  # last work of destroyed streams: it still counts
        self.last_op: Work | None = None  # the work the latest call queued
        self._plans: dict[tuple[Any, ...], Plan] = {}  # launches checked before, by their values (plan)
        self._modules_init()  # the modules it loaded (mpsd.runtime.modules)
        self.sticky: CudaError | None = None
        self.last_error: CudaError | None = None  # from fire-and-forget calls, for get_last_error
        self.counters = Counters()
        self._next_handle = 1
        self._init_graphs()  # graphs and executable graphs (mpsd.runtime.graphs)
        self._init_graph_memory()  # their memory nodes' allocations (mpsd.runtime.graph_memory)
        self._init_capture()  # the captures under way (mpsd.runtime.capture)
        self.closed = False

    # -- errors ----------------------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise the sticky error, if the context has one: after it, every call fails the same way."""
        if self.sticky is not None:
            raise self.sticky

    def take_last_error(self, clear: bool = True) -> CudaError | None:
        """``cudaGetLastError`` (clear) / ``cudaPeekAtLastError``: a sticky error is never cleared."""
        error = self.last_error or self.sticky
        if clear:
            self.last_error = None
        return error

    def set_sticky(self, error: CudaError) -> None:
        if self.sticky is None:
            self.sticky = error

    def _handle(self) -> int:
        handle = self._next_handle
        self._next_handle += 1
        return handle

    # -- memory ----------------------------------------------------------------------------------------
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) as this client sees them. As measured under MPS on an H200, a pinned limit caps
        free (less the context's own charge) while total stays the device's; a MIG instance's client sees
        the instance's memory as the total, shared with the instance's other clients."""
        device_free, total = self.device.ledger.room(self.partition)
        return max(0, min(self.room_under_limit(), device_free)), total

    def room_under_limit(self) -> int:
        """What this client's pinned limit still allows: less the context's own charge, its allocations and
        what it maps through IPC (mpsd.runtime.ledger.Account.imported says why imports count)."""
        account = self.account
        return self.quotas.pinned_mem_limit - self.backend.context_memory - account.reserved - account.imported

    def malloc(self, nbytes: int) -> int:
        if nbytes == 0:
            return 0  # cudaMalloc(0) succeeds with a null pointer
        addr = self._map_new(nbytes, pool=False)
        self.counters.mallocs += 1
        return addr

    def _map_new(self, nbytes: int, pool: bool) -> int:
        """Back and map `nbytes` of new device memory, charged to this client (in use too, unless it is a pool's
        reservation, whose bytes are in use as the client hands them out); its address.

        Raises:
            OutOfMemoryError: past the device's free memory, this client's pinned limit or the address space.
        """
        self.check_allocations()
        free, _ = self.mem_get_info()
        try:
            addr, span, charge = self.memory.plan(nbytes)
        except MemoryError:
            raise OutOfMemoryError("device address space exhausted") from None
        if charge > free:
            limit = self.quotas.pinned_mem_limit
            raise OutOfMemoryError(
                f"tried to allocate {format_size(nbytes)}; {format_size(free)} free"
                + (f" under this client's limit of {format_size(limit)}"
                   if limit < self.device.memory_total(self.partition)
                   else " in its MIG instance" if self.partition is not None else " on the device"))
        try:
            self.memory.allocate(addr, nbytes, span, pool=pool)
        except OSError as exc:
            raise OutOfMemoryError(f"the daemon could not back {format_size(nbytes)}: {exc.strerror}") from None
        self.device.ledger.move(self.account, charge, 0 if pool else nbytes)
        return addr

    def check_allocations(self) -> None:
        """Raise if this client holds as many allocations as it may (malloc's, pool reservations, mem_create's
        handles and IPC imports: each an object of the daemon's, whatever its size)."""
        if len(self.memory) + len(self.vmm.physical) >= self.limits.allocations:
            raise refused("allocations", self.limits.allocations)

    def _allocate(self, nbytes: int) -> DeviceMemory:
        """The backend's `allocate`, its fds and mappings counted against this client's limits and the daemon's
        reserves until the memory goes (after the client, where an IPC importer keeps it).

        Raises:
            OutOfMemoryError: past one of them (a CudaError: its callers pass it on as it is).
            OSError: the backend cannot back it.
        """
        fds, maps = self.backend.memory_fds, self.backend.host_maps
        self.take_host(fds, maps)
        try:
            memory = self.backend.allocate(nbytes)
        except BaseException:
            self.give_host(fds, maps)
            raise
        memory.on_release.append(functools.partial(self.give_host, fds, maps))
        return memory

    def take_host(self, fds: int, maps: int) -> None:
        """Count `fds` fds and `maps` memory mappings of the daemon's for a new object of this client's.

        Raises:
            OutOfMemoryError: past this client's limits or into the daemon's reserves (mpsd.runtime.limits).
        """
        self.device.fds.take(self, fds)
        try:
            self.device.maps.take(self, maps)
        except BaseException:
            self.device.fds.give(self, fds)
            raise

    def give_host(self, fds: int, maps: int) -> None:
        """An object that `take_host` counted has closed its fds and mappings (or never made them)."""
        self.device.fds.give(self, fds)
        self.device.maps.give(self, maps)

    def check_free(self, addr: int) -> None:
        if addr == 0:
            return
        alloc = self.memory.get(addr)
        if alloc is None:
            raise InvalidValueError(f"{addr:#x} is not the base of a live allocation in this context")
        if alloc.imported:
            raise InvalidValueError(f"{addr:#x} was opened from an IPC handle: close it with ipc_close_mem_handle")
        if alloc.pool:
            raise InvalidValueError(f"{addr:#x} is a memory pool's reservation: its allocations go with free_async")
        if addr in self.graph_allocs:
            raise InvalidValueError(f"{addr:#x} is a graph's allocation: free it with free_async")

    def free(self, addr: int) -> None:
        """Free an allocation; the caller has already waited for the context's work (cudaFree synchronises)."""
        if addr == 0:
            return  # cudaFree(NULL) is a no-op
        self.check_free(addr)
        alloc, released = self.memory.remove(addr)
        self._drop(alloc, released)
        self.counters.frees += 1

    def _drop(self, alloc: Allocation, released: int, in_use: int | None = None) -> None:
        """An allocation of ours is gone from our address space; its bytes go when the last importer's do,
        and until then they stay charged to us, against our pinned limit, and to the device (counted once, as
        real shared memory is): freeing shared memory must not make room for more."""
        self.ipc.allocation_freed(alloc)
        ledger = self.device.ledger
        if in_use is None:
            in_use = self.reservations.pop(alloc.addr).in_use if alloc.pool else alloc.size
        if alloc.segment.refs > 1:
            ledger.move(self.account, 0, -in_use)
            alloc.segment.on_release.append(functools.partial(ledger.move, self.account, -released))
        else:
            ledger.move(self.account, -released, -in_use)
        alloc.segment.release()

    def host_register(self, fd: int, nbytes: int) -> int:
        """Map a client's pinned host buffer (its memfd); its id. The whole buffer counts against the daemon's
        host RAM budget while it is mapped here (mpsd.backends.hostmem says why).

        Raises:
            InvalidValueError: 0 bytes, or not a memfd the daemon can map safely.
            OutOfMemoryError: the buffer does not fit in the daemon's host RAM budget, or this client holds as many
                host buffers or fds as it may.
        """
        if nbytes == 0:
            raise InvalidValueError("a host buffer of 0 bytes cannot be registered")
        if len(self.host) >= self.limits.host_buffers:
            raise refused("host_buffers", self.limits.host_buffers)
        self.take_host(1, 1)  # its mapping here, and the duplicate of its fd that Python's mmap keeps
        try:
            pinned = self.device.host_memory.pin(nbytes)
        except BaseException:
            self.give_host(1, 1)
            raise
        buffer_id = self._handle()
        try:
            buffer = HostBuffer(buffer_id, fd, nbytes, pinned)
        except (CudaError, OSError, ValueError) as exc:
            self.device.host_memory.unpin(pinned)
            self.give_host(1, 1)
            if isinstance(exc, CudaError):
                raise
            raise InvalidValueError(f"cannot map the host buffer: {exc}") from None  # not a mappable file
        self.host[buffer_id] = buffer
        return buffer_id

    def host_unregister(self, buffer_id: int) -> None:
        buffer = self.host.pop(buffer_id, None)
        if buffer is None:
            raise InvalidValueError(f"no host buffer {brief(buffer_id, 20)}")
        self._unmap_host(buffer)

    def _unmap_host(self, buffer: HostBuffer) -> None:
        self.backend.release_host(buffer)
        buffer.close()
        self.device.host_memory.unpin(buffer.pinned)
        self.give_host(1, 1)

    def _device(self, ptr: int, nbytes: int, what: str) -> Extent:
        extent = self.memory.extent(ptr, nbytes)
        if extent is None:
            raise InvalidValueError(f"{what} [{brief(ptr, 20)}, +{brief(nbytes, 20)}) is not inside one live "
                                    "allocation")
        return extent

    def _host(self, buffer_id: int, offset: int, nbytes: int) -> Extent:
        buffer = self.host.get(buffer_id)
        if buffer is None or offset + nbytes > buffer.size:
            raise InvalidValueError(f"host range [{brief(offset, 20)}, +{brief(nbytes, 20)}) of buffer "
                                    f"{brief(buffer_id, 20)} is invalid")
        return Extent(buffer, offset, nbytes)

    # -- stream-ordered pools -----------------------------------------------------------------------------
    # A pool is the client's (mpsd_client._pools), as CUDA's is the driver's in the process: it picks addresses
    # from the memory reserved here, so that malloc_async costs no round trip, and reports what it handed out,
    # took back and gave back in one notification per batch (mem_pool_ops), which keeps the ledger's "in use"
    # and checks that nothing is handed out twice. Kernels are checked against a reservation's bounds, not an
    # allocation's: pool memory stays mapped, as on a GPU.
    def mem_pool_reserve(self, nbytes: int) -> int:
        """Reserve `nbytes` (a multiple of 2 MiB) for a pool: charged to this client, none of it in use."""
        if nbytes == 0 or nbytes % CHUNK:
            raise InvalidValueError(f"a pool reserves whole 2 MiB pages, not {nbytes} bytes")
        addr = self._map_new(nbytes, pool=True)
        self.reservations[addr] = Reservation(addr, nbytes)
        return addr

    def mem_pool_ops(self, ops: list[object]) -> None:
        """The client's pool operations since its last message, in order (mpsd_protocol.POOL_ALLOC and the
        rest). A bad one is skipped and its error raised once the others are applied."""
        error: CudaError | None = None
        in_use = 0
        for op in ops:
            try:
                fields: list[Any] = op if isinstance(op, list) else []  # (anything else is no operation)
                kind = fields[0] if fields else None
                if kind == POOL_ALLOC and len(fields) == 5:
                    in_use += self._pool_alloc(*fields[1:])
                elif kind == POOL_FREE and len(fields) == 3:
                    in_use -= self._pool_free(*fields[1:])
                elif kind == POOL_RELEASE and len(fields) == 2:
                    self._pool_release(fields[1])
                elif kind == POOL_GRAPH_FREE and len(fields) == 3:
                    self._graph_free(*fields[1:])
                else:
                    raise InvalidValueError(f"mem_pool_ops: {brief(op, 40)} is no pool operation")
            except CudaError as exc:
                error = error or exc
            except (TypeError, ValueError, OverflowError) as exc:  # a malformed operation of a client of its own
                error = error or InvalidValueError(f"mem_pool_ops: {brief(op, 40)}: {type(exc).__name__}")
        self.device.ledger.move(self.account, 0, in_use)
        if error is not None:
            raise error

    def _reservation(self, ptr: object, nbytes: object) -> Reservation:
        last = self._last_reservation  # a pool hands out most allocations from its latest reservation
        if (last is not None and type(ptr) is int and type(nbytes) is int and last.base <= ptr < last.base + last.size
                and 0 <= nbytes and ptr + nbytes <= last.base + last.size and self.reservations.get(last.base) is last):
            return last
        alloc = self.memory.find(ptr) if isinstance(ptr, int) and isinstance(nbytes, int) and nbytes >= 0 else None
        # (alloc is looked up only for int ptr and nbytes)
        if alloc is None or not alloc.pool or ptr + nbytes > alloc.end:  # type: ignore[operator]
            raise InvalidValueError(f"[{brief(ptr, 20)}, +{brief(nbytes, 20)}) is not inside one of this context's "
                                    "memory pools")
        self._last_reservation = self.reservations[alloc.addr]
        return self._last_reservation

    def _pool_alloc(self, ptr: int, nbytes: int, stream: int | None, after: object) -> int:
        """The pool handed out [ptr, +nbytes) on `stream`, after the work queued so far on the streams in `after`
        (memory freed there, reused without an event between); the bytes now in use."""
        s = self._pool_stream(stream)
        if not isinstance(after, list):
            raise InvalidValueError(f"malloc_async waits for a list of streams, not {brief(after, 20)}")
        waits = [self._pool_stream(a).tail for a in after]
        reservation = self._reservation(ptr, nbytes)
        if ptr in reservation.live or reservation.overlaps(ptr, nbytes):
            raise InvalidValueError(f"[{ptr:#x}, +{nbytes}) was handed out twice by its pool")
        reservation.live[ptr] = nbytes
        bisect.insort(reservation.starts, ptr)
        reservation.in_use += nbytes
        self.counters.async_mallocs += 1
        pending = tuple(w for w in waits if w is not None and not w.done)
        if pending:
            self._enqueue(s, Record(**self._on(s), after=pending))
        return nbytes

    def _pool_free(self, ptr: int, stream: int | None) -> int:
        reservation = self._reservation(ptr, 0)
        nbytes = reservation.live.pop(ptr, None)
        if nbytes is None:
            raise InvalidValueError(f"{ptr:#x} is no live allocation of a memory pool")
        del reservation.starts[bisect.bisect_left(reservation.starts, ptr)]
        reservation.in_use -= nbytes
        self.counters.async_frees += 1
        self._pool_stream(stream)  # after the bookkeeping: the pool that sent it counts the bytes free either way
        return nbytes

    def _pool_stream(self, stream: object) -> Stream:
        """A stream named inside a pool operation: no row of the table has checked its kind."""
        if stream is not None and type(stream) is not int:
            raise InvalidResourceHandleError(f"no stream {brief(stream, 20)} in this context")
        return self._stream(stream)

    def _pool_release(self, ptr: object) -> None:
        """The pool gives a reservation back. Its address range goes now; its memory once the work queued so far,
        which may still use it, has run."""
        alloc = self.memory.get(ptr) if isinstance(ptr, int) else None
        if alloc is None or not alloc.pool:
            raise InvalidValueError(f"{brief(ptr, 20)} is not a memory pool's reservation in this context")
        _, released = self.memory.remove(alloc.addr)
        in_use = self.reservations.pop(alloc.addr).in_use  # nothing, unless the client let go of live allocations
        self.backend.when_done(self.tails(), functools.partial(self._drop, alloc, released, in_use))

    # -- copies ----------------------------------------------------------------------------------------
    def memcpy_htod(self, dst: int, host: int, offset: int, nbytes: int, stream: int | None,
                    staged: bool) -> Work:
        """Copy host buffer bytes to the device. A staged (pageable) source is read now; a pinned one when
        the copy runs, as DMA from pinned memory does."""
        s = self._stream(stream)
        if staged and nbytes > MAX_STAGED_COPY:
            # A staged source is copied into the daemon's memory: bounded, so no client can exhaust it.
            raise InvalidValueError(f"a staged copy moves at most {format_size(MAX_STAGED_COPY)}; "
                                    "larger ones go in pieces")
        target = self._device(dst, nbytes, "destination")
        source = self._host(host, offset, nbytes)
        data = stage(source.memory.view(source.offset, nbytes)) if staged else None
        try:
            return self._copy(s, Copy(**self._on(s), kind="h2d", dst=target, src=None if staged else source,
                                      data=data))
        except BaseException:
            # Refused (the host budget, say): its staged bytes go now. The error's traceback holds the copy's
            # frames, and through them its mapping, until Python's cyclic collector runs: 80 refused 64-MiB
            # copies took the daemon's RSS to 2.35 GiB under a 512-MiB budget (issue 29, item 3).
            if isinstance(data, mmap.mmap):
                data.close()
            raise

    def memcpy_dtoh(self, host: int, offset: int, src: int, nbytes: int, stream: int | None) -> Work:
        s = self._stream(stream)
        source = self._device(src, nbytes, "source")
        return self._copy(s, Copy(**self._on(s), kind="d2h", dst=self._host(host, offset, nbytes), src=source))

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: int | None) -> Work:
        """Copy between device addresses of this context; an end in memory opened from another device's IPC
        handle (which maps only over peer access) makes it a copy over NVLink."""
        s = self._stream(stream)
        target, source = self._device(dst, nbytes, "destination"), self._device(src, nbytes, "source")
        return self._copy(s, Copy(**self._on(s), kind="d2d", dst=target, src=source, src_device=self._device_of(src),
                                  dst_device=self._device_of(dst)))

    def memcpy_peer(self, dst: int, source: Context, src: int, nbytes: int, stream: int | None,
                    peer_access: bool) -> Work:
        """cudaMemcpyPeerAsync into this context's `dst` from `src` of `source`, a context of the same process
        on another device, on this context's `stream`: over NVLink where the devices are peers
        (`peer_access`), else staged through host memory."""
        s = self._stream(stream)
        target = self._device(dst, nbytes, "destination")
        extent = source.memory.extent(src, nbytes)
        if extent is None:
            raise InvalidValueError(f"source [{brief(src, 20)}, +{brief(nbytes, 20)}) is not inside one live "
                                    f"allocation of device {source.device.index}")
        other = source.device.index
        return self._copy(s, Copy(**self._on(s), kind="d2d", dst=target, src=extent,
                                  src_device=None if other == self.device.index else other, peer_access=peer_access))

    def _device_of(self, ptr: int) -> int | None:
        """The other device whose memory `ptr` lies in (opened from its IPC handle), if it is another's."""
        alloc = self.memory.find(ptr)
        export = self.imports.get(alloc.addr) if alloc is not None else None
        return export.device if export is not None and export.device != self.device.index else None

    def memset(self, ptr: int, value: int, nbytes: int, stream: int | None) -> Work:
        s = self._stream(stream)
        target = self._device(ptr, nbytes, "memset range")
        # cudaMemset uses the low byte, as memset does
        return self._copy(s, Memset(**self._on(s), dst=target, value=value & 0xFF))

    def _copy(self, stream: Stream, work: Copy | Memset) -> Work:
        self._enqueue(stream, work)
        if work.handle is CAPTURED:  # a node of a graph now: not a copy made
            return work
        counters = self.counters
        counters.copies += 1
        counters.bytes_copied += work.dst.nbytes
        if isinstance(work, Copy) and (work.src_device is not None or work.dst_device is not None):
            if work.peer_access:
                counters.peer_copies_nvlink += 1
            else:
                counters.peer_copies_staged += 1
            counters.bytes_copied_peer += work.dst.nbytes
        return work

    def _on(self, stream: Stream) -> OnStream:
        """What every piece of work queued on `stream` carries: whose it is, where, and the quotas it runs under."""
        return {"client": self.id, "stream": stream.key, "priority": stream.priority, "sm_cap": self.quotas.sm_cap}

    # -- kernels ---------------------------------------------------------------------------------------
    def plan(self, name: str, grid: object, block: object, args: object, shared_mem: object) -> Plan:
        """A launch call's checks, in CUDA's order (its kernel, grid and block, arguments, and the fit of a
        block on one SM), as a plan: the grid, block and arguments as the backend takes them and what the
        pointer arguments touch (kernels.Kernel).

        A loop launches the same kernel with the same shape and arguments again and again, and what checking
        them gives depends on nothing else, so the plan is made once and kept by those values (`planned` finds
        it again for the next call). The key holds each value's type beside it, as 1, 1.0 and True are equal
        keys but not equally valid, and None between the lists, which no valid value is, so that different
        lists never flatten to one key. Anything but the lists our client sends, and any launch that fails, is
        checked afresh, so a bad launch gets the error it always got; and no launch with a float among its
        values is kept: -0.0 and 0.0 are equal keys, yet a fill with one writes other bits than with the other.
        """
        key = None
        if type(grid) is list and type(block) is list and type(args) is list:
            key = (name, shared_mem, *grid, None, *block, None, *args)
            key = (*key, *map(type, key))
            try:
                found = self._plans.get(key)
            except TypeError:  # an unhashable value among them: the checks say what is wrong with it
                key = None
            else:
                if found is not None:
                    return found
        kernel = self.function(name)
        grid3, block3 = check_shape(name, grid, block, shared_mem, self.device.properties)
        values = check_args(name, kernel.params, args)
        threads = block3[0] * block3[1] * block3[2]
        if threads > kernel.max_threads:
            raise LaunchOutOfResourcesError(f"a block of {threads} threads is more than {kernel.qualified}'s launch "
                                            f"bounds ({kernel.max_threads})")
        # (check_shape has made sure shared_mem is an int)
        if not self.backend.fits(threads, shared_mem + kernel.shared, kernel.registers):  # type: ignore[operator]
            raise LaunchOutOfResourcesError(f"a block of {threads} threads of {kernel.registers} registers and "
                                            f"{kernel.shared} + {shared_mem} bytes of shared memory does not fit "
                                            "on one SM")
        # (shared_mem: an int, as above)
        made = Plan(name, grid3, block3, shared_mem, tuple(values), check_extents(kernel, values),  # type: ignore[arg-type]
                    kernel)
        if key is not None and float not in key:
            if len(self._plans) >= _MAX_PLANS:  # pointer arguments make new keys
                self._plans.clear()
            self._plans[key] = made
        return made

    def planned(self, args: dict[str, Any]) -> Plan | None:
        """The plan `plan` made and kept for a launch call's argument map as it arrived (None: none kept).
        The row's checks need not be made first: only a launch that passed them (and `plan`'s) is kept, under
        a key holding each value's type, so a plan found is one of exactly those kinds and values."""
        grid, block, kargs = args.get("grid"), args.get("block"), args.get("args")
        if type(grid) is not list or type(block) is not list or type(kargs) is not list:
            return None
        key = (args.get("name"), args.get("shared_mem", 0), *grid, None, *block, None, *kargs)  # as `plan` makes it
        try:
            return self._plans.get((*key, *map(type, key)))
        except TypeError:
            return None

    def launch(self, plan: Plan, stream: int | None, count: int = 1) -> Launch:
        """Queue `count` launches of `plan` on `stream`, one after another (the launch queued stands for the
        last). A pointer argument outside live memory is found now, and is an illegal address when the kernel
        runs: sticky, contained as the device's fault-containment setting says. Only a plan that touches no
        memory is launched more than once in a call.

        Raises:
            InvalidResourceHandleError: no such stream in this context.
            CudaError: the backend refused the launches.
        """
        s = self._stream(stream)
        touches = plan.touches
        extents = tuple((index, self.memory.extent(int(plan.args[index]), nbytes))
                        for index, nbytes in touches) if touches else ()
        work = Launch.of(self.id, s.key, s.priority, self.quotas.sm_cap, plan, extents)
        if count == 1 and len(self.streams) == 1 and not self._orphans:
            self.backend.submit(work)  # _enqueue's share where there is nothing to wait for: most launches
            s.tail = self.last_op = work
        else:
            self._enqueue(s, work, count)
            if work.handle is CAPTURED:
                return work
        self.counters.launches += count
        return work

    # -- streams and events ----------------------------------------------------------------------------
    def _stream(self, stream: int | None) -> Stream:
        s = self.streams.get(0 if stream is None else stream)
        if s is None:
            raise InvalidResourceHandleError(f"no stream {brief(stream, 20)} in this context")
        return s

    def _enqueue(self, stream: Stream, work: Work, count: int = 1) -> Work:
        """Queue `work` on `stream` (`count` launches of its plan, where it is a Launch), after what the legacy
        default stream's rules make it wait for.

        Raises:
            OutOfMemoryError: the backend cannot hold what it would touch (nothing is queued).
            CudaError: a capture's rules refuse it (mpsd.runtime.capture).
        """
        if (self.capturing or self._into is not None) and self._captured(stream, work, count):
            return work  # taken as nodes of a graph: nothing queued
        deps: list[Work | None] = []  # the tails of the streams it waits for (None: a stream with no work yet)
        if stream.id == 0:
            # (A context with the default stream alone, most of them, has nothing for it to wait for.)
            if len(self.streams) > 1 or self._orphans:
                deps = [s.tail for s in self.streams.values() if s.blocking and s.id != 0]
                deps += self._orphans
        elif stream.blocking:
            deps = [self.streams[0].tail]
        if deps or type(work.after) is not tuple:
            work.after = tuple(d for d in deps if d is not None and not d.done) + tuple(work.after)
        self.backend.submit(work, count)
        stream.tail = work
        self.last_op = work
        return work

    def create_stream(self, priority: int, flags: int) -> tuple[int, int]:
        if flags & ~NON_BLOCKING:
            raise InvalidValueError(f"bad stream flags {flags:#x}")
        # Priorities outside the range are clamped, as the runtime does.
        priority = min(max(priority, STREAM_PRIORITY_GREATEST), STREAM_PRIORITY_LEAST)
        if len(self.streams) > self.limits.streams:  # (the default stream is not one it created)
            raise refused("streams", self.limits.streams)
        stream_id = self._handle()
        self.streams[stream_id] = Stream(stream_id, priority, not flags & NON_BLOCKING, (self.id, stream_id))
        return stream_id, priority

    def destroy_stream(self, stream: int) -> None:
        # Work already queued still runs, as with cudaStreamDestroy; the handle is gone at once.
        gone = self.streams.pop(stream, None) if stream else None  # None and 0: the default stream
        if gone is None:
            raise InvalidResourceHandleError(f"no stream {brief(stream, 20)} to destroy")
        if self.capturing:
            self._stream_gone(stream)
        self._orphans = [op for op in self._orphans if not op.done]
        if gone.tail is not None and not gone.tail.done:
            self._orphans.append(gone.tail)

    def stream_tail(self, stream: int | None) -> Work | None:
        return self._stream(stream).tail

    def stream_query(self, stream: int | None) -> bool:
        tail = self._stream(stream).tail
        return tail is None or tail.done

    def stream_wait_event(self, stream: int | None, event: int, flags: int = 0) -> None:
        s, e = self._stream(stream), self._event(event)
        external = _event_flags(flags, "stream_wait_event")
        if self.capturing and external and self._capture_event_node(s, e, EVENT_WAIT):
            return
        if (self.capturing or e.captured is not None) and self._capture_wait(s, e):
            return
        if e.record is not None and not e.record.done:
            self._enqueue(s, Record(**self._on(s), after=(e.record,)))

    def create_event(self, disable_timing: bool, interprocess: bool) -> int:
        if interprocess and not disable_timing:
            raise InvalidValueError("an interprocess event must also disable timing")
        self.check_events()
        event_id = self._handle()
        self.events[event_id] = Event(event_id, not disable_timing, bool(interprocess))
        return event_id

    def check_events(self) -> None:
        """Raise if this client holds as many events as it may (its own and those opened from IPC handles)."""
        if len(self.events) >= self.limits.events:
            raise refused("events", self.limits.events)

    def _event(self, event: int) -> Event:
        e = self.events.get(event)
        if e is None:
            raise InvalidResourceHandleError(f"no event {brief(event, 20)} in this context")
        return e

    def destroy_event(self, event: int) -> None:
        self.ipc.event_destroyed(self._event(event).cell)
        del self.events[event]

    def record_event(self, event: int, stream: int | None, flags: int = 0) -> None:
        e, s = self._event(event), self._stream(stream)
        external = _event_flags(flags, "event_record")
        if self.capturing and external and self._capture_event_node(s, e, EVENT_RECORD):
            return
        if self.capturing and self._capture_record(e, s):
            return
        record = Record(**self._on(s))
        self._enqueue(s, record)  # (it returns the work it was given)
        e.captured = None
        e.cell.record = record

    # -- IPC -------------------------------------------------------------------------------------------
    def ipc_get_event_handle(self, event: int) -> bytes:
        e = self._event(event)
        if not e.interprocess or e.timing:
            raise InvalidResourceHandleError("only events created with interprocess=True and disable_timing=True "
                                             "have IPC handles")
        return self.ipc.export_event(self, e.cell)

    def ipc_open_event_handle(self, handle: object) -> int:
        """A new event of this context sharing the exported event's records (it behaves as disable-timing)."""
        self.check_events()
        cell = self.ipc.open_event(self, handle)
        cell.users += 1
        event_id = self._handle()
        self.events[event_id] = Event(event_id, False, True, cell)
        return event_id

    def segment_of(self, ptr: int) -> Allocation | MappedPiece:
        """The allocation (own or imported) containing `ptr`, whose memfd the client may map; in a reserved
        range, the mapping that holds it.

        Raises:
            InvalidValueError: `ptr` is in no live allocation or mapping of this context.
            NotSupportedError: the device's memory is not host memory (a real GPU's).
        """
        alloc: Allocation | MappedPiece | None = (self.mapped_piece(ptr) if ptr >= VMM_BASE
                                                  else self.memory.find(ptr))
        if alloc is None:
            raise InvalidValueError(f"{ptr:#x} is not inside a live allocation of this context")
        if HOST_VIEW not in self.backend.capabilities:
            raise NotSupportedError(f"host_view needs the {HOST_VIEW} capability: {self.device.name}'s memory is "
                                    "device memory, which the host cannot map (pinned host buffers it can)")
        return alloc

    def event_record_op(self, event: int) -> Record | None:
        return self._event(event).record

    def event_query(self, event: int) -> bool:
        record = self._event(event).record
        return record is None or record.done  # a never-recorded event counts as complete

    def elapsed_ms(self, start: int, end: int) -> float:
        a, b = self._event(start), self._event(end)
        if not (a.timing and b.timing):
            raise InvalidResourceHandleError("elapsed time needs two events created with timing enabled")
        if a.record is None or b.record is None:
            raise InvalidResourceHandleError("elapsed time needs two recorded events")
        if not (a.record.done and b.record.done):
            raise NotReadyError("an event has not completed yet")
        return (b.record.ended - a.record.ended) * 1e3

    def tails(self) -> list[Work]:
        """The last op of every stream: what a context synchronize waits for."""
        tails = [s.tail for s in self.streams.values() if s.tail is not None] + self._orphans
        return [op for op in tails if not op.done]

    # -- teardown --------------------------------------------------------------------------------------
    def teardown(self) -> Teardown:
        """Release everything the client holds (it exited or was killed), a unit of work per step of the
        iteration (mpsd.runtime.teardown); what was reclaimed is in its `reclaimed` once it ends."""
        return Teardown(self)

    def close(self) -> dict[str, int]:
        """The whole teardown at once. Returns what was reclaimed."""
        teardown = Teardown(self)
        for _ in teardown:
            pass
        return teardown.reclaimed
