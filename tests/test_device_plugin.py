# What NVIDIA's k8s-device-plugin (cmd/mps-control-daemon) does with MPS, replayed against mpsd as it does it
# (issue 16, item 4): for each resource, `nvidia-smi -i <uuid> -c EXCLUSIVE_PROCESS`; `nvidia-cuda-mps-control -d`
# run with only CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY in its environment; each setting written to a
# fresh `nvidia-cuda-mps-control`'s stdin without a trailing newline, its exit status checked; `tail -n +1 -f`
# of control.log; `get_default_active_thread_percentage` as the health check; at the end `quit`, the compute mode
# back to DEFAULT and the log directory removed. Two resources, one daemon each in its own directories, and a
# workload "container" per resource that sees only its resource's pipe directory and gets its share.
# nvidia-smi is mpsd-smi under that name (a link, as a user makes one), nvidia-cuda-mps-control our entry point.
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mpsd_client
from daemons import short_tempdir
from mpsd.sim import H200

BIN = Path(sys.executable).parent
MiB = 1 << 20
RESOURCES = {"nvidia.com/gpu": 2, "nvidia.com/gpu.big": 1}  # resource -> replicas per GPU (the plugin's sharing)
UUID = "GPU-5eed0000-0000-4000-8000-00006d707364"  # device 0 of a simulated H200, as every daemon names it


@pytest.fixture
def node(tmp_path):
    """The node: a PATH where nvidia-smi is mpsd-smi, and the plugin's root of per-resource directories."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").symlink_to(BIN / "mpsd-smi")
    (tools / "nvidia-cuda-mps-control").symlink_to(BIN / "nvidia-cuda-mps-control")
    root = short_tempdir() / "mps"
    yield tools, root
    for resource in RESOURCES:  # whatever a failed test left running
        pipe = root / resource / "pipe"
        if (pipe / "control").exists():
            _echo(tools, pipe, root / resource / "log", "quit")
    shutil.rmtree(root.parent, ignore_errors=True)


def _plugin_env(tools: Path) -> dict[str, str]:
    """The plugin's own environment: its PATH, and no CUDA_MPS_* variables."""
    return {"PATH": f"{tools}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/root")}


def _echo(tools: Path, pipe: Path, log: Path, command: str) -> subprocess.CompletedProcess[str]:
    """EchoPipeToControl: a fresh nvidia-cuda-mps-control with only the two variables, the command on its stdin
    with no newline, stdin closed."""
    return subprocess.run([tools / "nvidia-cuda-mps-control"], input=command, capture_output=True, text=True,
                          timeout=60, env={"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)})


def test_the_device_plugins_mps_control_daemon_works_unchanged(node):
    tools, root = node
    tailers = {}
    try:
        for resource, replicas in RESOURCES.items():
            pipe, log = root / resource / "pipe", root / resource / "log"
            mode = subprocess.run(["nvidia-smi", "-i", UUID, "-c", "EXCLUSIVE_PROCESS"], capture_output=True,
                                  text=True, timeout=60, env=_plugin_env(tools))
            # before any daemon runs there is no device to set (mpsd's exist only in its daemon): said, exit 0
            assert mode.returncode == 0 and mode.stdout.startswith("Compute mode not set"), mode.stdout + mode.stderr
            pipe.mkdir(parents=True, mode=0o755)
            log.mkdir(parents=True, mode=0o755)
            started = subprocess.run([tools / "nvidia-cuda-mps-control", "-d"], capture_output=True, text=True,
                                     timeout=60, env={"CUDA_MPS_PIPE_DIRECTORY": str(pipe),
                                                      "CUDA_MPS_LOG_DIRECTORY": str(log)})
            assert started.returncode == 0, started.stderr
            limit = f"{H200.total_memory // replicas // MiB}M"
            for command in (f"set_default_device_pinned_mem_limit 0 {limit}",
                            f"set_default_active_thread_percentage {100 // replicas}"):
                answer = _echo(tools, pipe, log, command)
                assert answer.returncode == 0, answer.stdout + answer.stderr
            (root / resource / ".started").touch()
            tailers[resource] = subprocess.Popen(["tail", "-n", "+1", "-f", str(log / "control.log")],
                                                 stdout=subprocess.PIPE, text=True)
            health = _echo(tools, pipe, log, "get_default_active_thread_percentage")
            assert (health.returncode, health.stdout.strip()) == (0, f"{100 // replicas:.1f}")
        # With its daemon up, a device's mode is set, and shown, as nvidia-smi sets and shows it.
        at = {**_plugin_env(tools), "CUDA_MPS_PIPE_DIRECTORY": str(root / "nvidia.com/gpu" / "pipe")}
        mode = subprocess.run(["nvidia-smi", "-i", UUID, "-c", "3"], capture_output=True, text=True, timeout=60, env=at)
        assert mode.stdout.splitlines()[-1] == "All done."
        shown = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=60, env=at)
        assert shown.stdout.split() == ["Exclusive_Process"]
        # A workload container of each resource: its pipe directory mounted, nothing else of the node's.
        for resource, replicas in RESOURCES.items():
            pipe = root / resource / "pipe"
            with mpsd_client.connect(pipe) as ctx:
                quotas = ctx.quotas
                assert quotas["active_thread_percentage"] == 100 // replicas
                assert quotas["pinned_mem_limit"] == H200.total_memory // replicas // MiB * MiB
                ctx.launch("spin", 264, 1024, [1000])
                ctx.synchronize()
        for resource, tailer in tailers.items():
            log = root / resource / "log"
            deadline = time.monotonic() + 30
            while "set_default_active_thread_percentage" not in (log / "control.log").read_text():
                assert time.monotonic() < deadline
                time.sleep(0.05)
        for resource in RESOURCES:  # Stop()
            pipe, log = root / resource / "pipe", root / resource / "log"
            assert _echo(tools, pipe, log, "quit").returncode == 0
            mode = subprocess.run(["nvidia-smi", "-i", UUID, "-c", "DEFAULT"], capture_output=True, text=True,
                                  timeout=60, env=_plugin_env(tools))
            assert mode.returncode == 0, mode.stdout + mode.stderr
            (root / resource / ".started").unlink()
            shutil.rmtree(log)
            deadline = time.monotonic() + 30
            while (pipe / "control").exists():  # the daemon has gone, and taken its sockets with it
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        for tailer in tailers.values():
            tailer.kill()
            tailer.communicate()
