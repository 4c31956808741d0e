# The CUDA backend: a real GPU behind the backend protocol, through the driver API (cuda-python's
# cuda.bindings), as the MPS server does it: the daemon is the one process that touches the device, every
# client's work goes through its contexts (the primary one, and green ones for capped clients, below), and
# clients never see a CUDA handle.
#
# - Memory: cuMemCreate with POSIX file descriptor handles, mapped in the daemon's address space; its exported
#   fd is what IPC passes over SCM_RIGHTS (the seed's dma-buf path). The runtime keeps its own client address
#   spaces, so a client's pointer is translated to the device address when its work is queued.
# - Kernels: the built-ins compiled once with NVRTC for the device's architecture (mpsd.backends.cuda_kernels),
#   launched with the client's grid and block. A pointer argument outside live memory is caught before launch
#   (the runtime resolves every extent) and reported as an illegal address when the kernel would have run,
#   contained as the daemon's fault containment says, without corrupting the primary context that every client
#   shares.
# - Virtual memory (the driver's VMM calls, mpsd.runtime.vmm): a reservation is a cuMemAddressReserve'd range
#   (CudaRange), the physical memory mapped into it is ordinary CudaMemory (cuMemCreate'd, so its handle maps at a
#   second address too) mapped with cuMemMap and made readable and writable by cuMemSetAccess. Work on it is given
#   extents in the range, resolved to its device address as any memory's are; the runtime refuses, before launch,
#   work on a page it has not mapped. An unmapping is put off until the work given before it has run, as memory
#   is freed (bury): on the driver cuMemUnmap does not wait for work, and a kernel that touched the page would
#   fault the primary context every client shares.
# - Streams: one non-blocking CUDA stream per client stream, with its priority; the legacy default stream's
#   rules and event waits come from the runtime as `after` work, realised with cuStreamWaitEvent.
# - SM caps: a client whose active thread percentage gives it fewer SMs than the device has runs its streams in a
#   green context of at least that many SMs. MPS's percentage is a limit on how many SMs a client holds at once,
#   where a green context is a fixed set of them; the closest mapping (mpsd.backends.smgroups) gives each capped
#   client a window of the device's smallest SM groups, overlapping other clients' windows where the caps add
#   up to more than the device, all placed again whenever a capped client comes or goes so that the worst-off
#   tenant keeps the most SMs. A client whose window changes moves: each of its streams becomes a new CUDA
#   stream of the new green context that waits for the last event of the old one, so its work keeps its order
#   (work already queued runs out on the old SMs), and the old stream is destroyed at once (the driver lets its
#   queued work finish first). A window's SMs come in the driver's groups (8 on an H200), so it may hold more
#   than the cap (32 SMs for the 26 of 20%): where that would run a grid in fewer waves than the cap's SMs, the
#   grid goes as launches in a row of the blocks its cap's SMs hold at once, and takes the waves it takes under
#   MPS.
# - Trace (`--trace FILE`): the kernels are compiled to write where and when each block ran (mpsd.backends.
#   cuda_trace), and the trace at exit is drawn from that, as the simulator's is from its block groups.
# - Completion: work on a stream completes in order, so one event marks the end of every piece of work queued
#   on the stream since the last one: it is recorded when the backend's task next runs, when an event record
#   asks for its exact place, or when other work must wait for it. One trio task polls the oldest event of each
#   stream and tells whoever waits; it runs after the calls one read of a socket brought where the GPU had
#   nothing pending, then every POLL while someone waits for work, and about every IDLE_POLL while nobody does
#   (a stream or event query may then learn of work's end a millisecond late). Between two looks while someone
#   waits, it spins (trio's timers are whole milliseconds), querying the events already recorded at each turn
#   of trio's loop, and the work waited for is marked when the wait begins: a wait learns of its end within a
#   turn of the loop. The events are reused.
#
# Where it differs from MPS today: a green context's SMs are fixed, where MPS lets a capped client use any SMs
# up to its cap (the windows overlap, but a client never reaches SMs outside its own); a grid given as launches
# in a row waits for the slowest block of each before the next starts (MPS starts a block wherever one ends,
# which matters only where a kernel's blocks take unequal times); weights and MIG
# instances are not modelled; a kernel or copy is known to have ended when the next event of its stream fires
# (event records are timed exactly); and a cancelled client's running work is waited for rather than torn down
# (a real GPU cannot drop work already queued).
#
# Graphs: a graph launch is replayed, not launched as a CUDA graph. Its nodes go as the work they stand for, in the
# graph's order, on the launch's stream (so branches of a graph run one after another here), with one record after
# them; the host saves the calls of the nodes (one notification from the client) but the device runs what
# cuLaunchKernel would. A real CUDA graph (stream capture on the daemon's streams, cuGraphInstantiate,
# cuGraphLaunch) waits for a GPU to test it on: this machine's tests cannot run it.
"""The real-GPU backend."""

from __future__ import annotations

import ctypes
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import trio

from mpsd.backends.base import VIRTUAL_MEMORY, Client, Gate, Instance, when_all
from mpsd.backends.cuda_driver import CudaFailure, _bindings, _check, cuda_device_count
from mpsd.backends.cuda_kernels import Kernel, compile_kernels
from mpsd.backends.cuda_modules import load_module
from mpsd.backends.cuda_trace import RECORD, BlockTrace
from mpsd.backends.ops import Copy, Extent, GraphLaunch, Launch, Memset, Record, Work
from mpsd.backends.recorder import Recorder
from mpsd.backends.smgroups import place
from mpsd_protocol import (DEFAULT_CONNECTIONS, CudaError, IllegalAddressError, InvalidDeviceFunctionError,
                           OutOfMemoryError)

if TYPE_CHECKING:
    from mpsd.record.timeline import Timeline

__all__ = ["CudaBackend", "CudaDevice", "CudaFailure", "cuda_device_count"]

