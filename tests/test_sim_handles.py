"""A kernel submitted by plain values (Simulator.launch) runs as the Kernel of those values would, to the bit, and
its record (mpsd._core.Handle) reads as that Kernel would; the daemon's backend uses it for its launches, and
Kernel objects where a trace or a policy written in Python needs them."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_scenarios import first_difference, play  # noqa: E402

from inproc import in_process_daemon  # noqa: E402
from mpsd import _core  # noqa: E402
from mpsd.backends.ops import Extent, Launch, Plan  # noqa: E402
from mpsd.backends.sim import SimBackend  # noqa: E402
from mpsd.sim import H200, Kernel, Policy, Simulator, kernel_cost  # noqa: E402

COMPILED = ["mps", "round-robin", "priority", "fair", "exclusive", "mig", "timeslice"]
SPIN = kernel_cost(H200, "spin", 1, 32, [round(1e-3 * H200.clock_hz)])  # 1 ms blocks


def _unrecorded(spec, policy, record, options):
    return Simulator(spec, policy, False, options)  # launch needs a run without a trace


def _launching():
    """A scenario's submit with its kernels launched: each Kernel's handle stands for it, in the record and in
    the `after` of the ops that name it."""
    handles: dict[int, object] = {}  # id of a Kernel (the scenario holds it) -> its handle

    def submit(sim, op):
        after = tuple(handles.get(id(dep), dep) for dep in op.after)
        if isinstance(op, Kernel):
            handle = handles[id(op)] = sim.launch(op.client, op.stream, after, op.blocks, op.threads, op.cost,
                                                  op.smem, op.priority, op.sm_cap, op.regs_per_thread)
            return handle
        op.after = after
        sim.submit(op)
        return op
    return submit


@pytest.mark.parametrize("policy", COMPILED)
def test_launched_kernels_run_as_submitted_kernels_to_the_bit(policy):
    """Every seeded scenario gives the same record whether its kernels are Kernels or launches: every op's
    times and flags (the handles' read as the Kernels'), every list returned, the counts and statistics."""
    for seed in range(300):
        kernels = play(_unrecorded, seed, policy)
        launched = play(_unrecorded, seed, policy, _launching())
        assert launched == kernels, f"seed {seed}: {first_difference(launched, kernels)}"


def test_a_handle_is_its_kernels_record_and_its_holder_writes_only_the_tag():
    sim = Simulator(H200)
    assert sim.handles
    first = sim.launch(1, (1, 0), (), 1, 32, SPIN)
    twin = sim.launch(1, (1, 0), (), 1, 32, SPIN)
    assert type(first) is _core.Handle and first is not twin and first != twin
    waiters = {first: "first", twin: "twin"}  # hashed by identity, as a Kernel is
    assert (first.client, first.seq, twin.seq, first.submitted) == (1, 0, 1, 0.0)
    assert not first.done and not first.cancelled and first.ended != first.ended  # NaN until it ends
    first.tag = "mine"
    with pytest.raises(AttributeError):
        first.done = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        first.ended = 0.0  # type: ignore[misc]
    done = sim.run()
    assert done == [first, twin] and [waiters[h] for h in done] == ["first", "twin"]
    assert first.done and first.tag == "mine"
    assert first.eligible == 0.0 and first.started == pytest.approx(H200.kernel_overhead)
    assert first.ended == pytest.approx(H200.kernel_overhead + 1e-3) and twin.eligible == first.ended
    assert twin.started == pytest.approx(first.ended + H200.kernel_overhead)
    assert "done" in repr(first)


def test_a_tag_that_refers_back_to_its_handle_is_collected():
    """The collector sees a handle's tag, as a Kernel's: a completion callback that holds its handle leaks
    nothing once both are dropped."""
    sim = Simulator(H200)

    class Callback:
        pass

    handle, callback = sim.launch(1, 0, (), 1, 32, SPIN), Callback()
    callback.handle, handle.tag = handle, callback
    gone = weakref.ref(callback)
    sim.run()  # the engine lets go of it
    del handle, callback
    gc.collect()
    assert gone() is None


def test_a_cancelled_launch_is_marked_so_and_releases_what_waits_on_it():
    sim = Simulator(H200)
    running = sim.launch(1, (1, 0), (), 1, 32, SPIN)
    queued = sim.launch(1, (1, 0), (), 1, 32, SPIN)
    other = Kernel(client=2, stream=(2, 0), after=(queued,), blocks=1, threads=32, cost=SPIN)
    sim.submit(other)
    sim.advance(5e-4)
    assert running.started == pytest.approx(H200.kernel_overhead) and not running.done
    assert sim.cancel(1) == [queued]  # the dropped ones, never started; the running one is evicted
    assert running.cancelled and queued.cancelled and not running.done and not queued.done
    assert sim.run() == [other] and other.started == pytest.approx(5e-4 + H200.kernel_overhead)


def test_launch_checks_what_submit_checks():
    sim = Simulator(H200)
    for blocks, threads, sm_cap, smem in [(0, 32, None, 0), (1, 32, 0, 0), (1, 2048, None, 0), (1, 32, None, 1 << 30)]:
        with pytest.raises(ValueError) as launched:
            sim.launch(1, 0, (), blocks, threads, SPIN, smem, 0, sm_cap)
        with pytest.raises(ValueError) as submitted:
            sim.submit(Kernel(client=1, stream=0, blocks=blocks, threads=threads, cost=SPIN, smem=smem, sm_cap=sm_cap))
        assert str(launched.value) == str(submitted.value)
    assert sim.statistics().kernels_completed == 0 and sim.next_time() is None


class _InTurn(Policy):
    def dispatch(self, ready):
        for run in ready:
            run.place()


@pytest.mark.parametrize("make", [lambda: Simulator(H200, record=True), lambda: Simulator(H200, _InTurn())],
                         ids=["recorded", "python-policy"])
def test_launch_is_refused_where_kernel_objects_are_needed(make):
    """A trace names the Kernels its block groups ran, and a policy written in Python is handed them."""
    sim = make()
    assert not sim.handles
    with pytest.raises(ValueError, match="need Kernel objects"):
        sim.launch(1, 0, (), 1, 32, SPIN)
    assert sim.next_time() is None


def _spin_launch(client: int = 1, after: tuple = (), extents: tuple = ()) -> Launch:
    work = Launch.of(client, (client, 0), 0, None,
                     Plan("spin", (1, 1, 1), (32, 1, 1), 0, (round(1e-3 * H200.clock_hz),)), extents)
    work.after = after
    return work


async def _settled(backend: SimBackend, works: list, autojump_clock) -> list[str]:
    """Run `backend`'s engine until every work of `works` has been told done; the order they were told in."""
    told: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.engine.run)
        for n, work in enumerate(works):
            backend.when_done([work], lambda n=n: told.append(str(n)))
        with trio.fail_after(10):
            while len(told) < len(works):
                await trio.sleep(1e-3)
        nursery.cancel_scope.cancel()
    return told


