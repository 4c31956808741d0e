# Where the daemon's sockets and logs are, read the way MPS reads it, by the daemon, its tools and its clients
# alike: CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY (MPSD_PIPE_DIRECTORY and MPSD_LOG_DIRECTORY are
# aliases, for setups written for mpsd before it read MPS's names), then MPS's defaults. A client never looks
# anywhere but the one directory these name: a wrong directory is an error naming it, never another daemon.
"""The pipe and log directories."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

__all__ = ["DEFAULT_LOG_DIRECTORY", "DEFAULT_PIPE_DIRECTORY", "LOG_VARIABLES", "PIPE_VARIABLES", "log_directory",
           "pipe_directory"]

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # as MPS
DEFAULT_LOG_DIRECTORY = "/var/log/nvidia-mps"  # as MPS
PIPE_VARIABLES = ("CUDA_MPS_PIPE_DIRECTORY", "MPSD_PIPE_DIRECTORY")  # the first that is set wins
LOG_VARIABLES = ("CUDA_MPS_LOG_DIRECTORY", "MPSD_LOG_DIRECTORY")


def _first(variables: tuple[str, ...], environ: Mapping[str, str]) -> str | None:
    return next((environ[name] for name in variables if environ.get(name)), None)


def pipe_directory(option: str | os.PathLike[str] | None = None, environ: Mapping[str, str] = os.environ) -> Path:
    """The pipe directory: an explicit `option`, else CUDA_MPS_PIPE_DIRECTORY (or its alias), else MPS's."""
    return Path(option or _first(PIPE_VARIABLES, environ) or DEFAULT_PIPE_DIRECTORY)


def log_directory(option: str | os.PathLike[str] | None, pipe_dir: Path,
                  environ: Mapping[str, str] = os.environ) -> tuple[Path, bool]:
    """The log directory, and whether it is MPS's default (which a daemon that cannot write there leaves for
    the pipe directory). An explicit `option` or CUDA_MPS_LOG_DIRECTORY (or its alias) first; then, when the
    pipe directory was named, that directory, so that one daemon's files stay together (MPS would still log to
    its default); else MPS's default."""
    named = option or _first(LOG_VARIABLES, environ)
    if named:
        return Path(named), False
    if pipe_dir != Path(DEFAULT_PIPE_DIRECTORY):
        return pipe_dir, False
    return Path(DEFAULT_LOG_DIRECTORY), True
