"""Exhaustion sweep: one client takes all it may of each limited object; another is still served; all comes back.

    .venv/bin/python bench/exhaust.py [--only KIND ...] [--fd-headroom 2048] [--slack-mib 8]

For each object a client can make the daemon hold (streams, events, calls waiting for the device, allocations,
VMM reservations, pinned host buffers, the daemon's fds, host memory), a greedy client process forked from this
one makes them until the daemon refuses; and it opens 2,000 client or control connections that say nothing, of
which the daemon keeps 64 (closing the oldest). While it holds all it got, a second well-behaved client connects,
allocates 4 MiB (two of the daemon's fds), writes and reads back a page. Then the greedy client exits, and once
the daemon says what it reclaimed, its open fds, RSS, device memory and pinned host memory are compared with
what they were before the greedy client came. Printed for each: how many it got, the CUDA error at the limit,
the bystander's outcome, and what came back. Exit status 1 if any bystander failed or anything stayed behind.

The per-client limits are set low (LIMITS below; the defaults, mpsd.runtime.limits, are far larger, so that a
sweep at them takes many minutes), the host memory budget is 256 MiB (the default is half of the host's RAM),
and for the fds the daemon's soft RLIMIT_NOFILE is lowered (prlimit) to `--fd-headroom` more than it holds, so
that the reserve and the per-client half that protect the others are what refuses, and restored after.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import select
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import mpsd_client  # noqa: E402
from daemons import DaemonProcess, drain_stderr, start_daemon  # noqa: E402
from mpsd.tools.smi import query  # noqa: E402

MiB = 1 << 20
HOST_BUDGET = 256 * MiB
CHUNK = 16 * MiB  # what the host-memory client touches per call
LIMITS = {"--max-streams": 2048, "--max-events": 8192, "--max-pending-waits": 1024, "--max-allocations": 16384,
          "--max-reservations": 4096, "--max-host-buffers": 1024}
TIME_SCALE = 100.0
SPIN_SECONDS = 30.0  # of the wall clock: the kernel the waiting calls wait for outlasts the measurement
REPORT_TIMEOUT = 300.0


def _until_refused(make: Callable[[], Any]) -> tuple[int, mpsd_client.CudaError]:
    count = 0
    while True:
        try:
            make()
        except mpsd_client.CudaError as exc:
            return count, exc
        count += 1


def _touch(ctx: Any) -> Callable[[], Any]:
    p = ctx.malloc(1 << 30)  # costs no host memory until written
    offsets = iter(range(0, 1 << 30, CHUNK))
    return lambda: ctx.memset(p + next(offsets), 7, CHUNK)


# kind -> (what one is, how the greedy client makes one more: given its context, a call that makes one)
TAKERS: dict[str, tuple[str, Callable[[Any], Callable[[], Any]]]] = {
    "streams": ("create_stream", lambda ctx: ctx.create_stream),
    "events": ("create_event", lambda ctx: ctx.create_event),
    "allocations": ("malloc(512)", lambda ctx: lambda: ctx.malloc(512)),
    "reservations": ("mem_address_reserve(2 MiB)", lambda ctx: lambda: ctx.mem_address_reserve(2 * MiB)),
    "host buffers": ("host_alloc(4 KiB)", lambda ctx: lambda: ctx.host_alloc(4096)),
    "fds": ("malloc(4 MiB), two fds each", lambda ctx: lambda: ctx.malloc(4 * MiB)),
    "host memory": (f"memset of {CHUNK // MiB} MiB not yet touched", _touch),
}
# Connections a client opens and keeps without a word: each costs the daemon an fd, and none is refused, but the
# daemon keeps at most 64 of one uid (closing the oldest for a newer one).
SOCKETS = {"silent connections": ("mpsd.sock", socket.SOCK_STREAM), "control connections": ("control",
                                                                                           socket.SOCK_SEQPACKET)}
OPENED = 2000
KINDS = ["streams", "events", "pending waits", "allocations", "reservations", "host buffers", "fds", "host memory",
         *SOCKETS]


async def _take_waits(pipe_dir: Path, hold: Callable[[int, mpsd_client.CudaError], None]) -> None:
    """synchronize calls, 64 more at a time, all waiting on a long kernel until the daemon refuses one; then
    `hold` (which never returns) with them still waiting."""
    refusals: list[mpsd_client.CudaError] = []

    async def wait(ctx: Any) -> None:
        try:
            await ctx.synchronize()
        except mpsd_client.CudaError as exc:
            refusals.append(exc)

    async with mpsd_client.open_context(pipe_dir, environ={}) as ctx, trio.open_nursery() as nursery:
        await ctx.launch("spin", 1, 32, [int(SPIN_SECONDS * TIME_SCALE * 1.98e9)])  # one block: SMs stay free
        started = 0
        while not refusals:
            for _ in range(64):
                nursery.start_soon(wait, ctx)
            started += 64
            await trio.sleep(0.05)
        await trio.sleep(0.5)  # every refusal of the last batch has come back
        await trio.to_thread.run_sync(hold, started - len(refusals), refusals[0])


def _open_sockets(kind: str, pipe_dir: Path, held: list[socket.socket]) -> dict[str, int]:
    """OPENED connections of `kind` into `held`, none saying anything; how many the daemon has closed after half a
    second."""
    name, type_ = SOCKETS[kind]
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    while len(held) < OPENED:
        sock = socket.socket(socket.AF_UNIX, type_)
        sock.setblocking(False)
        try:
            sock.connect(str(pipe_dir / name))
        except BlockingIOError:  # the listen queue is full for now
            sock.close()
            time.sleep(0.01)
            continue
        held.append(sock)
    time.sleep(0.5)
    closed = sum(_closed(sock) for sock in held)
    return {"got": len(held) - closed, "opened": len(held), "closed": closed}


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False


def greedy(kind: str, pipe_dir: Path, report: int, go: int) -> None:
    """The greedy client's life (in a forked child): take all it may, report, hold it until told, exit."""
    def hold(got: int, exc: mpsd_client.CudaError) -> None:
        os.write(report, json.dumps({"got": got, "code": exc.code, "name": exc.name, "message": exc.message}).encode())
        os.read(go, 1)
        os._exit(0)  # as a killed client goes: the daemon sees its socket close, all it holds still held

    try:
        if kind == "pending waits":
            trio.run(_take_waits, pipe_dir, hold)
        elif kind in SOCKETS:
            held: list[socket.socket] = []  # (open until this process exits)
            os.write(report, json.dumps(_open_sockets(kind, pipe_dir, held)).encode())
            os.read(go, 1)
            os._exit(0)
        else:
            hold(*_until_refused(TAKERS[kind][1](mpsd_client.connect(pipe_dir))))
    except BaseException as exc:  # say what went wrong: the sweep prints it
        os.write(report, json.dumps({"failed": repr(exc)}).encode())
    finally:
        os._exit(1)


