# Graph memory nodes (cudaGraphAddMemAllocNode, cudaGraphAddMemFreeNode, and what a capture makes of
# cudaMallocAsync and cudaFreeAsync), with CUDA's rules, as its documentation states them (no H200 measurement
# covers them yet):
#
# - An allocation node's address is given when the node is made and stays the same for every instantiation and
#   launch of its graph: replays reuse the same addresses.
# - Freed by a free node of its own graph, the allocation is the graph's alone: it may not be freed outside, nor
#   twice in the graph. Not freed there, it is live after each launch, for work after the launch, until it is
#   freed outside: by free_async or cudaFree, or by another graph's free node when that runs. Launching its graph
#   again while it is live is cudaErrorInvalidValue, unless the executable graph was instantiated with
#   AutoFreeOnLaunch, where the relaunch frees it.
# - A graph with memory nodes has at most one executable graph at a time, cannot be cloned and cannot be a child
#   graph (cudaErrorNotSupported here; CUDA says only "an error"), and an update may not change its memory nodes
#   (cudaGraphExecUpdateErrorNotSupported).
#
# The bytes are backed when the node is made (the daemon's memory, charged to the client as cudaMalloc's are) and
# given back when the graph and its executable graph are gone and nothing outside holds them live. CUDA maps
# physical memory only between the allocation and the free as the graph runs, and reuses it between graphs; mpsd
# keeps it for the graph's life, and a kernel touching it outside that window is not an error here.
"""Memory allocation and free nodes of graphs."""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpsd.runtime.graphs import MEM_ALLOC, MEM_FREE, Graph, GraphExec, Node
from mpsd_protocol import (
    InvalidValueError,
    NotSupportedError,
    StreamCaptureInvalidatedError,
    brief,
)

if TYPE_CHECKING:
    from mpsd.backends.base import Backend
    from mpsd.backends.ops import Work
    from mpsd.runtime.capture import Capture
    from mpsd.runtime.streams import Stream
    from mpsd.runtime.memory import AddressSpace, Allocation

__all__ = ["GraphAllocation", "GraphMemoryCalls"]

# type(), under a name of its own: methods here take a parameter called `type` (a node's). An alias, not a
# function, so that `type_of(x) is int` narrows x as `type(x) is int` does.
type_of = builtins.type


@dataclass(eq=False)
class GraphAllocation:
    """An allocation node's memory.

    Attributes:
        addr, nbytes: where it is.
        graph: the graph whose allocation node it is.
        freed_in_graph: a free node of that graph frees it.
        live: a launch allocated it and nothing has freed it since.
    """

    addr: int
    nbytes: int
    graph: Graph
    freed_in_graph: bool = False
    live: bool = False


