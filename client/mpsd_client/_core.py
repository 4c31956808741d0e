# The client's I/O-free core. Every API call is a generator: it yields the messages to send (a Request, to
# which the shell answers with the matching Reply; or a Notification, answered with None) and returns the
# call's result. The blocking `Context` and the trio `AsyncContext` are two small loops that drive these
# generators, so the rules live here once. Requests are built from mpsd_protocol's table of calls (`invoke`):
# the methods here are only the calls where the client does real work (mappings, staging, the objects users
# hold); the others go straight from the API to `invoke`.
#
# Bulk bytes never cross the socket: pinned host buffers are memfds mapped by both sides, and pageable
# copies go through pinned staging buffers taken from a pool (one per call in flight, so concurrent trio
# tasks never share one).
from __future__ import annotations

import ctypes
import fcntl
import itertools
import mmap
import os
import threading
import time
from typing import Any, Generator, overload


from mpsd_protocol import (
    EVENT_HANDLE,
    IPC_FREED,
    POOL_ALLOC,
    POOL_FREE,
    POOL_GRAPH_FREE,
    POOL_RELEASE,
    PROTOCOL_ERROR,
    PROTOCOL_VERSION,
    STREAM_HANDLE,
    Call,
    Calls,
    CudaError,
    InvalidDeviceFunctionError,
    InvalidResourceHandleError,
    InvalidValueError,
    MpsRpcFailureError,
    Notification,
    OutOfMemoryError,
    Reply,
    Request,
    brief,
    check_args,
    check_shape,
    close_fds,
    error_from_wire,
    format_size,
)

from ._modules import Function, loaded_modules
from ._objects import DevicePointer, Event, HostBuffer, Stream
from ._pools import ALIGN, RESERVE_STEP, SYNCHRONISING, MemPool, Ordering


class _TakeNotices:
    """What an op yields to have its shell take in, without waiting, the notices the daemon has sent."""

    def __repr__(self) -> str:
        return "TAKE_NOTICES"


TAKE_NOTICES = _TakeNotices()
Op = Generator[Request | Notification | _TakeNotices, Reply | None, Any]
STAGING_SIZE = 8 << 20
CURRENT: Any = object()  # malloc_async's pool: the device's current one
MAX_OPS = 1024  # pool operations that may wait for the next message, at most
_LAUNCH, _PACK_LAUNCH = Calls.launch.name, Calls.launch.pack  # looked up once: every launch uses them


class _Imports:
    """IPC: the handles of this context's allocations, the mappings it opened with the opens of each not yet
    closed (the daemon counts the same), and those whose exporter has let go (the daemon's IPC_FREED notices)."""

    __slots__ = ("handles", "opens", "freed")

    def __init__(self) -> None:
        self.handles: dict[int, bytes] = {}  # allocation base -> its IPC handle
        self.opens: dict[int, int] = {}
        self.freed: set[int] = set()


class _Capture:
    """The captures this context began and has not ended (their streams' handles), and the capture mode of each
    thread that set one (cudaThreadExchangeStreamCaptureMode; the others' is global). While a capture is under
    way every call carries its thread, for the daemon's rules of the thread-local and relaxed modes."""

    __slots__ = ("streams", "modes", "allocs")

    def __init__(self) -> None:
        self.streams: set[int] = set()
        self.modes: dict[int, int] = {}
        # Addresses that graphs' allocation nodes gave (mpsd.runtime.graph_memory): their frees go to the daemon.
        self.allocs: set[int] = set()

    def tag(self, args: dict[str, Any]) -> dict[str, Any]:
        thread = threading.get_ident()
        mode = self.modes.get(thread)
        return {**args, "thread": thread, **({"thread_mode": mode} if mode else {})}


