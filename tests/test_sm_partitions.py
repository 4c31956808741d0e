# Static SM partitioning (MPS's -S, CUDA_MPS_SM_PARTITION): partitions of 8-SM chunks made with
# `sm_partition add`, listed by `lspart`, and a client pinned to its partition's SMs through the simulator's
# SM window (the one the mig policy pins a MIG instance's clients with). The simulator's trace says on which
# SM every block ran: clients of disjoint partitions never share one. The texts are mpsd's guesses
# (mpsd/daemon/sm_partitions.py lists them).
from __future__ import annotations

import os

import pytest
import trio
import trio.testing

import mpsd_client
from inproc import in_process_daemon
from mpsd.sim import H200, Kernel, Simulator, kernel_cost

UID = os.getuid()
SPIN = 1.98e6  # cycles: 1 ms at the H200's clock
SPIN_COST = kernel_cost(H200, "spin", 264, 1024, [int(SPIN)])


def _sms_of(trace, client: int) -> set[int]:
    return {group.sm for group in trace if group.op.client == client}


async def _sms_by_partition(d, *clients) -> dict[str, set[int]]:
    """Each client runs a full-device grid at once; the SMs each one's blocks ran on, by its partition's id."""
    for ctx in clients:
        await ctx.launch("spin", 264, 1024, [int(SPIN)])
    for ctx in clients:
        await ctx.synchronize()
    trace = d.daemon.devices[0].backend.sim.trace
    return {ctx.sm_partition.id: _sms_of(trace, ctx.id) for ctx in d.daemon.devices[0].contexts.values()}


def test_the_engine_keeps_a_pinned_client_on_its_window():
    """Under mps, a client given SMs 0-15 and one given 16-47 each fill their window and nothing else, while
    an unpinned client may use any SM."""
    sim = Simulator(record=True)
    sim.configure_client(1, sms=(0, 16))
    sim.configure_client(2, sms=(16, 32))
    for client in (1, 2, 3):
        sim.submit(Kernel(client=client, stream=0, blocks=264, threads=1024, cost=SPIN_COST))
    sim.run()
    assert _sms_of(sim.trace, 1) == set(range(16))
    assert _sms_of(sim.trace, 2) == set(range(16, 48))
    assert len(_sms_of(sim.trace, 3)) > 48
    with pytest.raises(ValueError, match="within the device"):
        sim.configure_client(4, sms=(128, 8))  # 128..135 on 132 SMs
    with pytest.raises(ValueError, match="needs the mps policy"):
        Simulator(policy="fair").configure_client(1, sms=(0, 8))


async def test_sm_partition_add_rm_and_lspart():
    """sm_partition add prints the new partition's id, lspart lists them, rm removes one without clients;
    the chunks are 8 SMs (16 on an H200, its last 4 SMs in none); errors say why and change nothing."""
    async with in_process_daemon("-S", "--time-scale", "100") as d:
        run = d.daemon.control.execute
        uuid = d.daemon.devices[0].properties["uuid"]
        assert H200.sm_count // 8 == d.daemon.sm_partitions.chunk_counts[0] == 16
        assert run("lspart", UID) == ""
        assert run("sm_partition add 0 2", UID) == "p0"
        assert run(f"sm_partition add {uuid} 4", UID) == "p1"
        assert run("sm_partition add 0 11", UID) == "Not enough free chunks on device 0: 10 free, 11 asked"
        assert run("sm_partition add 0 17", UID) == "Invalid number of chunks 17: device 0 has 16 of 8 SMs"
        assert run("sm_partition add 3 1", UID) == 'Invalid device "3"'
        assert run("sm_partition add 0 x", UID) == 'Invalid number of chunks "x"'
        assert run("sm_partition", UID).startswith("Usage: sm_partition add")
        assert run("lspart", UID).splitlines() == [
            "ID      DEVICE                                      CHUNKS  SMS   FIRST_SM  CLIENTS",
            f"p0      {uuid:<44}2       16    0         0",
            f"p1      {uuid:<44}4       32    16        0",
        ]
        assert run("sm_partition rm p0", UID) == ""
        assert run("sm_partition rm p0", UID) == "Partition p0 not found"
        assert run("sm_partition add 0 1", UID) == "p2"  # the lowest free chunk: chunk 0 again
        assert "SM partition p2 added on device 0: chunks 0-0, SMs 0-7" in (d.log_dir / "control.log").read_text()
    async with in_process_daemon("--time-scale", "100") as d:  # without -S
        # As the H200's tool without -S answered (bench/fidelity/mps_control_h200's records 44 and 46).
        assert d.daemon.control.execute("lspart", UID) == 'Unknown command "lspart"'
        assert d.daemon.control.execute("sm_partition add 0 1", UID) == 'Unknown command "sm_partition"'


