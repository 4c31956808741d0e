# CUDA graphs in a client's context: graphs of nodes (made by stream capture, mpsd.runtime.capture, or by hand),
# executable graphs instantiated from them, and their launches. A node is what one call would have queued on a
# stream (a kernel launch, a memset, a copy), or nothing (an empty node), after the nodes it names; it keeps the
# call's arguments, so that nodes() and to_dot show what the user gave, and the checks the call made: a kernel
# node its Plan, whose pointers are looked up at each launch as a launch's are; a memset or a copy the work the
# call built, its memory resolved when the node was made (as cudaGraphAddMemsetNode checks its pointer then).
#
# A graph launch is one unit of work (mpsd.backends.ops.GraphLaunch), queued on its stream as one launch is, by
# the same rules, and handed whole to the backend, which runs its nodes in dependency order (the simulator on
# streams of their own, so that branches run side by side; the kernel dispatcher holds and releases it whole).
# Launches of one executable graph run one after another, whatever their streams, as CUDA orders them.
#
# An event record node records its event when the graph runs, and an event wait node waits for the event's latest
# record as of the graph's launch, as cudaEventRecord and cudaStreamWaitEvent called at the launch would. A child
# graph node holds a copy of its graph, made when the node was (cudaGraphAddChildGraphNode clones it); instantiating
# flattens it into the executable graph: its roots after the node's dependencies, and the node itself an empty node
# after its sinks, which its dependents wait for, so a backend sees only plain nodes.
"""Graphs, executable graphs and graph launches of a context."""

from __future__ import annotations

import builtins
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from mpsd.backends.ops import Copy, GraphLaunch, Launch, Memset, OnStream, Plan, Record, Work
from mpsd.runtime.limits import refused
from mpsd_protocol import Calls, InvalidValueError, brief

# type(), under a name of its own: methods here take a parameter called `type` (a node's). An alias, not a
# function, so that `_type(x) is int` narrows x as `type(x) is int` does.
_type = builtins.type

if TYPE_CHECKING:
    from mpsd.runtime.capture import Capture
    from mpsd.runtime.context import Counters
    from mpsd.runtime.streams import Event, Stream
    from mpsd.runtime.limits import ClientLimits
    from mpsd.runtime.memory import AddressSpace

__all__ = ["CAPTURED", "CHILD", "EMPTY", "EVENT_RECORD", "EVENT_WAIT", "KERNEL", "MEMCPY", "MEMSET", "MEM_ALLOC",
           "MEM_FREE", "Graph", "GraphCalls", "GraphExec", "Node"]

KERNEL, MEMSET, MEMCPY, EMPTY = "kernel", "memset", "memcpy", "empty"
# cudaGraphNodeTypeEventRecord, cudaGraphNodeTypeWaitEvent, cudaGraphNodeTypeGraph
EVENT_RECORD, EVENT_WAIT, CHILD = "event_record", "event_wait", "graph"
MEM_ALLOC, MEM_FREE = "mem_alloc", "mem_free"  # cudaGraphNodeTypeMemAlloc, MemFree (mpsd.runtime.graph_memory)
# cudaGraphExecUpdateResult
UPDATE_SUCCESS, UPDATE_TOPOLOGY_CHANGED, UPDATE_NODE_TYPE_CHANGED, UPDATE_NOT_SUPPORTED = 0, 2, 3, 6
INSTANTIATE_AUTO_FREE_ON_LAUNCH = 0x1  # cudaGraphInstantiateFlagAutoFreeOnLaunch
_COPY_CALLS = {"d2d": Calls.memcpy_dtod, "h2d": Calls.memcpy_htod, "d2h": Calls.memcpy_dtoh}


class _Captured:
    """The handle of work that a capture (or a graph being built) took as a node: done, as far as its stream
    is concerned, since nothing was queued."""

    __slots__ = ()
    done = True
    cancelled = False
    ended = float("nan")
    tag = None


CAPTURED = _Captured()


