# CUDA IPC across real processes: memory handles (the memfd really passed over SCM_RIGHTS and mapped), event
# handles ordering work across processes, lifetimes past the exporter, CUDA's error cases, the access policy
# with a real second user, and no file descriptor leaks in either process.
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mpsd_client
from daemons import as_user as _as_user, second_user as _second_user, spawn_worker, start_daemon
from mpsd.sim import H200
from mpsd_client import (
    DeviceUninitializedError,
    InvalidResourceHandleError,
    InvalidValueError,
    PeerAccessUnsupportedError,
)

MiB = 1 << 20


def export_from_worker(daemon, code: str) -> tuple[subprocess.Popen[str], list[str]]:
    """Start an exporting worker; it prints lines (handles as hex) and then waits for a line on stdin."""
    worker = spawn_worker(code, daemon.pipe_dir)
    lines = []
    while (line := worker.stdout.readline().strip()) != "ready":
        assert line, worker.stderr.read()
        lines.append(line)
    return worker, lines


def finish(worker: subprocess.Popen[str]) -> str:
    out, err = worker.communicate("go\n", timeout=60)
    assert worker.returncode == 0, err
    return out


EXPORTER = """
    import mpsd_client
    ctx = mpsd_client.connect()
    p = ctx.malloc(4 * MiB)
    ctx.launch("fill_f32", 1024, 1024, [p, 2.5, MiB])
    ctx.synchronize()
    print(ctx.ipc_get_mem_handle(p).hex())
    print("ready", flush=True)
    input()
""".replace("MiB", str(MiB))


def test_imported_memory_is_the_same_bytes(daemon):
    """An importer sees the exporter's bytes, through kernels, copies and a zero-copy host_view, and its
    writes are seen by the exporter."""
    worker, (handle,) = export_from_worker(daemon, EXPORTER + """
    print(float(__import__("numpy").frombuffer(p.host_view(), "float32")[:4].sum()))
    """)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        q = ctx.ipc_open_mem_handle(bytes.fromhex(handle))
        assert q.size == 4 * MiB
        view = np.frombuffer(q.host_view(), np.float32)
        assert view.shape == (MiB,) and (view == 2.5).all()
        out = ctx.malloc(4)
        ctx.launch("reduce_sum_f32", 256, 256, [q, out, MiB])
        total = np.empty(1, np.float32)
        ctx.memcpy_dtoh(total, out)
        assert total[0] == 2.5 * MiB
        ctx.launch("fill_f32", 1, 4, [q, 1.0, 4])  # write through the import
        ctx.synchronize()
        assert view[:5].tolist() == [1.0, 1.0, 1.0, 1.0, 2.5]
        del view
        ctx.ipc_close_mem_handle(q)
    assert finish(worker).strip() == "4.0"


def test_opening_twice_gives_the_same_pointer_and_counts(daemon):
    """Opening a handle again in one context returns the same pointer; it stays mapped until closed as often."""
    worker, (handle,) = export_from_worker(daemon, EXPORTER)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        q1 = ctx.ipc_open_mem_handle(bytes.fromhex(handle))
        q2 = ctx.ipc_open_mem_handle(bytes.fromhex(handle))
        assert q1 == q2
        ctx.ipc_close_mem_handle(q1)
        ctx.memset(q2, 0, 16)  # still mapped
        ctx.ipc_close_mem_handle(q2)
        with pytest.raises(InvalidValueError):
            ctx.memset(q2, 0, 16)  # gone now
        with pytest.raises(InvalidValueError):
            ctx.ipc_close_mem_handle(q2)
    finish(worker)


