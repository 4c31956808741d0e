"""CUDA IPC through mpsd: one producer process fills a device buffer, two consumer processes read it in place.

    .venv/bin/python examples/ipc_pipeline.py

What it does, in order:
  1. starts `python -m mpsd` on a private pipe directory under /tmp and waits for its "ready" line;
  2. starts the producer (this file, `producer PIPE_DIR`): it allocates a 1 MiB buffer `y` (and a private `x`),
     creates an interprocess event, and exports both with ``ipc_get_mem_handle`` / ``ipc_get_event_handle``;
  3. starts two consumers (this file, `consumer PIPE_DIR NAME MEM_HANDLE EVENT_HANDLE [--reduce]`), which open
     both handles in their own contexts and map the buffer with ``host_view()``: a numpy array over the
     daemon's memory, no copy;
  4. runs ROUNDS rounds. In round k the producer queues ``fill_f32(x, k)``, ``fill_f32(y, 1)`` and
     ``saxpy_f32(2, x, y)`` (so y = 2k + 1 everywhere) and records the event, without waiting for the GPU. Each
     consumer waits on its copy of the event (``event.synchronize()``), then checks every float of its array;
     the consumer started with --reduce also runs ``reduce_sum_f32`` on the imported pointer and checks the sum.
     This script relays "round k" between them over the children's stdin/stdout, and starts round k + 1 only
     when both consumers have checked round k, so the producer never overwrites bytes still being read;
  5. the consumers close their handles and exit, the producer frees its buffers and exits, and the daemon is
     stopped with SIGTERM, which must give exit status 0.
Exit status: 0 if every check passed, 1 otherwise.

The children talk to this script in lines: "=word ..." lines are for the script, all others are their log,
which it prints with the child's name in front.
"""
from __future__ import annotations

import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import mpsd_client

ROUNDS = 3
N = 1 << 18                  # floats in the shared buffer: 1 MiB
ALPHA = 2.0
TIME_SCALE = 0.002           # simulated seconds per wall second: the GPU model runs 500x slower than real
                             # time, so the producer's kernels (about 0.15 ms simulated, 75 ms wall) are still
                             # running when the consumers hear of them: the event wait makes their reads right
TIMEOUT = 20.0               # seconds for any one step; the whole run takes about two
HERE = Path(__file__).resolve()


def tell(line: str) -> None:
    print(line, flush=True)


