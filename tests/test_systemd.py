# The service unit is accepted by systemd as it stands, and the daemon speaks sd_notify to whoever listens on
# NOTIFY_SOCKET: READY=1 once it accepts clients, STOPPING=1 when SIGTERM starts its shutdown.
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from daemons import short_tempdir, start_daemon

UNIT = Path(__file__).parent.parent / "systemd" / "mpsd.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_service_unit_verifies_without_a_word(tmp_path):
    """systemd-analyze verify accepts the unit with nothing on stderr (it exits 0 even on typos)."""
    mpsd = Path(sys.executable).with_name("mpsd")  # the venv's entry point stands in for /usr/local/bin/mpsd
    unit = tmp_path / "mpsd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/mpsd", str(mpsd)))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""


def test_daemon_notifies_ready_and_stopping(daemon_factory):
    """With NOTIFY_SOCKET set, the daemon sends READY=1 when listening and STOPPING=1 on SIGTERM."""
    path = short_tempdir() / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(20)
    d = start_daemon(env={"NOTIFY_SOCKET": str(path)})
    assert listener.recv(4096).decode().splitlines()[0] == "READY=1"
    assert d.stop() == 0
    assert listener.recv(4096).decode() == "STOPPING=1"
    listener.close()
    shutil.rmtree(path.parent)
    shutil.rmtree(d.pipe_dir.parent)


def test_watchdog_and_status_notifications(daemon_factory):
    """With WATCHDOG_USEC set the daemon pings WATCHDOG=1; STATUS= reports the number of clients."""
    import mpsd_client

    path = short_tempdir() / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(20)
    d = start_daemon(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})
    seen = set()
    with mpsd_client.connect(d.pipe_dir):
        while not {"WATCHDOG=1", "STATUS=1 clients"} <= seen:
            seen.update(listener.recv(4096).decode().splitlines())
    assert d.stop() == 0
    listener.close()
    shutil.rmtree(path.parent)
    shutil.rmtree(d.pipe_dir.parent)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_service_is_sandboxed_to_an_exposure_of_two_or_less(tmp_path):
    """systemd-analyze security rates the unit as shipped at 2.0 or below ("OK"): its --threshold is in tenths."""
    unit = tmp_path / "mpsd.service"
    unit.write_text(UNIT.read_text())
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=20", str(unit)],
                            capture_output=True, text=True, timeout=60)
    level = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, level
    assert "Overall exposure level for mpsd.service: " in level and float(level.split(": ")[1].split()[0]) <= 2.0