def test_close_does_not_wait_and_work_queued_before_it_still_lands(daemon):
    """ipc_close_mem_handle returns without waiting for the work queued before it: the pointer is invalid for
    the very next call, while a kernel queued before the close, still waiting behind a long one, writes the
    exporter's bytes when it runs."""
    worker, (handle,) = export_from_worker(daemon, EXPORTER + """
    print(float(__import__("numpy").frombuffer(p.host_view(), "float32")[:4].sum()))
    """)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        q = ctx.ipc_open_mem_handle(bytes.fromhex(handle))
        s = ctx.create_stream()
        ctx.launch("spin", 1, 32, [int(50 * 1.98e9)], stream=s)  # 50 s simulated: 0.5 s at --time-scale 100
        ctx.launch("fill_f32", 1, 4, [q, 7.0, 4], stream=s)
        ctx.ipc_close_mem_handle(q)
        assert not s.query()  # the close did not wait for the work before it
        with pytest.raises(InvalidValueError):
            ctx.memset(q, 0, 16)
        ctx.synchronize()  # raises if the fill found its bytes gone (an illegal address)
    assert finish(worker).strip() == "28.0"


def test_handles_follow_cuda_rules_in_the_exporter(ctx):
    """Handles only for allocation bases; the same handle each time; a new one for a new allocation at a
    reused address; no opening in the exporting process."""
    p = ctx.malloc(MiB)
    with pytest.raises(InvalidValueError):
        ctx.ipc_get_mem_handle(p + 512)
    handle = ctx.ipc_get_mem_handle(p)
    assert len(handle) == 64 and ctx.ipc_get_mem_handle(p) == handle
    with pytest.raises(DeviceUninitializedError):
        ctx.ipc_open_mem_handle(handle)
    ctx.free(p)
    p2 = ctx.malloc(MiB)
    assert p2 == p and ctx.ipc_get_mem_handle(p2) != handle


def test_bad_handles_are_errors_not_crashes(daemon_factory):
    """Forged, stale, malformed and foreign-device handles (where the devices are no peers) and bad flags get
    CUDA's errors."""
    d = start_daemon("--time-scale", "100", "--devices", "h200:2", "--peer-access", "none")
    daemon_factory.append(d)
    worker, (handle_hex, stale_hex) = export_from_worker(d, """
        import mpsd_client
        ctx = mpsd_client.connect()
        p, gone = ctx.malloc(4096), ctx.malloc(4096)
        print(ctx.ipc_get_mem_handle(p).hex())
        print(ctx.ipc_get_mem_handle(gone).hex())
        ctx.free(gone)
        print("ready", flush=True)
        input()
    """)
    handle, stale = bytes.fromhex(handle_hex), bytes.fromhex(stale_hex)
    forged = handle[:16] + bytes(16) + handle[32:]
    with mpsd_client.connect(d.pipe_dir) as ctx, mpsd_client.connect(d.pipe_dir, device=1) as other_device:
        for bad, error in ((forged, InvalidResourceHandleError), (stale, InvalidResourceHandleError),
                           (b"\x00" * 64, InvalidValueError), (handle[:63], InvalidValueError),
                           (b"x" * 64, InvalidValueError)):
            with pytest.raises(error):
                ctx.ipc_open_mem_handle(bad)
        with pytest.raises(InvalidValueError):
            ctx.ipc_open_mem_handle(handle, flags=0)
        with pytest.raises(PeerAccessUnsupportedError):
            other_device.ipc_open_mem_handle(handle)
        q = ctx.ipc_open_mem_handle(handle)
        with pytest.raises(InvalidValueError):
            ctx.free(q)  # an import is closed, not freed
        e = ctx.create_event()
        with pytest.raises(InvalidResourceHandleError):
            ctx.ipc_get_event_handle(e)  # not interprocess
        with pytest.raises(InvalidValueError):
            ctx.ipc_open_event_handle(handle)  # a memory handle is not an event handle
        ctx.ipc_close_mem_handle(q)
    finish(worker)


