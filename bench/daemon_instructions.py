"""Daemon instructions per call: what the daemon's CPU executes for one fire-and-forget launch and for one
synchronous request, counted by valgrind's callgrind, beside two raw peers counted the same way in the same run.

    .venv/bin/python bench/daemon_instructions.py [--n 2000]

The wall-clock benchmarks (launch_rate, rpc_latency, ipc_open) measure what a user sees, and on a shared 2-core
machine their figures move with whatever else runs. An instruction count does not: it is the figure to follow
when changing the daemon's path. Each process runs under callgrind, and each figure is the count of one
window (counters zeroed before it, dumped after it, with `callgrind_control`), less an empty window's, over
the calls in it. Only user-space instructions count; the kernel's share of a syscall does not. The daemon
runs with `--spin 0`: what a session reads while it spins for its client's next call (mpsd.daemon.channel)
depends on how long the client takes, many times longer under callgrind, and is waiting, not the call's path.
For the same reason the clients wait for their replies with cudaDeviceScheduleBlockingSync, not Auto's spin.

    launch   N x ctx.launch('spin', 1, 32, [0]) and one synchronize(), less one synchronize() alone
    request  N x ctx.mem_get_info()
    client   the same calls counted in the blocking client that makes them (a process of its own, under
             callgrind too, told what to run over a pipe; the telling is an empty window's cost, taken off)
    raw      the peer of launch_rate and rpc_latency (blocking socket, one recv for many frames, msgpack),
             fed the same frames: our launch notification N times and one request; N requests one by one
    trio     the same peer waiting with trio's wait_readable between reads, as the daemon does: what a trio
             server costs before it does any work of its own (about what the blocking peer costs: trio's
             wait is not where the daemon's instructions go)

Targets follow issue 14 item 6 (launch_rate: 40% of raw; rpc_latency: 1.5 times raw): a launch within 2.5
raw frames, a request within 1.5 raw round trips.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

from launch_rate import KERNEL, WIRE  # noqa: E402

LAUNCH_TARGET = 2.5  # our instructions per launch / the raw peer's per frame, at most (40% of its rate)
REQUEST_TARGET = 1.5  # our instructions per request / the raw peer's per round trip, at most


class Counted:
    """A process under callgrind, whose instructions are counted window by window."""

    def __init__(self, proc: subprocess.Popen[str], out_dir: Path) -> None:
        self.proc = proc
        self.out_dir = out_dir

    def window(self, work: Callable[[], None]) -> int:
        """Instructions the process executed while `work` ran."""
        subprocess.run(["callgrind_control", "-z", str(self.proc.pid)], check=True, capture_output=True)
        work()
        before = set(glob.glob(str(self.out_dir / "cg.*")))
        subprocess.run(["callgrind_control", "-d", str(self.proc.pid)], check=True, capture_output=True)
        deadline = time.monotonic() + 30
        while not (new := set(glob.glob(str(self.out_dir / "cg.*"))) - before):
            if time.monotonic() > deadline:
                raise RuntimeError("callgrind wrote no dump")
            time.sleep(0.05)
        (path,) = new
        for _ in range(600):  # the dump is written in pieces; its totals come last
            for line in Path(path).read_text().splitlines():
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
            time.sleep(0.05)
        raise RuntimeError(f"no totals in {path}")


def _valgrind(out_dir: Path) -> list[str]:
    return ["valgrind", "--tool=callgrind", "--trace-children=no", f"--callgrind-out-file={out_dir}/cg.%p"]


@contextlib.contextmanager
def counted_daemon(out_dir: Path) -> Iterator[tuple[Counted, Path]]:
    pipe_dir = Path(tempfile.mkdtemp(prefix="mpsdi-", dir="/tmp"))
    proc = subprocess.Popen([*_valgrind(out_dir), "-q", sys.executable, "-m", "mpsd", "--pipe-dir", str(pipe_dir),
                             "--time-scale", "1000", "--spin", "0"],
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        h._wait_ready(proc, timeout=300)
        threading.Thread(target=h._drain, args=(proc,), daemon=True).start()
        yield Counted(proc, out_dir), pipe_dir
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(pipe_dir, ignore_errors=True)


@contextlib.contextmanager
def counted_peer(out_dir: Path, kind: str) -> Iterator[tuple[Counted, socket.socket, h.FrameReader]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([*_valgrind(out_dir), sys.executable, str(Path(__file__).resolve()), f"--{kind}-peer",
                             str(theirs.fileno())], pass_fds=[theirs.fileno()], stderr=subprocess.DEVNULL)
    theirs.close()
    reader = h.FrameReader(ours)
    try:
        ours.sendall(h.frame([0, 0, "ready", {}]))  # answered once the peer has started under valgrind
        if reader.next() is None:
            raise RuntimeError("the peer did not start")
        yield Counted(proc, out_dir), ours, reader
    finally:
        ours.close()
        proc.wait(timeout=120)


@contextlib.contextmanager
def counted_client(out_dir: Path, pipe_dir: Path) -> Iterator[Callable[[str, int], Callable[[], None]]]:
    """A blocking client under callgrind: `run(what, count)` is a window's work, `count` launches (and the
    synchronize after them) or requests made in that process."""
    proc = subprocess.Popen([*_valgrind(out_dir), sys.executable, str(Path(__file__).resolve()), "--client",
                             str(pipe_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    counted = Counted(proc, out_dir)

    def run(what: str, count: int) -> Callable[[], None]:
        def work() -> None:
            proc.stdin.write(f"{what} {count}\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            if proc.stdout.readline().strip() != "done":  # type: ignore[union-attr]
                raise RuntimeError("the counted client failed")
        return lambda: counted.window(work)  # type: ignore[return-value]

    try:
        run("request", 0)()  # answered once it has connected, under valgrind
        yield run
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)


def _client(pipe_dir: str) -> None:
    """The counted client's loop: run what each line says, then say done."""
    import mpsd_client

    name, grid, block, kargs = KERNEL
    with mpsd_client.connect(pipe_dir, timeout=300) as ctx:
        ctx.set_device_flags(mpsd_client.DEVICE_SCHEDULE_BLOCKING_SYNC)
        for line in sys.stdin:
            what, count = line.split()
            if what == "launch":
                for _ in range(int(count)):
                    ctx.launch(name, grid, block, kargs)
                ctx.synchronize()
            else:
                for _ in range(int(count)):
                    ctx.mem_get_info()
            print("done", flush=True)


