# The simulated backend: a calibrated H200 (mpsd.sim) behind the backend protocol. It turns the runtime's work
# (mpsd.backends.ops) into the simulator's ops with what each costs (the kernel's cost model; copy engines for
# host copies; the kernels the runtime launches for device copies and memsets), drives the simulator under the
# wall or the virtual clock (mpsd.backends.engine), and applies each op's effect on the bytes when it completes:
# device memory is memfd segments (mpsd.backends.memfd), kernels (built-in or a module's: mpsd.modules) are
# computed by their declared numpy references, and the host RAM all of it costs is kept within a budget
# (mpsd.backends.hostmem).
"""The simulated GPU backend."""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import trio

from mpsd.backends.base import HOST_VIEW, VIRTUAL_MEMORY, Client, Gate, Instance
from mpsd.backends.engine import DEFAULT_IDLE_GRACE, Engine, VirtualEngine
from mpsd.backends.hostmem import HostMemory, Reservation, default_budget
from mpsd.backends.memfd import Segment
from mpsd.backends.ops import Copy, Extent, GraphLaunch, Launch, Memset, Plan, Record, Work
from mpsd.backends.recorder import Recorder
from mpsd.backends.vrange import VirtualRange
from mpsd.clock import DeviceClock, Host
from mpsd.sim import (COPY_KINDS, BlockCost, DeviceSpec, Kernel, Marker, Op, Simulator, copy_kernel, function_cost,
                      sm_cap)
from mpsd.sim import occupancy as sm_occupancy
from mpsd.sim import Copy as SimCopy
from mpsd_protocol import DEFAULT_CONNECTIONS, CudaError, IllegalAddressError, LaunchFailureError

if TYPE_CHECKING:
    from mpsd.record.timeline import Timeline

__all__ = ["SimBackend", "device_properties"]

log = logging.getLogger("mpsd.backends.sim")
_CHUNK = 64 << 20  # a memset writes its pattern in pieces this size, so a huge one needs no huge temporary
_MAX_COSTS = 4096  # launch costs kept, by kernel, grid, block and arguments


def device_properties(spec: DeviceSpec, index: int) -> dict[str, Any]:
    """``cudaGetDeviceProperties`` for a whole simulated device, in snake_case."""
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
        # cudaDeviceProp's pciDomainID, pciBusID, pciDeviceID: one bus per simulated device
        "pci_domain_id": 0, "pci_bus_id": 0x18 + index, "pci_device_id": 0,
    }


