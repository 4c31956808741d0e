# CUDA graphs, as users hold them: a Graph (made by a stream's capture or by hand) and the GraphExec instantiated
# from it. Like Stream and Event (._objects), their methods hand a generator of the core to their context's
# `_drive`, so the same classes serve the blocking and the trio shells. The rules are the daemon's
# (mpsd.runtime.capture and .graphs); the client keeps only which captures it began, so that its calls carry
# their thread while one is under way (the core's `capture`).
"""Graphs, their nodes, executable graphs and stream capture."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator, Iterable

from mpsd_protocol import (
    CAPTURE_GLOBAL,
    CAPTURE_NONE,
    CAPTURE_RELAXED,
    CAPTURE_THREAD_LOCAL,
    Calls,
    CudaError,
    GraphExecUpdateFailureError,
    InvalidValueError,
    Notification,
    StreamCaptureWrongThreadError,
    brief,
)

if TYPE_CHECKING:
    from ._api import ContextBase
    from ._objects import Event, Stream

__all__ = ["CaptureInfo", "Graph", "GraphExec", "GraphNode"]

MODES = {"global": CAPTURE_GLOBAL, "thread_local": CAPTURE_THREAD_LOCAL, "relaxed": CAPTURE_RELAXED}
STATUSES = ("none", "active", "invalidated")  # cudaStreamCaptureStatus, by value
UPDATE_RESULTS = {0: "SUCCESS", 1: "ERROR", 2: "TOPOLOGY_CHANGED", 3: "NODE_TYPE_CHANGED", 4: "FUNCTION_CHANGED",
                  5: "PARAMETERS_CHANGED", 6: "NOT_SUPPORTED"}
Op = Generator[Any, Any, Any]


@dataclass(frozen=True, slots=True)
class GraphNode:
    """A node of a graph: `type` is "kernel", "memset", "memcpy", "empty", "event_record", "event_wait", "graph"
    (a child graph), "mem_alloc" or "mem_free"; `deps` the ids of the nodes it runs after; `params` the arguments
    of the call it stands for (an event node's event handle; a child graph node's source graph and its copy's
    nodes; an allocation node's bytes and address). Where a node is asked for, its id does too."""

    id: int
    type: str
    deps: tuple[int, ...]
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CaptureInfo:
    """``cudaStreamGetCaptureInfo``: `status` "none", "active" or "invalidated"; while a capture is under way its
    `id`, `mode`, the `graph` it builds (readable only once it ends) and the nodes the stream's next work would
    depend on."""

    status: str
    id: int | None = None
    mode: str | None = None
    graph: Graph | None = None
    dependencies: tuple[int, ...] = ()


class Graph:
    """A CUDA graph of this context (``cudaGraph_t``): what a capture recorded, or nodes added by hand."""

    def __init__(self, ctx: ContextBase, handle: int) -> None:
        self.ctx = ctx
        self.handle = handle

    def add_kernel_node(self, name: str, grid: Any, block: Any, args: Iterable[Any] = (),
                        deps: Iterable[GraphNode | int] = (), shared_mem: int = 0) -> Any:
        """``cudaGraphAddKernelNode``: a launch of a built-in kernel, after `deps`, checked as a launch is."""
        return self._add("kernel", deps, {"name": name, "grid": _dims(grid), "block": _dims(block), "args": list(args),
                                          "shared_mem": shared_mem})

    def add_memset_node(self, ptr: Any, value: int, nbytes: int, deps: Iterable[GraphNode | int] = ()) -> Any:
        """``cudaGraphAddMemsetNode``: `nbytes` at `ptr` set to the low byte of `value`."""
        return self._add("memset", deps, {"ptr": ptr, "value": value, "nbytes": nbytes})

    def add_memcpy_node(self, dst: Any, src: Any, nbytes: int | None = None,
                        deps: Iterable[GraphNode | int] = ()) -> Any:
        """``cudaGraphAddMemcpyNode``: a copy between device pointers (`nbytes` of them), or between a device
        pointer and a pinned `HostBuffer` (or a view of one: all its bytes, unless `nbytes` says fewer).

        Raises:
            InvalidValueError: host memory that is not pinned, or two host ends.
        """
        core = self.ctx._core
        if isinstance(dst, int) and isinstance(src, int):
            params = {"kind": "d2d", "dst": dst, "src": src, "nbytes": nbytes}
        elif isinstance(dst, int):
            host, offset, size = _pinned(core, src)
            params = {"kind": "h2d", "dst": dst, "host": host, "offset": offset, "nbytes": size if nbytes is None
                      else nbytes}
        elif isinstance(src, int):
            host, offset, size = _pinned(core, dst)
            params = {"kind": "d2h", "host": host, "offset": offset, "src": src, "nbytes": size if nbytes is None
                      else nbytes}
        else:
            raise InvalidValueError("a memcpy node copies to or from device memory")
        return self._add("memcpy", deps, params)

    def add_empty_node(self, deps: Iterable[GraphNode | int] = ()) -> Any:
        """``cudaGraphAddEmptyNode``: nothing, after `deps` (a point to join branches at)."""
        return self._add("empty", deps, {})

    def add_event_record_node(self, event: Event, deps: Iterable[GraphNode | int] = ()) -> Any:
        """``cudaGraphAddEventRecordNode``: record `event` when the graph reaches this node, at each launch (its
        latest record, for queries, synchronisations and waits, is the launch's).

        Raises:
            InvalidResourceHandleError: not an event of this context.
        """
        return self._add("event_record", deps, {"event": event.handle})

    def add_event_wait_node(self, event: Event, deps: Iterable[GraphNode | int] = ()) -> Any:
        """``cudaGraphAddEventWaitNode``: the nodes after this one wait for `event`'s latest record as of each
        launch, as a stream's wait_event at the launch would."""
        return self._add("event_wait", deps, {"event": event.handle})

    def add_mem_alloc_node(self, nbytes: int, deps: Iterable[GraphNode | int] = ()) -> Any:
        """``cudaGraphAddMemAllocNode``: `nbytes` of device memory the graph allocates when it reaches this node;
        the node's ``params["ptr"]`` is the address, the same at every launch. Free it with a free node of this
        graph, or after a launch with free_async (mpsd.runtime.graph_memory has CUDA's rules).

        Raises:
            InvalidValueError: no bytes. OutOfMemoryError: as malloc's.
        """
        return self.ctx._drive(_add_memory_node(self, nbytes, deps))

    def add_mem_free_node(self, ptr: Any, deps: Iterable[GraphNode | int] = ()) -> Any:
        """``cudaGraphAddMemFreeNode``: free the graph allocation at `ptr` when the graph reaches this node.

        Raises:
            InvalidValueError: `ptr` is no allocation node's address, or this graph frees it already.
        """
        return self._add("mem_free", deps, {"ptr": ptr})

    def add_child_graph_node(self, graph: Graph, deps: Iterable[GraphNode | int] = ()) -> Any:
        """``cudaGraphAddChildGraphNode``: all of `graph` (copied now: later changes to it are not seen) after
        `deps`; the nodes after this one run after all of the child's. The node's params show the copy's nodes."""
        return self._add("graph", deps, {"graph": graph.handle})

    def _add(self, type: str, deps: Iterable[GraphNode | int], params: dict[str, Any]) -> Any:
        params = {key: _plain(value) for key, value in params.items()}
        return self.ctx._drive(_add_node(self, type, [_node_id(d) for d in deps], params))

    def nodes(self) -> Any:
        """``cudaGraphGetNodes``: its nodes (`GraphNode`), in the order they were made."""
        return self.ctx._drive(_nodes(self))

    def clone(self) -> Any:
        """``cudaGraphClone``: a copy with the same nodes and edges (nodes of its own)."""
        return self.ctx._drive(_graph_of(self.ctx, self.ctx._core.invoke(Calls.graph_clone, self.handle)))

    def instantiate(self, auto_free_on_launch: bool = False) -> Any:
        """``cudaGraphInstantiate``: an executable graph of the nodes as they are now (one request). With
        `auto_free_on_launch` (cudaGraphInstantiateFlagAutoFreeOnLaunch), a launch frees what the previous one
        allocated and nobody freed, instead of failing.

        Raises:
            NotSupportedError: the graph has memory nodes and an executable graph already.
        """
        return self.ctx._drive(_instantiate(self, 1 if auto_free_on_launch else 0))

    def to_dot(self, path: str | os.PathLike[str]) -> Any:
        """Write the graph in Graphviz's dot language, as ``cudaGraphDebugDotPrint`` does: a cluster for the
        graph, a box for each node with its type and arguments, an arrow for each dependency."""
        return self.ctx._drive(_to_dot(self, path))

    def destroy(self) -> Any:
        """``cudaGraphDestroy``: executable graphs made from it stay."""
        return self.ctx._drive(self.ctx._core.invoke(Calls.graph_destroy, self.handle))

    def __repr__(self) -> str:
        return f"<Graph {self.handle}>"


class GraphExec:
    """An executable graph (``cudaGraphExec_t``)."""

    def __init__(self, ctx: ContextBase, handle: int) -> None:
        self.ctx = ctx
        self.handle = handle

    def launch(self, stream: Stream | None = None) -> Any:
        """``cudaGraphLaunch``: every node, in dependency order, on `stream` (after its earlier work and this
        graph's previous launch), as one fire-and-forget notification however many nodes there are: errors
        surface at the next synchronising call, as a launch's do."""
        core = self.ctx._core
        try:
            if core.broken is not None:
                raise core.broken
            call = Calls.graph_launch
            note = Notification(call.name, core._charge(call.encode((self.handle, core._stream(stream)))))
        except CudaError as exc:
            core.last_error = exc
            raise
        return self.ctx._post(note)

    def set_kernel_params(self, node: GraphNode | int, name: str, grid: Any, block: Any, args: Iterable[Any] = (),
                          shared_mem: int = 0) -> Any:
        """``cudaGraphExecKernelNodeSetParams``: this executable graph's copy of kernel node `node` (of the graph it
        was instantiated from) launches `name` with this grid, block and arguments from the next launch on; the
        graph is unchanged.

        Raises:
            InvalidValueError: `node` is no kernel node of that graph; a launch's errors for the new arguments.
        """
        params = {key: _plain(value) for key, value in (("name", name), ("grid", _dims(grid)), ("block", _dims(block)),
                                                         ("args", list(args)), ("shared_mem", shared_mem))}
        return self.ctx._drive(self.ctx._core.invoke(Calls.graph_exec_kernel_node_set_params, self.handle,
                                                     _node_id(node), params))

    def update(self, graph: Graph) -> Any:
        """``cudaGraphExecUpdate``: take `graph`'s nodes' arguments (kernels, grids, blocks, arguments, memory),
        where it has this graph's shape.

        Raises:
            GraphExecUpdateFailureError: it has not; its ``result`` is "TOPOLOGY_CHANGED" (a node or an edge more
                or less), "NODE_TYPE_CHANGED" or "NOT_SUPPORTED" (a memory node's allocation differs; ``node`` the
                id of the node), and nothing changed.
        """
        return self.ctx._drive(_update(self, graph))

    def destroy(self) -> Any:
        """``cudaGraphExecDestroy``: launches already made still run."""
        return self.ctx._drive(self.ctx._core.invoke(Calls.graph_exec_destroy, self.handle))

    def __repr__(self) -> str:
        return f"<GraphExec {self.handle}>"


# -- the core's side: generators a context drives ------------------------------------------------------------
def begin_capture(stream: Stream, mode: str) -> Op:
    core = stream.ctx._core
    if mode not in MODES:
        raise InvalidValueError(f"capture mode {brief(mode, 20)} is not one of {', '.join(MODES)}")
    yield from core.invoke(Calls.stream_begin_capture, stream, MODES[mode], threading.get_ident())
    core.capture.streams.add(stream.handle)


def end_capture(stream: Stream) -> Op:
    core = stream.ctx._core
    try:
        handle = yield from core.invoke(Calls.stream_end_capture, stream, threading.get_ident())
    except StreamCaptureWrongThreadError:
        raise  # the capture goes on
    except CudaError:
        core.capture.streams.discard(stream.handle)
        raise
    core.capture.streams.discard(stream.handle)
    return Graph(stream.ctx, handle)


def capture_info(stream: Stream) -> Op:
    info = yield from stream.ctx._core.invoke(Calls.stream_get_capture_info, stream)
    if info["status"] == CAPTURE_NONE:
        return CaptureInfo("none")
    return CaptureInfo(STATUSES[info["status"]], info["id"], next(k for k, v in MODES.items() if v == info["mode"]),
                       Graph(stream.ctx, info["graph"]), tuple(info["dependencies"]))


def is_capturing(stream: Stream) -> Op:
    return (yield from stream.ctx._core.invoke(Calls.stream_is_capturing, stream)) != CAPTURE_NONE


def create_graph(ctx: ContextBase) -> Op:
    return (yield from _graph_of(ctx, ctx._core.invoke(Calls.graph_create)))


def exchange_capture_mode(ctx: ContextBase, mode: str) -> str:
    """``cudaThreadExchangeStreamCaptureMode`` for the calling thread: its mode from now on; the one before."""
    if mode not in MODES:
        raise InvalidValueError(f"capture mode {brief(mode, 20)} is not one of {', '.join(MODES)}")
    modes = ctx._core.capture.modes
    before = modes.get(threading.get_ident(), CAPTURE_GLOBAL)
    if MODES[mode] == CAPTURE_GLOBAL:
        modes.pop(threading.get_ident(), None)
    else:
        modes[threading.get_ident()] = MODES[mode]
    return next(k for k, v in MODES.items() if v == before)


def _graph_of(ctx: ContextBase, op: Op) -> Op:
    return Graph(ctx, (yield from op))


def _add_node(graph: Graph, type: str, deps: list[int], params: dict[str, Any]) -> Op:
    node = yield from graph.ctx._core.invoke(Calls.graph_add_node, graph.handle, type, deps, params)
    return GraphNode(node, type, tuple(deps), params)


def _nodes(graph: Graph) -> Op:
    found = yield from graph.ctx._core.invoke(Calls.graph_get_nodes, graph.handle)
    return [GraphNode(n["id"], n["type"], tuple(n["deps"]), n["params"]) for n in found]


def _instantiate(graph: Graph, flags: int = 0) -> Op:
    return GraphExec(graph.ctx, (yield from graph.ctx._core.invoke(Calls.graph_instantiate, graph.handle, flags)))


def _add_memory_node(graph: Graph, nbytes: int, deps: Iterable[GraphNode | int]) -> Op:
    core = graph.ctx._core
    ids = [_node_id(d) for d in deps]
    node = yield from core.invoke(Calls.graph_add_node, graph.handle, "mem_alloc", ids, {"nbytes": _plain(nbytes)})
    made = next(n for n in (yield from _nodes(graph)) if n.id == node)
    core.capture.allocs.add(made.params["ptr"])
    return made


def _update(graph_exec: GraphExec, graph: Graph) -> Op:
    found = yield from graph_exec.ctx._core.invoke(Calls.graph_exec_update, graph_exec.handle, graph.handle)
    result = found.get("result", 1)
    if result:
        name = UPDATE_RESULTS.get(result, str(result))
        error = GraphExecUpdateFailureError(f"cudaGraphExecUpdateResult{name.title().replace('_', '')}"
                                            + (f" at node {found['node']}" if found.get("node") is not None else ""))
        error.result, error.node = name, found.get("node")
        raise error


def _to_dot(graph: Graph, path: str | os.PathLike[str]) -> Op:
    nodes = yield from _nodes(graph)
    name = f"graph_{graph.handle}"
    lines = ["digraph dot {", f"subgraph cluster_{graph.handle} {{", f'label="{name}" graph[style="dashed"];']
    for node in nodes:
        lines.append(f'"{name}_node_{node.id}"[style="solid" shape="rectangle" label="{_label(node)}"];')
    for node in nodes:
        lines += [f'"{name}_node_{dep}" -> "{name}_node_{node.id}";' for dep in node.deps]
    lines += ["}", "}"]
    with open(path, "w", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")


def _label(node: GraphNode) -> str:
    p = node.params
    if node.type == "kernel":
        rows = [p["name"], f"grid {tuple(p['grid'])} block {tuple(p['block'])}", f"args {tuple(p['args'])}"]
    elif node.type == "memset":
        rows = [f"ptr {p['ptr']:#x}", f"value {p['value']}", f"bytes {p['nbytes']}"]
    elif node.type == "memcpy":
        rows = [p.get("kind", "?").upper()] + [f"{k} {v:#x}" if k in ("dst", "src") else f"{k} {v}"
                                               for k, v in p.items() if k != "kind"]
    elif node.type in ("event_record", "event_wait"):
        rows = [f"event {p['event']}"]
    elif node.type == "mem_alloc":
        rows = [f"ptr {p['ptr']:#x}", f"bytes {p['nbytes']}"]
    elif node.type == "mem_free":
        rows = [f"ptr {p['ptr']:#x}"]
    elif node.type == "graph":
        rows = [f"graph {p['graph']}", f"{len(p.get('nodes', []))} nodes"]
    else:
        rows = []
    return "\\n".join([f"{node.id}", node.type.upper(), *rows])


def _node_id(node: GraphNode | int) -> int:
    return node.id if isinstance(node, GraphNode) else node


def _dims(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _plain(value: Any) -> Any:
    """A value as the wire carries it: a DevicePointer a plain int, a tuple a list (the row checks the rest)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _pinned(core: Any, buffer: Any) -> tuple[int, int, int]:
    """(host buffer id, offset, bytes) of a view of pinned memory."""
    from ._core import _bytes_view  # (the core's own check of a buffer)

    view = _bytes_view(buffer, writable=False)
    found = core._find_pinned(view)
    if found is None:
        raise InvalidValueError("a memcpy node's host memory must be a pinned HostBuffer (or a view of one)")
    return found[0].id, found[1], len(view)
