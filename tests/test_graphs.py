# Graphs: what their launches compute (the simulator computes the built-in kernels on the real bytes), the order
# their nodes run in, their lifecycle (instantiate, launch again, update, clone, destroy), the seed's
# simpleCudaGraphs shapes, and what a graph launch costs the host beside the same launches one by one. In process,
# under the autojump clock (tests/inproc.py), but for the virtual clock's figures.
from __future__ import annotations

import numpy as np
import pytest

from inproc import in_process_daemon
from mpsd.sim import H200
from mpsd_client import GraphExecUpdateFailureError, IllegalAddressError, InvalidValueError

N = 4096
ONE_MS = int(1e-3 * 1.98e9)  # spin cycles for 1 ms at the H200's 1.98 GHz
# ms: one 1-ms kernel node of a graph and the model's launch overhead of a graph's node (not a lone launch's)
UNIT = 1 + H200.graph_node_overhead * 1e3
QUARTER = 66  # blocks of 1024 threads: a quarter of a wave, so two fit side by side


async def floats(actx, ptr, n: int = N) -> np.ndarray:
    return np.frombuffer(await actx.host_view(ptr), np.float32)[:n].copy()


async def test_a_captured_graph_computes_what_its_launches_would_and_replays_on_the_same_memory(actx, autojump_clock):
    """fill, fill, saxpy captured and launched: y = 3x + y, computed when the graph runs, not at the capture; each
    launch again works on the same addresses (y grows by 3x each time) and counts its kernels as launches."""
    s = await actx.create_stream()
    x, y = await actx.malloc(4 * N), await actx.malloc(4 * N)
    await actx.launch("fill_f32", 16, 256, [y, 0.0, N], stream=s)
    await s.begin_capture()
    await actx.launch("fill_f32", 16, 256, [x, 2.0, N], stream=s)
    await actx.launch("saxpy_f32", 16, 256, [3.0, x, y, N], stream=s)
    graph = await s.end_capture()
    await s.synchronize()
    assert (await floats(actx, x) == 0).all()  # captured, not run
    before = (await actx.statistics())["launches"]
    executable = await graph.instantiate()
    for _ in range(3):
        await executable.launch(s)
    await s.synchronize()
    assert (await floats(actx, y) == 18.0).all()
    assert (await actx.statistics())["launches"] == before + 6


async def test_branches_of_a_graph_run_side_by_side_and_a_chain_in_turn(actx, autojump_clock):
    """Two 1-ms kernels of a quarter wave each, with no edge between them, take one kernel's time; the same two
    with an edge take two: a graph launch's nodes run by their dependencies, not in one stream's order."""
    s = await actx.create_stream()
    await actx.launch("spin", 1, 32, [int(20 * 1.98e9)], stream=s)  # a blocker: what follows is queued first
    times = []
    for chained in (False, True):
        graph = await actx.graph_create()
        first = await graph.add_kernel_node("spin", QUARTER, 1024, [ONE_MS])
        await graph.add_kernel_node("spin", QUARTER, 1024, [ONE_MS], deps=[first] if chained else [])
        start, end = await actx.create_event(), await actx.create_event()
        await start.record(s)
        await (await graph.instantiate()).launch(s)
        await end.record(s)
        times.append((start, end))
    await s.synchronize()
    assert await times[0][0].elapsed_ms(times[0][1]) == pytest.approx(UNIT, abs=1e-6)
    assert await times[1][0].elapsed_ms(times[1][1]) == pytest.approx(2 * UNIT, abs=1e-6)


async def test_launches_of_one_executable_graph_run_one_after_another_whatever_their_streams(actx, autojump_clock):
    """One graph launched on two non-blocking streams: the second launch waits for the first, as CUDA orders an
    executable graph's launches."""
    s1, s2 = await actx.create_stream(non_blocking=True), await actx.create_stream(non_blocking=True)
    graph = await actx.graph_create()
    await graph.add_kernel_node("spin", 264, 1024, [ONE_MS])
    executable = await graph.instantiate()
    start, end = await actx.create_event(), await actx.create_event()
    await actx.launch("spin", 1, 32, [int(20 * 1.98e9)], stream=s1)
    await start.record(s1)
    await executable.launch(s1)
    await executable.launch(s2)
    await end.record(s2)
    await actx.synchronize()
    assert await start.elapsed_ms(end) == pytest.approx(2 * UNIT, abs=1e-6)


