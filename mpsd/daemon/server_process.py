# One `nvidia-cuda-mps-server` process per running server, as MPS shows one (ps, pgrep, pidof, nvidia-smi
# and liveness scripts look for it by name), where the daemon runs with --mps-names. mpsd still plays every
# server inside the daemon's own process: this process does no work. It is there so that the server has a pid
# of its own, the one get_server_list, ps and the logs give, that lives exactly as long as the server, and
# whose death ends the server as MPS's does (its clients' calls fail with cudaErrorMpsRpcFailure, and the next
# client starts a new server with a new pid).
#
# The process is `cat` exec'd through a symlink named nvidia-cuda-mps-server (the kernel names a process, its
# /proc/PID/comm, after the path it was exec'd by; argv[0] gives its command line), reading a pipe whose other
# end only the daemon holds: when the daemon ends the server, or dies itself, the pipe closes and the process
# exits at once, so none outlives its daemon. Where the daemon runs as root it runs as the server's user, as
# MPS's server does. What differs from MPS's: /proc/PID/exe is cat, and the process holds no GPU context.
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import trio

MPS_SERVER_NAME = "nvidia-cuda-mps-server"


class ServerProcessError(Exception):
    """The server's process cannot be started; the message says why."""


class ServerProcesses:
    """Starts server processes from a directory of the daemon's own that holds the named link to cat."""

    def __init__(self) -> None:
        self._directory: Path | None = None

    def _link(self) -> Path:
        if self._directory is None:
            cat = shutil.which("cat")
            if cat is None:
                raise ServerProcessError("no cat on PATH to run as nvidia-cuda-mps-server")
            directory = Path(tempfile.mkdtemp(prefix="mpsd-server-"))
            directory.chmod(0o711)  # a server run as its user must reach the link; no one can list or write
            (directory / MPS_SERVER_NAME).symlink_to(cat)
            self._directory = directory
        return self._directory / MPS_SERVER_NAME

    def start(self, uid: int | None) -> ServerProcess:
        """A new server process (as `uid` where the daemon is root and `uid` is given).

        Raises:
            ServerProcessError: it cannot be started.
        """
        read, write = os.pipe()
        try:
            user = uid if uid is not None and os.geteuid() == 0 and uid != 0 else None
            process = subprocess.Popen([MPS_SERVER_NAME], executable=self._link(), stdin=read,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, user=user,
                                       cwd="/", close_fds=True)
        except (OSError, subprocess.SubprocessError) as exc:
            os.close(write)
            raise ServerProcessError(f"cannot start {MPS_SERVER_NAME}: {exc}") from None
        finally:
            os.close(read)
        _wait_named(process.pid)
        return ServerProcess(process, write)

    def close(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None


def _wait_named(pid: int, timeout: float = 1.0) -> None:
    """Wait (a few ms at most, as a rule) until `pid` has exec'd, so that whoever is given its pid sees the
    name: Popen may return while the child is still a copy of the daemon."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(MPS_SERVER_NAME.encode()):  # set last
                return
        except OSError:
            return  # it is gone already: its watcher will say so
        time.sleep(0.0005)


class ServerProcess:
    """One server's process: its pid, and a way to wait for and to bring about its end."""

    def __init__(self, process: subprocess.Popen[bytes], pipe: int) -> None:
        self._process = process
        self._pipe: int | None = pipe
        self.pid = process.pid
        self._pidfd = os.pidfd_open(process.pid)

    async def wait(self) -> int:
        """Wait for the process to exit, reap it, and return its status as a shell gives it (128 + the signal
        that killed it)."""
        try:
            await trio.lowlevel.wait_readable(self._pidfd)
        finally:
            if self._process.poll() is None:  # cancelled: the daemon is going, and so must it
                self.end()
                self._process.wait()
            os.close(self._pidfd)
        code = self._process.returncode
        return 128 - code if code < 0 else code

    def end(self) -> None:
        """Let the process exit (it does at once: its pipe closes)."""
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
