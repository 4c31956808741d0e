# MPS v3's namespaces and routing by socket path, in the in-process tier: the -a file's namespaces subdivide
# their server (each value cut to the server's), `namespace create|delete|list|set|get`, and the routed
# directories $PIPE/<server>/ and $PIPE/<server>/<namespace>/ whose sockets put a client, or a control
# command, in that server and namespace. The texts are mpsd's guesses (mpsd/daemon/namespaces.py, routes.py,
# control_v3.py list them); these tests pin them.
from __future__ import annotations

import os
import re
import socket
import stat
from pathlib import Path

import pytest
import trio
import trio.testing

import mpsd_client
from inproc import in_process_daemon
from mpsd.backends.sim import device_properties
from mpsd.daemon.mps_config import load_mps_config
from mpsd.sim import H200
from mpsd_protocol import read_control_answer

UID = os.getuid()
CONFIG = f"""schema_version = "1.0"
[servers.train]
uid = {UID}
active_thread_percentage = "50"
pinned_memory_limit = "8G"
[servers.train.namespaces.small]
active_thread_percentage = "20"
pinned_memory_limit = "1G"
client_priority = "1"
[servers.train.namespaces.big]
active_thread_percentage = "80"
"""


def _contexts(d):
    return [ctx for device in d.daemon.devices for ctx in device.contexts.values()]