async def test_the_seeds_simple_cuda_graphs_by_hand_and_by_capture(actx, autojump_clock):
    """simpleCudaGraphs: a graph made by hand (copy in, memset, reduce, memset, reduce the partial sums, copy out)
    launched three times, then cloned and launched again; and the same work captured with a fork and a join across
    three streams. Each computes the sum of its input."""
    host_in, host_out = await actx.host_alloc(4 * N), await actx.host_alloc(4)
    values = np.arange(N, dtype=np.float32) % 7
    np.frombuffer(host_in, np.float32)[:] = values
    x, partial, result = await actx.malloc(4 * N), await actx.malloc(4 * 2), await actx.malloc(4)
    graph = await actx.graph_create()
    copy_in = await graph.add_memcpy_node(x, host_in)
    clear = await graph.add_memset_node(partial, 0, 8)
    halves = [await graph.add_kernel_node("reduce_sum_f32", 512, 512, [x + 4 * i * (N // 2), partial + 4 * i, N // 2],
                                          deps=[copy_in, clear]) for i in range(2)]
    zero = await graph.add_memset_node(result, 0, 4)
    final = await graph.add_kernel_node("reduce_sum_f32", 1, 512, [partial, result, 2], deps=[*halves, zero])
    await graph.add_memcpy_node(host_out, result, deps=[final])
    nodes = await graph.nodes()
    assert [n.type for n in nodes] == ["memcpy", "memset", "kernel", "kernel", "memset", "kernel", "memcpy"]
    assert nodes[-1].params["kind"] == "d2h" and nodes[0].params["kind"] == "h2d"
    s = await actx.create_stream()
    executable = await graph.instantiate()
    for _ in range(3):
        np.frombuffer(host_out, np.float32)[0] = -1
        await executable.launch(s)
        await s.synchronize()
        assert np.frombuffer(host_out, np.float32)[0] == values.sum()
    clone = await graph.clone()
    assert [(n.type, len(n.deps)) for n in await clone.nodes()] == [(n.type, len(n.deps)) for n in nodes]
    assert not {n.id for n in await clone.nodes()} & {n.id for n in nodes}
    np.frombuffer(host_out, np.float32)[0] = -1
    await (await clone.instantiate()).launch(s)
    await s.synchronize()
    assert np.frombuffer(host_out, np.float32)[0] == values.sum()

    # The same by capture: s copies in and forks to t and u, which reduce a half each; s joins both and finishes.
    t, u = await actx.create_stream(non_blocking=True), await actx.create_stream(non_blocking=True)
    forked, done_t, done_u = [await actx.create_event(disable_timing=True) for _ in range(3)]
    await s.begin_capture()
    await actx.memcpy_htod(x, host_in, s)
    await actx.memset(partial, 0, 8, s)
    await forked.record(s)
    for i, (branch, done) in enumerate(((t, done_t), (u, done_u))):
        await branch.wait_event(forked)
        await actx.launch("reduce_sum_f32", 512, 512, [x + 4 * i * (N // 2), partial + 4 * i, N // 2], stream=branch)
        await done.record(branch)
        await s.wait_event(done)
    await actx.launch("reduce_sum_f32", 1, 512, [partial, result, 2], stream=s)
    await actx.memcpy_dtoh(host_out, result, s)
    captured = await s.end_capture()
    kinds = [(n.type, len(n.deps)) for n in await captured.nodes()]
    # (a join adds the event's nodes to the stream's: the final reduce runs after the memset and both halves)
    assert kinds == [("memcpy", 0), ("memset", 1), ("kernel", 1), ("kernel", 1), ("kernel", 3), ("memcpy", 1)]
    executable = await captured.instantiate()
    for _ in range(3):
        np.frombuffer(host_out, np.float32)[0] = -1
        await executable.launch(s)
        await s.synchronize()
        assert np.frombuffer(host_out, np.float32)[0] == values.sum()


async def test_a_failed_node_surfaces_at_the_next_synchronise(actx, autojump_clock):
    """A kernel node whose memory was freed after the graph was made: the launch returns, and the illegal address
    is the next synchronising call's error (sticky, as a launch's is)."""
    p = await actx.malloc(4 * N)
    graph = await actx.graph_create()
    await graph.add_kernel_node("fill_f32", 16, 256, [p, 1.0, N])
    executable = await graph.instantiate()
    await actx.free(p)
    await executable.launch()
    with pytest.raises(IllegalAddressError):
        await actx.synchronize()


async def test_an_update_takes_new_arguments_and_refuses_a_new_shape(actx, autojump_clock):
    """cudaGraphExecUpdate: a kernel's new arguments are taken in place (the next launch fills 5.0); a node more is
    TOPOLOGY_CHANGED and a kernel turned memset NODE_TYPE_CHANGED, each leaving the executable graph as it was."""
    p = await actx.malloc(4 * N)

    async def graph_of(*kinds):
        graph = await actx.graph_create()
        for kind, value in kinds:
            if kind == "kernel":
                await graph.add_kernel_node("fill_f32", 16, 256, [p, value, N])
            else:
                await graph.add_memset_node(p, 0, 4 * N)
        return graph

    executable = await (await graph_of(("kernel", 1.0))).instantiate()
    await executable.update(await graph_of(("kernel", 5.0)))
    await executable.launch()
    await actx.synchronize()
    assert (await floats(actx, p) == 5.0).all()
    for changed, result in (((("kernel", 2.0), ("kernel", 3.0)), "TOPOLOGY_CHANGED"),
                            ((("memset", 0),), "NODE_TYPE_CHANGED")):
        with pytest.raises(GraphExecUpdateFailureError) as failed:
            await executable.update(await graph_of(*changed))
        assert failed.value.result == result
    await executable.launch()
    await actx.synchronize()
    assert (await floats(actx, p) == 5.0).all()


async def test_an_executable_graph_outlives_its_graph_and_not_its_own_destroy(actx, autojump_clock):
    """A graph destroyed after instantiation: its executable graph still launches. An executable graph destroyed:
    a launch of it is cudaErrorInvalidValue, at the next synchronising call (a launch is fire-and-forget)."""
    p = await actx.malloc(4 * N)
    graph = await actx.graph_create()
    await graph.add_kernel_node("fill_f32", 16, 256, [p, 4.0, N])
    executable = await graph.instantiate()
    await graph.destroy()
    with pytest.raises(InvalidValueError):
        await graph.nodes()
    await executable.launch()
    await actx.synchronize()
    assert (await floats(actx, p) == 4.0).all()
    await executable.destroy()
    await executable.launch()
    with pytest.raises(InvalidValueError):
        await actx.synchronize()


async def test_nodes_by_hand_are_checked_as_their_calls_are(actx, autojump_clock):
    """A node is refused as the call it stands for would be (a range outside live memory, an unknown kernel), and so
    is a dependency outside its graph or a memcpy from pageable host memory."""
    p = await actx.malloc(4096)
    graph, other = await actx.graph_create(), await actx.graph_create()
    elsewhere = await other.add_empty_node()
    for bad in (lambda: graph.add_memset_node(p, 0, 8192), lambda: graph.add_empty_node(deps=[elsewhere]),
                lambda: graph.add_memcpy_node(p, bytearray(16))):
        with pytest.raises(InvalidValueError):
            await bad()
    with pytest.raises(Exception, match="no kernel named"):
        await graph.add_kernel_node("nope", 1, 1)
    assert await graph.nodes() == []


async def test_to_dot_writes_each_node_and_edge(actx, autojump_clock, tmp_path):
    """to_dot writes a Graphviz digraph, as cudaGraphDebugDotPrint does: a box per node with its type and
    arguments, an arrow per dependency."""
    p = await actx.malloc(4096)
    graph = await actx.graph_create()
    clear = await graph.add_memset_node(p, 0, 4096)
    fill = await graph.add_kernel_node("fill_f32", 4, 256, [p, 1.0, 1024], deps=[clear])
    await graph.to_dot(tmp_path / "g.dot")
    text = (tmp_path / "g.dot").read_text()
    assert text.startswith("digraph dot {") and "MEMSET" in text and "KERNEL" in text and "fill_f32" in text
    assert f'"graph_{graph.handle}_node_{clear.id}" -> "graph_{graph.handle}_node_{fill.id}";' in text


async def test_a_graph_launch_costs_the_host_a_fraction_of_its_launches_one_by_one(autojump_clock):
    """Under the virtual clock, one graph launch of 100 kernels costs the host what the H200's did beside the same
    100 launched one by one (2.0 us against 483 us: over 99% saved), as a ratio of the two measured in one run."""
    async with in_process_daemon("--clock", "virtual") as d, d.connect() as actx:
        s = await actx.create_stream()
        await actx.launch("spin", 1, 32, [0], stream=s)  # warm: every call below is back to back
        await s.begin_capture()
        for _ in range(100):
            await actx.launch("spin", 1, 32, [0], stream=s)
        executable = await (await s.end_capture()).instantiate()
        before = await actx.clock()
        for _ in range(100):
            await actx.launch("spin", 1, 32, [0], stream=s)
        one_by_one = await actx.clock() - before
        before = await actx.clock()
        await executable.launch(s)
        graph = await actx.clock() - before
        await s.synchronize()
    assert graph / one_by_one == pytest.approx(2.0 / 483, rel=0.05)
    assert 1 - graph / one_by_one > 0.99


async def test_the_kernel_dispatcher_releases_a_graph_launch_whole(autojump_clock):
    """Under --dispatch kernel a graph launch is one item of the client's queue, released whole: it computes what
    the graph says, and counts once among the kernels released."""
    async with in_process_daemon("--policy", "priority", "--dispatch", "kernel") as d, d.connect() as actx:
        p = await actx.malloc(4 * N)
        s = await actx.create_stream()
        await s.begin_capture()
        for value in (1.0, 2.0, 3.0):
            await actx.launch("fill_f32", 16, 256, [p, value, N], stream=s)
        await (await (await s.end_capture()).instantiate()).launch(s)
        await s.synchronize()
        assert (await floats(actx, p) == 3.0).all()
        tenants = d.daemon.devices[0].backend.tenants
        assert [t.released for t in tenants.values()] == [1]


async def test_an_event_record_node_records_where_it_stands_in_the_graph_at_each_launch(actx, autojump_clock):
    """spin 1 ms -> record(e) -> spin 1 ms: e completes one kernel into the launch, not at its end; a second launch
    records e again (its latest record is the new launch's)."""
    s = await actx.create_stream()
    e, start, end = [await actx.create_event() for _ in range(3)]
    graph = await actx.graph_create()
    first = await graph.add_kernel_node("spin", 264, 1024, [ONE_MS])
    mark = await graph.add_event_record_node(e, deps=[first])
    await graph.add_kernel_node("spin", 264, 1024, [ONE_MS], deps=[mark])
    executable = await graph.instantiate()
    for _ in range(2):
        await start.record(s)
        await executable.launch(s)
        await end.record(s)
        await s.synchronize()
        assert await start.elapsed_ms(e) == pytest.approx(UNIT, abs=1e-6)
        assert await start.elapsed_ms(end) == pytest.approx(2 * UNIT, abs=1e-6)
    assert [n.type for n in await graph.nodes()] == ["kernel", "event_record", "kernel"]


async def _fill_after_a_wait(actx):
    """Two streams, a buffer p, an event e, and a graph that fills p with 2.0 after a wait node on e, instantiated."""
    s, t = await actx.create_stream(non_blocking=True), await actx.create_stream(non_blocking=True)
    p = await actx.malloc(4 * N)
    e = await actx.create_event(disable_timing=True)
    graph = await actx.graph_create()
    wait = await graph.add_event_wait_node(e)
    await graph.add_kernel_node("fill_f32", 16, 256, [p, 2.0, N], deps=[wait])
    return s, t, p, e, graph, await graph.instantiate()


async def test_an_event_wait_node_waits_for_the_events_record_as_of_the_launch(actx, autojump_clock):
    """Stream t spins 5 ms, fills p with 1.0 and records e; a graph whose fill of 2.0 comes after a wait node on e,
    launched on s meanwhile, fills after t's fill: p ends 2.0 (without the wait, t's fill would come last)."""
    s, t, p, e, graph, executable = await _fill_after_a_wait(actx)
    await actx.launch("spin", 1, 32, [5 * ONE_MS], stream=t)
    await actx.launch("fill_f32", 16, 256, [p, 1.0, N], stream=t)
    await e.record(t)
    await executable.launch(s)
    await actx.synchronize()
    assert (await floats(actx, p) == 2.0).all()
    assert (await graph.nodes())[0].params == {"event": e.handle}


async def test_a_child_graph_node_runs_its_copy_between_its_dependencies_and_dependents(actx, autojump_clock):
    """spin -> child{two 1-ms quarter-wave spins side by side} -> spin takes three kernels' time, and a fill after
    the child sees what the child's kernels wrote; the child was copied when the node was made (a node added to it
    later is not in the parent)."""
    p = await actx.malloc(4 * N)
    child = await actx.graph_create()
    await child.add_kernel_node("spin", QUARTER, 1024, [ONE_MS])
    await child.add_kernel_node("spin", QUARTER, 1024, [ONE_MS])
    await child.add_kernel_node("fill_f32", 16, 256, [p, 3.0, N])
    parent = await actx.graph_create()
    before = await parent.add_kernel_node("spin", QUARTER, 1024, [ONE_MS])
    inner = await parent.add_child_graph_node(child, deps=[before])
    await parent.add_kernel_node("saxpy_f32", 16, 256, [1.0, p, p, N], deps=[inner])
    await parent.add_kernel_node("spin", QUARTER, 1024, [ONE_MS], deps=[inner])
    await child.add_kernel_node("fill_f32", 16, 256, [p, 100.0, N])  # not seen by the parent
    nodes = await parent.nodes()
    assert nodes[1].type == "graph" and len(nodes[1].params["nodes"]) == 3
    s = await actx.create_stream()
    start, end = await actx.create_event(), await actx.create_event()
    await start.record(s)
    await (await parent.instantiate()).launch(s)
    await end.record(s)
    await s.synchronize()
    assert await start.elapsed_ms(end) == pytest.approx(3 * UNIT, abs=1e-6)
    assert (await floats(actx, p) == 6.0).all()


async def test_external_records_and_waits_in_a_capture_become_event_nodes(actx, autojump_clock):
    """record(s, external=True) and wait_event(e, external=True) on a capturing stream are event record and wait
    nodes, in stream order; an external wait may name an event recorded outside the capture (a plain one is
    cudaErrorStreamCaptureIsolation)."""
    s, t = await actx.create_stream(), await actx.create_stream()
    p = await actx.malloc(4 * N)
    outside, mark = await actx.create_event(disable_timing=True), await actx.create_event(disable_timing=True)
    await outside.record(t)
    await s.begin_capture()
    await s.wait_event(outside, external=True)
    await actx.launch("fill_f32", 16, 256, [p, 4.0, N], stream=s)
    await mark.record(s, external=True)
    graph = await s.end_capture()
    nodes = await graph.nodes()
    assert [(n.type, n.deps) for n in nodes] == [("event_wait", ()), ("kernel", (nodes[0].id,)),
                                                 ("event_record", (nodes[1].id,))]
    await (await graph.instantiate()).launch(s)
    await mark.synchronize()
    assert (await floats(actx, p) == 4.0).all()


async def test_set_kernel_params_changes_the_executable_graphs_copy_only(actx, autojump_clock):
    """exec.set_kernel_params(node, ...): the next launch fills 9.0 where the graph said 1.0; the graph is unchanged
    (a new instantiation fills 1.0), and a node that is no kernel node, or a kernel that does not exist, is
    refused."""
    p = await actx.malloc(4 * N)
    graph = await actx.graph_create()
    clear = await graph.add_memset_node(p, 0, 4 * N)
    fill = await graph.add_kernel_node("fill_f32", 16, 256, [p, 1.0, N], deps=[clear])
    executable = await graph.instantiate()
    await executable.set_kernel_params(fill, "fill_f32", 16, 256, [p, 9.0, N])
    await executable.launch()
    await actx.synchronize()
    assert (await floats(actx, p) == 9.0).all()
    await (await graph.instantiate()).launch()
    await actx.synchronize()
    assert (await floats(actx, p) == 1.0).all()
    with pytest.raises(InvalidValueError):
        await executable.set_kernel_params(clear, "fill_f32", 16, 256, [p, 9.0, N])
    with pytest.raises(Exception, match="no kernel named"):
        await executable.set_kernel_params(fill, "nope", 1, 1)


async def test_a_graphs_kernel_nodes_pay_the_graph_node_overhead_not_a_launchs(actx, autojump_clock):
    """Ten 1-ms kernels back to back take ten kernel launch overheads one by one and ten graph node overheads as a
    graph (DeviceSpec.graph_node_overhead: the H200's 0.69 us a node, with the model's least block time): the
    device saves by a graph too, not only the host."""
    s = await actx.create_stream()
    await actx.launch("spin", 1, 32, [int(20 * 1.98e9)], stream=s)  # a blocker: what follows is queued first
    start, middle, end = [await actx.create_event() for _ in range(3)]
    await s.begin_capture()
    for _ in range(10):
        await actx.launch("spin", 264, 1024, [ONE_MS], stream=s)
    executable = await (await s.end_capture()).instantiate()
    await start.record(s)
    for _ in range(10):
        await actx.launch("spin", 264, 1024, [ONE_MS], stream=s)
    await middle.record(s)
    await executable.launch(s)
    await end.record(s)
    await s.synchronize()
    assert await start.elapsed_ms(middle) == pytest.approx(10 * (1 + H200.kernel_overhead * 1e3), abs=1e-6)
    assert await middle.elapsed_ms(end) == pytest.approx(10 * UNIT, abs=1e-6)


async def test_an_instantiation_costs_the_host_what_the_h200s_did(autojump_clock):
    """Under the virtual clock, cudaGraphInstantiate of a 100-kernel graph costs the host about 155 us, the H200's
    figure (DeviceSpec.graph_instantiate_call), where another call costs a warm launch call's 6.39 us."""
    async with in_process_daemon("--clock", "virtual") as d, d.connect() as actx:
        s = await actx.create_stream()
        await s.begin_capture()
        for _ in range(100):
            await actx.launch("spin", 1, 32, [0], stream=s)
        graph = await s.end_capture()
        before = await actx.clock()
        await graph.instantiate()
        assert await actx.clock() - before == pytest.approx(H200.graph_instantiate_call, rel=0.05)


async def test_an_event_wait_node_holds_under_the_kernel_dispatcher(autojump_clock):
    """Under --dispatch kernel, a graph whose wait node waits for a record the dispatcher still holds (a less urgent
    client's, behind an urgent client's work) runs its fill after the other stream's: the launch waits for that
    record to be released, which a backend could not wait for unreleased."""
    async with in_process_daemon("--policy", "priority", "--dispatch", "kernel") as d, d.connect() as urgent, \
            d.connect(CUDA_MPS_CLIENT_PRIORITY="1") as actx:
        await urgent.launch("spin", 264, 1024, [20 * ONE_MS])
        s, t, p, e, _, executable = await _fill_after_a_wait(actx)
        for _ in range(3):
            await actx.launch("spin", 264, 1024, [5 * ONE_MS], stream=t)
        await actx.launch("fill_f32", 16, 256, [p, 1.0, N], stream=t)
        await e.record(t)
        await executable.launch(s)
        await actx.synchronize()
        assert (await floats(actx, p) == 2.0).all()
