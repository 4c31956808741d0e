# mpsd-smi speaks nvidia-smi where scripts parse it (issue 16, item 5 in part): -L, --query-gpu= and
# --query-compute-apps= with --format=csv[,noheader][,nounits], in the shapes an H200's nvidia-smi printed on the
# H200 machine; an unknown field is nvidia-smi's error and its exit status 2. A real daemon, a real client.
from __future__ import annotations

import os
import subprocess
import sys

import psutil

import mpsd_client
from daemons import start_daemon
from mpsd.sim import H200

MiB = 1 << 20


def _smi(daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mpsd.tools.smi", "--pipe-dir", str(daemon.pipe_dir), *args],
                          capture_output=True, text=True, timeout=30, env=dict(os.environ))


def test_nvidia_smi_lists_and_queries(daemon_factory):
    daemon = start_daemon("--time-scale", "100", "--devices", "h200:2")
    daemon_factory.append(daemon)
    with mpsd_client.connect(daemon.pipe_dir, device=1) as ctx:
        ctx.malloc(256 << 20)
        uuid = ctx.device_properties()["uuid"]
        listed = _smi(daemon, "-L").stdout.splitlines()
        assert listed[1] == f"GPU 1: NVIDIA H200 (UUID: {uuid})"
        assert listed[0].startswith("GPU 0: NVIDIA H200 (UUID: GPU-")
        gpus = _smi(daemon, "--query-gpu=index,name,memory.total,memory.used,utilization.gpu", "--format=csv")
        lines = gpus.stdout.splitlines()
        assert lines[0] == "index, name, memory.total [MiB], memory.used [MiB], utilization.gpu [%]"
        assert lines[2].startswith("1, NVIDIA H200, 143156 MiB, ") and lines[2].endswith(" %")
        used = [int(line.split(", ")[3].split()[0]) for line in lines[1:]]
        # the MPS server's memory on each; on device 1 also the client's context and its allocation
        assert used == [round(H200.server_memory / MiB),
                        round((H200.server_memory + H200.context_memory + (256 << 20)) / MiB)]
        bare = _smi(daemon, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits").stdout
        assert bare.splitlines() == ["0, 143156", "1, 143156"]
        apps = _smi(daemon, "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv")
        assert apps.stdout.splitlines() == ["pid, process_name, used_gpu_memory [MiB], gpu_uuid",
                                            f"{os.getpid()}, {psutil.Process().name()}, 256 MiB, {uuid}"]
    wrong = _smi(daemon, "--query-gpu=bogus")
    assert wrong.returncode == 2 and wrong.stderr.strip() == 'Field "bogus" is not a valid field to query.'
