# MPS v3's control interface (NVIDIA's MPS documentation, releases 615 and 620) as mpsd-control and a real
# daemon give it: how v3 is selected (-p 3, CUDA_MPS_PROTOCOL_VERSION=3, which wins; a running daemon's
# protocol, which a new invocation follows), and the module-verb commands over the legacy state, with their
# exact outputs, stderr and exit codes. The texts NVIDIA does not document are mpsd's guesses (listed in
# mpsd/daemon/control_v3.py and README): these tests pin them so that a change is deliberate.
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import mpsd_client
from daemons import short_tempdir, start_daemon
from mpsd.backends.sim import device_properties
from mpsd.sim import H200
from mpsd.tools.control import HELP, MPSD_OPTIONS, V3_HELP
from test_ipc import _as_user, _second_user

BIN = Path(sys.executable).parent


def tool(pipe_dir: Path, *args: str, stdin: str = "", env: dict[str, str] | None = None
         ) -> tuple[int, str, str]:
    """mpsd-control with `args` (and `stdin`) against the daemon on `pipe_dir`: (rc, stdout, stderr)."""
    environ = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_PROTOCOL_VERSION"}
    result = subprocess.run([BIN / "mpsd-control", *args], input=stdin, capture_output=True, text=True, timeout=60,
                            env={**environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir), **(env or {})})
    return result.returncode, result.stdout, result.stderr


@pytest.fixture
def v3(daemon_factory):
    """A daemon started with protocol 3."""
    d = start_daemon("--protocol", "3", "--time-scale", "100")
    daemon_factory.append(d)
    return d


def test_selecting_v3_and_following_the_running_daemon(daemon_factory):
    """-p 3 starts a v3 daemon, and a plain invocation then speaks v3; the variable beats -p; a v2 daemon
    makes -p 3 a legacy invocation (its command words are unrecognised options, as MPS's v2 tool says)."""
    pipe = short_tempdir() / "pipe"
    try:
        assert tool(pipe, "-p", "4") == (1, "", 'Invalid protocol version "4", expected 2 or 3\n')
        assert tool(pipe, "-p", "3", "server", "list") == (1, "", "Cannot find MPS control daemon process\n")
        assert tool(pipe, "-h", env={"CUDA_MPS_PROTOCOL_VERSION": "3"}) == (0, V3_HELP, "")
        assert tool(pipe, "-d", "-p", "3", "--time-scale", "100")[0] == 0
        assert (pipe / "mpsd-protocol").read_text() == "3\n"
        assert tool(pipe, "server", "list") == (0, "", "")  # no server yet: nothing, as v2's lists
        assert tool(pipe, "-p", "2", "-h") == (0, V3_HELP, "")  # the running daemon's protocol wins
        assert tool(pipe, "-q") == (0, "", "")  # v3's -q quits
        assert not (pipe / "mpsd-protocol").exists() and not (pipe / "control").exists()  # gone with the daemon
        # The variable wins over -p 2: the daemon speaks v3.
        assert tool(pipe, "-d", "-p", "2", "--time-scale", "100", env={"CUDA_MPS_PROTOCOL_VERSION": "3"})[0] == 0
        assert tool(pipe, "client", "list") == (0, "", "")
        assert tool(pipe, stdin="quit\n") == (0, "", "")
        # A v2 daemon: -p 3 follows it, so the words are unrecognised options (MPS prints a NUL for the name),
        # and on stdin `server` is an unknown legacy command; no protocol file is left beside MPS's files.
        d = start_daemon("--time-scale", "100", pipe_dir=pipe)
        daemon_factory.append(d)
        assert not (pipe / "mpsd-protocol").exists()
        assert tool(pipe, "-p", "3", "server", "list") == (0, "Unrecognized option \0\n" + HELP + MPSD_OPTIONS, "")
        assert tool(pipe, "-p", "3", stdin="server list\n") == (0, 'Unknown command "server"\n', "")
    finally:
        shutil.rmtree(pipe.parent, ignore_errors=True)