class GraphMemoryCalls:
    """The memory node rules of a context (mixed into mpsd.runtime.context.Context, before GraphCalls)."""

    graph_allocs: dict[int, GraphAllocation]

    if TYPE_CHECKING:  # what the Context they are mixed into has, for the type checker (the real ones are there)
        memory: AddressSpace
        backend: Backend
        capturing: dict[int, Capture]  # (CaptureCalls')
        graphs: dict[int, Graph]  # (GraphCalls')

        def _handle(self) -> int: ...
        def _stream(self, stream: int | None) -> Stream: ...
        def _pool_stream(self, stream: object) -> Stream: ...
        def _map_new(self, nbytes: int, pool: bool) -> int: ...
        def _drop(self, alloc: Allocation, released: int, in_use: int | None = None) -> None: ...
        def tails(self) -> list[Work]: ...

    def _init_graph_memory(self) -> None:
        self.graph_allocs = {}

    # -- the calls ---------------------------------------------------------------------------------------
    def graph_mem_alloc(self, nbytes: int, stream: int | None) -> int:
        """cudaMallocAsync on `stream`: where it captures, an allocation node of its capture's graph after the
        stream's nodes so far; its address. 0 where it does not (the client's pool serves the call).

        Raises:
            InvalidValueError: no bytes. OutOfMemoryError: as cudaMalloc's. StreamCaptureInvalidatedError: the
                capture was invalidated.
        """
        s = self._stream(stream)
        cap = self.capturing.get(s.id)
        if cap is None:
            return 0
        if cap.invalidated:
            raise StreamCaptureInvalidatedError(f"the capture on stream {cap.origin} was invalidated")
        node = cap.graph.add(self._memory_node(cap.graph, MEM_ALLOC, cap.deps[s.id], {"nbytes": nbytes}))
        cap.deps[s.id] = (node.id,)
        return node.params["ptr"]

    def _graph_free(self, ptr: object, stream: object) -> None:
        """A free_async (or cudaFree) of a graph's allocation on `stream` (mem_pool_ops' POOL_GRAPH_FREE): a free node
        where the stream captures, else a free of a live allocation, in stream order.

        Raises:
            InvalidValueError: no graph allocation; one its own graph frees; one not live (never launched, or freed
                already).
        """
        alloc = self.graph_allocs.get(ptr) if type(ptr) is int else None
        if alloc is None:
            raise InvalidValueError(f"{brief(ptr, 20)} is no graph allocation of this context")
        s = self._pool_stream(stream)
        cap = self.capturing.get(s.id)
        if cap is not None:
            if cap.invalidated:
                raise StreamCaptureInvalidatedError(f"the capture on stream {cap.origin} was invalidated")
            node = cap.graph.add(self._memory_node(cap.graph, MEM_FREE, cap.deps[s.id], {"ptr": ptr}))
            cap.deps[s.id] = (node.id,)
            return
        if alloc.freed_in_graph:
            raise InvalidValueError(f"{ptr:#x} is freed by its own graph: it cannot be freed outside it")
        if not alloc.live:
            raise InvalidValueError(f"{ptr:#x} is not live: its graph has not allocated it since it was last freed")
        alloc.live = False
        self._release_if_unused(alloc)

    # -- nodes -------------------------------------------------------------------------------------------
    def _memory_node(self, graph: Graph, type: str, deps: tuple[int, ...], params: dict[str, Any]) -> Node:
        """An allocation node (params: nbytes; it gets its address) or a free node (params: ptr) of `graph`.

        Raises:
            InvalidValueError: no bytes, or a free of no graph allocation, or of one this graph frees already.
        """
        if type == MEM_ALLOC:
            nbytes = params.get("nbytes")
            if type_of(nbytes) is not int or nbytes <= 0:
                raise InvalidValueError(f"an allocation node needs a byte count above 0, not {brief(nbytes, 20)}")
            addr = self._map_new(nbytes, pool=False)
            self.graph_allocs[addr] = GraphAllocation(addr, nbytes, graph)
            graph.memory = True
            return Node(self._handle(), MEM_ALLOC, deps, {"nbytes": nbytes, "ptr": addr})
        ptr = params.get("ptr")
        alloc = self.graph_allocs.get(ptr) if type_of(ptr) is int else None
        if alloc is None:
            raise InvalidValueError(f"a free node frees an allocation node's address, not {brief(ptr, 20)}")
        if alloc.graph is graph:
            if alloc.freed_in_graph:
                raise InvalidValueError(f"{ptr:#x} is freed twice in graph {graph.id}")
            alloc.freed_in_graph = True
        graph.memory = True
        return Node(self._handle(), MEM_FREE, deps, {"ptr": ptr})

    # -- the rules (GraphCalls' hooks) ---------------------------------------------------------------------
    def _check_child(self, child: Graph) -> None:
        if child.memory:
            raise NotSupportedError(f"graph {child.id} has memory nodes: it cannot be a child graph")

    def _check_clone(self, graph: Graph) -> None:
        if graph.memory:
            raise NotSupportedError(f"graph {graph.id} has memory nodes: it cannot be cloned")

    def _check_instantiate(self, graph: Graph) -> None:
        if graph.execs:
            raise NotSupportedError(f"graph {graph.id} has memory nodes and an executable graph already: destroy "
                                    "that one first")

    def _launching(self, ex: GraphExec, stream: Stream) -> None:
        """Before a launch of a graph with memory nodes (or free nodes of other graphs' allocations): what the last
        launch allocated and nobody freed (freed now, under AutoFreeOnLaunch), and what its free nodes free, which
        must be live; then what the launch leaves live.

        Raises:
            InvalidValueError: an allocation of the last launch is still live, or a free node's allocation is not.
            NotSupportedError: it would be captured into another graph.
        """
        if self.capturing.get(stream.id) is not None:
            raise NotSupportedError("a graph with memory nodes cannot be launched into a capture")
        allocs = [self.graph_allocs[n.params["ptr"]] for n in ex.nodes if n.type == MEM_ALLOC]
        frees = [self.graph_allocs.get(n.params["ptr"]) for n in ex.nodes if n.type == MEM_FREE]
        foreign = [a for a in frees if a is not None and a.graph is not ex.graph]
        for alloc in allocs:
            if alloc.live and not ex.auto_free:
                raise InvalidValueError(f"the graph's allocation at {alloc.addr:#x} from its last launch is not "
                                        "freed (free it, or instantiate with auto_free_on_launch)")
        for alloc in foreign:
            if not alloc.live:
                raise InvalidValueError(f"a free node frees {alloc.addr:#x}, which is not live")
        for alloc in allocs:
            alloc.live = not alloc.freed_in_graph
        for alloc in foreign:
            alloc.live = False
            self._release_if_unused(alloc)

    def _memory_gone(self, graph: Graph) -> None:
        """The graph or its executable graph is destroyed: allocations nothing can reach any more go back."""
        for alloc in [a for a in self.graph_allocs.values() if a.graph is graph]:
            self._release_if_unused(alloc)

    def _release_if_unused(self, alloc: GraphAllocation) -> None:
        graph = alloc.graph
        if alloc.live or graph.execs or self.graphs.get(graph.id) is graph:
            return
        del self.graph_allocs[alloc.addr]
        # After the work queued so far, which may still use it, as a pool's memory goes (Context._pool_release).
        memory, released = self.memory.remove(alloc.addr)
        self.backend.when_done(self.tails(), lambda: self._drop(memory, released))