# What MPS holds on an H200 beside the clients' allocations, measured (bench/fidelity/h200_memory.json): the
# daemon charges them on every backend alike, so quotas mean the same on both.
SERVER_MEMORY, CONTEXT_MEMORY = 81_172_336, 538_339_472
# Seconds between full looks at pending work (which mark what was queued since the last, an event record a
# stream): while someone waits for some of it (a synchronize, a full launch queue, memory to free, the kernel
# dispatcher's holding), and while nobody does. More often costs launch rate (10 us took a quarter off it,
# bench/fidelity/dispatch_h200_spin/summary.txt); a client streaming launches with nobody waiting needs its
# work retired only now and then.
POLL, IDLE_POLL = 50e-6, 500e-6
_SYNCED = object()  # in place of an event: work the backend waited for when the driver refused it one
_UNASKED = object()  # no event asked about yet (None is work not marked yet, which must never pass as fired)
# The gap between back-to-back kernels of one stream on an H200, measured (mpsd.sim.specs.H200.kernel_overhead
# says how): a traced kernel counts as queued from its stream's turn, this much later, until its last block starts.
KERNEL_OVERHEAD = 2e-6
PORTABLE = 0x1  # CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTREGISTER_PORTABLE: pinned for every context, green ones too
DEVICEMAP = 0x2  # CU_MEMHOSTALLOC_DEVICEMAP: mapped into the device's address space
WAIT_VALUE_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
VMM_PAGE = 2 << 20  # the page the runtime reserves, makes and maps memory in (mpsd.runtime.vmm.GRANULARITY)

@dataclass(frozen=True, slots=True)
class CudaDevice:
    """`--devices cuda:N`: the real GPU with driver ordinal N."""

    ordinal: int
    name = "cuda"


