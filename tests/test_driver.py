"""The driver-API flavour (mpsd_client.driver) and the runtime flavour over it (mpsd_client.runtime), against a real
daemon process with two simulated H200s: cuInit first, a stack of current contexts per thread, primary contexts
shared with the runtime and reference counted, explicit contexts with memory, streams and events of their own,
and CUresult errors from the one table. Each case starts from a process that has not called cuInit."""
from __future__ import annotations

import shutil
import struct
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from daemons import DaemonProcess, run_worker, start_daemon
from mpsd_client import _contexts, driver, runtime
from mpsd_protocol import CudaError, error_name


@pytest.fixture(scope="module")
def two_gpus() -> Iterator[DaemonProcess]:
    d = start_daemon("--devices", "h200:2", "--time-scale", "100")
    yield d
    code = d.stop()
    assert code == 0, f"daemon exited {code}: {d.stderr_lines}"
    shutil.rmtree(d.pipe_dir.parent, ignore_errors=True)


@pytest.fixture(autouse=True)
def fresh_process(two_gpus: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each case begins before cuInit, with the daemon where the runtime flavour looks for it; every context it
    left open is closed after it."""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(two_gpus.pipe_dir))
    yield
    _contexts._state.forget()


def raises_cu(name: str, code: int, call: Callable[..., Any], *args: Any) -> CudaError:
    with pytest.raises(CudaError) as info:
        call(*args)
    assert (info.value.name, info.value.code) == (name, code), info.value
    return info.value


SEED = """
import struct
from mpsd_client import driver, runtime

size = 1 << 20
driver.init(0)
device0, device1 = driver.device_get(0), driver.device_get(1)
ctx0 = driver.ctx_create(0, device0)
ctx1 = driver.ctx_create(0, device1)
driver.ctx_set_current(ctx0)           # the thread is bound to device 0
ptr0 = runtime.malloc(size)            # allocated on device 0
driver.ctx_push_current(ctx1)          # pushed: bound to device 1
ptr1 = runtime.malloc(size)            # allocated on device 1
popped = driver.ctx_pop_current()      # popped: bound to device 0 again
print("popped ctx1", popped is ctx1, "now on", driver.ctx_get_device())
print("ptr0 on", ptr0.ctx.device_properties()["index"], "ptr1 on", ptr1.ctx.device_properties()["index"])
driver.memset_d8(ptr0, 7, size)
out = bytearray(4)
driver.memcpy_dtoh(out, ptr0)
print("ptr0 holds", list(out))
driver.ctx_destroy(ctx1)
driver.ctx_destroy(ctx0)
"""


def test_seed_example_runs_as_written(two_gpus: DaemonProcess) -> None:
    """The seed's section 1.3: two contexts on two devices, cudaMalloc between cuCtxSetCurrent, push and pop."""
    result = run_worker(SEED, two_gpus.pipe_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["popped ctx1 True now on 0", "ptr0 on 0 ptr1 on 1", "ptr0 holds [7, 7, 7, 7]"]


@pytest.mark.parametrize("call, args", [
    (driver.device_get_count, ()), (driver.device_get, (0,)), (driver.ctx_create, (0, 0)),
    (driver.ctx_get_current, ()), (driver.mem_alloc, (4096,)), (driver.device_primary_ctx_retain, (0,)),
])
def test_every_call_before_init_is_not_initialized(call: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Before cuInit, each call fails with CUDA_ERROR_NOT_INITIALIZED (3)."""
    error = raises_cu("CUDA_ERROR_NOT_INITIALIZED", 3, call, *args)
    assert isinstance(error, driver.NotInitializedError)


def test_init_takes_flags_zero_only(two_gpus: DaemonProcess) -> None:
    """cuInit(1) is CUDA_ERROR_INVALID_VALUE and leaves the driver uninitialised; cuInit(0) twice is fine."""
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.init, 1)
    raises_cu("CUDA_ERROR_NOT_INITIALIZED", 3, driver.device_get_count)
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    assert driver.device_get_count() == 2


def test_devices_are_queried_without_a_context(two_gpus: DaemonProcess) -> None:
    """Device queries need no current context; an ordinal past the count is CUDA_ERROR_INVALID_DEVICE."""
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    assert driver.device_get(1) == 1
    assert driver.device_get_name(1) == "NVIDIA H200"
    assert driver.device_get_attribute(driver.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 1) == 132
    assert driver.device_get_attribute(driver.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0) == 9
    assert driver.device_get_attribute(driver.CU_DEVICE_ATTRIBUTE_WARP_SIZE, 0) == 32
    raises_cu("CUDA_ERROR_INVALID_DEVICE", 101, driver.device_get, 2)
    raises_cu("CUDA_ERROR_INVALID_DEVICE", 101, driver.ctx_create, 0, 2)
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.device_get_attribute, 100000, 0)
    assert driver.ctx_get_current() is None


@pytest.mark.parametrize("call, args", [
    (driver.mem_alloc, (4096,)), (driver.ctx_synchronize, ()), (driver.ctx_get_device, ()),
    (driver.ctx_pop_current, ()), (driver.stream_create, ()), (driver.event_create, ()),
    (driver.launch_kernel, ("fill_f32", 1, 1, 1, 32, 1, 1, 0, None, [0, 1.0, 0])),
])
def test_no_current_context_is_invalid_context(two_gpus: DaemonProcess, call: Callable[..., Any],
                                               args: tuple[Any, ...]) -> None:
    """With no context current to the thread, calls in the current context are CUDA_ERROR_INVALID_CONTEXT (201)."""
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    error = raises_cu("CUDA_ERROR_INVALID_CONTEXT", 201, call, *args)
    assert isinstance(error, driver.InvalidContextError)


def test_each_thread_has_its_own_stack(two_gpus: DaemonProcess) -> None:
    """A context current here is not current to another thread, which may push its own or share this one."""
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    ctx0 = driver.ctx_create(0, 0)
    ctx1 = driver.ctx_create(0, 1)
    driver.ctx_pop_current()
    seen: dict[str, Any] = {}

    def other() -> None:
        seen["before"] = driver.ctx_get_current()
        driver.ctx_push_current(ctx1)
        seen["pushed"] = driver.ctx_get_device()
        driver.ctx_push_current(ctx0)  # one context may be current to two threads at once
        seen["shared"] = driver.mem_alloc(4096).ctx is ctx0.runtime

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == {"before": None, "pushed": 1, "shared": True}
    assert driver.ctx_get_current() is ctx0


def test_set_current_replaces_the_top(two_gpus: DaemonProcess) -> None:
    """cuCtxSetCurrent swaps the top of the stack (pushes onto an empty one); None unbinds it."""
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    ctx0 = driver.ctx_create(0, 0)
    ctx1 = driver.ctx_create(0, 1)  # stack: ctx0, ctx1
    driver.ctx_set_current(ctx0)    # stack: ctx0, ctx0
    assert driver.ctx_pop_current() is ctx0
    assert driver.ctx_get_current() is ctx0
    driver.ctx_set_current(None)
    assert driver.ctx_get_current() is None
    driver.ctx_set_current(ctx1)
    assert driver.ctx_get_device() == 1
    raises_cu("CUDA_ERROR_INVALID_CONTEXT", 201, driver.ctx_push_current, "not a context")


def test_destroy_pops_here_and_stays_current_elsewhere(two_gpus: DaemonProcess) -> None:
    """cuCtxDestroy pops the caller's current context; another thread it is current to gets
    CUDA_ERROR_CONTEXT_IS_DESTROYED (709); a destroyed context cannot be pushed or destroyed again."""
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    ctx = driver.ctx_create(0, 0)
    bound, destroyed, errors = threading.Event(), threading.Event(), []

    def other() -> None:
        driver.ctx_push_current(ctx)
        bound.set()
        destroyed.wait(30)
        try:
            driver.mem_alloc(4096)
        except CudaError as exc:
            errors.append((exc.name, exc.code))

    thread = threading.Thread(target=other)
    thread.start()
    assert bound.wait(30)
    driver.ctx_destroy(ctx)
    destroyed.set()
    thread.join()
    assert driver.ctx_get_current() is None
    assert errors == [("CUDA_ERROR_CONTEXT_IS_DESTROYED", 709)]
    raises_cu("CUDA_ERROR_INVALID_CONTEXT", 201, driver.ctx_push_current, ctx)
    raises_cu("CUDA_ERROR_INVALID_CONTEXT", 201, driver.ctx_destroy, ctx)


def test_contexts_keep_their_own_memory_streams_and_events(two_gpus: DaemonProcess) -> None:
    """A pointer, stream or event of one context is refused in another, as the driver refuses them."""
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    ctx0 = driver.ctx_create(0, 0)
    ptr0 = driver.mem_alloc(1 << 20)
    stream0 = driver.stream_create()
    event0 = driver.event_create()
    driver.event_record(event0, stream0)
    driver.ctx_create(0, 0)  # a second context on the same device, current now
    event1 = driver.event_create()
    driver.event_record(event1)
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.mem_free, ptr0)
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.memcpy_htod, ptr0, b"\0" * 16)
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.launch_kernel, "fill_f32", 1, 1, 1, 32, 1, 1, 0, None,
              [ptr0, 1.0, 16])
    raises_cu("CUDA_ERROR_INVALID_HANDLE", 400, driver.launch_kernel, "fill_f32", 1, 1, 1, 32, 1, 1, 0, stream0,
              [driver.mem_alloc(64), 1.0, 16])
    raises_cu("CUDA_ERROR_INVALID_HANDLE", 400, driver.event_elapsed_time, event0, event1)
    raises_cu("CUDA_ERROR_INVALID_HANDLE", 400, driver.event_record, event1, stream0)
    driver.stream_synchronize(stream0)  # a stream is waited for from any context
    driver.stream_synchronize(None)  # and None is the current context's NULL stream
    driver.ctx_push_current(ctx0)
    driver.mem_free(ptr0)  # in its own context it frees


def test_destroying_a_context_frees_its_memory(two_gpus: DaemonProcess) -> None:
    """cuCtxDestroy gives back what the context held: the device's free memory comes back (once the daemon has
    torn the connection down, which cuCtxDestroy does not wait for: docs/architecture.md says so)."""
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    watcher = driver.ctx_create(0, 1)
    free_before, _ = driver.mem_get_info()
    doomed = driver.ctx_create(0, 1)
    driver.mem_alloc(4 << 30)
    driver.ctx_destroy(doomed)
    assert driver.ctx_get_current() is watcher
    deadline = time.monotonic() + 30
    while driver.mem_get_info()[0] != free_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert driver.mem_get_info()[0] == free_before


def test_work_runs_in_the_current_context(two_gpus: DaemonProcess) -> None:
    """Copies, memsets, launches on a stream and event timing in an explicit context give CUDA's results."""
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    driver.ctx_create(0, 1)
    n = 1 << 16
    ptr = driver.mem_alloc(4 * n)
    stream = driver.stream_create(driver.CU_STREAM_NON_BLOCKING)
    start, end = driver.event_create(), driver.event_create()
    driver.memcpy_htod_async(ptr, struct.pack(f"{n}f", *range(n)), stream)
    driver.event_record(start, stream)
    driver.launch_kernel("fill_f32", n // 256, 1, 1, 256, 1, 1, 0, stream, [ptr + 8, 5.0, n - 2])
    driver.event_record(end, stream)
    driver.stream_synchronize(stream)
    assert driver.event_elapsed_time(start, end) > 0
    out = bytearray(16)
    driver.memcpy_dtoh(out, ptr)
    assert struct.unpack("4f", out) == (0.0, 1.0, 5.0, 5.0)
    driver.memset_d8(ptr, 0xAB, 4)
    driver.ctx_synchronize()
    driver.memcpy_dtoh(out, ptr)
    assert out[:5] == b"\xab\xab\xab\xab\x00"
    raises_cu("CUDA_ERROR_INVALID_HANDLE", 400, driver.launch_kernel, "no_such_kernel", 1, 1, 1, 1, 1, 1, 0, None,
              [])
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.launch_kernel, "fill_f32", 1, 1, 1, 4096, 1, 1, 0, None,
              [ptr, 1.0, 16])  # a block too large: the runtime's invalid configuration (9) is the driver's 1
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.mem_alloc, 0)
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.stream_create, 2)
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.event_create, driver.CU_EVENT_INTERPROCESS)
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.ctx_create, 0x100, 0)
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.ctx_create, 0x3, 0)  # CU_CTX_SCHED_SPIN | _YIELD
    blocking = driver.ctx_create(0x4, 0)  # CU_CTX_SCHED_BLOCKING_SYNC: how its calls wait
    assert blocking.runtime.get_device_flags() & 0x7 == 0x4


