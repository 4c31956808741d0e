# The logs MPS operators already read: control.log and server.log in $MPSD_LOG_DIRECTORY, one line per event,
# `[YYYY-MM-DD HH:MM:SS.mmm Control   PID] text` and `[... Server   PID] text`, as nvidia-cuda-mps-control
# writes them. Lines are written whole and flushed, so a tail -f or a test sees them at once. The directory must
# be the daemon's own and the files are never opened through a symlink (mpsd.daemon.ownership): the daemon runs as
# root, and a log planted as a link would have it append to any file on the system.
#
# Clients put text in these lines (commands, pids they claim, what their bad requests held). So that none can
# forge a line or flood the disk, every line is cut to MAX_LINE characters and its control characters are
# escaped (a newline in a command shows as \n, it does not start a line), and complaints about one client
# (`complaint`) are rate-limited: a burst, then one a second, with a count of those left out. So are the
# control.log lines of users other than root and the daemon's owner (`limited`): a burst, then a hundred a
# second (another uid's denied commands wrote 212 MB in 10 s before); what root and the owner do is all logged,
# as MPS logs it.
from __future__ import annotations

import datetime
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Hashable, Iterator, TextIO

from mpsd.daemon.ownership import UnsafePathError, open_log, private_directory


MAX_LINE = 4088  # characters in one line, its prefix included: where MPS cuts its lines (measured on an H200)
COMPLAINT_BURST = 20  # complaints about one client logged in a row before the rate limit applies
COMPLAINT_INTERVAL = 1.0  # seconds between complaints about one client after that
CONTROL_BURST = 1000  # control.log lines of one limited user logged in a row before the rate limit applies
CONTROL_INTERVAL = 0.01  # seconds between its lines after that
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\u2028\u2029\x85]")  # a tab stays: MPS logs it as it came


def log_line(source: str, pid: int, text: str, now: datetime.datetime | None = None, verbatim: bool = False) -> str:
    """One log line in the MPS format (without the newline), its text escaped and bounded.

    The prefix is MPS's: the source, one space and the pid right-aligned in five columns
    (``Control   484``, ``Server  1140``, ``Other   486``).
    """
    now = now or datetime.datetime.now()
    stamp = now.strftime("%Y-%m-%d %H:%M:%S.") + f"{now.microsecond // 1000:03d}"
    if not verbatim:  # only text of the daemon's own may start a line: device_query's table does, as MPS's
        text = _CONTROL.sub(lambda m: repr(m.group())[1:-1], text[:MAX_LINE])
    return f"[{stamp} {source} {pid:5d}] {text}"[:MAX_LINE]


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
        self.server_pid = self.pid  # whose server.log lines are the server's: the server process's, where one runs
        self.echo: TextIO | None = None  # where control.log's lines also go (stdout, for MPS's -f)
        self._files: dict[str, TextIO] = {}
        self.limited: int | None = None  # the uid whose control.log lines are rate-limited now (None: nobody's)
        self._complaints: dict[Hashable, list[float]] = {}  # about whom -> [allowance, last time, left out]
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

    def _write(self, name: str, source: str, text: str, pid: int | None = None, verbatim: bool = False) -> None:
        handle = self._files.get(name)
        line = log_line(source, self.pid if pid is None else pid, text, verbatim=verbatim) + "\n"
        if handle is not None:
            handle.write(line)
        if name == "control" and self.echo is not None:
            self.echo.write(line)
            self.echo.flush()

    @contextmanager
    def limiting(self, uid: int | None) -> Iterator[None]:
        """Within the block, control.log's lines are `uid`'s, rate-limited (None: nobody's)."""
        self.limited = uid
        try:
            yield
        finally:
            self.limited = None

    def control(self, text: str, pid: int | None = None, verbatim: bool = False) -> None:
        """A control.log line; `pid` is whose it is where not the daemon's (MPS logs a server's start under
        the server's pid); `verbatim` for the daemon's own text that holds newlines on purpose. Left out while
        the user `limited` names has had its share lately."""
        if self.limited is not None:
            left = self._share(("control", self.limited), CONTROL_BURST, CONTROL_INTERVAL)
            if left is None:
                return
            if left:
                self._write("control", "Control", f"({left} lines of user {self.limited} left out)")
        self._write("control", "Control", text, pid, verbatim)

    def server(self, text: str, source: str = "Server", pid: int | None = None) -> None:
        """A server.log line; `source` "Other" for what MPS's server writes before it has its context."""
        self._write("server", source, text, self.server_pid if pid is None else pid)

    def complaint(self, about: Hashable, text: str) -> None:
        """A server.log line about what a client did wrong, unless that client has had its share lately."""
        left = self._share(about, COMPLAINT_BURST, COMPLAINT_INTERVAL)
        if left is None:
            return
        self.server(text + (f" ({left} similar lines about it left out)" if left else ""))

    def _share(self, about: Hashable, burst: int, interval: float) -> int | None:
        """Whether one more line about `about` may go now (a token bucket of `burst` lines, one more every
        `interval` seconds): None if not (it is counted), else how many were left out since the last."""
        now = time.monotonic()
        state = self._complaints.setdefault(about, [float(burst), now, 0])
        state[0] = min(float(burst), state[0] + (now - state[1]) / interval)
        state[1] = now
        if state[0] < 1.0:
            state[2] += 1
            return None
        state[0] -= 1.0
        left, state[2] = int(state[2]), 0
        if len(self._complaints) > 4096:  # those long quiet go; the limit keeps for the rest
            self._complaints = {k: v for k, v in self._complaints.items() if now - v[1] < 60.0}
        return left

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