def test_a_handle_opens_on_a_peer_device(daemon_factory):
    """A buffer exported on device 0 opens on device 1 (cudaIpcMemLazyEnablePeerAccess: simulated devices are
    NVLink peers): the same bytes, which device 1's kernels read and write; the importer's statistics say the
    memory is another device's, mapped over peer access."""
    d = start_daemon("--time-scale", "100", "--devices", "h200:2")
    daemon_factory.append(d)
    worker, (handle_hex,) = export_from_worker(d, EXPORTER)
    with mpsd_client.connect(d.pipe_dir, device=1) as ctx:
        q = ctx.ipc_open_mem_handle(bytes.fromhex(handle_hex))
        total = ctx.malloc(4)
        ctx.memset(total, 0, 4)
        ctx.launch("saxpy_f32", 1024, 1024, [1.0, q, q, MiB])  # on device 1, in device 0's memory: q += q
        ctx.launch("reduce_sum_f32", 1, 1024, [q, total, MiB])
        out = np.empty(1, np.float32)
        ctx.memcpy_dtoh(out, total)
        assert out[0] == 5.0 * MiB
        stats = ctx.statistics()
        assert stats["memory_imported"] == stats["memory_imported_peer"] == 4 * MiB
        ctx.ipc_close_mem_handle(q)
    finish(worker)


def test_importer_keeps_the_bytes_after_the_exporter_dies(daemon):
    """SIGKILL the exporter while an importer holds the memory: the importer reads on, and the memory is
    counted once until the importer closes it."""
    worker, (handle,) = export_from_worker(daemon, EXPORTER)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        free_with_exporter = ctx.mem_get_info()[0]
        q = ctx.ipc_open_mem_handle(bytes.fromhex(handle))
        assert ctx.mem_get_info()[0] == free_with_exporter  # importing costs nothing more
        worker.kill()
        worker.communicate()
        from test_daemon import wait_for_log

        wait_for_log(daemon, f"Client {worker.pid} disconnected")
        # the exporter's context is gone, its 4 MiB are not: still counted until we close
        assert ctx.mem_get_info()[0] == free_with_exporter + 538_339_472
        out = np.empty(MiB, np.float32)
        ctx.memcpy_dtoh(out, q)
        assert (out == 2.5).all()
        ctx.ipc_close_mem_handle(q)
        assert ctx.mem_get_info()[0] == free_with_exporter + 538_339_472 + 4 * MiB
        with pytest.raises(InvalidResourceHandleError):
            ctx.ipc_open_mem_handle(bytes.fromhex(handle))  # nothing left to open


EVENT_EXPORTER = """
    import mpsd_client
    ctx = mpsd_client.connect()
    e = ctx.create_event(disable_timing=True, interprocess=True)
    e.record()
    print(ctx.ipc_get_event_handle(e).hex())
    print("ready", flush=True)
    input()
"""


def test_an_event_handle_opens_only_while_its_exporter_lives(daemon):
    """An IPC event opened before its exporter is SIGKILLed goes on working in the importer; once the exporter
    is gone, its handle opens no more, as its memory's handle does not."""
    worker, (handle,) = export_from_worker(daemon, EVENT_EXPORTER)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        opened = ctx.ipc_open_event_handle(bytes.fromhex(handle))
        worker.kill()
        worker.communicate()
        from test_daemon import wait_for_log

        wait_for_log(daemon, f"Client {worker.pid} disconnected")
        with pytest.raises(InvalidResourceHandleError):
            ctx.ipc_open_event_handle(bytes.fromhex(handle))
        s = ctx.create_stream()
        s.wait_event(opened)  # the record it shares was done: nothing to wait for
        s.synchronize()
        opened.record(s)
        assert opened.query()


LIMITED_EXPORTER = """
    import mpsd_client
    ctx = mpsd_client.connect()
    p = ctx.malloc(1 << 30)
    print(ctx.ipc_get_mem_handle(p).hex())
    print("ready", flush=True)
    input()
"""


