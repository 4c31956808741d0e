# Helpers for tests that need real processes. Real parts only: the daemon runs as its own process
# (`python -m mpsd`) on a private pipe directory, and tests talk to it over its real socket, from this process
# or from worker processes they spawn. A daemon is ready when it prints its ready line: tests wait for that
# line, never sleep-and-poll.
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

READY_TIMEOUT = 30.0


@dataclass
class DaemonProcess:
    """A running `mpsd` and where to find it."""

    proc: subprocess.Popen[str]
    pipe_dir: Path
    log_dir: Path
    stderr_lines: list[str] = field(default_factory=list)

    @property
    def socket_path(self) -> Path:
        return self.pipe_dir / "mpsd.sock"

    def server_log(self) -> str:
        path = self.log_dir / "server.log"
        return path.read_text() if path.exists() else ""

    def stop(self, timeout: float = 20.0, signum: int | None = signal.SIGTERM) -> int:
        """Send `signum` (None: none, it was sent already), wait, and return the exit code."""
        if self.proc.poll() is None and signum is not None:
            self.proc.send_signal(signum)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("the daemon did not exit within 20 s of SIGTERM")
        assert self.proc.stderr is not None
        if not self.proc.stderr.closed:  # (stopped once already: what it said is read)
            self.stderr_lines.extend(self.proc.stderr.read().splitlines())
            self.proc.stderr.close()
        return self.proc.returncode


def drain_stderr(daemon: DaemonProcess) -> threading.Thread:
    """Read `daemon`'s stderr into its stderr_lines all along, for a run long enough that what the daemon says
    could fill the pipe and stall it; join the thread once the daemon has exited, before `stop`."""
    def read() -> None:
        assert daemon.proc.stderr is not None
        for line in daemon.proc.stderr:
            daemon.stderr_lines.append(line.rstrip("\n"))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def short_tempdir() -> Path:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer than that.
    return Path(tempfile.mkdtemp(prefix="mpsd-t-", dir="/tmp"))


def start_daemon(*args: str, pipe_dir: Path | None = None, env: dict[str, str] | None = None) -> DaemonProcess:
    """Start `python -m mpsd` and return once it says it is ready."""
    pipe_dir = pipe_dir or short_tempdir() / "pipe"
    log_dir = pipe_dir.parent / "log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpsd", "--pipe-dir", str(pipe_dir), "--log-dir", str(log_dir), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )
    daemon = DaemonProcess(proc, pipe_dir, log_dir)
    assert proc.stderr is not None
    line = proc.stderr.readline()  # blocks until the ready line, or EOF if it died
    daemon.stderr_lines.append(line.rstrip("\n"))
    if not line.startswith("mpsd: ready on"):
        proc.wait(READY_TIMEOUT)
        rest = proc.stderr.read()
        proc.stderr.close()
        raise AssertionError(f"daemon did not start (exit {proc.returncode}): {line}{rest}")
    return daemon


def run_worker(code: str, pipe_dir: Path, *args: str, env: dict[str, str] | None = None,
               timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh Python process with CUDA_MPS_PIPE_DIRECTORY set; returns its result."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir), **(env or {})},
        capture_output=True, text=True, timeout=timeout,
    )


def spawn_worker(code: str, pipe_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start `code` in a fresh Python process (stdin, stdout and stderr are pipes)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir), **(env or {})},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


SECOND_USER = "mpsd-ipc-test"


def second_user() -> pwd.struct_passwd | None:
    """A real second user, created when we are root; None (where a test is then skipped) otherwise."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SECOND_USER)
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        return None
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SECOND_USER],
                   check=True, capture_output=True)
    return pwd.getpwnam(SECOND_USER)


def as_user(user: pwd.struct_passwd, work: Callable[[], str]) -> str:
    """Run `work` in a forked child that has become `user` (the interpreter is already loaded, so the child
    needs no access to where Python lives), and return what it returned."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller
        status = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            os.write(write, work().encode())
            status = 0
        except BaseException as exc:  # say what went wrong: the caller's error shows it
            os.write(write, repr(exc).encode())
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise AssertionError(answer)
    return answer
