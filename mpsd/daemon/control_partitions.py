# -S's static SM partitions in the v2 language (sm_partition add|rm, lspart; mpsd.daemon.sm_partitions has the
# texts' sources and guesses). v3's partition module shares add_sm_partition and remove_sm_partition: one set of
# partitions, one set of rules.
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpsd.daemon.control_servers import Commands
from mpsd.daemon.control_text import CommandError, brief, integer_arg
from mpsd.daemon.sm_partitions import PartitionError

if TYPE_CHECKING:
    from mpsd.daemon.control import Control


class PartitionCommands(Commands):
    """The commands that make, list and remove static SM partitions."""

    def __init__(self, control: Control) -> None:
        super().__init__(control.state, control.servers)

    def _partitions(self) -> Any:
        assert self.state.partitions is not None  # execute answers these commands only under -S
        return self.state.partitions

    def cmd_sm_partition(self, args: list[str]) -> str:
        usage = "Usage: sm_partition add <device> <chunks> | sm_partition rm <partition id>"
        verb = args[0] if args else None
        if verb == "add" and len(args) >= 3:
            devices = self.state.devices
            device = next((d.index for d in devices if args[1] in (str(d.index), d.properties["uuid"])), None)
            if device is None:  # an index or a GPU UUID, of a device the daemon has
                raise CommandError(f'Invalid device "{brief(args[1])}"')
            chunks = integer_arg(args[2], f'Invalid number of chunks "{brief(args[2])}"')
            try:
                return self.add_sm_partition(device, chunks).id
            except PartitionError as exc:
                raise CommandError(str(exc)) from None
        if verb == "rm" and len(args) >= 2:
            try:
                self.remove_sm_partition(args[1])
            except PartitionError as exc:
                raise CommandError(str(exc)) from None
            return ""
        raise CommandError(usage)

    # The legacy commands and v3's `partition` module share these: one set of partitions, one set of rules.
    def add_sm_partition(self, device: int, chunks: int, **options: Any) -> Any:
        """Make a partition (SmPartitions.add's `options`) and say so in control.log.

        Raises:
            PartitionError: it cannot be made.
        """
        partition = self._partitions().add(device, chunks, **options)
        self.servers.note(f"SM partition {partition.id} added on device {device}: chunks {partition.first_chunk}-"
                   f"{partition.first_chunk + partition.chunks - 1}, SMs {partition.first_sm}-"
                   f"{partition.first_sm + partition.sm_count - 1}")
        return partition

    def remove_sm_partition(self, key: str) -> Any:
        """Remove the partition whose id or name is `key`, unless clients run in it.

        Raises:
            PartitionError: no such partition, or it has clients.
        """
        found = self._partitions().find(key)
        users = self.sm_partition_clients(found) if found is not None else 0
        if users:
            raise PartitionError(f"Partition {found.id} has {users} client(s)")
        # mpsd's guess: a namespace's devices table that puts its clients in it keeps it.
        holders = [space.name for spaces in self.state.namespaces.values() for space in spaces.values()
                   if found is not None and found.name is not None
                   and any(device.sm_partition == found.name for device in space.devices)]
        if holders:
            raise PartitionError(f"Partition {found.id} is namespace {holders[0]}'s")
        return self._partitions().remove(key)

    def sm_partition_clients(self, partition: Any) -> int:
        return sum(1 for ctx in self.state.contexts() if ctx.sm_partition is partition)

    def cmd_lspart(self, args: list[str]) -> str:
        partitions = self._partitions()
        rows: list[tuple[object, ...]] = [
            (p.id, self.state.devices[p.device].properties["uuid"], p.chunks, p.sm_count, p.first_sm,
             self.sm_partition_clients(p))
            for p in partitions.partitions.values()]
        if not rows:
            return ""
        rows.insert(0, ("ID", "DEVICE", "CHUNKS", "SMS", "FIRST_SM", "CLIENTS"))
        return "\n".join(f"{pid!s:<8}{device!s:<44}{chunks!s:<8}{sms!s:<6}{first!s:<10}{users}"
                         for pid, device, chunks, sms, first, users in rows)

