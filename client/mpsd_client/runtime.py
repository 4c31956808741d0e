"""The runtime flavour as the thin layer over the driver that libcudart is: implicit initialisation, a current
device per thread, and each device's primary context, shared by every thread of the process.

    from mpsd_client import runtime
    runtime.set_device(1)            # cudaSetDevice: device 1's primary context is current to this thread
    p = runtime.malloc(1 << 20)      # cudaMalloc, in the calling thread's current context
    runtime.current().launch("fill_f32", 256, 256, [p, 1.0, 1 << 18])
    runtime.device_reset()           # cudaDeviceReset: the primary context's memory goes, and the runtime's
                                     # reference to it

Each call acts in the calling thread's current context, whoever made it current (a driver user's
`driver.ctx_set_current`, or cudaSetDevice here); with none, it retains and makes current the primary context of
the thread's device, as cudart does. `current()` gives the `Context` of that context: every other runtime call
(streams, events, graphs, IPC, pools) is a method of it. Errors keep the runtime's names (cudaError*).

`mpsd_client.connect()` stays what it was: a context of its own for a process that wants one explicitly.
"""
from __future__ import annotations

from typing import Any

from ._contexts import _state
from ._objects import DevicePointer
from ._sync import Context


def _init() -> None:
    if not _state.initialized:  # the runtime initialises the driver itself, at its first call
        _state.init(None)


def current() -> Context:
    """The calling thread's current context, as the runtime flavour's `Context`: the top of its driver stack,
    else (after retaining it) its device's primary context, made current.

    Raises:
        MpsConnectionError: no daemon. ContextIsDestroyedError: the current context was destroyed.
    """
    _init()
    stack = _state.stack
    if not stack:
        stack.append(_state.runtime_primary(_state.runtime_device()))
    top = stack[-1]
    if top.primary and _state.primary(top.device).refs == 0:  # released (cudaDeviceReset): cudart starts it again
        _state.runtime_primary(top.device)
    return top.runtime


def get_device_count() -> int:
    """``cudaGetDeviceCount``."""
    _init()
    return _state.device_count


def set_device(device: int) -> None:
    """``cudaSetDevice``: `device`'s primary context becomes the calling thread's current context (it replaces
    the top of the thread's stack, as cuCtxSetCurrent would).

    Raises:
        InvalidDeviceError: no such device.
    """
    _init()
    _state.check_device(device)
    _state.set_runtime_device(device)
    ctx = _state.runtime_primary(device)
    stack = _state.stack
    if stack:
        stack[-1] = ctx
    else:
        stack.append(ctx)


def get_device() -> int:
    """``cudaGetDevice``: the device of the calling thread's current context (its cudaSetDevice choice while
    none is current)."""
    _init()
    stack = _state.stack
    return stack[-1].device if stack else _state.runtime_device()


def malloc(nbytes: int) -> DevicePointer:
    """``cudaMalloc`` in the calling thread's current context (see `Context.malloc`)."""
    return current().malloc(nbytes)  # type: ignore[no-any-return]


def free(ptr: DevicePointer | int) -> Any:
    """``cudaFree`` in the calling thread's current context (see `Context.free`)."""
    return current().free(ptr)


def device_synchronize() -> Any:
    """``cudaDeviceSynchronize`` of the calling thread's current context."""
    return current().synchronize()


def device_reset() -> None:
    """``cudaDeviceReset``: free everything the current device's primary context holds, now, and release the
    runtime's reference to it; the next runtime call on the device starts it afresh. Contexts made with
    cuCtxCreate are untouched."""
    _init()
    _state.runtime_reset(get_device())


__all__ = ["current", "device_reset", "device_synchronize", "free", "get_device", "get_device_count", "malloc",
           "set_device"]