def test_partition_commands_through_the_tool(daemon_factory):
    """The partition module through nvidia-cuda-mps-control (mpsd-control) on a v3 -S daemon: the id on
    stdout and 0, a failure on stderr and 1, and the legacy lspart sees what it made."""
    d = start_daemon("--protocol", "3", "-S", "--time-scale", "100")
    daemon_factory.append(d)
    pipe = d.pipe_dir
    assert tool(pipe, "partition", "create", "--device=0", "--chunks", "3", "--name=big") == (0, "p0\n", "")
    assert tool(pipe, "partition", "create", "--device=0", "--chunks=3", "--name=big") == (
        1, "", 'Partition "big" already exists\n')
    assert tool(pipe, "partition", "remove") == (
        1, "", 'Unknown command "partition remove"\nUsage: partition <list|create|delete> [options]\n')
    rc, out, err = tool(pipe, "partition", "list")
    assert (rc, err, out.splitlines()[1].split()[:6]) == (
        0, "", ["p0", "big", device_properties(H200, 0)["uuid"], "3", "24", "0"])
    assert tool(pipe, stdin="lspart\n")[1].splitlines()[1].split()[0] == "p0"
    assert tool(pipe, "partition", "delete", "--partition=big") == (0, "", "")
    assert tool(pipe, "partition", "list") == (0, "", "")


def test_server_commands(v3):
    """server create/list/get/set/delete over the legacy state: exact outputs, failures on stderr with 1."""
    pipe, pid, uid = v3.pipe_dir, v3.proc.pid, os.getuid()
    assert tool(pipe, "server") == (1, "", "Usage: server <list|create|delete|set|get> [options]\n")
    assert tool(pipe, "server", "start") == (
        1, "", 'Unknown command "server start"\nUsage: server <list|create|delete|set|get> [options]\n')
    assert tool(pipe, "server", "create") == (
        1, "", "A user id (UID) is required to start a new server\nUsage: server create --uid=UID\n")
    assert tool(pipe, "server", "create", "--uid=12x") == (1, "", 'Invalid user id "12x"\n')
    assert tool(pipe, "server", "create", "--name=a") == (
        1, "", 'Unknown option "--name"\nUsage: server create --uid=UID\n')
    # The defaults, before any server: what the next server starts with.
    assert tool(pipe, "server", "set", "--active-thread-percentage=25", "--pinned-memory-limit=2G") == (0, "", "")
    assert tool(pipe, "server", "get", "--pinned-memory-limit") == (0, "0=2G\n", "")
    assert tool(pipe, "server", "create", f"--uid={uid}") == (0, "", "")
    header = "NAME           PID       UID       STATUS\n"
    assert tool(pipe, "server", "list") == (0, header + f"-              {pid:<10}{uid:<10}ACTIVE\n", "")
    assert tool(pipe, "server", "get", f"--pid={pid}", "--active-thread-percentage") == (0, "25.0\n", "")
    assert tool(pipe, "server", "get", "--pid", str(pid), "--pinned-memory-limit", "--device=0") == (0, "2G\n", "")
    assert tool(pipe, "server", "set", f"--pid={pid}", "--active-thread-percentage=50",
                "--pinned-memory-limit=4096M", "--client-priority=1") == (0, "", "")
    # A failed set changes nothing, though its first value was good.
    assert tool(pipe, "server", "set", f"--pid={pid}", "--active-thread-percentage=75", "--client-priority=2") == (
        1, "", 'Invalid client priority "2", expected 0 or 1\n')
    assert tool(pipe, "server", "set", "--active-thread-percentage=0") == (
        1, "", 'Invalid active thread percentage "0", expected between (0.0, 100.0]\n')
    assert tool(pipe, "server", "get", f"--pid={pid + 1}", "--client-priority") == (
        1, "", f"Server {pid + 1} not found\n")
    assert tool(pipe, "server", "get", "--device=7", "--pinned-memory-limit") == (1, "", 'Invalid device "7"\n')
    assert tool(pipe, "server", "get") == (1, "", "Usage: server get [--pid=PID] [--device=DEV] "
                                                  "--active-thread-percentage|--pinned-memory-limit|--client-priority\n")
    # The legacy commands still answer on a v3 daemon, and see what v3 set.
    legacy = tool(pipe, stdin=f"get_active_thread_percentage {pid}\nget_device_pinned_mem_limit {pid} 0\n"
                              "get_default_client_priority\nget_default_active_thread_percentage\n")
    assert legacy == (0, "50.0\n4G\n1\n25.0\n", "")
    with mpsd_client.connect(pipe) as ctx:  # a client that comes now gets the server's settings
        assert ctx.quotas["sm_cap"] == 66 and ctx.quotas["pinned_mem_limit"] == 4 << 30
        assert ctx.quotas["priority"] == 1
    assert tool(pipe, "server", "delete") == (1, "", "Usage: server delete --pid=PID [--force]\n")
    assert tool(pipe, "server", "delete", f"--pid={pid}") == (0, "", "")
    assert tool(pipe, "server", "list") == (0, "", "")
    assert tool(pipe, "namespace", "list") == (0, "", "")  # no named server, none runs: nothing to list
    log = (v3.log_dir / "control.log").read_text()
    assert "Cmd:server set --pid" in log and "Invalid client priority \"2\", expected 0 or 1" in log


