"""The CUDA driver API's flavour of mpsd_client: ``cuInit``, ``cuCtxCreate``, ``cuMemAlloc``... in snake_case.

    from mpsd_client import driver
    driver.init(0)
    dev = driver.device_get(0)
    ctx = driver.ctx_create(0, dev)        # current to this thread from here
    p = driver.mem_alloc(1 << 20)
    driver.launch_kernel("fill_f32", 256, 1, 1, 256, 1, 1, 0, None, [p, 1.0, 1 << 18])
    driver.ctx_synchronize()
    driver.ctx_destroy(ctx)

The rules are the driver's: `init` comes first (every other call raises CUDA_ERROR_NOT_INITIALIZED before it);
each thread has a stack of current contexts (`ctx_push_current`, `ctx_pop_current`, `ctx_set_current`), and the
memory, stream, event and launch calls act in the calling thread's current one (CUDA_ERROR_INVALID_CONTEXT when
there is none); a device's primary context is reference counted (`device_primary_ctx_retain`/`release`) and is
the one the runtime flavour (`mpsd_client.runtime`) uses. A context is a connection to the daemon: mpsd_client's
`_contexts` says why.

Errors are the runtime flavour's classes (``except InvalidValueError`` catches either flavour's) carrying the
driver's code and ``CUDA_ERROR_*`` name, from mpsd_protocol's one table; the driver's own names for the classes
are here too (`InvalidContextError` is `DeviceUninitializedError`, code 201).

Modules are kernels of one's own (mpsd.modules): `module_load` reads one from the daemon's --module-path,
`module_get_function` gives its `Function`, which `launch_kernel`, `func_get_attribute` and
`occupancy_max_active_blocks_per_multiprocessor` take, as they take a built-in's name.

Where mpsd knowingly differs: a kernel's name may stand in for a ``CUfunction`` (an unknown name is
CUDA_ERROR_INVALID_HANDLE, as a bad function is); a module file is a Python declaration read by the daemon, only
from its --module-path (a path outside it is CUDA_ERROR_FILE_NOT_FOUND, as a missing file is); a
`DevicePointer` of another context is refused at the call with CUDA_ERROR_INVALID_VALUE (a GPU would run the
kernel and fault with CUDA_ERROR_ILLEGAL_ADDRESS), while a plain int is taken as an address of the current
context; `init` takes mpsd's `pipe_dir` beside CUDA's flags.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, TypeVar

from mpsd_protocol import (
    DRIVER_ALIASES,
    ERROR_CLASSES,
    Calls,
    CudaError,
    InvalidResourceHandleError,
    InvalidValueError,
    brief,
    driver_error,
    driver_error_name,
    driver_error_string,
)

from . import _modules
from ._contexts import DriverContext, _state, check_flags
from ._modules import Function, Module
from ._objects import DevicePointer, Event, Stream
from ._sync import Context
from ._wait import check_flags as check_device_flags

F = TypeVar("F", bound=Callable[..., Any])

CU_CTX_FLAGS = 0xFF  # CU_CTX_SCHED_* (low 3 bits), MAP_HOST, LMEM_RESIZE_TO_MAX, the coredump bits, SYNC_MEMOPS
CU_STREAM_DEFAULT, CU_STREAM_NON_BLOCKING = 0x0, 0x1
CU_EVENT_DEFAULT, CU_EVENT_BLOCKING_SYNC, CU_EVENT_DISABLE_TIMING, CU_EVENT_INTERPROCESS = 0x0, 0x1, 0x2, 0x4

# cuDeviceGetAttribute's attributes that the daemon's device properties answer (CUdevice_attribute's numbers).
CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1
CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X = 2
CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y = 3
CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z = 4
CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X = 5
CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y = 6
CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z = 7
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8
CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10
CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK = 12
CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33
CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34
CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39
CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR = 82
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR = 106
_ATTRIBUTES: dict[int, Callable[[dict[str, Any]], int]] = {
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: lambda p: p["max_threads_per_block"],
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: lambda p: p["max_block_dims"][0],
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: lambda p: p["max_block_dims"][1],
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: lambda p: p["max_block_dims"][2],
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: lambda p: p["max_grid_dims"][0],
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: lambda p: p["max_grid_dims"][1],
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: lambda p: p["max_grid_dims"][2],
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: lambda p: p["shared_memory_per_block"],
    CU_DEVICE_ATTRIBUTE_WARP_SIZE: lambda p: p["warp_size"],
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: lambda p: p["regs_per_block"],
    CU_DEVICE_ATTRIBUTE_CLOCK_RATE: lambda p: p["clock_rate_khz"],
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: lambda p: p["multiprocessor_count"],
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: lambda p: p["pci_bus_id"],
    CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: lambda p: p["pci_device_id"],
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: lambda p: p["max_threads_per_multiprocessor"],
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: lambda p: 1,
    CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: lambda p: p["pci_domain_id"],
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: lambda p: p["major"],
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: lambda p: p["minor"],
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: lambda p: p["shared_memory_per_multiprocessor"],
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: lambda p: p["regs_per_multiprocessor"],
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: lambda p: p["shared_memory_per_block_optin"],
    CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: lambda p: p["max_blocks_per_multiprocessor"],
}


def __getattr__(name: str) -> type[CudaError]:
    """Every error class, under the runtime's name and, where it differs, the driver's (InvalidContextError,
    NotInitializedError, InvalidHandleError, ...), so that ``except driver.InvalidContextError`` reads as CUDA
    does (PEP 562: looked up when asked for, from the one error table)."""
    found = DRIVER_ALIASES.get(name) or _ERRORS_BY_NAME.get(name)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return found


_ERRORS_BY_NAME = {cls.__name__: cls for cls in ERROR_CLASSES.values()}


def _driver(initialized: bool = True) -> Callable[[F], F]:
    """A driver call: it raises CUDA_ERROR_NOT_INITIALIZED before `init` (where `initialized`), and every
    error under the driver's code and name."""
    def wrap(call: F) -> F:
        @functools.wraps(call)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                if initialized:
                    _state.check_initialized()
                return call(*args, **kwargs)
            except CudaError as exc:
                raise driver_error(exc) from None
        return run  # type: ignore[return-value]
    return wrap


