# The kernel-level dispatcher (mpsd.runtime.dispatch) in front of the simulated H200 (`--dispatch kernel`): the
# real daemon in this trio loop on its virtual clock (tests/inproc.py), its clients on its socket; trio's
# autojump clock lets its idle grace pass in no wall time when every task waits. Simulated times are exact, so
# each rule shows as a time: a kernel of 264 blocks of 1024 threads fills the H200 (two blocks on each of its
# 132 SMs), so such kernels run one after another, in the order the policy releases them.
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import trio

from inproc import in_process_daemon
from mpsd.daemon.config import ConfigError, load_config
from mpsd.runtime.dispatch import Dispatcher
from mpsd.runtime.dispatch_policies import KernelPolicy
from mpsd.sim import H200
from mpsd.stress.metrics import latency_summary
from mpsd.stress.runner import run_virtual
from mpsd.stress.workload import load_workload
from mpsd_client import IllegalAddressError, MpsClientTerminatedError

ONE_MS = int(1e-3 * 1.98e9)  # spin cycles for 1 ms at the H200's 1.98 GHz
UNIT = 1 + H200.kernel_overhead * 1e3  # ms: one full-device 1-ms kernel, with the model's launch overhead
FULL = 264
BEST_EFFORT = {"CUDA_MPS_CLIENT_PRIORITY": "1"}
KERNEL_POLICIES = ["priority", "round-robin", "fair", "timeslice", "exclusive"]
WORKLOADS = Path(__file__).parent.parent / "examples" / "workloads"


def served(policy: str, *args: str, shared_process: bool = False):
    return in_process_daemon("--policy", policy, "--dispatch", "kernel", "--clock", "virtual", *args,
                             shared_process=shared_process)


async def together(*calls) -> None:
    """Await `calls` at once: the virtual clock runs on while every client waits in mpsd, and waits its idle
    grace for a client that does not."""
    async with trio.open_nursery() as nursery:
        for call in calls:
            nursery.start_soon(call)


def dispatcher(d) -> Dispatcher:
    backend = d.daemon.devices[0].backend
    assert isinstance(backend, Dispatcher)
    return backend


async def full_kernels(actx, stream, n: int, ms: float = 1.0) -> tuple[object, object]:
    """`n` full-device kernels of `ms` each on `stream`, between two events it returns."""
    start, end = await actx.create_event(), await actx.create_event()
    await start.record(stream)
    for _ in range(n):
        await actx.launch("spin", FULL, 1024, [int(ms * ONE_MS)], stream=stream)
    await end.record(stream)
    return start, end


async def test_mps_needs_no_dispatcher_and_the_others_have_one(autojump_clock):
    """`mps` stays pass-through under --dispatch kernel (today's path, at today's speed)."""
    async with served("mps") as d:
        assert not isinstance(d.daemon.devices[0].backend, Dispatcher)
    async with served("fair") as d:
        assert dispatcher(d).policy == "fair"


@pytest.mark.parametrize("policy", KERNEL_POLICIES)
async def test_each_stream_keeps_its_order(policy, autojump_clock):
    """Work held in the daemon goes to the device in its stream's order, whoever else is queued: fill, then
    two saxpys of the buffer with itself (x3 each) give 9 only in that order."""
    async with served(policy) as d, d.connect() as a, d.connect(**BEST_EFFORT) as b:
        other = await b.create_stream()
        await full_kernels(b, other, 6)  # another client's work, queued beside
        s = await a.create_stream()
        p = await a.malloc(4096)
        await full_kernels(a, s, 3)
        await a.launch("fill_f32", 4, 256, [p, 1.0, 1024], stream=s)
        for _ in range(2):
            await a.launch("saxpy_f32", 4, 256, [2.0, p, p, 1024], stream=s)
        await together(a.synchronize, b.synchronize)
        out = np.empty(1024, np.float32)
        await a.memcpy_dtoh(out, p)
        assert (out == 9.0).all()


