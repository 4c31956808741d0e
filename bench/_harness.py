# Shared plumbing for the benchmarks in bench/: a private daemon subprocess, the raw baselines' peer process,
# statistics and the one report block. Every benchmark measures its raw baseline in the same run, on the same
# machine, so the ratio it prints means something even where the absolute figures drift between machines.
#
# The raw baselines copy what our stack does on the wire and nothing more: an 8-byte `<II` header (body length,
# fd count) and a msgpack body of the same shape as our message, blocking sockets, one `sendall` per frame,
# one `recv` of up to 64 KiB that may hold many frames, two processes over a Unix socketpair. The peer is
# this file run as a script (`python _harness.py FD`): it answers requests and swallows notifications, so
# the same peer serves the ping-pong and the stream (whose end is one request, as ours is synchronize()).
#
# Profiling hooks (for finding where the time goes, not for the figures): `--profile DIR` runs the daemon
# under cProfile and profiles the client's measured loop; `--py-spy DIR` attaches py-spy (from $PY_SPY or
# PATH) to the daemon and to the client, writing collapsed stacks.
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack

HEADER = struct.Struct("<II")  # the same header as mpsd_protocol.HEADER
READ_SIZE = 1 << 16
SPIN = 1e-3  # seconds a spinning raw reader keeps reading an empty socket before it blocks
READY = "mpsd: ready on "
HERE = Path(__file__).resolve().parent


# -- framing for the raw baselines ---------------------------------------------------------------------------
def frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body), 0) + body


