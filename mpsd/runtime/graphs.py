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
"""Graphs, executable graphs and graph launches of a context."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mpsd.backends.ops import Copy, GraphLaunch, Launch, Memset, Plan, Record, Work
from mpsd_protocol import Calls, InvalidValueError, brief  # type: ignore[attr-defined]

if TYPE_CHECKING:
    from mpsd.runtime.context import Stream

__all__ = ["CAPTURED", "EMPTY", "KERNEL", "MEMCPY", "MEMSET", "Graph", "GraphCalls", "GraphExec", "Node"]

KERNEL, MEMSET, MEMCPY, EMPTY = "kernel", "memset", "memcpy", "empty"
# cudaGraphExecUpdateResult
UPDATE_SUCCESS, UPDATE_TOPOLOGY_CHANGED, UPDATE_NODE_TYPE_CHANGED = 0, 2, 3
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
        type: KERNEL, MEMSET, MEMCPY or EMPTY.
        deps: the ids of the nodes of its graph it runs after.
        params: the arguments of the call it stands for (no stream), as nodes() shows them.
        plan: a kernel node's launch, checked.
        template: a memset's or a copy's work as the call built it; each launch runs a fresh copy of it.
    """

    id: int
    type: str
    deps: tuple[int, ...]
    params: dict[str, Any]
    plan: Plan | None = None
    template: Work | None = field(default=None, repr=False)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "deps": list(self.deps), "params": dict(self.params)}


@dataclass(eq=False)
class Graph:
    """A graph's nodes by id, in the order they were added: each after the nodes it depends on."""

    id: int
    nodes: dict[int, Node] = field(default_factory=dict)

    def add(self, node: Node) -> Node:
        self.nodes[node.id] = node
        return node

    def sinks(self) -> tuple[int, ...]:
        """The nodes no other node depends on."""
        needed = {d for node in self.nodes.values() for d in node.deps}
        return tuple(i for i in self.nodes if i not in needed)


@dataclass(eq=False)
class GraphExec:
    """An instantiated graph: its nodes fixed (until an update), the indices each depends on, and its last
    launch, which the next waits for."""

    id: int
    nodes: tuple[Node, ...]
    deps: tuple[tuple[int, ...], ...]
    kernels: int
    last: Work | None = None