async def test_a_client_has_at_most_its_bound_of_kernels_on_the_device(autojump_clock):
    """--kernels-in-flight N: a client's kernels beyond N wait in the daemon, and go as the first ones end (with
    another client on the device, idle: a client alone has no bound, as nobody could wait behind its work)."""
    async with served("round-robin", "--kernels-in-flight", "3") as d, d.connect() as a, d.connect():
        s = await a.create_stream()
        for _ in range(10):
            await a.launch("spin", 1, 32, [ONE_MS], stream=s)
        assert not await s.query()  # a request: the launches before it have reached the daemon
        mine, _ = [p["dispatch"] for p in d.daemon.status()["processes"]]
        assert (mine["in_flight"], mine["queued"], mine["released"]) == (3, 7, 3)
        await s.synchronize()
        mine, _ = [p["dispatch"] for p in d.daemon.status()["processes"]]
        assert (mine["in_flight"], mine["queued"], mine["released"]) == (0, 0, 10)
        assert mine["gpu_time"] == pytest.approx(10 * UNIT / 1e3, rel=1e-6)


async def test_the_bound_is_for_the_others(autojump_clock):
    """A client alone on the device has no bound (nobody could wait behind its work); under `priority` neither
    has the most urgent client, beside a less urgent one, while the less urgent one keeps its bound."""
    async with served("round-robin", "--kernels-in-flight", "3") as d, d.connect() as a:
        s = await a.create_stream()
        for _ in range(10):
            await a.launch("spin", 1, 32, [ONE_MS], stream=s)
        assert not await s.query()
        (mine,) = [p["dispatch"] for p in d.daemon.status()["processes"]]
        assert (mine["in_flight"], mine["queued"]) == (10, 0)
        await s.synchronize()
    async with served("priority", "--kernels-in-flight", "1") as d, d.connect() as urgent, \
            d.connect(**BEST_EFFORT) as be:
        s_urgent, s_be = await urgent.create_stream(priority=-5), await be.create_stream()
        for _ in range(4):
            await be.launch("spin", 1, 32, [ONE_MS], stream=s_be)
            await urgent.launch("spin", 1, 32, [ONE_MS], stream=s_urgent)
        assert not await s_urgent.query() and not await s_be.query()
        held = {p["priority"]: p["dispatch"] for p in d.daemon.status()["processes"]}
        assert (held[0]["in_flight"], held[0]["queued"]) == (4, 0)
        assert held[1]["in_flight"] == 1  # its first, released before the urgent work came; the rest wait
        await together(urgent.synchronize, be.synchronize)


async def gated(a, b, n: int = 4, level: bool = True, blocker_ms: float = 1.0) -> tuple[float, float]:
    """`n` full-device kernels from each of a and b, all queued while a blocker of a's runs (b's stream waits for
    it through an IPC event): how long a's and b's took from the blocker's end, in UNITs. `level`: b runs a
    blocker as long beside it, so that both come to the gate with the same device time. Every handle is made
    first: once the blocker runs, the clients only post (a request's round trip would let the autojump clock
    run on)."""
    sa, sb = await a.create_stream(), await b.create_stream()
    gate = await a.create_event(disable_timing=True, interprocess=True)
    theirs = await b.ipc_open_event_handle(await a.ipc_get_event_handle(gate))
    (a_start, a_end), (b_start, b_end) = [[await c.create_event() for _ in range(2)] for c in (a, b)]
    await a.launch("spin", 1, 32, [int(blocker_ms * ONE_MS)], stream=sa)
    if level:
        await b.launch("spin", 1, 32, [int(blocker_ms * ONE_MS)], stream=sb)
    await gate.record(sa)
    await sb.wait_event(theirs)
    for c, s, start, end in ((a, sa, a_start, a_end), (b, sb, b_start, b_end)):
        await start.record(s)
        for _ in range(n):
            await c.launch("spin", FULL, 1024, [ONE_MS], stream=s)
        await end.record(s)
    await together(a.synchronize, b.synchronize)
    return (await a_start.elapsed_ms(a_end) / UNIT, await b_start.elapsed_ms(b_end) / UNIT)