async def test_clients_of_disjoint_partitions_never_share_an_sm(tmp_path):
    """Two clients pinned to disjoint partitions run full-device grids at once: the simulator's trace shows
    each on its own partition's SMs only; a partition with clients cannot be removed; a client naming no such
    partition is refused with cudaErrorInvalidValue."""
    async with in_process_daemon("-S", "--time-scale", "100", "--trace", str(tmp_path / "t.json")) as d:
        run = d.daemon.control.execute
        assert (run("sm_partition add 0 3", UID), run("sm_partition add 0 5", UID)) == ("p0", "p1")
        async with d.connect(CUDA_MPS_SM_PARTITION="p0") as a, d.connect(CUDA_MPS_SM_PARTITION="p1") as b:
            assert a.quotas["sm_cap"] == 24 and b.quotas["sm_cap"] == 40
            used = await _sms_by_partition(d, a, b)
            assert used["p0"] == set(range(24)) and used["p1"] == set(range(24, 64))
            assert run("sm_partition rm p1", UID) == "Partition p1 has 1 client(s)"
            assert run("lspart", UID).splitlines()[1].split()[-1] == "1"
        with pytest.raises(mpsd_client.InvalidValueError, match="no SM partition 'p9'"):
            async with d.connect(CUDA_MPS_SM_PARTITION="p9"):
                pass


def test_mpsd_control_dash_S_starts_a_partitioning_daemon():
    """nvidia-cuda-mps-control -d -S (mpsd-control here) starts a daemon that takes sm_partition on stdin."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from daemons import short_tempdir

    pipe = short_tempdir() / "pipe"
    tool = [str(Path(sys.executable).parent / "mpsd-control")]
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(pipe.parent / "log")}
    try:
        assert subprocess.run([*tool, "-d", "-S", "--time-scale", "100"], env=env, timeout=60).returncode == 0
        out = subprocess.run(tool, input="sm_partition add 0 16\nlspart\n", capture_output=True, text=True,
                             env=env, timeout=60).stdout
        assert out.splitlines()[0] == "p0" and out.splitlines()[2].split()[2:5] == ["16", "128", "0"]
    finally:
        subprocess.run(tool, input=b"quit\n", env=env, timeout=60)
        shutil.rmtree(pipe.parent, ignore_errors=True)


async def test_v3_partition_module_keeps_the_legacy_commands_partitions(tmp_path):
    """MPS v3's `partition create|delete|list` on a -S daemon works on the same partitions as sm_partition and
    lspart: each sees, and may remove, what the other made; a partition may have a name, which
    CUDA_MPS_SM_PARTITION takes as well as the id; include_remainder's partition lies at the device's end and
    holds its last 4 SMs too; failures set the "!" flag and change nothing; only root or the owner may change."""
    async with in_process_daemon("-S", "--protocol", "3", "--time-scale", "100",
                                 "--trace", str(tmp_path / "t.json")) as d:
        control = d.daemon.control

        def run(line: str, uid: int = UID) -> tuple[str, bool]:
            return control.execute(line, uid), control.failed

        uuid = d.daemon.devices[0].properties["uuid"]
        assert run("partition list") == ("", False)
        assert run("partition create --device=0 --chunks=2 --name=big") == ("p0", False)
        assert run("sm_partition add 0 1") == ("p1", False)
        assert run(f"partition create --device={uuid} --chunks=2 --include-remainder") == ("p2", False)
        assert run("partition create --device=0 --chunks=1 --include-remainder") == (
            "The SMs past device 0's last chunk are already a partition's", True)
        assert run("partition create --device=0 --chunks=1 --name=big") == ('Partition "big" already exists', True)
        assert run("partition create --device=0 --chunks=1 --name=p7")[0].startswith('Invalid partition name "p7"')
        assert run("partition create --device=4 --chunks=1") == ('Invalid device "4"', True)
        assert run("partition create --device=0") == (
            "Usage: partition create --device=DEV --chunks=N [--name=NAME] [--include-remainder]", True)
        assert run("partition create --device=0 --chunks=1", uid=UID + 1)[0].startswith("Permission denied")
        listing = run("partition list")[0].splitlines()
        assert listing[0].split() == ["ID", "NAME", "DEVICE", "CHUNKS", "SMS", "FIRST_SM", "SERVER", "CLIENTS"]
        assert [line.split() for line in listing[1:]] == [
            ["p0", "big", uuid, "2", "16", "0", "-", "0"],
            ["p1", "-", uuid, "1", "8", "16", "-", "0"],
            ["p2", "-", uuid, "2", "20", "112", "-", "0"],  # chunks 14-15 and the 4 SMs past them
        ]
        assert [line.split()[0] for line in run("lspart")[0].splitlines()[1:]] == ["p0", "p1", "p2"]
        async with d.connect(CUDA_MPS_SM_PARTITION="big") as a, d.connect(CUDA_MPS_SM_PARTITION="p2") as b:
            assert (a.quotas["sm_cap"], b.quotas["sm_cap"]) == (16, 20)
            used = await _sms_by_partition(d, a, b)
            assert used["p0"] == set(range(16)) and used["p2"] == set(range(112, 132))
            assert run("partition delete --partition=big") == ("Partition p0 has 1 client(s)", True)
            assert run("partition list --device=0")[0].splitlines()[1].split()[-1] == "1"
        await trio.testing.wait_all_tasks_blocked()  # the daemon has seen both clients go
        assert run("partition delete --partition=big") == ("", False)
        assert run("sm_partition rm p2") == ("", False)  # the legacy command removes a v3 partition
        assert run("partition delete --partition=p1") == ("", False)
        assert run("partition delete --partition=p1") == ("Partition p1 not found", True)
        assert run("partition list") == ("", False)
    async with in_process_daemon("--protocol", "3", "--time-scale", "100") as d:  # no static partitioning
        assert d.daemon.control.execute("partition list", UID).startswith("Static SM partitioning is off")
        assert d.daemon.control.failed
