# The frozen snapshots `Simulator.statistics()` hands out of what the engine (simcore) counts as work ends
# (trio's convention: objects with counters expose statistics() returning a frozen dataclass).
"""Simulator statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ClientStatistics", "SimStatistics"]


@dataclass(frozen=True, slots=True)
class ClientStatistics:
    """One client's totals.

    Attributes:
        kernels: kernels completed (reported).
        blocks: blocks that ran to the end, including those of cancelled kernels.
        block_seconds: sum of the durations of those blocks.
        sm_seconds: SM-time those blocks held, each block weighted by its share of an SM's threads (two
            1024-thread blocks for 1 ms on one SM are 1 ms of SM-time).
        copies: host-device copies completed (reported; device copies and memsets run as kernels).
        bytes_copied: bytes of those copies.
        max_sms: most distinct SMs the client occupied at once.
    """

    kernels: int = 0
    blocks: int = 0
    block_seconds: float = 0.0
    sm_seconds: float = 0.0
    copies: int = 0
    bytes_copied: int = 0
    max_sms: int = 0


@dataclass(frozen=True, slots=True)
class SimStatistics:
    """Totals for the whole simulated device.

    Attributes:
        now: simulated seconds.
        kernels_completed, blocks_completed, copies_completed: totals over every client.
        per_client: client id -> its totals, for the clients the simulator still knows.
        sm_seconds: SM-time of every block that ran, forgotten clients' included.
    """

    now: float
    kernels_completed: int
    blocks_completed: int
    copies_completed: int
    per_client: dict[int, ClientStatistics] = field(default_factory=dict)
    sm_seconds: float = 0.0
