# cudaIpcCloseMemHandle as a notification, and the one close that stays a request: the last close of memory
# whose exporter has freed it already, which gives back what other processes see. The daemon tells each importer
# when an exporter lets go (IPC_FREED) before it answers the exporter; the client takes in what has come before
# it chooses (TAKE_NOTICES).
from __future__ import annotations

import os
import select
import signal
import socket

import pytest
import trio

import mpsd_client
from daemons import spawn_worker
from inproc import in_process_daemon
from mpsd_client._async import AsyncContext
from mpsd_client._core import TAKE_NOTICES, Core
from mpsd_client._sync import Context
from mpsd_protocol import IPC_FREED, Connection, Notification, Reply, Request, Role

MiB = 1 << 20
BASE = 0x7F40_0000_0000


def _open(core: Core, ptr: int = BASE) -> int:
    """Drive the core's ipc_open_mem_handle as a shell would, the daemon's reply made here (a real memfd)."""
    op = core.ipc_open_mem_handle(None, bytes(64), 1)
    request = next(op)
    assert isinstance(request, Request) and request.op == "ipc_open_mem_handle"
    fd = os.memfd_create("mapping")
    os.ftruncate(fd, 2 * MiB)
    with pytest.raises(StopIteration) as done:
        op.send(Reply(request.id, None, {"ptr": ptr, "size": MiB, "offset": 0, "mappable": True}, (fd,)))
    return int(done.value.value)


def _close(core: Core, ptr: int) -> list[str]:
    """Drive the core's ipc_close_mem_handle; what it yielded, by kind."""
    op = core.ipc_close_mem_handle(ptr)
    kinds = []
    answer = None
    try:
        while True:
            item = op.send(answer)
            answer = None
            if item is TAKE_NOTICES:
                kinds.append("take notices")
            elif isinstance(item, Request):
                kinds.append("request")
                answer = Reply(item.id, None, None)
            else:
                assert isinstance(item, Notification)
                kinds.append("notification")
    except StopIteration:
        return kinds


@pytest.fixture
def core():
    return Core(0, None, {})


def test_a_close_is_a_notification_while_the_exporter_holds_its_memory(core):
    ptr = _open(core)
    assert _open(core) == ptr  # opened twice: the same mapping, two references
    assert _close(core, ptr) == ["notification"]
    assert _close(core, ptr) == ["take notices", "notification"]


def test_the_last_close_after_the_exporter_let_go_is_a_request(core):
    ptr = _open(core)
    _open(core)
    other = _open(core, BASE + 64 * MiB)
    core.notification_received(Notification(IPC_FREED, {"ptr": ptr}))
    core.notification_received(Notification(IPC_FREED, {"ptr": BASE + 128 * MiB}))  # not ours: nothing
    for garbage in ({"ptr": [BASE]}, {"ptr": None}, {"ptr": float(BASE)}, {}):  # unreadable: nothing changes
        core.notification_received(Notification(IPC_FREED, garbage))
    assert _close(core, ptr) == ["notification"]  # a reference is left: nothing is given back yet
    assert _close(core, ptr) == ["take notices", "request"]
    assert _close(core, other) == ["take notices", "notification"]
    # The same address mapped again later is another mapping: the old notice is forgotten.
    assert _open(core) == ptr
    assert _close(core, ptr) == ["take notices", "notification"]


@pytest.mark.parametrize("importers", [1, 2])
async def test_an_importers_close_after_the_exporters_free_has_given_the_memory_back_when_it_returns(
        autojump_clock, importers):
    """In one trio loop nothing the daemon is sent is served before the sender waits, so a close that were
    a notification would return with the memory still charged."""
    async with in_process_daemon("--time-scale", "100", shared_process=True) as served:
        device = served.daemon.devices[0]
        async with served.connect() as exporter, served.connect() as first, served.connect() as second:
            free_before = device.memory_free(None)
            p = await exporter.malloc(64 * MiB)
            handle = await exporter.ipc_get_mem_handle(p)
            mapped = [(c, await c.ipc_open_mem_handle(handle)) for c in (first, second)[:importers]]
            for ctx, q in mapped[1:]:  # another importer lets go before the exporter does: nothing given back
                await ctx.ipc_close_mem_handle(q)
            await exporter.free(p)
            assert device.memory_free(None) == free_before - 64 * MiB  # still mapped by the last importer
            ctx, q = mapped[0]
            await ctx.ipc_close_mem_handle(q)
            assert device.memory_free(None) == free_before


IMPORTER = """
import sys, mpsd_client
with mpsd_client.connect() as ctx:
    q = ctx.ipc_open_mem_handle(bytes.fromhex(sys.argv[1]))
    print("open", flush=True)
    sys.stdin.readline()
    ctx.ipc_close_mem_handle(q)
    print("closed", flush=True)
    sys.stdin.readline()
"""


def _line_within(proc, seconds: float) -> str | None:
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    return proc.stdout.readline().strip() if ready else None


@pytest.mark.parametrize("exporter_frees", [False, True])
def test_a_real_importers_close_waits_for_the_daemon_only_when_it_gives_memory_back(daemon, exporter_frees):
    """With the daemon stopped (SIGSTOP) a notification can be sent and a request cannot be answered: an
    importer's close returns at once while the exporter holds the memory, and only once the daemon runs again
    after the exporter freed it, when the memory is back as the call returns."""
    with mpsd_client.connect(daemon.pipe_dir) as exporter:
        p = exporter.malloc(64 * MiB)
        proc = spawn_worker(IMPORTER, daemon.pipe_dir, exporter.ipc_get_mem_handle(p).hex())
        try:
            assert _line_within(proc, 60) == "open", proc.stderr.read()
            held = exporter.mem_get_info()[0]  # with the importer's context, and the 64 MiB
            if exporter_frees:
                exporter.free(p)
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                proc.stdin.write("\n")
                proc.stdin.flush()
                if exporter_frees:
                    assert _line_within(proc, 1.0) is None  # it waits for the daemon's answer
                else:
                    assert _line_within(proc, 60) == "closed"
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            if exporter_frees:
                assert _line_within(proc, 60) == "closed"
                assert exporter.mem_get_info()[0] == held + 64 * MiB
            else:
                assert exporter.mem_get_info()[0] == held
                exporter.free(p)
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.wait(timeout=60) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.mark.parametrize("shell", ["blocking", "trio"])
def test_each_shell_takes_in_what_has_come_without_waiting(shell):
    """TAKE_NOTICES: what the daemon has sent is read and acted on, and nothing waits when nothing has come.
    The daemon's end is a socketpair and a server Connection, past the handshake."""
    ours, theirs = socket.socketpair()
    server = Connection(Role.SERVER)
    core = Core(0, None, {})
    core._imports.opens[BASE] = 1
    try:
        if shell == "blocking":
            shell_ctx = Context(ours, core)
            take = lambda: shell_ctx._take(None)  # noqa: E731
        else:
            ours.setblocking(False)
            shell_ctx = AsyncContext(trio.socket.from_stdlib_socket(ours), ours, core)
            take = shell_ctx._take_now
        shell_ctx._conn.receive_data(server.send(Reply(1, None, {})), [])  # the hello's reply
        assert shell_ctx._conn.next_event().id == 1
        take()  # nothing has come: it returns at once
        assert not core._imports.freed
        theirs.sendall(server.send(Notification(IPC_FREED, {"ptr": BASE})))
        take()
        assert core._imports.freed == {BASE}
    finally:
        ours.close()
        theirs.close()
