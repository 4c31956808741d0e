# The calls: one row per CUDA runtime call that crosses the socket, read by both ends. The daemon's session
# dispatches from the row (its arguments checked here, then its handler) and the client core builds its request
# from the same row, so a new call is one row and the two halves cannot drift apart. A row says what a call
# takes and answers, whether it carries file descriptors, whether it may come as a fire-and-forget
# notification, whether its reply may wait for the device, and what kind of host cost it has under the virtual
# clock (the figures stay in mpsd.sim).
#
# Kinds are checked where a call enters either end, with the error a real runtime gives for a malformed
# argument: cudaErrorInvalidValue, naming the argument. What only the daemon's state can judge (a live pointer,
# a stream of this context, a launch's grid against the device's limits) stays with the runtime, which gives
# CUDA's own error for it. The handshake (`hello`) is no call: the connection's state machine owns it.
from __future__ import annotations

import keyword
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ._brief import brief
from ._errors import InvalidValueError

# Host-cost kinds, as mpsd.clock prices them (the clock imports nothing from here; a test pins that
# the two agree). LAUNCH: queues work and returns; SYNC: waits for the device; CALL: anything else; CLOCK:
# touches only the client's own simulated clock, so it is answered at once and never stamped.
LAUNCH, SYNC, CALL, CLOCK = "launch", "sync", "call", "clock"


@dataclass(frozen=True, slots=True)
class Kind:
    """What a value on the wire may be: `what` names it in errors, `normal` makes a caller's value a plain one
    (a DevicePointer a plain int, a memoryview bytes). A decoded value whose type is in `wire` is of the kind
    whatever its value (msgpack's ints are all within 64 bits): the daemon's check of a launch asks no more."""

    what: str
    accepts: Callable[[Any], bool]
    normal: Callable[[Any], Any] = lambda value: value
    wire: frozenset[type] = frozenset()


