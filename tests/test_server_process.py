# Each server's own nvidia-cuda-mps-server process (--mps-names, which the nvidia-cuda-mps-control command
# gives): its pid is the one get_server_list, ps and server.log give, it lives exactly as long as its server,
# and killing it ends the server as MPS's does: the clients' calls fail with cudaErrorMpsRpcFailure and the
# next client starts a new server, with a new process. In the in-process tier (the daemon here, its server
# processes real children).
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import trio

import mpsd_client
from inproc import in_process_daemon

UID = os.getuid()


async def _until(condition, what: str, timeout: float = 10.0) -> None:
    with trio.move_on_after(timeout):
        while not condition():
            await trio.sleep(0.01)
        return
    raise AssertionError(f"still not {what} after {timeout} s")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def test_a_server_has_its_own_named_process_for_as_long_as_it_runs():
    """The server's pid is its process's, named nvidia-cuda-mps-server (comm, cmdline, pidof); get_server_list,
    ps and server.log give it; it goes with the server, and the next server has a new one."""
    async with in_process_daemon("--mps-names", "--time-scale", "100") as d:
        run = d.daemon.control.execute
        assert run("get_server_list", UID) == ""
        async with d.connect() as client:
            await client.synchronize()
            pid = int(run("get_server_list", UID))
            assert pid != os.getpid()
            assert Path(f"/proc/{pid}/comm").read_text() == "nvidia-cuda-mps\n"  # the kernel keeps 15 bytes
            assert Path(f"/proc/{pid}/cmdline").read_bytes() == b"nvidia-cuda-mps-server\0"
            assert str(pid) in subprocess.run(["pidof", "nvidia-cuda-mps-server"], capture_output=True,
                                              text=True).stdout.split()
            assert run("ps", UID).splitlines()[1].split()[2] == str(pid)
            assert f"Server {pid:5d}] Server has started" in d.server_log()
            assert client._core.server_pid == pid  # what the daemon told the client its server is
        assert run(f"shutdown_server {pid}", UID) == ""
        await _until(lambda: _gone(pid), "gone with its server")
        assert f"Server {pid} exited with status 0" in (d.log_dir / "control.log").read_text()
        async with d.connect() as client:
            await client.synchronize()
            second = int(run("get_server_list", UID))
        assert second != pid and not _gone(second)
    await _until(lambda: _gone(second), "gone with the daemon")


async def test_killing_the_server_process_ends_the_server_as_mps_does():
    """kill -9 of the server's process: its clients' calls fail with cudaErrorMpsRpcFailure (806), control.log
    says it exited (status 137, as a shell gives a SIGKILL), and the next client gets a new server."""
    async with in_process_daemon("--mps-names", "--time-scale", "100") as d:
        run = d.daemon.control.execute
        async with d.connect() as victim:
            await victim.synchronize()
            pid = int(run("get_server_list", UID))
            os.kill(pid, signal.SIGKILL)
            await _until(lambda: run("get_server_list", UID) == "", "ended")
            with pytest.raises(mpsd_client.CudaError) as failed:
                await victim.malloc(1 << 20)
            assert failed.value.code == 806
            assert f"Server {pid} exited with status 137" in (d.log_dir / "control.log").read_text()
            async with d.connect() as newcomer:
                ptr = await newcomer.malloc(1 << 20)
                assert ptr
                second = int(run("get_server_list", UID))
                assert second != pid and not _gone(second)