async def _control(path: Path, line: str) -> tuple[str, bool]:
    """One command over the SEQPACKET control socket at `path`: its output and whether it failed."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with sock:
        await sock.connect(str(path))
        await sock.send(line.encode())
        packets = []
        while True:
            packet = await sock.recv(1 << 16)
            packets.append(packet)
            if not packet or packet[:1] != b"+":
                break
        answer = read_control_answer(iter(packets).__next__)
        assert answer is not None
        return answer[0].decode(), answer[1]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "mps.toml"
    path.write_text(CONFIG)
    return path


async def test_a_files_namespaces_subdivide_their_server_and_have_their_own_sockets(config):
    """Each namespace of the -a file has its directory with both sockets, as reachable as the pipe directory (a
    root daemon's, as real MPS's, 0755, for every user's clients); a client that comes by one gets the
    namespace's values inside the server's, and client list shows it."""
    async with in_process_daemon("--protocol", "3", "--apply", str(config), "--time-scale", "100") as d:
        for directory in (d.pipe_dir / "train", d.pipe_dir / "train" / "small", d.pipe_dir / "train" / "big",
                          d.pipe_dir / "train" / "default"):
            mode = directory.lstat().st_mode
            assert stat.S_ISDIR(mode) and stat.S_IMODE(mode) == stat.S_IMODE(d.pipe_dir.lstat().st_mode)
            assert stat.S_IMODE(mode) == (0o755 if os.geteuid() == 0 else 0o700)
            assert stat.S_ISSOCK((directory / "control").lstat().st_mode)
            assert stat.S_ISSOCK((directory / "mpsd.sock").lstat().st_mode)
        async with mpsd_client.open_context(d.pipe_dir / "train" / "small", environ={}) as small, \
                mpsd_client.open_context(d.pipe_dir / "train" / "big", environ={}) as big, \
                mpsd_client.open_context(d.pipe_dir / "train", environ={}) as plain:
            await small.synchronize()
            await big.synchronize()
            await plain.synchronize()
            by_space = {ctx.namespace: ctx.quotas for ctx in _contexts(d)}
            assert by_space["small"].active_thread_percentage == 20.0
            assert by_space["small"].pinned_mem_limit == 1 << 30
            assert by_space["small"].priority == 1
            assert by_space["big"].active_thread_percentage == 50.0  # 80 is cut to the server's 50
            assert by_space["big"].pinned_mem_limit == 8 << 30
            assert by_space["default"].active_thread_percentage == 50.0
            listing = d.daemon.control.execute("client list", UID).splitlines()
            assert listing[0].split() == ["PID", "SERVER", "UID", "STATUS", "NAMESPACE", "DEVICE"]
            # One row per client process (all three are this one): its first context's namespace.
            assert [line.split()[4] for line in listing[1:]] == ["small"]
            spaces = d.daemon.control.execute("namespace list", UID).splitlines()
            assert spaces[0].split() == ["SERVER", "UID", "NAMESPACE", "CLIENTS"]
            assert [line.split() for line in spaces[1:]] == [
                ["train", str(UID), "default", "1"], ["train", str(UID), "small", "1"],
                ["train", str(UID), "big", "1"]]
            # A routed control socket is about its server and namespace: no --server or --name needed.
            assert await _control(d.pipe_dir / "train" / "small" / "control",
                                  "namespace get --active-thread-percentage") == ("20.0", False)
            assert await _control(d.pipe_dir / "train" / "control",
                                  "namespace get --name=big --pinned-memory-limit") == ("0=8G", False)
            assert await _control(d.pipe_dir / "train" / "small" / "control", "namespace delete") == (
                'Namespace "small" has 1 client(s)', True)
            # client list on a routed socket lists that namespace's clients only (by its contexts there).
            for where, space in (("small", "small"), ("big", "big"), ("default", "default"), ("", "default")):
                text, failed = await _control(d.pipe_dir / "train" / where / "control", "client list")
                assert not failed and [line.split()[4] for line in text.splitlines()[1:]] == [space]
            async with mpsd_client.open_context(d.pipe_dir / "train" / "default", environ={}) as again:
                await again.synchronize()
                assert sorted(ctx.namespace for ctx in _contexts(d)).count("default") == 2
        # With no client left in it, a namespace's socket lists nothing (the main one lists everyone).
        async with mpsd_client.open_context(d.pipe_dir / "train" / "big", environ={}) as big:
            await big.synchronize()
            assert await _control(d.pipe_dir / "train" / "small" / "control", "client list") == ("", False)
            assert len(d.daemon.control.execute("client list", UID).splitlines()) == 2


async def test_namespace_commands_make_and_remove_namespaces_and_their_sockets(config):
    """create makes the namespace and its directory, set changes what new clients get, delete takes both
    away once it has no clients; failures are on stderr (the "!" packet) and change nothing."""
    async with in_process_daemon("--protocol", "3", "--apply", str(config), "--time-scale", "100") as d:
        run = d.daemon.control.execute

        def failed(line: str) -> str:
            reply = run(line, UID)
            assert d.daemon.control.failed, line
            return reply

        assert run("namespace create --server=train --name=eval --active-thread-percentage=10", UID) == ""
        assert stat.S_ISSOCK((d.pipe_dir / "train" / "eval" / "mpsd.sock").lstat().st_mode)
        assert failed("namespace create --server=train --name=eval") == 'Namespace "eval" already exists'
        assert failed("namespace create --server=train --name=../x").startswith('Invalid namespace name "../x"')
        assert failed("namespace create --server=train --name=default").startswith("Invalid namespace name")
        assert failed("namespace create --server=nope --name=x") == 'Server "nope" not found'
        assert failed("namespace create --server=train --name=x --active-thread-percentage=0").startswith(
            'Invalid active thread percentage "0"')
        assert "x" not in d.daemon.control.namespaces[UID]
        assert run("namespace set --server=train --name=eval --client-priority=1 --pinned-memory-limit=2G", UID) == ""
        assert run("namespace get --server=train --name=eval --client-priority", UID) == "1"
        assert run("namespace get --uid=" + str(UID) + " --name=eval --active-thread-percentage", UID) == "10.0"
        assert failed("namespace set --server=train --name=default --client-priority=1") == (
            'The "default" namespace is its server: use server set')
        async with mpsd_client.open_context(d.pipe_dir / "train" / "eval", environ={}) as client:
            await client.synchronize()
            (quotas,) = [ctx.quotas for ctx in _contexts(d)]
            assert (quotas.active_thread_percentage, quotas.pinned_mem_limit, quotas.priority) == (10.0, 2 << 30, 1)
            assert failed("namespace delete --server=train --name=eval") == 'Namespace "eval" has 1 client(s)'
        await trio.sleep(0.2)  # the client's session ends
        assert run("namespace delete --server=train --name=eval", UID) == ""
        assert not (d.pipe_dir / "train" / "eval").exists()
        assert failed("namespace get --server=train --name=eval --cgroup") == 'Namespace "eval" not found'
        with pytest.raises(mpsd_client.MpsConnectionError):
            async with mpsd_client.open_context(d.pipe_dir / "train" / "eval", environ={}):
                pass
        # Another user may read namespaces but not change them.
        assert failed("namespace create --server=train --name=y").startswith("Permission denied") if UID else True


async def test_a_namespace_whose_sockets_cannot_be_made_is_not_made(config):
    """namespace create fails with the reason where its directory cannot be made safely (a planted link),
    and the namespace is not made: not listed, not logged as created, and the next command runs as before
    (the daemon takes it back out of the control plane's state and drops the actions after the route)."""
    async with in_process_daemon("--protocol", "3", "--apply", str(config), "--time-scale", "100") as d:
        (d.pipe_dir / "train" / "evil").symlink_to(d.pipe_dir)
        reply = d.daemon.control.execute("namespace create --server=train --name=evil", UID)
        assert d.daemon.control.failed and "symbolic link" in reply
        assert "evil" not in d.daemon.control.namespaces[UID]
        log = (d.log_dir / "control.log").read_text()
        assert "Namespace evil created" not in log and reply.splitlines()[0] in log
        assert d.daemon.control.execute("namespace create --server=train --name=good", UID) == ""
        assert not d.daemon.control.failed and "good" in d.daemon.control.namespaces[UID]


async def test_a_namespaces_cgroup_takes_clients_of_the_main_socket(tmp_path):
    """A namespace whose cgroup holds the client's process takes it when it comes by the main socket."""
    cgroup = Path("/proc/self/cgroup").read_text().split("0::", 1)[-1].strip()
    if not cgroup.startswith("/"):
        pytest.skip("no cgroup v2 hierarchy here")
    path = tmp_path / "mps.toml"
    path.write_text(CONFIG + f'[servers.train.namespaces.mine]\ncgroup = "{cgroup}"\nactive_thread_percentage = "30"\n')
    async with in_process_daemon("--protocol", "3", "--apply", str(path), "--time-scale", "100") as d:
        async with d.connect() as client:
            await client.synchronize()
            ((space, percentage),) = [(c.namespace, c.quotas.active_thread_percentage) for c in _contexts(d)]
            assert (space, percentage) == ("mine", 30.0)


async def test_the_daemon_never_follows_a_planted_link_for_a_server_directory(config):
    """A symlink where a server's directory goes stops the daemon from starting, naming it; nothing is
    made at the link's target."""
    from mpsd.daemon.config import load_config
    from mpsd.daemon.inprocess import open_daemon
    from mpsd.daemon.server import DaemonError
    from daemons import short_tempdir

    base = short_tempdir()
    pipe, target = base / "pipe", base / "elsewhere"
    pipe.mkdir(mode=0o700)
    target.mkdir()
    (pipe / "train").symlink_to(target)
    daemon_config = load_config(["--pipe-dir", str(pipe), "--log-dir", str(base / "log"), "--protocol", "3",
                                 "--apply", str(config)], environ={})
    with pytest.raises(BaseExceptionGroup) as raised:
        async with open_daemon(daemon_config):
            pass
    assert raised.group_contains(DaemonError, match="pipe/train is a symbolic link")
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("text, error", [
    ('[servers.train.namespaces.small]\ncgroup_depth = 2\n',
     "servers.train.namespaces.small.cgroup_depth is not supported"),
    ('[servers.train.namespaces.small]\n[[servers.train.namespaces.small.devices]]\nuuid = "GPU-a"\n'
     'sm_partition = "large"\n', "sm_partition 'large' is no partition of servers.train.devices on GPU-a"),
    ('[[servers.train.devices]]\nuuid = "GPU-a"\n[[servers.train.devices.sm_partitions]]\nname = "x"\nchunks = 0\n',
     r"servers.train.devices\[0\].sm_partitions\[0\].chunks must be a whole number of chunks above 0"),
    ('[[servers.train.devices]]\nuuid = "GPU-a"\n[[servers.train.devices.sm_partitions]]\nname = "x"\nchunks = 1\n'
     'shareable = false\n', "shareable is not supported by mpsd yet"),
    ('[servers.train.namespaces.small]\ndevices = "GPU-a"\n', "must be an array of tables"),
    ('[servers.train.namespaces.small]\ncolour = "red"\n', "unknown key servers.train.namespaces.small.colour"),
    ('[servers.train.namespaces.default]\n', 'Invalid namespace name "default"'),
    ('[servers.train.namespaces.small]\ncgroup = "job1"\n', "cgroup must be a cgroup path"),
])
def test_the_a_files_namespaces_are_checked(tmp_path, text, error):
    """A namespace table mpsd cannot apply is a configuration error naming the key."""
    path = tmp_path / "mps.toml"
    path.write_text(f'schema_version = "1.0"\n[servers.train]\nuid = {UID}\n' + text)
    with pytest.raises(ValueError, match=error):
        load_mps_config(path)


def test_a_cgroup_under_the_mount_point_is_the_cgroups_path(tmp_path):
    """NVIDIA's example writes a namespace's cgroup as /sys/fs/cgroup/<path>: that is the cgroup /<path>."""
    path = tmp_path / "mps.toml"
    path.write_text(f'schema_version = "1.0"\n[servers.train]\nuid = {UID}\n[servers.train.namespaces.a]\n'
                    'cgroup = "/sys/fs/cgroup/training"\n[servers.train.namespaces.b]\ncgroup = "/user.slice"\n')
    (server,) = load_mps_config(path)
    assert [ns.cgroup for ns in server.namespaces] == ["/training", "/user.slice"]


async def test_a_namespaces_devices_are_all_its_clients_see_and_its_partition_theirs(tmp_path):
    """The -a file's per-device SM partitions exist as the daemon starts (partition list names them and their
    server); a namespace with devices shows its clients those only, its own list numbered from 0 and
    CUDA_VISIBLE_DEVICES picking among them, and puts them in its partition there; a client may name its
    server's partition, not another's, and not another than its namespace's."""
    uuids = [device_properties(H200, i)["uuid"] for i in range(2)]
    path = tmp_path / "mps.toml"
    path.write_text(f"""schema_version = "1.0"
[servers.train]
uid = {UID}
allowed_devices = "{uuids[0]},{uuids[1]}"
[[servers.train.devices]]
uuid = "{uuids[1]}"
  [[servers.train.devices.sm_partitions]]
  name = "large"
  chunks = 4
  [[servers.train.devices.sm_partitions]]
  name = "tail"
  chunks = 2
  include_remainder = true
[servers.train.namespaces.pinned]
[[servers.train.namespaces.pinned.devices]]
uuid = "{uuids[1]}"
sm_partition = "large"
[servers.other]
uid = {UID + 1}
[[servers.other.devices]]
uuid = "{uuids[0]}"
  [[servers.other.devices.sm_partitions]]
  name = "theirs"
  chunks = 1
""")
    async with in_process_daemon("--protocol", "3", "--apply", str(path), "--devices", "h200:2",
                                 "--time-scale", "100") as d:
        listing = d.daemon.control.execute("partition list", UID).splitlines()
        assert [line.split() for line in listing[1:]] == [
            ["p0", "tail", uuids[1], "2", "20", "112", "train", "0"],  # include_remainder's are made first
            ["p1", "large", uuids[1], "4", "32", "0", "train", "0"],
            ["p2", "theirs", uuids[0], "1", "8", "0", "other", "0"],
        ]
        pinned = d.pipe_dir / "train" / "pinned"
        for environ in ({}, {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": uuids[1]},
                        {"CUDA_MPS_SM_PARTITION": "large"}, {"CUDA_MPS_SM_PARTITION": "p1"}):
            async with mpsd_client.open_context(pinned, environ=environ) as ctx:
                await ctx.synchronize()
                (mine,) = _contexts(d)
                assert (mine.device.index, mine.sm_partition.name, ctx.quotas["sm_cap"]) == (1, "large", 32)
            await trio.testing.wait_all_tasks_blocked()
        for environ in ({"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": uuids[0]}):
            with pytest.raises(mpsd_client.CudaError) as raised:  # none of the namespace's devices
                async with mpsd_client.open_context(pinned, environ=environ):
                    pass
            assert raised.value.code == 100  # cudaErrorNoDevice
        with pytest.raises(mpsd_client.CudaError) as raised:  # the namespace has one device: ordinal 1 is none
            async with mpsd_client.open_context(pinned, device=1, environ={}):
                pass
        assert raised.value.code == 101  # cudaErrorInvalidDevice
        with pytest.raises(mpsd_client.InvalidValueError, match="runs its clients in SM partition large"):
            async with mpsd_client.open_context(pinned, environ={"CUDA_MPS_SM_PARTITION": "tail"}):
                pass
        # The server's default namespace sees both devices; its clients may pick the server's partitions.
        async with mpsd_client.open_context(d.pipe_dir / "train", device=1,
                                            environ={"CUDA_MPS_SM_PARTITION": "tail"}) as ctx:
            assert ctx.quotas["sm_cap"] == 20
        assert (d.daemon.control.execute("partition delete --partition=large", UID)
                == "Partition p1 is namespace pinned's")
        with pytest.raises(mpsd_client.InvalidValueError, match="is server other's"):
            async with mpsd_client.open_context(d.pipe_dir / "train", device=0,
                                                environ={"CUDA_MPS_SM_PARTITION": "theirs"}):
                pass


@pytest.mark.parametrize("devices, error", [
    ('[[servers.train.devices]]\nuuid = "{0}"\n[[servers.train.devices.sm_partitions]]\nname = "a"\nchunks = 12\n'
     '[[servers.train.devices.sm_partitions]]\nname = "b"\nchunks = 6\n',
     "servers.train's SM partition b: Not enough free chunks on device 0: 4 free, 6 asked"),
    ('[servers.train.namespaces.n]\n[[servers.train.namespaces.n.devices]]\nuuid = "GPU-nowhere"\n',
     "servers.train.namespaces.n.devices names no device of this daemon: GPU-nowhere"),
])
async def test_the_a_files_devices_must_be_the_daemons_and_its_partitions_fit(tmp_path, devices, error):
    """A partition that does not fit its device, or a namespace's device the daemon lacks, stops the start."""
    from mpsd.daemon.config import load_config
    from mpsd.daemon.inprocess import open_daemon
    from mpsd.daemon.server import DaemonError

    path = tmp_path / "mps.toml"
    path.write_text(f'schema_version = "1.0"\n[servers.train]\nuid = {UID}\n'
                    + devices.format(device_properties(H200, 0)["uuid"]))
    config = load_config(["--pipe-dir", str(tmp_path / "p"), "--log-dir", str(tmp_path / "l"), "--protocol", "3",
                          "--apply", str(path)], environ={})
    with pytest.raises(DaemonError, match=re.escape(error)):  # as the Daemon is built, before it serves
        async with open_daemon(config):
            pass