@dataclass(frozen=True, slots=True, eq=False)
class Node:
    """One node of a graph.

    Attributes:
        id: its handle, unique in the context.
        type: KERNEL, MEMSET, MEMCPY, EMPTY, EVENT_RECORD, EVENT_WAIT, CHILD, MEM_ALLOC or MEM_FREE.
        deps: the ids of the nodes of its graph it runs after.
        params: the arguments of the call it stands for (no stream), as nodes() shows them.
        plan: a kernel node's launch, checked.
        template: a memset's or a copy's work as the call built it; each launch runs a fresh copy of it.
        event: an event node's event (the context's Event).
        child: a child graph node's copy of its graph's nodes.
    """

    id: int
    type: str
    deps: tuple[int, ...]
    params: dict[str, Any]
    plan: Plan | None = None
    template: Work | None = field(default=None, repr=False)
    event: Any = field(default=None, repr=False)
    child: tuple[Node, ...] = field(default=(), repr=False)

    def describe(self) -> dict[str, Any]:
        params = dict(self.params)
        if self.type == CHILD:
            params["nodes"] = [node.describe() for node in self.child]
        return {"id": self.id, "type": self.type, "deps": list(self.deps), "params": params}


@dataclass(eq=False)
class Graph:
    """A graph's nodes by id, in the order they were added: each after the nodes it depends on; `budget`, its
    context's count of graph nodes, which each node taken takes from."""

    id: int
    nodes: dict[int, Node] = field(default_factory=dict)
    memory: bool = False  # it has memory nodes (mpsd.runtime.graph_memory's rules apply)
    execs: int = 0  # executable graphs made from it that live
    budget: NodeBudget | None = None

    def add(self, node: Node) -> Node:
        if self.budget is not None:
            self.budget.take(_size((node,)))
        self.nodes[node.id] = node
        return node

    @property
    def size(self) -> int:
        """Its nodes, a child graph's counted with its node."""
        return _size(self.nodes.values())


