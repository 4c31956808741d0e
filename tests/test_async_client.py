# The trio client: the same calls as the blocking one, awaited, from several tasks at once over one context.
# On a daemon in this trio loop (tests/inproc.py), but for what needs a daemon process to kill.
from __future__ import annotations

import shutil

import numpy as np
import pytest
import trio

import mpsd_client
from inproc import in_process_daemon
from mpsd.sim import H200
from mpsd_client import IllegalAddressError, InvalidValueError, OutOfMemoryError

MiB = 1 << 20


async def test_concurrent_tasks_copy_through_separate_staging_buffers(served, autojump_clock):
    """Four tasks copying 20 MiB each at once never mix their bytes: each call stages through its own buffer."""
    async with served.connect() as actx:
        results = {}

        async def round_trip(seed: int) -> None:
            data = np.random.default_rng(seed).integers(0, 256, 20 * MiB, dtype=np.uint8)
            p = await actx.malloc(data.nbytes)
            await actx.memcpy_htod(p, data)
            out = np.empty_like(data)
            await actx.memcpy_dtoh(out, p)
            results[seed] = np.array_equal(out, data)
            await actx.free(p)

        async with trio.open_nursery() as nursery:
            for seed in range(4):
                nursery.start_soon(round_trip, seed)
        assert results == {0: True, 1: True, 2: True, 3: True}


async def test_errors_are_the_same_classes(served, autojump_clock):
    """Errors raised through AsyncContext are the CUDA error classes the blocking client raises."""
    async with served.connect() as actx:
        with pytest.raises(OutOfMemoryError):
            await actx.malloc(1 << 50)
        with pytest.raises(InvalidValueError):
            await actx.free(12345)
        p = await actx.malloc(64)
        await actx.launch("fill_f32", 1, 32, [p, 1.0, 17])
        with pytest.raises(IllegalAddressError):
            await actx.synchronize()
        assert (await actx.get_last_error()).code == 700


async def test_streams_and_events_work_awaited(served, autojump_clock):
    """Stream and event methods return awaitables on an AsyncContext."""
    async with served.connect() as actx:
        s = await actx.create_stream(priority=-1)
        start, end = await actx.create_event(), await actx.create_event()
        # Hold the stream while the rest queues: 100 simulated seconds (none of the wall's: the mock clock
        # moves only when every task waits, so the rest is queued before it ends).
        await actx.launch("spin", 1, 32, [int(1.98e11)], stream=s)
        await start.record(s)
        await actx.launch("spin", 264, 1024, [int(1.98e6)], stream=s)
        await end.record(s)
        assert not await end.query()
        await end.synchronize()
        assert await start.elapsed_ms(end) == pytest.approx(1 + H200.kernel_overhead * 1e3, abs=1e-9)
        assert await s.query()
        await s.destroy()


async def test_no_daemon_is_an_mps_connection_error(tmp_path):
    """open_context where no daemon listens raises cudaErrorMpsConnectionFailed."""
    with pytest.raises(mpsd_client.MpsConnectionError):
        async with mpsd_client.open_context(tmp_path):
            pass  # pragma: no cover


async def test_daemon_exit_fails_waiting_calls(daemon_factory):
    """When the daemon goes away, a call waiting for its reply fails with cudaErrorMpsRpcFailure."""
    from daemons import start_daemon

    d = start_daemon("--time-scale", "1")
    async with mpsd_client.open_context(d.pipe_dir) as actx:
        await actx.launch("spin", 1, 32, [int(60 * 1.98e9)])

        async def kill_daemon() -> None:
            await trio.sleep(0.2)
            d.proc.kill()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_daemon)
            with pytest.raises(mpsd_client.MpsRpcFailureError):
                await actx.synchronize()
        with pytest.raises(mpsd_client.MpsRpcFailureError):
            await actx.mem_get_info()  # and every call after it
    assert d.stop(signum=None) == -9
    shutil.rmtree(d.pipe_dir.parent, ignore_errors=True)


async def test_a_refused_hello_raises_the_cuda_error_itself(autojump_clock):
    """A daemon that refuses the handshake (here: no room for another client) makes open_context raise that
    CUDA error, not an ExceptionGroup from the context's nursery (mpsd-stress's tenants met one)."""
    async with in_process_daemon("--time-scale", "100", "--max-clients", "1") as d:
        async with d.connect():
            with pytest.raises(mpsd_client.MpsMaxClientsReachedError):
                async with d.connect():
                    pass