def test_primary_context_is_reference_counted(two_gpus: DaemonProcess) -> None:
    """Retains share one handle; the last release frees its memory; a released primary is no context until it is
    retained again, which gives the same handle, empty."""
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    primary = driver.device_primary_ctx_retain(0)
    assert driver.device_primary_ctx_retain(0) is primary
    assert driver.device_primary_ctx_get_state(0) == (0, True)
    driver.ctx_push_current(primary)
    ptr = driver.mem_alloc(1 << 20)
    driver.device_primary_ctx_release(0)
    driver.mem_free(ptr)  # one reference left: still alive
    ptr = driver.mem_alloc(1 << 20)
    driver.device_primary_ctx_release(0)
    assert driver.device_primary_ctx_get_state(0) == (0, False)
    raises_cu("CUDA_ERROR_INVALID_CONTEXT", 201, driver.mem_alloc, 4096)  # still on the stack, but released
    raises_cu("CUDA_ERROR_INVALID_CONTEXT", 201, driver.device_primary_ctx_release, 0)
    raises_cu("CUDA_ERROR_INVALID_CONTEXT", 201, driver.ctx_destroy, primary)  # released, never destroyed
    assert driver.device_primary_ctx_retain(0) is primary
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.mem_free, ptr)  # the old allocation went with the release
    raises_cu("CUDA_ERROR_INVALID_CONTEXT", 201, driver.ctx_destroy, primary)


