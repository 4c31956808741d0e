# PyTorch's graph wrapper (mpsd_client.CUDAGraph, mpsd_client.graph) and the caching allocator's private pools
# during a capture, through the blocking client on a real daemon process: the seed's warm-up-then-capture pattern
# (section 3.3) as written, with the model's buffers from the context's caching allocator as torch's tensors are.
from __future__ import annotations

import numpy as np
import pytest

import mpsd_client
from mpsd_client import StreamCaptureInvalidatedError, StreamCaptureUnsupportedError

N = 4096


def model(ctx, allocator, x, stream):
    """out = 2x + x, with a temporary freed inside: what a layer's forward does with its intermediate tensors."""
    hidden = allocator.malloc(4 * N, stream)
    ctx.memset(hidden, 0, 4 * N, stream)
    ctx.launch("saxpy_f32", 16, 256, [2.0, x, hidden, N], stream=stream)
    out = allocator.malloc(4 * N, stream)
    ctx.launch("vector_add_f32", 16, 256, [hidden, x, out, N], stream=stream)
    allocator.free(hidden)
    return out


def floats(ctx, ptr) -> np.ndarray:
    return np.frombuffer(ctx.host_view(ptr), np.float32)[:N].copy()


def pools_of(allocator) -> dict[int, tuple[int, int]]:
    return {seg["address"]: seg["segment_pool_id"] for seg in allocator.memory_snapshot()}


def pool_at(allocator, ptr: int) -> tuple[int, int]:
    """The pool id of the segment holding `ptr`."""
    return next(seg["segment_pool_id"] for seg in allocator.memory_snapshot()
                if seg["address"] <= ptr < seg["address"] + seg["total_size"])


def test_the_seeds_warm_up_then_capture_pattern_runs_as_written(ctx):
    """Warm up on a side stream, synchronise, capture the model under `with graph(g, stream=s)`, then for each batch
    copy the input in place and replay: each replay computes the new batch's output at the captured address, and the
    capture's buffers came from the graph's private pool, not the shared cache."""
    allocator = mpsd_client.caching_allocator(ctx)
    static_input = allocator.malloc(4 * N)
    g = mpsd_client.CUDAGraph(ctx)
    s = ctx.create_stream()
    # Step 1: warm up on the side stream
    allocator.free(model(ctx, allocator, static_input, s))
    ctx.synchronize()
    # Step 2: capture
    with mpsd_client.graph(g, stream=s):
        static_output = model(ctx, allocator, static_input, s)
    assert not s.is_capturing()
    assert pool_at(allocator, static_output) == g.pool() != (0, 0)
    assert pool_at(allocator, static_input) == (0, 0)
    # Step 3: replay, the input updated in place
    host = ctx.host_alloc(4 * N)
    for batch in (1.0, 2.0, 3.0):
        np.frombuffer(host, np.float32)[:] = batch
        ctx.memcpy_htod(static_input, host)
        g.replay()
        ctx.synchronize()
        assert (floats(ctx, static_output) == 3 * batch).all()
    # Memory allocated after the capture comes from the shared cache again.
    assert pool_at(allocator, allocator.malloc(4 * N, s)) == (0, 0)


def test_a_second_graph_shares_the_first_ones_pool_and_reuses_what_it_freed(ctx):
    """graph(g2, pool=g1.pool()): g2's capture allocates from g1's private pool, and the temporary g1 freed during
    its capture is the first block g2 gets (the pool is shared, as torch's is, if the two replay in capture order);
    an allocation outside any capture never gets that block."""
    allocator = mpsd_client.caching_allocator(ctx)
    x = allocator.malloc(4 * N)
    s = ctx.create_stream()
    g1, g2 = mpsd_client.CUDAGraph(ctx), mpsd_client.CUDAGraph(ctx)
    with mpsd_client.graph(g1, stream=s):
        hidden = allocator.malloc(4 * N, s)
        ctx.launch("fill_f32", 16, 256, [hidden, 1.0, N], stream=s)
        out1 = allocator.malloc(4 * N, s)
        ctx.launch("vector_add_f32", 16, 256, [hidden, hidden, out1, N], stream=s)
        allocator.free(hidden)
    outside = allocator.malloc(4 * N, s)
    assert outside != hidden
    with mpsd_client.graph(g2, pool=g1.pool(), stream=s):
        reused = allocator.malloc(4 * N, s)
        ctx.launch("vector_add_f32", 16, 256, [out1, x, reused, N], stream=s)
    assert reused == hidden and g2.pool() == g1.pool()
    ctx.memset(x, 0, 4 * N)
    g1.replay()
    g2.replay()
    ctx.synchronize()
    assert (floats(ctx, reused) == 2.0).all()


