# Quotas as MPS defines them, read from each client's environment and only ever tightening the daemon's:
# the active thread percentage caps SMs in whole TPCs, the client priority is recorded, and
# CUDA_VISIBLE_DEVICES picks and renumbers the daemon's devices. Clients whose environment is all that matters
# run in this process against a daemon in it (tests/inproc.py); tenants sharing the GPU are real processes.
from __future__ import annotations

import contextlib
import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

import mpsd_client
from daemons import start_daemon
from inproc import in_process_daemon
from mpsd.runtime.memory import CHUNK
from mpsd.sim import H200
from mpsd_client import InvalidDeviceError, InvalidValueError, NoDeviceError
from mpsd_protocol import parse_mem_limits

ONE_MS = int(1e-3 * 1.98e9)

async def probe(d, **env: str) -> dict:
    """The quotas a client with this environment sees, and the simulated time of one FULL spin kernel."""
    async with d.connect(**env) as ctx:
        s = await ctx.create_stream()
        start, end = await ctx.create_event(), await ctx.create_event()
        await ctx.launch("spin", 1, 32, [int(20 * 1.98e9)], stream=s)  # hold the stream while the rest is queued
        await start.record(s)
        await ctx.launch("spin", 264, 1024, [ONE_MS], stream=s)
        await end.record(s)
        await end.synchronize()
        return {"sms": (await ctx.device_properties())["multiprocessor_count"], "quotas": ctx.quotas,
                "ms": await start.elapsed_ms(end), "max_sms": (await ctx.statistics())["max_sms"]}


@pytest.mark.parametrize("percentage,sms,waves", [("25", 32, 5), ("50", 66, 2), ("100", 132, 1), ("10", 12, 11)])
async def test_active_thread_percentage_caps_sms_in_whole_tpcs(served, autojump_clock, percentage, sms, waves):
    """25% of 132 SMs is 32 (whole TPCs, rounded down): a full-wave kernel then needs 5 waves, as measured."""
    seen = await probe(served, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=percentage)
    assert seen["sms"] == seen["quotas"]["sm_cap"] == sms
    assert seen["max_sms"] == sms
    assert seen["ms"] == pytest.approx(waves + H200.kernel_overhead * 1e3, abs=1e-9)


async def device_copies(d, **env: str) -> dict:
    """A memset and a device-to-device copy of 64 MiB on a held stream: their simulated times, the bytes, the
    client's SMs."""
    async with d.connect(**env) as ctx:
        n = 64 << 20
        a, b = await ctx.malloc(n), await ctx.malloc(n)
        s = await ctx.create_stream()
        start, mid, end = await ctx.create_event(), await ctx.create_event(), await ctx.create_event()
        await ctx.launch("spin", 1, 32, [int(20 * 1.98e9)], stream=s)  # hold the stream while the rest is queued
        await start.record(s)
        await ctx.memset(a, 7, n, stream=s)
        await mid.record(s)
        await ctx.memcpy_dtod(b, a, n, stream=s)
        await end.record(s)
        await end.synchronize()
        out = bytearray(16)
        await ctx.memcpy_dtoh(out, b + n - 16)
        stats = await ctx.statistics()
        return {"memset_ms": await start.elapsed_ms(mid), "copy_ms": await mid.elapsed_ms(end), "bytes": list(out),
                "max_sms": stats["max_sms"], "kernels": stats["kernels_completed"]}


async def test_device_copies_run_under_the_clients_sm_cap(served, autojump_clock):
    """A memset and a device-to-device copy are kernels, as on a real H200: at 25% active threads they stay
    on the client's 32 SMs and take longer than at 100%, and still move the bytes."""
    seen = {}
    for percentage in ("25", "100"):
        seen[percentage] = await device_copies(served, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=percentage)
    assert seen["25"]["max_sms"] == 32 and seen["100"]["max_sms"] == 132
    assert all(s["kernels"] == 3 and s["bytes"] == [7] * 16 for s in seen.values())  # spin, memset, copy
    for op in ("memset_ms", "copy_ms"):
        assert seen["25"][op] > 1.5 * seen["100"][op] > 0


async def test_daemon_percentage_is_a_ceiling_for_clients(autojump_clock):
    """With the daemon at 50%, a client asking for 75% gets 50% and one asking for 25% gets 25%."""
    async with in_process_daemon("--time-scale", "100", "--active-thread-percentage", "50") as d:
        assert (await probe(d, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="75"))["sms"] == 66
        assert (await probe(d, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="25"))["sms"] == 32
        assert (await probe(d))["sms"] == 66