def _trio_peer(fd: int) -> None:
    """The raw peer's loop (bench/_harness.py), waiting for data with trio as the daemon's channel does."""
    import msgpack
    import trio

    async def serve() -> None:
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        buffer = bytearray()
        while True:
            try:
                data = sock.recv(h.READ_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            if not data:
                return
            buffer += data
            start = 0
            while len(buffer) - start >= h.HEADER.size:
                length, _ = h.HEADER.unpack_from(buffer, start)
                if len(buffer) - start < h.HEADER.size + length:
                    break
                message = msgpack.unpackb(bytes(buffer[start + h.HEADER.size:start + h.HEADER.size + length]),
                                          raw=False)
                start += h.HEADER.size + length
                if message[0] == 0:
                    sock.sendall(h.frame([1, message[1], None, [141 << 30, 141 << 30]]))
            del buffer[:start]

    trio.run(serve)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] in ("--raw-peer", "--trio-peer"):
        (h._peer if sys.argv[1] == "--raw-peer" else _trio_peer)(int(sys.argv[2]))
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--client":
        _client(sys.argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="calls per window (default 2000)")
    args = p.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        h.report("daemon_instructions", [("skipped", "valgrind (callgrind) is not installed")], None, None)
        return 0
    import mpsd_client

    n = args.n
    name, grid, block, kargs = KERNEL
    out_dir = Path(tempfile.mkdtemp(prefix="cgi-", dir="/tmp"))
    started = time.monotonic()
    try:
        with counted_daemon(out_dir) as (daemon, pipe_dir), mpsd_client.connect(pipe_dir, timeout=300) as ctx:
            ctx.set_device_flags(mpsd_client.DEVICE_SCHEDULE_BLOCKING_SYNC)

            def launches(count: int) -> Callable[[], None]:
                def run() -> None:
                    for _ in range(count):
                        ctx.launch(name, grid, block, kargs)
                    ctx.synchronize()
                return run

            def requests() -> None:
                for _ in range(n):
                    ctx.mem_get_info()

            launches(n // 4)()  # warm: the first calls make what stays (caches, the stream)
            requests()
            empty = daemon.window(launches(0))
            ours_launch = (daemon.window(launches(n)) - empty) / n
            ours_request = daemon.window(requests) / n
            with counted_client(out_dir, pipe_dir) as client:
                client("launch", n // 4)()  # warm, as above
                client("request", n)()
                empty_launch, empty_request = client("launch", 0)(), client("request", 0)()
                client_launch = (client("launch", n)() - empty_launch) / n
                client_request = (client("request", n)() - empty_request) / n
        raw: dict[str, tuple[float, float]] = {}
        for kind in ("raw", "trio"):
            with counted_peer(out_dir, kind) as (peer, sock, reader):
                def stream(count: int) -> Callable[[], None]:
                    def run() -> None:
                        for _ in range(count):
                            sock.sendall(h.frame(WIRE))
                        sock.sendall(h.frame([0, 1, "synchronize", {}]))
                        reader.next()
                    return run

                def ping_pong() -> None:
                    for i in range(n):
                        sock.sendall(h.frame([0, i & 0xFFFF, "mem_get_info", {}]))
                        reader.next()

                stream(n // 4)()
                ping_pong()
                empty = peer.window(stream(0))
                raw[kind] = ((peer.window(stream(n)) - empty) / n, peer.window(ping_pong) / n)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)

    frame, round_trip = raw["raw"]
    trio_frame, trio_round_trip = raw["trio"]
    launch_ratio, request_ratio = ours_launch / frame, ours_request / round_trip
    verdict = launch_ratio <= LAUNCH_TARGET and request_ratio <= REQUEST_TARGET
    rows = [("counted", f"user-space instructions (callgrind), {n} calls per window"),
            ("launch", f"{ours_launch:,.0f} per launch;  raw peer {frame:,.0f} per frame ({launch_ratio:.1f}x), "
                       f"trio peer {trio_frame:,.0f} ({ours_launch / trio_frame:.1f}x)"),
            ("request", f"{ours_request:,.0f} per request;  raw peer {round_trip:,.0f} per round trip "
                        f"({request_ratio:.1f}x), trio peer {trio_round_trip:,.0f} "
                        f"({ours_request / trio_round_trip:.1f}x)"),
            ("client", f"{client_launch:,.0f} per launch, {client_request:,.0f} per request (the blocking client's "
                       "own process)"),
            ("target", f"launch <= {LAUNCH_TARGET} raw frames, request <= {REQUEST_TARGET} raw round trips"),
            ("wall time", f"{time.monotonic() - started:.0f} s (everything under valgrind)")]
    h.report("daemon_instructions", rows, verdict, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
