# Under --policy mig each GPU instance owns its profile's eighths of the device's memory: its clients see that
# memory as the total (as a MIG instance reports it), share it among themselves, and cannot allocate past it,
# while the other instances' memory stays untouched. Expected figures come from the model's own tables.
from __future__ import annotations

import subprocess
import sys

import pytest

import mpsd_client
from daemons import start_daemon
from test_daemon import wait_for_log
from mpsd.runtime.memory import CHUNK
from mpsd.sim import H200, MIG_PROFILES

LAYOUT = ("3g.71gb", "1g.18gb")


def _instance_memory(profile: str) -> int:
    return H200.total_memory * MIG_PROFILES[profile][2] // 8


@pytest.fixture
def mig(daemon_factory):
    d = start_daemon("--time-scale", "100", "--policy", "mig", "--mig-partitions", ",".join(LAYOUT))
    daemon_factory.append(d)
    return d


def _connect(daemon, monkeypatch, partition: int):
    monkeypatch.setenv("MPSD_MIG_PARTITION", str(partition))
    return mpsd_client.connect(daemon.pipe_dir)


@pytest.mark.parametrize("partition", [0, 1])
def test_a_client_sees_its_instance_memory(mig, monkeypatch, partition):
    """total_memory and mem_get_info's total are the instance's; free is that less the context's charge."""
    with _connect(mig, monkeypatch, partition) as ctx:
        total = _instance_memory(LAYOUT[partition])
        assert ctx.device_properties()["total_memory"] == total
        assert ctx.mem_get_info() == (total - H200.context_memory, total)


def test_a_client_cannot_allocate_past_its_instance(mig, monkeypatch):
    """An allocation larger than what is free in the instance fails; one that fits succeeds and fills it."""
    with _connect(mig, monkeypatch, 1) as ctx:
        free, _ = ctx.mem_get_info()
        with pytest.raises(mpsd_client.OutOfMemoryError, match="MIG instance"):
            ctx.malloc(free + 1)
        ctx.malloc(free // CHUNK * CHUNK)
        assert ctx.mem_get_info()[0] < CHUNK
        with pytest.raises(mpsd_client.OutOfMemoryError):
            ctx.malloc(CHUNK)


def test_clients_of_one_instance_share_it_and_others_are_untouched(mig, monkeypatch):
    """What one client of an instance allocates is gone for its neighbours there, not for another instance's
    clients; it comes back when the client exits."""
    with _connect(mig, monkeypatch, 1) as first, _connect(mig, monkeypatch, 1) as second, \
            _connect(mig, monkeypatch, 0) as other:
        free_second, free_other = second.mem_get_info()[0], other.mem_get_info()[0]
        taken = free_second // 2 // CHUNK * CHUNK
        first.malloc(taken)
        assert second.mem_get_info()[0] == free_second - taken
        assert other.mem_get_info()[0] == free_other
        with pytest.raises(mpsd_client.OutOfMemoryError):
            second.malloc(free_second - taken + CHUNK)
        first.close()
        wait_for_log(mig, "disconnected; reclaimed 1 allocations")  # the daemon has seen it go
        assert second.mem_get_info()[0] == free_second + H200.context_memory


def test_a_pinned_limit_still_tightens_inside_an_instance(mig, monkeypatch):
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT caps a client below its instance's memory; the total stays the
    instance's."""
    monkeypatch.setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=2G")
    with _connect(mig, monkeypatch, 0) as ctx:
        assert ctx.mem_get_info() == ((2 << 30) - H200.context_memory, _instance_memory(LAYOUT[0]))


def test_an_instance_without_room_for_a_context_refuses_the_client(daemon_factory, monkeypatch):
    """When a 1g instance's clients have taken all its memory, the next client cannot create a context."""
    d = start_daemon("--time-scale", "100", "--policy", "mig", "--mig-partitions", "1g.18gb")
    daemon_factory.append(d)
    with _connect(d, monkeypatch, 0) as hog:
        hog.malloc(hog.mem_get_info()[0] // CHUNK * CHUNK)
        with pytest.raises(mpsd_client.OutOfMemoryError, match="MIG instance 0"):
            _connect(d, monkeypatch, 0)


def test_cuda_visible_devices_names_a_mig_device(mig, monkeypatch):
    """nvidia-smi -L lists each instance's MIG UUID under its GPU; CUDA_VISIBLE_DEVICES takes it (or the older
    MIG-GPU-<uuid>/<gi>/<ci>) and binds the client to that instance, as CUDA enumerates a MIG device; one that
    names no instance is no device."""
    listed = subprocess.run([sys.executable, "-m", "mpsd.tools.smi", "--pipe-dir", str(mig.pipe_dir), "-L"],
                            capture_output=True, text=True, timeout=30).stdout.splitlines()
    assert listed[0].startswith("GPU 0: NVIDIA H200 (UUID: GPU-")
    gpu = listed[0].split("UUID: ")[1].rstrip(")")
    assert [line.split(": (UUID: ")[0] for line in listed[1:]] == ["  MIG 3g.71gb     Device  0",
                                                                   "  MIG 1g.18gb     Device  1"]
    migs = [line.split("UUID: ")[1].rstrip(")") for line in listed[1:]]
    for visible in (migs[1], migs[1][:12], f"MIG-{gpu}/1/0"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        with mpsd_client.connect(mig.pipe_dir) as ctx:
            assert ctx.device_properties()["total_memory"] == _instance_memory(LAYOUT[1])
    for visible in ("MIG-ffffffff", f"MIG-{gpu}/2/0", f"MIG-{gpu}/1/1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        with pytest.raises(mpsd_client.NoDeviceError):
            mpsd_client.connect(mig.pipe_dir)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", migs[0])
    monkeypatch.setenv("MPSD_MIG_PARTITION", "1")
    with pytest.raises(mpsd_client.InvalidValueError, match="disagree"):
        mpsd_client.connect(mig.pipe_dir)