async def test_client_priority_is_recorded_and_only_lowered(autojump_clock):
    """CUDA_MPS_CLIENT_PRIORITY=1 marks the client below normal; it cannot rise above the daemon's default."""
    async with in_process_daemon("--time-scale", "100", "--client-priority", "1") as d:
        async with d.connect(CUDA_MPS_CLIENT_PRIORITY="0") as ctx:
            assert ctx.quotas["priority"] == 1
        async with d.connect(CUDA_MPS_CLIENT_PRIORITY="1") as ctx:
            assert ctx.quotas["priority"] == 1


@pytest.mark.parametrize("name,value", [
    ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "lots"), ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "0"),
    ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "101"), ("CUDA_MPS_CLIENT_PRIORITY", "2"),
])
def test_malformed_quota_variables_fail_connect_naming_the_variable(module_daemon, monkeypatch, name, value):
    """A quota variable the runtime cannot read fails connect with cudaErrorInvalidValue naming it."""
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidValueError, match=name):
        mpsd_client.connect(module_daemon.pipe_dir)


def test_visible_devices_select_and_renumber(daemon_factory, monkeypatch):
    """CUDA_VISIBLE_DEVICES=1 makes the daemon's second GPU this process's device 0."""
    d = start_daemon("--time-scale", "100", "--devices", "h200:2")
    daemon_factory.append(d)
    with mpsd_client.connect(d.pipe_dir, device=1) as ctx:
        assert ctx.device_properties()["index"] == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with mpsd_client.connect(d.pipe_dir) as ctx:
        assert ctx.device_properties()["index"] == 1
    with pytest.raises(InvalidDeviceError):
        mpsd_client.connect(d.pipe_dir, device=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(NoDeviceError):
        mpsd_client.connect(d.pipe_dir)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(NoDeviceError):
        mpsd_client.connect(d.pipe_dir)  # no such device: as in CUDA, none is visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,0")
    with mpsd_client.connect(d.pipe_dir) as ctx:
        assert ctx.device_properties()["index"] == 1
    with pytest.raises(InvalidDeviceError, match="1 visible"):
        mpsd_client.connect(d.pipe_dir, device=1)  # the list ended at 7
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,x,1")
    with pytest.raises(InvalidDeviceError):
        mpsd_client.connect(d.pipe_dir, device=1)


def test_visible_devices_by_uuid(daemon_factory, monkeypatch):
    """CUDA_VISIBLE_DEVICES takes UUIDs as CUDA does, whole or a prefix that names one device; and the device's
    properties carry torch's name for the SM count beside CUDA's."""
    d = start_daemon("--time-scale", "100", "--devices", "h200:2")
    daemon_factory.append(d)
    with mpsd_client.connect(d.pipe_dir, device=1) as ctx:
        properties = ctx.device_properties()
    uuid = properties["uuid"]
    assert properties["multi_processor_count"] == properties["multiprocessor_count"] == 132
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuid)
    with mpsd_client.connect(d.pipe_dir) as ctx:
        assert ctx.device_properties()["index"] == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{uuid},0")  # a UUID, then an index
    with mpsd_client.connect(d.pipe_dir, device=1) as ctx:
        assert ctx.device_properties()["index"] == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuid[:-3])  # a prefix that names one device
    with mpsd_client.connect(d.pipe_dir) as ctx:
        assert ctx.device_properties()["index"] == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5eed")  # a prefix of both: names none
    with pytest.raises(NoDeviceError):
        mpsd_client.connect(d.pipe_dir)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(NoDeviceError):
        mpsd_client.connect(d.pipe_dir)


def test_devices_are_separate(daemon_factory):
    """Memory and work on one simulated GPU do not show on the other."""
    d = start_daemon("--time-scale", "100", "--devices", "h200:2")
    daemon_factory.append(d)
    with mpsd_client.connect(d.pipe_dir, device=0) as a, mpsd_client.connect(d.pipe_dir, device=1) as b:
        free_a, free_b = a.mem_get_info()[0], b.mem_get_info()[0]
        a.malloc(1 << 30)
        assert b.mem_get_info()[0] == free_b
        assert a.mem_get_info()[0] == free_a - (1 << 30)


def test_no_daemon_is_an_mps_connection_error(tmp_path):
    """Connecting where no daemon listens is cudaErrorMpsConnectionFailed, saying where it looked."""
    with pytest.raises(mpsd_client.MpsConnectionError, match=str(tmp_path)):
        mpsd_client.connect(tmp_path)