# -- initialisation and devices ---------------------------------------------------------------------------
@_driver(initialized=False)
def init(flags: int = 0, *, pipe_dir: str | os.PathLike[str] | None = None) -> None:
    """``cuInit``: reach the daemon (at `pipe_dir`, else $CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps) and
    learn its devices. Calling it again does nothing.

    Raises:
        InvalidValueError: `flags` is not 0. MpsConnectionError: no daemon. NoDeviceError: it shows us none.
    """
    check_flags(flags, 0, "cuInit")
    _state.init(pipe_dir)


@_driver()
def device_get_count() -> int:
    """``cuDeviceGetCount``: the devices this process sees (CUDA_VISIBLE_DEVICES applies)."""
    return _state.device_count


@_driver()
def device_get(ordinal: int) -> int:
    """``cuDeviceGet``: the ``CUdevice`` of `ordinal` (here the ordinal itself).

    Raises:
        InvalidDeviceError: no such device.
    """
    return _state.check_device(ordinal)


@_driver()
def device_get_name(dev: int) -> str:
    """``cuDeviceGetName``."""
    return str(_state.device_properties(_state.check_device(dev))["name"])


@_driver()
def device_get_attribute(attrib: int, dev: int) -> int:
    """``cuDeviceGetAttribute``: one of the ``CU_DEVICE_ATTRIBUTE_*`` constants of this module. Under MPS the
    multiprocessor count is this client's SM cap, as a real MPS client sees it.

    Raises:
        InvalidValueError: an attribute mpsd does not report. InvalidDeviceError: no such device.
    """
    properties = _state.device_properties(_state.check_device(dev))
    entry = _ATTRIBUTES.get(attrib) if type(attrib) is int else None
    if entry is None:
        raise InvalidValueError(f"device attribute {brief(attrib, 20)} is not one mpsd reports")
    return int(entry(properties))


