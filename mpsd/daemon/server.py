# The daemon: one trio event loop that owns the devices, listens on $CUDA_MPS_PIPE_DIRECTORY/mpsd.sock, gives each
# connection a Session and each session a sub-context with its quotas. Shutdown (SIGTERM, SIGINT, or `stop`)
# stops accepting, stops reading requests, lets replies already in flight finish for a short grace period,
# removes the socket file and returns, so the process exits 0. An exception that leaves `serve` makes the
# process exit 1 (mpsd.daemon.cli), and control.log's last line says which.
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import gc
import logging
import math
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import trio

from mpsd.backends.base import HOST_VIEW, Backend
from mpsd.backends.factory import DeviceDescription, GpuUnavailableError, open_backend
from mpsd.backends.hostmem import HostMemory, default_budget
from mpsd.backends.sim import SimBackend
from mpsd.daemon.channel import Spin
from mpsd.daemon.config import Config
from mpsd.daemon.control_plane import ControlPlane
from mpsd.daemon.control_state import Settings
from mpsd.daemon.control_text import MPS_VERSION
from mpsd.daemon.listeners import (ControlConnections, Greetings, Listeners, ListenError, open_listeners,
                                   write_protocol_file)
from mpsd.daemon.ownership import UnsafePathError
from mpsd.daemon.routes import Route, RouteSockets, open_route
from mpsd.daemon.servlog import ServerLog
from mpsd.daemon.server_process import ServerProcess, ServerProcesses, ServerProcessError
from mpsd.daemon.session import Session
from mpsd.daemon.sm_partitions import PartitionError, SmPartitions
from mpsd.runtime.context import Context, Quotas
from mpsd.runtime.device import COMPUTE_MODES, Device
from mpsd.runtime.dispatch import Dispatcher
from mpsd.runtime.dispatch_policies import kernel_policy
from mpsd.runtime.ipc import IpcRegistry
from mpsd.runtime.limits import FDS, MAPS, ProcessBudget, fd_limit, map_limit
from mpsd.runtime.memory import CHUNK
from mpsd_protocol import (
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
    parse_integer,
)

log = logging.getLogger("mpsd")
SHUTDOWN_GRACE = 5.0  # seconds that in-flight replies get to finish
# Wall seconds of a departed client's teardown between two turns of the other tasks: another client's call
# waits about this long, or two of it, however much the departed one held (mpsd.runtime.teardown).
TEARDOWN_PIECE = 1e-3


class DaemonError(Exception):
    """The daemon cannot start; the message says why."""


