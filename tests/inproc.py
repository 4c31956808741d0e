# The in-process tier: the real Daemon served inside the test's own trio loop (mpsd.daemon.inprocess) on a
# private pipe directory, and trio clients (mpsd_client.open_context) on its real Unix socket. Nothing
# starts a process, and a test that takes trio's `autojump_clock` fixture waits for simulated work in no wall
# time at all: the wall-clock engine reads trio's clock, and the mock clock jumps whenever every task,
# the daemon's and the test's, is waiting. What only real processes show (signals, fds between processes,
# systemd, reclaim after SIGKILL, uids, the CLIs' exit codes) stays with tests/daemons.py.
from __future__ import annotations

import dataclasses
import shutil
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import mpsd_client
from daemons import short_tempdir
from mpsd.daemon.config import load_config
from mpsd.daemon.inprocess import open_daemon
from mpsd.daemon.server import Daemon


@dataclass
class InProcessDaemon:
    """A daemon served in this trio loop, and where to find it."""

    daemon: Daemon
    pipe_dir: Path
    log_dir: Path

    def server_log(self) -> str:
        path = self.log_dir / "server.log"
        return path.read_text() if path.exists() else ""

    def connect(self, device: int = 0, **environ: str) -> AbstractAsyncContextManager[mpsd_client.AsyncContext]:
        """A trio client of this daemon; `environ` stands for its process's CUDA_MPS_* environment (nothing
        from the test's own environment leaks in)."""
        return mpsd_client.open_context(self.pipe_dir, device=device, environ=environ)


@asynccontextmanager
async def in_process_daemon(*args: str, shared_process: bool = False) -> AsyncIterator[InProcessDaemon]:
    """Serve a daemon with `mpsd`'s command-line `args` here until the block ends.

    `shared_process`: every client counts as a process of its own for CUDA's same-process rules (IPC), as
    the tenants of `mpsd-stress --virtual-time` do; otherwise they all are this one process, as they are.
    """
    pipe_dir = short_tempdir() / "pipe"
    log_dir = pipe_dir.parent / "log"
    try:
        config = load_config(["--pipe-dir", str(pipe_dir), "--log-dir", str(log_dir), *args], environ={})
        config = dataclasses.replace(config, shared_process=shared_process)
        async with open_daemon(config) as daemon:
            yield InProcessDaemon(daemon, pipe_dir, log_dir)
    finally:
        shutil.rmtree(pipe_dir.parent, ignore_errors=True)