# -- contexts ---------------------------------------------------------------------------------------------
@_driver()
def ctx_create(flags: int, dev: int) -> DriverContext:
    """``cuCtxCreate``: a new context on `dev`, with its own memory, streams and events, pushed onto the calling
    thread's stack. `flags` are CU_CTX_SCHED_* and the others of the low byte, as cudaSetDeviceFlags takes them.

    Raises:
        InvalidValueError: bad flags (a bit above the low byte, two scheduling choices).
        InvalidDeviceError: no such device. OutOfMemoryError: no room for another context.
    """
    check_flags(flags, CU_CTX_FLAGS, "cuCtxCreate")
    check_device_flags(flags)  # one scheduling choice at most, before a connection is opened for it
    return _state.create(flags, _state.check_device(dev))


@_driver()
def ctx_destroy(ctx: DriverContext) -> None:
    """``cuCtxDestroy``: free everything `ctx` holds; popped if it is the calling thread's current context (to
    other threads it stays current, and their calls in it raise CUDA_ERROR_CONTEXT_IS_DESTROYED).

    Raises:
        InvalidContextError: not a live context, or a primary one (those are released, not destroyed).
    """
    _state.destroy(_state.check_live(ctx))


@_driver()
def ctx_push_current(ctx: DriverContext) -> None:
    """``cuCtxPushCurrent``: `ctx` becomes the calling thread's current context; the one before comes back at
    `ctx_pop_current`.

    Raises:
        InvalidContextError: not a live context.
    """
    _state.stack.append(_state.check_live(ctx))


@_driver()
def ctx_pop_current() -> DriverContext:
    """``cuCtxPopCurrent``: take the calling thread's current context off its stack; the one under it (if any)
    is current again. Returns the context popped.

    Raises:
        InvalidContextError: the stack is empty.
    """
    _state.current()
    return _state.stack.pop()


@_driver()
def ctx_set_current(ctx: DriverContext | None) -> None:
    """``cuCtxSetCurrent``: replace the top of the calling thread's stack with `ctx` (push it onto an empty
    one); None unbinds the current context.

    Raises:
        InvalidContextError: not a live context.
    """
    stack = _state.stack
    if ctx is None:
        if stack:
            stack.pop()
        return
    _state.check_live(ctx)
    if stack:
        stack[-1] = ctx
    else:
        stack.append(ctx)


@_driver()
def ctx_get_current() -> DriverContext | None:
    """``cuCtxGetCurrent``: the calling thread's current context, or None."""
    stack = _state.stack
    return stack[-1] if stack else None


@_driver()
def ctx_get_device() -> int:
    """``cuCtxGetDevice``: the device of the current context.

    Raises:
        InvalidContextError: no context is current.
    """
    return _state.current().device


@_driver()
def ctx_synchronize() -> None:
    """``cuCtxSynchronize``: wait for the current context's work; raises its pending errors.

    Raises:
        InvalidContextError: no context is current. ContextIsDestroyedError: it was destroyed.
    """
    _current().synchronize()


@_driver()
def device_primary_ctx_retain(dev: int) -> DriverContext:
    """``cuDevicePrimaryCtxRetain``: `dev`'s primary context, one reference more (the first opens it). It is
    not made current: push or set it."""
    return _state.retain(_state.check_device(dev))


@_driver()
def device_primary_ctx_release(dev: int) -> None:
    """``cuDevicePrimaryCtxRelease``: one reference less; with the last, its memory, streams and events go.

    Raises:
        InvalidContextError: the primary context is not retained.
    """
    _state.release(_state.check_device(dev))