class Daemon:
    """An mpsd server for one configuration."""

    def __init__(self, config: Config) -> None:
        """Set up the simulated devices and open the logs.

        Raises:
            DaemonError: the log directory cannot be written, or is not safely the daemon's own.
        """
        self.config = config
        moved = None
        try:
            try:
                self.log = ServerLog(config.log_dir)
            except OSError as exc:
                if not config.default_log_dir or isinstance(exc, UnsafePathError):
                    raise
                # MPS's default log directory is root's to make: any other user's daemon logs beside its pipes.
                moved = f"cannot write logs in {config.log_dir} ({exc.strerror}); they go in {config.pipe_dir}"
                self.log = ServerLog(config.pipe_dir)
        except UnsafePathError as exc:
            raise DaemonError(str(exc)) from None
        except OSError as exc:
            raise DaemonError(f"cannot write logs in {exc.filename or config.log_dir}: {exc.strerror}") from None
        if config.control_log_stdout:
            self.log.echo = sys.stdout
        if moved is not None:
            logging.getLogger("mpsd").warning(moved)
            self.log.server(moved[0].upper() + moved[1:])
        # One budget of host RAM for every device's simulated memory and the clients' pinned buffers mapped here:
        # they all live in this process.
        self.host_memory = HostMemory(config.host_memory if config.host_memory is not None else default_budget())
        # And one count of the fds and memory mappings its clients' objects hold, each against the process's
        # limit less a reserve (mpsd.runtime.limits).
        limits = config.client_limits
        self.fds = ProcessBudget(FDS, limits, fd_limit)
        max_maps = map_limit()
        self.maps = ProcessBudget(MAPS, limits, lambda: max_maps)
        self.devices = [Device(i, self._backend(i, device), containment=config.fault_containment, log=self.log,
                               host_memory=self.host_memory, shared_process=config.shared_process, limits=limits,
                               fds=self.fds, maps=self.maps)
                        for i, device in enumerate(config.devices)]
        self.ipc = IpcRegistry(config.ipc_access, self.log, self.peers)
        self.owner_uid = os.geteuid()
        self.settings = Settings(config.active_thread_percentage, {
            i: limit for i in range(len(self.devices)) if (limit := config.pinned_mem_limit(i)) is not None
        }, config.client_priority)
        # With --mps-names each server has a process of its own named nvidia-cuda-mps-server (its pid the server's).
        self.server_processes = ServerProcesses() if config.mps_names else None
        self._server_process: ServerProcess | None = None
        self.sm_partitions: SmPartitions | None = None  # MPS's -S, or the -a file's SM partitions
        try:
            self._set_up_partitions_and_named_servers()
        except DaemonError:
            self.log.close()  # the daemon never served: nothing will close its logs
            raise
        for named in config.servers:
            if named.client_priority is not None:  # what its user's clients get, as a per-user setting
                self.settings.priorities[("uid", named.uid)] = named.client_priority
        # A caller in this process may take each device's trace as data at exit instead of a file (open_daemon).
        self.keep_traces = False
        self.traces: list[tuple[Any, dict[str, Any]] | None] = []
        self._grace = SHUTDOWN_GRACE
        self.sessions: set[Session] = set()
        self.spin = Spin(config.spin, self.sessions.__len__)  # how long a session reads an emptied socket on
        self.greetings = Greetings(config.handshake_timeout)
        self.controls = ControlConnections()
        self._next_client = 1
        self._stop = trio.Event()
        self.routes: dict[Route, RouteSockets] = {}  # MPS v3's per-server and per-namespace sockets
        self._front: trio.Nursery | None = None  # where accept loops run while the daemon takes clients
        self._sessions: trio.Nursery | None = None
        self.exporter: Any = None  # the Prometheus exporter (mpsd.daemon.metrics) while --metrics serves

    def _set_up_partitions_and_named_servers(self) -> None:
        """Static SM partitioning (-S, or the -a file's partitions), the control plane, and the -a file's
        devices checked against ours and its partitions made.

        Raises:
            DaemonError: the devices cannot be pinned, or the file names a device we lack or a partition that
                does not fit.
        """
        config = self.config
        if config.static_partitioning or any(named.sm_partitions for named in config.servers):
            # The simulator's mps policy is what pins a client to its partition's SMs.
            unpinnable = [d.index for d in self.devices
                          if not isinstance(d.backend, SimBackend) or d.backend.policy != "mps"]
            if unpinnable:
                raise DaemonError("static SM partitioning (-S, or the -a file's sm_partitions) needs simulated "
                                  "devices under the mps policy; not device " + ", ".join(map(str, unpinnable)))
            self.sm_partitions = SmPartitions([d.properties["multiprocessor_count"] for d in self.devices])
        self.control = ControlPlane(self)
        self.admission = self.control.admission  # what a new client may get: the session's view of the control plane
        by_uuid = {device.properties["uuid"]: device.index for device in self.devices}
        for named in config.servers:  # MPS v3's named servers: their devices must be ours
            tables = [(f"servers.{named.name}.allowed_devices", named.allowed_devices),
                      (f"servers.{named.name}.devices", tuple(device.uuid for device in named.devices))]
            tables += [(f"servers.{named.name}.namespaces.{ns.name}.devices", tuple(d.uuid for d in ns.devices))
                       for ns in named.namespaces]
            for where, uuids in tables:
                missing = [uuid for uuid in uuids if uuid not in by_uuid]
                if missing:
                    raise DaemonError(f"{config.apply}: {where} names no device of this daemon: {', '.join(missing)}")
            # Those that take the SMs past the last chunk first: they must lie at their device's end.
            for uuid, spec in sorted(named.sm_partitions, key=lambda entry: not entry[1].include_remainder):
                assert self.sm_partitions is not None
                try:
                    self.sm_partitions.add(by_uuid[uuid], spec.chunks, name=spec.name,
                                           include_remainder=spec.include_remainder, server=named.name)
                except PartitionError as exc:
                    raise DaemonError(f"{config.apply}: servers.{named.name}'s SM partition "
                                      f"{spec.name}: {exc}") from None

    def _backend(self, index: int, device: DeviceDescription) -> Backend:
        """What runs device `index`: a real GPU, or the simulator.

        Raises:
            DaemonError: the real GPU cannot be opened.
        """
        config = self.config
        # Under kernel dispatch the simulator models the hardware the dispatcher feeds: MPS's block scheduler.
        policy, options = ("mps", {}) if config.dispatch == "kernel" else config.device_policy(index)
        try:
            backend = open_backend(device, policy=policy, policy_options=options, clock=config.clock,
                                   time_scale=config.time_scale, idle_grace=config.idle_grace,
                                   trace=config.trace_path(index), host_memory=self.host_memory)
        except GpuUnavailableError as exc:
            raise DaemonError(str(exc)) from None
        if config.kernel_dispatch:
            return Dispatcher(backend, kernel_policy(config.policy, config.policy_options),
                              config.kernels_in_flight, config.dispatch_reaction)
        return backend

    def peers(self, exporter: int, importer: int) -> bool:
        """Whether a context on device `importer` may map device `exporter`'s memory, and copies between them go
        over NVLink: simulated devices (their memory is the host's) unless --peer-access none, or either runs
        MIG partitions (MIG has no peer-to-peer access over NVLink or PCIe); a real GPU's peers are not built
        yet (it takes two)."""
        if self.config.peer_access != "all":
            return False
        devices = [self.devices[index] for index in (exporter, importer)]
        return all(HOST_VIEW in d.backend.capabilities and d.backend.policy != "mig" for d in devices)

    # -- clients ---------------------------------------------------------------------------------------
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
        cap = min(device.backend.sm_cap(percentage), device.partition_sms(partition))
        if sm_partition is not None:  # the percentage applies inside the partition's SMs
            cap = min(cap, sm_partition.sm_count)
        quotas = Quotas(percentage, cap, memory, priority, weight)
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
                              sms=None if sm_partition is None else sm_partition.sms)
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
                                      sms=None if context.sm_partition is None else context.sm_partition.sms)
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

    def now(self) -> float:
        return trio.current_time()

    @staticmethod
    def device_of(context: Context) -> Device:
        return context.device

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

    # -- serving ---------------------------------------------------------------------------------------
    async def wait_stopped(self) -> None:
        """Return once stop() has been called."""
        await self._stop.wait()

    def stop(self, grace: float | None = None) -> None:
        """Begin a clean shutdown; in-flight replies get `grace` seconds (default 5) to finish."""
        if grace is not None:
            self._grace = grace
        self._stop.set()

    async def serve(self, *, handle_signals: bool = True,
                    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until `stop()` or SIGTERM/SIGINT; reports the socket path to `nursery.start` when listening.

        Raises:
            DaemonError: the pipe directory or socket cannot be set up.
        """
        was, limit = raise_fd_limit()
        try:
            listeners = await open_listeners(self.config.pipe_dir, multiuser=self.config.multiuser)
        except ListenError as exc:
            self.log.close()  # the daemon never served: nothing below will close its logs
            raise DaemonError(str(exc)) from None
        try:
            protocol_file = write_protocol_file(self.config.pipe_dir, self.config.protocol)
        except ListenError as exc:
            listeners.close()
            self.log.close()
            raise DaemonError(str(exc)) from None
        if protocol_file is not None:
            listeners.bound.append(protocol_file)
        try:
            for named in self.config.servers:  # $PIPE/<server>/ and $PIPE/<server>/<namespace>/
                self.add_route(Route(named.name, self.control.state.server_key(named.uid)))
                self.add_route(Route(named.name, self.control.state.server_key(named.uid), named_default=True))
                for namespace in self.control.namespaces.get(self.control.state.server_key(named.uid), {}).values():
                    self.add_route(Route(named.name, self.control.state.server_key(named.uid), namespace.name))
        except ListenError as exc:
            self.close_routes()
            listeners.close()
            self.log.close()  # the daemon never served: nothing below will close its logs
            raise DaemonError(str(exc)) from None
        if self.config.metrics is not None:
            try:
                self.exporter = _open_exporter(self, *self.config.metrics)
            except OSError as exc:
                self.close_routes()
                listeners.close()
                self.log.close()
                where = ":".join(map(str, self.config.metrics))
                raise DaemonError(f"cannot serve --metrics on {where}: {exc.strerror or exc}") from None
        control_path = self.config.pipe_dir / "control"
        self.log.control(f"Starting control daemon using socket {control_path}"
                         + (" (sockets from systemd)" if listeners.activated else ""))
        self.log.control("To connect CUDA applications to this daemon, set env "
                         f"CUDA_MPS_PIPE_DIRECTORY={self.config.pipe_dir}")
        self.log.control(f"CUDA MPS Control binary version: {MPS_VERSION}")
        if self.config.apply is not None:  # mpsd's line: what MPS v3 logs of its -a file is not documented
            self.log.control(f"Applied configuration {self.config.apply}: servers "
                             + (", ".join(named.name for named in self.config.servers) or "none"))
        self.log.server(f"Server {self.log.pid} started on {len(self.devices)} device(s): "
                        + ", ".join(d.name for d in self.devices)
                        + "; policy " + ", ".join(dict.fromkeys(d.backend.policy for d in self.devices))
                        + (f", virtual clock (idle grace {self.config.idle_grace:g} s)"
                           if self.config.clock == "virtual" else f", time scale {self.config.time_scale}"))
        # Two fds per 2 MiB of device memory at most (a segment and its mapping): what the fds must cover so
        # that memory, not fds, is what runs out.
        needed = sum(2 * (device.total_memory // CHUNK) for device in self.devices)
        self.log.server(f"File descriptor limit {limit}" + (f" (raised from {was})" if was != limit else "")
                        + f", {self.fds.kept(limit)} of them kept from clients (--fd-reserve)"
                        + (f"; the devices' memory in 2 MiB allocations would need {needed}, so raise the hard "
                           "limit (LimitNOFILE= under systemd)" if limit < needed else ""))
        # And a mapping per 2 MiB on the simulated device (none on a GPU).
        maps, needed = self.maps.limit(), sum(d.backend.host_maps * (d.total_memory // CHUNK) for d in self.devices)
        self.log.server(f"Memory map limit {maps} (vm.max_map_count), {self.maps.kept(maps)} of them kept from "
                        "clients (--map-reserve)" + (f"; the devices' memory in 2 MiB allocations would need {needed}, "
                                                     "so raise it (sysctl)" if maps < needed else ""))
        if self.exporter is not None:
            self.log.server(f"Metrics for Prometheus at {self.exporter.url}" + (
                ": reachable from other hosts (--metrics-allow-remote), and they show every client's pid and uid"
                if self.exporter.remote else ""))
        received = (trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) if handle_signals
                    else contextlib.nullcontext(None))
        failure: BaseException | None = None
        try:
            # The signal receiver is installed before we say we are ready, so an early SIGTERM is never lost.
            with received as signals:
                async with trio.open_nursery() as engines:
                    for device in self.devices:
                        await engines.start(device.backend.run)
                    await self._serve_clients(listeners, signals, task_status)
                    engines.cancel_scope.cancel()
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if handle_signals:  # we are on our way out: a second signal must not cut the clean-up short
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            listeners.close()
            self.close_routes()
            self.end_server_process()
            if self.server_processes is not None:
                self.server_processes.close()
            self._write_traces()
            self.log.server("Server exited")
            self.log.control(f"Exit with status {_exit_status(failure)}")
            self.log.close()

    def _write_traces(self) -> None:
        # Drawing a trace makes millions of objects, none of them in cycles, so the collector's scans of the whole
        # heap while it draws found nothing; they took up to a second each (a DISB-C run of 2 s spent 3.6 s of
        # its daemon's exit in them). No collection runs meanwhile.
        if self.keep_traces:
            self.traces = [device.backend.timeline(device.index) for device in self.devices]
            return
        self.write_traces()

    def write_traces(self) -> list[str]:
        """Write each traced device's timeline so far where --trace says (at exit, or when an operator asks:
        mpsd-control's mpsd_trace); what was written, as server.log says it."""
        said = []
        collecting = gc.isenabled()
        gc.disable()  # (see _write_traces)
        try:
            for device in self.devices:
                try:
                    path = device.backend.write_trace(device.index)
                    if path is not None:
                        said.append(f"Trace of device {device.index} written to {path}")
                except OSError as exc:
                    said.append(f"Cannot write the trace of device {device.index}: {exc}")
        finally:
            if collecting:
                gc.enable()
        for line in said:
            self.log.server(line)
        return said

    async def _serve_clients(self, listeners: Listeners, signals: Any,
                             task_status: trio.TaskStatus[Path]) -> None:
        async with trio.open_nursery() as sessions:
            async with trio.open_nursery() as front:  # the tasks that end when shutdown begins
                self._front, self._sessions = front, sessions
                front.start_soon(self._accept, listeners.clients, sessions, self._serve_session)
                front.start_soon(self._accept, listeners.control, sessions, self.control.serve)
                for sockets in self.routes.values():
                    front.start_soon(self._accept_route, sockets)
                front.start_soon(self.control.run_shutdown_retries)
                if self.exporter is not None:  # scrapes are answered from here until shutdown begins
                    await front.start(self.exporter.run)
                if signals is not None:
                    front.start_soon(self._watch_signals, signals)
                watchdog = _watchdog_interval()
                if watchdog:
                    front.start_soon(_keep_watchdog_fed, watchdog)
                notify("READY=1\nSTATUS=accepting clients")
                task_status.started(self.config.socket_path)
                await self._stop.wait()
                front.cancel_scope.cancel()
            self._front = None
            notify("STOPPING=1")
            self.log.server("Shutting down")
            # No new client may wait in the listen queue for a handshake that never comes: it is refused now.
            listeners.close()
            self.close_routes()
            for session in list(self.sessions):
                session.reader_scope.cancel()
            sessions.cancel_scope.deadline = trio.current_time() + self._grace

    async def _accept(self, listener: trio.socket.SocketType, nursery: trio.Nursery, serve: Any) -> None:
        failed = 0  # accepts refused in a row: said once when it begins, then once a minute with the count
        said = -math.inf
        while True:
            try:
                sock, _ = await listener.accept()
            except trio.ClosedResourceError:
                return  # a namespace's socket, closed by namespace delete
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    failed += 1
                    if trio.current_time() - said >= 60:  # (it is tried ten times a second)
                        log.warning("accept failed (%s), %d time%s in a row; trying again every 0.1 s", exc,
                                    failed, "" if failed == 1 else "s")
                        said = trio.current_time()
                    await trio.sleep(0.1)
                    continue
                raise
            if failed:
                log.warning("accepting again after %d failed accept%s", failed, "" if failed == 1 else "s")
                failed, said = 0, -math.inf
            nursery.start_soon(serve, sock)

    # -- the servers' processes (--mps-names) ---------------------------------------------------------------
    def start_server_process(self, uid: int | None) -> int:
        """The pid of the server that starts now: its own process's, or the daemon's where it has none."""
        self.end_server_process()
        if self.server_processes is None or self._front is None:
            return self.log.pid
        try:
            process = self.server_processes.start(uid)
        except ServerProcessError as exc:
            self.log.server(f"{exc}; the server's pid is the daemon's", pid=self.log.pid)
            return self.log.pid
        self._server_process = process
        self.log.server_pid = process.pid
        self._front.start_soon(self._watch_server, process)
        return process.pid

    def end_server_process(self) -> None:
        """The server ends: so does its process (it is reaped by its watcher)."""
        process, self._server_process = self._server_process, None
        self.log.server_pid = self.log.pid
        if process is not None:
            process.end()

    async def _watch_server(self, process: ServerProcess) -> None:
        status = await process.wait()
        if self._server_process is process:  # it died while its server ran: killed
            self._server_process = None
            self.log.server_pid = self.log.pid
            self.control.server_died(process.pid, status)

    # -- MPS v3's routed sockets --------------------------------------------------------------------------
    def add_route(self, route: Route) -> None:
        """Listen on `route`'s sockets ($PIPE/<server>[/<namespace>]/), from now on where clients are taken.

        Raises:
            ListenError: its directory is not safely ours, or a socket cannot be bound.
        """
        if route in self.routes:
            return
        sockets = open_route(self.config.pipe_dir, route, multiuser=self.config.multiuser)
        self.routes[route] = sockets
        if self._front is not None:
            self._front.start_soon(self._accept_route, sockets)

    def remove_route(self, route: Route) -> None:
        """Stop listening on `route`'s sockets and remove them (clients that came by them stay)."""
        sockets = self.routes.pop(route, None)
        if sockets is not None:
            sockets.close()

    def close_routes(self) -> None:
        # Namespaces' directories before their servers', which hold them.
        for route in sorted(self.routes, key=lambda r: r.is_server):
            self.remove_route(route)

    async def _accept_route(self, sockets: RouteSockets) -> None:
        assert self._sessions is not None
        with sockets.scope:
            async with trio.open_nursery() as loops:
                loops.start_soon(self._accept, sockets.clients, self._sessions,
                                 functools.partial(self._serve_session, route=sockets.route))
                loops.start_soon(self._accept, sockets.control, self._sessions,
                                 functools.partial(self.control.serve, route=sockets.route))

    async def _serve_session(self, tsock: trio.socket.SocketType, route: Route | None = None) -> None:
        # Sessions drive the plain socket themselves (see mpsd.daemon.channel), without trio's wrapper.
        sock = socket.socket(fileno=tsock.detach())
        try:
            session = Session(self, sock, route)
        except OSError:
            sock.close()
            return
        if self.greetings.admit(session.uid) == 1:
            self.log.server(f"User {session.uid} has {self.greetings.limit} connections that have not said hello; "
                            "closing the oldest of them for each new one until one does or is closed")
        self.sessions.add(session)
        try:
            async with self.greetings.open_handshake(session.uid, session, sock) as handshake:
                await session.run()
            if self.greetings.evicted(session):
                pass  # (the line above said so, once for the run of them)
            elif handshake.cancelled_caught:
                self.log.server(f"Client {session.pid}: no hello within {self.greetings.timeout:g} s; its "
                                "connection was closed")
            elif session.channel.overflowed:
                self.log.server(f"Client {session.pid}: {session.channel.overflowed}; its connection was closed")
        except Exception:
            # A bug met by one client's input ends that client's session, never the daemon.
            log.exception("session of client %d failed", session.pid)
            self.log.complaint(("uid", session.uid), f"Client {session.pid}: internal error; its connection was closed")
        finally:
            self.sessions.discard(session)

    def greeted(self, session: Session) -> None:
        """`session` has said hello: it no longer counts against its uid's bound, nor has a deadline."""
        self.greetings.greeted(session.uid, session)

    async def _watch_signals(self, signals: Any) -> None:
        async for signum in signals:
            self.log.server(f"Received {signal.Signals(signum).name}")
            self.stop()
            return


def _open_exporter(daemon: Daemon, host: str, port: int) -> Any:
    """The Prometheus exporter, bound to HOST:PORT; imported only when asked for, as prometheus-client's HTTP
    server costs every other start about 50 ms to import.

    Raises:
        OSError: the address cannot be bound.
    """
    from mpsd.daemon.metrics import Exporter

    return Exporter(daemon, host, port)


def _exit_status(failure: BaseException | None) -> int:
    """The status mpsd.daemon.cli exits with when `serve` ends with `failure`: 0 when serving ended cleanly (or our
    caller cancelled it, which is no failure of ours), 1 for any exception (mpsd.daemon.cli turns a DaemonError into
    exit 1, and Python exits 1 on any other)."""
    if failure is None or isinstance(failure, trio.Cancelled):
        return 0
    if isinstance(failure, BaseExceptionGroup) and failure.split(trio.Cancelled)[1] is None:
        return 0
    return 1


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit, as a server that holds an fd per client and per
    allocation should (systemd gives services a soft limit of 1024 unless the unit says LimitNOFILE=).

    Returns:
        The soft limit before and after (the same when it could not be raised).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:  # Linux caps the fd table at fs.nr_open, whatever the limit says
        try:
            hard = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            return soft, soft
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the file descriptor limit from %d to %d: %s", soft, hard, exc)
            return soft, soft
        return soft, hard
    return soft, soft


def _tighter(level: int, requested: int | None) -> int:
    """A client's priority: the daemon's level, or the less urgent level its environment asks for."""
    return level if requested is None else max(level, requested)


def _watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings when systemd asked for them (WatchdogSec=), else None."""
    usec, pid = os.environ.get("WATCHDOG_USEC", ""), os.environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        return parse_integer(usec, max_digits=20) / 1e6 / 2  # twice per period, as sd_watchdog_enabled(3) advises
    except ValueError:
        return None


async def _keep_watchdog_fed(interval: float) -> None:
    # Runs on the event loop, so a loop that stops turning stops the pings and systemd notices.
    while True:
        notify("WATCHDOG=1")
        await trio.sleep(interval)


def notify(state: str) -> None:
    """Tell systemd (Type=notify) about our state, if it is listening; a no-op otherwise."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError as exc:
            log.warning("cannot notify systemd at %s: %s", address, exc)
