# The table of calls (mpsd_protocol.CALLS) is the one place a call is declared: both halves read it, so a row
# the daemon cannot serve or the client cannot reach, a call the client makes without a row, or a handler whose
# parameters are not the row's arguments is a failure here. And every argument of every row is checked the
# same way: a value of the wrong kind, or none, is cudaErrorInvalidValue naming it.
from __future__ import annotations

import inspect
import time

import pytest

import mpsd_client
import mpsd_protocol._calls as kinds
from daemons import run_worker, start_daemon
from mpsd import clock
from mpsd.daemon.session import HANDLERS
from mpsd_protocol import CALLS, CLOCK, LAUNCH

SAMPLE = {kinds.INT: 0, kinds.COUNT: 0, kinds.PTR: 0, kinds.EVENT_HANDLE: 0, kinds.STREAM_HANDLE: None,
          kinds.BOOL: False, kinds.SECONDS: 0.0, kinds.STR: "x", kinds.BYTES: b"", kinds.LIST: [], kinds.DIMS: 1,
          kinds.MAP: {}}
WRONG = {kinds.STR: 7, kinds.BOOL: 1, kinds.SECONDS: -1.0}  # anything else: a string
ARGUMENTS = [(call.name, arg.name) for call in CALLS.values() for arg in call.args]


@pytest.fixture(scope="module")
def virtual():
    """A daemon on the virtual clock (where clock, sleep and idle are served), and a context of it."""
    daemon = start_daemon("--clock", "virtual", "--idle-grace", "60")
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        yield daemon, ctx
    assert daemon.stop() == 0
    assert not [line for line in daemon.stderr_lines if "Traceback" in line], daemon.stderr_lines


def _sample(call) -> dict:
    return {arg.name: SAMPLE[arg.kind] for arg in call.args}


def test_rows_are_consistent():
    """Defaults are of their kinds, cost kinds are the virtual clock's, and only calls that merely queue work
    may come as notifications."""
    for call in CALLS.values():
        assert all(arg.default is kinds.REQUIRED or arg.kind.accepts(arg.default) for arg in call.args), call.name
        assert all(arg.kind in SAMPLE for arg in call.args), call.name
        assert call.cost[0] in (clock.LAUNCH, clock.SYNC, clock.CALL, CLOCK), call.name
        assert not call.notify or (call.cost[0] == LAUNCH and not call.fds and not call.reply_fds), call.name
        assert not call.reply_fds or call.reply is kinds.MAP, call.name


def test_every_row_has_a_handler_taking_its_arguments():
    """Each row is served by ``Session.on_<name>`` or the context method of its name, whose parameters are the
    row's arguments in its order (positional dispatch depends on it), then the fds where the call takes some;
    it may defer its reply exactly when the row says the call waits."""
    assert set(HANDLERS) == set(CALLS)
    for name, (handler, _) in HANDLERS.items():
        call = CALLS[name]
        params = list(inspect.signature(handler).parameters)[1:]
        expected = [arg.name for arg in call.args] + (["fds"] if call.fds else [])
        # A context method may spell an argument more fully ("buffer_id" for the wire's "id").
        assert len(params) == len(expected) and all(p.endswith(a) for p, a in zip(params, expected)), (name, params)
        # Only the calls whose row says they wait may answer later (a Deferred reply); context methods never do.
        assert ("Deferred" in str(inspect.signature(handler).return_annotation)) == call.waits, name


# A worker process notes the ops its context sends, as `_tap` does (IPC memory opens only in another process).
IPC_WORKER = """
import sys, mpsd_client
sent = set()
with mpsd_client.connect() as ctx:
    send = ctx._send  # every message the shell sends, requests and notifications alike
    ctx._send = lambda message: (sent.add(message.op), send(message))[1]
    ctx.ipc_close_mem_handle(ctx.ipc_open_mem_handle(bytes.fromhex(sys.argv[1])))
print(" ".join(sorted(sent)))
"""


def _tap(ctx, sent: set[str]) -> None:
    """Note the op of every message `ctx` sends (its shell's drive and post, wrapped, and the notifications
    that wait in the core for the next message)."""
    drive, post, take = ctx._drive, ctx._post, ctx._core.take_notes

    def taken():
        notes = take()
        sent.update(note.op for note in notes)
        return notes

    def tapped(op):
        reply = None
        while True:
            try:
                item = op.send(reply)
            except StopIteration as stop:
                return stop.value
            sent.add(item.op)
            reply = yield item

    ctx._drive = lambda op: drive(tapped(op))
    ctx._post = lambda note: (sent.add(note.op), post(note))[1]
    ctx._core.take_notes = taken