@_driver()
def device_primary_ctx_reset(dev: int) -> None:
    """``cuDevicePrimaryCtxReset``: free everything the primary context holds now; its references stay."""
    _state.reset(_state.check_device(dev))


@_driver()
def device_primary_ctx_get_state(dev: int) -> tuple[int, bool]:
    """``cuDevicePrimaryCtxGetState``: (flags, active)."""
    entry = _state.primary(_state.check_device(dev))
    return entry.context.flags, entry.refs > 0


# -- memory, streams, events and launches in the current context ------------------------------------------
def _current() -> Context:
    return _state.current().runtime


def _own(ptr: Any, connection: Context) -> Any:
    """`ptr` if nothing says it is another context's."""
    if isinstance(ptr, DevicePointer) and ptr.ctx is not None and ptr.ctx is not connection:
        raise InvalidValueError(f"{ptr!r} belongs to another context")
    return ptr


def _stream(stream: Stream | int | None, connection: Context) -> Stream | None:
    if stream is None or (type(stream) is int and stream == 0):
        return None  # the context's NULL stream
    if not isinstance(stream, Stream) or stream.ctx is not connection:
        raise InvalidResourceHandleError(f"{brief(stream, 40)} is not a stream of the current context")
    return stream


@_driver()
def mem_alloc(bytesize: int) -> DevicePointer:
    """``cuMemAlloc``: `bytesize` bytes of the current context's device memory.

    Raises:
        InvalidValueError: `bytesize` is 0 or not a byte count. OutOfMemoryError: no room.
    """
    if type(bytesize) is not int or bytesize <= 0:
        raise InvalidValueError(f"cuMemAlloc of {brief(bytesize, 20)} bytes")
    return _current().malloc(bytesize)  # type: ignore[no-any-return]


@_driver()
def mem_free(dptr: DevicePointer | int) -> None:
    """``cuMemFree``: the allocation based at `dptr`, once the current context's work is done with it.

    Raises:
        InvalidValueError: not the base of a live allocation of the current context.
    """
    connection = _current()
    connection.free(_own(dptr, connection))


@_driver()
def mem_get_info() -> tuple[int, int]:
    """``cuMemGetInfo``: (free, total) bytes, as the current context sees them."""
    return _current().mem_get_info()  # type: ignore[no-any-return]


@_driver()
def memcpy_htod(dst_device: DevicePointer | int, src_host: Any) -> None:
    """``cuMemcpyHtoD``: the bytes of `src_host` to `dst_device`, synchronously."""
    connection = _current()
    connection.memcpy_htod(_own(dst_device, connection), src_host)


@_driver()
def memcpy_dtoh(dst_host: Any, src_device: DevicePointer | int) -> None:
    """``cuMemcpyDtoH``: ``len(dst_host)`` bytes from `src_device`, synchronously."""
    connection = _current()
    connection.memcpy_dtoh(dst_host, _own(src_device, connection))


@_driver()
def memcpy_htod_async(dst_device: DevicePointer | int, src_host: Any, stream: Stream | int | None) -> None:
    """``cuMemcpyHtoDAsync``: as `memcpy_htod`, in `stream`'s order."""
    connection = _current()
    connection.memcpy_htod(_own(dst_device, connection), src_host, _stream(stream, connection))


@_driver()
def memcpy_dtoh_async(dst_host: Any, src_device: DevicePointer | int, stream: Stream | int | None) -> None:
    """``cuMemcpyDtoHAsync``: as `memcpy_dtoh`, in `stream`'s order (into a pinned `HostBuffer`, when it runs)."""
    connection = _current()
    connection.memcpy_dtoh(dst_host, _own(src_device, connection), _stream(stream, connection))


@_driver()
def memcpy_dtod(dst_device: DevicePointer | int, src_device: DevicePointer | int, byte_count: int) -> None:
    """``cuMemcpyDtoD``: `byte_count` bytes between two addresses of the current context."""
    connection = _current()
    connection.memcpy_dtod(_own(dst_device, connection), _own(src_device, connection), byte_count)