@pytest.mark.parametrize("policy,level,turns", [
    ("round-robin", True, (7, 8)),  # a1 b1 a2 b2 a3 b3 a4 b4
    ("fair", True, (7, 8)),  # the same turns, by device time (equal before the gate; a's queued first)
    ("exclusive", False, (4, 8)),  # a's work, all of it, then b's
    # a's slice began with its blocker, and a1 went with it; b's slice releases b1..b4 (within 2.09 ms of its
    # start), then a's the rest
    ("timeslice", False, (8, 5)),
])
async def test_full_device_kernels_go_in_the_policys_turns(policy, level, turns, autojump_clock):
    """Two clients each queue four full-device kernels behind a blocker: how long each client's took from the
    blocker's end says in what order the policy released them."""
    async with served(policy, shared_process=True) as d, d.connect() as a, d.connect() as b:
        assert await gated(a, b, level=level, blocker_ms=10) == pytest.approx(turns, abs=0.01)


async def test_the_next_kernel_waits_on_the_device_behind_the_one_running(autojump_clock):
    """Where no kernel has room, the policy's next pick goes at once to wait on the device behind the kernels
    running, one at a time: it starts as they end, not once the daemon has learnt of their end (about 200 us
    on the H200). It holds no SM meanwhile: each full-device kernel ends a kernel's time after the one before,
    in the order the policy picked them."""
    async with served("round-robin", shared_process=True) as d, d.connect() as a, d.connect() as b:
        sa, sb = await a.create_stream(), await b.create_stream()
        a_start, a_end = await full_kernels(a, sa, 3)
        b_start, b_end = await full_kernels(b, sb, 3)
        tenants = dispatcher(d).tenants.values()
        # a's first runs, its second (round-robin's pick while a alone had work) waits behind it; b's are held
        assert sorted((t.in_flight, t.queued) for t in tenants) == [(0, 4), (2, 2)]  # (end records too)
        (running,) = dispatcher(d)._behind  # what the second waits for on the device: the first
        assert not running.done and running.handle.started <= 0.001 + H200.kernel_overhead
        await together(a.synchronize, b.synchronize)
        # a1 a2 b1 a3 b2 b3, back to back (b's start is recorded at once, beside a1)
        assert (await a_start.elapsed_ms(a_end), await b_start.elapsed_ms(b_end)) == pytest.approx(
            (4 * UNIT, 6 * UNIT), abs=0.05)


async def test_a_modelled_reaction_delays_what_goes_on_an_end(autojump_clock):
    """With --dispatch-reaction R, each kernel the dispatcher releases on another's end starts R later, as the
    daemon launches it on a real GPU: beside an idle urgent client, two best-effort clients' three full-device
    kernels each go one at a time (a1 a2 a3 b1 b2 b3), two of a's and all of b's on an end."""
    async def run(reaction_ms: float) -> tuple[float, float]:
        async with served("priority", "--dispatch-reaction", str(reaction_ms / 1e3), shared_process=True) as d, \
                d.connect(), d.connect(**BEST_EFFORT) as a, d.connect(**BEST_EFFORT) as b:
            sa, sb = await a.create_stream(), await b.create_stream()
            a_start, a_end = await full_kernels(a, sa, 3)
            b_start, b_end = await full_kernels(b, sb, 3)
            await together(a.synchronize, b.synchronize)
            return await a_start.elapsed_ms(a_end), await b_start.elapsed_ms(b_end)

    (a0, b0), (a1, b1) = await run(0.0), await run(0.5)
    assert a0 == pytest.approx(3 * UNIT, abs=0.02)
    assert (a1 - a0, b1 - b0) == pytest.approx((2 * 0.5, 5 * 0.5), abs=0.005)