class FrameReader:
    """Reads frames from a blocking socket: one recv per refill, as many frames per recv as arrived (with
    `spin`, a refill reads without blocking for up to SPIN seconds first, as a spinning waiter does; the bound
    keeps an idle peer from taking a core while the other side's blocks run)."""

    def __init__(self, sock: socket.socket, spin: bool = False) -> None:
        self.sock = sock
        self.spin = spin
        self.buffer = bytearray()
        self.start = 0

    def next(self) -> Any:
        """The next decoded body, or None at end of file."""
        while True:
            available = len(self.buffer) - self.start
            if available >= HEADER.size:
                length, _ = HEADER.unpack_from(self.buffer, self.start)
                if available >= HEADER.size + length:
                    body_start = self.start + HEADER.size
                    body = bytes(self.buffer[body_start:body_start + length])
                    self.start = body_start + length
                    if self.start == len(self.buffer):
                        self.buffer.clear()
                        self.start = 0
                    return msgpack.unpackb(body, raw=False)
            data = self._refill()
            if not data:
                return None
            if self.start:
                del self.buffer[:self.start]
                self.start = 0
            self.buffer += data

    def _refill(self) -> bytes:
        if self.spin:
            end = time.perf_counter() + SPIN
            while time.perf_counter() < end:
                try:
                    return self.sock.recv(READ_SIZE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass
        return self.sock.recv(READ_SIZE)


def _peer(fd: int, spin: bool = False) -> None:
    """Decode every frame; answer each request [0, id, op, args] with a reply [1, id, None, result] shaped like
    mem_get_info's, and drop notifications [2, op, args] once decoded. Until end of file."""
    sock = socket.socket(fileno=fd)
    reader = FrameReader(sock, spin)
    while (message := reader.next()) is not None:
        if message[0] == 0:
            sock.sendall(frame([1, message[1], None, [141 << 30, 141 << 30]]))


@contextlib.contextmanager
def raw_peer(cpu: int | None = None, spin: bool = False) -> Iterator[tuple[socket.socket, FrameReader]]:
    """A peer process at the other end of a socketpair (pinned to `cpu` if given): yields our end and a
    reader on it. With `spin` both ends read without blocking for up to SPIN seconds before they block."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, str(HERE / "_harness.py"), str(theirs.fileno())] + ["spin"] * spin,
                            pass_fds=[theirs.fileno()])
    theirs.close()
    try:
        if cpu is not None:
            pin(proc.pid, cpu)
        yield ours, FrameReader(ours, spin)
    finally:
        ours.close()
        if proc.wait(timeout=10) != 0:
            raise RuntimeError(f"the raw peer exited {proc.returncode}")


# -- the daemon ----------------------------------------------------------------------------------------------
@dataclass
class Daemon:
    pipe_dir: Path
    proc: subprocess.Popen[str]


@contextlib.contextmanager
def daemon(time_scale: float, profile_dir: Path | None = None, py_spy_dir: Path | None = None,
           cpu: int | None = None, devices: str | None = None, policy: str | None = None,
           dispatch: str | None = None, clock: str | None = None) -> Iterator[Daemon]:
    """A private `python -m mpsd` on a short temp pipe directory; stopped with SIGTERM, which must give 0."""
    pipe_dir = Path(tempfile.mkdtemp(prefix="mpsdb-", dir="/tmp"))  # socket paths are limited to 107 bytes
    cmd = [sys.executable]
    if profile_dir is not None:
        cmd += ["-m", "cProfile", "-o", str(profile_dir / "daemon.prof")]
    cmd += ["-m", "mpsd", "--pipe-dir", str(pipe_dir), "--time-scale", str(time_scale)]
    if devices is not None:
        cmd += ["--devices", devices]
    if policy is not None:
        cmd += ["--policy", policy]
    if dispatch is not None:
        cmd += ["--dispatch", dispatch]
    if clock is not None:
        cmd += ["--clock", clock]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    spy = None
    try:
        _wait_ready(proc, timeout=30)
        if cpu is not None:
            pin(proc.pid, cpu)
        # Keep draining stderr so a chatty daemon never blocks on a full pipe; echo what it says.
        threading.Thread(target=_drain, args=(proc,), daemon=True).start()
        if py_spy_dir is not None:
            spy = _start_py_spy(proc.pid, py_spy_dir / "daemon.txt")
        yield Daemon(pipe_dir, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError("the daemon did not stop within 15 s of SIGTERM") from None
        finally:
            if spy is not None:
                spy.wait(timeout=30)
            shutil.rmtree(pipe_dir, ignore_errors=True)
        if code != 0:
            raise RuntimeError(f"the daemon exited {code} after SIGTERM (expected 0)")


def _wait_ready(proc: subprocess.Popen[str], timeout: float) -> None:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    found = threading.Event()

    def reader() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if line.startswith(READY):
                found.set()
                return
        found.set()  # end of file: the daemon died

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    found.wait(max(0.0, deadline - time.monotonic()))
    if not found.is_set() or not lines or not lines[-1].startswith(READY):
        proc.kill()
        raise RuntimeError("the daemon did not say it was ready:\n" + "".join(lines[-20:]))
    thread.join()


def _drain(proc: subprocess.Popen[str]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write("[daemon] " + line)


def _py_spy() -> str:
    found = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not found:
        raise SystemExit("--py-spy needs py-spy on PATH or in $PY_SPY")
    return found


def _start_py_spy(pid: int, output: Path) -> subprocess.Popen[bytes]:
    spy = subprocess.Popen([_py_spy(), "record", "--pid", str(pid), "--rate", "1000", "--format", "raw",
                            "--output", str(output), "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # let it attach before the measured part starts
    return spy


@contextlib.contextmanager
def client_profile(profile_dir: Path | None, py_spy_dir: Path | None, name: str) -> Iterator[None]:
    """Profile this (client) process around the measured loop, if asked to."""
    spy = _start_py_spy(os.getpid(), py_spy_dir / f"{name}.txt") if py_spy_dir is not None else None
    profiler = None
    if profile_dir is not None:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    try:
        yield
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(profile_dir / f"{name}.prof"))  # type: ignore[operator]
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
            spy.wait(timeout=30)


# -- options, statistics and the report ----------------------------------------------------------------------
def alternate(args: argparse.Namespace, name: str, ours: Callable[[], Any],
              raw: Callable[[], Any] | None) -> tuple[list[Any], list[Any]]:
    """Measure `ours` and `raw` in alternating blocks, so load on the machine hits both alike; the first of
    our blocks is profiled when asked (--profile, --py-spy)."""
    mine: list[Any] = []
    theirs: list[Any] = []
    for r in range(args.repeat):
        profiling = client_profile(args.profile, args.py_spy, name) if r == 0 else contextlib.nullcontext()
        with profiling:
            mine.append(ours())
        if raw is not None:
            theirs.append(raw())
    return mine, theirs


def parser(description: str, n: int, repeat: int, warmup: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--n", type=int, default=n, help=f"measured iterations per block (default {n})")
    p.add_argument("--repeat", type=int, default=repeat,
                   help=f"measured blocks of each side, alternating (default {repeat})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"warm-up iterations per block (default {warmup})")
    p.add_argument("--json", action="store_true", help="also print one machine-readable JSON line")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="write cProfile data: DIR/daemon.prof (whole daemon) and DIR/<bench>.prof (client loop)")
    p.add_argument("--py-spy", type=Path, metavar="DIR", dest="py_spy",
                   help="write py-spy collapsed stacks of the daemon and the client to DIR")
    p.add_argument("--pin", action="store_true",
                   help="pin the server side (daemon, raw peer) to CPU 0 and this client to CPU 1: steadier "
                        "figures on a busy 2-core machine, where two processes sharing a CPU add a context "
                        "switch to every round trip")
    p.add_argument("--skip-baseline", action="store_true", help="measure only our side (for profiling)")
    return p


SERVER_CPU, CLIENT_CPU = 0, 1


def pin(pid: int, cpu: int) -> None:
    """Keep `pid` (0: this process) on one CPU, where the machine has it."""
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > max(SERVER_CPU, CLIENT_CPU):
        os.sched_setaffinity(pid, {cpu})


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def percentiles(blocks: list[list[float]]) -> tuple[float, float]:
    """p50 and p99 over every sample of every block."""
    pooled = sorted(v for block in blocks for v in block)
    return percentile(pooled, 50), percentile(pooled, 99)


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(title: str, rows: list[tuple[str, str]], verdict: bool | None,
           json_line: dict[str, Any] | None) -> None:
    """Print the one result block (and the JSON line if asked); verdict None: no baseline was run, or there is
    no target for what was."""
    width = max(len(k) for k, _ in rows)
    print(f"== {title} ==")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    result = "n/a (no baseline, or no target)" if verdict is None else "PASS" if verdict else "MISS"
    print(f"  {'result':<{width}}  {result}")
    if json_line is not None:
        print(json.dumps(json_line, sort_keys=True))
    sys.stdout.flush()


def daemon_and_client(stack: contextlib.ExitStack, args: argparse.Namespace, time_scale: float,
                      devices: str | None = None, policy: str | None = None,
                      dispatch: str | None = None) -> tuple[Any, Any]:
    """A private daemon (on the server CPU with --pin, profiled when asked, on `devices` if given) and a
    blocking client of it, both closed when `stack` closes."""
    import mpsd_client

    d = stack.enter_context(daemon(time_scale=time_scale, profile_dir=args.profile, py_spy_dir=args.py_spy,
                                   cpu=SERVER_CPU if args.pin else None, devices=devices, policy=policy,
                                   dispatch=dispatch))
    return d, stack.enter_context(mpsd_client.connect(d.pipe_dir))


def prepare_dirs(args: argparse.Namespace) -> None:
    for directory in (args.profile, args.py_spy):
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)


if __name__ == "__main__":
    _peer(int(sys.argv[1]), sys.argv[2:] == ["spin"])
