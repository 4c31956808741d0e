"""Device figures, occupancy, SM caps and kernel cost models of mpsd.sim."""

import dataclasses
import math

import pytest

from mpsd.sim import H200, KERNEL_COSTS, BlockCost, block_need, kernel_cost, occupancy, sm_cap

SPIN_1MS = round(1e-3 * 1.98e9)


def test_h200_figures():
    """The H200 model carries the figures the CUDA runtime and the calibration runs report."""
    assert H200.name == "NVIDIA H200"
    assert H200.sm_count == 132
    assert H200.total_memory == 150_109_880_320  # totalGlobalMem on a real H200 (nvidia-smi says 143771 MiB)
    assert H200.sm_issue_rate == pytest.approx(2 * 1024 * 93638 / 1e-3)


def test_spec_is_frozen():
    """DeviceSpec is immutable."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        H200.sm_count = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("threads", "regs", "smem", "expected"),
    [
        (1024, 32, 0, 2),  # thread limit
        (256, 32, 0, 8),  # thread limit
        (32, 32, 0, 32),  # block limit
        (256, 64, 0, 4),  # register limit: 8 warps x 2048 registers
        (256, 255, 0, 1),  # 255 regs/thread round to 8192 per warp
        (128, 32, 100 * 1024, 2),  # shared memory limit, with the 1 KiB reservation
        (64, 32, 113 * 1024, 2),  # 2 x (113 + 1) KiB = 228 KiB fits exactly
        (1025, 32, 0, 0),  # too many threads per block
        (256, 32, 228 * 1024, 0),  # more shared memory than a block may have
        (33, 32, 0, 32),  # 33 threads round up to 2 warps: 64 warps / 2 = 32
    ],
)
def test_occupancy(threads, regs, smem, expected):
    """occupancy() is the minimum of the block, warp, register and shared-memory limits."""
    assert occupancy(H200, threads, regs, smem) == expected


def test_occupancy_rejects_nonsense():
    """Zero threads or negative registers are errors, not zero occupancy."""
    with pytest.raises(ValueError):
        occupancy(H200, 0)
    with pytest.raises(ValueError):
        occupancy(H200, 32, -1)


def test_block_need_rounds_to_warps_and_allocation_units():
    """A block's registers are allocated per warp in 256-register units; smem includes 1 KiB reserved."""
    need = block_need(H200, 40, 33, 10)
    assert need.warps == 2
    assert need.regs == 2 * 1280  # 33*32 = 1056 -> 1280
    assert need.smem == 1034


@pytest.mark.parametrize(
    ("pct", "expected"), [(25, 32), (50, 66), (100, 132), (0.5, 2), (1, 2), (10, 12), (99.9, 130)]
)
def test_sm_cap(pct, expected):
    """MPS caps SMs in whole TPCs, rounded down, at least one TPC."""
    assert sm_cap(H200, pct) == expected


@pytest.mark.parametrize("pct", [0, -5, 100.5, math.nan])
def test_sm_cap_rejects_out_of_range(pct):
    """Percentages outside (0, 100] are rejected."""
    with pytest.raises(ValueError):
        sm_cap(H200, pct)


def test_spin_cost_is_fixed_cycles():
    """spin(cycles) takes cycles / clock, not shared, and waits on the clock."""
    cost = kernel_cost(H200, "spin", 264, 1024, [SPIN_1MS])
    assert cost == BlockCost(SPIN_1MS / 1.98e9, clocked=True)
    for kinds in ({"shared": True, "clocked": True}, {"clocked": True, "dram": True}, {"shared": True, "dram": True}):
        with pytest.raises(ValueError, match="one at most"):
            BlockCost(1e-3, **kinds)
    assert cost.seconds == pytest.approx(1e-3)


def test_work_cost_full_wave_block():
    """work(93638) with 1024 threads needs 0.5 ms of full-rate issue, shared."""
    cost = kernel_cost(H200, "work", 264, 1024, [93638])
    assert cost.shared
    assert cost.seconds == pytest.approx(0.5e-3)


@pytest.mark.parametrize(
    ("name", "args", "nbytes"),
    [
        ("fill_f32", [0x1000, 1.0, 10**6], 4 * 10**6),
        ("vector_add_f32", [1, 2, 3, 10**6], 12 * 10**6),
        ("saxpy_f32", [2.0, 1, 2, 10**6], 12 * 10**6),
        ("reduce_sum_f32", [1, 2, 10**6], 4 * 10**6),
    ],
)
def test_memory_bound_costs(name, args, nbytes):
    """Memory-bound kernels: a block's time alone is its bytes at its threads' rate (31.1 GB/s per 1024
    threads, the first point of the H200's DRAM curve); the engine shares the bandwidth."""
    cost = kernel_cost(H200, name, 528, 256, args)
    assert cost.dram and not cost.shared and not cost.clocked
    assert cost.seconds == pytest.approx(nbytes / 528 / (256 * 31.1e9 / 1024))


def test_unknown_kernel_is_key_error():
    """Unknown kernel names raise KeyError."""
    with pytest.raises(KeyError):
        kernel_cost(H200, "nope", 1, 32, [])


def test_bad_arguments_are_value_errors():
    """Wrong argument counts and non-positive grids raise ValueError."""
    with pytest.raises(ValueError):
        kernel_cost(H200, "spin", 1, 32, [1, 2])
    with pytest.raises(ValueError):
        kernel_cost(H200, "spin", 0, 32, [1])
    with pytest.raises(ValueError):
        kernel_cost(H200, "spin", 1, 32, [-1])


def test_registry_names():
    """The built-in kernels the daemon registers all have cost models."""
    assert set(KERNEL_COSTS) == {"spin", "work", "fill_f32", "vector_add_f32", "saxpy_f32", "reduce_sum_f32"}
