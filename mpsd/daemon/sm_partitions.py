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
#
# MPS v3 (NVIDIA's MPS documentation, release 620, "MPS v3 Configuration File") names partitions: a server's
# `[[servers.<name>.devices]]` (a GPU by `uuid`) lists `[[...devices.sm_partitions]]` with `name`, `chunks` and
# `include_remainder`, and a namespace's `[[...namespaces.<ns>.devices]]` puts its clients on one by that name.
# They are the same partitions as -S's, kept here: each has its id (p0, p1, ...) and may have a name and the
# server whose file entry made it. mpsd's guesses: that CUDA_MPS_SM_PARTITION takes the name as well as the
# id; that names are unique in the daemon, not only in their server; that `include_remainder` gives the
# partition the SMs no whole chunk holds (an H200's last 4), so it lies at the device's top end, and that one
# partition per device may have them.
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

CHUNK_SMS = 8
_ID = re.compile(r"p[0-9]+", re.ASCII)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", re.ASCII)


def check_partition_name(text: str) -> str:
    """`text` if it can name a partition: a word of letters, digits, "_", "." and "-" (at most 64) that no
    id could be (p0, p1, ...), since CUDA_MPS_SM_PARTITION takes either.

    Raises:
        ValueError: it cannot.
    """
    if not _NAME.fullmatch(text) or _ID.fullmatch(text):
        raise ValueError(f'Invalid partition name "{text[:24]}": letters, digits, "_", "." and "-", at most 64, '
                         "and not an id such as p0")
    return text


@dataclass(frozen=True)
class SmPartition:
    """Some consecutive chunks of one device's SMs."""

    id: str
    device: int
    first_chunk: int
    chunks: int
    name: str | None = None  # MPS v3's: the -a file's or `partition create --name`'s
    remainder: int = 0  # the SMs past the device's last whole chunk that it also holds (include_remainder)
    server: str | None = None  # the named server (-a file) whose devices table made it

    @property
    def first_sm(self) -> int:
        return self.first_chunk * CHUNK_SMS

    @property
    def sm_count(self) -> int:
        return self.chunks * CHUNK_SMS + self.remainder

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
        self.remainders = [count % CHUNK_SMS for count in sm_counts]
        self.partitions: dict[str, SmPartition] = {}
        self._ids = itertools.count()

    def free_chunks(self, device: int) -> list[int]:
        taken = {p.first_chunk + n for p in self.partitions.values() if p.device == device for n in range(p.chunks)}
        return [chunk for chunk in range(self.chunk_counts[device]) if chunk not in taken]

    def add(self, device: int, chunks: int, *, name: str | None = None, include_remainder: bool = False,
            server: str | None = None) -> SmPartition:
        """A new partition of `chunks` chunks of `device`: the lowest free chunks that lie together (with
        `include_remainder`, the free chunks at the device's top end, and the SMs past them).

        Raises:
            PartitionError: no such run of free chunks, the name is taken, or the remainder is.
        """
        if not 0 < chunks <= self.chunk_counts[device]:
            raise PartitionError(f"Invalid number of chunks {chunks}: device {device} has "
                                 f"{self.chunk_counts[device]} of {CHUNK_SMS} SMs")
        if name is not None and self.find(name) is not None:
            raise PartitionError(f'Partition "{name[:24]}" already exists')
        free = set(self.free_chunks(device))
        last = self.chunk_counts[device] - chunks
        if include_remainder:  # the remainder lies past the last chunk: the window must end there
            if any(p.device == device and p.remainder for p in self.partitions.values()):
                raise PartitionError(f"The SMs past device {device}'s last chunk are already a partition's")
            starts = [last] if all(last + n in free for n in range(chunks)) else []
            if not starts:
                raise PartitionError(f"Not enough free chunks at device {device}'s end for {chunks} chunk(s) "
                                     "and the remainder")
        else:
            starts = [first for first in range(last + 1) if all(first + n in free for n in range(chunks))]
        if starts:
            partition = SmPartition(f"p{next(self._ids)}", device, starts[0], chunks, name,
                                    self.remainders[device] if include_remainder else 0, server)
            self.partitions[partition.id] = partition
            return partition
        raise PartitionError(f"Not enough free chunks on device {device}: {len(free)} free, none {chunks} together"
                             if len(free) >= chunks else
                             f"Not enough free chunks on device {device}: {len(free)} free, {chunks} asked")

    def find(self, key: str) -> SmPartition | None:
        """The partition whose id or name is `key`."""
        found = self.partitions.get(key)
        return found if found is not None else next((p for p in self.partitions.values() if p.name == key), None)

    def remove(self, key: str) -> SmPartition:
        """Remove the partition whose id or name is `key`.

        Raises:
            PartitionError: no such partition."""
        partition = self.find(key)
        if partition is None:
            raise PartitionError(f"Partition {key[:24]} not found")
        del self.partitions[partition.id]
        return partition
