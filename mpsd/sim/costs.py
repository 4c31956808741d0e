# Kernel cost models. A kernel declares what a launch costs in a few terms (mpsd.modules.Cost: fixed seconds,
# clock cycles, thread-instructions, DRAM traffic), the built-ins as a module of their own (mpsd.builtin_kernels)
# and a user's module the same way; the simulator needs only "how long does one block take, and does it share
# the SM's issue rate, the clock or DRAM with its neighbours", which `declared_cost` answers from those terms.
"""Per-block cost models of declared kernels."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mpsd.builtin_kernels import BUILTIN
from mpsd.modules import Cost, Kernel

from .specs import DeviceSpec, occupancy

__all__ = ["COPY_KINDS", "KERNEL_COSTS", "BlockCost", "copy_kernel", "declared_cost", "function_cost",
           "kernel_cost"]


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


def _memory_bound(spec: DeviceSpec, blocks: int, threads: int, nbytes: float, weight: float = 1.0) -> BlockCost:
    if spec.dram_curve:  # the time alone at the curve's first slope; the engine shares the bandwidth
        threads0, rate0 = spec.dram_curve[0]
        return BlockCost(nbytes / blocks / (threads * weight * rate0 / threads0), dram=True, weight=weight)
    # Every resident slot busy moves data at the full device bandwidth.
    occ = occupancy(spec, threads)
    if occ == 0:
        raise ValueError(f"a block of {threads} threads cannot fit on an SM")
    return BlockCost(nbytes / blocks * spec.sm_count * occ / spec.mem_bandwidth)


def declared_cost(spec: DeviceSpec, blocks: int, threads: int, cost: Cost) -> BlockCost:
    """One block's cost from a kernel's declared `cost` (mpsd.modules.Cost): each figure given is a way to be
    bound (fixed seconds; clock cycles; thread-instructions at the SM's issue rate; the grid's DRAM traffic), and
    the one that takes a block longest alone is the block's cost, shared as that way is shared. None given: a
    block that takes no time."""
    bounds: list[BlockCost] = []
    if cost.seconds is not None:
        bounds.append(BlockCost(float(cost.seconds)))
    if cost.cycles is not None:
        bounds.append(BlockCost(float(cost.cycles) / spec.clock_hz, clocked=True))
    if cost.work is not None:
        bounds.append(BlockCost(float(cost.work) / spec.sm_issue_rate, shared=True))
    if cost.traffic is not None:
        bounds.append(_memory_bound(spec, blocks, threads, cost.traffic, cost.weight))
    if not bounds:
        return BlockCost(0.0)
    return max(bounds, key=lambda bound: bound.seconds) if len(bounds) > 1 else bounds[0]


def _declared(kernel: Kernel) -> CostModel:
    def model(spec: DeviceSpec, blocks: int, threads: int, args: Sequence) -> BlockCost:
        cost = kernel.cost(args, blocks, threads)
        if not isinstance(cost, Cost):
            raise ValueError(f"its cost function gave a {type(cost).__name__}, not an mpsd.modules.Cost")
        return declared_cost(spec, blocks, threads, cost)
    return model


# The built-in kernels' cost models, as their module (mpsd.builtin_kernels) declares them.
KERNEL_COSTS: dict[str, CostModel] = {name: _declared(kernel) for name, kernel in BUILTIN.kernels.items()}


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
    return function_cost(spec, BUILTIN.kernels[name], blocks, threads, args)


def function_cost(spec: DeviceSpec, kernel: Kernel, blocks: int, threads: int, args: Sequence) -> BlockCost:
    """Cost of one block of a declared kernel (a built-in's or a module's), as `kernel_cost`.

    Raises:
        ValueError: as kernel_cost; and whatever the kernel's own cost function raised, or a result that is no
            Cost, named as the kernel's (a module's code is not to be trusted to be right).
    """
    if blocks < 1 or threads < 1:
        raise ValueError(f"blocks and threads must be >= 1, got {blocks} x {threads}")
    try:
        return _declared(kernel)(spec, blocks, threads, args)
    except Exception as exc:  # a module's cost function may raise anything
        raise ValueError(f"bad arguments for kernel {kernel.qualified!r}: {exc}") from exc
