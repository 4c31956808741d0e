# One GPU as the runtime holds it: the backend that runs its work, its memory ledger, the clients attached to
# it, and fatal-fault handling. Faults are contained per device, as on Volta+ MPS (every client sharing the GPU
# gets the sticky error), or per client when the daemon is told so.
from __future__ import annotations

import uuid
from pathlib import Path

from typing import TYPE_CHECKING, Any

from mpsd.backends.base import Backend
from mpsd.runtime.ledger import Ledger
from mpsd.runtime.limits import FDS, MAPS, ClientLimits, ProcessBudget, fd_limit, map_limit
from mpsd.runtime.modules import ModuleLibrary
from mpsd_protocol import CudaError

if TYPE_CHECKING:
    from mpsd.backends.hostmem import HostMemory
    from mpsd.daemon.servlog import ServerLog
    from mpsd.runtime.context import Context


# nvidia-smi's compute modes, as -c takes them -> as its reports name them
COMPUTE_MODES = {"DEFAULT": "Default", "PROHIBITED": "Prohibited", "EXCLUSIVE_PROCESS": "Exclusive_Process"}


class Device:
    """A GPU shared by the daemon's clients.

    Args:
        index: its ordinal in the daemon.
        backend: what runs its work (mpsd.backends).
        containment: "device" (a fatal fault tears down every client on it) or "client" (only the culprit).
        host_memory: the daemon's host RAM budget (mpsd.backends.hostmem.HostMemory), shared by its devices:
            what its clients' pinned host buffers are counted against.
        shared_process: every client is a process of its own though they share one pid (mpsd-stress
            --virtual-time plays every tenant in the daemon's process).
        limits: what each of its clients may hold (mpsd.runtime.limits).
        fds, maps: the fds and memory mappings the daemon holds for its clients, shared by its devices (a budget of
            its own if None).
        module_path: the directories its clients may load modules from (--module-path; none: built-ins only).
    """

    def __init__(self, index: int, backend: Backend, *, containment: str, log: ServerLog, host_memory: HostMemory,
                 shared_process: bool = False, limits: ClientLimits = ClientLimits(),
                 fds: ProcessBudget | None = None, maps: ProcessBudget | None = None,
                 module_path: tuple[Path, ...] = ()) -> None:
        self.index = index
        self.backend = backend
        self.modules = ModuleLibrary(module_path, backend)  # the module files its clients may load
        self.host_memory = host_memory
        self.limits = limits
        self.fds = fds if fds is not None else ProcessBudget(FDS, limits, fd_limit)
        self.maps = maps if maps is not None else ProcessBudget(MAPS, limits, map_limit)
        backend.on_fault, backend.on_idle = self.fault, self.went_idle
        self.name = backend.name
        self.shared_process = shared_process
        self.properties = backend.properties(index)
        # torch's name for it beside CUDA's (torch.cuda.get_device_properties(0).multi_processor_count)
        self.properties["multi_processor_count"] = self.properties["multiprocessor_count"]
        self.instances = backend.instances
        # Each MIG instance's UUID, as nvidia-smi -L lists them and CUDA_VISIBLE_DEVICES takes them: derived
        # from the device's, so that the same device gives the same ones on every run.
        gpu = self.properties["uuid"]
        self.mig_uuids = [f"MIG-{uuid.uuid5(uuid.NAMESPACE_OID, f'{gpu}/{n}')}" for n in range(len(self.instances))]
        self.ledger = Ledger(backend.total_memory, backend.server_memory, [i.memory for i in self.instances])
        self.contexts: dict[int, Context] = {}
        self.containment = containment
        self.log = log
        # nvidia-smi -c's setting (mpsd-smi -c): PROHIBITED refuses new clients; DEFAULT and EXCLUSIVE_PROCESS,
        # the one MPS is run under, let every client in through the server alike.
        self.compute_mode = "DEFAULT"
        self.last_look: tuple[float, float] = (0.0, 0.0)  # (device time, SM-seconds) when mpsd-smi last looked
        # Contexts torn down by a fatal fault and not yet gone: while any is, the server is in FAULT and new
        # clients are refused, as MPS refuses them until the faulting clients have exited.
        self.faulted: set[int] = set()

    @property
    def total_memory(self) -> int:
        return self.ledger.device.total

    def memory_total(self, partition: int | None) -> int:
        """Device memory a client bound to `partition` sees: its MIG instance's, or the whole GPU's."""
        return self.ledger.total(partition)

    def memory_free(self, partition: int | None) -> int:
        """Bytes still free where a client bound to `partition` allocates: its instance and the device."""
        return self.ledger.free(partition)

    def partition_sms(self, partition: int | None) -> int:
        """SMs a client bound to `partition` can use: its MIG instance's, or the whole GPU's."""
        return self.instances[partition or 0].sm_count if self.instances else self.properties["multiprocessor_count"]

    def client_properties(self, context: Context) -> dict[str, Any]:
        """What one client sees: the SM count capped by its active thread percentage, and under MIG its GPU
        instance's memory, as a MIG instance reports them."""
        return dict(self.properties, multiprocessor_count=context.quotas.sm_cap,
                    multi_processor_count=context.quotas.sm_cap, total_memory=self.memory_total(context.partition))

    def went_idle(self, client: int, clock: float, grace: float) -> None:
        """Under the virtual clock, a client stayed silent past its grace and the others go on without it."""
        context = self.contexts.get(client)
        if context is not None:
            self.log.server(f"Client {context.pid}: silent for {grace:g} s of wall time; "
                            f"counted idle at simulated time {clock:.6f} s, the clock goes on without it")

    def fault(self, client: int, error: CudaError) -> None:
        """A fatal GPU error in a client's work: make it sticky where containment says, drop queued work."""
        culprit = self.contexts.get(client)
        if culprit is None or culprit.closed:
            return
        self.log.server(f"Client {{PID: {culprit.pid}, Context: {culprit.id}}} encountered a fatal GPU error.")
        victims = list(self.contexts.values()) if self.containment == "device" else [culprit]
        self.log.server("Server is handling a fatal GPU error.")
        for context in victims:
            self.log.server(f"Client {{PID: {context.pid}, Context: {context.id}}} on device {self.index} "
                            "to be torn down")
            context.set_sticky(error)
            self.faulted.add(context.id)
            self.backend.cancel(context.id)
        if self.containment == "device":
            self.log.server(f"The following devices will be reset: {self.index}")
        self.log.server("The following client process have a sticky error set: "
                        + " ".join(str(c.pid) for c in victims))