def test_several_tenants_share_the_gpu_within_their_caps(daemon):
    """Three worker processes with different quotas run at once; each computes right and stays in its cap."""
    code = """
        import json, mpsd_client, numpy as np
        with mpsd_client.connect() as ctx:
            n = 1 << 16
            x = np.random.default_rng(ctx.client_id).standard_normal(n, dtype=np.float32)
            p = ctx.malloc(4 * n)
            ctx.memcpy_htod(p, x)
            for _ in range(20):
                ctx.launch("spin", 264, 1024, [%d])
                ctx.launch("saxpy_f32", 256, 256, [2.0, p, p, n])
            out = np.empty(n, np.float32)
            ctx.memcpy_dtoh(out, p)
            stats = ctx.statistics()
            print(json.dumps({"ok": bool(np.allclose(out, x * 3.0**20, rtol=1e-4)), "cap": stats["sm_cap"],
                              "max": stats["max_sms"], "kernels": stats["kernels_completed"]}))
    """ % ONE_MS
    from daemons import spawn_worker

    workers = [spawn_worker(code, daemon.pipe_dir, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": pct})
               for pct in ("100", "50", "25")]
    results = []
    for w in workers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
        results.append(json.loads(out))
    assert [r["cap"] for r in results] == [132, 66, 32]
    for r in results:
        assert r["ok"] and r["kernels"] == 40 and 0 < r["max"] <= r["cap"]


# -- a client never allocates past its limit, whatever the interleaving ---------------------------------------
# Three clients of one daemon (its default limit, a tighter one from the environment, a looser one that the
# daemon must not grant) allocate and free in an order Hypothesis picks. After every step each client's
# charge stays within its limit, a refused allocation changes nothing, and one is refused only when the
# memory it needs (whole 2 MiB pages, at most) is not free.

# A limit counts the context's own charge: leave each client a few allocations' worth above it.
_CONTEXT_MIB = -(-H200.context_memory // (1 << 20))
DAEMON_LIMIT = (_CONTEXT_MIB + 16) << 20
CLIENT_LIMITS = (None, f"0={_CONTEXT_MIB + 8}M", f"0={2 * _CONTEXT_MIB}M")  # what each environment asks for


@pytest.fixture(scope="module")
def limited_daemon():
    d = start_daemon("--time-scale", "100", "--pinned-mem-limit", f"{DAEMON_LIMIT >> 20}M")
    yield d
    assert d.stop() == 0
    shutil.rmtree(d.pipe_dir.parent, ignore_errors=True)


@contextlib.contextmanager
def _environment(name: str, value: str | None):
    old = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if old is not None:
            os.environ[name] = old


# Sizes on both sides of the 1 MiB line between packed small allocations and page-rounded large ones;
# mallocs outnumber frees, so the limits are reached.
MALLOC = st.tuples(st.just("malloc"), st.integers(1, 1 << 20) | st.integers(1 << 20, 6 << 20))
STEPS = st.lists(st.tuples(
    st.integers(0, len(CLIENT_LIMITS) - 1),
    st.one_of(MALLOC, MALLOC, st.tuples(st.just("free"), st.integers(0, 15))),
), min_size=8, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=STEPS)
@example(steps=[(who, ("malloc", 6 << 20)) for who in (0, 1, 2) * 4] + [(1, ("free", 0)), (1, ("malloc", 6 << 20))])
def test_no_client_allocates_past_its_limit(limited_daemon, steps):
    """Under any interleaving of mallocs and frees, each client stays within min(daemon limit, its request)."""
    clients = []
    with contextlib.ExitStack() as stack:
        for request in CLIENT_LIMITS:
            with _environment("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", request):
                clients.append(stack.enter_context(mpsd_client.connect(limited_daemon.pipe_dir)))
        limits = [min([DAEMON_LIMIT] + ([parse_mem_limits(r)[0]] if r else [])) for r in CLIENT_LIMITS]
        assert [c.quotas["pinned_mem_limit"] for c in clients] == limits
        live: list[list[int]] = [[] for _ in clients]
        for who, (action, value) in steps:
            ctx = clients[who]
            used = ctx.statistics()["memory_used"]
            if action == "free":
                if live[who]:
                    ctx.free(live[who].pop(value % len(live[who])))
            else:
                free, _ = ctx.mem_get_info()
                try:
                    live[who].append(ctx.malloc(value))
                except mpsd_client.OutOfMemoryError:
                    event("an allocation was refused")
                    assert ctx.statistics()["memory_used"] == used
                    assert free < -(-value // CHUNK) * CHUNK
            for c, limit in zip(clients, limits):
                assert c.statistics()["memory_used"] + H200.context_memory <= limit
