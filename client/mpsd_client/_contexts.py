# The driver API's contexts, as one process holds them: whether cuInit has run, each thread's stack of current
# contexts, and each device's primary context with its reference count. Everything here is the process's own
# bookkeeping, as libcuda's is; the daemon sees only connections.
#
# Why a context is a connection: the daemon already gives each connection a sub-context of its own (its
# address space, streams, events, quotas, sticky error, freed as a whole when the connection goes), which is what
# a CUcontext is to a real driver. So an explicit context (cuCtxCreate) opens a connection of its own, and a
# pointer, stream or event of one context means nothing on another's, as on a GPU without peer mappings. A
# device's primary context is one connection shared by every thread and by the runtime flavour
# (mpsd_client.runtime), opened at the first retain and closed when the last reference goes, as CUDA 11+
# destroys a primary context whose count falls to zero (retaining it again gives the same handle, fresh).
#
# Rule: every change to the stacks, the primaries and the init state is made here, under `_lock` where more
# than one thread can see it (the stacks are per thread and need none).
from __future__ import annotations

import os
import threading
from typing import Any

from mpsd_protocol import (
    ContextIsDestroyedError,
    DeviceUninitializedError,
    InitializationError,
    InvalidDeviceError,
    InvalidValueError,
    brief,
)

from ._sync import Context, open_connection

CONNECT_TIMEOUT = 10.0


class DriverContext:
    """A ``CUcontext``: a context on one device, current to any number of threads' stacks.

    Attributes:
        device: the device ordinal (``CUdevice``) it was made on.
        primary: True for a device's primary context (cuDevicePrimaryCtxRetain), False for cuCtxCreate's.
        destroyed: True once cuCtxDestroy has run (never for a primary context).
    """

    __slots__ = ("device", "primary", "destroyed", "flags", "_connection")

    def __init__(self, device: int, primary: bool, flags: int = 0) -> None:
        self.device = device
        self.primary = primary
        self.destroyed = False
        self.flags = flags
        self._connection: Context | None = None

    @property
    def runtime(self) -> Context:
        """The connection behind this context: the runtime-flavour `Context` whose calls act in it.

        Raises:
            ContextIsDestroyedError: cuCtxDestroy destroyed it (it may still be current to some thread).
            DeviceUninitializedError: a primary context whose every reference has been released
                (CUDA_ERROR_INVALID_CONTEXT, 201).
        """
        if self.destroyed:
            raise ContextIsDestroyedError(f"context on device {self.device} was destroyed")
        if self._connection is None:
            if not self.primary:  # pragma: no cover - an explicit context has its connection until destroyed
                raise DeviceUninitializedError("context has no connection")
            _state.reopen_primary(self)
        assert self._connection is not None
        return self._connection

    def __repr__(self) -> str:
        kind = "primary" if self.primary else "destroyed" if self.destroyed else "created"
        return f"<DriverContext {kind} on device {self.device}>"


class _Primary:
    """A device's primary context and how many retains hold it."""

    __slots__ = ("context", "refs")

    def __init__(self, device: int) -> None:
        self.context = DriverContext(device, primary=True)
        self.refs = 0