def test_client_list_and_terminate(v3):
    """client list shows the running server's clients; --all adds another user's client waiting for its
    server (PENDING); client terminate ends a client's calls, as terminate_client does."""
    pipe, pid = v3.pipe_dir, v3.proc.pid
    me, user = os.getpid(), _second_user()  # None where no second user can be had: that part is left out
    header = "PID       SERVER    UID       STATUS    NAMESPACE      DEVICE\n"
    assert tool(pipe, "client", "list") == (0, "", "")
    assert tool(pipe, "client", "list", "--every") == (1, "", 'Unknown option "--every"\nUsage: client list [--all]\n')
    first = mpsd_client.connect(pipe)
    uuid = first.device_properties()["uuid"]
    row = f"{me:<10}{pid:<10}{os.getuid():<10}{'ACTIVE':<10}{'default':<15}{uuid}\n"
    assert tool(pipe, "client", "list") == (0, header + row, "")
    if user is not None:  # another user's client waits while root's server has a client
        for path in (pipe.parent, pipe):
            os.chmod(path, 0o755)
        os.chmod(v3.socket_path, 0o777)
        waited: list[str] = []

        def connect() -> str:
            first._sock.close()  # the fork's copy of root's connection
            with mpsd_client.connect(pipe, timeout=30) as ctx:
                return "yes" if ctx.malloc(16) else "no"

        waiter = threading.Thread(target=lambda: waited.append(_as_user(user, connect)))
        waiter.start()
        try:
            _wait_for(v3.log_dir / "control.log", f"from user {user.pw_uid}: Server {pid} serves user")
            listed = tool(pipe, "client", "list", "--all")
            assert tool(pipe, "client", "list") == (0, header + row, "")  # without --all: no waiting client
        finally:
            first.close()  # root's server can go: the other user's client gets its own
            waiter.join(30)
        assert listed[0] == 0 and listed[1].startswith(header + row), listed
        assert listed[1].splitlines()[2].split()[1:] == ["-", str(user.pw_uid), "PENDING", "-", "-"]
        assert waited == ["yes"]
    else:
        first.close()
    with mpsd_client.connect(pipe) as ctx:
        assert tool(pipe, "client", "terminate", "--pid=1") == (1, "", "Invalid process 1\n")
        assert tool(pipe, "client", "terminate", f"--pid={me}") == (0, "", "")
        with pytest.raises(mpsd_client.CudaError) as failed:
            ctx.malloc(16)
        assert failed.value.code == 810  # cudaErrorMpsClientTerminated


def _wait_for(path: Path, text: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.02)
    raise AssertionError(f"{text!r} never appeared in {path}")


CONFIG = """schema_version = "1.0"

[servers.training]
allowed_devices          = "{uuid}"
pinned_memory_limit      = "2G"
active_thread_percentage = "50"
client_priority          = "1"
uid                      = {uid}
locality_domains         = false

[servers.other]
uid = 4242
"""


def test_apply_starts_named_servers_from_a_toml_file(daemon_factory, tmp_path):
    """-a FILE with -d -p 3: a named server's settings are what its user's server starts with (its allowed
    devices the only ones its clients may use), and server list names it; the others show INACTIVE."""
    uuid = device_properties(H200, 1)["uuid"]  # the simulator's second device
    config = tmp_path / "mps.toml"
    config.write_text(CONFIG.format(uuid=uuid, uid=os.getuid()))
    pipe = short_tempdir() / "pipe"
    try:
        assert tool(pipe, "-p", "3", "-a", str(config)) == (
            1, "", "-a/--apply applies a configuration as the daemon starts: give it with -d or -f\n")
        assert tool(pipe, "-d", "-p", "3", "-a", str(config), "--devices", "h200:2", "--time-scale", "100") == (
            0, "", "")
        header = "NAME           PID       UID       STATUS\n"
        assert tool(pipe, "server", "list") == (0, header + f"training       -         {os.getuid():<10}INACTIVE\n"
                                                         "other          -         4242      INACTIVE\n", "")
        with mpsd_client.connect(pipe, device=1) as ctx:
            assert ctx.quotas["sm_cap"] == 66 and ctx.quotas["pinned_mem_limit"] == 2 << 30
            assert ctx.quotas["priority"] == 1
            pid = (pipe / "nvidia-cuda-mps-control.pid").read_text().strip()
            assert tool(pipe, "server", "list") == (
                0, header + f"training       {pid:<10}{os.getuid():<10}ACTIVE\nother          -         4242      "
                "INACTIVE\n", "")
            assert tool(pipe, "server", "get", f"--pid={pid}", "--pinned-memory-limit") == (0, "1=2G\n", "")
            # The named server's priority is its own: the next server's default stays 0.
            assert tool(pipe, "server", "get", f"--pid={pid}", "--client-priority") == (0, "1\n", "")
            assert tool(pipe, "server", "get", "--client-priority") == (0, "0\n", "")
            assert tool(pipe, "server", "set", f"--pid={pid}", "--client-priority=0") == (0, "", "")
            with mpsd_client.connect(pipe, device=1) as second:
                assert second.quotas["priority"] == 0
            with pytest.raises(mpsd_client.CudaError) as refused:
                mpsd_client.connect(pipe, device=0)
            assert refused.value.code == 46  # cudaErrorDevicesUnavailable: not among training's devices
        log = (pipe / "control.log").read_text()
        assert f"Applied configuration {config}: servers training, other" in log
        assert "Active Threads Percentage set to 50.0" in (pipe / "server.log").read_text()
        assert "Server Priority set to 1" in (pipe / "server.log").read_text()
        assert tool(pipe, "-q") == (0, "", "")
    finally:
        shutil.rmtree(pipe.parent, ignore_errors=True)