@pytest.mark.parametrize("policy", ["exclusive", "timeslice"])
async def test_what_a_client_alone_released_is_its_slice_when_another_comes(policy, autojump_clock):
    """A client alone goes without a policy, all its kernels on the device at once; when another client's work
    comes, that is the first client's slice: the newcomer's full-device kernel waits for the six to drain, and
    ends a seventh kernel's time after they began (its start event is recorded when its calls come, a little
    after; released at once beside them, it would end within two)."""
    async with served(policy) as d, d.connect() as a:
        sa = await a.create_stream()
        await full_kernels(a, sa, 6)
        assert not await sa.query()  # the six are on the device, none held
        async with d.connect() as b:
            sb = await b.create_stream()
            start, end = await full_kernels(b, sb, 1)
            await together(a.synchronize, b.synchronize)
            assert 6.5 < await start.elapsed_ms(end) / UNIT <= 7


@pytest.mark.parametrize("weight,turns", [
    (1.0, (11, 12)),  # a1 b1 a2 b2 ... a6 b6
    (3.0, (7, 12)),  # a1 a2 a3 b1 a4 a5 a6 b2 ... b6: three of a's for each of b's while both have work
])
async def test_fair_shares_the_device_by_weight(weight, turns, autojump_clock):
    """Under `fair` the client with the least device time for its weight has its kernel released next."""
    async with served("fair", shared_process=True) as d, d.connect() as a, d.connect() as b:
        first = next(iter(d.daemon.devices[0].contexts.values()))  # a, the first to connect
        d.daemon.settings.weights[("client", first.id)] = weight
        d.daemon.reconfigure(first)
        assert dispatcher(d).tenants[first.id].weight == weight
        assert await gated(a, b, 6) == pytest.approx(turns, abs=0.01)


async def test_priority_holds_best_effort_work_while_urgent_work_waits(autojump_clock):
    """The urgent client's request waits only for what already runs: best-effort kernels queued before it stay
    in the daemon until it is done (under `mps` it would wait for all of them)."""
    async with served("priority") as d, d.connect() as urgent, d.connect(**BEST_EFFORT) as be:
        s_be, s_urgent = await be.create_stream(), await urgent.create_stream(priority=-5)
        await full_kernels(be, s_be, 6)  # 6 ms of best-effort work, two kernels of it released
        start, end = await full_kernels(urgent, s_urgent, 2)
        held = []

        async def urgent_done() -> None:
            await urgent.synchronize()
            held.extend(p["dispatch"]["queued"] for p in d.daemon.status()["processes"] if p["priority"] == 1)

        await together(urgent_done, be.synchronize)
        # Only the first best-effort kernel was released (the second would not have found SMs free): the
        # request waits for what is left of it alone, and the rest waited for the request.
        assert 2 * UNIT < await start.elapsed_ms(end) <= 3 * UNIT
        assert held == [5]


async def test_priority_releases_less_urgent_work_one_block_to_an_sm(autojump_clock):
    """Beside a more urgent client, best-effort kernels of one block to each SM go one at a time, though two
    would fit on the device at two blocks to an SM: an urgent kernel that comes then waits for one block that
    runs alone (1 ms here), not for two sharing each SM (2 ms)."""
    async with served("priority") as d, d.connect() as urgent, d.connect(**BEST_EFFORT) as be:
        s_be, s_urgent = await be.create_stream(), await urgent.create_stream(priority=-5)
        for _ in range(4):
            await be.launch("spin", 132, 1024, [ONE_MS], stream=s_be)
        assert not await s_be.query()
        (mine,) = [p["dispatch"] for p in d.daemon.status()["processes"] if p["priority"] == 1]
        assert (mine["in_flight"], mine["queued"]) == (1, 3)
        start, end = await full_kernels(urgent, s_urgent, 1)
        await together(urgent.synchronize, be.synchronize)
        assert await start.elapsed_ms(end) <= 2 * UNIT + 0.01  # at most what is left of one block, then its own


