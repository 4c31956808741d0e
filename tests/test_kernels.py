# Built-in kernels through the real daemon (in this process, tests/inproc.py, but for a smoke test on a daemon
# process): they really compute on the device bytes, launches are validated as cudaLaunchKernel validates
# them, and an out-of-bounds access is a sticky cudaErrorIllegalAddress, contained per device (every client
# on it, as Volta+ MPS does) or per client.
from __future__ import annotations

import numpy as np
import pytest
import trio

import mpsd_client
from inproc import in_process_daemon
from mpsd_client import (
    IllegalAddressError,
    InvalidConfigurationError,
    InvalidDeviceFunctionError,
    InvalidValueError,
)
from mpsd_protocol import Notification

N = 100_003  # not a multiple of any block size


def upload(ctx, array: np.ndarray):
    p = ctx.malloc(array.nbytes)
    ctx.memcpy_htod(p, array)
    return p


def download(ctx, p, n: int) -> np.ndarray:
    out = np.empty(n, np.float32)
    ctx.memcpy_dtoh(out, p)
    return out


def test_kernels_compute_on_device_bytes(ctx):
    """fill, vector_add, saxpy and reduce_sum give numpy's answers on the bytes in device memory."""
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal(N, dtype=np.float32), rng.standard_normal(N, dtype=np.float32)
    px, py, pc, pout = upload(ctx, x), upload(ctx, y), ctx.malloc(4 * N), ctx.malloc(4)
    ctx.launch("vector_add_f32", (N + 255) // 256, 256, [px, py, pc, N])
    assert np.array_equal(download(ctx, pc, N), x + y)
    ctx.launch("saxpy_f32", 391, (16, 16), [2.5, px, py, N])
    expected = np.float32(2.5) * x + y
    assert np.array_equal(download(ctx, py, N), expected)
    ctx.launch("reduce_sum_f32", 512, 512, [py, pout, N])
    assert download(ctx, pout, 1)[0] == pytest.approx(float(expected.astype(np.float64).sum()), rel=1e-4)
    ctx.launch("fill_f32", 1, 1024, [pc + 400, -1.25, 10])  # a pointer inside an allocation
    out = download(ctx, pc, N)
    assert (out[100:110] == -1.25).all() and np.array_equal(out[:100], (x + y)[:100])


async def test_spin_and_work_take_simulated_time_and_leave_memory_alone(actx, autojump_clock):
    """spin and work only take time; statistics count their blocks and SM-seconds."""
    before = await actx.statistics()
    await actx.launch("spin", 264, 1024, [int(1.98e6)])
    await actx.launch("work", 264, 1024, [93638])
    await actx.synchronize()
    after = await actx.statistics()
    assert after["kernels_completed"] - before["kernels_completed"] == 2
    assert after["blocks_completed"] - before["blocks_completed"] == 528
    # 264 blocks x 1 ms of spin, and 264 blocks x 1 ms of work (two blocks share each SM's issue rate);
    # each 1024-thread block holds half an SM
    assert after["block_seconds"] - before["block_seconds"] == pytest.approx(0.528, rel=1e-6)
    assert after["sm_seconds"] - before["sm_seconds"] == pytest.approx(0.264, rel=1e-6)
    assert after["max_sms"] == 132


@pytest.mark.parametrize("call,error", [
    (lambda c, p: c.launch("no_such_kernel", 1, 1, []), InvalidDeviceFunctionError),
    (lambda c, p: c.launch("fill_f32", 1, 1, [p, 1.0]), InvalidValueError),           # too few arguments
    (lambda c, p: c.launch("fill_f32", 1, 1, [p, 1.0, 4, 5]), InvalidValueError),     # too many
    (lambda c, p: c.launch("fill_f32", 1, 1, [p, "one", 4]), InvalidValueError),      # wrong kind
    (lambda c, p: c.launch("fill_f32", 1, 1, [1.5, 1.0, 4]), InvalidValueError),      # float as a pointer
    (lambda c, p: c.launch("spin", 1, 1, [2**63]), InvalidValueError),                # overflows i64
    (lambda c, p: c.launch("spin", 1, 2048, [1]), InvalidConfigurationError),         # too many threads
    (lambda c, p: c.launch("spin", 0, 32, [1]), InvalidConfigurationError),           # empty grid
    (lambda c, p: c.launch("spin", (1, 70000), 32, [1]), InvalidConfigurationError),  # grid.y too large
    (lambda c, p: c.launch("spin", 1, (32, 1, 65), [1]), InvalidConfigurationError),  # block.z too large
    (lambda c, p: c.launch("spin", 1, 32, [1], shared_mem=300_000), InvalidValueError),
])
async def test_bad_launches_fail_at_the_call_and_are_not_sticky(actx, call, error, autojump_clock):
    """Launch errors are returned by the launch itself, recorded as the last error, and not sticky."""
    p = await actx.malloc(64)
    with pytest.raises(error):
        await call(actx, p)
    assert isinstance(await actx.get_last_error(), error)
    assert await actx.get_last_error() is None
    await actx.launch("fill_f32", 1, 16, [p, 1.0, 16])
    await actx.synchronize()


async def _raw_launch(actx, **args):
    """Send a launch the way a client that skips our checks would: straight to the daemon."""
    def op():
        yield Notification("launch", args)
    await actx._drive(op())


async def test_daemon_checks_launches_it_is_sent_directly(actx, autojump_clock):
    """A launch that bypasses the client's checks is refused by the daemon; the next sync reports it."""
    await _raw_launch(actx, name="spin", grid=[1, 1, 1], block=[4096, 1, 1], args=[1], shared_mem=0, stream=None)
    with pytest.raises(InvalidConfigurationError):
        await actx.synchronize()
    await _raw_launch(actx, name="vector_add_f32", grid=[1, 1, 1], block=[1, 1, 1], args=[1], stream=None)
    assert isinstance(await actx.peek_at_last_error(), InvalidValueError)
    await _raw_launch(actx, name="spin", grid="lots")
    await _raw_launch(actx, name="spin", grid=[1, 1, 1], block=[1024, 1, 1], args=[1], shared_mem=230_000)
    await actx.get_last_error()
    await actx.synchronize()


async def test_out_of_bounds_access_is_sticky_illegal_address(actx, autojump_clock):
    """A kernel touching bytes past its allocation makes every later call fail with cudaErrorIllegalAddress."""
    p = await actx.malloc(4096)
    await actx.launch("fill_f32", 4, 256, [p, 1.0, 1025])  # one float too many
    with pytest.raises(IllegalAddressError) as info:
        await actx.synchronize()
    assert info.value.code == 700 and info.value.sticky
    for call in (lambda: actx.malloc(16), lambda: actx.mem_get_info(), actx.synchronize, actx.create_stream):
        with pytest.raises(IllegalAddressError):
            await call()
    assert (await actx.get_last_error()).code == 700
    assert (await actx.get_last_error()).code == 700  # sticky: never reset
    assert (await actx.statistics())["sticky_error"]["code"] == 700


async def test_kernel_on_freed_memory_is_an_illegal_address(actx, autojump_clock):
    """A kernel given a pointer that has been freed faults when it runs."""
    p = await actx.malloc(4096)
    await actx.free(p)
    await actx.launch("fill_f32", 1, 256, [p, 1.0, 16])
    with pytest.raises(IllegalAddressError):
        await actx.synchronize()


@pytest.mark.parametrize("containment", ["device", "client"])
async def test_fault_containment(containment, autojump_clock):
    """A fault reaches every client on the device (Volta+ MPS) or, under `client`, only the culprit; until
    the faulted clients have gone the server is in FAULT and refuses newcomers, then it serves them again."""
    async with in_process_daemon("--time-scale", "100", "--fault-containment", containment) as d:
        async with d.connect() as bystander, d.connect() as culprit:
            q = await bystander.malloc(64)
            p = await culprit.malloc(64)
            await culprit.launch("fill_f32", 1, 32, [p, 0.0, 17])
            with pytest.raises(IllegalAddressError):
                await culprit.synchronize()
            if containment == "device":
                with pytest.raises(IllegalAddressError):
                    await bystander.memset(q, 0, 64)
            else:
                await bystander.memset(q, 0, 64)
                await bystander.synchronize()
            with pytest.raises(mpsd_client.MpsServerNotReadyError):
                async with d.connect():
                    pass  # pragma: no cover
        with trio.fail_after(20):
            while d.server_log().count("disconnected; reclaimed") < 2:
                await trio.sleep(0.02)  # the two clients' exits reach the daemon's sessions as tasks of their own
        async with d.connect() as newcomer:  # the faulted clients are gone: it starts clean
            await newcomer.synchronize()
        log = d.server_log()
    assert "encountered a fatal GPU error." in log
    assert "The following client process have a sticky error set:" in log


async def test_shape_checks_are_not_fooled_by_equal_values(actx, autojump_clock):
    """A float or bool grid equal to a valid int grid is still refused, even after the int one was used."""
    await actx.launch("spin", 1, 32, [0])
    for grid in (1.0, True, (1.0,)):
        with pytest.raises(InvalidConfigurationError):
            await actx.launch("spin", grid, 32, [0])
    await actx.synchronize()


@pytest.mark.parametrize("grid,block,args,error", [
    ([True, 1, 1], [32, 1, 1], [0], InvalidConfigurationError),   # equal to [1, 1, 1] as a key, but a bool
    ([1.0, 1, 1], [32, 1, 1], [0], InvalidConfigurationError),
    ([1, 1, 1], [32, 1, 1], [False], InvalidValueError),          # an i64 argument that is a bool
    ([1, 1, 1], [32, 1, 1], [0.0], InvalidValueError),
    ([1, 1, 1, 32], [1, 1], [0], InvalidConfigurationError),      # the same values, split otherwise
])
async def test_the_daemon_refuses_a_launch_equal_to_one_it_took(actx, grid, block, args, error, autojump_clock):
    """The daemon keeps what checking a launch gave, by kernel, shape and arguments: a launch whose values equal
    a valid one's but are of other kinds, or in other lists, is still refused, as the first time."""
    for _ in range(2):
        await _raw_launch(actx, name="spin", grid=[1, 1, 1], block=[32, 1, 1], args=[0], shared_mem=0, stream=None)
        await _raw_launch(actx, name="spin", grid=grid, block=block, args=args, shared_mem=0, stream=None)
        with pytest.raises(error):
            await actx.synchronize()
    assert (await actx.statistics())["kernels_completed"] == 2


async def test_a_fill_with_minus_zero_after_one_with_zero_writes_its_sign(actx, autojump_clock):
    """-0.0 and 0.0 are equal, yet they are different bits: the second fill is not taken for the first."""
    p = await actx.malloc(16)
    for value, bits in ((0.0, 0), (-0.0, 0x80000000), (0.0, 0)):
        await _raw_launch(actx, name="fill_f32", grid=[1, 1, 1], block=[32, 1, 1], args=[p, value, 4],
                          shared_mem=0, stream=None)
        out = np.empty(4, np.float32)
        await actx.memcpy_dtoh(out, p)
        assert (out.view(np.uint32) == bits).all()