def test_every_row_is_reachable_from_the_client_and_nothing_else_is(daemon, virtual):
    """The public API, used once over, sends every call of the table and no op outside it (the clock's calls
    on the virtual clock, where the client does not keep its own time)."""
    sent: set[str] = set()
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        _tap(ctx, sent)
        ctx.device_properties()
        ctx.mem_get_info()
        p = ctx.malloc(1 << 20)
        q = ctx.malloc(1 << 20)
        host = ctx.host_alloc(4096)
        stream = ctx.create_stream()
        start, end = ctx.create_event(), ctx.create_event()
        start.record(stream)
        ctx.memset(p, 1, 4096, stream)
        ctx.memcpy_dtod(q, p, 4096, stream)
        ctx.memcpy_peer(q, ctx, p, 4096, stream)  # one device: a device copy
        ctx.launch("fill_f32", 1, 256, [p, 2.0, 256], stream=stream)
        ctx.memcpy_htod(p, host, stream)
        ctx.memcpy_dtoh(host, q, stream)
        ctx.free_async(ctx.malloc_async(1 << 20, stream), stream)
        end.record(stream)
        stream.wait_event(end)
        stream.query()
        stream.synchronize()
        end.synchronize()
        end.query()
        start.elapsed_ms(end)
        stream.begin_capture()
        assert stream.is_capturing() and stream.capture_info().status == "active"
        ctx.launch("fill_f32", 1, 256, [p, 2.0, 256], stream=stream)
        graph = stream.end_capture()
        graph.add_empty_node(deps=graph.nodes())
        clone = graph.clone()
        executable = clone.instantiate()
        executable.update(graph)
        executable.set_kernel_params(clone.nodes()[0], "fill_f32", 1, 256, [p, 3.0, 256])
        executable.launch(stream)
        executable.destroy()
        clone.destroy()
        stream.begin_capture()
        ctx.free_async(ctx.malloc_async(4096, stream), stream)  # memory nodes (graph_mem_alloc)
        stream.end_capture().destroy()
        ctx.graph_create().destroy()
        page = ctx.mem_get_allocation_granularity()
        va, handle = ctx.mem_address_reserve(2 * page), ctx.mem_create(page)
        ctx.mem_map(va, page, 0, handle)
        ctx.mem_unmap(va, page)
        ctx.mem_release(handle)
        ctx.mem_address_free(va, 2 * page)
        assert len(ctx.host_view(p)) == 1 << 20
        shared = ctx.create_event(disable_timing=True, interprocess=True)
        ctx.ipc_open_event_handle(ctx.ipc_get_event_handle(shared))
        worker = run_worker(IPC_WORKER, daemon.pipe_dir, ctx.ipc_get_mem_handle(p).hex())
        assert worker.returncode == 0, worker.stderr
        sent |= set(worker.stdout.split())
        assert ctx.func_get_attributes("fill_f32")["num_regs"] == 32
        assert ctx.occupancy_max_active_blocks("fill_f32", 256) == 8
        with pytest.raises(mpsd_client.InvalidValueError):  # this daemon has no --module-path
            ctx.module_load("matmul")
        with pytest.raises(mpsd_client.InvalidResourceHandleError):  # a handle the daemon never gave
            ctx.module_unload(mpsd_client.Module(ctx, 1 << 40, "matmul", {}))
        ctx.synchronize()
        ctx.get_last_error()
        ctx.statistics()
        stream.destroy()
        start.destroy()
        ctx.free_host(host)
        ctx.free(q)
    _, on_virtual = virtual
    _tap(on_virtual, sent)
    on_virtual.clock()
    on_virtual.sleep(0.001)
    with on_virtual.idle():
        pass
    sent.discard("hello")
    assert sent == set(CALLS)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_row_is_served(virtual, name):
    """A request of each row, its arguments of the right kinds, reaches a handler: whatever it answers, it is
    never "unknown request"."""
    _, ctx = virtual
    try:
        ctx._drive(ctx._core.call(name, _sample(CALLS[name])))
    except mpsd_client.CudaError as exc:
        assert "unknown" not in str(exc)


@pytest.mark.parametrize("name,arg", ARGUMENTS, ids=[f"{c}.{a}" for c, a in ARGUMENTS])
def test_an_argument_of_the_wrong_kind_is_invalid_value_naming_it(virtual, name, arg):
    """For every argument of every row, a value of another kind, or none where it has no default, gets
    cudaErrorInvalidValue from the daemon naming the argument; the client's own check says the same."""
    _, ctx = virtual
    call = CALLS[name]
    kind = next(a.kind for a in call.args if a.name == arg)
    args = {**_sample(call), arg: WRONG.get(kind, "wrong")}
    with pytest.raises(mpsd_client.InvalidValueError, match=f"{name}: {arg} "):
        ctx._drive(ctx._core.call(name, args))
    with pytest.raises(mpsd_client.InvalidValueError, match=f"{name}: {arg} "):
        call.encode([args[a.name] for a in call.args])
    if next(a.default for a in call.args if a.name == arg) is kinds.REQUIRED:
        del args[arg]
        with pytest.raises(mpsd_client.InvalidValueError, match=f"{name} needs {arg} "):
            ctx._drive(ctx._core.call(name, args))


def test_wall_clock_daemons_refuse_what_only_the_virtual_clock_does(daemon):
    """Under the wall clock the client keeps its own time: sleep and idle are cudaErrorNotSupported there."""
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        for name in ("sleep", "idle"):
            with pytest.raises(mpsd_client.NotSupportedError, match="virtual clock"):
                ctx._drive(ctx._core.call(name, _sample(CALLS[name])))
        # its own clock is the device's, which moves with the wall clock (times --time-scale): two readings
        # 50 ms apart differ by at least that
        before = ctx._drive(ctx._core.call("clock", {}))["now"]
        time.sleep(0.05)
        after = ctx._drive(ctx._core.call("clock", {}))["now"]
        assert 0 <= before and after - before >= 0.05