async def test_work_held_for_another_clients_event_holds_no_one_back(autojump_clock):
    """Priority holds less urgent clients only for urgent work that could go: an urgent stream that waits on a
    best-effort client's event lets that client's work go, though the urgent client has work on the device."""
    async with served("priority", shared_process=True) as d, d.connect() as urgent, \
            d.connect(**BEST_EFFORT) as be:
        s_be = await be.create_stream()
        long, waits = await urgent.create_stream(), await urgent.create_stream(priority=-5)
        await urgent.launch("spin", 1, 32, [50 * ONE_MS], stream=long)  # in flight until 50 ms
        await be.launch("spin", 1, 32, [ONE_MS], stream=s_be)
        await be.launch("spin", 1, 32, [ONE_MS], stream=s_be)  # its bound: the record below is held
        ready = await be.create_event(disable_timing=True, interprocess=True)
        await ready.record(s_be)
        theirs = await urgent.ipc_open_event_handle(await be.ipc_get_event_handle(ready))
        await waits.wait_event(theirs)
        start, end = await full_kernels(urgent, waits, 1)
        await together(end.synchronize, be.synchronize)
        assert not await long.query()  # done before the urgent client's long kernel


async def test_held_work_of_a_terminated_client_is_dropped_and_its_waiters_told(autojump_clock):
    """A client terminated while its work waits in the daemon: the work is dropped, never run, and its
    synchronize, waiting on it, returns at once with the sticky error. (On the wall clock, 100x, under the
    autojump clock: the test's own waits take turns with the device's.)"""
    async with in_process_daemon("--policy", "priority", "--dispatch", "kernel", "--time-scale", "100") as d, \
            d.connect() as urgent, d.connect(**BEST_EFFORT) as be:
        s_urgent, s_be = await urgent.create_stream(), await be.create_stream()
        await urgent.launch("spin", FULL, 1024, [1000 * ONE_MS], stream=s_urgent)  # a second of the device
        await full_kernels(be, s_be, 5)  # all held: the urgent kernel holds the device
        victim = next(c for c in d.daemon.devices[0].contexts.values() if c.quotas.priority == 1)
        released = dispatcher(d).tenants[victim.id].released
        told = trio.Event()

        async def sync() -> None:
            with pytest.raises(MpsClientTerminatedError):
                await be.synchronize()
            told.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync)
            await trio.sleep(0.001)
            d.daemon.terminate(victim, "test")
            with trio.fail_after(1):  # the urgent kernel has 10 wall seconds to go at 100x
                await told.wait()
        assert dispatcher(d).tenants[victim.id].queued == 0
        assert dispatcher(d).tenants[victim.id].released == released
        assert not await s_urgent.query()


async def test_a_departed_clients_held_work_is_dropped_not_waited_for(autojump_clock):
    """A best-effort client leaves with work held: the urgent client's next kernel finds the device free."""
    async with served("priority") as d, d.connect() as urgent:
        s = await urgent.create_stream()
        await urgent.launch("spin", FULL, 1024, [20 * ONE_MS], stream=s)
        async with d.connect(**BEST_EFFORT) as be:
            await full_kernels(be, await be.create_stream(), 8)
            await be.create_stream()  # a request: its launches have reached the daemon
        await urgent.synchronize()
        start, end = await full_kernels(urgent, s, 1)
        await end.synchronize()
        assert await start.elapsed_ms(end) == pytest.approx(UNIT, abs=0.01)
        assert len(dispatcher(d).tenants) == 1


async def test_a_fault_in_released_work_is_sticky_and_drops_what_is_held(autojump_clock):
    """A kernel that faults on the device gives its client the sticky error a GPU gives, and what the client
    still had waiting in the daemon is dropped (another client is there, so that its bound holds)."""
    async with served("round-robin", "--kernels-in-flight", "1") as d, d.connect() as a, d.connect():
        s = await a.create_stream()
        p = await a.malloc(4096)
        await a.launch("spin", 1, 32, [ONE_MS], stream=s)
        await a.launch("fill_f32", 4, 256, [p, 1.0, 1025], stream=s)  # one float past its allocation
        for _ in range(4):
            await a.launch("spin", FULL, 1024, [ONE_MS], stream=s)
        with pytest.raises(IllegalAddressError):
            await a.synchronize()
        me = dispatcher(d).tenants[min(dispatcher(d).tenants)]
        assert me.queued == 0 and me.released == 2
        with pytest.raises(IllegalAddressError):  # sticky
            await a.malloc(16)