class NodeBudget:
    """The graph nodes a context holds, in its graphs and executable graphs, within the client's limit."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.held, self.limit = 0, limit

    def take(self, count: int) -> None:
        if self.held + count > self.limit:
            raise refused("graph_nodes", self.limit, self.held)
        self.held += count

    def give(self, count: int) -> None:
        self.held -= count


def _size(nodes: Iterable[Node]) -> int:
    return sum(1 + (_size(node.child) if node.child else 0) for node in nodes)

    def sinks(self) -> tuple[int, ...]:
        """The nodes no other node depends on."""
        needed = {d for node in self.nodes.values() for d in node.deps}
        return tuple(i for i in self.nodes if i not in needed)


@dataclass(eq=False)
class GraphExec:
    """An instantiated graph: its nodes fixed (until an update), child graphs flattened, the indices each depends
    on, where each node of the graph it was made from is among them (for set_kernel_params), and its last launch,
    which the next waits for."""

    id: int
    nodes: tuple[Node, ...]
    deps: tuple[tuple[int, ...], ...]
    kernels: int
    index: dict[int, int] = field(default_factory=dict)
    last: Work | None = None
    graph: Graph | None = None  # the graph it was made from, where that has memory nodes
    auto_free: bool = False  # cudaGraphInstantiateFlagAutoFreeOnLaunch


class GraphCalls:
    """The graph calls of a context (mixed into mpsd.runtime.context.Context, whose helpers they use)."""

    graphs: dict[int, Graph]
    execs: dict[int, GraphExec]
    # While a node is made by hand: the graph it goes into and its dependencies (the work the call builds is
    # taken there by _enqueue, as a capture's is); and the arguments of the call a node is being made of.
    _into: tuple[Graph, tuple[int, ...]] | None
    _node_params: dict[str, Any] | None
    _nodes: NodeBudget  # the nodes its graphs may still hold, of its client's limit

    if TYPE_CHECKING:  # what the Context they are mixed into has, for the type checker (the real ones are there)
        memory: AddressSpace
        counters: Counters
        limits: ClientLimits
        capturing: dict[int, Capture]  # (CaptureCalls')

        def _handle(self) -> int: ...
        def _stream(self, stream: int | None) -> Stream: ...
        def _event(self, event: int) -> Event: ...
        def _on(self, stream: Stream) -> OnStream: ...
        def _enqueue(self, stream: Stream, work: Work, count: int = 1) -> Work: ...
        def plan(self, name: str, grid: object, block: object, args: object, shared_mem: object) -> Plan: ...
        def memset(self, ptr: int, value: int, nbytes: int, stream: int | None) -> Work: ...
        def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: int | None) -> Work: ...
        def memcpy_htod(self, dst: int, host: int, offset: int, nbytes: int, stream: int | None,
                        staged: bool) -> Work: ...
        def memcpy_dtoh(self, host: int, offset: int, src: int, nbytes: int, stream: int | None) -> Work: ...
        # (GraphMemoryCalls')
        def _memory_node(self, graph: Graph, type: str, deps: tuple[int, ...], params: dict[str, Any]) -> Node: ...
        def _check_instantiate(self, graph: Graph) -> None: ...
        def _launching(self, ex: GraphExec, stream: Stream) -> None: ...
        def _memory_gone(self, graph: Graph) -> None: ...

    def _init_graphs(self) -> None:
        self.graphs, self.execs = {}, {}
        self._into = self._node_params = None
        self._nodes = NodeBudget(self.limits.graph_nodes)

    def _graphs_held(self) -> int:
        """Its graphs, executable graphs and captures under way (each builds a graph)."""
        return len(self.graphs) + len(self.execs) + len({id(c) for c in self.capturing.values()})

    def _new_graph(self) -> Graph:
        """An empty graph of this context's, within its client's limit on graphs."""
        held = self._graphs_held()
        limit = self.limits.graphs
        if held >= limit:
            raise refused("graphs", limit, held)
        return Graph(self._handle(), budget=self._nodes)

    def _graph(self, graph: int) -> Graph:
        found = self.graphs.get(graph)
        if found is None:
            raise InvalidValueError(f"no graph {brief(graph, 20)} in this context")
        return found

    def _exec(self, graph_exec: int) -> GraphExec:
        found = self.execs.get(graph_exec)
        if found is None:
            raise InvalidValueError(f"no executable graph {brief(graph_exec, 20)} in this context")
        return found

    # -- graphs ----------------------------------------------------------------------------------------
    def graph_create(self) -> int:
        """``cudaGraphCreate``: an empty graph."""
        graph = self._new_graph()
        self.graphs[graph.id] = graph
        return graph.id

    def graph_add_node(self, graph: int, type: str, deps: list[Any], params: dict[str, Any]) -> int:
        """``cudaGraphAdd{Kernel,Memset,Memcpy,Empty,EventRecord,EventWait,ChildGraph,MemAlloc,MemFree}Node``: a
        node of `type` after the nodes `deps`, its arguments those of the call it stands for, checked as that call
        checks them (an event node's `event`, a child graph node's `graph`, an allocation node's `nbytes`, a free
        node's `ptr`); its id.

        Raises:
            InvalidValueError: an unknown type, a dependency that is no node of the graph, or what the call
                would refuse (a range outside live memory, a pageable copy); the call's own errors otherwise.
            InvalidResourceHandleError: an event node's event is not this context's.
            NotSupportedError: a child graph with memory nodes (mpsd.runtime.graph_memory).
        """
        g = self._graph(graph)
        if not all(type_ is int for type_ in map(_type, deps)) or any(d not in g.nodes for d in deps) or (
                len(set(deps)) != len(deps)):
            raise InvalidValueError(f"dependencies {brief(deps, 40)} are not distinct nodes of graph {graph}")
        after = tuple(deps)
        if type == KERNEL:
            name, grid, block, args, shared_mem, _ = Calls.launch.check(params)
            plan = self.plan(name, grid, block, args, shared_mem)
            return g.add(self._kernel_node(plan, after)).id
        if type == EMPTY:
            return g.add(Node(self._handle(), EMPTY, after, {})).id
        if type in (EVENT_RECORD, EVENT_WAIT):
            event = params.get("event")
            if _type(event) is not int:
                raise InvalidValueError(f"an {type} node needs an event, not {brief(event, 20)}")
            e = self._event(event)
            return g.add(Node(self._handle(), type, after, {"event": e.id}, event=e)).id
        if type in (MEM_ALLOC, MEM_FREE):
            return g.add(self._memory_node(g, type, after, params)).id
        if type == CHILD:
            source = params.get("graph")
            if _type(source) is not int:
                raise InvalidValueError(f"a child graph node needs a graph, not {brief(source, 20)}")
            child = self._graph(source)
            if child is g:
                raise InvalidValueError("a graph cannot be its own child")
            self._check_child(child)
            nodes = self._copy_nodes(child.nodes.values())
            return g.add(Node(self._handle(), CHILD, after, {"graph": child.id}, child=nodes)).id
        kind = params.get("kind") if type == MEMCPY else None
        # (kind is what the client sent: a str, or anything, which finds no call)
        call = Calls.memset if type == MEMSET else _COPY_CALLS.get(kind) if type == MEMCPY else None  # type: ignore[arg-type]
        if call is None:
            raise InvalidValueError(f"no node of type {brief(type, 20)}"
                                    + (f" and kind {brief(kind, 20)}" if type == MEMCPY else ""))
        values = call.check(params)
        if params.get("stream") is not None or params.get("staged"):
            raise InvalidValueError(f"a {type} node names no stream and copies no pageable memory")
        self._node_params = _params(call, values, kind)
        self._into = (g, after)
        try:  # the call's own method builds the work, with its checks; _enqueue takes it into the graph
            if call is Calls.memset:
                self.memset(values[0], values[1], values[2], None)
            elif call is Calls.memcpy_dtod:
                self.memcpy_dtod(values[0], values[1], values[2], None)
            elif call is Calls.memcpy_htod:
                self.memcpy_htod(values[0], values[1], values[2], values[3], None, False)
            else:
                self.memcpy_dtoh(values[0], values[1], values[2], values[3], None)
        finally:
            self._into = self._node_params = None
        return next(reversed(g.nodes))

    def graph_get_nodes(self, graph: int) -> list[dict[str, Any]]:
        """``cudaGraphGetNodes`` with each node's type, dependencies and arguments, in the order they were made."""
        return [node.describe() for node in self._graph(graph).nodes.values()]

    def graph_clone(self, graph: int) -> int:
        """``cudaGraphClone``: a graph of the same nodes and edges, its nodes ids of their own.

        Raises:
            NotSupportedError: the graph has memory nodes.
        """
        source = self._graph(graph)
        self._check_clone(source)
        clone = self._new_graph()
        clone.budget = None  # its nodes are taken at once, so that a refusal leaves nothing taken
        for node in self._copy_nodes(source.nodes.values()):
            clone.add(node)
        self._nodes.take(clone.size)
        clone.budget = self._nodes
        self.graphs[clone.id] = clone
        return clone.id

    def _copy_nodes(self, nodes: Any) -> tuple[Node, ...]:
        """The nodes again, with ids of their own and the same edges."""
        ids: dict[int, int] = {}
        out = []
        for node in nodes:
            ids[node.id] = self._handle()
            out.append(dataclasses.replace(node, id=ids[node.id], deps=tuple(ids[d] for d in node.deps)))
        return tuple(out)

    def _flatten(self, nodes: Any) -> list[Node]:
        """The nodes with each child graph node's graph spliced in (module comment): its nodes get fresh ids, its
        roots run after the child node's dependencies, and the child node is an empty node after its sinks."""
        out: list[Node] = []
        for node in nodes:
            if node.type != CHILD:
                out.append(node)
                continue
            inner = self._flatten(node.child)
            ids = {n.id: self._handle() for n in inner}
            out += [dataclasses.replace(n, id=ids[n.id], deps=tuple(ids[d] for d in n.deps) or node.deps)
                    for n in inner]
            needed = {d for n in inner for d in n.deps}
            sinks = tuple(ids[n.id] for n in inner if n.id not in needed)
            out.append(Node(node.id, EMPTY, sinks or node.deps, {"graph": node.params["graph"]}))
        return out

    def _check_child(self, child: Graph) -> None:
        """Hook for the rules of what may be a child graph (memory nodes may not: mpsd.runtime.graph_memory)."""

    def _check_clone(self, graph: Graph) -> None:
        """Hook for the rules of what may be cloned (a graph with memory nodes may not)."""

    def graph_destroy(self, graph: int) -> None:
        """``cudaGraphDestroy``: executable graphs made from it stay."""
        g = self._graph(graph)
        del self.graphs[graph]
        self._nodes.give(g.size)
        if g.memory:
            self._memory_gone(g)

    # -- executable graphs -------------------------------------------------------------------------------
    def graph_instantiate(self, graph: int, flags: int = 0) -> int:
        """``cudaGraphInstantiateWithFlags``: an executable graph of the graph's nodes as they are now. `flags`:
        INSTANTIATE_AUTO_FREE_ON_LAUNCH (a relaunch frees what the last launch allocated and nobody freed).

        Raises:
            InvalidValueError: other flags. NotSupportedError: the graph has memory nodes and an executable
                graph already (one at a time).
        """
        g = self._graph(graph)
        if flags & ~INSTANTIATE_AUTO_FREE_ON_LAUNCH:
            raise InvalidValueError(f"graph_instantiate: bad flags {flags:#x}")
        if g.memory:
            self._check_instantiate(g)
        held = self._graphs_held()
        if held >= self.limits.graphs:
            raise refused("graphs", self.limits.graphs, held)
        nodes = tuple(self._flatten(g.nodes.values()))
        self._nodes.take(len(nodes))
        index = {node.id: i for i, node in enumerate(nodes)}
        graph_exec = GraphExec(self._handle(), nodes, tuple(tuple(index[d] for d in n.deps) for n in nodes),
                               sum(node.type == KERNEL for node in nodes), index, graph=g if g.memory else None,
                               auto_free=bool(flags & INSTANTIATE_AUTO_FREE_ON_LAUNCH))
        g.execs += 1
        self.execs[graph_exec.id] = graph_exec
        return graph_exec.id

    def graph_exec_update(self, graph_exec: int, graph: int) -> dict[str, Any]:
        """``cudaGraphExecUpdate``: the executable graph takes the graph's nodes' arguments (kernels' functions,
        grids, blocks, arguments; memsets' and copies' memory), where the graph has its shape. The result is
        cudaGraphExecUpdateResult's: 0 (updated), 2 (TOPOLOGY_CHANGED: a node or an edge more or less), 3
        (NODE_TYPE_CHANGED) or 6 (NOT_SUPPORTED: a memory node's allocation changed), with the node that differs,
        if one does; on a failure nothing changes. Child graphs are compared flattened."""
        ex, g = self._exec(graph_exec), self._graph(graph)
        nodes = tuple(self._flatten(g.nodes.values()))
        index = {node.id: i for i, node in enumerate(nodes)}
        deps = tuple(tuple(sorted(index[d] for d in n.deps)) for n in nodes)
        if len(nodes) != len(ex.nodes) or deps != tuple(tuple(sorted(d)) for d in ex.deps):
            return {"result": UPDATE_TOPOLOGY_CHANGED, "node": None}
        for old, new in zip(ex.nodes, nodes):
            if old.type != new.type:
                return {"result": UPDATE_NODE_TYPE_CHANGED, "node": new.id}
            if old.type in (MEM_ALLOC, MEM_FREE) and old.params != new.params:  # its memory is the graph's own
                return {"result": UPDATE_NOT_SUPPORTED, "node": new.id}
        ex.nodes, ex.deps = nodes, tuple(tuple(index[d] for d in n.deps) for n in nodes)
        return {"result": UPDATE_SUCCESS, "node": None}

    def graph_exec_kernel_node_set_params(self, graph_exec: int, node: int, params: dict[str, Any]) -> None:
        """``cudaGraphExecKernelNodeSetParams``: the executable graph's copy of kernel node `node` (a node of the
        graph it was instantiated from) takes new arguments: function, grid, block, arguments, shared memory,
        checked as a launch's are; the graph itself is unchanged. Launches already made keep what they had.

        Raises:
            InvalidValueError: `node` is no kernel node of the graph it was made from; a launch's errors otherwise.
        """
        ex = self._exec(graph_exec)
        at = ex.index.get(node) if _type(node) is int else None
        if at is None or ex.nodes[at].type != KERNEL:
            raise InvalidValueError(f"node {brief(node, 20)} is no kernel node of executable graph {graph_exec}")
        name, grid, block, args, shared_mem, _ = Calls.launch.check(params)
        plan = self.plan(name, grid, block, args, shared_mem)
        nodes = list(ex.nodes)
        nodes[at] = dataclasses.replace(self._kernel_node(plan, nodes[at].deps), id=nodes[at].id)
        ex.nodes = tuple(nodes)

    def graph_exec_destroy(self, graph_exec: int) -> None:
        """``cudaGraphExecDestroy``: launches already queued still run."""
        ex = self._exec(graph_exec)
        del self.execs[graph_exec]
        self._nodes.give(len(ex.nodes))
        if ex.graph is not None:
            ex.graph.execs -= 1
            self._memory_gone(ex.graph)

    def graph_launch(self, graph_exec: int, stream: int | None) -> Work:
        """``cudaGraphLaunch``: the graph's nodes, as one unit of work on `stream`, after the stream's earlier work
        (the legacy default stream's rules included) and the executable graph's previous launch. Memory a kernel
        node's pointer names is looked up now, as a launch's is.

        Raises:
            InvalidValueError: no such executable graph. InvalidResourceHandleError: no such stream.
            OutOfMemoryError: the backend cannot hold what its nodes would touch.
        """
        ex = self._exec(graph_exec)
        s: Stream = self._stream(stream)
        if ex.graph is not None or any(node.type == MEM_FREE for node in ex.nodes):
            self._launching(ex, s)
        on = self._on(s)
        work = GraphLaunch(**on, nodes=tuple(self._node_work(node, on) for node in ex.nodes), deps=ex.deps, graph=ex)
        if ex.last is not None and not ex.last.done:
            work.after = (ex.last,)
        # A wait node's record that no backend has yet (the kernel dispatcher holds it) is the whole launch's
        # dependency too: the dispatcher looks only at a work's own `after` before it releases it, and a
        # backend cannot wait for a record it has never been given.
        held = tuple(r for node in work.nodes for r in node.after if r.handle is None)
        if held:
            work.after += held
        self._enqueue(s, work)
        if work.handle is not CAPTURED:
            ex.last = work
            self.counters.launches += ex.kernels
            self._records(ex, work)
        return work

    # -- nodes -------------------------------------------------------------------------------------------
    def _kernel_node(self, plan: Plan, deps: tuple[int, ...]) -> Node:
        return Node(self._handle(), KERNEL, deps, {
            "name": plan.kernel, "grid": list(plan.grid), "block": list(plan.block), "args": list(plan.args),
            "shared_mem": plan.shared_mem}, plan=plan)

    def _node_of(self, work: Work, deps: tuple[int, ...]) -> Node:
        """The node of work a capture (or a node made by hand) took instead of queuing it."""
        if isinstance(work, Launch):
            return self._kernel_node(work.plan, deps)
        params = dict(self._node_params or {})
        if isinstance(work, Copy):
            params.setdefault("kind", work.kind)
            return Node(self._handle(), MEMCPY, deps, params, template=work)
        if isinstance(work, Memset):
            return Node(self._handle(), MEMSET, deps, params, template=work)
        return Node(self._handle(), EMPTY, deps, {})

    def _add_nodes(self, graph: Graph, work: Work, deps: tuple[int, ...], count: int = 1) -> tuple[int, ...]:
        """Take `work` (`count` launches of it) into `graph` after `deps`, as nodes; the nodes that work after it
        on the same stream depends on. A graph launched into a capture adds its nodes (CUDA makes a child graph
        node of it: the same work in the same order)."""
        if isinstance(work, GraphLaunch):
            ex: GraphExec = work.graph
            ids: list[int] = []
            for node, node_deps in zip(ex.nodes, ex.deps):
                ids.append(self._handle())
                graph.add(dataclasses.replace(node, id=ids[-1], deps=tuple(ids[d] for d in node_deps) or deps))
            needed = {d for node_deps in ex.deps for d in node_deps}
            return tuple(ids[i] for i in range(len(ids)) if i not in needed) or deps
        for _ in range(count):
            deps = (graph.add(self._node_of(work, deps)).id,)
        return deps

    def _node_work(self, node: Node, on: OnStream) -> Work:
        """A node's work for one launch, on the launch's stream with its quotas."""
        if node.type == KERNEL:
            plan = node.plan
            assert plan is not None
            memory = self.memory
            extents = tuple((index, memory.extent(int(plan.args[index]), nbytes))
                            for index, nbytes in plan.touches)
            return Launch.of(on["client"], on["stream"], on["priority"], on["sm_cap"], plan, extents)
        if node.template is not None:
            return dataclasses.replace(node.template, **on, after=(), handle=None)
        if node.type == EVENT_WAIT:  # the record it waits for is the event's latest as of this launch
            record = node.event.record
            return Record(**on, after=(record,) if record is not None and not record.done else ())
        return Record(**on)  # an empty node, or an event record node (graph_launch makes it the event's record)

    def _records(self, ex: GraphExec, work: GraphLaunch) -> None:
        """A launch's event record nodes are their events' latest records (in node order, as they were made)."""
        for node, node_work in zip(ex.nodes, work.nodes):
            if node.type == EVENT_RECORD:
                node.event.cell.record = node_work
                node.event.captured = None


def _params(call: Any, values: tuple[Any, ...], kind: str | None) -> dict[str, Any]:
    """A node's arguments for nodes(): the call's, without its stream and staging."""
    params = {arg.name: value for arg, value in zip(call.args, values) if arg.name not in ("stream", "staged")}
    if kind is not None:
        params = {"kind": kind, **params}
    return params
