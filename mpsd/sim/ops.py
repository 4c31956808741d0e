# What the daemon hands the simulator and what comes back. Ops are mutable records compared by
# identity (eq=False): the simulator stamps their times on them and keys its bookkeeping by them, so two
# launches with equal fields stay two launches. Fields are keyword-only so subclasses can add required
# fields after the base's defaults.
"""Operations (kernels, copies, markers) and the recorded block groups."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from .costs import BlockCost

__all__ = ["ENGINES", "BlockGroup", "Copy", "Kernel", "Marker", "Op"]
_new = object.__new__

# Device-to-device copies within a device and memsets are kernels (mpsd.sim.costs.copy_kernel); a copy between
# devices is "peer_in"/"peer_out" over NVLink (reading or writing the peer's memory) or, between devices that are
# not peers, "staged_in"/"staged_out": this device's leg of a copy staged through host memory.
ENGINES = ("h2d", "d2h", "peer_in", "peer_out", "staged_in", "staged_out")


@dataclass(eq=False, slots=True, kw_only=True)
class Op:
    """One unit of device work.

    Attributes:
        client: tenant id.
        stream: ops of one client with equal ``stream`` run one after another, in submission order
            (the stream's identity is ``(client, stream)``).
        after: other ops that must complete before this one may start.
        tag: opaque to the simulator.
        submitted, started, ended: simulated times, set by the simulator (NaN until then).
        eligible: when it reached the head of its stream with its ``after`` ops done (NaN until then); a
            kernel's blocks can start ``kernel_overhead`` later.
        done: set by the simulator when the op is reported complete.
        cancelled: set by the simulator when its client's work was torn down: it never completes, and ops
            that depend on it go ahead as if it had.
        seq: submission sequence number, set by the simulator (-1 until submitted).
    """

    client: int
    stream: Hashable
    after: tuple = field(default=(), repr=False)
    tag: object = None
    submitted: float = field(default=math.nan, init=False)
    eligible: float = field(default=math.nan, init=False)
    started: float = field(default=math.nan, init=False)
    ended: float = field(default=math.nan, init=False)
    done: bool = field(default=False, init=False)
    cancelled: bool = field(default=False, init=False)
    seq: int = field(default=-1, init=False)


@dataclass(eq=False, slots=True, kw_only=True)
class Kernel(Op):
    """A grid of ``blocks`` blocks of ``threads`` threads, each costing ``cost``.

    Attributes:
        blocks: blocks in the grid (>= 1).
        threads: threads per block.
        cost: per-block cost (see ``mpsd.sim.kernel_cost``).
        regs_per_thread: registers per thread.
        smem: shared memory per block, bytes.
        priority: CUDA stream priority; lower is more urgent.
        sm_cap: most distinct SMs this client may occupy at once (from its active thread
            percentage); None for all.
    """

    blocks: int
    threads: int
    cost: BlockCost
    regs_per_thread: int = 32
    smem: int = 0
    priority: int = 0
    sm_cap: int | None = None
    launch_overhead: float | None = None  # the device's overhead before it, if not the spec's (a graph's node)

    @classmethod
    def of(cls, client: int, stream: Hashable, after: tuple, blocks: int, threads: int, cost: BlockCost, smem: int,
           priority: int, sm_cap: int | None) -> Kernel:
        """``Kernel(client=client, stream=stream, ...)`` with these fields in this order, and the others their
        defaults: what a daemon calls for every launch, as a call with nine keywords costs three times as much
        in CPython 3.11 (tests/test_op_builders.py holds the two to the same fields)."""
        op = _new(cls)
        op.client, op.stream, op.after, op.tag = client, stream, after, None
        op.submitted = op.eligible = op.started = op.ended = math.nan
        op.done = op.cancelled = False
        op.seq = -1
        op.blocks, op.threads, op.cost, op.regs_per_thread = blocks, threads, cost, 32
        op.smem, op.priority, op.sm_cap, op.launch_overhead = smem, priority, sm_cap, None
        return op


@dataclass(eq=False, slots=True, kw_only=True)
class Copy(Op):
    """A copy between host and device on a copy engine (one per direction, time-sliced between streams:
    ``mpsd.sim.copies``).

    Attributes:
        engine: "h2d" or "d2h", at PCIe bandwidth; "peer_in" or "peer_out", to or from a peer device at
            NVLink bandwidth; "staged_in" or "staged_out", to or from a device that is not a peer, through host
            memory (``simcore/src/copies.rs``).
        nbytes: bytes copied; the copy also pays the device's fixed ``copy_latency`` (a peer copy its
            ``peer_copy_latency``, a staged one both legs' ``copy_latency``).
    """

    engine: str
    nbytes: int


@dataclass(eq=False, slots=True, kw_only=True)
class Marker(Op):
    """Zero-duration op: completes when it reaches its stream's head and its ``after`` ops are done."""


class BlockGroup(NamedTuple):
    """Blocks of one kernel placed together on one SM at one instant (recorded when they end). (A named tuple:
    ``Simulator.trace`` builds one per group from the engine's columns, at 0.26 us where a frozen dataclass
    took 0.64.)

    Attributes:
        op: the kernel.
        sm: SM index.
        count: blocks in the group.
        start, end: simulated seconds.
    """

    op: Kernel
    sm: int
    count: int  # type: ignore[assignment]  # (a field, as the trace names it: it hides tuple.count)
    start: float
    end: float
