# Multi-Instance GPU: the device cut into static partitions, each a disjoint window of SMs with its own copy
# engines. The profiles table and the layout check are kept beside the policy so the daemon can size
# partitions (memory in eighths) with the very figures the simulator places blocks by.
"""The ``mig`` policy and the H200 MIG profiles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..specs import DeviceSpec
from .base import BuiltinPolicy, ClientConfig

__all__ = ["MIG_PROFILES", "MigPartition", "MigPolicy", "mig_layout"]

# profile -> (SMs, compute slices of 7, memory eighths), for the H200.
MIG_PROFILES: dict[str, tuple[int, int, int]] = {
    "1g.18gb": (16, 1, 1),
    "2g.35gb": (32, 2, 2),
    "3g.71gb": (60, 3, 4),
    "4g.71gb": (64, 4, 4),
    "7g.141gb": (132, 7, 8),
}
DEFAULT_LAYOUT = ("3g.71gb", "3g.71gb")


@dataclass(frozen=True, slots=True)
class MigPartition:
    """One GPU instance.

    Attributes:
        profile: its profile name, or "custom" for a partition given as an SM count.
        first_sm: index of its first SM; it holds SMs ``first_sm`` .. ``first_sm + sm_count - 1``.
        sm_count: SMs it holds.
        memory: device memory it holds, bytes (its eighths of ``total_memory``; 0 for custom ones).
    """

    profile: str
    first_sm: int
    sm_count: int
    memory: int


def mig_layout(spec: DeviceSpec, partitions) -> tuple[MigPartition, ...]:
    """Lay partitions out on consecutive SMs, checking they fit the device.

    Args:
        spec: the device.
        partitions: profile names (keys of ``MIG_PROFILES``), or positive SM counts for custom partitions
            (models smaller than an H200).

    Returns:
        The partitions, in the order given.

    Raises:
        ValueError: no partitions, an unknown profile, or more SMs, compute slices (7) or memory eighths (8)
            than the device has.
    """
    if isinstance(partitions, str) or not partitions:
        raise ValueError(f"partitions must be a non-empty list of profiles, got {partitions!r}")
    out, first, slices, eighths = [], 0, 0, 0
    for p in partitions:
        if isinstance(p, int) and not isinstance(p, bool) and p > 0:
            profile, sms, memory = "custom", p, 0
        elif p in MIG_PROFILES:
            sms, s, e = MIG_PROFILES[p]
            profile, memory = p, spec.total_memory * e // 8
            slices += s
            eighths += e
        else:
            raise ValueError(f"unknown MIG profile {p!r}; known: {sorted(MIG_PROFILES)}")
        out.append(MigPartition(profile, first, sms, memory))
        first += sms
    if first > spec.sm_count or slices > 7 or eighths > 8:
        raise ValueError(f"MIG layout {list(partitions)} does not fit: {first} SMs of {spec.sm_count}, "
                         f"{slices} compute slices of 7, {eighths} memory eighths of 8")
    return tuple(out)


class MigPolicy(BuiltinPolicy):
    """Static partitions: a client's blocks only go on its partition's SMs, its copies on its partition's copy
    engines, and its memory-bound blocks share its partition's DRAM bandwidth.

    Inside a partition work is dispatched as under ``mps`` (launch order, stream priorities, SM caps).
    Partitions share nothing: no SM, no copy engine, no DRAM bandwidth, so load in one never changes
    another's timeline.
    Clients are bound with ``configure_client(partition=...)``; unconfigured clients use partition 0.

    Options:
        partitions: the layout, as for ``mig_layout`` (default two 3g.71gb).
    """

    name = "mig"
    options: ClassVar[dict[str, Any]] = {"partitions": DEFAULT_LAYOUT}

    def __init__(self, sim, options=None) -> None:
        super().__init__(sim, options)
        self.partitions = mig_layout(self.spec, self.settings["partitions"])
        self._bound: dict[int, int] = {}

    def resolve(self, partition: str | int | None) -> int:
        """The index of a partition named as ``ClientConfig.partition`` allows.

        Raises:
            ValueError: no such partition.
        """
        if partition is None:
            return 0
        if isinstance(partition, str):
            if partition.isascii() and partition.isdigit():  # not "²", which int() refuses
                partition = int(partition)
            else:
                for i, p in enumerate(self.partitions):
                    if p.profile == partition:
                        return i
                raise ValueError(f"no {partition!r} partition in this MIG layout")
        if not 0 <= partition < len(self.partitions):
            raise ValueError(f"partition {partition} out of range: the layout has {len(self.partitions)}")
        return partition

    def configure(self, client: int, config: ClientConfig) -> None:
        """Bind ``client`` to its partition (takes effect for blocks placed from now on)."""
        self._bound[client] = self.resolve(config.partition)

    def forget(self, client: int) -> None:
        self._bound.pop(client, None)

    def partition_of(self, client: int) -> MigPartition:
        """The partition ``client`` is bound to."""
        return self.partitions[self._bound.get(client, 0)]

    def bandwidth_share(self, index: int) -> float:
        """Partition ``index`` has its own memory slices: its eighths of the DRAM bandwidth (a custom partition:
        its share of the SMs). Not measured: MIG cannot be set up on the lent H200s."""
        p = self.partitions[index]
        return p.memory / self.spec.total_memory if p.memory else p.sm_count / self.spec.sm_count

    def engine_args(self) -> object:
        """(first SM, SMs, share of the device's DRAM bandwidth) of each partition."""
        return [(p.first_sm, p.sm_count, self.bandwidth_share(i)) for i, p in enumerate(self.partitions)]