@dataclass(frozen=True)
class Sample:
    """What the daemon holds: open fds, RSS, device memory in use, clients' pinned host memory mapped."""

    fds: int
    rss: int
    device: int
    pinned: int


def sample(daemon: DaemonProcess, proc: psutil.Process) -> Sample:
    fds = _fds(proc)  # before the query: its control connection is one of the daemon's fds until it has closed it
    status = query(daemon.pipe_dir)
    return Sample(fds, proc.memory_info().rss, status["devices"][0]["memory_used"], status["host_memory"]["pinned"])


def _fds(proc: psutil.Process) -> int:
    """The daemon's open fds once two reads 20 ms apart agree (a connection that just closed on our side, the last
    query's, leaves its fd there until the daemon's loop has seen it close)."""
    last = proc.num_fds()
    for _ in range(50):
        time.sleep(0.02)
        if (now := proc.num_fds()) == last:
            break
        last = now
    return last


def warm_up(pipe_dir: Path) -> None:
    """One client that makes one of each thing and touches a chunk, so that what the daemon makes once and keeps
    (the heap that the first large allocation grows) is in the baselines, not taken for what a greedy client
    left behind."""
    with mpsd_client.connect(pipe_dir) as ctx:
        ctx.create_stream()
        ctx.create_event()
        ctx.mem_address_reserve(2 * MiB)
        ctx.host_alloc(4096)
        p = ctx.malloc(1 << 30)
        for offset in (0, CHUNK):  # the second memset of a chunk left 16 MiB of heap that the daemon then reuses
            ctx.memset(p + offset, 7, CHUNK)
        ctx.launch("spin", 1, 32, [1000])
        ctx.synchronize()


