# A departed client's teardown goes in pieces (mpsd.runtime.teardown, Daemon.detach): other clients are served
# between them and see its memory come back a piece at a time, never more of it than has been freed. The
# teardowns here are of a few thousand objects, some tens of milliseconds in pieces of a millisecond: what is
# checked is the order of things (another client answered while the memory is part way back), never a time.
from __future__ import annotations

import shutil

import trio

import mpsd_client
from daemons import short_tempdir
from inproc import in_process_daemon
from mpsd.daemon.config import load_config
from mpsd.daemon.inprocess import open_daemon
from mpsd_client import InvalidResourceHandleError, OutOfMemoryError

MiB = 1 << 20
SMALL = 6000  # 1 MiB allocations, two to a 2 MiB chunk: the free memory rises with every second one freed


async def _free(ctx) -> int:
    return (await ctx.mem_get_info())[0]


async def test_a_bystander_is_answered_while_a_large_client_is_torn_down(served):
    """Another client's calls are answered part way through a large client's teardown, which gives its memory
    back as it goes (on the old code the teardown was one step: the memory came back all at once)."""
    async with served.connect() as bystander:
        base = await _free(bystander)
        seen: list[int] = []

        async def watch() -> None:
            with trio.fail_after(60):
                while not seen or seen[-1] != base:
                    seen.append(await _free(bystander))

        async with trio.open_nursery() as nursery:
            async with served.connect() as big:
                for _ in range(SMALL):
                    await big.malloc(MiB)
                full = await _free(bystander)
                nursery.start_soon(watch)
        assert full < base
        between = sorted({free for free in seen if full < free < base})
        assert len(between) > 1, f"the teardown went in one step: the bystander saw only {sorted(set(seen))}"
        assert seen == sorted(seen) and full <= seen[0]  # memory only comes back
    assert f"disconnected; reclaimed {SMALL} allocations" in served.server_log()


async def test_memory_being_torn_down_is_given_out_only_once_freed(served):
    """While a client holding the whole device is torn down, another's allocations succeed as its memory comes
    back, and only as far as it has: the device's ledger never holds more than the device."""
    device = served.daemon.devices[0]
    ledger = device.ledger.device
    piece = 64 * MiB  # about 2,200 of them fill the device
    async with served.connect() as other:
        got, during = 0, 0

        async def take(count: int, dying) -> None:
            nonlocal got, during
            with trio.fail_after(60):
                while got < count:
                    try:
                        await other.malloc(piece)
                    except OutOfMemoryError:
                        continue
                    got += 1
                    during += dying.account.reserved > 0  # the dying client still held some of its memory
                    assert ledger.reserved <= ledger.total

        async with trio.open_nursery() as nursery:
            async with served.connect() as big:
                count = 0
                while True:
                    try:
                        await big.malloc(piece)
                    except OutOfMemoryError:
                        break
                    count += 1
                dying = max(device.contexts.values(), key=lambda context: context.id)
                nursery.start_soon(take, count, dying)
        assert got == count and during


async def test_an_export_of_a_client_being_torn_down_opens_no_more():
    """From the start of an exporter's teardown its IPC handles are refused, though its memory goes in pieces
    (the exported allocation, made last, is freed last): as when it all went at once."""
    async with in_process_daemon("--time-scale", "100", shared_process=True) as served:
        async with served.connect() as importer:
            base = await _free(importer)
            refused = 0

            async def open_during_teardown(handle: bytes, full: int) -> None:
                nonlocal refused
                with trio.fail_after(60):
                    while (free := await _free(importer)) != base:
                        if free > full:  # part of its memory is back: the teardown has begun
                            try:
                                await importer.ipc_open_mem_handle(handle)
                            except InvalidResourceHandleError:
                                refused += 1
                            else:
                                raise AssertionError("an export of a client being torn down was opened")

            async with trio.open_nursery() as nursery:
                async with served.connect() as exporter:
                    for _ in range(SMALL):
                        await exporter.malloc(MiB)
                    handle = await exporter.ipc_get_mem_handle(await exporter.malloc(MiB))
                    nursery.start_soon(open_during_teardown, handle, await _free(importer))
            assert refused


