# Device figures and the two pure functions every other module derives limits from.
# Kept apart from the engine so the daemon (quotas, device queries) can use them without a simulator;
# `block_need` is the single place that turns a launch shape into per-SM resource units, so the
# occupancy calculator and the engine's SM accounting can never disagree.
"""Device specifications, occupancy and MPS SM caps."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["H200", "BlockNeed", "DeviceSpec", "block_need", "occupancy", "sm_cap"]


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """Static figures of one GPU model (see ``H200`` for the calibrated values).

    Memory figures are what the CUDA runtime reports and charges: ``total_memory`` is
    ``cudaDeviceProp.totalGlobalMem`` (also cudaMemGetInfo's total), ``context_memory`` what one client
    context costs against its pinned limit and the device, ``server_memory`` what the MPS server itself holds.
    """

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    sms_per_tpc: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    regs_per_sm: int
    max_threads_per_block: int
    max_block_dims: tuple[int, int, int]
    max_grid_dims: tuple[int, int, int]
    warp_size: int
    smem_per_sm: int
    max_smem_per_block: int
    smem_reserved_per_block: int
    reg_alloc_unit: int
    clock_hz: float
    total_memory: int
    mem_bandwidth: float
    pcie_bandwidth: float
    copy_latency: float
    kernel_overhead: float
    sm_issue_rate: float
    saturation_threads: int
    context_memory: int = 0
    server_memory: int = 0
    # The least time a block takes: dispatch and retirement are never free. Not a measurement; it keeps
    # simulated time moving, so a grid of empty blocks cannot make one instant last forever.
    min_block_time: float = 1e-7
    # Host time a tenant pays around the device's work, outside the GPU: its launch call, as the work reaches
    # the device when the call returns (``launch_latency``; the device's own ``kernel_overhead`` follows), and
    # from the kernel's end until its synchronise returns (``sync_latency``). Those are a thread's figures
    # after a long idle time; back to back it pays the ``_busy`` ones, and ``host_cooling`` is the time
    # constant of the change between them (``mpsd.clock.host.HostThread``; 0: one figure). Only virtual-time
    # answers to "what does a tenant observe" add them (``mpsd simulate``, mpsd-stress --virtual-time,
    # bench/fidelity): the daemon's clients are real processes and pay real host time.
    launch_latency: float = 0.0
    sync_latency: float = 0.0
    launch_latency_busy: float = 0.0
    sync_latency_busy: float = 0.0
    host_cooling: float = 0.0
    # Host time of a cudaMalloc or a cudaFree call (half of a pair's), and of any other runtime call the model
    # has no figure of its own for (stream and event management, queries, attributes).
    alloc_call_latency: float = 0.0
    call_latency: float = 0.0
    # DRAM bandwidth that memory-bound blocks reach together, against the threads they hold resident:
    # (threads, bytes/s) points, ascending, linear between them and from (0, 0), flat past the last. Such
    # blocks share it in proportion to their threads (simcore/src/dram.rs). Empty: each block instead
    # moves its bytes at its share of ``mem_bandwidth`` by the slots it holds, whatever else runs. An SM's
    # threads past ``dram_knee`` count ``dram_beyond`` each on the curve's axis (more threads on one SM
    # add less than on another SM).
    dram_curve: tuple[tuple[float, float], ...] = ()
    dram_knee: int = 0
    dram_beyond: float = 1.0
    # Device-to-device copies and memsets are kernels the runtime launches (``mpsd.sim.costs.copy_kernel``):
    # (kind, bytes of DRAM traffic a byte on the curve stands for, weight of a thread on the curve's axis),
    # as a copy kernel moves more than c = a + b at the top of the curve and keeps more bytes in flight per
    # thread below it. A kind not here moves its traffic as ``fill_f32`` does.
    copy_kernels: tuple[tuple[str, float, float], ...] = ()
    # A PCIe copy engine's time slice between streams (``mpsd.sim.copies``); 0: each copy runs to its end.
    copy_timeslice: float = 0.0
    # The fraction of its bandwidth each direction's engine gets while the other direction's runs.
    copy_duplex: tuple[tuple[str, float], ...] = ()
    # A copy call's host time, by kind, as a fraction of a kernel launch call's (``launch_latency`` and its
    # busy figure; ``mpsd.clock.host``); a kind not here costs what a launch does.
    copy_calls: tuple[tuple[str, float], ...] = ()
    # A graph launch call's host time (cudaGraphLaunch), whatever the graph's size, as a fraction of a kernel
    # launch call's, as ``copy_calls`` are.
    graph_launch_call: float = 1.0
    # The device's launch overhead of a kernel node of a launched graph, in place of ``kernel_overhead``: a graph's
    # work is handed to the device whole, so its nodes do not pay a launch each. None: the same as alone.
    graph_node_overhead: float | None = None
    # A cudaGraphInstantiate call's host time (0: call_latency's), whatever the graph's size.
    graph_instantiate_call: float = 0.0
    # A copy between this device and a peer over NVLink: its bytes/s each way (0: the device has no NVLink)
    # and its fixed cost. Between devices that are not peers a copy is staged through host memory at
    # ``pcie_bandwidth`` (simcore/src/copies.rs says how).
    nvlink_bandwidth: float = 0.0
    peer_copy_latency: float = 0.0


def dram_threads(spec: DeviceSpec, threads: int) -> float:
    """Where an SM holding ``threads`` threads of memory-bound blocks counts on ``spec.dram_curve``'s axis."""
    knee = spec.dram_knee
    return float(threads) if not knee or threads <= knee else knee + spec.dram_beyond * (threads - knee)


def dram_bandwidth(spec: DeviceSpec, threads: float) -> float:
    """Bytes/s that memory-bound blocks counting ``threads`` on the axis of ``spec.dram_curve`` reach
    together."""
    lo_t, lo_b = 0.0, 0.0
    for t, b in spec.dram_curve:
        if threads <= t:
            return lo_b + (b - lo_b) * (threads - lo_t) / (t - lo_t)
        lo_t, lo_b = t, b
    return lo_b


H200 = DeviceSpec(
    name="NVIDIA H200",
    compute_capability=(9, 0),
    sm_count=132,
    sms_per_tpc=2,
    max_threads_per_sm=2048,
    max_blocks_per_sm=32,
    regs_per_sm=65536,
    max_threads_per_block=1024,
    max_block_dims=(1024, 1024, 64),
    max_grid_dims=(2**31 - 1, 65535, 65535),
    warp_size=32,
    smem_per_sm=228 * 1024,
    max_smem_per_block=227 * 1024,
    smem_reserved_per_block=1024,
    reg_alloc_unit=256,
    clock_hz=1.98e9,
    # Measured on an H200 under MPS (bench/fidelity/h200_memory.json): totalGlobalMem, and the memory a
    # client context is charged against its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (the same for 600M..4G limits);
    # without a limit a lone client saw 619,511,808 bytes gone, the rest being the server's own.
    total_memory=150_109_880_320,
    context_memory=538_339_472,
    server_memory=619_511_808 - 538_339_472,
    mem_bandwidth=4.8e12,
    pcie_bandwidth=55e9,
    copy_latency=2e-6,
    # bench/fidelity/compare.py --calibration derives these from bench/fidelity/h200_copies.json and
    # h200_copies2.json (runs 7 and 8): the time slice from a 64-KiB copy launched back to back beside a stream
    # of 256-MiB ones (one slice and the small copy between its launches); the two directions' shares of the
    # link from streams of 256-MiB copies both ways at once (runs 7 and 9, the means of figures that differed
    # between runs: 0.56 to 0.82 for host to device); the copy kernels' figures from
    # 256-MiB copies and memsets alone (traffic) and under MPS at active thread percentages 10, 25 and 50
    # (weight); the calls from copies launched back to back, against the launch call of an empty kernel.
    copy_timeslice=1.0555e-3,
    copy_duplex=(("d2h", 0.946), ("h2d", 0.715)),
    copy_kernels=(("d2d", 1.1665, 1.364), ("memset", 1.4433, 0.716)),
    copy_calls=(("d2d", 0.892), ("d2h", 0.403), ("h2d", 0.432), ("memset", 0.399)),
    # 100 empty kernels cost the host 483 us launched one by one through the driver and 2.0 us as one graph launch
    # (h200-runtime-measurements.md, CUDA graphs): a graph launch is 2.0 / 4.83 of one launch call. One graph's
    # figure only: how the call grows with the graph's nodes was not measured, so it does not grow here.
    graph_launch_call=2.0 / 4.83,
    # 0.69 us a node in a graph of empty kernels on the H200 (h200-runtime-measurements.md, issue 30: 0.79 us under
    # MPS, which the model does not tell apart), less the model's 0.1 us least block time. The same 100 nodes took
    # 53 us between events there, and 264-block kernels of 10 us 1090 us (bench/graph_launch.py sets the model's
    # figures beside them): one figure cannot give both, and this one sits between.
    graph_node_overhead=0.59e-6,
    # Instantiating that 100-node graph took about 155 us (439 us the first time in the process, which the model
    # does not keep apart); one graph's figure, as graph_launch_call's is.
    graph_instantiate_call=155e-6,
    # NVLink 4 as NVIDIA's H200 datasheet gives it: 900 GB/s a GPU, both directions together (18 links), so
    # 450 GB/s each way. A nominal figure, not a measurement (no two-GPU H200 has been lent to measure one):
    # copies a real one makes will reach less. Its latency is taken as the PCIe engines' (copy_latency).
    nvlink_bandwidth=450e9,
    peer_copy_latency=2e-6,
    # The device's gap between back-to-back kernels of one stream, from CUDA-event timings on a real H200
    # (bench/fidelity/h200_timing_extra.json and h200_timing_repeat.json, "1 tenant alone", both modes;
    # bench/fidelity/compare.py --calibration derives it): time per kernel less the spin's cycles at the
    # measured clock ("clock, 1 block", about 1.979 GHz). Over "100 x FULL spin 0.05 ms" and "50 x FULL spin
    # 0.2 ms", where a 0.1% clock error moves it by 0.2 us at most, that is 2.05 us at the median (1.7 to
    # 2.5 us, 8 figures), here rounded to the spread's precision; the rows of longer kernels agree
    # within their clock error ("100 x FULL spin 1 ms": 0.9 to 2.2 us; "50 x (FULL 0.05 ms + QUARTER 1 ms)
    # spin": 1.7 to 3.2 us a kernel). "empty kernel back to back" (5.6 to 8.9 us a kernel) measures the
    # host's launch rate instead: CuPy's launch call alone took 5.3 to 7.8 us ("empty kernel, back to back",
    # launch_call_ms p50), so the device never had a queue to drain.
    kernel_overhead=2e-6,
    sm_issue_rate=2 * 1024 * 93638 / 1e-3,
    saturation_threads=1024,
    # Calibrated on a real H200 (bench/fidelity/measure_timing.py; bench/fidelity/compare.py --calibration
    # derives them). Idle: a 1-block empty kernel, launched and synchronised from CuPy after a 5 ms sleep,
    # alone, took 0.0643 ms at the median, its launch call 0.0561 ms (means of two runs x with/without MPS,
    # h200_timing_extra.json and h200_timing_repeat.json); the call is the launch, the rest less the model's
    # device time (kernel_overhead + min_block_time) the synchronise. Busy: the same back to back took 0.0112
    # ms, its call 0.0064 ms (h200_timing_host.json, both modes). Cooling: the same after idle times of 20 us
    # to 5 ms, spent asleep or spinning (same file), rose from the one figure to the other as
    # 1 - exp(-idle / 1.14 ms), fitted over both modes; MPS rose later and steeper, without MPS sooner.
    launch_latency=56.1e-6,
    sync_latency=6.65e-6,
    launch_latency_busy=6.39e-6,
    sync_latency_busy=2.67e-6,
    host_cooling=1.14e-3,
    # A cudaMalloc+cudaFree pair of 1 MiB took 101 us of host time (h200-runtime-measurements.md; 222 us at
    # 64 MiB: the model keeps the small figure). Other calls were not measured: they cost what a warm launch
    # call does.
    alloc_call_latency=50.5e-6,
    call_latency=6.39e-6,
    # c = a + b on a real H200 (bench/fidelity/h200_bandwidth.json; compare.py --calibration derives these).
    # Alone in one wave of 1 to 132 blocks of 1024 threads, one to an SM (both modes' mean): 31 GB/s a block,
    # linear to 16 blocks, bending to 2.69 TB/s. 256-thread blocks reached what as many threads in 1024-thread
    # blocks did, up to 512 threads an SM. Two 1024-thread blocks to an SM reach less: under MPS at ATP 50,
    # 66 SMs of two blocks reached what 66 x 1.86 SMs of one would, so an SM's second 1024 threads count 0.861.
    # Every SM with two (264 blocks): 3.64 TB/s, the last point; the nominal 4.8 TB/s is never reached.
    dram_curve=((1024, 31.1e9), (2048, 60.2e9), (4096, 119.1e9), (8192, 234.7e9), (16384, 453.2e9),
                (33792, 902.8e9), (67584, 1638.6e9), (135168, 2690.8e9), (251521, 3636.1e9)),
    dram_knee=1024,
    dram_beyond=0.861,
)


@dataclass(frozen=True, slots=True)
class BlockNeed:
    """What one resident block takes from its SM, in allocation units.

    Attributes:
        warps: warps (threads rounded up to whole warps).
        regs: registers (allocated per warp, rounded up to the allocation unit).
        smem: shared memory bytes, including the driver's per-block reservation.
    """

    warps: int
    regs: int
    smem: int


def block_need(
    spec: DeviceSpec, threads_per_block: int, regs_per_thread: int = 32, smem_per_block: int = 0
) -> BlockNeed:
    """Resources one block of this shape occupies on an SM.

    Args:
        spec: the device.
        threads_per_block: threads in one block (>= 1).
        regs_per_thread: registers each thread uses (>= 0).
        smem_per_block: dynamic plus static shared memory per block, bytes (>= 0).

    Returns:
        The block's warps, registers and shared memory in allocation units.

    Raises:
        ValueError: a non-positive thread count or a negative register or shared-memory figure.
    """
    if threads_per_block < 1:
        raise ValueError(f"threads_per_block must be >= 1, got {threads_per_block}")
    if regs_per_thread < 0 or smem_per_block < 0:
        raise ValueError("regs_per_thread and smem_per_block must be >= 0")
    warps = -(-threads_per_block // spec.warp_size)
    unit = spec.reg_alloc_unit
    regs_per_warp = -(-(regs_per_thread * spec.warp_size) // unit) * unit
    return BlockNeed(warps, regs_per_warp * warps, smem_per_block + spec.smem_reserved_per_block)


def occupancy(
    spec: DeviceSpec, threads_per_block: int, regs_per_thread: int = 32, smem_per_block: int = 0
) -> int:
    """Resident blocks per SM for a launch shape, as the CUDA occupancy calculator gives it.

    Args:
        spec: the device.
        threads_per_block: threads in one block.
        regs_per_thread: registers per thread.
        smem_per_block: shared memory per block in bytes (the driver adds its reservation).

    Returns:
        The minimum of the block, thread, register and shared-memory limits; 0 if one block cannot fit
        (too many threads, registers or shared memory for one block).

    Raises:
        ValueError: as for ``block_need``.
    """
    need = block_need(spec, threads_per_block, regs_per_thread, smem_per_block)
    if threads_per_block > spec.max_threads_per_block or smem_per_block > spec.max_smem_per_block:
        return 0
    limits = [spec.max_blocks_per_sm, (spec.max_threads_per_sm // spec.warp_size) // need.warps]
    if need.regs:
        limits.append(spec.regs_per_sm // need.regs)
    limits.append(spec.smem_per_sm // need.smem)
    return min(limits)


def sm_cap(spec: DeviceSpec, active_thread_percentage: float) -> int:
    """SMs a client may occupy at once under an MPS active thread percentage.

    Args:
        spec: the device.
        active_thread_percentage: the client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, in (0, 100].

    Returns:
        floor(sm_count * pct / 100) rounded down to whole TPCs, at least one TPC, at most sm_count
        (on the H200: 25 -> 32, 50 -> 66, 100 -> 132).

    Raises:
        ValueError: the percentage is not in (0, 100].
    """
    pct = float(active_thread_percentage)
    if not 0.0 < pct <= 100.0:  # also rejects NaN
        raise ValueError(f"active thread percentage must be in (0, 100], got {active_thread_percentage}")
    tpc = spec.sms_per_tpc
    sms = math.floor(spec.sm_count * pct / 100.0 + 1e-9) // tpc * tpc
    return min(spec.sm_count, max(tpc, sms))
