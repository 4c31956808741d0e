# Fixtures of the two tiers. Real processes: a daemon per test (a real `python -m mpsd` process on a private
# pipe directory) and a blocking context on it. In-process: the daemon inside the test's trio loop and a trio
# context on it (tests/inproc.py), for everything that needs no process of its own.
from __future__ import annotations

import os

# One BLAS thread in the tests and every process they start: pytest-xdist runs a worker per core already, and
# a daemon's numpy references (a module's matmul) spinning a thread per core beside them only fight for it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import shutil
from typing import AsyncIterator, Iterator

import pytest

from daemons import DaemonProcess, start_daemon
from inproc import InProcessDaemon, in_process_daemon
from mpsd_client import AsyncContext


@pytest.fixture
def daemon_factory() -> Iterator[list[DaemonProcess]]:
    """Start daemons with `start_daemon`; each is stopped (and must exit 0) after the test."""
    started: list[DaemonProcess] = []
    yield started
    for d in started:
        code = d.stop()
        assert code == 0, f"daemon exited {code}: {d.stderr_lines}"
        shutil.rmtree(d.pipe_dir.parent, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory: list[DaemonProcess]) -> DaemonProcess:
    """One daemon, simulated time running 100x faster than the wall clock so kernels finish quickly."""
    d = start_daemon("--time-scale", "100")
    daemon_factory.append(d)
    return d


@pytest.fixture(scope="module")
def module_daemon() -> Iterator[DaemonProcess]:
    """One daemon, as `daemon`'s, shared by a module's cases that leave nothing on it: each connects (or is
    refused, or breaks its own connection) and asks nothing of what other clients hold. It must exit 0 after
    the module's last case, as `daemon_factory`'s must after each test."""
    d = start_daemon("--time-scale", "100")
    yield d
    code = d.stop()
    assert code == 0, f"daemon exited {code}: {d.stderr_lines}"
    shutil.rmtree(d.pipe_dir.parent, ignore_errors=True)


@pytest.fixture
def realtime_daemon(daemon_factory: list[DaemonProcess]) -> DaemonProcess:
    """One daemon whose simulated time runs at wall-clock speed (for timing semantics)."""
    d = start_daemon("--time-scale", "1")
    daemon_factory.append(d)
    return d


@pytest.fixture
def ctx(daemon: DaemonProcess):
    import mpsd_client

    with mpsd_client.connect(daemon.pipe_dir) as context:
        yield context


# The in-process tier (tests/inproc.py): the daemon in the test's trio loop, a trio client on it. A test that
# also takes `autojump_clock` waits for simulated work in no wall time.
@pytest.fixture
async def served() -> AsyncIterator[InProcessDaemon]:
    """A daemon in this trio loop, simulated time 100x the (possibly mock) clock, as the `daemon` fixture's."""
    async with in_process_daemon("--time-scale", "100") as d:
        yield d


@pytest.fixture
async def actx(served: InProcessDaemon) -> AsyncIterator[AsyncContext]:
    async with served.connect() as context:
        yield context
