# MPS's static SM partitioning (CUDA 13.1's nvidia-cuda-mps-control -S, NVIDIA's MPS documentation): a
# device's SMs are cut into chunks (8 SMs a chunk on Hopper: an H200's 132 SMs are 16 chunks, and 4 SMs that
# no chunk holds), a partition is some of those chunks, and a client that names a partition with
# CUDA_MPS_SM_PARTITION runs its blocks on that partition's SMs only. SM partitioning does not partition
# memory, copy engines or DRAM bandwidth. In the simulator a partition is a window of SMs that the `mps`
# policy pins the client to (the window the `mig` policy pins a MIG instance's clients to); this module only
# keeps the books: which chunks are whose, and the commands' texts.
#
# mpsd's guesses (the lent H200's driver 580 has no -S, and NVIDIA documents no output): `sm_partition add
# DEV CHUNKS` (DEV an index or a GPU UUID) prints the new partition's id, "p" and a number; `sm_partition rm
# ID`; `lspart`'s columns ID DEVICE CHUNKS SMS FIRST_SM CLIENTS, nothing where there is no partition; a
# partition takes the lowest free chunks that lie together; every error text; a client that names no
# partition under -S may use every SM (MPS's sharing); a client that names one on a daemon without -S, one
# that does not exist, or one of another device, fails with cudaErrorInvalidValue; 8 SMs a chunk on every
# device (NVIDIA gives the figure for Hopper only).
from __future__ import annotations

import itertools
from dataclasses import dataclass

CHUNK_SMS = 8


@dataclass(frozen=True)
class SmPartition:
    """Some consecutive chunks of one device's SMs."""

    id: str
    device: int
    first_chunk: int
    chunks: int

    @property
    def first_sm(self) -> int:
        return self.first_chunk * CHUNK_SMS

    @property
    def sm_count(self) -> int:
        return self.chunks * CHUNK_SMS

    @property
    def sms(self) -> tuple[int, int]:
        """(first SM, SM count), as the simulator takes a window."""
        return self.first_sm, self.sm_count


class PartitionError(Exception):
    """A partition cannot be made or removed; the message says why."""


class SmPartitions:
    """The static SM partitions of a daemon's devices.

    Args:
        sm_counts: each device's SMs.
    """

    def __init__(self, sm_counts: list[int]) -> None:
        self.chunk_counts = [count // CHUNK_SMS for count in sm_counts]
        self.partitions: dict[str, SmPartition] = {}
        self._ids = itertools.count()

    def free_chunks(self, device: int) -> list[int]:
        taken = {p.first_chunk + n for p in self.partitions.values() if p.device == device for n in range(p.chunks)}
        return [chunk for chunk in range(self.chunk_counts[device]) if chunk not in taken]

    def add(self, device: int, chunks: int) -> SmPartition:
        """A new partition of `chunks` chunks of `device`: the lowest free chunks that lie together.

        Raises:
            PartitionError: no such run of free chunks.
        """
        if not 0 < chunks <= self.chunk_counts[device]:
            raise PartitionError(f"Invalid number of chunks {chunks}: device {device} has "
                                 f"{self.chunk_counts[device]} of {CHUNK_SMS} SMs")
        free = set(self.free_chunks(device))
        for first in range(self.chunk_counts[device] - chunks + 1):
            if all(first + n in free for n in range(chunks)):
                partition = SmPartition(f"p{next(self._ids)}", device, first, chunks)
                self.partitions[partition.id] = partition
                return partition
        raise PartitionError(f"Not enough free chunks on device {device}: {len(free)} free, none {chunks} together"
                             if len(free) >= chunks else
                             f"Not enough free chunks on device {device}: {len(free)} free, {chunks} asked")

    def remove(self, partition_id: str) -> SmPartition:
        """Raises:
            PartitionError: no such partition."""
        partition = self.partitions.pop(partition_id, None)
        if partition is None:
            raise PartitionError(f"Partition {partition_id[:24]} not found")
        return partition