class GraphCalls:
    """The graph calls of a context (mixed into mpsd.runtime.context.Context, whose helpers they use)."""

    graphs: dict[int, Graph]
    execs: dict[int, GraphExec]
    # While a node is made by hand: the graph it goes into and its dependencies (the work the call builds is
    # taken there by _enqueue, as a capture's is); and the arguments of the call a node is being made of.
    _into: tuple[Graph, tuple[int, ...]] | None
    _node_params: dict[str, Any] | None

    def _init_graphs(self) -> None:
        self.graphs, self.execs = {}, {}
        self._into = self._node_params = None

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
        graph = Graph(self._handle())  # type: ignore[attr-defined]
        self.graphs[graph.id] = graph
        return graph.id

    def graph_add_node(self, graph: int, type: str, deps: list[Any], params: dict[str, Any]) -> int:
        """``cudaGraphAdd{Kernel,Memset,Memcpy,Empty}Node``: a node of `type` after the nodes `deps`, its
        arguments those of the call it stands for, checked as that call checks them; its id.

        Raises:
            InvalidValueError: an unknown type, a dependency that is no node of the graph, or what the call
                would refuse (a range outside live memory, a pageable copy); the call's own errors otherwise.
        """
        g = self._graph(graph)
        if not all(type_ is int for type_ in map(_type, deps)) or any(d not in g.nodes for d in deps) or (
                len(set(deps)) != len(deps)):
            raise InvalidValueError(f"dependencies {brief(deps, 40)} are not distinct nodes of graph {graph}")
        after = tuple(deps)
        if type == KERNEL:
            name, grid, block, args, shared_mem, _ = Calls.launch.check(params)
            plan = self.plan(name, grid, block, args, shared_mem)  # type: ignore[attr-defined]
            return g.add(self._kernel_node(plan, after)).id
        if type == EMPTY:
            return g.add(Node(self._handle(), EMPTY, after, {})).id  # type: ignore[attr-defined]
        kind = params.get("kind") if type == MEMCPY else None
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
                self.memset(*values[:3], None)  # type: ignore[attr-defined]
            elif call is Calls.memcpy_dtod:
                self.memcpy_dtod(*values[:3], None)  # type: ignore[attr-defined]
            elif call is Calls.memcpy_htod:
                self.memcpy_htod(*values[:4], None, False)  # type: ignore[attr-defined]
            else:
                self.memcpy_dtoh(*values[:4], None)  # type: ignore[attr-defined]
        finally:
            self._into = self._node_params = None
        return next(reversed(g.nodes))

    def graph_get_nodes(self, graph: int) -> list[dict[str, Any]]:
        """``cudaGraphGetNodes`` with each node's type, dependencies and arguments, in the order they were made."""
        return [node.describe() for node in self._graph(graph).nodes.values()]

    def graph_clone(self, graph: int) -> int:
        """``cudaGraphClone``: a graph of the same nodes and edges, its nodes ids of their own."""
        source = self._graph(graph)
        clone = Graph(self._handle())  # type: ignore[attr-defined]
        ids: dict[int, int] = {}
        for node in source.nodes.values():
            ids[node.id] = self._handle()  # type: ignore[attr-defined]
            clone.add(dataclasses.replace(node, id=ids[node.id], deps=tuple(ids[d] for d in node.deps)))
        self.graphs[clone.id] = clone
        return clone.id

    def graph_destroy(self, graph: int) -> None:
        """``cudaGraphDestroy``: executable graphs made from it stay."""
        self._graph(graph)
        del self.graphs[graph]

    # -- executable graphs -------------------------------------------------------------------------------
    def graph_instantiate(self, graph: int) -> int:
        """``cudaGraphInstantiate``: an executable graph of the graph's nodes as they are now."""
        g = self._graph(graph)
        nodes = tuple(g.nodes.values())
        index = {node.id: i for i, node in enumerate(nodes)}
        graph_exec = GraphExec(self._handle(), nodes, tuple(tuple(index[d] for d in n.deps) for n in nodes),  # type: ignore[attr-defined]
                               sum(node.type == KERNEL for node in nodes))
        self.execs[graph_exec.id] = graph_exec
        return graph_exec.id

    def graph_exec_update(self, graph_exec: int, graph: int) -> dict[str, Any]:
        """``cudaGraphExecUpdate``: the executable graph takes the graph's nodes' arguments (kernels' functions,
        grids, blocks, arguments; memsets' and copies' memory), where the graph has its shape. The result is
        cudaGraphExecUpdateResult's: 0 (updated), 2 (TOPOLOGY_CHANGED: a node or an edge more or less) or 3
        (NODE_TYPE_CHANGED), with the node that differs, if one does; on a failure nothing changes."""
        ex, g = self._exec(graph_exec), self._graph(graph)
        nodes = tuple(g.nodes.values())
        index = {node.id: i for i, node in enumerate(nodes)}
        deps = tuple(tuple(sorted(index[d] for d in n.deps)) for n in nodes)
        if len(nodes) != len(ex.nodes) or deps != tuple(tuple(sorted(d)) for d in ex.deps):
            return {"result": UPDATE_TOPOLOGY_CHANGED, "node": None}
        for old, new in zip(ex.nodes, nodes):
            if old.type != new.type:
                return {"result": UPDATE_NODE_TYPE_CHANGED, "node": new.id}
        ex.nodes, ex.deps = nodes, tuple(tuple(index[d] for d in n.deps) for n in nodes)
        return {"result": UPDATE_SUCCESS, "node": None}

    def graph_exec_destroy(self, graph_exec: int) -> None:
        """``cudaGraphExecDestroy``: launches already queued still run."""
        self._exec(graph_exec)
        del self.execs[graph_exec]

    def graph_launch(self, graph_exec: int, stream: int | None) -> Work:
        """``cudaGraphLaunch``: the graph's nodes, as one unit of work on `stream`, after the stream's earlier work
        (the legacy default stream's rules included) and the executable graph's previous launch. Memory a kernel
        node's pointer names is looked up now, as a launch's is.

        Raises:
            InvalidValueError: no such executable graph. InvalidResourceHandleError: no such stream.
            OutOfMemoryError: the backend cannot hold what its nodes would touch.
        """
        ex = self._exec(graph_exec)
        s: Stream = self._stream(stream)  # type: ignore[attr-defined]
        on = self._on(s)  # type: ignore[attr-defined]
        work = GraphLaunch(**on, nodes=tuple(self._node_work(node, on) for node in ex.nodes), deps=ex.deps, graph=ex)
        if ex.last is not None and not ex.last.done:
            work.after = (ex.last,)
        self._enqueue(s, work)  # type: ignore[attr-defined]
        if work.handle is not CAPTURED:
            ex.last = work
            self.counters.launches += ex.kernels  # type: ignore[attr-defined]
        return work

    # -- nodes -------------------------------------------------------------------------------------------
    def _kernel_node(self, plan: Plan, deps: tuple[int, ...]) -> Node:
        return Node(self._handle(), KERNEL, deps, {  # type: ignore[attr-defined]
            "name": plan.kernel, "grid": list(plan.grid), "block": list(plan.block), "args": list(plan.args),
            "shared_mem": plan.shared_mem}, plan=plan)

    def _node_of(self, work: Work, deps: tuple[int, ...]) -> Node:
        """The node of work a capture (or a node made by hand) took instead of queuing it."""
        if isinstance(work, Launch):
            return self._kernel_node(work.plan, deps)
        params = dict(self._node_params or {})
        if isinstance(work, Copy):
            params.setdefault("kind", work.kind)
            return Node(self._handle(), MEMCPY, deps, params, template=work)  # type: ignore[attr-defined]
        if isinstance(work, Memset):
            return Node(self._handle(), MEMSET, deps, params, template=work)  # type: ignore[attr-defined]
        return Node(self._handle(), EMPTY, deps, {})  # type: ignore[attr-defined]

    def _add_nodes(self, graph: Graph, work: Work, deps: tuple[int, ...], count: int = 1) -> tuple[int, ...]:
        """Take `work` (`count` launches of it) into `graph` after `deps`, as nodes; the nodes that work after it
        on the same stream depends on. A graph launched into a capture adds its nodes (CUDA makes a child graph
        node of it: the same work in the same order)."""
        if isinstance(work, GraphLaunch):
            ex: GraphExec = work.graph
            ids: list[int] = []
            for node, node_deps in zip(ex.nodes, ex.deps):
                ids.append(self._handle())  # type: ignore[attr-defined]
                graph.add(dataclasses.replace(node, id=ids[-1], deps=tuple(ids[d] for d in node_deps) or deps))
            needed = {d for node_deps in ex.deps for d in node_deps}
            return tuple(ids[i] for i in range(len(ids)) if i not in needed) or deps
        for _ in range(count):
            deps = (graph.add(self._node_of(work, deps)).id,)
        return deps

    def _node_work(self, node: Node, on: dict[str, Any]) -> Work:
        """A node's work for one launch, on the launch's stream with its quotas."""
        if node.type == KERNEL:
            plan = node.plan
            assert plan is not None
            memory = self.memory  # type: ignore[attr-defined]
            extents = tuple((index, memory.extent(int(plan.args[index]), nbytes))  # type: ignore[arg-type]
                            for index, nbytes in plan.touches)
            return Launch.of(on["client"], on["stream"], on["priority"], on["sm_cap"], plan, extents)
        if node.template is not None:
            return dataclasses.replace(node.template, **on, after=(), handle=None)  # type: ignore[type-var]
        return Record(**on)


def _type(value: Any) -> type:
    return type(value)


def _params(call: Any, values: tuple[Any, ...], kind: str | None) -> dict[str, Any]:
    """A node's arguments for nodes(): the call's, without its stream and staging."""
    params = {arg.name: value for arg, value in zip(call.args, values) if arg.name not in ("stream", "staged")}
    if kind is not None:
        params = {"kind": kind, **params}
    return params
