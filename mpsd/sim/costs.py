# Kernel cost models, by kernel name. The daemon owns each kernel's argument signature and CPU
# implementation; the simulator needs only "how long does one block take, and does it share the SM's
# issue rate with its neighbours". One table of small pure functions keeps adding a kernel a one-line change.
"""Per-block cost models for the built-in kernels."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .specs import DeviceSpec, occupancy

__all__ = ["COPY_KINDS", "KERNEL_COSTS", "BlockCost", "copy_kernel", "kernel_cost"]


@dataclass(frozen=True, slots=True)
class BlockCost:
    """How long one block of a kernel runs.

    Attributes:
        seconds: the per-block duration: fixed (latency-bound) or, if ``shared``, the duration when the
            block alone gets the SM's full issue rate.
        shared: True for throughput-bound blocks: co-resident shared blocks on one SM divide its issue
            rate (processor sharing, see simcore/src/sms.rs).
        clocked: True for blocks that wait on the SM's clock (``spin``): the clock runs on while the block
            is preempted, so a resumed block ends when its ``seconds`` since it started have passed, or at
            once if they already have. Other blocks resume with the work they had left.
        dram: True for memory-bound blocks: ``seconds`` is the block's time at the DRAM rate its threads
            reach alone, and resident dram blocks share the device's DRAM bandwidth (``DeviceSpec.dram_curve``,
            simcore/src/dram.rs).
        weight: for dram blocks, what each thread counts on the curve's axis and in the sharing (a kernel
            that keeps more bytes in flight per thread than c = a + b counts more).
    """

    seconds: float
    shared: bool = False
    clocked: bool = False
    dram: bool = False
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.seconds >= 0.0:
            raise ValueError(f"block seconds must be >= 0, got {self.seconds}")
        if self.shared + self.clocked + self.dram > 1:
            raise ValueError("a block shares the issue rate, waits on the clock or shares DRAM: one at most")
        if not self.weight > 0.0:
            raise ValueError(f"block weight must be > 0, got {self.weight}")


CostModel = Callable[[DeviceSpec, int, int, Sequence], BlockCost]


def _spin(spec: DeviceSpec, blocks: int, threads: int, args: Sequence) -> BlockCost:
    # Each block busy-waits until clock64() has advanced `cycles` past its start. Time-slicing on a real
    # H200 showed the clock running on while a context is switched out: a preempted 5-ms spin still took
    # 5.0 ms from start to end (bench/fidelity/h200_timing_host.json, "timeline, 2 x FULL spin 5 ms x 8").
    (cycles,) = args
    return BlockCost(float(cycles) / spec.clock_hz, clocked=True)


def _work(spec: DeviceSpec, blocks: int, threads: int, args: Sequence) -> BlockCost:
    (iters,) = args
    return BlockCost(float(iters) * threads / spec.sm_issue_rate, shared=True)


def _memory_bound(spec: DeviceSpec, blocks: int, threads: int, nbytes: float, weight: float = 1.0) -> BlockCost:
    if spec.dram_curve:  # the time alone at the curve's first slope; the engine shares the bandwidth
        threads0, rate0 = spec.dram_curve[0]
        return BlockCost(nbytes / blocks / (threads * weight * rate0 / threads0), dram=True, weight=weight)
    # Every resident slot busy moves data at the full device bandwidth.
    occ = occupancy(spec, threads)
    if occ == 0:
        raise ValueError(f"a block of {threads} threads cannot fit on an SM")
    return BlockCost(nbytes / blocks * spec.sm_count * occ / spec.mem_bandwidth)


def _fill_f32(spec: DeviceSpec, blocks: int, threads: int, args: Sequence) -> BlockCost:
    _ptr, _value, n = args
    return _memory_bound(spec, blocks, threads, 4 * int(n))


def _vector_add_f32(spec: DeviceSpec, blocks: int, threads: int, args: Sequence) -> BlockCost:
    _a, _b, _c, n = args
    return _memory_bound(spec, blocks, threads, 12 * int(n))


def _saxpy_f32(spec: DeviceSpec, blocks: int, threads: int, args: Sequence) -> BlockCost:
    _alpha, _x, _y, n = args
    return _memory_bound(spec, blocks, threads, 12 * int(n))


def _reduce_sum_f32(spec: DeviceSpec, blocks: int, threads: int, args: Sequence) -> BlockCost:
    _x, _out, n = args
    return _memory_bound(spec, blocks, threads, 4 * int(n))


KERNEL_COSTS: dict[str, CostModel] = {
    "spin": _spin,
    "work": _work,
    "fill_f32": _fill_f32,
    "vector_add_f32": _vector_add_f32,
    "saxpy_f32": _saxpy_f32,
    "reduce_sum_f32": _reduce_sum_f32,
}


COPY_KINDS = ("d2d", "memset")
COPY_THREADS = 1024
_COPY_BYTES_PER_THREAD = 16  # assumed: a grid-stride kernel of 16-byte accesses


def copy_kernel(spec: DeviceSpec, kind: str, nbytes: int, sms: int | None = None) -> tuple[int, int, BlockCost]:
    """The kernel a device-to-device copy (``d2d``) or a memset of ``nbytes`` bytes runs as, for a client that
    sees ``sms`` SMs (its SM cap; None: the device's).

    On a real H200 both are kernels: under MPS an active thread percentage slows them as it does any
    kernel, beside a full-GPU kernel they wait for its blocks, and without MPS they are time-sliced with other
    contexts (bench/fidelity/h200_copies2.json). Their grid is not observable from outside, so it is assumed:
    blocks of 1024 threads, one per 16 KiB, at most two on each SM the client sees (one wave, as a grid-stride
    kernel sized from the device's properties would be); their DRAM traffic (read and write for a copy, write
    for a memset) follows ``spec.copy_kernels``.

    Returns:
        (blocks, threads per block, per-block cost).

    Raises:
        ValueError: an unknown kind or negative nbytes.
    """
    if kind not in COPY_KINDS:
        raise ValueError(f"unknown device copy {kind!r}; known: {COPY_KINDS}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    per_sm = spec.max_threads_per_sm // COPY_THREADS
    wave = per_sm * min(spec.sm_count, sms or spec.sm_count)
    blocks = max(1, min(wave, math.ceil(nbytes / (COPY_THREADS * _COPY_BYTES_PER_THREAD))))
    traffic = nbytes * (2 if kind == "d2d" else 1)
    figures = {k: (bytes_per, weight) for k, bytes_per, weight in spec.copy_kernels}
    if kind in figures and spec.dram_curve:
        bytes_per, weight = figures[kind]
        return blocks, COPY_THREADS, _memory_bound(spec, blocks, COPY_THREADS, traffic / bytes_per, weight)
    return blocks, COPY_THREADS, _memory_bound(spec, blocks, COPY_THREADS, traffic)


def kernel_cost(spec: DeviceSpec, name: str, blocks: int, threads: int, args: Sequence) -> BlockCost:
    """Cost of one block of a named built-in kernel.

    Args:
        spec: the device.
        name: the kernel's name (a key of ``KERNEL_COSTS``).
        blocks: blocks in the grid (>= 1).
        threads: threads per block (>= 1).
        args: the launch's positional arguments (pointers are ints).

    Returns:
        The per-block cost.

    Raises:
        KeyError: unknown kernel name.
        ValueError: non-positive blocks or threads, wrong number of arguments, a negative duration,
            or a block shape that cannot fit on an SM.
    """
    model = KERNEL_COSTS[name]
    if blocks < 1 or threads < 1:
        raise ValueError(f"blocks and threads must be >= 1, got {blocks} x {threads}")
    try:
        return model(spec, blocks, threads, args)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad arguments for kernel {name!r}: {exc}") from exc