@_driver()
def memset_d8(dst_device: DevicePointer | int, uc: int, n: int) -> None:
    """``cuMemsetD8``: `n` bytes at `dst_device` set to `uc`, in the NULL stream's order."""
    connection = _current()
    if type(uc) is not int or not 0 <= uc <= 0xFF:
        raise InvalidValueError(f"cuMemsetD8's value {brief(uc, 20)} is not an unsigned char")
    connection.memset(_own(dst_device, connection), uc, n)


@_driver()
def stream_create(flags: int = CU_STREAM_DEFAULT, priority: int = 0) -> Stream:
    """``cuStreamCreate`` (``cuStreamCreateWithPriority`` with `priority`): a stream of the current context.

    Raises:
        InvalidValueError: flags other than CU_STREAM_DEFAULT and CU_STREAM_NON_BLOCKING.
    """
    check_flags(flags, CU_STREAM_NON_BLOCKING, "cuStreamCreate")
    return _current().create_stream(priority, bool(flags & CU_STREAM_NON_BLOCKING))  # type: ignore[no-any-return]


def _live_stream(stream: object) -> Stream:
    if not isinstance(stream, Stream) or stream.ctx.closed:  # type: ignore[attr-defined]
        raise InvalidResourceHandleError(f"{brief(stream, 40)} is not a live stream")
    return stream


@_driver()
def stream_synchronize(stream: Stream | int | None) -> None:
    """``cuStreamSynchronize``: wait for the work queued on `stream`, from any thread whatever is current to it;
    None (or 0), the current context's NULL stream.

    Raises:
        InvalidHandleError: not a stream of a live context. InvalidContextError: None with no current context.
    """
    if stream is None or (type(stream) is int and stream == 0):
        connection = _current()
        connection._drive(connection._core.invoke(Calls.stream_synchronize, None))
    else:
        _live_stream(stream).synchronize()


@_driver()
def stream_destroy(stream: Stream) -> None:
    """``cuStreamDestroy``: work already queued on it still runs."""
    _live_stream(stream).destroy()


@_driver()
def event_create(flags: int = CU_EVENT_DEFAULT) -> Event:
    """``cuEventCreate``: an event of the current context. CU_EVENT_BLOCKING_SYNC is taken and changes nothing
    (waits block as the context's flags say).

    Raises:
        InvalidValueError: unknown flags, or CU_EVENT_INTERPROCESS without CU_EVENT_DISABLE_TIMING.
    """
    check_flags(flags, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS, "cuEventCreate")
    if flags & CU_EVENT_INTERPROCESS and not flags & CU_EVENT_DISABLE_TIMING:
        raise InvalidValueError("CU_EVENT_INTERPROCESS needs CU_EVENT_DISABLE_TIMING")
    return _current().create_event(bool(flags & CU_EVENT_DISABLE_TIMING),  # type: ignore[no-any-return]
                                   bool(flags & CU_EVENT_INTERPROCESS))


def _live_event(event: object) -> Event:
    if not isinstance(event, Event) or event.ctx.closed:  # type: ignore[attr-defined]
        raise InvalidResourceHandleError(f"{brief(event, 40)} is not a live event")
    return event


@_driver()
def event_record(event: Event, stream: Stream | int | None = None) -> None:
    """``cuEventRecord``: record `event` in `stream` (its context's NULL stream for None or 0).

    Raises:
        InvalidHandleError: the stream is not of the event's context.
    """
    event = _live_event(event)
    event.record(_stream(stream, event.ctx))  # type: ignore[arg-type]


@_driver()
def event_synchronize(event: Event) -> None:
    """``cuEventSynchronize``: wait for the event's latest record."""
    _live_event(event).synchronize()


