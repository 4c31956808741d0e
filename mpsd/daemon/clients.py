# The daemon's clients: admitting one (its device through CUDA_VISIBLE_DEVICES and its namespace, its quotas
# from what the control plane's admission says a new client gets, tightened by what it asks for), reconfiguring,
# terminating and cutting one off as the control plane's actions ask, reclaiming what a departed one held, and
# their figures (mpsd-smi's status, a client's statistics). It holds the devices and what their clients share
# (IPC, host memory); the sockets and the control plane are the daemon's.
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import trio

from mpsd.daemon.listeners import notify
from mpsd.runtime.context import Context, Quotas
from mpsd.runtime.device import COMPUTE_MODES
from mpsd.runtime.dispatch import Dispatcher
from mpsd_protocol import (
    DEFAULT_CONNECTIONS,
    MAX_CONNECTIONS,
    DevicesUnavailableError,
    InvalidDeviceError,
    InvalidValueError,
    MpsClientTerminatedError,
    MpsConnectionError,
    MpsMaxClientsReachedError,
    MpsRpcFailureError,
    MpsServerNotReadyError,
    NoDeviceError,
    OutOfMemoryError,
    brief,
    format_size,
)

if TYPE_CHECKING:
    from mpsd.backends.hostmem import HostMemory
    from mpsd.daemon.config import Config
    from mpsd.daemon.control_plane import ControlPlane
    from mpsd.daemon.control_state import Settings
    from mpsd.daemon.servlog import ServerLog
    from mpsd.daemon.session import Session
    from mpsd.daemon.sm_partitions import SmPartitions
    from mpsd.runtime.device import Device
    from mpsd.runtime.ipc import IpcRegistry

# Wall seconds of a departed client's teardown between two turns of the other tasks: another client's call
# waits about this long, or two of it, however much the departed one held (mpsd.runtime.teardown).
TEARDOWN_PIECE = 1e-3


