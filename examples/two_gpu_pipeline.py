"""A two-GPU pipeline through mpsd (the seed's section 5.3): preprocessing on GPU 0, inference on GPU 1.

    .venv/bin/python examples/two_gpu_pipeline.py [--peer-access all|none]

It starts `python -m mpsd --devices h200:2` on a private pipe directory, then two worker processes:
  - the producer, on GPU 0, turns each batch's raw input into features (fill_f32, then saxpy_f32: x = 2k + 1)
    in a buffer it exports with ``ipc_get_mem_handle``;
  - the consumer, on GPU 1, opens that handle. Where the devices are peers (``--peer-access all``, the default:
    simulated H200s are NVLink peers, as on an HGX board) the buffer maps into its context and its kernels
    read device 0's memory in place. Where they are not (``--peer-access none``), opening the handle is
    cudaErrorPeerAccessUnsupported, and the batch is staged instead: the producer copies it to the host, and
    the consumer copies it into a buffer of its own on GPU 1.
  The consumer's "inference" is reduce_sum_f32 over the features, checked against the expected sum.
At the end each prints its statistics: ``memory_imported_peer`` says a peer mapping happened, ``bytes_copied``
what was staged. Exit status 0 if every batch checked.
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

N = 1 << 18  # floats per batch: 1 MiB
BATCHES = 4
THREADS = 256


def producer(pipe_dir: str) -> int:
    """GPU 0: make each batch's features, then say where they are (a handle, or the bytes themselves)."""
    with mpsd_client.connect(pipe_dir, device=0) as ctx:
        features = ctx.malloc(4 * N)
        print(f"=handle {ctx.ipc_get_mem_handle(features).hex()}", flush=True)
        for line in sys.stdin:
            command = line.split()
            if command[0] == "quit":
                break
            k = int(command[1])
            ctx.launch("fill_f32", N // THREADS, THREADS, [features, 1.0, N])
            ctx.launch("saxpy_f32", N // THREADS, THREADS, [2.0 * k, _ones(ctx), features, N])
            ctx.synchronize()
            if command[0] == "stage":  # no peer access: the batch goes through the host
                host = np.empty(N, np.float32)
                ctx.memcpy_dtoh(host, features)
                print(f"=bytes {host.tobytes().hex()}", flush=True)
            else:
                print("=ready", flush=True)
        print(f"=stats {_summary(ctx.statistics())}", flush=True)
    return 0


_ONES: dict[int, int] = {}


def _ones(ctx: mpsd_client.Context) -> int:
    """A device buffer of ones, made once."""
    if ctx.client_id not in _ONES:
        ones = _ONES[ctx.client_id] = ctx.malloc(4 * N)
        ctx.launch("fill_f32", N // THREADS, THREADS, [ones, 1.0, N])
    return _ONES[ctx.client_id]


def _summary(stats: dict) -> str:
    return (f"memory_imported_peer={stats['memory_imported_peer']} bytes_copied={stats['bytes_copied']} "
            f"launches={stats['launches']}")


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
                               "--devices", "h200:2", "--peer-access", options.peer_access],
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
                features = ctx.ipc_open_mem_handle(handle)
                print("consumer on GPU 1: mapped GPU 0's feature buffer over peer access")
                staged = False
            except mpsd_client.PeerAccessUnsupportedError as exc:
                print(f"consumer on GPU 1: {exc.name}: staging each batch through the host instead")
                features, staged = ctx.malloc(4 * N), True
            total = ctx.malloc(4)
            ok = True
            for k in range(BATCHES):
                worker.stdin.write(f"{'stage' if staged else 'make'} {k}\n")
                worker.stdin.flush()
                reply = worker.stdout.readline().split()
                if staged:
                    ctx.memcpy_htod(features, np.frombuffer(bytes.fromhex(reply[1]), np.float32))
                ctx.memset(total, 0, 4)
                ctx.launch("reduce_sum_f32", 1, 1024, [features, total, N])
                out = np.empty(1, np.float32)
                ctx.memcpy_dtoh(out, total)
                expected = (2.0 * k + 1.0) * N
                ok &= bool(out[0] == expected)
                print(f"batch {k}: inference on GPU 1 summed {out[0]:.0f} (expected {expected:.0f})")
            print(f"consumer: {_summary(ctx.statistics())}")
            if not staged:
                ctx.ipc_close_mem_handle(features)
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
