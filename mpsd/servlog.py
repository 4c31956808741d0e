# The logs MPS operators already read: control.log and server.log in $MPSD_LOG_DIRECTORY, one line per event,
# `[YYYY-MM-DD HH:MM:SS.mmm Control   PID] text` and `[... Server   PID] text`, as nvidia-cuda-mps-control
# writes them. Lines are written whole and flushed, so a tail -f or a test sees them at once. The directory must
# be the daemon's own and the files are never opened through a symlink (mpsd.ownership): the daemon runs as
# root, and a log planted as a link would have it append to any file on the system.
from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import TextIO

from mpsd.ownership import UnsafePathError, open_log, private_directory


def log_line(source: str, pid: int, text: str, now: datetime.datetime | None = None) -> str:
    """One log line in the MPS format (without the newline)."""
    now = now or datetime.datetime.now()
    stamp = now.strftime("%Y-%m-%d %H:%M:%S.") + f"{now.microsecond // 1000:03d}"
    return f"[{stamp} {source:<9} {pid}] {text}"


class ServerLog:
    """control.log and server.log of one daemon.

    Args:
        directory: where they go (created 0700 if missing); None: nowhere.

    Raises:
        UnsafePathError: the directory or a log file in it is not safely the daemon's own.
        OSError: they cannot be created or opened.
    """

    def __init__(self, directory: Path | None) -> None:
        self.pid = os.getpid()
        self._files: dict[str, TextIO] = {}
        if directory is None:
            return
        private_directory(directory, "log directory")
        try:
            for name in ("control", "server"):
                self._files[name] = open_log(directory / f"{name}.log")
        except UnsafePathError as exc:
            self.close()
            raise UnsafePathError(f"cannot write logs in {directory}: {exc}") from None
        except OSError:
            self.close()
            raise

    def _write(self, name: str, source: str, text: str) -> None:
        handle = self._files.get(name)
        if handle is not None:
            handle.write(log_line(source, self.pid, text) + "\n")

    def control(self, text: str) -> None:
        self._write("control", "Control", text)

    def server(self, text: str) -> None:
        self._write("server", "Server", text)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
