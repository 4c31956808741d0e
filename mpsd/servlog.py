# The logs MPS operators already read: control.log and server.log in $MPSD_LOG_DIRECTORY, one line per event,
# `[YYYY-MM-DD HH:MM:SS.mmm Control   PID] text` and `[... Server   PID] text`, as nvidia-cuda-mps-control
# writes them. Lines are written whole and flushed, so a tail -f or a test sees them at once.
from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import TextIO


def log_line(source: str, pid: int, text: str, now: datetime.datetime | None = None) -> str:
    """One log line in the MPS format (without the newline)."""
    now = now or datetime.datetime.now()
    stamp = now.strftime("%Y-%m-%d %H:%M:%S.") + f"{now.microsecond // 1000:03d}"
    return f"[{stamp} {source:<9} {pid}] {text}"


class ServerLog:
    """control.log and server.log of one daemon."""

    def __init__(self, directory: Path | None) -> None:
        self.pid = os.getpid()
        self._files: dict[str, TextIO] = {}
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            for name in ("control", "server"):
                self._files[name] = open(directory / f"{name}.log", "a", buffering=1, encoding="utf-8")

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
