# One private MPS control daemon for a measurement script: its own pipe and log directories, so it neither
# meets nor disturbs any other MPS on the machine, and the tail of its logs kept with the results.
"""A private nvidia-cuda-mps-control daemon, as a context manager."""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator


@contextlib.contextmanager
def private_mps(logs: dict[str, list[str]], tail: int = 40) -> Iterator[dict[str, str]]:
    """Start ``nvidia-cuda-mps-control -d`` on fresh directories; yield the environment its clients need.

    On exit it is told to quit, and the last ``tail`` lines of its control.log and server.log go into ``logs``
    (under "control" and "server"; an unreadable log gives its error instead).
    """
    base = tempfile.mkdtemp(prefix="mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": f"{base}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{base}/log"}
    for path in env.values():
        os.makedirs(path)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **env}, check=True)
    try:
        yield env
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env={**os.environ, **env},
                       check=False)
        time.sleep(1)  # the server writes its last lines as it exits
        for name in ("control", "server"):
            try:
                with open(f"{base}/log/{name}.log") as f:
                    logs[name] = f.read().splitlines()[-tail:]
            except OSError as exc:
                logs[name] = [repr(exc)]
