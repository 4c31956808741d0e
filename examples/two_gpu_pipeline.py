"""A two-GPU pipeline through mpsd (the seed's section 5.3): preprocessing on GPU 0, inference on GPU 1.

    .venv/bin/python examples/two_gpu_pipeline.py [--peer-access all|none]

It starts `python -m mpsd --devices h200:2 --clock virtual` on a private pipe directory (simulated time moves as
the clients' calls allow, so the figures are the model's whatever this host's load), then two worker processes:
  - the producer, on GPU 0, turns each batch's raw input into features (fill_f32, then saxpy_f32: x = 2k + 1)
    in a buffer it exports with ``ipc_get_mem_handle``;
  - the consumer, on GPU 1, opens that handle. Where the devices are peers (``--peer-access all``, the default:
    simulated H200s are NVLink peers, as on an HGX board) the buffer maps into its context, and it copies each
    batch into memory of its own on GPU 1 with memcpy_dtod from the mapping: a copy over NVLink. Where they are
    not (``--peer-access none``), opening the handle is cudaErrorPeerAccessUnsupported, and the batch is staged
    instead: the producer copies it into pinned host memory, the bytes come over a pipe, and the consumer
    copies them into GPU 1 from pinned memory of its own, each leg over its GPU's PCIe link.
  The consumer's "inference" is reduce_sum_f32 over its copy of the features, checked against the expected sum.
Each device leg of a transfer is timed with CUDA events on the simulated device (a spin kernel ahead of it keeps
the host calls' own time out of the figure), and printed with the bandwidth it reached. At the end each side prints
its statistics: ``peer_copies_nvlink`` and ``memory_imported_peer`` say a peer mapping and copy happened,
``bytes_copied`` what was staged. Exit status 0 if every batch checked.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import mpsd_client

N = 1 << 22  # floats per batch: 16 MiB
BATCHES = 4
THREADS = 256
AHEAD = 19_800_000  # spin cycles ahead of a timed copy: 10 ms at the H200's 1.98 GHz, longer than a host call


def producer(pipe_dir: str) -> int:
    """GPU 0: make each batch's features, then say where they are (a handle, or the bytes themselves)."""
    with mpsd_client.connect(pipe_dir, device=0) as ctx:
        features, ones = ctx.malloc(4 * N), ctx.malloc(4 * N)
        ctx.launch("fill_f32", N // THREADS, THREADS, [ones, 1.0, N])
        print(f"=handle {ctx.ipc_get_mem_handle(features).hex()}", flush=True)
        pinned = None
        while True:
            with ctx.idle():  # waiting on the pipe, outside mpsd: the virtual clock need not wait for this client
                command = sys.stdin.readline().split()
            if not command or command[0] == "quit":
                break
            k = int(command[1])
            ctx.launch("fill_f32", N // THREADS, THREADS, [features, 1.0, N])
            ctx.launch("saxpy_f32", N // THREADS, THREADS, [2.0 * k, ones, features, N])
            ctx.synchronize()
            if command[0] == "stage":  # no peer access: the batch goes through the host
                pinned = pinned if pinned is not None else ctx.host_alloc(4 * N)
                ms = _timed(ctx, lambda stream: ctx.memcpy_dtoh(pinned, features, stream=stream))
                print(f"=bytes {ms!r} {bytes(pinned).hex()}", flush=True)
            else:
                print("=ready", flush=True)
        print(f"=stats {_summary(ctx.statistics())}", flush=True)
    return 0


def _timed(ctx: mpsd_client.Context, copy) -> float:
    """The simulated milliseconds of the copy `copy(stream)` queues, between two events on that stream."""
    stream = ctx.create_stream()
    start, end = ctx.create_event(), ctx.create_event()
    ctx.launch("spin", 1, 32, [AHEAD], stream=stream)  # the device is busy while the host makes the calls below
    start.record(stream)
    copy(stream)
    end.record(stream)
    end.synchronize()
    stream.destroy()
    return start.elapsed_ms(end)


def _rate(ms: float) -> str:
    return f"{4 * N / 2**20:.0f} MiB in {ms:.4f} ms ({4 * N / (ms / 1e3) / 1e9:.1f} GB/s)"


def _summary(stats: dict) -> str:
    return (f"memory_imported_peer={stats['memory_imported_peer']} peer_copies_nvlink={stats['peer_copies_nvlink']} "
            f"bytes_copied={stats['bytes_copied']} launches={stats['launches']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer-access", choices=("all", "none"), default="all")
    parser.add_argument("role", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("pipe_dir", nargs="?", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.role == "producer":
        return producer(options.pipe_dir)
    root = Path(tempfile.mkdtemp(prefix="mpsd-2gpu-"))
    pipe = root / "pipe"
    daemon = subprocess.Popen([sys.executable, "-m", "mpsd", "--pipe-dir", str(pipe), "--log-dir", str(root / "log"),
                               "--devices", "h200:2", "--peer-access", options.peer_access, "--clock", "virtual"],
                              stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        assert daemon.stderr is not None and daemon.stderr.readline().startswith("mpsd: ready")
        worker = subprocess.Popen([sys.executable, __file__, "producer", str(pipe)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert worker.stdin is not None and worker.stdout is not None
        handle = bytes.fromhex(worker.stdout.readline().split()[1])
        with mpsd_client.connect(pipe, device=1) as ctx:
            try:
                mapped = ctx.ipc_open_mem_handle(handle)
                print("consumer on GPU 1: mapped GPU 0's feature buffer over peer access")
                staged = False
            except mpsd_client.PeerAccessUnsupportedError as exc:
                print(f"consumer on GPU 1: {exc.name}: staging each batch through the host instead")
                mapped, staged, pinned = None, True, ctx.host_alloc(4 * N)
            features, total = ctx.malloc(4 * N), ctx.malloc(4)
            ok = True
            for k in range(BATCHES):
                worker.stdin.write(f"{'stage' if staged else 'make'} {k}\n")
                worker.stdin.flush()
                with ctx.idle():
                    reply = worker.stdout.readline().split()
                if staged:
                    d2h = float(reply[1])
                    pinned[:] = bytes.fromhex(reply[2])
                    h2d = _timed(ctx, lambda stream: ctx.memcpy_htod(features, pinned, stream=stream))
                    moved = (f"staged: GPU 0 to host {_rate(d2h)}, host to GPU 1 {_rate(h2d)}; "
                             f"both legs {_rate(d2h + h2d)}")
                else:
                    ms = _timed(ctx, lambda stream: ctx.memcpy_dtod(features, mapped, 4 * N, stream=stream))
                    moved = f"over NVLink {_rate(ms)}"
                ctx.memset(total, 0, 4)
                ctx.launch("reduce_sum_f32", 1, 1024, [features, total, N])
                out = np.empty(1, np.float32)
                ctx.memcpy_dtoh(out, total)
                expected = (2.0 * k + 1.0) * N
                ok &= bool(out[0] == expected)
                print(f"batch {k}: {moved}; inference on GPU 1 summed {out[0]:.0f} (expected {expected:.0f})")
            print(f"consumer: {_summary(ctx.statistics())}")
            if mapped is not None:
                ctx.ipc_close_mem_handle(mapped)
        worker.stdin.write("quit\n")
        worker.stdin.flush()
        print(f"producer: {worker.stdout.readline().split(' ', 1)[1].strip()}")
        ok &= worker.wait(30) == 0
        return 0 if ok else 1
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
