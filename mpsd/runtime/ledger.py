# Device memory accounting, in one place. Every byte is counted three times: against the client whose memory it
# is (its pinned limit), against the MIG instance it lives in (which owns its profile's eighths of the memory),
# and against the device. One `move` updates all three, so the counts cannot drift apart.
#
# Each account says what is reserved (charged: what limits and cudaMemGetInfo see, in the driver's 2 MiB steps)
# and, of that, what is in use by live allocations (the bytes asked for). They differ where memory is held but
# not allocated: the rest of a 2 MiB chunk, memory a client freed that an IPC importer still maps, and a stream-
# ordered pool's reserve.
"""The device memory ledger."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Account", "Ledger"]


@dataclass(eq=False, slots=True)
class Account:
    """Memory charged to one holder.

    Attributes:
        total: what it may hold (a device's or instance's memory; a client's pinned limit).
        reserved: bytes charged to it.
        in_use: of those, bytes of live allocations.
        peak: the most it had reserved at once.
        instance: for a client, the MIG instance whose memory it is charged in (None: the device's).
        imported: for a client, bytes of other clients' memory it maps through IPC (in 2 MiB steps): held
            against its own limit, though not against the device again. The driver keeps such memory alive for
            as long as any mapping holds it, past its exporter's exit, so it must fit within some live
            client's limit all along: then no set of clients holds more than the sum of their limits.
    """

    total: int
    reserved: int = 0
    in_use: int = 0
    peak: int = 0
    instance: int | None = None
    imported: int = 0

    @property
    def free(self) -> int:
        return self.total - self.reserved

    def _move(self, reserved: int, in_use: int) -> None:
        self.reserved += reserved
        self.in_use += in_use
        self.peak = max(self.peak, self.reserved)


class Ledger:
    """One device's memory: the device, each MIG instance with memory of its own, each client.

    Args:
        total: the device's memory.
        server: what the MPS server itself holds on it.
        instances: each instance's memory (0 for a partition with none of its own: it shares the device's).
    """

    def __init__(self, total: int, server: int, instances: Sequence[int] = ()) -> None:
        self.device = Account(total)
        self.device._move(server, 0)
        self.instances = [Account(memory) for memory in instances]

    def instance(self, partition: int | None) -> int | None:
        """`partition` if it is an instance with memory of its own, else None (it allocates the device's)."""
        if partition is None or partition >= len(self.instances) or not self.instances[partition].total:
            return None
        return partition

    def open(self, limit: int, partition: int | None) -> Account:
        """An account for a client bound to `partition`, limited to `limit` bytes."""
        return Account(limit, instance=self.instance(partition))

    def move(self, account: Account | None, reserved: int = 0, in_use: int = 0, *,
             partition: int | None = None) -> None:
        """Charge (or with negative figures, release) bytes to `account`, its instance and the device; with no
        account, to `partition` and the device (what a context itself holds)."""
        instance = account.instance if account is not None else self.instance(partition)
        if account is not None:
            account._move(reserved, in_use)
        if instance is not None:
            self.instances[instance]._move(reserved, in_use)
        self.device._move(reserved, in_use)

    def total(self, partition: int | None) -> int:
        """The memory a client bound to `partition` sees: its instance's, or the device's."""
        instance = self.instance(partition)
        return self.device.total if instance is None else self.instances[instance].total

    def room(self, partition: int | None) -> tuple[int, int]:
        """`free` and `total` for `partition` at once (cudaMemGetInfo asks for both)."""
        instance = self.instance(partition)
        device = self.device
        if instance is None:
            return device.free, device.total
        own = self.instances[instance]
        return min(device.free, own.free), own.total

    def free(self, partition: int | None) -> int:
        """Bytes still free where a client bound to `partition` allocates: in its instance and the device."""
        instance = self.instance(partition)
        free = self.device.free
        return free if instance is None else min(free, self.instances[instance].free)
