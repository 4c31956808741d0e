"""Copies between two simulated devices: over NVLink between peers, staged through host memory between devices
that are not (peer access off, or MIG on either), and which route each took in the client's statistics.
In-process tier: the daemon in the test's trio loop, trio clients, the autojump clock."""
from __future__ import annotations

import numpy as np
import pytest

from inproc import in_process_daemon
from mpsd.sim import H200
from mpsd_client import IllegalAddressError, InvalidDeviceError, InvalidValueError, PeerAccessUnsupportedError

N = 16 << 20  # bytes a copy moves


def nvlink_ms(nbytes: int) -> float:
    return (H200.peer_copy_latency + nbytes / H200.nvlink_bandwidth) * 1e3


def staged_ms(nbytes: int) -> float:
    return (2 * H200.copy_latency + nbytes / H200.pcie_bandwidth) * 1e3


async def _timed_peer_copy(dst_ctx, src_ctx, nbytes: int) -> tuple[float, np.ndarray]:
    """Fill a buffer on `src_ctx`'s device, copy it into `dst_ctx`'s with memcpy_peer between two events; the
    copy's simulated milliseconds and the bytes that arrived."""
    src = await src_ctx.malloc(nbytes)
    await src_ctx.launch("fill_f32", nbytes // 4 // 256, 256, [src, 3.0, nbytes // 4])
    await src_ctx.synchronize()
    dst = await dst_ctx.malloc(nbytes)
    start, end = await dst_ctx.create_event(), await dst_ctx.create_event()
    await start.record()
    await dst_ctx.memcpy_peer(dst, src_ctx, src, nbytes)
    await end.record()
    await end.synchronize()
    out = np.empty(nbytes // 4, np.float32)
    await dst_ctx.memcpy_dtoh(out, dst)
    return await start.elapsed_ms(end), out


@pytest.mark.parametrize("peer_access, route, expected", [("all", "peer_copies_nvlink", nvlink_ms),
                                                          ("none", "peer_copies_staged", staged_ms)])
async def test_memcpy_peer_takes_nvlink_between_peers_and_the_host_between_others(
        autojump_clock, peer_access, route, expected):
    """memcpy_peer from device 0 to device 1 moves the bytes in the time its route takes (NVLink's bandwidth, or
    PCIe's with both legs' latencies), and the statistics count the route."""
    async with in_process_daemon("--devices", "h200:2", "--peer-access", peer_access) as d:
        async with d.connect(device=0) as gpu0, d.connect(device=1) as gpu1:
            ms, out = await _timed_peer_copy(gpu1, gpu0, N)
            assert (out == 3.0).all()
            assert ms == pytest.approx(expected(N), rel=1e-9)
            stats = await gpu1.statistics()
            other = "peer_copies_staged" if route == "peer_copies_nvlink" else "peer_copies_nvlink"
            assert (stats[route], stats[other], stats["bytes_copied_peer"]) == (1, 0, N)
            assert (await gpu0.statistics())["bytes_copied_peer"] == 0  # the copy was device 1's


async def test_nvlink_is_faster_than_staging_by_the_links_ratio(autojump_clock):
    """The same 256 MiB copy over NVLink and staged: their times differ by about the bandwidths' ratio."""
    times = {}
    for peer_access in ("all", "none"):
        async with in_process_daemon("--devices", "h200:2", "--peer-access", peer_access) as d:
            async with d.connect(device=0) as gpu0, d.connect(device=1) as gpu1:
                times[peer_access], _ = await _timed_peer_copy(gpu1, gpu0, 256 << 20)
    assert times["none"] / times["all"] == pytest.approx(H200.nvlink_bandwidth / H200.pcie_bandwidth, rel=0.01)


async def test_a_device_copy_from_memory_opened_over_peer_access_goes_over_nvlink(autojump_clock):
    """memcpy_dtod on device 1 from memory opened from device 0's IPC handle is a peer copy: NVLink's time, and
    counted so; a copy within device 1 is not."""
    async with in_process_daemon("--devices", "h200:2", shared_process=True) as d:
        async with d.connect(device=0) as gpu0, d.connect(device=1) as gpu1:
            src = await gpu0.malloc(N)
            await gpu0.memset(src, 7, N)
            await gpu0.synchronize()
            mapped = await gpu1.ipc_open_mem_handle(await gpu0.ipc_get_mem_handle(src))
            dst = await gpu1.malloc(N)
            start, end = await gpu1.create_event(), await gpu1.create_event()
            await start.record()
            await gpu1.memcpy_dtod(dst, mapped, N)
            await end.record()
            await end.synchronize()
            assert await start.elapsed_ms(end) == pytest.approx(nvlink_ms(N), rel=1e-9)
            await gpu1.memcpy_dtod(dst, dst + N // 2, N // 2)  # within the device: a copy kernel
            await gpu1.synchronize()
            out = np.empty(N, np.uint8)
            await gpu1.memcpy_dtoh(out, dst)
            assert (out == 7).all()
            stats = await gpu1.statistics()
            assert (stats["peer_copies_nvlink"], stats["peer_copies_staged"], stats["bytes_copied_peer"]) == (1, 0, N)
            await gpu1.ipc_close_mem_handle(mapped)


async def test_a_device_running_mig_has_no_peers(autojump_clock, tmp_path):
    """MIG has no peer-to-peer access: an IPC handle of device 0 does not open on a MIG device 1, and a copy
    between them is staged, though the daemon's peer access is on."""
    config = tmp_path / "mpsd.toml"
    config.write_text('[mpsd]\ndevices = "h200:2"\n\n[mpsd.device.1]\npolicy = "mig"\n'
                      'mig-partitions = ["3g.71gb", "3g.71gb"]\n')
    async with in_process_daemon("--config", str(config), shared_process=True) as d:
        async with d.connect(device=0) as gpu0, d.connect(device=1) as gpu1:
            src = await gpu0.malloc(N)
            with pytest.raises(PeerAccessUnsupportedError):
                await gpu1.ipc_open_mem_handle(await gpu0.ipc_get_mem_handle(src))
            ms, _ = await _timed_peer_copy(gpu1, gpu0, N)
            assert ms == pytest.approx(staged_ms(N), rel=1e-9)
            assert (await gpu1.statistics())["peer_copies_staged"] == 1


async def test_memcpy_peer_needs_a_live_source_context_and_range(autojump_clock):
    """A source range outside the source context's allocations is cudaErrorInvalidValue, and a source context that
    has failed (a sticky error) is cudaErrorInvalidDevice, as the call returns (as cudaMemcpyPeerAsync's argument
    checks); the destination is untouched."""
    async with in_process_daemon("--devices", "h200:2") as d:
        async with d.connect(device=0) as gpu0, d.connect(device=1) as gpu1:
            dst = await gpu1.malloc(N)
            await gpu1.memset(dst, 1, N)
            src = await gpu0.malloc(N)
            with pytest.raises(InvalidValueError, match="not inside one live allocation of device 0"):
                await gpu1.memcpy_peer(dst, gpu0, src + N, N)  # past the source's allocation
            await gpu0.launch("fill_f32", 1, 32, [src + 2 * N, 0.0, 32])  # an illegal address: sticky on gpu0
            with pytest.raises(IllegalAddressError):
                await gpu0.synchronize()
            with pytest.raises(InvalidDeviceError, match="no usable context of this process"):
                await gpu1.memcpy_peer(dst, gpu0, src, N)
            out = np.empty(N, np.uint8)
            await gpu1.memcpy_dtoh(out, dst)
            assert (out == 1).all()
            assert (await gpu1.statistics())["bytes_copied_peer"] == 0