def settled(daemon: DaemonProcess) -> None:
    """Return once the daemon has no client (every one before has been reclaimed)."""
    deadline = time.monotonic() + 60
    while query(daemon.pipe_dir)["processes"] and time.monotonic() < deadline:
        time.sleep(0.05)


def bystander(pipe_dir: Path) -> tuple[bool, bool, str]:
    """A new well-behaved client: (connected and allocated, wrote and read back a page, what happened)."""
    start = time.perf_counter()
    try:
        with mpsd_client.connect(pipe_dir, timeout=10) as ctx:
            p = ctx.malloc(4 * MiB)
            ctx.mem_get_info()
            try:
                ctx.memset(p, 0xA5, 4096)
                out = bytearray(4096)
                ctx.memcpy_dtoh(out, p)
                touched = out == b"\xa5" * 4096
                what = "wrote and read back a page" if touched else "read back the wrong bytes"
            except mpsd_client.CudaError as exc:
                touched, what = False, f"writing a page: {exc.name}"
            ctx.free(p)
    except (mpsd_client.CudaError, OSError) as exc:
        return False, False, f"FAILED: {type(exc).__name__}: {exc}"
    return True, touched, f"connected, allocated 4 MiB, {what} ({(time.perf_counter() - start) * 1e3:.1f} ms)"


def _reclaimed(daemon: DaemonProcess, pid: int) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.search(rf"Client {pid} disconnected; reclaimed (.*)", daemon.server_log())
        if found:
            return found.group(1)
        time.sleep(0.02)
    return "NOTHING: no line in server.log within 120 s"


