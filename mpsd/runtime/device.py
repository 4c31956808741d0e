# One GPU as the daemon holds it: the simulator and its engine, the memory every client has allocated on it,
# the clients attached to it, and fatal-fault handling. Faults are contained per device, as on Volta+ MPS
# (every client sharing the GPU gets the sticky error), or per client when the daemon is told so.
#
# Memory is counted twice: for the whole device (what mpsd-smi shows) and, under the mig policy, for each
# GPU instance, which owns its profile's eighths of the device's memory. Every charge goes through
# `charge`/`release_memory` with the partition it belongs to, so the two counts never drift apart.
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpsd.backends.engine import DEFAULT_IDLE_GRACE, Engine, VirtualEngine
from mpsd.backends.hostmem import HostMemory, default_budget
from mpsd.backends.recorder import Recorder
from mpsd.sim import DeviceSpec, Simulator, sm_cap
from mpsd_protocol import CudaError

if TYPE_CHECKING:
    from mpsd.runtime.context import Context
    from mpsd.sim.clock import Host
    from mpsd.daemon.servlog import ServerLog


def device_properties(spec: DeviceSpec, index: int) -> dict[str, Any]:
    """``cudaGetDeviceProperties`` for a whole device, in snake_case."""
    return {
        "name": spec.name,
        "index": index,
        "uuid": f"GPU-5eed{index:04x}-0000-4000-8000-{0x6d707364 + index:012x}",
        "compute_capability": list(spec.compute_capability),
        "major": spec.compute_capability[0],
        "minor": spec.compute_capability[1],
        "multiprocessor_count": spec.sm_count,
        "total_memory": spec.total_memory,
        "max_threads_per_multiprocessor": spec.max_threads_per_sm,
        "max_blocks_per_multiprocessor": spec.max_blocks_per_sm,
        "max_threads_per_block": spec.max_threads_per_block,
        "max_block_dims": list(spec.max_block_dims),
        "max_grid_dims": list(spec.max_grid_dims),
        "warp_size": spec.warp_size,
        "regs_per_multiprocessor": spec.regs_per_sm,
        "regs_per_block": spec.regs_per_sm,
        "shared_memory_per_block": 48 * 1024,
        "shared_memory_per_block_optin": spec.max_smem_per_block,
        "shared_memory_per_multiprocessor": spec.smem_per_sm,
        "clock_rate_khz": int(spec.clock_hz / 1e3),
        "memory_bandwidth": spec.mem_bandwidth,
        "stream_priority_range": [0, -5],
    }


class Device:
    """A simulated GPU shared by the daemon's clients."""

    def __init__(self, index: int, spec: DeviceSpec, *, policy: str, time_scale: float,
                 containment: str, log: ServerLog, policy_options: dict[str, Any] | None = None,
                 trace: Path | None = None, clock: str = "wall", idle_grace: float = DEFAULT_IDLE_GRACE,
                 shared_process: bool = False, host_memory: HostMemory | None = None) -> None:
        self.index = index
        self.host_memory = host_memory if host_memory is not None else HostMemory(default_budget())
        self.spec = spec
        self.shared_process = shared_process
        self.properties = device_properties(spec, index)
        self.recorder = Recorder(trace) if trace is not None else None
        self.sim = Simulator(spec, policy=policy, policy_options=policy_options, record=trace is not None)
        self.policy = policy
        self.engine = (VirtualEngine(self.sim, idle_grace, self._went_idle) if clock == "virtual"
                       else Engine(self.sim, time_scale))
        self.total_memory = spec.total_memory
        self.used = spec.server_memory  # device bytes charged: the server, every context, every allocation
        # MIG instances' memory (custom partitions given as SM counts have none of their own: they share
        # the device's), and the bytes charged in each.
        self.partitions = getattr(self.sim.policy, "partitions", ())
        self.partition_used = [0] * len(self.partitions)
        self.contexts: dict[int, Context] = {}
        self.containment = containment
        self.log = log
        self.last_look: tuple[float, float] = (0.0, 0.0)  # (simulated time, SM-seconds) when mpsd-smi last looked
        # Contexts torn down by a fatal fault and not yet gone: while any is, the server is in FAULT and new
        # clients are refused, as MPS refuses them until the faulting clients have exited.
        self.faulted: set[int] = set()

    def _went_idle(self, host: Host) -> None:
        context = self.contexts.get(host.client)
        if context is not None:
            grace = self.engine.idle_grace  # type: ignore[attr-defined]  # only a VirtualEngine calls this
            self.log.server(f"Client {context.pid}: silent for {grace:g} s of wall time; "
                            f"counted idle at simulated time {host.clock:.6f} s, the clock goes on without it")

    def _instance(self, partition: int | None) -> int | None:
        """`partition` if it is a MIG instance with memory of its own, else None (the device's memory)."""
        if partition is None or partition >= len(self.partitions) or not self.partitions[partition].memory:
            return None
        return partition

    def charge(self, nbytes: int, partition: int | None) -> None:
        """Charge `nbytes` of device memory, in MIG instance `partition` if it has memory of its own."""
        self.used += nbytes
        instance = self._instance(partition)
        if instance is not None:
            self.partition_used[instance] += nbytes

    def release_memory(self, nbytes: int, partition: int | None = None) -> None:
        """Device memory is no longer charged for `nbytes` (freed, or an exported segment's last mapping went)."""
        self.charge(-nbytes, partition)

    def memory_total(self, partition: int | None) -> int:
        """Device memory a client bound to `partition` sees: its MIG instance's, or the whole GPU's."""
        instance = self._instance(partition)
        return self.total_memory if instance is None else self.partitions[instance].memory

    def memory_free(self, partition: int | None) -> int:
        """Bytes still free where a client bound to `partition` allocates: its instance and the device."""
        free = self.total_memory - self.used
        instance = self._instance(partition)
        if instance is not None:
            free = min(free, self.partitions[instance].memory - self.partition_used[instance])
        return free

    def partition_sms(self, partition: int | None) -> int:
        """SMs a client bound to `partition` can use: its MIG instance's, or the whole GPU's."""
        return self.partitions[partition or 0].sm_count if self.partitions else self.spec.sm_count

    def client_properties(self, context: Context) -> dict[str, Any]:
        """What one client sees: the SM count capped by its active thread percentage, and under MIG its GPU
        instance's memory, as a MIG instance reports them."""
        return dict(self.properties, multiprocessor_count=context.quotas.sm_cap,
                    total_memory=self.memory_total(context.partition))

    def sm_cap(self, active_thread_percentage: float) -> int:
        return sm_cap(self.spec, active_thread_percentage)

    def fault(self, culprit: Context, error: CudaError) -> None:
        """A fatal GPU error in `culprit`'s work: make it sticky where containment says, drop queued work."""
        self.log.server(f"Client {{PID: {culprit.pid}, Context: {culprit.id}}} encountered a fatal GPU error.")
        victims = list(self.contexts.values()) if self.containment == "device" else [culprit]
        self.log.server("Server is handling a fatal GPU error.")
        for context in victims:
            self.log.server(f"Client {{PID: {context.pid}, Context: {context.id}}} on device {self.index} "
                            "to be torn down")
            context.set_sticky(error)
            self.faulted.add(context.id)
            self.engine.cancel(context.id)
        if self.containment == "device":
            self.log.server(f"The following devices will be reset: {self.index}")
        self.log.server("The following client process have a sticky error set: "
                        + " ".join(str(c.pid) for c in victims))
