# Graph memory nodes (mpsd.runtime.graph_memory): malloc_async and free_async in a capture become allocation and
# free nodes, whose address is the graph's for good, and CUDA's rules for freeing them inside and outside the graph,
# relaunching while an allocation is live, AutoFreeOnLaunch, one executable graph at a time, no clone and no child.
# In process, under the autojump clock (tests/inproc.py).
from __future__ import annotations

import numpy as np
import pytest

from mpsd_client import InvalidValueError, NotSupportedError

N = 4096


async def floats(actx, ptr, n: int = N) -> np.ndarray:
    return np.frombuffer(await actx.host_view(ptr), np.float32)[:n].copy()


async def test_a_captured_alloc_and_free_are_nodes_and_each_replay_uses_the_same_address(actx, autojump_clock):
    """malloc_async, two kernels on the memory, free_async, all captured: an allocation node, the kernels, a free
    node, with the allocation's address in the node; three launches compute through that same address; it may not
    be freed outside (its graph frees it), and its bytes go back once the graph and its executable graph are gone."""
    s = await actx.create_stream()
    out = await actx.malloc(4 * N)
    free_before = (await actx.mem_get_info())[0]
    await s.begin_capture()
    tmp = await actx.malloc_async(4 << 20, s)  # whole pages: what the device has free shows it
    await actx.launch("fill_f32", 16, 256, [tmp, 1.5, N], stream=s)
    await actx.launch("vector_add_f32", 16, 256, [tmp, tmp, out, N], stream=s)
    actx.free_async(tmp, s)
    graph = await s.end_capture()
    nodes = await graph.nodes()
    assert [n.type for n in nodes] == ["mem_alloc", "kernel", "kernel", "mem_free"]
    assert nodes[0].params == {"nbytes": 4 << 20, "ptr": tmp} and nodes[3].params == {"ptr": tmp}
    assert (await actx.mem_get_info())[0] < free_before
    executable = await graph.instantiate()
    for _ in range(3):
        await actx.memset(out, 0, 4 * N, s)
        await executable.launch(s)
        await s.synchronize()
        assert (await floats(actx, out) == 3.0).all()
        assert [n.params for n in await graph.nodes()][0]["ptr"] == tmp
    actx.free_async(tmp, s)
    with pytest.raises(InvalidValueError):
        await actx.synchronize()
    await executable.destroy()
    await graph.destroy()
    await actx.synchronize()
    assert (await actx.mem_get_info())[0] == free_before


async def test_an_allocation_the_graph_does_not_free_lives_until_freed_outside(actx, autojump_clock):
    """Not freed in its graph, the allocation is live after a launch (work after it reads what the graph wrote);
    launching again before it is freed is cudaErrorInvalidValue at the next synchronisation; freed with free_async,
    the graph launches again and the address is the same. A free before any launch is refused (not live)."""
    s = await actx.create_stream()
    await s.begin_capture()
    kept = await actx.malloc_async(4 * N, s)
    await actx.launch("fill_f32", 16, 256, [kept, 7.0, N], stream=s)
    graph = await s.end_capture()
    actx.free_async(kept, s)
    with pytest.raises(InvalidValueError):
        await actx.synchronize()
    executable = await graph.instantiate()
    await executable.launch(s)
    await s.synchronize()
    assert (await floats(actx, kept) == 7.0).all()
    await executable.launch(s)
    with pytest.raises(InvalidValueError, match="not freed"):
        await actx.synchronize()
    actx.free_async(kept, s)
    await actx.launch("fill_f32", 16, 256, [kept, 0.0, N], stream=s)  # (the bytes are mpsd's until the graph goes)
    await executable.launch(s)
    await s.synchronize()
    assert (await floats(actx, kept) == 7.0).all()
    assert (await graph.nodes())[0].params["ptr"] == kept


async def test_auto_free_on_launch_frees_the_last_launchs_allocation(actx, autojump_clock):
    """Instantiated with auto_free_on_launch, a graph whose allocation is never freed launches again and again."""
    graph = await actx.graph_create()
    alloc = await graph.add_mem_alloc_node(4 * N)
    ptr = alloc.params["ptr"]
    await graph.add_kernel_node("fill_f32", 16, 256, [ptr, 2.0, N], deps=[alloc])
    executable = await graph.instantiate(auto_free_on_launch=True)
    for _ in range(3):
        await executable.launch()
    await actx.synchronize()
    assert (await floats(actx, ptr) == 2.0).all()


async def test_a_graph_with_memory_nodes_has_one_executable_graph_no_clone_and_is_no_child(actx, autojump_clock):
    """cudaErrorNotSupported for a second instantiation (until the first is destroyed), a clone, and a child graph
    node of it; a free node of an address no allocation node gave, or a second free of one in the same graph, is
    cudaErrorInvalidValue."""
    graph = await actx.graph_create()
    alloc = await graph.add_mem_alloc_node(4096)
    await graph.add_mem_free_node(alloc.params["ptr"], deps=[alloc])
    with pytest.raises(InvalidValueError):
        await graph.add_mem_free_node(alloc.params["ptr"])
    with pytest.raises(InvalidValueError):
        await graph.add_mem_free_node(await actx.malloc(4096))
    first = await graph.instantiate()
    with pytest.raises(NotSupportedError):
        await graph.instantiate()
    await first.destroy()
    await graph.instantiate()
    with pytest.raises(NotSupportedError):
        await graph.clone()
    parent = await actx.graph_create()
    with pytest.raises(NotSupportedError):
        await parent.add_child_graph_node(graph)


async def test_another_graphs_free_node_frees_a_live_allocation(actx, autojump_clock):
    """A graph that allocates and one that frees what the first left live: the first relaunches once the second
    has run; the second run again, with nothing live to free, is cudaErrorInvalidValue."""
    maker, freer = await actx.graph_create(), await actx.graph_create()
    alloc = await maker.add_mem_alloc_node(4096)
    await freer.add_mem_free_node(alloc.params["ptr"])
    make, free = await maker.instantiate(), await freer.instantiate()
    await make.launch()
    await free.launch()
    await make.launch()
    await actx.synchronize()
    await free.launch()
    await free.launch()
    with pytest.raises(InvalidValueError):
        await actx.synchronize()


async def test_an_update_may_not_change_a_memory_node(actx, autojump_clock):
    """cudaGraphExecUpdate from the graph itself succeeds; from another graph of the same shape, whose allocation
    node has an address of its own, it is cudaGraphExecUpdateErrorNotSupported, and nothing changes."""
    from mpsd_client import GraphExecUpdateFailureError

    first, second = await actx.graph_create(), await actx.graph_create()
    for graph in (first, second):
        await graph.add_mem_alloc_node(4096)
    executable = await first.instantiate(auto_free_on_launch=True)
    await executable.update(first)
    with pytest.raises(GraphExecUpdateFailureError) as failed:
        await executable.update(second)
    assert failed.value.result == "NOT_SUPPORTED"
    await executable.launch()
    await actx.synchronize()