class Core:
    """State and rules of one client connection, without I/O."""

    def __init__(self, device: int, visible: list[int | str] | None, limits: dict[str, Any]) -> None:
        # At most 29 attributes: CPython 3.11 shares an instance dict's keys among instances only up to 30, and
        # past that every attribute load of the object is slower (a launch makes dozens: 1,100 instructions more
        # per launch in bench/daemon_instructions.py's client). Group what is rarely used instead.
        self.device = device
        self.visible = visible
        self.limits = limits
        self._ids = itertools.count(1)
        self.client_id = 0
        self.device_flags = 0  # cudaSetDeviceFlags' (mpsd_client._wait)
        self.server_pid = 0
        self.properties: dict[str, Any] = {}
        self.kernels: dict[str, list[str]] = {}
        self.quotas: dict[str, Any] = {}
        self.last_error: CudaError | None = None
        self.broken: CudaError | None = None  # set when the connection is gone: every later call fails
        self._pinned: dict[int, HostBuffer] = {}  # by id
        self._staging: list[HostBuffer] = []
        # base address -> the mapping of its memfd's pages, where its bytes begin in it, its size
        self._maps: dict[int, tuple[mmap.mmap, int, int]] = {}
        self._imports = _Imports()
        self.capture = _Capture()
        # Stream-ordered allocation (mpsd_client._pools): the pools, the default one first; what each live
        # allocation came from (its pool, segment and rounded size); what is known of order between streams; the
        # pool operations that wait for the next message (the shells send them ahead of it, in one notification).
        self.pools: list[MemPool] = []
        self.current_pool: MemPool | None = None
        self._pool_live: dict[int, tuple[MemPool, Any, int, int]] = {}  # addr -> pool, segment, size, nbytes
        self.ordering = Ordering()
        self._ops: list[list[Any]] = []
        self._destroyed: set[int] = set()  # streams destroyed (their handles are never given out again)
        self._shapes: dict[tuple[Any, Any, Any], tuple[tuple[int, int, int], tuple[int, int, int]]] = {}
        # The daemon's clock: "wall" (simulated time = (monotonic - origin) x time_scale) or "virtual" (this
        # client's simulated host clock lives in the daemon; `measure` says whether to report our CPU time).
        self.clock_kind = "wall"
        self.time_scale = 1.0
        self.origin = 0.0
        self.measure = False
        self._cpu_mark = time.thread_time()

    # -- plumbing --------------------------------------------------------------------------------------
    def _charge(self, args: dict[str, Any]) -> dict[str, Any]:
        """Under ``--host-time measured``: the thread CPU time spent since our last call, with the call; while a
        capture is under way, the calling thread."""
        if self.capture.streams:
            args = self.capture.tag(args)
        if not self.measure:
            return args
        now = time.thread_time()
        spent, self._cpu_mark = now - self._cpu_mark, now
        return {**args, "host_time": spent}

    def _request(self, op: str, args: dict[str, Any], fds: tuple[int, ...]) -> Op:
        """Send a request; its Reply, whose fds are the caller's to close."""
        if self.broken is not None:
            raise self.broken
        reply = yield Request(next(self._ids) & 0xFFFFFFFF, op, self._charge(args), fds)  # ids wrap at 32 bits
        assert isinstance(reply, Reply)
        if reply.error is not None:
            close_fds(reply.fds)
            raise error_from_wire(reply.error)
        return reply

    def call(self, op: str, args: dict[str, Any], fds: tuple[int, ...] = ()) -> Op:
        """Any request, its argument map as given: the handshake's, and tests' of what the daemon does with
        anything. Calls of the table go through `invoke`."""
        reply = yield from self._request(op, args, fds)
        close_fds(reply.fds)
        return reply.result

    def invoke(self, call: Call, *values: Any, fds: tuple[int, ...] = ()) -> Op:
        """The call of `call`, a row of mpsd_protocol's table (Calls), its arguments in the row's order (streams
        and events as the objects users hold), checked against the row. Returns its result, checked too; for a
        call whose reply carries fds, (result, fds), the fds the caller's to close.

        Raises:
            InvalidValueError: an argument of the wrong kind; InvalidResourceHandleError: a stream or event
                of another context.
            MpsRpcFailureError: the daemon's reply is not what the row says.
        """
        name = call.name
        args = call.encode([self._stream(v) if arg.kind is STREAM_HANDLE else self._event(v)
                            if arg.kind is EVENT_HANDLE else v for arg, v in zip(call.args, values)])
        reply = yield from self._request(name, args, fds)
        if len(reply.fds) != call.reply_fds or not call.reply.accepts(reply.result):
            close_fds(reply.fds)
            raise MpsRpcFailureError(f"the daemon answered {name} with {brief(reply.result, 60)} and "
                                     f"{len(reply.fds)} file descriptors, not {call.reply.what} and {call.reply_fds}")
        if call is Calls.destroy_stream:
            self._destroyed.add(args["stream"])
            self.capture.streams.discard(args["stream"])  # its capture ends with it
        if self.pools:
            self.ordering.observe(call, args)
            if call in SYNCHRONISING:  # pools give back what is past their release threshold
                for pool in self.pools:
                    self._release(pool.unused(pool.release_threshold, threshold=True))
                yield from self._flush()
        return (reply.result, reply.fds) if call.reply_fds else reply.result

    # -- pool operations that wait for the next message ---------------------------------------------------
    # One notification carries every stream-ordered allocation, free and release made since the client's last
    # message, in order: the daemon then pays for one message, not two per pair (mpsd_protocol's row says why).
    def take_notes(self) -> list[Notification]:
        """The shells' side: the notifications to send ahead of the message they send now."""
        if not self._ops:
            return []
        ops, self._ops = self._ops, []
        return [Notification(Calls.mem_pool_ops.name, Calls.mem_pool_ops.encode((ops,)))]

    def _flush(self) -> Op:
        notes = self.take_notes()
        if notes:
            yield notes[0]

    def _release(self, bases: list[int]) -> None:
        self._ops.extend([POOL_RELEASE, base] for base in bases)

    def notification_received(self, note: Notification | Request) -> None:
        """The daemon told us something unasked: that an IPC mapping's exporter let go of it, or that it is
        closing us for a protocol error."""
        if note.op == IPC_FREED:
            ptr = note.args.get("ptr") if isinstance(note.args, dict) else None
            if type(ptr) is int and ptr in self._imports.opens:
                self._imports.freed.add(ptr)
        elif note.op == PROTOCOL_ERROR:
            message = note.args.get("message") if isinstance(note.args, dict) else None
            self.broken = MpsRpcFailureError(f"the daemon closed the connection: {message}")
            raise self.broken

    def connection_lost(self, why: str) -> CudaError:
        self.broken = self.broken or MpsRpcFailureError(why)
        return self.broken

    @overload
    def _stream(self, ctx_stream: None) -> None: ...
    @overload
    def _stream(self, ctx_stream: Stream) -> int: ...
    def _stream(self, ctx_stream: Stream | None) -> int | None:
        if ctx_stream is None:
            return None
        if not isinstance(ctx_stream, Stream) or ctx_stream.ctx._core is not self:
            raise InvalidResourceHandleError(f"{brief(ctx_stream, 40)} is not a stream of this context")
        return ctx_stream.handle

    def _pool_stream(self, stream: Stream | None) -> int:
        """A stream's key for the pools (0: the legacy default stream). A pool's host call knows at once that a
        stream was destroyed, as CUDA's does (a launch learns it from the daemon, later)."""
        if stream is None:
            return 0
        key = stream.handle if type(stream) is Stream and stream.ctx._core is self else self._stream(stream)
        if key in self._destroyed:
            raise InvalidResourceHandleError(f"stream {key} of this context was destroyed")
        return key

    def _event(self, event: Event) -> int:
        if not isinstance(event, Event) or event.ctx._core is not self:
            raise InvalidResourceHandleError(f"{brief(event, 40)} is not an event of this context")
        return event.handle

    # -- context ---------------------------------------------------------------------------------------
    def hello(self) -> Op:
        result = yield from self.call("hello", {
            "version": PROTOCOL_VERSION, "pid": os.getpid(), "device": self.device, "visible": self.visible,
            "limits": self.limits})
        self.client_id = result["client_id"]
        self.server_pid = result.get("server_pid", 0)
        self.properties = result["properties"]
        self.kernels = result["kernels"]
        self.quotas = result["quotas"]
        clock = result.get("clock") or {}
        self.clock_kind = clock.get("kind", "wall")
        self.time_scale = float(clock.get("time_scale", 1.0))
        self.origin = float(clock.get("origin", 0.0))
        self.measure = self.clock_kind == "virtual" and clock.get("host_time") is not None
        self._cpu_mark = time.thread_time()
        return result

    # -- time --------------------------------------------------------------------------------------------
    def clock(self) -> Op:
        """This client's simulated now, in seconds."""
        if self.clock_kind == "virtual":
            return (yield from self.invoke(Calls.clock))["now"]
        return (time.monotonic() - self.origin) * self.time_scale

    def sleep(self, seconds: float) -> Op:
        """Advance this client's simulated clock by `seconds`; returns the wall seconds the shell must still
        sleep (none under the virtual clock)."""
        Calls.sleep.encode((seconds,))  # its row's check, whichever clock keeps the time
        if self.clock_kind == "virtual":
            yield from self.invoke(Calls.sleep, seconds)
            return 0.0
        return seconds / self.time_scale

    def idle(self) -> Op:
        """Hold the virtual clock no longer until the next call (nothing under the wall clock)."""
        if self.clock_kind == "virtual":
            yield from self.invoke(Calls.idle)

    def device_properties(self) -> Op:
        self.properties = yield from self.invoke(Calls.device_properties)
        return dict(self.properties)

    def mem_get_info(self) -> Op:
        free, total = yield from self.invoke(Calls.mem_get_info)
        return free, total

    def get_last_error(self, clear: bool) -> Op:
        remote = yield from self.invoke(Calls.get_last_error, clear)
        # An error the daemon holds came from fire-and-forget work and was never raised here, so it wins
        # over the last error this side raised.
        error = error_from_wire(remote) if remote else self.last_error
        if clear:
            self.last_error = None
        return error

    # -- memory ----------------------------------------------------------------------------------------
    def malloc(self, ctx: Any, nbytes: int) -> Op:
        addr = yield from self.invoke(Calls.malloc, nbytes)
        return DevicePointer(addr, nbytes, ctx)

    def free(self, ptr: int) -> Op:
        if int(ptr) in self._pool_live or int(ptr) in self.capture.allocs:
            # cudaFree of stream-ordered memory (a pool's or a graph's): freed in order, then synchronised
            self.free_async(ptr, None)
            yield from self.invoke(Calls.synchronize)
            return
        yield from self.invoke(Calls.free, ptr)
        self._unmap(int(ptr))
        self._imports.handles.pop(int(ptr), None)

    # -- the driver's virtual memory (mpsd.runtime.vmm) -----------------------------------------------------
    def mem_unmap(self, ptr: int, size: int) -> Op:
        """cuMemUnmap; host views of the mappings it removes are let go (the same addresses may show other
        memory next)."""
        yield from self.invoke(Calls.mem_unmap, ptr, size)
        for base in [b for b in self._maps if ptr <= b < ptr + size]:
            self._unmap(base)

    # -- stream-ordered allocation (mpsd_client._pools) ---------------------------------------------------
    def default_pool(self, ctx: Any) -> MemPool:
        if not self.pools:
            self.pools.append(MemPool(ctx, default=True))
            self.current_pool = self.pools[0]
        return self.pools[0]

    def current(self, ctx: Any) -> MemPool:
        """The device's current pool (cudaDeviceGetMemPool)."""
        return self.current_pool or self.default_pool(ctx)

    def pool_of(self, ctx: Any, pool: Any) -> MemPool:
        """`pool` if it is a live pool of this context."""
        if not isinstance(pool, MemPool) or pool.ctx._core is not self or pool.destroyed:
            raise InvalidValueError(f"{brief(pool, 40)} is not a memory pool of this context")
        return pool

    def mem_pool_create(self, ctx: Any, location: Any, max_size: Any) -> MemPool:
        if location is not None and location != self.device:
            raise InvalidValueError(f"a pool of this context lives on its device {self.device}, "
                                    f"not {brief(location, 20)}")
        if not isinstance(max_size, int) or isinstance(max_size, bool) or max_size < 0:
            raise InvalidValueError(f"max_size {brief(max_size, 20)} is not a byte count")
        self.default_pool(ctx)
        pool = MemPool(ctx, max_size=max_size)
        self.pools.append(pool)
        return pool

    def _pool_request(self, ctx: Any, nbytes: Any, stream: Stream | None, pool: Any) -> tuple[MemPool, int]:
        key = self._pool_stream(stream)
        pool = self.current(ctx) if pool is CURRENT else self.pool_of(ctx, pool)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes < 2**63:
            raise InvalidValueError(f"malloc_async size {brief(nbytes, 40)} is not a byte count")
        return pool, key

    def _hand_out(self, ctx: Any, pool: MemPool, key: int, nbytes: int) -> DevicePointer | None:
        """`nbytes` from what `pool` holds for stream `key`, or None if it must grow."""
        size = -(-nbytes // ALIGN) * ALIGN
        found = pool.take(size, nbytes, key, self.ordering)
        if found is None:
            return None
        addr, segment, after = found
        self._pool_live[addr] = (pool, segment, size, nbytes)
        self._ops.append([POOL_ALLOC, addr, nbytes, key, after])
        return DevicePointer(addr, nbytes, ctx)

    def malloc_async_now(self, ctx: Any, nbytes: int, stream: Stream | None, pool: Any) -> DevicePointer | None:
        """The blocking shell's fast path: `malloc_async` where it needs no message (None: it does)."""
        if len(self._ops) >= MAX_OPS or (self.capture.streams and stream is not None):
            return None
        pool, key = self._pool_request(ctx, nbytes, stream, pool)
        return DevicePointer(0, 0, ctx) if nbytes == 0 else self._hand_out(ctx, pool, key, nbytes)

    def malloc_async(self, ctx: Any, nbytes: int, stream: Stream | None, pool: Any) -> Op:
        """``cudaMallocFromPoolAsync``: an address from the pool's reservations; a round trip only to grow it.
        While a capture of this context is under way, the daemon is asked first whether the stream captures: then
        the allocation is a memory node of the capture's graph, its address the graph's (not the pool's)."""
        pool, key = self._pool_request(ctx, nbytes, stream, pool)
        if self.capture.streams and stream is not None and nbytes:
            addr = yield from self.invoke(Calls.graph_mem_alloc, nbytes, stream)
            if addr:
                self.capture.allocs.add(addr)
                return DevicePointer(addr, nbytes, ctx)
        if nbytes == 0:
            return DevicePointer(0, 0, ctx)
        ptr = self._hand_out(ctx, pool, key, nbytes)
        if ptr is None:
            grow = -(-(-(-nbytes // ALIGN) * ALIGN) // RESERVE_STEP) * RESERVE_STEP
            if pool.max_size and pool.reserved + grow > pool.max_size:
                raise OutOfMemoryError(f"the pool's max_size of {pool.max_size} bytes has no room for {nbytes} more")
            pool.add((yield from self.invoke(Calls.mem_pool_reserve, grow)), grow)
            ptr = self._hand_out(ctx, pool, key, nbytes)
            assert ptr is not None, "a fresh reservation fits what it was made for"
        if len(self._ops) >= MAX_OPS:
            yield from self._flush()
        return ptr

    def free_async(self, ptr: Any, stream: Stream | None) -> None:
        """``cudaFreeAsync``: the bytes go back to their pool in `stream`'s order (no I/O: the daemon hears of it
        with the next message)."""
        key = self._pool_stream(stream)
        addr = _address(ptr)
        if addr == 0:
            return
        found = self._pool_live.pop(addr, None)
        if found is None and addr in self.capture.allocs:  # a graph's: the daemon has its rules
            self._ops.append([POOL_GRAPH_FREE, addr, key])
            return
        if found is None:
            raise InvalidValueError(f"{addr:#x} is not a live stream-ordered allocation of this context (freed "
                                    "already, or from malloc)")
        pool, segment, size, nbytes = found
        pool.give_back(segment, addr, size, nbytes, key, self.ordering.freed(key))
        self._ops.append([POOL_FREE, addr, key])
        if pool.destroyed and segment.live == 0:
            self._release(pool.unused(0))

    def mem_pool_trim_to(self, pool: MemPool, keep: Any) -> Op:
        pool = self.pool_of(pool.ctx, pool)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise InvalidValueError(f"trim_to takes a byte count, not {brief(keep, 20)}")
        self._release(pool.unused(keep))
        yield from self._flush()

    def mem_pool_destroy(self, pool: MemPool) -> Op:
        pool = self.pool_of(pool.ctx, pool)
        if pool.default:
            raise InvalidValueError("a device's default memory pool cannot be destroyed")
        pool.destroyed = True
        self.pools.remove(pool)
        if self.current_pool is pool:
            self.current_pool = self.pools[0]
        self._release(pool.unused(0))
        yield from self._flush()

    # -- mappings of device memory in this process (host_view, IPC) ------------------------------------
    def _map(self, base: int, size: int, fd: int, offset: int) -> memoryview:
        """Map the pages of `fd` that hold `size` bytes from `offset` (a small allocation's memfd is its
        2 MiB chunk's, shared with its neighbours), and view those bytes."""
        page = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            mapping = mmap.mmap(fd, offset + size - page, offset=page) if size else mmap.mmap(-1, 1)
        finally:
            os.close(fd)
        self._maps[base] = (mapping, offset - page, size)
        return memoryview(mapping)[offset - page:offset - page + size]

    def _unmap(self, base: int) -> None:
        entry = self._maps.pop(base, None)
        if entry is not None:
            try:
                entry[0].close()
            except BufferError:
                pass  # the user still holds a view; the mapping goes with it

    def host_view(self, ptr: int) -> Op:
        """A writable memoryview of the device bytes from `ptr` to the end of its allocation: the same
        memory the daemon's kernels and copies use, mapped from its memfd."""
        addr = _address(ptr)
        view = yield from self._host_view(addr)
        pooled = self._pool_live.get(addr)
        return view[:pooled[2]] if pooled else view  # a pool's allocation ends where its bytes do

    def _host_view(self, addr: int) -> Op:
        for base, (mapping, start, size) in self._maps.items():
            if base <= addr < base + size:
                return memoryview(mapping)[start + addr - base:start + size]
        found, fds = yield from self.invoke(Calls.mem_fd, addr)
        base, size = found["base"], found["size"]
        return self._map(base, size, fds[0], found.get("offset", 0))[addr - base:]

    def ipc_get_mem_handle(self, ptr: int) -> Op:
        addr = _address(ptr)
        handles = self._imports.handles
        handle = handles.get(addr)
        if handle is None:  # one allocation has one handle: ask once (free forgets it)
            handle = handles[addr] = yield from self.invoke(Calls.ipc_get_mem_handle, addr)
        return handle

    def ipc_open_mem_handle(self, ctx: Any, handle: bytes, flags: int) -> Op:
        mapping, fds = yield from self.invoke(Calls.ipc_open_mem_handle, handle, flags)
        ptr, size = mapping["ptr"], mapping["size"]
        if ptr in self._maps or not mapping.get("mappable", True):
            # Opened before (the same mapping, one more reference), or a real GPU's memory, which the host
            # cannot map: then the pointer works in calls but has no host_view.
            os.close(fds[0])
        else:
            self._map(ptr, size, fds[0], mapping.get("offset", 0))
        opens = self._imports.opens
        opens[ptr] = opens.get(ptr, 0) + 1
        return DevicePointer(ptr, size, ctx)

    def ipc_close_mem_handle(self, ptr: int) -> Op:
        addr = _address(ptr)
        imports = self._imports
        if addr not in imports.opens:
            raise InvalidValueError(f"{addr:#x} is not a pointer opened from an IPC handle in this context")
        # The daemon serves this client's messages in order, so the pointer is invalid for every later call either
        # way, as cudaIpcCloseMemHandle promises, and the bytes stay for the work queued before the close. As CUDA
        # says, a close leaves the exporter's allocation and other processes' mappings as they were: it is this
        # context's business alone, a notification. Except for the last close of memory whose exporter has freed
        # it already, which frees what other processes see (its charge, its range): that one is a request, so
        # that it has happened when the call returns, whatever this process tells others next. The daemon tells
        # importers when an exporter lets go before it answers the exporter (IPC_FREED), so once this process
        # has taken in what has come (TAKE_NOTICES), a free it can know of is known here.
        call = Calls.ipc_close_mem_handle
        args = call.encode((addr,))
        last = imports.opens[addr] == 1
        if last:
            yield TAKE_NOTICES
        if last and addr in imports.freed:
            yield from self._request(call.name, args, ())
        else:
            yield Notification(call.name, self._charge(args))
        left = imports.opens.pop(addr) - 1
        if left:
            imports.opens[addr] = left
        else:
            imports.freed.discard(addr)
            self._unmap(int(ptr))

    def ipc_open_event_handle(self, ctx: Any, handle: bytes) -> Op:
        handle_id = yield from self.invoke(Calls.ipc_open_event_handle, handle)
        return Event(ctx, handle_id, True, True)

    def host_alloc(self, nbytes: int) -> Op:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidValueError(f"host_alloc size {brief(nbytes, 40)} is not a positive byte count")
        fd = os.memfd_create("mpsd-host", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            # Pinned memory is resident, as cudaHostAlloc's page-locked pages are: its pages are this process's
            # from the start, never ones the daemon's copies fault in.
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise OutOfMemoryError(f"cannot pin {format_size(nbytes)} of host memory: {exc.strerror}") from None
            # The daemon maps only buffers that cannot shrink under it.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            buffer = HostBuffer(fd, nbytes)
            buffer.id = yield from self.invoke(Calls.host_register, nbytes, fds=(fd,))
        finally:
            os.close(fd)  # the mappings on both sides keep the memory
        buffer.nbytes = nbytes
        buffer.base_address = _address_of(memoryview(buffer))
        self._pinned[buffer.id] = buffer
        return buffer

    def free_host(self, buffer: HostBuffer) -> Op:
        number: int | None = getattr(buffer, "id", None)  # (a mapping not made by host_alloc has none)
        if not isinstance(buffer, HostBuffer) or number is None or self._pinned.get(number) is not buffer:
            raise InvalidValueError(f"{brief(buffer, 40)} is not a host buffer of this context")
        del self._pinned[buffer.id]
        yield from self.invoke(Calls.host_unregister, buffer.id)
        try:
            buffer.close()
        except BufferError:
            pass  # the user still holds a view; the mapping goes with it

    def _find_pinned(self, view: memoryview) -> tuple[HostBuffer, int] | None:
        address = _address_of(view)
        for buffer in self._pinned.values():
            offset = address - buffer.base_address
            if 0 <= offset and offset + len(view) <= buffer.nbytes:
                return buffer, offset
        return None

    def _acquire_staging(self) -> Op:
        if self._staging:
            return self._staging.pop()
        return (yield from self.host_alloc(STAGING_SIZE))

    def memcpy_htod(self, dst: int, src: Any, stream: Stream | None) -> Op:
        view = _bytes_view(src, writable=False)
        dst_addr, nbytes = _address(dst), len(view)
        self._stream(stream)  # before any bytes are staged
        if nbytes == 0:
            return
        pinned = self._find_pinned(view)
        if pinned is not None:
            yield from self.invoke(Calls.memcpy_htod, dst_addr, pinned[0].id, pinned[1], nbytes, stream, False)
            return
        staging = yield from self._acquire_staging()
        try:
            for start in range(0, nbytes, STAGING_SIZE):
                chunk = view[start:start + STAGING_SIZE]
                staging[:len(chunk)] = chunk
                yield from self.invoke(Calls.memcpy_htod, dst_addr + start, staging.id, 0, len(chunk), stream, True)
        finally:
            self._staging.append(staging)

    def memcpy_dtoh(self, dst: Any, src: int, stream: Stream | None) -> Op:
        view = _bytes_view(dst, writable=True)
        src_addr, nbytes = _address(src), len(view)
        self._stream(stream)
        if nbytes == 0:
            return
        pinned = self._find_pinned(view)
        if pinned is not None:
            yield from self.invoke(Calls.memcpy_dtoh, pinned[0].id, pinned[1], src_addr, nbytes, stream, False)
            return
        staging = yield from self._acquire_staging()
        try:
            for start in range(0, nbytes, STAGING_SIZE):
                size = min(STAGING_SIZE, nbytes - start)
                yield from self.invoke(Calls.memcpy_dtoh, staging.id, 0, src_addr + start, size, stream, True)
                view[start:start + size] = staging[:size]
        finally:
            self._staging.append(staging)

    # -- streams and events ----------------------------------------------------------------------------
    def create_stream(self, ctx: Any, priority: int, non_blocking: bool) -> Op:
        handle, clamped = yield from self.invoke(Calls.create_stream, priority, 1 if non_blocking else 0)
        return Stream(ctx, handle, clamped, non_blocking)

    def create_event(self, ctx: Any, disable_timing: bool, interprocess: bool) -> Op:
        handle = yield from self.invoke(Calls.create_event, bool(disable_timing), bool(interprocess))
        return Event(ctx, handle, bool(disable_timing), bool(interprocess))

    # -- kernels ---------------------------------------------------------------------------------------
    def launch(self, name: Any, grid: Any, block: Any, args: Any, stream: Stream | None,
               shared_mem: int) -> Notification:
        """The launch notification, validated as cudaLaunchKernel validates (the shape check is cached:
        launches repeat the same shapes). `name` is a kernel's, or a module's `Function` (looked at only once
        no kernel has it as its name, so that a launch by name pays nothing for it)."""
        if self.broken is not None:
            raise self.broken
        params = self.kernels.get(name)
        if params is None:
            if isinstance(name, Function):
                return self.launch(name.name, grid, block, args, stream, shared_mem)
            module, dot, _ = name.partition(".") if type(name) is str else ("", "", "")
            raise InvalidDeviceFunctionError(f"no kernel named {brief(name, 60)}" + (
                f" (no module {brief(module, 40)} is loaded)" if dot and module not in loaded_modules(self) else ""))
        # Only shapes of plain ints are cached: 1.0 and True compare equal to 1 but are not valid.
        key = (grid, block, shared_mem) if _plain(grid) and _plain(block) and type(shared_mem) is int else None
        shape = self._shapes.get(key) if key is not None else None
        if shape is None:
            shape = check_shape(name, grid, block, shared_mem, self.properties)
            if key is not None:
                self._shapes[key] = shape
        return Notification(_LAUNCH, self._charge(_PACK_LAUNCH(
            name, shape[0], shape[1], check_args(name, params, args), shared_mem, self._stream(stream))))


def _plain(value: Any) -> bool:
    return type(value) is int or (type(value) is tuple and all(type(v) is int for v in value))


def _address(ptr: Any) -> int:
    if isinstance(ptr, bool) or not isinstance(ptr, int) or not 0 <= ptr < 2**64:
        raise InvalidValueError(f"{brief(ptr, 40)} is not a device pointer")
    return int(ptr)


def _bytes_view(obj: Any, writable: bool) -> memoryview:
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidValueError(f"{type(obj).__name__} does not support the buffer protocol") from None
    if not view.contiguous:
        raise InvalidValueError("the host buffer must be contiguous")
    if writable and view.readonly:
        raise InvalidValueError("the destination host buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class _PyBuffer(ctypes.Structure):
    # The head of CPython's Py_buffer (its layout is part of the stable ABI): only `buf` is read, the rest is
    # room for PyObject_GetBuffer to fill.
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("rest", ctypes.c_byte * 96)]


def _address_of(view: memoryview) -> int:
    """Where a host buffer's bytes are, read or write alike (ctypes' from_buffer takes only writable ones, and
    numpy for this alone costs a client process 15 MiB)."""
    if len(view) == 0:
        return 0
    raw = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(raw), 0)
    try:
        return int(raw.buf)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(raw))