class CudaMemory:
    """Device memory made with cuMemCreate, mapped in the daemon, exported as a POSIX fd."""

    offset = 0

    def __init__(self, backend: CudaBackend, nbytes: int) -> None:
        cu = backend.cu
        self._backend = backend
        self.size = nbytes
        granule = backend.granularity
        self._span = max(granule, -(-nbytes // granule) * granule)
        self._handle = _check(cu.cuMemCreate(self._span, backend.alloc_prop, 0))
        try:
            self.dptr = int(_check(cu.cuMemAddressReserve(self._span, 0, 0, 0)))
            _check(cu.cuMemMap(self.dptr, self._span, 0, self._handle, 0))
            _check(cu.cuMemSetAccess(self.dptr, self._span, [backend.access], 1))
            handle_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            self.fd = int(_check(cu.cuMemExportToShareableHandle(self._handle, handle_type, 0)))
        except BaseException:
            cu.cuMemRelease(self._handle)
            raise
        self.refs = 1
        self.on_release: list[Callable[[], None]] = []

    def release(self) -> None:
        """The last reference is gone. Its charge goes now, as cudaFree returns having freed it; the driver's
        memory goes once no work given before may touch it (CudaBackend.bury), since cudaFree's implicit
        synchronisation is not ours to make: the daemon must not wait on the GPU."""
        self.refs -= 1
        if not self.refs:
            for callback in self.on_release:
                callback()
            self._backend.bury(self)

    def give_back(self) -> Iterator[None]:
        """Nothing to give back first: the driver frees device memory, later (bury), off the daemon's thread."""
        return iter(())

    def free(self) -> None:
        """Give the memory back to the driver (the GPU touches it no more: see CudaBackend.bury)."""
        cu = self._backend.cu
        os.close(self.fd)
        cu.cuMemUnmap(self.dptr, self._span)
        cu.cuMemAddressFree(self.dptr, self._span)
        cu.cuMemRelease(self._handle)


class CudaRange:
    """A reserved device address range (cuMemAddressReserve) that CudaMemory is mapped into, page run by page
    run: the device side of a reservation of the driver's VMM calls (Backend.reserve)."""

    offset = 0

    def __init__(self, backend: CudaBackend, size: int) -> None:
        self._backend = backend
        self.size = size
        self.dptr = int(_check(backend.cu.cuMemAddressReserve(size, 0, 0, 0)))
        self.mapped: dict[int, int] = {}  # offset of each live cuMemMap in the range -> its bytes
        self.closed = False

    def map(self, offset: int, memory: CudaMemory, memory_offset: int, nbytes: int) -> None:
        """Map `nbytes` of `memory` from `memory_offset` at `offset`, readable and writable by the device."""
        backend, cu = self._backend, self._backend.cu
        backend.settle(self, offset, nbytes)  # an unmapping of these pages that is still put off happens first
        address = self.dptr + offset
        _check(cu.cuMemMap(address, nbytes, memory_offset, memory._handle, 0))
        try:
            _check(cu.cuMemSetAccess(address, nbytes, [backend.access], 1))
        except BaseException:
            cu.cuMemUnmap(address, nbytes)
            raise
        self.mapped[offset] = nbytes

    def unmap(self, offset: int, nbytes: int) -> None:
        """Unmap the whole mappings in [offset, offset + nbytes) once the work given so far has run (the
        runtime has stopped resolving addresses there already)."""
        for start in [start for start in self.mapped if offset <= start < offset + nbytes]:
            size = self.mapped.pop(start)
            self._backend.defer(self._unmapper(start, size), (self, start, start + size))

    def _unmapper(self, start: int, nbytes: int) -> Callable[[], None]:
        cu, address = self._backend.cu, self.dptr + start
        return lambda: cu.cuMemUnmap(address, nbytes)

    def close(self) -> None:
        """Unmap what is still mapped (a client that went) and give the address range back, once the work given
        so far has run."""
        if self.closed:
            return
        self.closed = True
        self.unmap(0, self.size)
        cu, dptr, size = self._backend.cu, self.dptr, self.size
        self._backend.defer(lambda: cu.cuMemAddressFree(dptr, size), None)


class CudaGate:
    """A word of pinned host memory the GPU reads (`Gate`): 0 open, 1 closed. Work given with it waits behind a
    stream wait on the word (cuStreamWaitValue32), queued after its other waits, so the word is read once what
    the work waits for has ended; the daemon writes it from the host, with no call into the driver.

    A stream waiting at a gate holds up the GPU's hardware queue it shares with other streams (a context has
    CUDA_DEVICE_MAX_CONNECTIONS of them: the backend asks for 32), and the work the gate waits for may be behind
    it there: so a gate closed GATE_LIMIT opens by itself (`expire`), and stays open until it is opened again.
    """

    __slots__ = ("_word", "address", "_slots", "_index", "closed_at", "expired", "freed")

    def __init__(self, slots: list[int], index: int, host: int, device: int) -> None:
        self._slots, self._index = slots, index
        self._word = ctypes.c_uint32.from_address(host + 4 * index)
        self._word.value = 0
        self.address = device + 4 * index
        self.closed_at: float | None = None  # monotonic time it was closed, while it is
        self.expired = self.freed = False

    def set(self, closed: bool) -> None:
        if not closed:
            self.expired = False
            self.closed_at = None
            self._word.value = 0
        elif not self.expired and self.closed_at is None:
            self.closed_at = time.monotonic()
            self._word.value = 1

    def expire(self, now: float) -> bool:
        """Open it if it has been closed GATE_LIMIT; whether it is still closed."""
        if self.closed_at is None:
            return False
        if now - self.closed_at < GATE_LIMIT:
            return True
        self._word.value = 0
        self.closed_at, self.expired = None, True
        return False

    def free(self) -> None:
        self.set(False)
        self.freed = True
        self._slots.append(self._index)


GATES = 1024  # words of the gates' pinned page: one a client, given back when it leaves
# The longest a gate stays closed (CudaGate): past the time urgent work usually holds best-effort work back
# (DISB-C's requests of two 0.5-ms kernels), short beside a deadlock's forever.
GATE_LIMIT = 5e-3


@dataclass(eq=False, slots=True)
class _Context:
    """A CUDA context work runs in (the primary one, or a green one of some SMs), and the event that dates it:
    events of one context are timed against its own base, recorded at a known host time."""

    handle: Any
    base: Any
    base_time: float  # seconds since the backend's origin when `base` completed
    sm_count: int
    spare: list[Any] = field(default_factory=list)  # events of this context that have fired, for reuse


@dataclass(eq=False, slots=True)
class _Pending:
    """The backend's record of one piece of work: what `Work.done`, `ended` and `cancelled` read. Its event is
    the first one recorded on its stream after it (None until then); `owner` is the work it was recorded for,
    which hands it back for reuse."""

    stream: tuple[int, int]
    context: _Context
    event: Any = None
    owner: bool = False
    done: bool = False  # completed, or let go with its client (cancelled)
    cancelled: bool = False
    retired: bool = False  # the GPU has finished it (a cancelled piece of work runs out all the same)
    ended: float = math.nan
    fault: CudaError | None = None
    waiters: list[Callable[[], None]] = field(default_factory=list)
    cleanup: list[Callable[[], None]] = field(default_factory=list)


class CudaBackend:
    """One real GPU.

    Args:
        ordinal: the driver's device ordinal.
        trace: where to write the device's timeline at exit (a Chrome trace), if anywhere: its kernels are then
            the traced ones, each block recording where and when it ran.
    """

    capabilities: frozenset[str]  # VIRTUAL_MEMORY where the driver's granularity fits the runtime's pages; no
    # HOST_VIEW: device memory is not host memory
    instances: tuple[Instance, ...] = ()
    policy = "mps"
    virtual = None
    server_memory, context_memory = SERVER_MEMORY, CONTEXT_MEMORY
    memory_fds = 1  # the exported POSIX fd (CudaMemory)
    host_maps = 0  # device memory and reservations are the driver's, on the GPU

    def __init__(self, ordinal: int = 0, trace: Path | None = None) -> None:
        cu, nvrtc = _bindings()
        self.cu, self._nvrtc = cu, nvrtc
        _check(cu.cuInit(0))
        self.device = _check(cu.cuDeviceGet(ordinal))
        self.ordinal = ordinal
        self.context = _check(cu.cuDevicePrimaryCtxRetain(self.device))
        _check(cu.cuCtxSetCurrent(self.context))
        self.name = _check(cu.cuDeviceGetName(256, self.device)).split(b"\0", 1)[0].decode()
        self.total_memory = int(_check(cu.cuDeviceTotalMem(self.device)))
        attr = cu.CUdevice_attribute
        self._attrs = {name: int(_check(cu.cuDeviceGetAttribute(getattr(attr, "CU_DEVICE_ATTRIBUTE_" + key),
                                                                self.device)))
                       for name, key in _ATTRIBUTES.items()}
        self._uuid = bytes(_check(cu.cuDeviceGetUuid(self.device)).bytes)
        self.priorities = _check(cu.cuCtxGetStreamPriorityRange())  # (least, greatest)
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.alloc_prop = prop
        self.granularity = int(_check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        # The runtime's virtual memory calls work in 2 MiB pages, which the driver's mapping granularity must divide.
        self.capabilities = frozenset({VIRTUAL_MEMORY}) if VMM_PAGE % self.granularity == 0 else frozenset()
        access = cu.CUmemAccessDesc()
        access.location = prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access
        self._kernels = compile_kernels(cu, nvrtc, self._attrs["major"], self._attrs["minor"], traced=trace is not None)
        self._functions = {name: kernel.function for name, kernel in self._kernels.items()}
        # Modules' kernels by their declarations (mpsd.modules.Kernel), as clients load them (load_module).
        self._module_kernels: dict[Any, Kernel] = {}
        self._blocks_per_sm: dict[tuple[Kernel, int, int], int] = {}  # (kernel, threads, shared memory) -> blocks
        self._origin = time.monotonic()
        self._primary = self._dated(self.context, self._attrs["sm_count"])
        self._current = self.context
        self._chunks: list[Any] | None = None  # the device's smallest SM groups, in order (smgroups)
        self._green: dict[tuple[int, ...], _Context] = {}  # window of chunks -> its green context
        self._placed: dict[int, _Context] = {}  # client -> the context its streams run in
        self._caps: dict[int, int] = {}  # capped client -> its SM cap, in the order they came
        self._windows: dict[int, tuple[tuple[int, ...], int]] = {}  # capped client -> (its window, its cap)
        self._streams: dict[tuple[int, int], tuple[Any, _Context]] = {}
        self._queues: dict[tuple[int, int], deque[_Pending]] = {}
        self._open: dict[tuple[int, int], list[_Pending]] = {}  # work queued since its stream's last event
        self._draining: list[deque[_Pending]] = []  # queues of forgotten clients' streams, running out
        # What must wait until no work given before may touch the memory (a free, an unmapping), the last work
        # then given to each stream, and the pages of a range it unmaps: done once all of that work has retired
        # (streams retire in order), in the order it was put off.
        self._graves: list[tuple[Callable[[], None], list[_Pending], tuple[CudaRange, int, int] | None]] = []
        self._host: dict[int, tuple[Any, int]] = {}  # id(HostBuffer) -> (the buffer, its registered address)
        self._gates: tuple[list[int], int, int] | None = None  # free words, the page's host and device address
        self._closed: list[CudaGate] = []  # gates given out, which _poll opens once closed GATE_LIMIT
        self._wake = trio.Event()
        self._watchers = 0  # when_done callbacks not yet called: while there are any, work is looked at often
        self._hurry = trio.Event()  # someone began to wait
        self._nvml = _nvml_handle(self.properties(ordinal)["uuid"])
        self.on_fault: Callable[[int, CudaError], None] = lambda client, error: None
        self.on_idle: Callable[[int, float, float], None] = lambda client, clock, grace: None
        self.recorder = Recorder(trace) if trace is not None else None
        self._trace: BlockTrace | None = None
        if trace is not None:
            self._trace = BlockTrace(cu, self._attrs["threads_per_sm"])
            self._trace.stamps.append(self._stamp())

    def _dated(self, handle: Any, sm_count: int) -> _Context:
        """`handle` made current, with a base event recorded and waited for."""
        cu = self.cu
        _check(cu.cuCtxSetCurrent(handle))
        self._current = handle
        base = _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT))
        _check(cu.cuEventRecord(base, 0))
        _check(cu.cuEventSynchronize(base))
        return _Context(handle, base, time.monotonic() - self._origin, sm_count)

    def _use(self, context: _Context) -> None:
        if self._current is not context.handle:
            _check(self.cu.cuCtxSetCurrent(context.handle))
            self._current = context.handle

    def _ring(self) -> list[Any]:
        """The device's SMs cut into the driver's smallest groups (8 SMs on an H200) and what is left over, in
        order: what every window is made of (one split, so that any of them combine in one green context)."""
        if self._chunks is None:
            cu = self.cu
            whole = _check(cu.cuDeviceGetDevResource(self.device, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
            parts, count, rest = _check(cu.cuDevSmResourceSplitByCount(whole.sm.smCount, whole, 0, 1))
            self._chunks = list(parts[:count]) + ([rest] if rest is not None and rest.sm.smCount else [])
        return self._chunks

    def _window(self, window: tuple[int, ...]) -> _Context:
        """The green context of a window of chunks, made the first time."""
        found = self._green.get(window)
        if found is None:
            cu = self.cu
            resources = [self._ring()[chunk] for chunk in window]
            desc = _check(cu.cuDevResourceGenerateDesc(resources, len(resources)))
            green = _check(cu.cuGreenCtxCreate(desc, self.device,
                                               cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
            sms = sum(r.sm.smCount for r in resources)
            found = self._green[window] = self._dated(_check(cu.cuCtxFromGreenCtx(green)), sms)
        return found

    # -- what the device is ----------------------------------------------------------------------------
    def properties(self, index: int) -> dict[str, Any]:
        a = self._attrs
        uuid = self._uuid.hex()
        return {
            "name": self.name, "index": index,
            "uuid": f"GPU-{uuid[:8]}-{uuid[8:12]}-{uuid[12:16]}-{uuid[16:20]}-{uuid[20:]}",
            "compute_capability": [a["major"], a["minor"]], "major": a["major"], "minor": a["minor"],
            "multiprocessor_count": a["sm_count"], "total_memory": self.total_memory,
            "max_threads_per_multiprocessor": a["threads_per_sm"], "max_blocks_per_multiprocessor": a["blocks_per_sm"],
            "max_threads_per_block": a["threads_per_block"],
            "max_block_dims": [a["block_x"], a["block_y"], a["block_z"]],
            "max_grid_dims": [a["grid_x"], a["grid_y"], a["grid_z"]],
            "warp_size": a["warp_size"], "regs_per_multiprocessor": a["regs_per_sm"],
            "regs_per_block": a["regs_per_block"],
            "shared_memory_per_block": a["smem_per_block"], "shared_memory_per_block_optin": a["smem_optin"],
            "shared_memory_per_multiprocessor": a["smem_per_sm"], "clock_rate_khz": a["clock_khz"],
            "memory_bandwidth": 2 * a["memory_clock_khz"] * 1e3 * a["bus_width"] / 8,
            "stream_priority_range": list(self.priorities),
            "pci_domain_id": a["pci_domain"], "pci_bus_id": a["pci_bus"], "pci_device_id": a["pci_device"],
        }

    def allocate(self, nbytes: int) -> CudaMemory:
        return CudaMemory(self, nbytes)

    def reserve(self, nbytes: int) -> CudaRange:
        """A reservation of the driver's VMM calls: `nbytes` of device address space, nothing mapped.

        Raises:
            OSError: the driver has no such range to give.
        """
        try:
            return CudaRange(self, nbytes)
        except (CudaFailure, OutOfMemoryError) as exc:
            raise OSError(12, f"cuMemAddressReserve refused {nbytes} bytes ({exc})") from None

    def fits(self, threads: int, shared_mem: int, regs: int = 32) -> bool:
        # The declared registers are a module's word for its simulated twin; the driver refuses a launch its
        # compiled kernel's registers do not allow (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES), reported when it runs.
        return threads <= self._attrs["threads_per_block"] and shared_mem <= self._attrs["smem_optin"]

    def occupancy(self, function: Any, threads: int, shared_mem: int) -> int:
        """As the driver computes it for the compiled kernel (its real registers and static shared memory, which
        may differ from what its module declares for the simulator); 0 where none fits."""
        return self._occupancy(self._kernel(function), threads, shared_mem, least=0)

    def _kernel(self, function: Any) -> Kernel:
        """The compiled kernel of a declaration: a module's by the declaration itself (two modules of one name,
        from two files, are two), a built-in's by its name.

        Raises:
            InvalidDeviceFunctionError: a module's kernel this device never loaded.
        """
        if not function.module:
            return self._kernels[function.name]
        found = self._module_kernels.get(function)
        if found is None:
            raise InvalidDeviceFunctionError(f"{function.qualified} was not loaded on this device")
        return found

    def load_module(self, module: Any) -> None:
        """Compile the module's CUDA C twin with NVRTC (or load its PTX) with cuModuleLoadData, and keep each of
        its kernels' CUfunction and argument buffer by its qualified name (mpsd.backends.cuda_modules).

        Raises:
            ValueError: it names no twin, or the twin does not compile, load or hold one of its kernels.
        """
        compiled = load_module(self.cu, self._nvrtc, module, self._attrs["major"], self._attrs["minor"])
        self._module_kernels.update((module.kernels[name], kernel) for name, kernel in compiled.items())

    def sm_cap(self, active_thread_percentage: float) -> int:
        """As MPS rounds it: whole TPCs (two SMs), at least one. A green context may round it again (the
        driver splits SMs in groups of its own granularity)."""
        sms = self._attrs["sm_count"]
        return min(sms, max(2, int(sms * active_thread_percentage / 100) // 2 * 2))

    # -- clients -----------------------------------------------------------------------------------------
    def attach(self, client: Client, *, sm_cap: int, priority: int, weight: float, instance: int | None,
               sms: tuple[int, int] | None = None, connections: int = DEFAULT_CONNECTIONS) -> None:
        """Place a client: in the primary context, or in the green context of a window of at least its SM cap
        (its streams are made there as its work arrives), the capped clients' windows all chosen again (which
        may move some of them). Static SM partitions (`sms`) are the simulator's only: the daemon refuses -S
        on a real GPU."""
        if client.id in self._placed:
            return  # a priority or weight change: nothing of it is modelled here
        if self.recorder is not None:
            # (The recorder reads a Context's quotas and account, more than Client promises: the runtime's
            # clients are Contexts.)
            self.recorder.attached(client)  # type: ignore[arg-type]
        self._placed[client.id] = self._primary
        if sm_cap < self._attrs["sm_count"]:
            self._caps[client.id] = sm_cap
            self._arrange()

    def _arrange(self) -> None:
        """Choose every capped client's window again (smgroups.place: a newcomer, or one that left, changes
        what is best for all) and move the clients whose window changed."""
        try:
            sizes = [chunk.sm.smCount for chunk in self._ring()]
        except CudaFailure:  # no green contexts on this driver or device: the caps go unenforced
            return
        clients = list(self._caps)
        current = [self._windows[c][0] if c in self._windows else None for c in clients]
        chosen = place(sizes, [(window, self._caps[c]) for c, window in zip(clients, current)])
        for client, old, window in zip(clients, current, chosen):
            if window == old:
                continue
            try:  # a window of the whole device is the primary context (it still counts in the others' shares)
                context = (self._window(window) if sum(sizes[c] for c in window) < self._attrs["sm_count"]
                           else self._primary)
            except CudaFailure:  # the driver made no green context of it: the client stays where it is
                continue
            self._windows[client] = (window, self._caps[client])
            self._move(client, context)

    def _move(self, client: int, context: _Context) -> None:
        """Run `client`'s work in `context` from now on: each of its streams made elsewhere is replaced by a
        stream of `context` that first waits for everything queued on the old one."""
        cu = self.cu
        self._placed[client] = context
        for key in [k for k, (_, there) in self._streams.items() if k[0] == client and there is not context]:
            self._flush(key)  # the work queued since the stream's last event gets one, to wait on
            old = self._streams[key][0]
            priority = _check(cu.cuStreamGetPriority(old))
            self._use(context)
            stream = _check(cu.cuStreamCreateWithPriority(cu.CUstream_flags.CU_STREAM_NON_BLOCKING, priority))
            queue = self._queues.get(key)
            tail = queue[-1] if queue else None
            if tail is not None and not tail.retired and tail.event is not None and tail.event is not _SYNCED:
                # Across contexts, as event waits between clients are; the tail's event is not reused before
                # the tail retires, and the wait takes its record as it stands now.
                _check(cu.cuStreamWaitEvent(stream, tail.event, 0))
            self._streams[key] = (stream, context)
            # The driver frees a destroyed stream once its queued work (and the events recorded after it) is
            # done; the queue's events go on being polled, each timed against its own context's base.
            cu.cuStreamDestroy(old)

    def cancel(self, client: int) -> None:
        """A real GPU cannot drop work it was given: the client's work is let go at once (whoever waits on it
        is told, nothing reports it completed) and runs out on the GPU meanwhile, without the daemon waiting
        for it; the memory it may touch is freed once it has (bury)."""
        for key, queue in self._queues.items():
            if key[0] == client:
                for pending in queue:
                    if not pending.done:
                        pending.cancelled = pending.done = True
                        _tell(pending.waiters)
        self._wake.set()

    def forget(self, client: int) -> None:
        self.cancel(client)
        for key in [k for k in self._open if k[0] == client]:
            self._flush(key)  # its work must still be seen to retire (bury), once its streams are gone
        for key in [k for k in self._streams if k[0] == client]:
            # The driver frees a destroyed stream's resources once its work is done; ours go on being polled.
            self.cu.cuStreamDestroy(self._streams.pop(key)[0])
            queue = self._queues.pop(key, None)
            if queue:
                self._draining.append(queue)
        self._placed.pop(client, None)
        self._windows.pop(client, None)
        if self._caps.pop(client, None) is not None:
            self._arrange()  # its SMs go to the capped clients that stay

    def bury(self, memory: CudaMemory) -> None:
        """Free `memory` now if no work the GPU was given may still touch it, else once that work has retired
        (a killed client's kernels run out before its memory goes, as on a real GPU under MPS)."""
        self.defer(memory.free, None)

    def defer(self, action: Callable[[], None], pages: tuple[CudaRange, int, int] | None) -> None:
        """Do `action` now if no work the GPU was given may still touch what it frees or unmaps (`pages`: the
        range and offsets it unmaps), else once that work has retired."""
        tails = [queue[-1] for queue in (*self._queues.values(), *self._draining) if queue]
        if tails:
            self._graves.append((action, tails, pages))
            self._wake.set()
        else:
            action()

    def settle(self, where: CudaRange, offset: int, nbytes: int) -> None:
        """Carry out now the put-off unmappings of pages of `where` in [offset, offset + nbytes), waiting for the
        work they wait on: the runtime maps the pages again (a client that mapped, unmapped and maps again
        without waiting for its work, which PyTorch does not do: it synchronises its stream before unmapping)."""
        cu = self.cu
        keep = []
        for action, tails, pages in self._graves:
            if pages is not None and pages[0] is where and pages[1] < offset + nbytes and offset < pages[2]:
                for pending in tails:
                    if pending.retired:
                        continue
                    if pending.event is None:
                        self._flush(pending.stream)
                    if pending.event is not _SYNCED and pending.event is not None:
                        cu.cuEventSynchronize(pending.event)
                action()
            else:
                keep.append((action, tails, pages))
        self._graves = keep

    def release_host(self, buffer: Any) -> None:
        """A pinned host buffer is about to be unmapped: the driver must let go of it first."""
        registered = self._host.pop(id(buffer), None)
        if registered is not None:
            self.cu.cuCtxSynchronize()  # no copy may still be using it
            self.cu.cuMemHostUnregister(registered[1])

    # -- work --------------------------------------------------------------------------------------------
    def _stream(self, key: tuple[int, int], priority: int) -> tuple[Any, _Context]:
        """The CUDA stream of a client stream, made in the client's context the first time, and that context."""
        found = self._streams.get(key)
        if found is None:
            context = self._placed.get(key[0], self._primary)
            self._use(context)
            least, greatest = self.priorities
            clamped = min(max(priority, greatest), least)
            stream = _check(self.cu.cuStreamCreateWithPriority(self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING,
                                                               clamped))
            found = self._streams[key] = (stream, context)
        return found

    def received(self, at: float) -> None:
        """A real GPU runs work when it is given, not when its call arrived."""

    def gate(self) -> CudaGate | None:
        """A gate in the gates' page (made the first time, mapped for every context); None once all its words
        are taken, or where the driver gives no mapped page."""
        cu = self.cu
        if self._gates is None:
            try:
                host = _check(cu.cuMemHostAlloc(4 * GATES, PORTABLE | DEVICEMAP))
                device = _check(cu.cuMemHostGetDevicePointer(host, 0))
            except (CudaFailure, OutOfMemoryError):
                return None
            self._gates = (list(range(GATES - 1, -1, -1)), int(host), int(device))
        slots, host, device = self._gates
        if not slots:
            return None
        gate = CudaGate(slots, slots.pop(), host, device)
        self._closed.append(gate)
        return gate

    def submit(self, work: Work, count: int = 1, gate: Gate | None = None, late: float = 0.0) -> None:
        """`count` launches where `work` is a Launch: one record marks them all, as it marks all the work of a
        stream until its next event (_flush). With `gate`, they wait at it after their other waits."""
        if type(work) is GraphLaunch:
            self._replay(work, gate)
            return
        cu = self.cu
        key = work.stream
        stream, context = self._stream(key, work.priority)
        for dep in work.after:  # an event may be waited for from another context's stream
            handle = dep.handle
            if handle is not None and not handle.done:
                if handle.event is None:
                    self._flush(handle.stream)
                if handle.event is not _SYNCED:  # else it has run already
                    _check(cu.cuStreamWaitEvent(stream, handle.event, 0))
        if gate is not None:
            assert isinstance(gate, CudaGate)
            _check(cu.cuStreamWaitValue32(stream, gate.address, 0, WAIT_VALUE_EQ))
        self._use(context)
        pending = _Pending(key, context)
        if isinstance(work, Launch):
            self._launch(work, stream, pending, count)
        elif isinstance(work, Copy):
            self._copy(work, stream, pending)
        elif isinstance(work, Memset):
            _check(cu.cuMemsetD8Async(self._device_pointer(work.dst), work.value, work.dst.nbytes, stream))
        elif not isinstance(work, Record):
            raise TypeError(f"no such work: {work!r}")
        work.handle = pending
        work.after = ()
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        queue.append(pending)
        waiting = self._open.get(key)
        if waiting is None:
            self._open[key] = [pending]
        else:
            waiting.append(pending)
        if isinstance(work, Record):
            self._flush(key)  # an event record is timed where it stands
        self._wake.set()

    def _replay(self, work: GraphLaunch, gate: Gate | None) -> None:
        """A graph launch, its nodes submitted in order on its stream (each node's dependencies come before it in
        `nodes`, so the stream's order keeps them), the first after what the launch waits for, and a record after
        them, which is the launch's record."""
        after = work.after
        for node in work.nodes:  # (an event wait node's own `after` is the record it waits for: kept)
            node.stream, node.priority, node.after = work.stream, work.priority, after + node.after
            after = ()
            self.submit(node, gate=gate)
            gate = None
        end = Record(client=work.client, stream=work.stream, priority=work.priority, sm_cap=work.sm_cap, after=after)
        self.submit(end)
        work.handle, work.after = end.handle, ()

    def _flush(self, key: tuple[int, int]) -> None:
        """Record one event after the work queued on stream `key` since its last one: it marks all of it."""
        waiting = self._open.pop(key, None)
        if not waiting:
            return
        cu = self.cu
        stream, context = self._streams[key]
        self._use(context)
        event: Any = _SYNCED
        try:
            event = (context.spare.pop() if context.spare
                     else _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT)))
            _check(cu.cuEventRecord(event, stream))
        except (CudaFailure, OutOfMemoryError):
            # The driver gave no event to mark the work by. This runs in the backend's task too, where a raise
            # would stop every client's completions: wait for the stream here instead, once, and let the
            # work end now (a refused record leaves the event as it was: fired, so it can be used again).
            if event is not _SYNCED:
                context.spare.append(event)
            cu.cuStreamSynchronize(stream)
            event = _SYNCED
        for pending in waiting:
            pending.event = event
        waiting[-1].owner = event is not _SYNCED

    def _launch(self, work: Launch, stream: Any, pending: _Pending, count: int) -> None:
        plan = work.plan
        kernel = self._kernel(plan.function)
        values = kernel.values
        for value, arg in zip(values, plan.args):
            value.value = arg
        for index, extent in work.extents:
            if extent is None:  # caught before launch: reported when it would have run
                pending.fault = IllegalAddressError(
                    f"{plan.kernel} argument {index} ({int(plan.args[index]):#x}) points outside live memory")
                return
            values[index].value = extent.memory.dptr + extent.offset
        (gx, gy, gz), (bx, by, bz) = plan.grid, plan.block
        launch, function, smem, address = self.cu.cuLaunchKernel, kernel.function, plan.shared_mem, kernel.address
        cap = self._caps.get(work.client)
        step = gx
        if cap is not None and pending.context.sm_count > cap and kernel.base is not None:
            # Its green context holds more SMs than its cap (the driver's groups are 8 SMs on an H200). Where that
            # would let its grid run in fewer waves than `cap` SMs take, the grid goes as launches in a row of the
            # blocks `cap` SMs hold at once, as MPS holds it to its cap. Only there: a launch waits for its slowest
            # block before the next starts, and where other clients share its SMs that costs more than it saves
            # (three tenants at 50% took 1.2 to 1.3 times MPS's time, split; bench/fidelity/h200_dec03/split).
            per_sm, blocks = self._occupancy(kernel, bx * by * bz, smem), gx * gy * gz
            if -(-blocks // (per_sm * cap)) > -(-blocks // (per_sm * pending.context.sm_count)):
                step = max(1, per_sm * cap // (gy * gz))
        if kernel.base is not None:
            kernel.total.value = gx
        trace = self._trace if kernel.trace is not None else None  # (a module's kernels write no block records)
        for _ in range(count):
            if trace is not None:  # each launch its slots, a part of a grid its own of them
                slots = trace.slots(work.client, work.stream, plan.kernel, gx * gy * gz, bx * by * bz, self.now())
            for first in range(0, gx, step):
                if kernel.base is not None:
                    kernel.base.value = first
                if trace is not None:
                    kernel.trace.value = slots and slots + first * gy * gz * RECORD
                _check(launch(function, min(step, gx - first), gy, gz, bx, by, bz, smem, stream, address, 0))

    def _occupancy(self, kernel: Kernel, threads: int, smem: int, least: int = 1) -> int:
        """The blocks of a kernel one SM holds at once, as the driver computes it (at least `least`)."""
        key = (kernel, threads, smem)
        found = self._blocks_per_sm.get(key)
        if found is None:
            cu = self.cu
            function = _check(cu.cuKernelGetFunction(kernel.function))
            found = self._blocks_per_sm[key] = int(_check(
                cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, smem)))
        return max(least, found)

    def _copy(self, work: Copy, stream: Any, pending: _Pending) -> None:
        cu, n = self.cu, work.nbytes
        if work.kind == "h2d":
            if work.data is not None:  # staged: from pinned memory of our own, freed when the copy is done
                staging = _check(cu.cuMemHostAlloc(max(n, 1), PORTABLE))
                # (a buffer copy: the staged bytes are an anonymous mapping, which ctypes.memmove does not take)
                memoryview((ctypes.c_ubyte * n).from_address(int(staging))).cast("B")[:] = work.data
                work.data = None  # used up: whoever still holds the work holds no bytes
                pending.cleanup.append(lambda: cu.cuMemFreeHost(staging))
                source = int(staging)
            else:
                # (an h2d copy's unstaged source is an Extent of pinned memory)
                source = self._host_pointer(work.src)  # type: ignore[arg-type]
            _check(cu.cuMemcpyHtoDAsync(self._device_pointer(work.dst), source, n, stream))
        elif work.kind == "d2h":
            _check(cu.cuMemcpyDtoHAsync(self._host_pointer(work.dst), self._device_pointer(work.src), n, stream))
        else:
            _check(cu.cuMemcpyDtoDAsync(self._device_pointer(work.dst), self._device_pointer(work.src), n, stream))

    def _device_pointer(self, extent: Extent | None) -> int:
        assert extent is not None
        return extent.memory.dptr + extent.offset

    def _host_pointer(self, extent: Extent) -> int:
        """A pinned host buffer's address, registered with the driver the first time it is used."""
        buffer = extent.memory
        registered = self._host.get(id(buffer))
        if registered is None:
            anchor = ctypes.c_char.from_buffer(buffer.map)
            address = ctypes.addressof(anchor)
            del anchor  # keep no export of the mapping, so that it can be closed
            _check(self.cu.cuMemHostRegister(address, buffer.size, PORTABLE))
            registered = self._host[id(buffer)] = (buffer, address)
        return registered[1] + extent.offset

    def when_done(self, work: Iterable[Work | None], callback: Callable[[], None]) -> None:
        pending = [w.handle for w in work if w is not None and w.handle is not None and not w.handle.done]
        if not pending:
            callback()
            return
        self._watchers += 1

        def done() -> None:
            self._watchers -= 1
            callback()

        for handle in pending:  # marked now, so that each look until it ends is only a query
            if handle.event is None:
                self._flush(handle.stream)
        when_all(pending, lambda pending, told: pending.waiters.append(told), done)
        self._hurry.set()

    def _poll(self) -> bool:
        """Mark the work queued since the last look, finish the work whose events have fired, and free the
        memory nothing may touch any more; whether any work or memory is still waiting."""
        for key in list(self._open):
            self._flush(key)
        if self._closed:
            now = time.monotonic()
            self._closed = [gate for gate in self._closed if not gate.freed]
            for gate in self._closed:
                gate.expire(now)
        busy = self._retire()
        self._draining = [queue for queue in self._draining if queue]
        if self._graves:
            graves, self._graves = self._graves, []
            for action, tails, pages in graves:
                if all(pending.retired for pending in tails):
                    action()
                else:
                    self._graves.append((action, tails, pages))
        return busy or bool(self._graves) or bool(self._open)

    def _retire(self) -> bool:
        """Finish the marked work whose events have fired (one query an event); whether any marked work is
        still running."""
        cu = self.cu
        busy = False
        not_ready = cu.CUresult.CUDA_ERROR_NOT_READY
        for queue in (*self._queues.values(), *self._draining):
            fired, ended = _UNASKED, math.nan  # work sharing an event ends together: it is asked about once
            while queue:
                head = queue[0]
                event = head.event
                if event is None:  # not marked yet (since the last full look, or by a callback of this pass)
                    busy = True
                    break
                if event is not fired:
                    if event is not _SYNCED and cu.cuEventQuery(event)[0] == not_ready:
                        busy = True
                        break
                    fired, ended = event, self.now() if event is _SYNCED else self._ended(head.context, event)
                queue.popleft()
                self._finish(head, ended)
                if head.owner:  # its event is back for reuse: a callback above may have recorded it again
                    fired = _UNASKED
        return busy

    def _ended(self, context: _Context, event: Any) -> float:
        """When a fired event did, in the backend's seconds."""
        cu = self.cu
        err, ms = cu.cuEventElapsedTime(context.base, event)
        return context.base_time + ms / 1e3 if err == cu.CUresult.CUDA_SUCCESS else self.now()

    def _finish(self, pending: _Pending, ended: float) -> None:
        if pending.owner:
            pending.context.spare.append(pending.event)
        if not pending.cancelled:
            pending.ended = ended
        pending.retired = True
        for cleanup in pending.cleanup:
            cleanup()
        if pending.cancelled:  # its client is gone: nobody is told again, and its fault is nobody's now
            return
        pending.done = True
        if pending.fault is not None:
            self.on_fault(pending.stream[0], pending.fault)
        _tell(pending.waiters)

    # -- time and what happened ----------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self._origin

    def clock_info(self) -> dict[str, Any]:
        return {"kind": "wall", "time_scale": 1.0, "origin": self._origin}

    def statistics(self) -> Any:
        return _Statistics(self.now())

    def busy_sms(self) -> int:
        return 0  # not known without counters

    def utilization(self) -> float | None:
        """The share of the last sample period in which a kernel ran, as NVML (nvidia-smi) reports it."""
        if self._nvml is None:
            return None
        import pynvml

        try:
            return pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu / 100
        except pynvml.NVMLError:
            return None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if not self._poll():
                await self._wake.wait()
                self._wake = trio.Event()
            elif self._watchers:
                await self._spin()
            elif self._graves:
                await trio.sleep(POLL)
            else:
                self._hurry = trio.Event()
                with trio.move_on_after(IDLE_POLL):
                    await self._hurry.wait()

    async def _spin(self) -> None:
        """Until the next full look (POLL), with the daemon's other tasks running between, finish marked work
        as soon as its event fires: someone waits for it. No timer: trio's are whole milliseconds under epoll
        (Python's epoll.poll rounds a timeout up to one), and a synchronize would wait that long for work long
        done (about 1.5 ms a request on the H200, bench/fidelity/dispatch_h200). CUDA's own synchronize spins
        too, where a process has fewer contexts than cores (cudaDeviceScheduleAuto)."""
        deadline = time.monotonic() + POLL
        while self._watchers and time.monotonic() < deadline:
            await trio.lowlevel.checkpoint()
            self._retire()

    def _stamp(self, tries: int = 20) -> tuple[int, float]:
        """The GPU's global timer (ns) at an instant of the backend's clock (the host's monotonic clock, which
        the clients' requests are stamped by): read by a one-thread kernel launched and waited for, dated
        halfway between the launch call and the wait's return, of the tries the one they bracket closest.
        (Dated by events instead, the trace came out about 20 us late against the host, kernels seemingly ending
        after the daemon had seen them end (bench/fidelity/h200_dec03/trace2): an event's time is
        reckoned from its context's base event, whose host time is read only once the wait for it returns.)"""
        cu = self.cu
        self._use(self._primary)
        stream = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        out = _check(cu.cuMemAlloc(8))
        try:
            stamp = self._kernels["mpsd_stamp"]
            stamp.values[0].value = int(out)
            timer = ctypes.c_uint64()
            best = (math.inf, 0, 0.0)
            for _ in range(tries):
                before = self.now()
                _check(cu.cuLaunchKernel(stamp.function, 1, 1, 1, 1, 1, 1, 0, stream, stamp.address, 0))
                _check(cu.cuStreamSynchronize(stream))
                after = self.now()
                _check(cu.cuMemcpyDtoH(ctypes.addressof(timer), out, 8))
                best = min(best, (after - before, timer.value, (before + after) / 2))
            return best[1], best[2]
        finally:
            cu.cuMemFree(out)
            cu.cuStreamDestroy(stream)

    def write_trace(self, index: int) -> Path | None:
        """Write the device's timeline, if one was asked for; where it went.

        Raises:
            OSError: it cannot be written.
        """
        return None if self.recorder is None else self.recorder.written(self, index)

    def timeline(self, index: int) -> tuple[Timeline, dict[str, Any]] | None:
        """The device's timeline, once the work it was given has run (it waits for it), from what the traced
        kernels recorded; None where no trace was asked for."""
        recorder, trace = self.recorder, self._trace
        if recorder is None or trace is None:
            return None
        for context in (self._primary, *self._green.values()):
            self._use(context)
            _check(self.cu.cuCtxSynchronize())
        trace.stamps.append(self._stamp())
        names, tenants = recorder.tenants()
        kernels, spans = trace.read(names)
        timeline = recorder.device(names, tenants, policy=self.policy, sm_count=self._attrs["sm_count"],
                                   duration=self.now(), launch_overhead=KERNEL_OVERHEAD, kernels=kernels,
                                   spans=spans)
        recorder.dropped = trace.untraced
        return timeline, recorder.meta(index, self._origin, 1.0, 0.0)


def _nvml_handle(uuid: str) -> Any:
    """NVML's handle of the GPU with `uuid` (nvidia-ml-py), or None where NVML is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:  # no nvidia-ml-py, no NVML library, or a GPU it does not know: utilisation is unknown
        return None


@dataclass(frozen=True, slots=True)
class _Statistics:
    """A real GPU's statistics as far as the daemon knows them without counters: its time."""

    now: float
    sm_seconds: float = 0.0
    per_client: dict[int, Any] = field(default_factory=dict)


_ATTRIBUTES = {
    "major": "COMPUTE_CAPABILITY_MAJOR", "minor": "COMPUTE_CAPABILITY_MINOR", "sm_count": "MULTIPROCESSOR_COUNT",
    "threads_per_sm": "MAX_THREADS_PER_MULTIPROCESSOR", "blocks_per_sm": "MAX_BLOCKS_PER_MULTIPROCESSOR",
    "threads_per_block": "MAX_THREADS_PER_BLOCK", "block_x": "MAX_BLOCK_DIM_X", "block_y": "MAX_BLOCK_DIM_Y",
    "block_z": "MAX_BLOCK_DIM_Z", "grid_x": "MAX_GRID_DIM_X", "grid_y": "MAX_GRID_DIM_Y", "grid_z": "MAX_GRID_DIM_Z",
    "warp_size": "WARP_SIZE", "regs_per_sm": "MAX_REGISTERS_PER_MULTIPROCESSOR",
    "regs_per_block": "MAX_REGISTERS_PER_BLOCK", "smem_per_block": "MAX_SHARED_MEMORY_PER_BLOCK",
    "smem_optin": "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", "smem_per_sm": "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
    "clock_khz": "CLOCK_RATE", "memory_clock_khz": "MEMORY_CLOCK_RATE", "bus_width": "GLOBAL_MEMORY_BUS_WIDTH",
    "pci_domain": "PCI_DOMAIN_ID", "pci_bus": "PCI_BUS_ID", "pci_device": "PCI_DEVICE_ID",
}


def _tell(waiters: list[Callable[[], None]]) -> None:
    for waiter in waiters:
        waiter()
    waiters.clear()
