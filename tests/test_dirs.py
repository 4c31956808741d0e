# The pipe and log directories are found as MPS finds them (issue 16, item 2): CUDA_MPS_PIPE_DIRECTORY and
# CUDA_MPS_LOG_DIRECTORY, MPSD_* as aliases, then MPS's defaults; by the daemon, its tools and its clients alike,
# and a client told a directory where no daemon listens fails naming it instead of finding another daemon.
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemons import DaemonProcess, run_worker, short_tempdir
from mpsd_protocol import log_directory, pipe_directory


def test_the_names_in_their_order():
    assert pipe_directory(None, {}) == Path("/tmp/nvidia-mps")
    assert pipe_directory(None, {"MPSD_PIPE_DIRECTORY": "/a"}) == Path("/a")
    assert pipe_directory(None, {"MPSD_PIPE_DIRECTORY": "/a", "CUDA_MPS_PIPE_DIRECTORY": "/b"}) == Path("/b")
    assert pipe_directory("/c", {"CUDA_MPS_PIPE_DIRECTORY": "/b"}) == Path("/c")
    assert log_directory(None, Path("/tmp/nvidia-mps"), {}) == (Path("/var/log/nvidia-mps"), True)
    assert log_directory(None, Path("/p"), {}) == (Path("/p"), False)  # a named pipe dir keeps its logs
    assert log_directory(None, Path("/p"), {"MPSD_LOG_DIRECTORY": "/l"}) == (Path("/l"), False)
    assert log_directory("/o", Path("/p"), {"CUDA_MPS_LOG_DIRECTORY": "/l"}) == (Path("/o"), False)


@pytest.fixture
def env_daemon(daemon_factory):
    """A daemon told where to be by CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY alone, as the device
    plugin starts one per resource."""
    root = short_tempdir()
    pipe_dir, log_dir = root / "pipe", root / "log"
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(log_dir)}
    env.pop("MPSD_PIPE_DIRECTORY", None)
    proc = subprocess.Popen([sys.executable, "-m", "mpsd", "--time-scale", "100"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert line.startswith("mpsd: ready on " + str(pipe_dir)), line
    daemon = DaemonProcess(proc, pipe_dir, log_dir)
    daemon_factory.append(daemon)
    return daemon


def test_a_daemon_clients_and_tools_find_each_other_by_mps_names(env_daemon):
    assert (env_daemon.log_dir / "control.log").exists() and not (env_daemon.pipe_dir / "control.log").exists()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(env_daemon.pipe_dir), "MPSD_PIPE_DIRECTORY": "/nonexistent"}
    result = run_worker("import mpsd_client; print(mpsd_client.connect().mem_get_info()[1])", Path("/nowhere"),
                        env=env)
    assert result.returncode == 0 and int(result.stdout) > 100e9, result.stderr
    smi = subprocess.run([sys.executable, "-m", "mpsd.tools.smi", "--json"], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=30)
    assert smi.returncode == 0 and '"devices"' in smi.stdout, smi.stderr


def test_a_directory_with_no_daemon_is_an_error_naming_it_never_another_daemon(daemon: DaemonProcess, tmp_path):
    """With a daemon running elsewhere (and MPSD_PIPE_DIRECTORY naming it), a client given an empty
    CUDA_MPS_PIPE_DIRECTORY fails: it connected to the other daemon before."""
    empty = tmp_path / "empty"
    empty.mkdir()
    code = """
import mpsd_client
from mpsd_protocol import MpsConnectionError
try:
    mpsd_client.connect()
except MpsConnectionError as exc:
    print(exc.name, exc.detail)
"""
    result = run_worker(code, daemon.pipe_dir, env={"CUDA_MPS_PIPE_DIRECTORY": str(empty),
                                                    "MPSD_PIPE_DIRECTORY": str(daemon.pipe_dir)})
    assert result.stdout.startswith("cudaErrorMpsConnectionFailed") and str(empty) in result.stdout, result.stderr


def test_the_pid_file_and_mps_names():
    """Launch scripts wait for nvidia-cuda-mps-control.pid in the pipe directory and look for the daemon by
    name: with --mps-names (which the nvidia-cuda-mps-control command gives) pgrep and pidof find it."""
    import shutil

    from daemons import start_daemon

    daemon = start_daemon("--time-scale", "100", "--mps-names")
    try:
        pid_file = daemon.pipe_dir / "nvidia-cuda-mps-control.pid"
        assert pid_file.read_text() == f"{daemon.proc.pid}\n" and pid_file.stat().st_mode & 0o777 == 0o644
        cmdline = Path(f"/proc/{daemon.proc.pid}/cmdline").read_bytes()
        assert cmdline.split(b"\0")[0] == b"nvidia-cuda-mps-control"
        assert Path(f"/proc/{daemon.proc.pid}/comm").read_text().strip() == "nvidia-cuda-mps"  # 15 characters
        found = subprocess.run(["pgrep", "-f", "^nvidia-cuda-mps-control"], capture_output=True, text=True)
        assert str(daemon.proc.pid) in found.stdout.split()
    finally:
        assert daemon.stop() == 0
    assert not pid_file.exists()
    shutil.rmtree(daemon.pipe_dir.parent, ignore_errors=True)