class SimBackend:
    """A simulated GPU.

    Args:
        spec: the device model.
        policy, policy_options: how the simulator shares it (mpsd.sim.POLICIES).
        clock: "wall" (simulated time follows the wall clock x `time_scale`) or "virtual" (it moves as the
            clients' stamped calls allow, with `idle_grace`: mpsd.backends.engine).
        trace: where to write the device's timeline at exit, if anywhere.
        host_memory: the daemon's budget of host RAM for simulated memory, shared by its devices.
        on_fault: told of a fatal error in a client's work (an illegal address), to contain it.
        on_idle: under the virtual clock, told of each client counted idle after its grace (client, its
            simulated clock, the grace).
    """

    capabilities = frozenset({HOST_VIEW, VIRTUAL_MEMORY})
    memory_fds = 2  # a memfd segment's own and its mapping's (Python's mmap keeps a duplicate)
    host_maps = 1  # a segment's mapping; a reserved range's (mpsd.backends.vrange)

    def __init__(self, spec: DeviceSpec, *, policy: str = "mps", policy_options: dict[str, Any] | None = None,
                 clock: str = "wall", time_scale: float = 1.0, idle_grace: float = DEFAULT_IDLE_GRACE,
                 trace: Path | None = None, host_memory: HostMemory | None = None,
                 on_fault: Callable[[int, CudaError], None] = lambda client, error: None,
                 on_idle: Callable[[int, float, float], None] = lambda client, clock, grace: None) -> None:
        self.spec = spec
        self.name = spec.name
        self.policy = policy
        self.total_memory = spec.total_memory
        self.server_memory, self.context_memory = spec.server_memory, spec.context_memory
        self.on_fault, self.on_idle = on_fault, on_idle
        self.sim = Simulator(spec, policy=policy, policy_options=policy_options, record=trace is not None)
        self.device_clock = DeviceClock(self.sim)  # the device's simulated time, the engine's and the recorder's
        self.engine = (VirtualEngine(self.device_clock, idle_grace, self._went_idle) if clock == "virtual"
                       else Engine(self.device_clock, time_scale))
        self.virtual = self.engine if isinstance(self.engine, VirtualEngine) else None
        self.recorder = Recorder(trace) if trace is not None else None
        self.host_memory = host_memory if host_memory is not None else HostMemory(default_budget())
        self.instances = tuple(Instance(p.profile, p.sm_count, p.memory)
                               for p in getattr(self.sim.policy, "partitions", ()))
        self._reservations: dict[int, dict[Op, Reservation]] = {}  # client -> host RAM its queued ops may touch
        # launch costs by plan key (kernel, grid, block, arguments): (blocks, threads per block, cost per block)
        self._costs: dict[tuple[object, ...], tuple[int, int, BlockCost]] = {}
        # All the daemon reads of a launch's op is when it ended (and calls its tag, the effect on the bytes of one
        # that touches memory), so the simulator makes its record natively (Simulator.launch) rather than be
        # handed a Kernel, except where the Kernel objects are needed (a trace; a policy written in Python).
        self._plain = self.recorder is None and self.sim.handles
        # The simulator's streams for each executable graph's nodes (_lanes), while the graph lives.
        self._graph_lanes: weakref.WeakKeyDictionary[Any, list[tuple[int, Any]]] = weakref.WeakKeyDictionary()
        self._graph_numbers = itertools.count()

    # -- what the device is ----------------------------------------------------------------------------
    def properties(self, index: int) -> dict[str, Any]:
        return device_properties(self.spec, index)

    def allocate(self, nbytes: int) -> Segment:
        return Segment(nbytes)

    def reserve(self, nbytes: int) -> VirtualRange:
        return VirtualRange(nbytes)

    def fits(self, threads: int, shared_mem: int, regs: int = 32) -> bool:
        return self.sim.block_need(threads, regs, shared_mem) is not None

    def occupancy(self, function: Any, threads: int, shared_mem: int) -> int:
        return sm_occupancy(self.spec, threads, function.registers, function.shared + shared_mem)

    def load_module(self, module: Any) -> None:
        """Nothing to do: the simulator runs a module's declarations as they are."""

    def sm_cap(self, active_thread_percentage: float) -> int:
        return sm_cap(self.spec, active_thread_percentage)

    def _went_idle(self, host: Host) -> None:
        self.on_idle(host.client, host.clock, self.engine.idle_grace)  # type: ignore[attr-defined]  # (only a VirtualEngine calls it)

    # -- clients -----------------------------------------------------------------------------------------
    def attach(self, client: Client, *, sm_cap: int, priority: int, weight: float, instance: int | None,
               sms: tuple[int, int] | None = None, connections: int = DEFAULT_CONNECTIONS) -> None:
        self.engine.catch_up()  # what happened until now happened under the old settings
        self.sim.configure_client(client.id, priority=priority, weight=weight, partition=instance, sms=sms,
                                  connections=connections)
        if self.recorder is not None:
            # (The recorder reads a Context's quotas and account, more than Client promises: the runtime's
            # clients are Contexts.)
            self.recorder.attached(client)  # type: ignore[arg-type]

    def cancel(self, client: int) -> None:
        self.engine.cancel(client)
        for reservation in self._reservations.pop(client, {}).values():  # work that never runs touches nothing
            self.host_memory.settle(reservation)

    def forget(self, client: int) -> None:
        self.engine.forget(client)
        for reservation in self._reservations.pop(client, {}).values():
            self.host_memory.settle(reservation)

    def release_host(self, buffer: Any) -> None:
        """Nothing holds a pinned host buffer here beyond its mapping."""

    # -- work --------------------------------------------------------------------------------------------
    def received(self, at: float) -> None:
        self.engine.arrival = at

    def submit(self, work: Work, count: int = 1, gate: Gate | None = None, late: float = 0.0) -> None:
        # (never given a gate: `gate()` makes none here)
        if late and type(work) is Launch:  # its launch overhead the longer (the first of a run: the rest follow)
            for i in range(count):
                each = work if i == count - 1 else Launch.of(work.client, work.stream, work.priority, work.sm_cap,
                                                             work.plan, ())
                if i == 0 and each is not work:
                    each.after, work.after = work.after, ()
                self._submit_op(each, self.spec.kernel_overhead + late if i == 0 else None)
            return
        if type(work) is Launch and self._plain:
            # Most launches touch no memory (spin, work): they skip the host RAM budget altogether.
            touched = self.host_memory.reserve(touches) if work.extents and (touches := self._touches(work)) else None
            try:
                handle = self._launch(work, count)
            except BaseException:
                if touched is not None:
                    self.host_memory.settle(touched)
                raise
            if work.extents:  # its effect on the bytes, applied when it completes (what _op gives a Kernel)
                handle.tag = functools.partial(self._complete, work)
                if touched is not None:
                    self._reservations.setdefault(work.client, {})[handle] = touched
            return
        if type(work) is GraphLaunch:
            self._submit_graph(work)
            return
        for _ in range(count - 1):  # each kernel needs its own Kernel object: the same plan, launched again
            # (only a Launch comes more than once)
            each = Launch.of(work.client, work.stream, work.priority, work.sm_cap, work.plan, ())  # type: ignore[attr-defined]
            each.after, work.after = work.after, ()  # the first waits for what the run waits for
            self._submit_op(each)
        self._submit_op(work)

    def _submit_op(self, work: Work, overhead: float | None = None) -> None:
        # Most launches touch no memory (spin, work): they skip the host RAM budget altogether.
        touches = self._touches(work) if type(work) is not Launch or work.extents else None
        touched = self.host_memory.reserve(touches) if touches else None
        op = self._op(work)
        if overhead is not None:  # a graph's kernel node (_submit_graph), or a launch late by the daemon's reaction
            op.launch_overhead = overhead  # type: ignore[attr-defined]  # (a launch's op is a Kernel)
        try:
            self.engine.submit(op)
        except BaseException:
            if touched is not None:
                self.host_memory.settle(touched)
            raise
        work.handle = op
        if touched is not None:
            self._reservations.setdefault(work.client, {})[op] = touched

    def _submit_graph(self, work: GraphLaunch) -> None:
        """A graph launch: a marker on its stream that the roots wait for (so they come after the stream's earlier
        work and what `after` names), its nodes on streams of the graph's own, one a chain of it (branches run
        side by side, each node after its dependencies), and a marker on its stream after the last nodes, which
        is the launch's record and what the stream's next work waits for. The nodes cost what the same work
        launched one by one costs the device, but for each kernel's launch overhead, which is the spec's
        graph_node_overhead (the device is handed the graph whole). If the backend refuses a node (host RAM), the
        nodes submitted before it still run."""
        client, stream = work.client, work.stream
        entry = Record(client=client, stream=stream, priority=work.priority, sm_cap=work.sm_cap, after=work.after)
        self._submit_op(entry)
        lanes = self._lanes(work)
        overhead = self.spec.graph_node_overhead
        sinks = set(range(len(work.nodes)))
        for node, deps, lane in zip(work.nodes, work.deps, lanes):
            node.stream = lane
            # (an event wait node's own `after`, the record it waits for, stays beside its dependencies)
            node.after = (tuple(work.nodes[d] for d in deps) if deps else (entry,)) + node.after
            sinks.difference_update(deps)
            if type(node) is Launch and overhead is not None:
                self._submit_op(node, overhead)
            elif type(node) is Launch and self._plain:
                self.submit(node)
            else:
                self._submit_op(node)
        end = Record(client=client, stream=stream, priority=work.priority, sm_cap=work.sm_cap,
                     after=tuple(work.nodes[i] for i in sorted(sinks)) or (entry,))
        self._submit_op(end)
        work.handle, work.after = end.handle, ()

    def _lanes(self, work: GraphLaunch) -> list[tuple[int, Any]]:
        """Streams of the simulator for a graph's nodes: a node goes on the lane of the first of its
        dependencies whose lane has nothing after it yet, else on a new one, so a chain is one lane. Kept by
        the executable graph, whose launches run one after another anyway."""
        found = self._graph_lanes.get(work.graph)
        if found is not None:
            return found
        last: dict[int, int] = {}  # lane -> the node last put on it
        lanes: list[int] = []
        for index, deps in enumerate(work.deps):
            lane = next((lanes[d] for d in deps if last.get(lanes[d]) == d), len(last))
            last[lane] = index
            lanes.append(lane)
        number = next(self._graph_numbers)
        streams = [(work.client, ("graph", number, lane)) for lane in lanes]
        self._graph_lanes[work.graph] = streams
        return streams

    def _launch(self, work: Launch, count: int) -> Any:
        """`count` kernels of `work` for the simulator to make its own records of (Simulator.launch): the last
        one's is work's handle."""
        plan = work.plan
        blocks, threads, cost = self._costs.get(plan.key) or self._cost(plan)
        work.handle = handle = self.engine.launch(work.client, work.stream,
                                                  _handles(work.after) if work.after else (), blocks, threads, cost,
                                                  plan.smem, work.priority, work.sm_cap, count,
                                                  plan.function.registers)
        work.after = ()  # as _op does: no chain of finished work stays reachable from a stream's tail
        return handle

    def gate(self) -> None:
        """None: the simulator's completions reach the daemon at the instant they happen (its clock stands still
        while the daemon decides), so what the dispatcher releases then starts when it would have, ahead or not."""
        return None

    def when_done(self, work: Iterable[Work | None], callback: Callable[[], None]) -> None:
        self.engine.when_done([w.handle for w in work if w is not None], callback)

    def _cost(self, plan: Plan) -> tuple[int, int, BlockCost]:
        """A plan's blocks, threads per block and cost per block, which `_costs` keeps by its key: a loop
        launches the same kernel with the same arguments again and again, so each launch looks there first and
        its cost is computed once (pointer arguments make new keys, so the cache is cleared when it grows
        large)."""
        blocks, threads = plan.blocks, plan.threads
        cost = function_cost(self.spec, plan.function, blocks, threads, plan.args)
        if len(self._costs) >= _MAX_COSTS:
            self._costs.clear()
        entry = self._costs[plan.key] = (blocks, threads, cost)
        return entry

    def _op(self, work: Work) -> Op:
        after = _handles(work.after) if work.after else ()
        client, stream = work.client, work.stream
        op: Op
        if isinstance(work, Launch):
            plan = work.plan
            blocks, threads, cost = self._costs.get(plan.key) or self._cost(plan)
            op = Kernel.of(client, stream, after, blocks, threads, cost, plan.smem, work.priority, work.sm_cap)
            op.regs_per_thread = plan.function.registers
            if self.recorder is not None:
                self.recorder.launched(op, plan.kernel)
            if work.extents:  # one that touches no memory has no effect to apply and no host RAM to settle
                op.tag = functools.partial(self._complete, work)
            work.after = ()
            return op
        elif isinstance(work, (Copy, Memset)):
            kind = work.kind if isinstance(work, Copy) else "memset"
            nbytes = work.dst.nbytes
            peer = _peer_engine(work) if isinstance(work, Copy) else None
            if peer is not None:  # between devices: a copy engine over NVLink, or this device's staged leg
                op = SimCopy(client=client, stream=stream, after=after, engine=peer, nbytes=nbytes)
            elif kind in COPY_KINDS:  # the runtime launches a kernel for these: the client's quotas hold
                blocks, threads, cost = copy_kernel(self.spec, kind, nbytes, work.sm_cap)
                op = Kernel(client=client, stream=stream, after=after, blocks=blocks, threads=threads, cost=cost,
                            priority=work.priority, sm_cap=work.sm_cap)
                self._record(op, "memcpy_dtod" if kind == "d2d" else kind)
            else:
                op = SimCopy(client=client, stream=stream, after=after, engine=kind, nbytes=nbytes)
        elif isinstance(work, Record):
            op = Marker(client=client, stream=stream, after=after)
        else:
            raise TypeError(f"no such work: {work!r}")
        # The op holds its work only through its tag, which the engine drops once the op completes or is
        # cancelled, so a staged copy's bytes go with it; and the work forgets what it waited for, so that no
        # chain of finished work stays reachable from a stream's tail (a launch's, above, the same way).
        op.tag = functools.partial(self._complete, work)
        work.after = ()
        return op

    def _record(self, op: Kernel, name: str) -> None:
        if self.recorder is not None:
            self.recorder.launched(op, name)

    def _touches(self, work: Work) -> list[tuple[Segment, int, int]]:
        """The device memory `work` will touch: what the host RAM budget must make room for."""
        extents: list[Extent | None]
        if isinstance(work, Launch):
            if not work.extents:  # spin and work touch no memory
                return []
            extents = [extent for _, extent in work.extents]
        elif isinstance(work, Copy):
            extents = [work.dst, work.src]
        elif isinstance(work, Memset) and work.value == 0:
            # Zeros are written as holes, which cost no RAM: only the partial pages at the ends count.
            dst = work.dst
            extents = [Extent(dst.memory, dst.offset, min(dst.nbytes, 1)),
                       Extent(dst.memory, dst.offset + dst.nbytes - 1, min(dst.nbytes, 1))]
        elif isinstance(work, Memset):
            extents = [work.dst]
        else:
            extents = []
        out: list[tuple[Segment, int, int]] = []
        for e in extents:
            if e is not None and isinstance(e.memory, Segment):
                out.append((e.memory, e.offset, e.nbytes))
            elif e is not None and isinstance(e.memory, VirtualRange):  # the memfds mapped behind a range
                out += e.memory.pieces(e.offset, e.nbytes)
        return out

    def _complete(self, work: Work, op: Op) -> None:
        """The op completed in the simulator: its effect lands on the bytes, then its host RAM is measured."""
        try:
            self._effect(work)
        finally:
            reservations = self._reservations.get(work.client)
            touched = reservations.pop(op, None) if reservations else None
            if touched is not None:
                self.host_memory.settle(touched)

    def _effect(self, work: Work) -> None:
        if isinstance(work, Launch):
            if not work.extents:  # a kernel without pointer arguments changes no bytes
                return
            views, plan = [], work.plan
            for index, extent in work.extents:
                view = _view(extent)
                if view is None:
                    self.on_fault(work.client, IllegalAddressError(
                        f"{plan.kernel} argument {index} ({int(plan.args[index]):#x}) points outside live memory"))
                    return
                views.append(view)
            run = plan.function.reference
            if run is None:
                return
            try:
                run(views, plan.args)
            except Exception as exc:  # a module's reference is not to be trusted: its fault is its client's
                self.on_fault(work.client, LaunchFailureError(
                    f"{plan.kernel}'s reference raised {type(exc).__name__}: {str(exc)[:200]}"))
        elif isinstance(work, Copy):
            target = _view(work.dst)
            source = work.data if work.data is not None else _view(work.src)
            work.data = None  # used up: whoever still holds the work (a stream's tail, a queue) holds no bytes
            if (target is None or source is None) and self._unmapped(work, [work.dst, work.src]):
                return
            if target is not None and source is not None:
                target[:] = memoryview(source)  # a memmove: right where a copy within one segment overlaps
        elif isinstance(work, Memset):
            dst = work.dst
            if work.value == 0 and isinstance(dst.memory, Segment):
                self.host_memory.zero(dst.memory, dst.offset, dst.nbytes)
                return
            if work.value == 0 and isinstance(dst.memory, VirtualRange) and _view(dst) is not None:
                for segment, offset, nbytes in dst.memory.pieces(dst.offset, dst.nbytes):
                    self.host_memory.zero(segment, offset, nbytes)
                return
            target = _view(dst)
            if target is None and self._unmapped(work, [dst]):
                return
            if target is not None:
                pattern = bytes([work.value]) * min(dst.nbytes, _CHUNK)
                for start in range(0, dst.nbytes, _CHUNK):
                    end = min(start + _CHUNK, dst.nbytes)
                    target[start:end] = pattern[:end - start]

    def _unmapped(self, work: Work, extents: list[Extent | None]) -> bool:
        """Whether `work` touches a page of a reserved range that was unmapped after it was queued: then it
        faults with an illegal address, as on a GPU (a host buffer that went is skipped, as before)."""
        for extent in extents:
            if extent is not None and isinstance(extent.memory, VirtualRange) and _view(extent) is None:
                self.on_fault(work.client, IllegalAddressError(
                    f"a {type(work).__name__.lower()} touches an unmapped page of a reserved address range"))
                return True
        return False

    # -- time and what happened ----------------------------------------------------------------------
    def now(self) -> float:
        return self.engine.sim_now()

    def clock_info(self) -> dict[str, Any]:
        """How clients relate the device's time to theirs (sent in the hello reply)."""
        if self.virtual is not None:
            return {"kind": "virtual"}
        return {"kind": "wall", "time_scale": self.engine.time_scale, "origin": self.engine.monotonic_origin()}

    def statistics(self) -> Any:
        return self.sim.statistics()

    def busy_sms(self) -> int:
        return self.sim.busy_sms()

    def utilization(self) -> None:
        """Not sampled: the daemon counts it from the SM-time of the blocks that ended (statistics)."""
        return None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.engine.run(task_status=task_status)

    def write_trace(self, index: int) -> Path | None:
        """Write the device's timeline, if one was asked for; where it went.

        Raises:
            OSError: it cannot be written.
        """
        return None if self.recorder is None else self.recorder.written(self, index)

    def timeline(self, index: int) -> tuple[Timeline, dict[str, Any]] | None:
        if self.recorder is None:
            return None
        engine = self.engine
        return self.recorder.timeline(self), self.recorder.meta(index, engine.monotonic_origin(), engine.time_scale,
                                                                engine.max_lag)


def _handles(after: tuple[Work, ...]) -> tuple[Any, ...]:
    """The simulator's records of the work `after` names, of those that have one."""
    return tuple(w.handle for w in after if w.handle is not None)


def _peer_engine(copy: Copy) -> str | None:
    """The simulator's engine for a copy between this device and another (None: within this device): over
    NVLink between peers, reading the other's memory or writing it; else this device's leg of a copy staged
    through host memory."""
    if copy.src_device is None and copy.dst_device is None:
        return None
    way = "in" if copy.src_device is not None else "out"
    return f"peer_{way}" if copy.peer_access else f"staged_{way}"


def _view(extent: Extent | None) -> memoryview | None:
    """The bytes of `extent` in the daemon's mapping of its memory, or None if that mapping is gone (a host
    buffer the client unregistered while a copy into it was queued)."""
    if extent is None:
        return None
    if isinstance(extent.memory, VirtualRange):
        return extent.memory.view(extent.offset, extent.nbytes)
    if extent.memory.map.closed:
        return None
    return memoryview(extent.memory.map)[extent.offset:extent.offset + extent.nbytes]
