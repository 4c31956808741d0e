# Built-in kernels through the real daemon: they really compute on the device bytes, launches are validated
# as cudaLaunchKernel validates them, and an out-of-bounds access is a sticky cudaErrorIllegalAddress,
# contained per device (every client on it, as Volta+ MPS does) or per client.
from __future__ import annotations

import time

import numpy as np
import pytest

import mpsd_client
from daemons import start_daemon
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


def test_spin_and_work_take_simulated_time_and_leave_memory_alone(ctx):
    """spin and work only take time; statistics count their blocks and SM-seconds."""
    before = ctx.statistics()
    ctx.launch("spin", 264, 1024, [int(1.98e6)])
    ctx.launch("work", 264, 1024, [93638])
    ctx.synchronize()
    after = ctx.statistics()
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
def test_bad_launches_fail_at_the_call_and_are_not_sticky(ctx, call, error):
    """Launch errors are returned by the launch itself, recorded as the last error, and not sticky."""
    p = ctx.malloc(64)
    with pytest.raises(error):
        call(ctx, p)
    assert isinstance(ctx.get_last_error(), error)
    assert ctx.get_last_error() is None
    ctx.launch("fill_f32", 1, 16, [p, 1.0, 16])
    ctx.synchronize()


def _raw_launch(ctx, **args):
    """Send a launch the way a client that skips our checks would: straight to the daemon."""
    def op():
        yield Notification("launch", args)
    ctx._drive(op())


def test_daemon_checks_launches_it_is_sent_directly(ctx):
    """A launch that bypasses the client's checks is refused by the daemon; the next sync reports it."""
    _raw_launch(ctx, name="spin", grid=[1, 1, 1], block=[4096, 1, 1], args=[1], shared_mem=0, stream=None)
    with pytest.raises(InvalidConfigurationError):
        ctx.synchronize()
    _raw_launch(ctx, name="vector_add_f32", grid=[1, 1, 1], block=[1, 1, 1], args=[1], stream=None)
    assert isinstance(ctx.peek_at_last_error(), InvalidValueError)
    _raw_launch(ctx, name="spin", grid="lots")
    _raw_launch(ctx, name="spin", grid=[1, 1, 1], block=[1024, 1, 1], args=[1], shared_mem=230_000)
    ctx.get_last_error()
    ctx.synchronize()


def test_out_of_bounds_access_is_sticky_illegal_address(ctx):
    """A kernel touching bytes past its allocation makes every later call fail with cudaErrorIllegalAddress."""
    p = ctx.malloc(4096)
    ctx.launch("fill_f32", 4, 256, [p, 1.0, 1025])  # one float too many
    with pytest.raises(IllegalAddressError) as info:
        ctx.synchronize()
    assert info.value.code == 700 and info.value.sticky
    for call in (lambda: ctx.malloc(16), lambda: ctx.mem_get_info(), ctx.synchronize, ctx.create_stream):
        with pytest.raises(IllegalAddressError):
            call()
    assert ctx.get_last_error().code == 700
    assert ctx.get_last_error().code == 700  # sticky: never reset
    assert ctx.statistics()["sticky_error"]["code"] == 700


def test_kernel_on_freed_memory_is_an_illegal_address(ctx):
    """A kernel given a pointer that has been freed faults when it runs."""
    p = ctx.malloc(4096)
    ctx.free(p)
    ctx.launch("fill_f32", 1, 256, [p, 1.0, 16])
    with pytest.raises(IllegalAddressError):
        ctx.synchronize()


@pytest.mark.parametrize("containment", ["device", "client"])
def test_fault_containment(daemon_factory, containment):
    """A fault reaches every client on the device (Volta+ MPS) or, under `client`, only the culprit; until
    the faulted clients have gone the server is in FAULT and refuses newcomers, then it serves them again."""
    d = start_daemon("--time-scale", "100", "--fault-containment", containment)
    daemon_factory.append(d)
    with mpsd_client.connect(d.pipe_dir) as bystander, mpsd_client.connect(d.pipe_dir) as culprit:
        q = bystander.malloc(64)
        p = culprit.malloc(64)
        culprit.launch("fill_f32", 1, 32, [p, 0.0, 17])
        with pytest.raises(IllegalAddressError):
            culprit.synchronize()
        if containment == "device":
            with pytest.raises(IllegalAddressError):
                bystander.memset(q, 0, 64)
        else:
            bystander.memset(q, 0, 64)
            bystander.synchronize()
        with pytest.raises(mpsd_client.MpsServerNotReadyError):
            mpsd_client.connect(d.pipe_dir)
    deadline = time.monotonic() + 20
    while d.server_log().count("disconnected") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # the two clients' exits reach the daemon asynchronously
    with mpsd_client.connect(d.pipe_dir) as newcomer:  # the faulted clients are gone: it starts clean
        newcomer.synchronize()
    log = d.server_log()
    assert "encountered a fatal GPU error." in log
    assert "The following client process have a sticky error set:" in log


def test_shape_checks_are_not_fooled_by_equal_values(ctx):
    """A float or bool grid equal to a valid int grid is still refused, even after the int one was used."""
    ctx.launch("spin", 1, 32, [0])
    for grid in (1.0, True, (1.0,)):
        with pytest.raises(InvalidConfigurationError):
            ctx.launch("spin", grid, 32, [0])
    ctx.synchronize()