def sweep(kind: str, daemon: DaemonProcess, proc: psutil.Process, options: argparse.Namespace) -> bool:
    """One kind: the greedy client, the bystander, the reclaim; prints the block; whether all was well."""
    settled(daemon)
    before = sample(daemon, proc)
    rlimit = proc.rlimit(psutil.RLIMIT_NOFILE)
    if kind == "fds":  # the daemon's own limit, close above what it holds: the reserve and the half refuse
        proc.rlimit(psutil.RLIMIT_NOFILE, (before.fds + options.fd_headroom, rlimit[1]))
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        os.close(go_w)
        greedy(kind, daemon.pipe_dir, report_w, go_r)
    os.close(report_w)
    os.close(go_r)
    ready, _, _ = select.select([report_r], [], [], REPORT_TIMEOUT)
    got = json.loads(os.read(report_r, 1 << 16) or b'{"failed": "it died"}') if ready else {"failed": "no report"}
    held = sample(daemon, proc)
    connected, touched, seen = bystander(daemon.pipe_dir)
    os.write(go_w, b"x")
    os.waitpid(pid, 0)
    reclaimed = "(nothing to reclaim: it never said hello)" if kind in SOCKETS else _reclaimed(daemon, pid)
    proc.rlimit(psutil.RLIMIT_NOFILE, rlimit)
    after = sample(daemon, proc)
    deadline = time.monotonic() + 10  # (RSS and fds a moment behind the log line, if ever)
    while (after.fds != before.fds or after.rss - before.rss > options.slack_mib * MiB) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = sample(daemon, proc)
    for fd in (report_r, go_w):
        os.close(fd)

    what = ("its pending calls" if kind == "pending waits" else "saying nothing" if kind in SOCKETS
            else TAKERS[kind][0])
    if "failed" in got:
        print(f"{kind} ({what}): the greedy client FAILED: {got['failed']}")
    elif kind in SOCKETS:
        print(f"{kind} ({what}): opened {got['opened']}; the daemon closed the oldest {got['closed']} and kept "
              f"{got['got']} open")
    else:
        print(f"{kind} ({what}): got {got['got']}, then {got['name']} ({got['code']}): {got['message']}")
    shared = kind == "host memory"  # the budget is the daemon's, not a client's: a full one refuses every first touch
    print(f"  bystander while it held them: {seen}" + (" (the host budget is shared)" if shared and not touched
                                                       else ""))
    mib = lambda n: f"{n / MiB:.0f} MiB"  # noqa: E731
    print(f"  daemon before / holding / after: fds {before.fds} / {held.fds} / {after.fds}; "
          f"RSS {mib(before.rss)} / {mib(held.rss)} / {mib(after.rss)}; device memory {mib(before.device)} / "
          f"{mib(held.device)} / {mib(after.device)}; pinned {mib(before.pinned)} / {mib(held.pinned)} / "
          f"{mib(after.pinned)}")
    print(f"  reclaimed: {reclaimed}")
    back = (after.fds == before.fds and after.device == before.device and after.pinned == before.pinned
            and after.rss - before.rss <= options.slack_mib * MiB and not reclaimed.startswith("NOTHING"))
    if not back:
        print(f"  NOT RECLAIMED: fds {after.fds - before.fds:+d}, RSS {(after.rss - before.rss) / MiB:+.1f} MiB "
              f"(slack {options.slack_mib} MiB), device memory {after.device - before.device:+d} B, pinned "
              f"{after.pinned - before.pinned:+d} B")
    return "failed" not in got and connected and (touched or shared) and back


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=KINDS, metavar="KIND", help=f"of {', '.join(KINDS)}")
    parser.add_argument("--fd-headroom", type=int, default=2048,
                        help="fds above what the daemon holds that its lowered limit leaves (default 2048)")
    parser.add_argument("--slack-mib", type=float, default=8.0,
                        help="RSS above the baseline still counted as given back (Python's allocator keeps "
                             "some freed arenas; default 8)")
    options = parser.parse_args()
    limits = [str(v) for option, value in LIMITS.items() for v in (option, value)]
    daemon = start_daemon("--time-scale", str(TIME_SCALE), "--host-memory", str(HOST_BUDGET), *limits)
    reader = drain_stderr(daemon)
    proc = psutil.Process(daemon.proc.pid)
    print(f"exhaust: daemon pid {proc.pid}, {' '.join(limits)} --host-memory {HOST_BUDGET // MiB}M, "
          f"fd limit {proc.rlimit(psutil.RLIMIT_NOFILE)[0]} (lowered to {options.fd_headroom} above what it holds "
          "for the fds)")
    try:
        warm_up(daemon.pipe_dir)
        results = {kind: sweep(kind, daemon, proc, options) for kind in options.only or KINDS}
    finally:
        code = daemon.stop()
        reader.join(30)
        shutil.rmtree(daemon.pipe_dir.parent, ignore_errors=True)
    tracebacks = sum("Traceback" in line for line in daemon.stderr_lines)
    failed = [kind for kind, ok in results.items() if not ok]
    print(f"exhaust: {len(results) - len(failed)} of {len(results)} kinds held at their limit with the "
          f"bystander served and all given back" + (f"; FAILED: {', '.join(failed)}" if failed else "")
          + f"; daemon exit {code}, tracebacks {tracebacks}")
    return 0 if not failed and code == 0 and not tracebacks else 1


if __name__ == "__main__":
    raise SystemExit(main())