def test_a_reset_graphs_pool_goes_back_at_empty_cache_and_a_live_ones_stays(ctx):
    """A private pool's segments stay reserved while a graph uses the pool, even across empty_cache; once every graph
    using it is reset and its blocks are freed, empty_cache gives them back to the device."""
    allocator = mpsd_client.caching_allocator(ctx)
    s = ctx.create_stream()
    g = mpsd_client.CUDAGraph(ctx)
    with mpsd_client.graph(g, stream=s):
        out = allocator.malloc(4 * N, s)
        ctx.launch("fill_f32", 16, 256, [out, 7.0, N], stream=s)
    allocator.free(out)
    allocator.empty_cache()
    assert g.pool() in pools_of(allocator).values()
    g.replay()
    ctx.synchronize()
    g.reset()
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0
    with pytest.raises(RuntimeError):
        g.replay()


def test_the_allocators_device_malloc_in_a_capture_is_relaxed_and_a_users_is_not(ctx):
    """The allocator's new segment during a global-mode capture is made in relaxed mode (PyTorch's
    cudaMallocMaybeCapturing), so the capture goes on; the user's own cudaMalloc there is refused and invalidates
    it, as on the H200, and the graph() block's exit then raises the capture's error."""
    allocator = mpsd_client.caching_allocator(ctx)
    s = ctx.create_stream()
    g = mpsd_client.CUDAGraph(ctx)
    with mpsd_client.graph(g, stream=s):
        allocator.malloc(3 << 20, s)  # a new large segment, inside the capture
    bad = mpsd_client.CUDAGraph(ctx)
    with pytest.raises(StreamCaptureUnsupportedError):
        with mpsd_client.graph(bad, stream=s):
            ctx.malloc(1 << 20)
    with pytest.raises(StreamCaptureInvalidatedError):
        g2 = mpsd_client.CUDAGraph(ctx)
        g2.capture_begin(stream=s)
        try:
            ctx.malloc(1 << 20)
        except StreamCaptureUnsupportedError:
            pass
        g2.capture_end()


def test_capture_twice_and_replay_before_capture_are_refused(ctx):
    """A CUDAGraph captures once (until reset), replays only after a capture, and knows its pool once begun."""
    g = mpsd_client.CUDAGraph(ctx)
    with pytest.raises(RuntimeError):
        g.replay()
    with pytest.raises(RuntimeError):
        g.pool()
    s = ctx.create_stream()
    with mpsd_client.graph(g, stream=s):
        ctx.launch("spin", 1, 32, [0], stream=s)
    with pytest.raises(RuntimeError):
        g.capture_begin(stream=s)
    g.reset()
    with mpsd_client.graph(g, stream=s):
        ctx.launch("spin", 1, 32, [0], stream=s)
    g.replay()
    ctx.synchronize()


async def test_the_wrapper_works_on_the_trio_client_too(actx, autojump_clock):
    """CUDAGraph and `async with graph(...)` on an AsyncContext: captured, replayed three times (the trio client has no
    caching allocator, so buffers are plain mallocs); keep_graph keeps the graph for debug_dump."""
    p = await actx.malloc(4 * N)
    g = mpsd_client.CUDAGraph(actx, keep_graph=True)
    async with mpsd_client.graph(g) as s:
        await actx.launch("saxpy_f32", 16, 256, [1.0, p, p, N], stream=s)
    await actx.launch("fill_f32", 16, 256, [p, 1.0, N])
    for _ in range(3):
        await g.replay()
    await actx.synchronize()
    assert (np.frombuffer(await actx.host_view(p), np.float32)[:N] == 8.0).all()
    assert [n.type for n in await g.raw_cuda_graph().nodes()] == ["kernel"]
