# An HPC site's MPS enable/disable scripts (tests/data/hpc_scripts, of the shape ALCF's Polaris documents:
# export CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY, `nvidia-cuda-mps-control -d`, and at the end
# `echo quit | nvidia-cuda-mps-control`) run unchanged with mpsd's nvidia-cuda-mps-control on PATH, and a job's
# CUDA process started in between, with only those two variables, connects and runs.
from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from daemons import short_tempdir

BIN = Path(sys.executable).parent
SCRIPTS = Path(__file__).parent / "data" / "hpc_scripts"
CLIENT = """
import mpsd_client
with mpsd_client.connect() as ctx:
    ptr = ctx.malloc(1 << 20)
    ctx.launch("spin", 1, 32, [1000])
    ctx.synchronize()
    print("ran on", ctx.device_properties()["name"])
"""


def test_enable_and_disable_scripts_bracket_a_job():
    """enable starts the daemon (exit 0, the pid file and control.log where the variables say), a client
    with only those variables runs, `ps` shows it while it runs, and disable quits the daemon (exit 0, its
    sockets and pid file gone)."""
    node = short_tempdir()
    tools = node / "bin"
    tools.mkdir()
    (tools / "nvidia-cuda-mps-control").symlink_to(BIN / "nvidia-cuda-mps-control")
    env = {"PATH": f"{tools}:/usr/bin:/bin", "MPS_NODE_DIR": str(node), "HOME": os.environ.get("HOME", "/root")}
    pipe, logs = node / "nvidia-mps", node / "nvidia-log"
    job = {"PATH": env["PATH"], "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        started = subprocess.run(["sh", SCRIPTS / "enable_mps.sh"], env=env, capture_output=True, text=True,
                                 timeout=60)
        assert (started.returncode, started.stdout) == (0, f"MPS started on {socket.gethostname()}\n"), started
        pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
        exited = os.pidfd_open(pid)  # readable once the daemon's process has exited
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "nvidia-cuda-mps"  # the kernel keeps 15 bytes
        ran = subprocess.run([sys.executable, "-c", CLIENT], env=job, capture_output=True, text=True, timeout=60)
        assert (ran.returncode, ran.stdout) == (0, "ran on NVIDIA H200\n"), ran.stderr
        assert "NEW CLIENT" in (logs / "control.log").read_text()
        stopped = subprocess.run(["sh", SCRIPTS / "disable_mps.sh"], env=env, capture_output=True, text=True,
                                 timeout=60)
        assert (stopped.returncode, stopped.stdout) == (0, f"MPS stopped on {socket.gethostname()}\n"), stopped
        assert not (pipe / "control").exists() and not (pipe / "nvidia-cuda-mps-control.pid").exists()
        assert select.select([exited], [], [], 30)[0] == [exited]  # the process follows its sockets out
        os.close(exited)
    finally:
        if (pipe / "control").exists():
            subprocess.run([tools / "nvidia-cuda-mps-control"], input=b"quit", timeout=60,
                           env={"CUDA_MPS_PIPE_DIRECTORY": str(pipe)})
        shutil.rmtree(node, ignore_errors=True)