@_driver()
def event_elapsed_time(start: Event, end: Event) -> float:
    """``cuEventElapsedTime``: milliseconds between the two records.

    Raises:
        InvalidHandleError: events of two contexts, timing disabled, or never recorded. NotReadyError: a record
            has not completed.
    """
    start, end = _live_event(start), _live_event(end)
    if start.ctx is not end.ctx:
        raise InvalidResourceHandleError("the two events belong to different contexts")
    return float(start.elapsed_ms(end))


@_driver()
def event_destroy(event: Event) -> None:
    """``cuEventDestroy``."""
    _live_event(event).destroy()


# cuFuncGetAttribute's attributes (CUfunction_attribute's numbers), by the declared kernel's figures.
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES = 2
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_PTX_VERSION = 5
CU_FUNC_ATTRIBUTE_BINARY_VERSION = 6
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_FUNC_ATTRIBUTES = {
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: "max_threads_per_block",
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: "shared_size_bytes",
    CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES: "const_size_bytes",
    CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: "local_size_bytes",
    CU_FUNC_ATTRIBUTE_NUM_REGS: "num_regs",
    CU_FUNC_ATTRIBUTE_PTX_VERSION: "ptx_version",
    CU_FUNC_ATTRIBUTE_BINARY_VERSION: "binary_version",
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: "max_dynamic_shared_size_bytes",
}


@_driver()
def module_load(fname: str | os.PathLike[str]) -> Module:
    """``cuModuleLoad``: the module at `fname` in the current context. On the daemon's side, as its
    --module-path allows (a module's code runs there): an absolute path within one of its directories, a path
    relative to them, or a module's name (``"matmul"`` for matmul.py).

    Raises:
        FileNotFoundError (KernelFileNotFoundError, CUDA_ERROR_FILE_NOT_FOUND): no such file within the daemon's
            --module-path. InvalidImageError: the file is no module (the reason). InvalidContextError: no
            context is current.
    """
    return _current()._drive(_modules.load(_current(), os.fspath(fname), runtime=False))  # type: ignore[no-any-return]


@_driver()
def module_unload(hmod: Module) -> None:
    """``cuModuleUnload``.

    Raises:
        InvalidHandleError: not a module loaded in the current context.
    """
    connection = _current()
    if not isinstance(hmod, Module) or hmod.ctx is not connection:
        raise InvalidResourceHandleError(f"{brief(hmod, 40)} is not a module of the current context")
    connection._drive(_modules.unload(connection, hmod))


@_driver()
def module_get_function(hmod: Module, name: str) -> Function:
    """``cuModuleGetFunction``: the kernel `name` of `hmod`.

    Raises:
        NotFoundError: no such kernel in it (CUDA_ERROR_NOT_FOUND). InvalidHandleError: not a loaded module.
    """
    if not isinstance(hmod, Module):
        raise InvalidResourceHandleError(f"{brief(hmod, 40)} is not a module")
    return hmod.get_function(name)


@_driver()
def func_get_attribute(attrib: int, hfunc: Function | str) -> int:
    """``cuFuncGetAttribute``: one of the ``CU_FUNC_ATTRIBUTE_*`` constants of this module, for a module's
    function or a built-in kernel (by its name), as the kernel's declaration gives them.

    Raises:
        InvalidValueError: an attribute mpsd does not report. InvalidHandleError: no such function.
    """
    key = _FUNC_ATTRIBUTES.get(attrib) if type(attrib) is int else None
    if key is None:
        raise InvalidValueError(f"function attribute {brief(attrib, 20)} is not one mpsd reports")
    connection = hfunc.ctx if isinstance(hfunc, Function) else _current()
    return int(connection._drive(_modules.attributes(connection, hfunc))[key])