def test_primary_reset_frees_but_keeps_references(two_gpus: DaemonProcess) -> None:
    """cuDevicePrimaryCtxReset frees the primary context's memory; its retains still hold it."""
    driver.init(0, pipe_dir=two_gpus.pipe_dir)
    driver.ctx_push_current(driver.device_primary_ctx_retain(1))
    ptr = driver.mem_alloc(1 << 20)
    driver.device_primary_ctx_reset(1)
    assert driver.device_primary_ctx_get_state(1) == (0, True)
    raises_cu("CUDA_ERROR_INVALID_VALUE", 1, driver.mem_free, ptr)
    driver.mem_free(driver.mem_alloc(4096))


def test_runtime_threads_share_the_primary_context(two_gpus: DaemonProcess) -> None:
    """Every thread that uses the runtime flavour on a device is in its primary context, the driver's too."""
    contexts: list[Any] = []

    def worker() -> None:
        runtime.set_device(1)
        contexts.append(runtime.current())
        runtime.free(runtime.malloc(4096))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(contexts) == 3 and all(c is contexts[0] for c in contexts)
    assert driver.device_primary_ctx_retain(1).runtime is contexts[0]
    assert runtime.get_device() == 0  # this thread chose no device: 0, as cudart's default
    ptr = runtime.malloc(4096)  # device 0's primary, made current to this thread
    assert driver.ctx_get_current() is driver.device_primary_ctx_retain(0)
    driver.mem_free(ptr)


