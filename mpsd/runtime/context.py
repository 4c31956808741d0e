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

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from mpsd_protocol import (
    DEFAULT_CONNECTIONS,
    CudaError,
    InvalidResourceHandleError,
    InvalidValueError,
    LaunchOutOfResourcesError,
    NotSupportedError,
    OutOfMemoryError,
    brief,
    check_args,
    check_shape,
    format_size,
)
from mpsd.backends.base import HOST_VIEW, DeviceMemory
from mpsd.backends.ops import Extent, Launch, OnStream, Plan, Work
from mpsd.runtime.capture import CaptureCalls
from mpsd.runtime.graph_memory import GraphMemoryCalls
from mpsd.runtime.graphs import CAPTURED, GraphCalls
from mpsd.runtime.limits import refused
from mpsd.runtime.memory import AddressSpace, Allocation, HostBuffer
from mpsd.runtime.copies import CopyCalls
from mpsd.runtime.modules import ModuleCalls, check_extents
from mpsd.runtime.pools import PoolCalls, Reservation
from mpsd.runtime.streams import Event, Stream, StreamCalls
from mpsd.runtime.teardown import Teardown
from mpsd.runtime.vmm import VMM_BASE, MappedPiece, VirtualMemory, VirtualMemoryCalls

if TYPE_CHECKING:
    from mpsd.runtime.device import Device
    from mpsd.runtime.ipc import Export, IpcRegistry

_MAX_PLANS = 1024  # plans kept, by kernel, shape and arguments


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


class Context(StreamCalls, CopyCalls, PoolCalls, VirtualMemoryCalls, CaptureCalls, GraphMemoryCalls, GraphCalls,
              ModuleCalls):
    """One client's sub-context on one device: its memory, its launches and, through the classes mixed in, its
    streams and events, copies, pools, virtual memory, captures, graphs and modules."""

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