async def test_the_backend_gives_a_launch_a_handle_and_one_that_touches_memory_its_effect(autojump_clock):
    backend = SimBackend(H200)
    segment = backend.allocate(4096)
    plain, after = _spin_launch(), _spin_launch(2)
    after.after = (plain,)
    touching = Launch.of(1, (1, 1), 0, None, Plan("fill_f32", (1, 1, 1), (32, 1, 1), 0, (0, 2.0, 32), ((0, 128),)),
                         ((0, Extent(segment, 0, 128)),))
    for work in (plain, after, touching):
        backend.submit(work)
    assert {type(w.handle) for w in (plain, after, touching)} == {_core.Handle}
    assert plain.handle.tag is None and touching.handle.tag is not None  # the effect on the bytes, at completion
    assert backend.host_memory.pending > 0  # the bytes it touches are counted against host RAM until then
    assert await _settled(backend, [plain, after, touching], autojump_clock) == ["2", "0", "1"]
    assert plain.done and after.done and touching.done and not plain.cancelled
    assert after.handle.started >= plain.ended  # it waited for the one it named
    assert bytes(segment.map[:8]) == b"\x00\x00\x00@" * 2  # 2.0f, written by the reference kernel
    assert touching.handle.tag is None and backend.host_memory.pending == 0 and backend._reservations[1] == {}


async def test_a_cancelled_clients_launches_tell_their_waiters(autojump_clock):
    backend = SimBackend(H200)
    works = [_spin_launch() for _ in range(3)]
    for work in works:
        backend.submit(work)
    told: list[int] = []
    backend.when_done(works, lambda: told.append(1))
    backend.cancel(1)
    assert told == [1] and all(w.cancelled and not w.handle.done for w in works)
    assert backend.engine._waiters == {}


@pytest.mark.parametrize("options", [{"trace": "trace.json"}, {"policy": _InTurn()}], ids=["traced", "python-policy"])
async def test_a_traced_backend_and_a_python_policy_get_kernel_objects(options, tmp_path, autojump_clock):
    if "trace" in options:
        options = {"trace": tmp_path / options["trace"]}
    backend = SimBackend(H200, **options)
    work = _spin_launch()
    backend.submit(work)
    assert type(work.handle) is Kernel
    assert await _settled(backend, [work], autojump_clock) == ["0"] and work.done
    if "trace" in options:
        (kernel, name), = backend.recorder.kernels
        assert kernel is work.handle and name == "spin"


async def test_a_daemon_client_that_leaves_with_launches_queued_holds_nobody_up(autojump_clock):
    """Through the daemon: the launches of a client that goes away are handles, cancelled with it, and another
    client's launch runs at once rather than after them."""
    async with in_process_daemon("--time-scale", "100") as served:
        backend = served.daemon.devices[0].backend
        async with served.connect() as gone:
            for _ in range(5):
                await gone.launch("spin", 264, 1024, [round(1e-2 * H200.clock_hz)])  # the whole device, 10 ms
            await trio.sleep(1e-5)  # the first is running
            assert backend._plain and backend.sim.busy_sms() == H200.sm_count
        async with served.connect() as other:
            await other.launch("spin", 1, 32, [1980])
            await other.synchronize()
            stats = await other.statistics()
        assert stats["kernels_completed"] == 1 and backend.sim.now < 1e-2
        assert backend.engine._waiters == {}