def test_imports_outliving_their_exporter_stay_within_a_live_clients_limit(daemon_factory):
    """Issue 29, item 2: memory an importer maps counts against the importer's own limit, so exporters that
    exit and reconnect cannot leave it holding more than its limit (that way two clients limited to 1 GiB each
    once held 11.75 GiB): the second exporter's GiB is refused, and so is a malloc past what the import left."""
    from mpsd_client import OutOfMemoryError

    daemon = start_daemon("--time-scale", "100", "--pinned-mem-limit", "2G")
    daemon_factory.append(daemon)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        room = ctx.mem_get_info()[0]  # the 2 GiB limit less the context's own charge
        assert 1 << 30 < room < 2 << 30
        opened = []
        for round in range(2):
            worker, (handle,) = export_from_worker(daemon, LIMITED_EXPORTER)
            try:
                opened.append(ctx.ipc_open_mem_handle(bytes.fromhex(handle)))
            except OutOfMemoryError as exc:
                assert round == 1 and "past its pinned limit" in str(exc)
            finish(worker)  # the exporter exits; its GiB lives on for as long as we map it
        assert len(opened) == 1 and ctx.mem_get_info()[0] == room - (1 << 30)
        with pytest.raises(OutOfMemoryError):
            ctx.malloc(room - (1 << 30) + (2 << 20))
        ctx.ipc_close_mem_handle(opened[0])
        assert ctx.mem_get_info()[0] == room
        ctx.free(ctx.malloc(room - (2 << 20)))  # closed: the room is this client's own again


SMALL_EXPORTER = """
    import mpsd_client
    ctx = mpsd_client.connect()
    a, b = ctx.malloc(512), ctx.malloc(512)
    ctx.memset(a, 7, 512)
    ctx.memset(b, 9, 512)
    ctx.synchronize()
    print(ctx.ipc_get_mem_handle(a).hex())
    print("ready", flush=True)
    input()
    ctx.free(a)
    c = ctx.malloc(512)
    ctx.memset(c, 1, 512)
    ctx.synchronize()
    print(int(c) != int(a), bytes(b.host_view()[:2]).hex(), flush=True)
    input()
    print(int(ctx.malloc(512)) == int(a), flush=True)
    input()
"""


