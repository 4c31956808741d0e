# The public API, written once. Each method hands a generator from the core to `self._drive`: the blocking
# Context drives it to a result, the trio AsyncContext returns an awaitable for it. Names are CUDA's in
# snake_case so users recognise them.
from __future__ import annotations

from typing import Any

from mpsd_protocol import Calls, CudaError

from . import _graphs, _modules
from ._core import CURRENT, Core
from ._objects import DevicePointer, Event, HostBuffer, Stream
from ._pools import MemPool
from ._wait import DEVICE_MAP_HOST, check_flags


class ContextBase:
    """What `Context` and `AsyncContext` share: every call of the CUDA runtime that mpsd emulates."""

    _core: Core

    def _drive(self, op: Any) -> Any:  # pragma: no cover - each shell defines it
        """Run a core generator to its result (blocking), or return an awaitable for it (trio)."""
        raise NotImplementedError

    def _post(self, note: Any) -> Any:  # pragma: no cover - each shell defines it
        """Send a notification (fire-and-forget), or return an awaitable that does."""
        raise NotImplementedError

    @property
    def client_id(self) -> int:
        """This client's id in the daemon (its MPS context number)."""
        return self._core.client_id

    @property
    def quotas(self) -> dict[str, Any]:
        """Effective quotas: active_thread_percentage, sm_cap, pinned_mem_limit (bytes), priority."""
        return dict(self._core.quotas)

    @property
    def kernels(self) -> dict[str, list[str]]:
        """The daemon's built-in kernels and their parameter kinds."""
        return dict(self._core.kernels)

    def device_properties(self) -> Any:
        """``cudaGetDeviceProperties`` in snake_case; ``multiprocessor_count`` is this client's SM cap."""
        return self._drive(self._core.device_properties())

    def stream_priority_range(self) -> tuple[int, int]:
        """``cudaDeviceGetStreamPriorityRange``: (least, greatest); lower numbers are more urgent."""
        least, greatest = self._core.properties["stream_priority_range"]
        return least, greatest

    def set_device_flags(self, flags: int) -> None:
        """``cudaSetDeviceFlags``: how this context's calls wait for the device, which here means for the daemon's
        reply (the constants are `mpsd_client.DEVICE_SCHEDULE_*`). Auto, the default, spins for 200 us at most
        before it blocks (CUDA's spins until the result while the process has no more contexts than the host has
        cores: the daemon needs a core here); Spin and Yield spin until the reply comes (Yield lets other
        processes run between reads); BlockingSync blocks at once, for the least CPU. The trio context keeps the
        flags and always waits through trio. The other bits of the low byte are taken and change nothing.

        Raises:
            InvalidValueError: a bit above the low byte, or more than one scheduling choice.
        """
        self._core.device_flags = check_flags(flags)

    def get_device_flags(self) -> int:
        """``cudaGetDeviceFlags``: the flags set last, with MapHost, which CUDA always reports."""
        return self._core.device_flags | DEVICE_MAP_HOST

    def mem_get_info(self) -> Any:
        """``cudaMemGetInfo``: (free, total) bytes as this client sees them; a pinned limit caps both."""
        return self._drive(self._core.mem_get_info())

    def malloc(self, nbytes: int) -> Any:
        """``cudaMalloc``: `nbytes` of device memory, as a `DevicePointer`.

        Raises:
            OutOfMemoryError: beyond the device's free memory or this client's pinned limit.
            InvalidValueError: `nbytes` is not a byte count.
        """
        return self._drive(self._core.malloc(self, nbytes))

    def free(self, ptr: DevicePointer | int) -> Any:
        """``cudaFree``: waits for this context's work, then frees the allocation based at `ptr`.

        Raises:
            InvalidValueError: `ptr` is not the base of a live allocation of this context.
        """
        return self._drive(self._core.free(ptr))

    # -- the driver's virtual memory (cuMem*: mpsd.runtime.vmm) -------------------------------------------
    # Sizes, addresses and offsets are whole pages of the granularity (CUDA_ERROR_INVALID_VALUE otherwise, as
    # InvalidValueError); a backend without the calls (a real GPU, in mpsd) raises NotSupportedError.
    def mem_get_allocation_granularity(self) -> Any:
        """``cuMemGetAllocationGranularity``: the bytes every size and mapping is a multiple of (2 MiB)."""
        return self._drive(self._core.invoke(Calls.mem_get_allocation_granularity))

    def mem_address_reserve(self, size: int, alignment: int = 0) -> Any:
        """``cuMemAddressReserve``: `size` bytes of device address space with no memory behind them; the
        address. Raises OutOfMemoryError when the address space is exhausted."""
        return self._drive(self._core.invoke(Calls.mem_address_reserve, size, alignment))

    def mem_address_free(self, ptr: int, size: int) -> Any:
        """``cuMemAddressFree``: the whole reservation at `ptr`, once nothing is mapped in it."""
        return self._drive(self._core.invoke(Calls.mem_address_free, ptr, size))

    def mem_create(self, size: int) -> Any:
        """``cuMemCreate``: `size` bytes of device memory, charged as cudaMalloc's are; its handle (an int).
        Raises OutOfMemoryError past the device's memory or the pinned limit."""
        return self._drive(self._core.invoke(Calls.mem_create, size))

    def mem_release(self, handle: int) -> Any:
        """``cuMemRelease``: the handle goes; its memory when its last mapping does."""
        return self._drive(self._core.invoke(Calls.mem_release, handle))

    def mem_map(self, ptr: int, size: int, offset: int, handle: int) -> Any:
        """``cuMemMap`` (and ``cuMemSetAccess`` read-write for this device): [ptr, ptr + size) of a reservation
        shows [offset, offset + size) of the handle's memory, to kernels, copies and host_view."""
        return self._drive(self._core.invoke(Calls.mem_map, ptr, size, offset, handle))

    def mem_unmap(self, ptr: int, size: int) -> Any:
        """``cuMemUnmap``: whole mappings only; it does not wait for queued work, which faults with an illegal
        address if it touches the range when it runs."""
        return self._drive(self._core.mem_unmap(ptr, size))

    # -- stream-ordered allocation (mpsd_client._pools) ---------------------------------------------------
    def malloc_async(self, nbytes: int, stream: Stream | None = None) -> Any:
        """``cudaMallocAsync``: `nbytes` from the device's current pool, for work on `stream` from here on (in
        stream order). No round trip, unless the pool must grow (in 32 MiB steps).

        Raises:
            OutOfMemoryError: the pool cannot grow (the device, this client's pinned limit, its max_size).
            InvalidValueError: `nbytes` is not a byte count. InvalidResourceHandleError: not a stream of this
                context.
        """
        return self._drive(self._core.malloc_async(self, nbytes, stream, CURRENT))

    def malloc_from_pool_async(self, nbytes: int, pool: MemPool, stream: Stream | None = None) -> Any:
        """``cudaMallocFromPoolAsync``: as `malloc_async`, from `pool`.

        Raises:
            InvalidValueError: `pool` is not a live pool of this context; otherwise as `malloc_async`.
        """
        return self._drive(self._core.malloc_async(self, nbytes, stream, pool))

    def free_async(self, ptr: DevicePointer | int, stream: Stream | None = None) -> None:
        """``cudaFreeAsync``: give `ptr` back to its pool in `stream`'s order: work queued on `stream` before
        it may still use the bytes; later allocations reuse them as CUDA's rules allow. Never blocks.

        Raises:
            InvalidValueError: `ptr` is not a live stream-ordered allocation of this context (a double free).
            InvalidResourceHandleError: not a stream of this context.
        """
        try:
            self._core.free_async(ptr, stream)
        except CudaError as exc:
            self._core.last_error = exc
            raise

    def device_get_default_mem_pool(self) -> MemPool:
        """``cudaDeviceGetDefaultMemPool``: this context's device's default pool."""
        return self._core.default_pool(self)

    def device_get_mem_pool(self) -> MemPool:
        """``cudaDeviceGetMemPool``: the pool `malloc_async` takes from (the default one until set)."""
        return self._core.current(self)

    def device_set_mem_pool(self, pool: MemPool) -> None:
        """``cudaDeviceSetMemPool``.

        Raises:
            InvalidValueError: `pool` is not a live pool of this context.
        """
        self._core.current_pool = self._core.pool_of(self, pool)

    def mem_pool_create(self, location: int | None = None, max_size: int = 0) -> MemPool:
        """``cudaMemPoolCreate``: a pool on this context's device (`location`, if given, must be its ordinal),
        reserving at most `max_size` bytes (0: no limit but the device's and this client's).

        Raises:
            InvalidValueError: another device, or `max_size` is not a byte count.
        """
        return self._core.mem_pool_create(self, location, max_size)

    def host_view(self, ptr: DevicePointer | int) -> Any:
        """A writable memoryview of the device bytes from `ptr` to the end of its allocation (local or opened
        from an IPC handle): the daemon's memfd, mapped here, so reading it copies nothing.

        Raises:
            InvalidValueError: `ptr` is in no live allocation of this context.
        """
        return self._drive(self._core.host_view(ptr))

    def ipc_get_mem_handle(self, ptr: DevicePointer | int) -> Any:
        """``cudaIpcGetMemHandle``: 64 bytes another process can open (the same handle for one allocation).

        Raises:
            InvalidValueError: `ptr` is not the base of an allocation this context made.
        """
        return self._drive(self._core.ipc_get_mem_handle(ptr))

    def ipc_open_mem_handle(self, handle: bytes, flags: int = 1) -> Any:
        """``cudaIpcOpenMemHandle``: the exported memory as a pointer in this context (opening it again gives
        the same pointer and counts a reference). Its memfd is mapped here too, for `host_view`.

        Raises:
            InvalidValueError: a malformed handle, one for another device, or flags other than 1.
            InvalidResourceHandleError: a stale or forged handle.
            DeviceUninitializedError: opened in the process that exported it.
            NotPermittedError: the daemon's IPC access policy refuses this process.
        """
        return self._drive(self._core.ipc_open_mem_handle(self, handle, flags))

    def ipc_close_mem_handle(self, ptr: DevicePointer | int) -> Any:
        """``cudaIpcCloseMemHandle``: one reference less; the mapping goes with the last (after the work queued
        before it). The bytes live on while the exporter or another importer holds them."""
        return self._drive(self._core.ipc_close_mem_handle(ptr))

    def ipc_get_event_handle(self, event: Event) -> Any:
        """``cudaIpcGetEventHandle``: for events created with ``interprocess=True, disable_timing=True``.

        Raises:
            InvalidResourceHandleError: the event is not an interprocess, disable-timing event.
        """
        return self._drive(self._core.invoke(Calls.ipc_get_event_handle, event))

    def ipc_open_event_handle(self, handle: bytes) -> Any:
        """``cudaIpcOpenEventHandle``: an Event of this context that shares the exported event's records
        (record, synchronize, query and stream.wait_event work across processes; it disables timing)."""
        return self._drive(self._core.ipc_open_event_handle(self, handle))

    def host_alloc(self, nbytes: int) -> Any:
        """``cudaHostAlloc``: a pinned `HostBuffer` of `nbytes`, shared with the daemon."""
        return self._drive(self._core.host_alloc(nbytes))

    def free_host(self, buffer: HostBuffer) -> Any:
        """``cudaFreeHost``."""
        return self._drive(self._core.free_host(buffer))

    def memcpy_htod(self, dst: DevicePointer | int, src: Any, stream: Stream | None = None) -> Any:
        """Copy the bytes of `src` (any contiguous buffer) to device address `dst`.

        With no stream it is synchronous; on a stream it is ordered there, and a pageable `src` may be
        reused as soon as the call returns (its bytes were staged), as with ``cudaMemcpyAsync``.

        Raises:
            InvalidValueError: the range is not inside one live allocation, or `src` is not a buffer.
        """
        return self._drive(self._core.memcpy_htod(dst, src, stream))

    def memcpy_dtoh(self, dst: Any, src: DevicePointer | int, stream: Stream | None = None) -> Any:
        """Copy ``len(dst)`` bytes from device address `src` into the writable buffer `dst`.

        Into pageable memory the copy is synchronous even on a stream, as in CUDA; into a pinned
        `HostBuffer` on a stream it lands when the copy runs.
        """
        return self._drive(self._core.memcpy_dtoh(dst, src, stream))

    def memcpy_dtod(self, dst: DevicePointer | int, src: DevicePointer | int, nbytes: int,
                    stream: Stream | None = None) -> Any:
        """Copy `nbytes` between device addresses; asynchronous with respect to the host, as in CUDA."""
        return self._drive(self._core.invoke(Calls.memcpy_dtod, dst, src, nbytes, stream))

    def memcpy_peer(self, dst: DevicePointer | int, src_context: ContextBase, src: DevicePointer | int, nbytes: int,
                    stream: Stream | None = None) -> Any:
        """``cudaMemcpyPeerAsync``: copy `nbytes` from `src` of `src_context`, this process's context on another
        device, to `dst` of this context, on this context's `stream`; asynchronous with respect to the host.

        Over NVLink where the daemon's devices are peers, staged through host memory where they are not; the
        statistics count which (``peer_copies_nvlink``, ``peer_copies_staged``). A source context of another
        process, or one that has failed, is cudaErrorInvalidDevice at the next synchronising call.
        """
        return self._drive(self._core.invoke(Calls.memcpy_peer, dst, src_context.client_id, src, nbytes, stream))

    def memset(self, ptr: DevicePointer | int, value: int, nbytes: int, stream: Stream | None = None) -> Any:
        """``cudaMemset``: set `nbytes` bytes at `ptr` to the low byte of `value`, in stream order."""
        return self._drive(self._core.invoke(Calls.memset, ptr, value, nbytes, stream))

    def create_stream(self, priority: int = 0, non_blocking: bool = False) -> Any:
        """``cudaStreamCreateWithPriority``: priorities are clamped to `stream_priority_range()`."""
        return self._drive(self._core.create_stream(self, priority, non_blocking))

    def create_event(self, disable_timing: bool = False, interprocess: bool = False) -> Any:
        """``cudaEventCreateWithFlags``."""
        return self._drive(self._core.create_event(self, disable_timing, interprocess))

    def launch(self, name: str | _modules.Function, grid: int | tuple[int, ...], block: int | tuple[int, ...],
               args: list[Any] | tuple[Any, ...] = (), stream: Stream | None = None, shared_mem: int = 0) -> Any:
        """Launch a kernel, fire-and-forget: errors in its execution surface at the next synchronising call, as
        in CUDA. `name` is a built-in's name, "module.kernel" of a module this context loaded, or a `Function`.

        Raises:
            InvalidDeviceFunctionError: no such kernel.
            InvalidConfigurationError: bad grid or block.
            InvalidValueError: wrong argument count or kinds, or too much shared memory.
        """
        try:
            note = self._core.launch(name, grid, block, args, stream, shared_mem)
        except CudaError as exc:
            self._core.last_error = exc
            raise
        return self._post(note)

    def module_load(self, path: str) -> Any:
        """Load a module (kernels of one's own, mpsd.modules) from the daemon's --module-path: `path` is a file
        there, absolute or relative to its directories, or a module's name (``"matmul"`` for matmul.py). Its
        kernels are launched as "module.kernel" or by its `Function`s. Loading a module again gives it again.
        (cudaLibraryLoadFromFile's place: the runtime has no cuModuleLoad.)

        Raises:
            InvalidValueError: no such file within the --module-path (a runtime's answer for a missing file), or
                a module of that name from another file is loaded.
            InvalidKernelImageError: the file is no module (a syntax error, a bad declaration: the reason).
        """
        return self._drive(_modules.load(self, path, runtime=True))

    def module_unload(self, module: _modules.Module) -> Any:
        """Unload a module loaded with `module_load` (work already queued still runs).

        Raises:
            InvalidResourceHandleError: not a module loaded in this context.
        """
        return self._drive(_modules.unload(self, module))

    def func_get_attributes(self, func: _modules.Function | str) -> Any:
        """``cudaFuncGetAttributes``: a kernel's max_threads_per_block, shared_size_bytes, num_regs, ... as its
        declaration gives them (a map).

        Raises:
            InvalidDeviceFunctionError: no such kernel.
        """
        return self._drive(_modules.attributes(self, func))

    def occupancy_max_active_blocks(self, func: _modules.Function | str, block: int | tuple[int, ...],
                                    shared_mem: int = 0) -> Any:
        """``cudaOccupancyMaxActiveBlocksPerMultiprocessor``: blocks of `block` threads of `func`, with `shared_mem`
        bytes of dynamic shared memory, that one SM holds at once by the kernel's registers and shared memory.

        Raises:
            InvalidDeviceFunctionError: no such kernel. InvalidValueError: a bad block or shared memory size.
        """
        return self._drive(_modules.occupancy(self, func, block, shared_mem))

    def graph_create(self) -> Any:
        """``cudaGraphCreate``: an empty `Graph`, for nodes added by hand."""
        return self._drive(_graphs.create_graph(self))

    def thread_exchange_stream_capture_mode(self, mode: str) -> str:
        """``cudaThreadExchangeStreamCaptureMode``: the calling thread's capture mode from now on ("global", the
        default, "thread_local" or "relaxed"), which says which of its calls a capture under way refuses; the
        mode it had."""
        return _graphs.exchange_capture_mode(self, mode)

    def synchronize(self) -> Any:
        """``cudaDeviceSynchronize``: wait for all of this context's work; raises its pending errors."""
        return self._drive(self._core.invoke(Calls.synchronize))

    def get_last_error(self) -> Any:
        """``cudaGetLastError``: the last error (a `CudaError`) or None, and reset it (sticky ones stay)."""
        return self._drive(self._core.get_last_error(clear=True))

    def peek_at_last_error(self) -> Any:
        """``cudaPeekAtLastError``: like `get_last_error` without the reset."""
        return self._drive(self._core.get_last_error(clear=False))

    def clock(self) -> Any:
        """This client's simulated now, in seconds. Under the daemon's virtual clock it is the client's own
        simulated host clock (each call advances it by what the call costs a real CUDA host); under the wall
        clock, the device's simulated time (wall seconds x the daemon's time scale), like time.monotonic()."""
        return self._drive(self._core.clock())

    def sleep(self, seconds: float) -> Any:
        """Let `seconds` of simulated time pass on this client's clock, as time.sleep() would (under the wall
        clock it is a real sleep of seconds / time scale).

        Raises:
            InvalidValueError: `seconds` is negative or not a number.
        """
        return self._sleep(self._core.sleep(seconds))

    def _sleep(self, op: Any) -> Any:  # pragma: no cover - each shell defines it
        raise NotImplementedError

    def statistics(self) -> Any:
        """What the daemon counted for this client: kernels, blocks, SM-seconds, memory, copies."""
        return self._drive(self._core.invoke(Calls.statistics))
