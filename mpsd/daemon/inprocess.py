# The daemon as a guest in someone else's trio loop: `mpsd-stress --virtual-time` plays its tenants as tasks
# beside it, and the in-process test tier drives it with trio clients, under trio's MockClock where a test
# allows. It is the same Daemon and the same sockets as `mpsd` serves; only the loop and the signals belong
# to the caller, so the daemon never installs handlers of its own and stops when the block ends.
"""Serving a daemon inside the calling trio loop."""

from __future__ import annotations

import functools
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio

from mpsd.daemon.config import Config
from mpsd.daemon.server import Daemon

__all__ = ["open_daemon"]


@asynccontextmanager
async def open_daemon(config: Config, *, grace: float | None = None,
                      keep_traces: bool = False) -> AsyncIterator[Daemon]:
    """``async with open_daemon(config) as daemon:`` serves `config` in this trio loop for the block.

    The daemon is listening on ``config.socket_path`` when the block begins; when it ends, the daemon shuts
    down as on SIGTERM (in-flight replies get `grace` seconds, default 5), and the block's exit waits for that.
    With `keep_traces`, what it would write at exit (``--trace``) is left in ``daemon.traces`` instead, by
    device: each device's timeline and what maps it onto the clients (``Backend.timeline``), with no file.

    Raises:
        DaemonError: the logs, the pipe directory or the socket cannot be set up.
    """
    daemon = Daemon(config)
    daemon.keep_traces = keep_traces
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(daemon.serve, handle_signals=False))
        try:
            yield daemon
        finally:
            daemon.stop(grace)