async def test_a_shutdown_waits_for_a_teardown_under_way():
    """A daemon stopped part way through a large client's teardown finishes it before it exits."""
    pipe_dir = short_tempdir() / "pipe"
    log_dir = pipe_dir.parent / "log"
    try:
        async with open_daemon(load_config(["--pipe-dir", str(pipe_dir), "--log-dir", str(log_dir),
                                            "--time-scale", "100"], environ={})) as daemon:
            device = daemon.devices[0]
            async with mpsd_client.open_context(pipe_dir, environ={}) as watcher:
                base = await _free(watcher)
                async with mpsd_client.open_context(pipe_dir, environ={}) as big:
                    for _ in range(SMALL):
                        await big.malloc(MiB)
                    full = await _free(watcher)
                with trio.fail_after(60):
                    while (free := await _free(watcher)) == full:
                        pass
                assert free < base, "the teardown went in one step"
                held = device.ledger.device.reserved  # as it is stopped (nothing else runs in between)
                daemon.stop(grace=0)
        # The block's end has waited for the daemon to exit.
        log = (log_dir / "server.log").read_text()
    finally:
        shutil.rmtree(pipe_dir.parent, ignore_errors=True)
    assert held > device.backend.server_memory + 2 * device.backend.context_memory  # part of it was still held
    assert log.index(f"disconnected; reclaimed {SMALL} allocations") < log.index("Server exited")
    assert device.ledger.device.reserved == device.backend.server_memory


async def test_under_the_virtual_clock_a_teardown_is_one_instant():
    """Under the virtual clock, a client torn down in pieces holds the clock till the end, even one that had
    stopped holding it (idle): another client's calls see all of its memory or none of it back, never part, so
    that simulated results do not depend on where the wall time falls between the pieces."""
    async with in_process_daemon("--clock", "virtual", "--idle-grace", "60") as served:
        async with served.connect() as bystander:
            base = await _free(bystander)
            go = trio.Event()

            async def big_life(task_status: trio.TaskStatus[None]) -> None:
                async with served.connect() as big:
                    for _ in range(SMALL):
                        await big.malloc(MiB)
                    async with big.idle():  # it holds the clock no longer, and goes away so
                        task_status.started()
                        await go.wait()

            async with trio.open_nursery() as nursery:
                async with bystander.idle():  # (so that the big client's calls need not wait for its next)
                    await nursery.start(big_life)
                seen = [await _free(bystander)]
                go.set()
                with trio.fail_after(60):
                    while seen[-1] != base:
                        seen.append(await _free(bystander))
            assert len(set(seen)) == 2, f"part of the memory was seen back: {sorted(set(seen))}"


async def test_a_large_touched_allocation_is_given_back_in_pieces(served):
    """The pages of a large allocation the client wrote go back to the host a few MiB a step (the kernel frees
    them at about 80 ms a GiB): another client is answered while they go, before the allocation's memory is
    uncharged (on the old code it was all one step)."""
    device = served.daemon.devices[0]
    async with served.connect() as bystander:
        answered = 0

        async def watch(dying) -> None:
            nonlocal answered
            with trio.fail_after(60):
                while dying.id in device.contexts:
                    await _free(bystander)
                    answered += dying.closed and dying.account.reserved > 0

        async with trio.open_nursery() as nursery:
            async with served.connect() as big:
                p = await big.malloc(512 * MiB)
                await big.memset(p, 7, 512 * MiB)  # every page written: the host holds them all
                await big.synchronize()
                nursery.start_soon(watch, max(device.contexts.values(), key=lambda context: context.id))
        assert answered