@_driver()
def occupancy_max_active_blocks_per_multiprocessor(func: Function | str, block_size: int,
                                                    dynamic_smem_size: int) -> int:
    """``cuOccupancyMaxActiveBlocksPerMultiprocessor``: blocks of `block_size` threads of `func` with
    `dynamic_smem_size` bytes of dynamic shared memory one SM holds at once.

    Raises:
        InvalidHandleError: no such function. InvalidValueError: a bad block or shared memory size.
    """
    connection = func.ctx if isinstance(func, Function) else _current()
    return int(connection._drive(_modules.occupancy(connection, func, block_size, dynamic_smem_size)))


@_driver()
def launch_kernel(f: Function | str, grid_dim_x: int, grid_dim_y: int, grid_dim_z: int, block_dim_x: int,
                  block_dim_y: int, block_dim_z: int, shared_mem_bytes: int, h_stream: Stream | int | None,
                  kernel_params: list[Any] | tuple[Any, ...], extra: None = None) -> None:
    """``cuLaunchKernel`` of `f` (a module's `Function`, or a kernel's name: a built-in's, or "module.kernel")
    in the current context; fire-and-forget (errors of its execution surface at the next synchronising call).

    Raises:
        InvalidHandleError: no such kernel, a function of another context, or a stream of another context.
        InvalidValueError: a bad grid or block, wrong arguments, `extra` given, or a pointer of another context.
    """
    connection = _current()
    if isinstance(f, Function):
        if f.ctx is not connection:
            raise InvalidResourceHandleError(f"{f!r} is a function of another context")
        f = f.name
    if extra is not None:
        raise InvalidValueError("cuLaunchKernel's extra is not supported: pass kernel_params")
    if not isinstance(kernel_params, (list, tuple)):
        raise InvalidValueError(f"kernel_params {brief(kernel_params, 40)} is not a list")
    args = [_own(arg, connection) for arg in kernel_params]
    connection.launch(f, (grid_dim_x, grid_dim_y, grid_dim_z), (block_dim_x, block_dim_y, block_dim_z), args,
                      _stream(h_stream, connection), shared_mem_bytes)


# -- errors -----------------------------------------------------------------------------------------------
def get_error_name(error: int) -> str:
    """``cuGetErrorName``: e.g. ``"CUDA_ERROR_INVALID_CONTEXT"`` for 201."""
    return driver_error_name(error)


def get_error_string(error: int) -> str:
    """``cuGetErrorString``: the driver's message for the code."""
    return driver_error_string(error)


__all__ = [
    "CU_CTX_FLAGS", "CU_EVENT_BLOCKING_SYNC", "CU_EVENT_DEFAULT", "CU_EVENT_DISABLE_TIMING", "CU_EVENT_INTERPROCESS",
    "CU_STREAM_DEFAULT", "CU_STREAM_NON_BLOCKING", "CudaError", "DriverContext",
    "Function", "Module", "func_get_attribute", "module_get_function", "module_load", "module_unload",
    "occupancy_max_active_blocks_per_multiprocessor",
    "ctx_create", "ctx_destroy", "ctx_get_current", "ctx_get_device", "ctx_pop_current", "ctx_push_current",
    "ctx_set_current", "ctx_synchronize", "device_get", "device_get_attribute", "device_get_count",
    "device_get_name", "device_primary_ctx_get_state", "device_primary_ctx_release", "device_primary_ctx_reset",
    "device_primary_ctx_retain", "event_create", "event_destroy", "event_elapsed_time", "event_record",
    "event_synchronize", "get_error_name", "get_error_string", "init", "launch_kernel", "mem_alloc", "mem_free",
    "mem_get_info", "memcpy_dtod", "memcpy_dtoh", "memcpy_dtoh_async", "memcpy_htod", "memcpy_htod_async",
    "memset_d8", "stream_create", "stream_destroy", "stream_synchronize",
] + [name for name in globals() if name.startswith(("CU_DEVICE_ATTRIBUTE_", "CU_FUNC_ATTRIBUTE_"))] + list(
    DRIVER_ALIASES) + [cls.__name__ for cls in ERROR_CLASSES.values()]