def test_small_allocations_share_a_chunk_but_not_their_bytes(daemon):
    """A 512-byte allocation lives in its chunk's memfd beside others, yet an importer sees its 512 bytes
    alone; after the exporter frees it, its range is not handed out again until the importer closes it, so
    the importer keeps its bytes and never sees a later allocation's."""
    worker, (handle,) = export_from_worker(daemon, SMALL_EXPORTER)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        q = ctx.ipc_open_mem_handle(bytes.fromhex(handle))
        assert q.size == 512 and bytes(q.host_view()) == b"\x07" * 512
        worker.stdin.write("free\n")
        worker.stdin.flush()
        assert worker.stdout.readline().split() == ["True", "0909"]  # a new allocation, elsewhere
        out = bytearray(512)
        ctx.memcpy_dtoh(out, q)
        assert out == b"\x07" * 512 and bytes(q.host_view()) == b"\x07" * 512
        ctx.ipc_close_mem_handle(q)
        worker.stdin.write("again\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "True"  # closed: the range is free again
    finish(worker)


def test_shared_weights_are_counted_once(daemon):
    """Four workers open one exported buffer: the device is charged for it once, and they for nothing."""
    worker, (handle,) = export_from_worker(daemon, EXPORTER)
    with mpsd_client.connect(daemon.pipe_dir) as observer:
        free = observer.mem_get_info()[0]
        code = """
            import json, sys, mpsd_client
            ctx = mpsd_client.connect()
            q = ctx.ipc_open_mem_handle(bytes.fromhex(sys.argv[1]))
            stats = ctx.statistics()
            print(json.dumps({"used": stats["memory_used"], "imported": stats["memory_imported"],
                              "first": list(q.host_view()[:4])}), flush=True)
            input()
        """
        readers = [spawn_worker(code, daemon.pipe_dir, handle) for _ in range(4)]
        reports = [json.loads(r.stdout.readline()) for r in readers]
        assert all(r["used"] == 0 and r["imported"] == 4 * MiB and r["first"] == [0, 0, 32, 64]  # 2.5 as f32
                   for r in reports)
        assert observer.mem_get_info()[0] == free - 4 * 538_339_472  # their contexts, not the weights again
        for r in readers:
            r.communicate("\n", timeout=60)
    finish(worker)


def test_simple_ipc_ring(daemon):
    """simpleIPC: N processes each wait on buffer (i+id)%N's IPC event, fill it with byte id and record the
    event; at the end each finds its own buffer holds (id+1)%N."""
    n = 4
    code = """
        import sys, mpsd_client
        rank, n = int(sys.argv[1]), int(sys.argv[2])
        ctx = mpsd_client.connect()
        mine = ctx.malloc(1 << 16)
        ctx.memset(mine, 255, 1 << 16)
        done = ctx.create_event(disable_timing=True, interprocess=True)
        done.record()                      # "my buffer is ready"
        ctx.synchronize()
        print(ctx.ipc_get_mem_handle(mine).hex(), ctx.ipc_get_event_handle(done).hex(), flush=True)
        peers = [line.split() for line in sys.stdin.readline().strip().split(";")]
        target = (rank + 1) % n            # the ring: buffer (i + id) % N with i = 1
        buf = ctx.ipc_open_mem_handle(bytes.fromhex(peers[target][0]))
        event = ctx.ipc_open_event_handle(bytes.fromhex(peers[target][1]))
        s = ctx.create_stream()
        s.wait_event(event)                # wait until its owner has finished with it
        ctx.memset(buf, rank, 1 << 16, stream=s)
        event.record(s)                    # records into the shared event
        s.synchronize()
        print("wrote", flush=True)
        sys.stdin.readline()               # everyone has written
        writer = (rank - 1) % n
        got = set(ctx.host_view(mine))
        print("ok" if got == {writer} else f"bad {got}", flush=True)
    """
    workers = [spawn_worker(code, daemon.pipe_dir, str(rank), str(n)) for rank in range(n)]
    handles = [w.stdout.readline().strip() for w in workers]
    table = ";".join(handles) + "\n"
    for w in workers:
        w.stdin.write(table)
        w.stdin.flush()
    assert [w.stdout.readline().strip() for w in workers] == ["wrote"] * n
    results = [w.communicate("\n", timeout=60) for w in workers]
    assert [out.strip() for out, _ in results] == ["ok"] * n, [err for _, err in results]


def test_events_order_work_across_processes(realtime_daemon):
    """A consumer's stream waits on the producer's interprocess event: its kernel starts only after the
    producer's long kernel, and its query and synchronize follow the producer's record."""
    worker = spawn_worker("""
        import mpsd_client
        ctx = mpsd_client.connect()
        e = ctx.create_event(disable_timing=True, interprocess=True)
        print(ctx.ipc_get_event_handle(e).hex(), flush=True)
        input()
        ctx.launch("spin", 1, 32, [int(0.3 * 1.98e9)])   # 0.3 s
        e.record()
        print("recorded", flush=True)
        input()
    """, realtime_daemon.pipe_dir)
    handle = bytes.fromhex(worker.stdout.readline().strip())
    with mpsd_client.connect(realtime_daemon.pipe_dir) as ctx:
        event = ctx.ipc_open_event_handle(handle)
        assert event.query()  # never recorded yet: complete
        worker.stdin.write("\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "recorded"
        assert not event.query()
        s = ctx.create_stream()
        s.wait_event(event)
        p = ctx.malloc(16)
        ctx.launch("fill_f32", 1, 4, [p, 9.0, 4], stream=s)
        assert not s.query()
        event.synchronize()
        s.synchronize()
        assert np.frombuffer(p.host_view(), np.float32).tolist() == [9.0] * 4
        with pytest.raises(InvalidResourceHandleError):
            event.elapsed_ms(event)  # an opened event disables timing
    worker.communicate("\n", timeout=60)


def _fds(pid: int) -> int:
    gc.collect()  # objects of earlier tests closing their fds late must not count here
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_no_fd_leaks_over_thousands_of_cycles(daemon):
    """Two thousand get/open/host_view/close cycles leave the importer's and the daemon's fd counts as
    they were."""
    worker, (handle_hex,) = export_from_worker(daemon, EXPORTER)
    handle = bytes.fromhex(handle_hex)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        q = ctx.ipc_open_mem_handle(handle)
        ctx.ipc_close_mem_handle(q)  # warm: the first calls create what stays (staging and so on)
        ours, theirs = _fds(os.getpid()), _fds(daemon.proc.pid)
        for _ in range(2000):
            q = ctx.ipc_open_mem_handle(handle)
            assert q.host_view()[0] == 0
            ctx.ipc_close_mem_handle(q)
        assert (_fds(os.getpid()), _fds(daemon.proc.pid)) == (ours, theirs)
    finish(worker)


def _try_open(pipe_dir, handle: bytes) -> str:
    with mpsd_client.connect(pipe_dir) as ctx:
        try:
            return f"opened {ctx.ipc_open_mem_handle(handle).host_view()[3]}"
        except mpsd_client.CudaError as exc:
            return exc.name


@pytest.mark.parametrize("access,allowed", [("uid", False), ("group", False), ("any", True)])
def test_access_policy_with_a_real_second_user(daemon_factory, access, allowed):
    """By default only the exporter's uid may open its handles; a denied open is cudaErrorNotPermitted and
    logged; --ipc-access any lets another user in."""
    user = _second_user()
    if user is None:
        pytest.skip("needs root to create a second user (useradd)")
    d = start_daemon("--time-scale", "100", "--ipc-access", access, "--multiuser")  # both users at once
    daemon_factory.append(d)
    os.chmod(d.pipe_dir.parent, 0o755)  # the test's temporary parent; --multiuser opened the rest
    worker, (handle,) = export_from_worker(d, EXPORTER)
    assert _as_user(user, lambda: _try_open(d.pipe_dir, bytes.fromhex(handle))) == (
        "opened 64" if allowed else "cudaErrorNotPermitted")
    if not allowed:
        assert f"(uid {user.pw_uid}) was refused an IPC handle" in d.server_log()
    finish(worker)


def test_example_pipeline_runs():
    """examples/ipc_pipeline.py, the example users run, completes and checks its own results."""

    example = Path(__file__).parent.parent / "examples" / "ipc_pipeline.py"
    result = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.mark.parametrize("peer_access", ["all", "none"])
def test_two_gpu_pipeline_example_runs(peer_access):
    """examples/two_gpu_pipeline.py: preprocessing on GPU 0, inference on GPU 1, through a peer mapping or
    staged through the host, and the statistics say which."""
    example = Path(__file__).parent.parent / "examples" / "two_gpu_pipeline.py"
    proc = subprocess.run([sys.executable, str(example), "--peer-access", peer_access], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    consumer = next(line for line in proc.stdout.splitlines() if line.startswith("consumer: memory"))
    batch = 16 * MiB
    if peer_access == "all":  # each batch copied over NVLink, in the model's time for it (the virtual clock)
        assert f"memory_imported_peer={batch} peer_copies_nvlink=4 " in consumer
        assert "mapped GPU 0's feature buffer" in proc.stdout
        ms = (H200.peer_copy_latency + batch / H200.nvlink_bandwidth) * 1e3
        assert proc.stdout.count(f"over NVLink 16 MiB in {ms:.4f} ms") == 4
    else:  # each batch through pinned host memory, each leg in the PCIe engines' time
        assert "memory_imported_peer=0 peer_copies_nvlink=0 " in consumer
        assert "cudaErrorPeerAccessUnsupported" in proc.stdout
        assert int(consumer.split("bytes_copied=")[1].split()[0]) >= 4 * batch
        ms = (H200.copy_latency + batch / H200.pcie_bandwidth) * 1e3
        assert proc.stdout.count(f"GPU 0 to host 16 MiB in {ms:.4f} ms") == 4
        assert proc.stdout.count(f"host to GPU 1 16 MiB in {ms:.4f} ms") == 4