@pytest.mark.parametrize("text, error", [
    ('schema_version = "1.0"\n[servers.a]\nuid = 1\ncolour = "red"\n', "unknown key servers.a.colour"),
    ('schema_version = "1.0"\nserver = 1\n', "unknown key server"),
    ('schema_version = "2.0"\n', "schema_version must be \"1.0\", not '2.0'"),
    ('schema_version = "1.0"\n[servers.a]\nuid = 1\n[servers.a.namespaces.b]\ncgroup_depth = 1\n',
     "servers.a.namespaces.b.cgroup_depth is not supported by mpsd: NVIDIA's documentation shows the key but does "
     "not say what it does"),
    ('schema_version = "1.0"\n[servers.a]\nuid = 1\n[[servers.a.devices]]\nuuid = "GPU-x"\n'
     '[[servers.a.devices.sm_partitions]]\nname = "big"\nchunks = 4\nmax_chunks = 6\n',
     "servers.a.devices[0].sm_partitions[0].max_chunks is not supported by mpsd yet"),
    ('schema_version = "1.0"\n[compute_policy]\ntimeslice = "long"\n', "[compute_policy] is not supported by mpsd yet"),
    ('schema_version = "1.0"\n[servers.a]\nactive_thread_percentage = "50"\n',
     "servers.a needs a uid (each of mpsd's servers serves one user)"),
    ('schema_version = "1.0"\n[servers.a]\nuid = 1\nactive_thread_percentage = "150"\n',
     "servers.a.active_thread_percentage must be in (0, 100], not '150'"),
    ('schema_version = "1.0"\n[servers.a]\nuid = 1\n[servers.b]\nuid = 1\n',
     "servers.a and servers.b both serve uid 1"),
])
def test_apply_refuses_what_it_cannot_apply(tmp_path, text, error):
    """A configuration error stops the daemon before it listens (exit 2, the path and the key named)."""
    config = tmp_path / "mps.toml"
    config.write_text(text)
    result = subprocess.run([sys.executable, "-m", "mpsd", "--pipe-dir", str(tmp_path / "pipe"), "--protocol", "3",
                             "--apply", str(config)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (2, f"mpsd: {config}: {error}\n")


def test_apply_needs_protocol_3_and_devices_of_the_daemon(tmp_path):
    """--apply on a v2 daemon is refused (exit 2); a UUID the daemon has no device for, when it starts (1)."""
    config = tmp_path / "mps.toml"
    config.write_text('schema_version = "1.0"\n[servers.a]\nuid = 1\nallowed_devices = "GPU-0,GPU-1"\n')
    pipe = str(tmp_path / "pipe")
    environ = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_PROTOCOL_VERSION"}
    v2 = subprocess.run([sys.executable, "-m", "mpsd", "--pipe-dir", pipe, "--apply", str(config)],
                        capture_output=True, text=True, timeout=60, env=environ)
    assert (v2.returncode, v2.stderr) == (2, "mpsd: --apply (MPS v3's configuration file) needs protocol 3\n")
    v3 = subprocess.run([sys.executable, "-m", "mpsd", "--pipe-dir", pipe, "--protocol", "3", "--apply", str(config)],
                        capture_output=True, text=True, timeout=60, env=environ)
    assert (v3.returncode, v3.stderr) == (
        1, f"mpsd: {config}: servers.a.allowed_devices names no device of this daemon: GPU-0, GPU-1\n")