class _State:
    """The process's driver state: init, device count, primaries, per-thread stacks."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.initialized = False
        self.pipe_dir: str | os.PathLike[str] | None = None
        self.device_count = 0
        self.properties: dict[int, dict[str, Any]] = {}  # by device, read once (cuDeviceGetAttribute)
        self.primaries: dict[int, _Primary] = {}
        self.created: set[DriverContext] = set()  # cuCtxCreate's contexts not yet destroyed
        self.runtime_retained: set[int] = set()  # devices whose primary the runtime flavour holds a reference to
        self._threads = threading.local()

    # -- cuInit and devices -----------------------------------------------------------------------------
    def init(self, pipe_dir: str | os.PathLike[str] | None) -> None:
        """Reach the daemon once, through a connection to device 0 that says how many devices we see."""
        with self._lock:
            if self.initialized:
                return
            probe, hello = open_connection(pipe_dir, 0, CONNECT_TIMEOUT)
            try:
                self.properties[0] = dict(hello["properties"])
                self.device_count = int(hello.get("device_count", 1))
            finally:
                probe.close()
            self.pipe_dir = pipe_dir
            self.initialized = True

    def check_initialized(self) -> None:
        if not self.initialized:
            raise InitializationError("cuInit has not been called")

    def check_device(self, device: object) -> int:
        if type(device) is not int or not 0 <= device < self.device_count:
            raise InvalidDeviceError(f"device {brief(device, 20)} does not exist ({self.device_count} visible)")
        return device

    def device_properties(self, device: int) -> dict[str, Any]:
        """The device's properties as a client of it sees them, asked once through a short-lived connection."""
        with self._lock:
            if device not in self.properties:
                probe, hello = open_connection(self.pipe_dir, device, CONNECT_TIMEOUT)
                probe.close()
                self.properties[device] = dict(hello["properties"])
            return self.properties[device]

    def connect(self, device: int) -> Context:
        return open_connection(self.pipe_dir, device, CONNECT_TIMEOUT)[0]

    # -- the calling thread's stack ----------------------------------------------------------------------
    @property
    def stack(self) -> list[DriverContext]:
        stack = getattr(self._threads, "stack", None)
        if stack is None:
            stack = self._threads.stack = []
        return stack

    def current(self) -> DriverContext:
        """The calling thread's current context.

        Raises:
            DeviceUninitializedError: none is current (CUDA_ERROR_INVALID_CONTEXT).
        """
        stack = self.stack
        if not stack:
            raise DeviceUninitializedError("no context is current to this thread")
        return stack[-1]

    def check_live(self, ctx: object) -> DriverContext:
        """`ctx` if it is a context that can be made current: not destroyed, not a released primary."""
        if not isinstance(ctx, DriverContext) or ctx.destroyed or (
                ctx.primary and self.primaries[ctx.device].refs == 0):
            raise DeviceUninitializedError(f"{brief(ctx, 60)} is not a live context")
        return ctx

    # -- explicit contexts -----------------------------------------------------------------------------
    def create(self, flags: int, device: int) -> DriverContext:
        ctx = DriverContext(device, primary=False, flags=flags)
        ctx._connection = self.connect(device)
        if flags:
            ctx._connection.set_device_flags(flags)
        with self._lock:
            self.created.add(ctx)
        self.stack.append(ctx)  # cuCtxCreate makes the new context current
        return ctx

    def destroy(self, ctx: DriverContext) -> None:
        if ctx.primary:
            raise DeviceUninitializedError("a primary context is released, not destroyed")
        self.check_live(ctx)
        with self._lock:
            self.created.discard(ctx)
            ctx.destroyed = True
            connection, ctx._connection = ctx._connection, None
        stack = self.stack
        if stack and stack[-1] is ctx:  # current to the caller: popped, as cuCtxPopCurrent would
            stack.pop()
        if connection is not None:
            connection.close()  # the daemon frees its memory, streams and events

    # -- primary contexts ------------------------------------------------------------------------------
    def primary(self, device: int) -> _Primary:
        with self._lock:
            entry = self.primaries.get(device)
            if entry is None:
                entry = self.primaries[device] = _Primary(device)
            return entry

    def retain(self, device: int) -> DriverContext:
        with self._lock:
            entry = self.primary(device)
            if entry.refs == 0:
                entry.context._connection = self.connect(device)
            entry.refs += 1
            return entry.context

    def release(self, device: int) -> None:
        with self._lock:
            entry = self.primary(device)
            if entry.refs == 0:
                raise DeviceUninitializedError(f"device {device}'s primary context is not retained")
            entry.refs -= 1
            if entry.refs == 0:
                self._drop(entry.context)

    def reset(self, device: int) -> None:
        """cuDevicePrimaryCtxReset: the primary context's memory, streams and events go now; the references
        stay, and the next use opens it afresh."""
        with self._lock:
            self._drop(self.primary(device).context)

    def reopen_primary(self, ctx: DriverContext) -> None:
        with self._lock:
            if self.primaries[ctx.device].refs == 0:
                raise DeviceUninitializedError(f"device {ctx.device}'s primary context has been released")
            if ctx._connection is None:
                ctx._connection = self.connect(ctx.device)

    # -- the runtime flavour's primaries ---------------------------------------------------------------
    def runtime_device(self) -> int:
        """The calling thread's device as cudaSetDevice chose it (0 until then)."""
        return getattr(self._threads, "device", 0)

    def set_runtime_device(self, device: int) -> None:
        self._threads.device = device

    def runtime_primary(self, device: int) -> DriverContext:
        """`device`'s primary context, retained once for the whole process by the runtime flavour (and again
        after cudaDeviceReset let it go), as cudart retains it at its first call on a device."""
        with self._lock:
            if device not in self.runtime_retained:
                self.retain(device)
                self.runtime_retained.add(device)
            return self.primaries[device].context

    def runtime_reset(self, device: int) -> None:
        """cudaDeviceReset: the primary context's memory, streams and events go now, and the runtime's
        reference with them (a driver user's references stay)."""
        with self._lock:
            self.reset(device)
            if device in self.runtime_retained:
                self.runtime_retained.discard(device)
                self.release(device)

    def _drop(self, ctx: DriverContext) -> None:
        connection, ctx._connection = ctx._connection, None
        if connection is not None:
            connection.close()

    def forget(self) -> None:
        """Close every context and return to the state before cuInit (for a process that starts over, as a
        test does; CUDA has no such call)."""
        with self._lock:
            for entry in self.primaries.values():
                self._drop(entry.context)
                entry.refs = 0
            for ctx in list(self.created):
                ctx.destroyed = True
                self._drop(ctx)
            self.__init__()  # type: ignore[misc]


def check_flags(flags: object, allowed: int, what: str) -> int:
    """`flags` if it is an int with no bits outside `allowed` (CUDA_ERROR_INVALID_VALUE otherwise)."""
    if type(flags) is not int or flags < 0 or flags & ~allowed:
        raise InvalidValueError(f"{what} flags {brief(flags, 20)} are not valid")
    return flags


_state = _State()