def _ints(low: int, high: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v < high


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_INT, _NONE = frozenset({int}), frozenset({int, type(None)})
INT = Kind("an int", _ints(-2**63, 2**64), int, _INT)  # what msgpack carries
COUNT = Kind("a byte count", _ints(0, 2**63), int)
PTR = Kind("a device pointer", _ints(0, 2**64), int)
EVENT_HANDLE = Kind("an event handle", _ints(-2**63, 2**64), int, _INT)
STREAM_HANDLE = Kind("a stream handle or None", lambda v: v is None or EVENT_HANDLE.accepts(v),
                     lambda v: None if v is None else int(v), _NONE)
BOOL = Kind("a bool", lambda v: isinstance(v, bool), wire=frozenset({bool}))
SECONDS = Kind("a finite number of seconds >= 0", lambda v: _number(v) and 0 <= v < math.inf, float)
STR = Kind("a string", lambda v: isinstance(v, str), wire=frozenset({str}))
BYTES = Kind("bytes", lambda v: isinstance(v, (bytes, bytearray, memoryview)), bytes, frozenset({bytes}))
LIST = Kind("a list", lambda v: isinstance(v, (list, tuple)), list, frozenset({list}))
# A launch's grid and block: what is in the list is check_shape's to judge, with CUDA's error for a bad shape.
DIMS = Kind("an int or a list", lambda v: isinstance(v, (int, list, tuple)) and not isinstance(v, bool),
            wire=frozenset({int, list}))
# Replies only.
NOTHING = Kind("nothing", lambda v: v is None)
FLOAT = Kind("a number", _number)
PAIR = Kind("a pair of ints", lambda v: type(v) is list and len(v) == 2 and INT.accepts(v[0]) and INT.accepts(v[1]))
MAP = Kind("a map", lambda v: isinstance(v, dict))
ERROR = Kind("an error or None", lambda v: v is None or isinstance(v, dict))

REQUIRED: Any = object()

# What a call does while a stream of its context captures (cudaStreamBeginCapture); mpsd.runtime.capture applies
# the rules, as bench/fidelity/graph_capture_h200 measured them on an H200. WORK: queues work on its stream, which
# a capturing stream turns into a node of the graph (where the work is queued, Context._enqueue); on the legacy
# stream beside a capturing blocking stream it is cudaErrorStreamCaptureImplicit. COPY: the same, but a copy that
# synchronises (no stream, or pageable memory) is UNSAFE first. UNSAFE: a "potentially unsafe" call, refused by the
# capture mode rules (global, thread-local, relaxed). SYNC_DEVICE: refused while any stream captures. SYNC_STREAM
# and QUERY_STREAM: refused on a capturing stream (a synchronize of another stream is UNSAFE). SYNC_EVENT and
# QUERY_EVENT: refused on an event recorded in a capture under way (cudaErrorCapturedEvent; a synchronize of
# another event is UNSAFE). Every refusal invalidates the captures it is refused for.
WORK, COPY, UNSAFE, SYNC_DEVICE = "work", "copy", "unsafe", "sync_device"
SYNC_STREAM, QUERY_STREAM, SYNC_EVENT, QUERY_EVENT = "sync_stream", "query_stream", "sync_event", "query_event"
# cudaStreamCaptureMode and cudaStreamCaptureStatus, by CUDA's values.
CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL, CAPTURE_RELAXED = 0, 1, 2
CAPTURE_NONE, CAPTURE_ACTIVE, CAPTURE_INVALIDATED = 0, 1, 2
EVENT_EXTERNAL = 0x1  # cudaEventRecordExternal, cudaEventWaitExternal

# The operations of mem_pool_ops, each a list: [POOL_ALLOC, ptr, nbytes, stream, [streams it waits for]] (a
# malloc_async; the streams: memory freed there reused without an event between, the pool's internal dependency),
# [POOL_FREE, ptr, stream] (a free_async), [POOL_RELEASE, ptr] (a reservation the pool gives back).
# [POOL_GRAPH_FREE, ptr, stream]: a free_async (or cudaFree) of a graph's allocation (mpsd.runtime.graph_memory):
# a memory free node where the stream captures, a free in stream order where it does not.
POOL_ALLOC, POOL_FREE, POOL_RELEASE, POOL_GRAPH_FREE = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class Arg:
    name: str
    kind: Kind
    default: Any = REQUIRED


@dataclass(frozen=True, slots=True, eq=False)
class Call:
    """One call.

    Attributes:
        name: its op on the wire, CUDA's name in snake_case: its attribute's in the table (Calls).
        args: its arguments in the order handlers take them; a missing one takes its default.
        pack: the argument map of values in the row's order, unchecked (see __post_init__).
        reply: the kind of its result.
        fds: file descriptors its request carries (exactly these; any a call takes none of are closed).
        reply_fds: file descriptors its reply carries.
        notify: it may come as a notification: it only queues work, whose errors surface later.
        waits: its reply may wait for the device (it synchronises), and earlier errors surface in it.
        cost: its host-cost kind, and what prices it within that kind (a copy's engine, "alloc").
        sticky_ok: it still answers after a sticky error, so the client can learn what happened.
        capture: what it does while a stream of the context captures (WORK, UNSAFE and the rest above).
    """

    args: tuple[Arg, ...] = ()
    reply: Kind = NOTHING
    fds: int = 0
    reply_fds: int = 0
    notify: bool = False
    waits: bool = False
    cost: tuple[str, str | None] = (CALL, None)
    sticky_ok: bool = False
    capture: str | None = None
    name: str = ""
    pack: Callable[..., dict[str, Any]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # `pack(*values)`: the argument map of values checked already, and more strictly than the row would (a
        # launch's, by check_shape and check_args), nothing checked again. Made from the row's names as a
        # function with a dict display, as dataclasses make their __init__: a launch is packed on every call,
        # and dict(zip(names, values)) costs it three times as much.
        names = [arg.name for arg in self.args]
        assert all(n.isidentifier() and not keyword.iskeyword(n) for n in names), names
        params = ", ".join(names)
        display = ", ".join(f"{n!r}: {n}" for n in names)
        object.__setattr__(self, "pack", eval(f"lambda {params}: {{{display}}}"))  # noqa: S307 (our own names)

    def __set_name__(self, owner: type, name: str) -> None:
        object.__setattr__(self, "name", name)  # a row is named by its attribute of the table (Calls)

    def check(self, args: dict[str, Any], fds: tuple[int, ...] = ()) -> tuple[Any, ...]:
        """The daemon's side: the arguments of a request that arrived, in the row's order.

        Raises:
            InvalidValueError: an argument is missing or of the wrong kind, or the file descriptors are not
                the ones the call takes.
        """
        values = []
        for arg in self.args:
            value = args.get(arg.name, arg.default)
            kind = arg.kind
            if type(value) not in kind.wire and not kind.accepts(value):  # REQUIRED is of no kind
                raise _wrong(self, arg, value)
            values.append(value)
        if self.fds and len(fds) != self.fds:
            raise InvalidValueError(f"{self.name} needs exactly {self.fds} file descriptor"
                                    f"{'s' if self.fds > 1 else ''}, not {len(fds)}")
        return tuple(values)

    def encode(self, values: Sequence[Any]) -> dict[str, Any]:
        """The client's side: the argument map of a request, from values in the row's order (trailing ones may
        be left to their defaults).

        Raises:
            InvalidValueError: a value of the wrong kind.
            TypeError: more values than the call has arguments (a bug of the caller).
        """
        if len(values) > len(self.args):
            raise TypeError(f"{self.name} takes {len(self.args)} arguments, not {len(values)}")
        out: dict[str, Any] = {}
        for arg, value in zip(self.args, values):
            if not arg.kind.accepts(value):
                raise _wrong(self, arg, value)
            out[arg.name] = arg.kind.normal(value)
        return out


def _wrong(call: Call, arg: Arg, value: Any) -> InvalidValueError:
    if value is REQUIRED:
        return InvalidValueError(f"{call.name} needs {arg.name} ({arg.kind.what})")
    return InvalidValueError(f"{call.name}: {arg.name} {brief(value, 40)} is not {arg.kind.what}")


_EVENT, _STREAM = (Arg("event", EVENT_HANDLE),), (Arg("stream", STREAM_HANDLE, None),)
_COPY = (Arg("nbytes", COUNT), *_STREAM, Arg("staged", BOOL, False))  # pageable copies are staged


class Calls:
    """The table, a row by name: ``Calls.malloc`` is malloc's. Code of either end names a call so, not by its
    string, so that a misspelt name is an error the type checker finds (and an AttributeError on import where
    the name is read at module level) instead of a request the daemon refuses at run time."""

    device_properties = Call(reply=MAP, sticky_ok=True)
    mem_get_info = Call(reply=PAIR)
    malloc = Call((Arg("nbytes", COUNT),), reply=PTR, cost=(CALL, "alloc"), capture=UNSAFE)
    free = Call((Arg("ptr", PTR),), waits=True, cost=(CALL, "alloc"), capture=UNSAFE)  # cudaFree synchronises
    # Stream-ordered allocation. A pool is the client's, as CUDA's is the driver's in the process: its memory is
    # reserved by request (the round trip CUDA's pool pays to grow), and what it hands out, takes back and gives
    # back comes as one notification ahead of the client's next message, a list of POOL_OPS in the order they
    # were made: one message for a batch, not two for every pair, so a pair costs the daemon a few dict
    # operations (bench/alloc_rate.py). Priced as one launch call under the virtual clock (mpsd.sim has no figure
    # of its own for these yet).
    mem_pool_reserve = Call((Arg("nbytes", COUNT),), reply=PTR, cost=(CALL, "alloc"))
    mem_pool_ops = Call((Arg("ops", LIST),), notify=True, cost=(LAUNCH, None))
    # The driver's virtual memory (cuMemGetAllocationGranularity, cuMemAddressReserve/Free, cuMemCreate/Release,
    # cuMemMap/Unmap): address space reserved apart from memory, and physical memory mapped into it page by page,
    # so that an allocation grows in place (PyTorch's expandable_segments). Sizes, addresses and offsets are
    # whole pages of the granularity; mem_map grants the device read-write access too (cuMemSetAccess's part).
    mem_get_allocation_granularity = Call(reply=INT)
    mem_address_reserve = Call((Arg("size", COUNT), Arg("alignment", COUNT, 0)), reply=PTR)
    mem_address_free = Call((Arg("ptr", PTR), Arg("size", COUNT)))
    mem_create = Call((Arg("size", COUNT),), reply=INT, cost=(CALL, "alloc"))
    mem_release = Call((Arg("handle", INT),))
    mem_map = Call((Arg("ptr", PTR), Arg("size", COUNT), Arg("offset", COUNT), Arg("handle", INT)))
    mem_unmap = Call((Arg("ptr", PTR), Arg("size", COUNT)))
    host_register = Call((Arg("nbytes", COUNT),), reply=INT, fds=1, capture=UNSAFE)  # a sealed memfd
    host_unregister = Call((Arg("id", INT),), capture=UNSAFE)
    # memcpy_htod waits without a stream, from pinned memory; memcpy_dtoh without a stream, or into pageable memory.
    memcpy_htod = Call((Arg("dst", PTR), Arg("host", INT), Arg("offset", COUNT), *_COPY), notify=True,
                       waits=True, cost=(LAUNCH, "h2d"), capture=COPY)
    memcpy_dtoh = Call((Arg("host", INT), Arg("offset", COUNT), Arg("src", PTR), *_COPY), notify=True,
                       waits=True, cost=(LAUNCH, "d2h"), capture=COPY)
    memcpy_dtod = Call((Arg("dst", PTR), Arg("src", PTR), Arg("nbytes", COUNT), *_STREAM), notify=True,
                       cost=(LAUNCH, "d2d"), capture=WORK)
    # cudaMemcpyPeerAsync from a context of the same process on another device (`src_client`: its client id)
    # into this one's, on this one's stream.
    memcpy_peer = Call((Arg("dst", PTR), Arg("src_client", INT), Arg("src", PTR), Arg("nbytes", COUNT), *_STREAM),
                       notify=True, cost=(LAUNCH, "d2d"), capture=WORK)
    memset = Call((Arg("ptr", PTR), Arg("value", INT), Arg("nbytes", COUNT), *_STREAM), notify=True,
                  cost=(LAUNCH, "memset"), capture=WORK)
    create_stream = Call((Arg("priority", INT, 0), Arg("flags", INT, 0)), reply=PAIR)  # handle, clamped
    destroy_stream = Call((Arg("stream", STREAM_HANDLE),))
    stream_synchronize = Call(_STREAM, waits=True, cost=(SYNC, None), capture=SYNC_STREAM)
    stream_query = Call(_STREAM, reply=BOOL, capture=QUERY_STREAM)
    # `flags`: cudaEventWaitExternal and cudaEventRecordExternal (EVENT_EXTERNAL), which only a capture heeds: the
    # wait or the record becomes an event node of the graph (mpsd.runtime.capture) instead of an edge of it.
    stream_wait_event = Call((*_STREAM, *_EVENT, Arg("flags", INT, 0)), notify=True, cost=(LAUNCH, None))
    create_event = Call((Arg("disable_timing", BOOL, False), Arg("interprocess", BOOL, False)),
                        reply=EVENT_HANDLE)
    destroy_event = Call(_EVENT)
    event_record = Call((*_EVENT, *_STREAM, Arg("flags", INT, 0)), notify=True, cost=(LAUNCH, None))
    event_synchronize = Call(_EVENT, waits=True, cost=(SYNC, None), capture=SYNC_EVENT)
    event_query = Call(_EVENT, reply=BOOL, capture=QUERY_EVENT)
    event_elapsed = Call((Arg("start", EVENT_HANDLE), Arg("end", EVENT_HANDLE)), reply=FLOAT)
    synchronize = Call(waits=True, cost=(SYNC, None), capture=SYNC_DEVICE)
    get_last_error = Call((Arg("clear", BOOL, True),), reply=ERROR, sticky_ok=True)
    statistics = Call(reply=MAP, sticky_ok=True)
    launch = Call((Arg("name", STR), Arg("grid", DIMS), Arg("block", DIMS), Arg("args", LIST),
                   Arg("shared_mem", INT, 0), *_STREAM), notify=True, cost=(LAUNCH, None), capture=WORK)
    # Modules (cuModuleLoad, cuModuleUnload): `path` names a module file within the daemon's --module-path (a bare
    # name is looked for there, file or stem); the reply is the module's handle, its name, and each kernel's
    # parameter kinds, which launches then name as "module.kernel". A function's attributes and occupancy
    # (cuFuncGetAttribute, cuOccupancyMaxActiveBlocksPerMultiprocessor) are the declared kernel's, by that name
    # (a built-in's bare name too).
    module_load = Call((Arg("path", STR),), reply=MAP)
    module_unload = Call((Arg("module", INT),))
    func_get_attributes = Call((Arg("name", STR),), reply=MAP)
    occupancy_max_active_blocks = Call((Arg("name", STR), Arg("block", DIMS), Arg("shared_mem", INT, 0)), reply=INT)
    mem_fd = Call((Arg("ptr", PTR),), reply=MAP, reply_fds=1)  # the memfd behind device memory (host_view)
    ipc_get_mem_handle = Call((Arg("ptr", PTR),), reply=BYTES)
    ipc_open_mem_handle = Call((Arg("handle", BYTES), Arg("flags", INT, 1)), reply=MAP, reply_fds=1)
    # The client knows what it opened, so a close is checked there, and needs no reply unless it gives back memory
    # its exporter has freed already (mpsd_client._core). The daemon releases the mapping after the work queued
    # before it.
    ipc_close_mem_handle = Call((Arg("ptr", PTR),), notify=True, cost=(LAUNCH, None))
    ipc_get_event_handle = Call(_EVENT, reply=BYTES)
    ipc_open_event_handle = Call((Arg("handle", BYTES),), reply=EVENT_HANDLE)
    # CUDA graphs (mpsd.runtime.capture, mpsd.runtime.graphs). Graphs, their nodes and executable graphs are ints
    # of the context's handles. `thread` is the calling thread's (threading.get_ident), for the thread-local mode's
    # rules; while it has a capture under way the client also sends it with every call, as an extra argument.
    stream_begin_capture = Call((*_STREAM, Arg("mode", INT, CAPTURE_GLOBAL), Arg("thread", INT, 0)))
    stream_end_capture = Call((*_STREAM, Arg("thread", INT, 0)), reply=INT)  # the graph
    stream_is_capturing = Call(_STREAM, reply=INT)  # a CAPTURE_* status
    stream_get_capture_info = Call(_STREAM, reply=MAP)  # status, id, graph, dependencies (its nodes)
    graph_create = Call(reply=INT)
    # A node of `type` ("kernel", "memset", "memcpy", "empty") after the nodes `deps`: `params` are the arguments of
    # the call it stands for, without the stream: launch's, memset's, or for a memcpy by its "kind" ("d2d", "h2d",
    # "d2h") memcpy_dtod's, memcpy_htod's or memcpy_dtoh's (from pinned memory: no "staged").
    graph_add_node = Call((Arg("graph", INT), Arg("type", STR), Arg("deps", LIST), Arg("params", MAP)), reply=INT)
    graph_get_nodes = Call((Arg("graph", INT),), reply=LIST)  # each node's id, type, deps and params, in order
    graph_clone = Call((Arg("graph", INT),), reply=INT)
    graph_destroy = Call((Arg("graph", INT),))
    # flags 1: AutoFreeOnLaunch. Priced as DeviceSpec.graph_instantiate_call under the virtual clock.
    graph_instantiate = Call((Arg("graph", INT), Arg("flags", INT, 0)), reply=INT, cost=(CALL, "instantiate"))
    # cudaMallocAsync on a capturing stream (a capture's memory alloc node): the allocation's address, fixed for the
    # graph's life; 0 where the stream captures nothing (the client's own pool serves it then). Frees of graph
    # allocations go with the pool's operations (POOL_GRAPH_FREE).
    graph_mem_alloc = Call((Arg("nbytes", COUNT), *_STREAM), reply=PTR, cost=(CALL, "alloc"))
    graph_exec_update = Call((Arg("exec", INT), Arg("graph", INT)), reply=MAP)  # result, node (cudaGraphExecUpdate)
    # cudaGraphExecKernelNodeSetParams: `node` a kernel node of the graph the executable graph was made from, `params`
    # a launch's arguments without the stream, as graph_add_node's.
    graph_exec_kernel_node_set_params = Call((Arg("exec", INT), Arg("node", INT), Arg("params", MAP)))
    graph_exec_destroy = Call((Arg("exec", INT),))
    # One notification for the whole graph, however many nodes it has, priced as a fraction of a kernel launch's
    # call under the virtual clock (DeviceSpec.graph_launch_call): where a graph saves the host its launches.
    graph_launch = Call((Arg("exec", INT), *_STREAM), notify=True, cost=(LAUNCH, "graph"), capture=WORK)
    # The client's simulated host clock, under the daemon's virtual clock: its now, let time pass, and stop
    # holding the clock until the next call.
    clock = Call(reply=MAP, cost=(CLOCK, None), sticky_ok=True)
    sleep = Call((Arg("seconds", SECONDS),), reply=MAP, cost=(CLOCK, None), sticky_ok=True)
    idle = Call(reply=MAP, cost=(CLOCK, None), sticky_ok=True)


ROWS: tuple[Call, ...] = tuple(row for row in vars(Calls).values() if isinstance(row, Call))
CALLS: dict[str, Call] = {call.name: call for call in ROWS}
