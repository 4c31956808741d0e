# Fixtures: a daemon per test (a real `python -m mpsd` process on a private pipe directory) and a context on it.
from __future__ import annotations

import shutil
from typing import Iterator

import pytest

from daemons import DaemonProcess, start_daemon


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