def test_device_reset_releases_the_runtimes_reference(two_gpus: DaemonProcess) -> None:
    """cudaDeviceReset frees the primary context's memory and drops the runtime's reference (a driver user's stays);
    the next runtime call starts it again."""
    runtime.set_device(0)
    ptr = runtime.malloc(1 << 20)
    assert driver.device_primary_ctx_get_state(0) == (0, True)
    runtime.device_reset()
    assert driver.device_primary_ctx_get_state(0) == (0, False)
    ptr = runtime.malloc(1 << 20)  # started afresh
    driver.device_primary_ctx_retain(0)
    runtime.device_reset()
    assert driver.device_primary_ctx_get_state(0) == (0, True)
    with pytest.raises(CudaError) as info:
        runtime.free(ptr)
    assert info.value.name == "cudaErrorInvalidValue"  # the runtime flavour keeps the runtime's names


def test_driver_names_come_from_the_one_table() -> None:
    """cuGetErrorName beside cudaGetErrorName: the same code, each API's name; runtime-only codes translate."""
    assert driver.get_error_name(201) == "CUDA_ERROR_INVALID_CONTEXT"
    assert error_name(201) == "cudaErrorDeviceUninitialized"
    assert driver.get_error_name(3) == "CUDA_ERROR_NOT_INITIALIZED"
    assert driver.get_error_name(0) == "CUDA_SUCCESS"
    assert driver.get_error_name(9) == "CUDA_ERROR_INVALID_VALUE"
    assert driver.get_error_string(201) == "invalid device context"
    assert driver.InvalidContextError.code == 201 and driver.InvalidHandleError.code == 400


def test_device_count_follows_cuda_visible_devices(two_gpus: DaemonProcess) -> None:
    """cuDeviceGetCount counts what CUDA_VISIBLE_DEVICES leaves, renumbered from 0, as the daemon applies it."""
    code = """
from mpsd_client import driver
driver.init(0)
ctx = driver.ctx_create(0, driver.device_get(0))
print(driver.device_get_count(), ctx.runtime.device_properties()["index"])
try:
    driver.device_get(1)
except driver.InvalidDeviceError as exc:
    print(exc.name)
"""
    result = run_worker(code, two_gpus.pipe_dir, env={"CUDA_VISIBLE_DEVICES": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1", "CUDA_ERROR_INVALID_DEVICE"]