class LowestIdFirst(KernelPolicy):
    """A policy of one's own, named module:Class: the client with the lowest id goes whenever it has work."""

    name = "lowest-id-first"

    def pick(self, dispatcher, ready):
        first = min(ready, key=lambda t: t.id)
        return first if dispatcher.room_for(first) else None


async def test_a_python_kernel_policy_decides(autojump_clock):
    async with served("test_dispatch:LowestIdFirst", shared_process=True) as d, d.connect() as a, \
            d.connect() as b:
        assert dispatcher(d).policy == "lowest-id-first"
        assert await gated(a, b, 2) == pytest.approx((2, 4), abs=0.01)  # a's two went first


@pytest.mark.parametrize("args,message", [
    (["--dispatch", "sometimes"], "invalid choice"),
    (["--dispatch", "kernel", "--policy", "fair", "--aging", "0.1"], "the fair policy takes no options"),
    (["--dispatch", "kernel", "--policy", "priority", "--aging", "-1"], "aging must be"),
    (["--dispatch", "kernel", "--policy", "nope"], "unknown policy 'nope'"),
    (["--dispatch", "kernel", "--policy", "mpsd.sim:Policy"], "is not a KernelPolicy"),
    (["--dispatch", "kernel", "--kernels-in-flight", "0"], "between 1 and 1024"),
    (["--dispatch", "kernel", "--dispatch-reaction", "-0.1"], "between 0 and 1 second"),
    (["--policy", "priority", "--dispatch-reaction", "0.0001"], "for --dispatch kernel on simulated devices"),
])
def test_bad_dispatch_settings_are_usage_errors(args, message, tmp_path, capsys):
    with pytest.raises((ConfigError, SystemExit)) as info:
        load_config(["--pipe-dir", str(tmp_path), *args], environ={})
    assert message in (str(info.value) + capsys.readouterr().err)


def test_device_sections_set_block_policies_not_kernel_ones(tmp_path):
    config = tmp_path / "mpsd.toml"
    config.write_text("[mpsd]\ndispatch = 'kernel'\npolicy = 'fair'\n[mpsd.device.0]\npolicy = 'priority'\n")
    with pytest.raises(ConfigError, match=r"\[mpsd.device.N\] sections set block-level policies"):
        load_config(["--pipe-dir", str(tmp_path), "--config", str(config)], environ={})


def test_disb_c_priority_by_kernel_keeps_the_critical_tenant_near_its_solo_latency():
    """DISB-C on the simulated H200 with the dispatcher in front of MPS's blocks: the critical tenant's p99
    under `priority` is within one best-effort block of its solo p99 and well under its p99 under `mps`,
    while the best-effort tenants keep their throughput (bench/fidelity has the same on the H200)."""
    workload = dataclasses.replace(load_workload(WORKLOADS / "disb_c.toml"), duration=0.5)
    solo = run_virtual(workload, "mps", {}, [t for t in workload.tenants if t.name == "critical"])
    mps = run_virtual(workload, "mps", {})
    priority = run_virtual(workload, "priority", {"dispatch": "kernel"})

    def p99(timeline, tenant: str = "critical") -> float:
        return latency_summary([r.latency for r in timeline.requests if r.tenant.startswith(tenant)])["p99"]

    def done(timeline) -> int:
        return sum(1 for r in timeline.requests if r.tenant.startswith("best_effort") and r.error is None)

    # One best-effort block as they run under sharing, two to an SM, sharing its issue rate: as long as a
    # best-effort request alone (two kernels of one wave, one block to an SM).
    be_alone = run_virtual(workload, "mps", {}, [t for t in workload.tenants if t.name == "best_effort"][:1])
    be_block = latency_summary([r.latency for r in be_alone.requests])["p50"]
    assert p99(priority) <= p99(solo) + be_block
    assert p99(priority) <= 0.7 * p99(mps)
    assert done(priority) >= 0.95 * done(mps)