# -- the producer --------------------------------------------------------------------------------------------
def producer(pipe_dir: str) -> int:
    with mpsd_client.connect(pipe_dir) as ctx:
        x, y = ctx.malloc(4 * N), ctx.malloc(4 * N)
        ready = ctx.create_event(disable_timing=True, interprocess=True)
        mem_handle, event_handle = ctx.ipc_get_mem_handle(y), ctx.ipc_get_event_handle(ready)
        tell(f"allocated y = {y!r} and exported it: a {len(mem_handle)}-byte handle {mem_handle[:8].hex()}...")
        tell(f"created an interprocess event and exported it: {event_handle[:8].hex()}...")
        tell(f"=handles {mem_handle.hex()} {event_handle.hex()}")
        for line in sys.stdin:
            command = line.split()
            if command[0] == "quit":
                break
            k = int(command[1])
            threads = 256
            ctx.launch("fill_f32", N // threads, threads, [x, float(k), N])
            ctx.launch("fill_f32", N // threads, threads, [y, 1.0, N])
            ctx.launch("saxpy_f32", N // threads, threads, [ALPHA, x, y, N])
            ready.record()  # on the default stream, after the three kernels: no waiting here
            tell(f"round {k}: queued fill x={k}, fill y=1, saxpy y = {ALPHA:g}*x + y; recorded the event")
            tell(f"=recorded {k}")
        ctx.free(x)
        ctx.free(y)
        tell("freed x and y")
    return 0


# -- a consumer ----------------------------------------------------------------------------------------------
def consumer(pipe_dir: str, name: str, mem_handle: str, event_handle: str, reduce: bool) -> int:
    ok = True
    with mpsd_client.connect(pipe_dir) as ctx:
        y = ctx.ipc_open_mem_handle(bytes.fromhex(mem_handle))
        ready = ctx.ipc_open_event_handle(bytes.fromhex(event_handle))
        view = y.host_view()
        values = np.frombuffer(view, np.float32)  # the daemon's memory itself: no copy, ever
        out = ctx.malloc(4) if reduce else None
        tell(f"opened the buffer as {y!r} and the event; numpy array over host_view(): {values.shape[0]:,} floats")
        tell("=ready")
        for line in sys.stdin:
            command = line.split()
            if command[0] == "quit":
                break
            k = int(command[1])
            want = np.float32(ALPHA * k + 1.0)
            ready.synchronize()  # the producer's kernels of round k have completed
            bad = np.flatnonzero(values != want)
            if bad.size:
                ok = False
                tell(f"round {k}: MISMATCH: {bad.size:,} of {N:,} floats differ from {want:g}, "
                     f"first at [{bad[0]}] = {values[bad[0]]:g}")
            else:
                tell(f"round {k}: event completed; all {N:,} floats read in place are {want:g}")
            if out is not None:
                ctx.launch("reduce_sum_f32", N // 256, 256, [y, out, N])
                ctx.synchronize()
                got = float(np.frombuffer(out.host_view(), np.float32)[0])
                if got != float(want) * N:
                    ok = False
                    tell(f"round {k}: MISMATCH: reduce_sum_f32 on the imported pointer gave {got:,.1f}, "
                         f"want {float(want) * N:,.1f}")
                else:
                    tell(f"round {k}: reduce_sum_f32 on the imported pointer: {got:,.0f} = {N:,} x {want:g}")
            tell(f"=checked {k}")
        del values            # numpy holds the view; release both before closing, so the mapping can go
        view.release()
        ctx.ipc_close_mem_handle(y)
        tell("closed the IPC handle")
    return 0 if ok else 1


# -- the script that runs them -------------------------------------------------------------------------------
class Child:
    """A child process whose stdout lines arrive on a queue, so that we can wait for one with a deadline."""

    def __init__(self, name: str, args: list[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(HERE), *args], text=True, bufsize=1,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str) -> list[str]:
        """Print the child's log until its `=word ...` line, and return that line's fields."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise RuntimeError(f"{self.name} said no '={word}' within {TIMEOUT:.0f} s") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited (status {self.proc.wait()}) before '={word}'")
            if line.startswith("="):
                fields = line[1:].split()
                if fields[0] != word:
                    raise RuntimeError(f"{self.name} said {line!r}, expected '={word}'")
                return fields[1:]
            print(f"  {self.name:<10} | {line}")

    def finish(self) -> int:
        """Close its stdin, print the rest of its log, and return its exit status."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            while (line := self.lines.get(timeout=TIMEOUT)) is not None:
                print(f"  {self.name:<10} | {line}")
            return self.proc.wait(timeout=TIMEOUT)
        except (queue.Empty, subprocess.TimeoutExpired):
            raise RuntimeError(f"{self.name} did not exit within {TIMEOUT:.0f} s") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_daemon(pipe_dir: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "mpsd", "--pipe-dir", str(pipe_dir), "--time-scale", str(TIME_SCALE)]
    print("$ " + " ".join(["python"] + cmd[1:]))
    daemon = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    assert daemon.stderr is not None
    for line in daemon.stderr:  # it says when it is ready; nothing to poll
        if line.startswith("mpsd: ready on"):
            print("  " + line.rstrip())
            # Keep draining its stderr so that it never blocks on a full pipe.
            threading.Thread(target=lambda: [sys.stderr.write("  [daemon] " + x) for x in daemon.stderr],
                             daemon=True).start()
            return daemon
        sys.stderr.write("  [daemon] " + line)
    raise RuntimeError(f"the daemon exited before it was ready (status {daemon.wait()})")


def run() -> int:
    started = time.monotonic()
    print(f"CUDA IPC through mpsd: a producer and two consumers share one {4 * N // (1 << 20)} MiB device buffer "
          f"for {ROUNDS} rounds.\n")
    pipe_dir = Path(tempfile.mkdtemp(prefix="mpsd-ipc-", dir="/tmp"))  # socket paths: at most 107 bytes
    daemon = None
    children: list[Child] = []
    ok = True
    try:
        daemon = start_daemon(pipe_dir)
        print("\nThe producer allocates and exports:")
        producer_ = Child("producer", ["producer", str(pipe_dir)])
        children.append(producer_)
        mem_handle, event_handle = producer_.expect("handles")

        print("\nTwo consumers open the handles (passed to them as hex on their command lines):")
        consumers = [Child("consumer-a", ["consumer", str(pipe_dir), "a", mem_handle, event_handle]),
                     Child("consumer-b", ["consumer", str(pipe_dir), "b", mem_handle, event_handle, "--reduce"])]
        children += consumers
        for c in consumers:
            c.expect("ready")

        for k in range(1, ROUNDS + 1):
            print(f"\nRound {k}:")
            producer_.send(f"round {k}")
            producer_.expect("recorded")
            for c in consumers:  # the GPU may still be running the producer's kernels: the event tells
                c.send(f"round {k}")
            for c in consumers:
                c.expect("checked")

        print("\nShutting down:")
        for child in children[::-1]:  # the importers close first, then the exporter frees
            child.send("quit")
            status = child.finish()
            if status != 0:
                ok = False
                print(f"  {child.name} exited with status {status}")
    except RuntimeError as exc:
        ok = False
        print(f"ipc_pipeline: {exc}", file=sys.stderr)
    finally:
        for child in children:
            child.kill()
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            try:
                status = daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                status = daemon.wait()
            print(f"  stopped the daemon with SIGTERM: exit status {status}")
            ok = ok and status == 0
        shutil.rmtree(pipe_dir, ignore_errors=True)

    print(f"\n{'OK' if ok else 'FAILED'} ({time.monotonic() - started:.1f} s)")
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    if len(argv) == 1:
        return run()
    if argv[1] == "producer" and len(argv) == 3:
        return producer(argv[2])
    if argv[1] == "consumer" and len(argv) in (6, 7) and argv[6:] in ([], ["--reduce"]):
        return consumer(argv[2], argv[3], argv[4], argv[5], reduce=len(argv) == 7)
    print(f"usage: {argv[0]} [producer PIPE_DIR | consumer PIPE_DIR NAME MEM_HANDLE EVENT_HANDLE [--reduce]]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