class Clients:
    """The clients of one daemon's devices."""

    def __init__(self, config: Config, devices: list[Device], log: ServerLog, ipc: IpcRegistry, settings: Settings,
                 control: ControlPlane, sm_partitions: SmPartitions | None, host_memory: HostMemory) -> None:
        self.config, self.devices, self.log, self.ipc, self.settings = config, devices, log, ipc, settings
        self.control, self.admission = control, control.admission
        self.sm_partitions, self.host_memory = sm_partitions, host_memory
        self._next_client = 1

    def attach(self, session: Session, limits: dict[str, Any], hello: dict[str, Any]) -> Context:
        """Create the sub-context for a client that said hello; its requests can only tighten our quotas.

        Raises:
            InvalidDeviceError: no such device.
            InvalidValueError: a requested limit is malformed.
        """
        if self.admission.quitting:  # a server being shut down still takes clients, as MPS's does; quit not
            raise MpsServerNotReadyError("the MPS control daemon is quitting")
        route = session.route
        if route is not None and route.uid is not None and route.uid != session.uid:
            raise MpsConnectionError(f"server {route.server} (at {route.directory(self.config.pipe_dir)}) serves "
                                     f"uid {route.uid}, not {session.uid}")
        namespace = self.admission.namespace_for(session.pid, session.uid, route)
        if route is not None and route.namespace != "default" and namespace is None:
            raise MpsConnectionError(f"namespace {route.namespace} of server {route.server} is gone")
        # A namespace with devices shows its clients those only, in its order (mpsd.daemon.namespaces).
        seen = None if namespace is None or not namespace.devices else [
            next(d.index for d in self.devices if d.properties["uuid"] == spec.uuid) for spec in namespace.devices]
        index, instance, count = self._device_index(hello.get("device", 0), hello.get("visible"), seen)
        device = self.devices[index]
        if device.compute_mode == "PROHIBITED":
            raise DevicesUnavailableError(f"device {index}'s compute mode is PROHIBITED (nvidia-smi -c)")
        refused = self.admission.refused_by(session.uid, device)
        if refused is not None:
            raise DevicesUnavailableError(f"device {index} is not among server {refused}'s allowed devices")
        if device.faulted:
            raise MpsServerNotReadyError(f"the server is handling a fatal GPU error on device {index}; new "
                                         "clients wait until the faulting clients have exited")
        if len(device.contexts) >= self.config.max_clients:
            raise MpsMaxClientsReachedError(f"device {index} already has {self.config.max_clients} clients")
        percentage = self.admission.percentage_for_new_client(session.uid)
        if namespace is not None:
            percentage = namespace.percentage(percentage)
        requested = limits.get("active_thread_percentage")
        if requested is not None:
            if type(requested) not in (int, float) or not 0 < requested <= 100:
                raise InvalidValueError(f"active thread percentage {brief(requested, 20)} is outside (0, 100]")
            percentage = min(percentage, float(requested))
        partition = limits.get("partition")
        if partition is not None and (type(partition) is not int or not 0 <= partition < len(device.instances)):
            raise InvalidValueError(f"MIG partition {brief(partition, 20)} does not exist on device {index}")
        if instance is not None:  # CUDA_VISIBLE_DEVICES named a MIG device
            if partition is not None and partition != instance:
                raise InvalidValueError(f"MPSD_MIG_PARTITION={partition} and CUDA_VISIBLE_DEVICES's MIG device "
                                        f"(partition {instance}) disagree")
            partition = instance
        if device.instances and partition is None:
            partition = 0  # as the mig policy binds a client that names no instance
        sm_partition = self._sm_partition(limits.get("sm_partition"), index, session.uid, namespace)
        memory_limit = self.admission.memory_limit_for_new_client(index, session.uid)
        if namespace is not None:
            memory_limit = namespace.memory_limit(memory_limit)
        memory = memory_limit or device.memory_total(partition)
        requested = limits.get("pinned_mem_limit")
        if requested is not None:
            if type(requested) is not int or requested < 0:
                raise InvalidValueError(f"pinned memory limit {brief(requested, 20)} is not a byte count")
            memory = min(memory, requested)
        requested_priority = limits.get("priority")
        # type(), not ==: True and 1.0 equal 1 but are no priority (they passed here and failed in the scheduler)
        if requested_priority is not None and (type(requested_priority) is not int or requested_priority not in (0, 1)):
            raise InvalidValueError(f"client priority {brief(requested_priority, 20)} must be 0 or 1")
        priority = self.settings.priority_for(session.pid, session.uid)
        priority = _tighter(priority if namespace is None else namespace.priority(priority), requested_priority)
        weight = self.settings.weight_for(session.pid, session.uid)
        connections = limits.get("connections", DEFAULT_CONNECTIONS)
        if type(connections) is not int or not 1 <= connections <= MAX_CONNECTIONS:
            raise InvalidValueError(f"CUDA_DEVICE_MAX_CONNECTIONS {brief(connections, 20)} is outside 1 to "
                                    f"{MAX_CONNECTIONS}")
        cap = min(device.backend.sm_cap(percentage), device.partition_sms(partition))
        if sm_partition is not None:  # the percentage applies inside the partition's SMs
            cap = min(cap, sm_partition.sm_count)
        quotas = Quotas(percentage, cap, memory, priority, weight, connections)
        context_memory = device.backend.context_memory
        if device.memory_free(partition) < context_memory:
            raise OutOfMemoryError(f"device {index} has no room for another context "
                                   f"({format_size(context_memory)} each)"
                                   + (f" in MIG instance {partition}" if partition is not None else ""))
        context = Context(device, self._next_client, session.pid, session.uid, session.gid, quotas, self.ipc,
                          partition, requested_priority, "default" if namespace is None else namespace.name)
        context.sm_partition = sm_partition
        context.visible_count = count
        device.backend.attach(context, sm_cap=cap, priority=priority, weight=weight, instance=partition,
                              sms=None if sm_partition is None else sm_partition.sms, connections=connections)
        device.ledger.move(None, context_memory, partition=partition)
        self._next_client += 1
        device.contexts[context.id] = context
        self.control.client_arrived(context)
        notify(f"STATUS={self.client_count()} clients")
        claimed = hello.get("pid")
        self.log.server(f"New client {session.pid} connected (context {context.id}, uid {session.uid}, "
                        f"device {index})"
                        + (f"; it claimed pid {brief(claimed, 20)}" if claimed != session.pid else ""))
        self.log.server(f"Client {session.pid}: active thread percentage {percentage:.1f} ({quotas.sm_cap} SMs), "
                        f"pinned memory limit {format_size(memory)}, priority {priority}"
                        + (f", weight {weight:g}" if weight != 1.0 else "")
                        + (f", MIG instance {partition}" if partition is not None else "")
                        + (f", namespace {namespace.name}" if namespace is not None else "")
                        + (f", SM partition {sm_partition.id} (SMs {sm_partition.first_sm}-"
                           f"{sm_partition.first_sm + sm_partition.sm_count - 1})" if sm_partition is not None else ""))
        return context

    def _sm_partition(self, requested: Any, device: int, uid: int, namespace: Any) -> Any:
        """The static SM partition a new client runs in: the one its namespace has on `device`, else the one
        CUDA_MPS_SM_PARTITION names (by id or name), if either does.

        Raises:
            InvalidValueError: static partitioning is off, no such partition is on the client's device, it is
                another named server's, or it is not the client's namespace's.
        """
        spec = None if namespace is None else next(
            (d for d in namespace.devices if d.uuid == self.devices[device].properties["uuid"]), None)
        assigned = None if spec is None else spec.sm_partition
        if requested is None and assigned is None:
            return None
        if self.sm_partitions is None:
            raise InvalidValueError(f"CUDA_MPS_SM_PARTITION={brief(requested, 40)}, but the daemon was not started "
                                    "with static partitioning (-S)")
        if assigned is not None:
            found = self.sm_partitions.find(assigned)
            if found is None:  # partition delete took it
                raise InvalidValueError(f"namespace {namespace.name}'s SM partition {assigned} is gone")
            if requested is not None and requested not in (found.id, found.name):
                raise InvalidValueError(f"CUDA_MPS_SM_PARTITION={brief(requested, 40)}, but namespace "
                                        f"{namespace.name} runs its clients in SM partition {assigned} there")
            return found
        found = self.sm_partitions.find(requested) if isinstance(requested, str) else None
        if found is None or found.device != device:
            raise InvalidValueError(f"no SM partition {brief(requested, 40)} on device {device} (lspart lists them)")
        named = self.admission.named(uid)
        if found.server is not None and (named is None or named.name != found.server):
            raise InvalidValueError(f"SM partition {brief(requested, 40)} is server {found.server}'s")
        return found

    def reconfigure(self, context: Context) -> None:
        """Give a connected client the priority level and weight the control plane sets for it now; the
        scheduler uses them from its next placement on."""
        priority = self.settings.priority_for(context.pid, context.uid, context.id)
        namespace = self.admission.namespace_of(context)
        priority = _tighter(priority if namespace is None else namespace.priority(priority), context.requested_priority)
        weight = self.settings.weight_for(context.pid, context.uid, context.id)
        if (priority, weight) == (context.quotas.priority, context.quotas.weight):
            return
        context.quotas = dataclasses.replace(context.quotas, priority=priority, weight=weight)
        context.device.backend.attach(context, sm_cap=context.quotas.sm_cap, priority=priority, weight=weight,
                                      instance=context.partition,
                                      sms=None if context.sm_partition is None else context.sm_partition.sms,
                                      connections=context.quotas.connections)
        self.log.server(f"Client {context.pid}: priority {priority}, weight {weight:g}")

    def _device_index(self, ordinal: Any, visible: Any,
                      seen: list[int] | None = None) -> tuple[int, int | None, int]:
        """Our index of the client's device `ordinal`, through its CUDA_VISIBLE_DEVICES list (None: unset),
        the MIG instance it names where the entry is a MIG device's (else None), and how many devices the
        list leaves the client (its cuDeviceGetCount). `seen`: the only devices
        the client sees (its namespace's), in order, as if they were all there is; its list picks among them.

        Raises:
            NoDeviceError: the list names none of our devices.
            InvalidDeviceError: the ordinal is not one of the visible devices.
        """
        base = list(range(len(self.devices))) if seen is None else seen
        count = len(base)
        if visible is None:
            indices: list[tuple[int, int | None]] = [(i, None) for i in base]
        elif isinstance(visible, list) and all(type(v) is int or (type(v) is str and len(v) <= 64) for v in visible):
            # As in CUDA, an entry that names no device (an index we do not have, a UUID prefix that matches
            # none or several) ends the list.
            indices = []
            for v in visible:
                if (index := self._visible_index(v, base)) is None:
                    break
                indices.append(index)
            if not indices:
                raise NoDeviceError(f"CUDA_VISIBLE_DEVICES names none of the {count} device(s) "
                                    + ("the daemon has" if seen is None else "the client's namespace sees"))
        else:
            raise InvalidValueError("hello: visible must be a list of device indices and UUIDs")
        if type(ordinal) is not int or not 0 <= ordinal < len(indices):
            raise InvalidDeviceError(f"device {brief(ordinal, 20)} does not exist ({len(indices)} visible)")
        return (*indices[ordinal], len(indices))

    def _visible_index(self, entry: int | str, base: list[int]) -> tuple[int, int | None] | None:
        """Our (device index, MIG instance or None) for one CUDA_VISIBLE_DEVICES entry among the devices
        `base` (by our index, in the client's order): an index into it, a UUID or a prefix of one device's UUID,
        or a MIG device as ``MIG-<uuid>`` or ``MIG-GPU-<uuid>/<gi>/<ci>`` (the older form; the compute instance
        must be 0, the only one a partition has here)."""
        if type(entry) is int:
            return (base[entry], None) if 0 <= entry < len(base) else None
        assert isinstance(entry, str)
        devices = [self.devices[i] for i in base]
        if entry.startswith("MIG-GPU-"):
            gpu, _, rest = entry.removeprefix("MIG-").partition("/")
            found = [d for d in devices if d.properties["uuid"] == gpu]
            gi, _, ci = rest.partition("/")
            if (len(found) == 1 and gi.isdecimal() and ci == "0"
                    and int(gi) < len(found[0].instances)):
                return found[0].index, int(gi)
            return None
        if entry.startswith("MIG-"):
            migs = [(d.index, n) for d in devices for n, u in enumerate(d.mig_uuids) if u.startswith(entry)]
            return migs[0] if len(migs) == 1 else None
        matches = [d.index for d in devices if d.properties["uuid"].startswith(entry)]
        return (matches[0], None) if len(matches) == 1 else None

    async def detach(self, context: Context) -> None:
        """The client is gone (closed, exited or killed): reclaim everything it held, in pieces of about
        TEARDOWN_PIECE seconds with every other task's turn between them. The caller shields it from
        cancellation, so that a shutdown waits for it to end."""
        self.control.client_leaving(context)
        teardown = context.teardown()
        clock = time.perf_counter  # the wall's: a test's mock clock does not move while this works
        due = clock() + TEARDOWN_PIECE
        for _ in teardown:
            if clock() >= due:
                await trio.lowlevel.checkpoint()
                due = clock() + TEARDOWN_PIECE
        reclaimed = teardown.reclaimed
        context.device.contexts.pop(context.id, None)
        context.device.backend.forget(context.id)
        context.device.faulted.discard(context.id)
        self.control.client_left(context)
        notify(f"STATUS={self.client_count()} clients")
        self.log.server(
            f"Client {context.pid} disconnected; reclaimed {reclaimed['allocations']} allocations "
            f"({format_size(reclaimed['bytes'])}), {reclaimed['imports']} IPC imports, {reclaimed['streams']} "
            f"streams, {reclaimed['events']} events, {reclaimed['host_buffers']} host buffers"
            + (f", {reclaimed['reservations']} address reservations, {reclaimed['physical']} physical allocations"
               if reclaimed["reservations"] or reclaimed["physical"] else ""))

    def client_count(self) -> int:
        return sum(len(device.contexts) for device in self.devices)

    def terminate(self, context: Context, why: str) -> None:
        """Terminate a client (terminate_client): its work is torn down and every later call of it fails with
        the sticky cudaErrorMpsClientTerminated. Its memory goes when it disconnects."""
        context.set_sticky(MpsClientTerminatedError(f"terminated by the control daemon ({why})"))
        context.device.backend.cancel(context.id)
        self.log.server(f"Client {{PID: {context.pid}, Context: {context.id}}} terminated: {why}")

    def server_gone(self, context: Context) -> None:
        """The client's server was shut down by force (shutdown_server -f, quit's timeout): its work is torn
        down and every later call fails with cudaErrorMpsRpcFailure, as MPS's clients' calls do."""
        context.set_sticky(MpsRpcFailureError("the MPS server was shut down"))
        context.device.backend.cancel(context.id)
        self.log.server(f"Client {{PID: {context.pid}, Context: {context.id}}} lost its server (forced shutdown)")

    def status(self) -> dict[str, Any]:
        """Devices and processes, for mpsd-smi: memory, SM utilisation since the last look, quotas."""
        devices, processes = [], []
        for device in self.devices:
            busy = device.backend.statistics().sm_seconds
            now = device.backend.now()
            last_time, last_busy = device.last_look
            device.last_look = (now, busy)
            span = (now - last_time) * device.properties["multiprocessor_count"]
            devices.append({
                "index": device.index, "name": device.name, "uuid": device.properties["uuid"],
                "pci_bus_id": "{:08X}:{:02X}:{:02X}.0".format(*(device.properties[f"pci_{k}_id"]
                                                               for k in ("domain", "bus", "device"))),
                "server_memory": device.backend.server_memory, "mig": bool(device.instances),
                "compute_capability": device.properties["compute_capability"],
                "compute_mode": COMPUTE_MODES[device.compute_mode],
                "mig_devices": [{"profile": i.name, "uuid": u} for i, u in zip(device.instances, device.mig_uuids)],
                "memory_used": device.ledger.device.reserved, "memory_total": device.total_memory,
                # SM-time of the blocks that ended since the last look, over the SM-time that passed (a real
                # GPU says it itself)
                "sm_utilization": sampled if (sampled := device.backend.utilization()) is not None else
                min(1.0, (busy - last_busy) / span) if span > 0 else 0.0,
                "sms_busy": device.backend.busy_sms(),
                "clock_sm_mhz": device.properties["clock_rate_khz"] // 1000,
                "policy": device.backend.policy, "clients": len(device.contexts), "sim_time": now,
            })
            dispatched = device.backend.dispatch_statistics() if isinstance(device.backend, Dispatcher) else {}
            for ctx in device.contexts.values():
                processes.append({
                    "pid": ctx.pid, "device": device.index, "type": "M+C", "uid": ctx.uid,
                    "memory": ctx.account.reserved, "sm_cap": ctx.quotas.sm_cap,
                    "active_thread_percentage": ctx.quotas.active_thread_percentage,
                    "priority": ctx.quotas.priority, "weight": ctx.quotas.weight, "partition": ctx.partition,
                    "sticky_error": ctx.sticky.name if ctx.sticky else None,
                    # under kernel dispatch: its work held in the daemon, its kernels on the device, device time
                    "dispatch": dispatched.get(ctx.id),
                })
        return {"server_pid": self.control.server.pid, "devices": devices, "processes": processes,
                "host_memory": {"resident": self.host_memory.resident, "reserved": self.host_memory.pending,
                                "pinned": self.host_memory.pinned, "budget": self.host_memory.budget}}

    def client_statistics(self, context: Context) -> dict[str, Any]:
        stats = context.device.backend.statistics()
        mine = stats.per_client.get(context.id)
        counters = context.counters
        return {
            "client_id": context.id, "pid": context.pid, "device": context.device.index,
            "sm_cap": context.quotas.sm_cap, "pinned_mem_limit": context.quotas.pinned_mem_limit,
            "priority": context.quotas.priority, "weight": context.quotas.weight,
            "memory_used": context.account.reserved, "memory_peak": context.account.peak,
            "memory_imported": sum(export.importers[context.id][1].size for export in
                                   {id(e): e for e in context.imports.values()}.values()),
            # of which another device's, mapped over peer access
            "memory_imported_peer": sum(export.importers[context.id][1].size for export in
                                        {id(e): e for e in context.imports.values()}.values()
                                        if export.device != context.device.index),
            "launches": counters.launches, "copies": counters.copies, "bytes_copied": counters.bytes_copied,
            # of copies, those between this device and another, by route (mpsd.runtime.context.Counters)
            "peer_copies_nvlink": counters.peer_copies_nvlink, "peer_copies_staged": counters.peer_copies_staged,
            "bytes_copied_peer": counters.bytes_copied_peer,
            "mallocs": counters.mallocs, "frees": counters.frees,
            "memory_in_use": context.account.in_use,  # of memory_used: live allocations (pools reserve more)
            "memory_pool_reserved": sum(r.size for r in context.reservations.values()),
            "async_mallocs": counters.async_mallocs, "async_frees": counters.async_frees,
            "kernels_completed": mine.kernels if mine else 0,
            "blocks_completed": mine.blocks if mine else 0,
            "block_seconds": mine.block_seconds if mine else 0.0,
            "sm_seconds": mine.sm_seconds if mine else 0.0,
            "max_sms": mine.max_sms if mine else 0,
            "sim_time": stats.now,
            "sticky_error": context.sticky.to_wire() if context.sticky else None,
        }

def _tighter(level: int, requested: int | None) -> int:
    """A client's priority: the daemon's level, or the less urgent level its environment asks for."""
    return level if requested is None else max(level, requested)
