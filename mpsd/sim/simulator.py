# The simulator's public class. Its engine is compiled (the crate in simcore/, imported as mpsd._core):
# this class checks what comes in, turns the spec and each launch's shape into the numbers the engine needs
# (once per device, once per launch shape), and hands the engine the caller's own op objects, which come
# back from advance/run/cancel with their times written on them; or, for a kernel given by plain values
# (`launch`), a record the engine makes and writes natively (mpsd._core.Handle). There is one engine: the
# Python one it replaced was deleted once this one matched it to the bit (tests/test_sim_differential.py holds
# it to the Python engine's recorded behaviour).
"""The simulated GPU: ``Simulator``."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator
from typing import Any

import numpy as np

from .. import _core
from .costs import BlockCost
from .ops import ENGINES, BlockGroup, Copy, Kernel, Marker, Op
from .policies import DEFAULT_CLIENT, BuiltinPolicy, ClientConfig, make_policy
from .policies.custom import Policy, load_policy
from .policies.mig import MigPolicy
from .shapes import Shapes
from .specs import H200, BlockNeed, DeviceSpec
from .stats import ClientStatistics, SimStatistics

__all__ = ["Simulator"]

# simcore/src/copies.rs's codes: PCIe each way, NVLink each way, and this device's leg of a staged copy.
_ENGINE_CODES = {"d2h": 0, "h2d": 1, "peer_in": 2, "peer_out": 3, "staged_in": 4, "staged_out": 5}


def _spec_numbers(spec: DeviceSpec) -> tuple:
    """What the compiled engine needs of ``spec``, in the order it takes them."""
    duplex = dict(spec.copy_duplex)
    return (spec.sm_count, spec.max_threads_per_sm // spec.warp_size, spec.max_blocks_per_sm, spec.regs_per_sm,
            spec.smem_per_sm, spec.min_block_time, spec.kernel_overhead,
            ([(float(t), float(b)) for t, b in spec.dram_curve], spec.dram_knee, float(spec.dram_beyond)),
            (spec.copy_latency, spec.pcie_bandwidth, spec.copy_timeslice, duplex.get("d2h"), duplex.get("h2d"),
             spec.peer_copy_latency, spec.nvlink_bandwidth))


class Simulator:
    """A simulated GPU shared by many clients.

    Args:
        spec: the device model.
        policy: dispatch policy name, a key of ``POLICIES``: "mps", "round-robin", "priority", "fair",
            "exclusive", "mig" or "timeslice"; or a policy written in Python (``mpsd.sim.Policy``): an
            instance, or its class named as "module:Class" (built with ``policy_options`` as keyword
            arguments).
        record: keep a trace of every block group (``trace``, ``trace_columns``; a block preempted and resumed
            appears once per stretch it ran).
        policy_options: the policy's settings, e.g. ``{"aging": 0.005}`` for "priority",
            ``{"partitions": ["3g.71gb", "3g.71gb"]}`` for "mig", ``{"timeslice": 1e-3, "switch": 25e-6}``
            for "timeslice".

    Raises:
        ValueError: unknown policy, or an option it does not know or accept.
    """

    def __init__(self, spec: DeviceSpec = H200, policy: str | Policy = "mps", record: bool = False,
                 policy_options: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self._trace: list[BlockGroup] = []  # the groups ``trace`` has built so far
        self._clients: dict[int, ClientConfig] = {}
        self._shapes = Shapes(spec)
        self._launch: dict[tuple[int, int, int], tuple] = {}  # (threads, regs, smem) -> the engine's numbers
        self._streams: dict[tuple, int] = {}  # (client, stream) -> the engine's number for it
        self._stream_numbers = itertools.count()  # never reused: a forgotten client's numbers stay retired
        # client -> (the engine's numbers of its hardware work queues, a count of its streams), for clients
        # configured with connections (CUDA_DEVICE_MAX_CONNECTIONS)
        self._queues: dict[int, tuple[list[int], Iterator[int]]] = {}
        self._queue_numbers = itertools.count()
        self._min_block = spec.min_block_time
        if isinstance(policy, str) and ":" in policy:
            policy = load_policy(policy, policy_options)
        elif isinstance(policy, Policy) and policy_options:
            raise ValueError("a policy object takes its settings in its own constructor, not policy_options")
        self._policy: BuiltinPolicy | Policy
        if isinstance(policy, Policy):  # written in Python: the engine calls it at each dispatch
            self._policy = policy
            self._core = _core.Engine(_spec_numbers(spec), "python", policy, record)
            return
        # A built-in's Python object checks the options and is what ``policy`` shows; the engine runs its own.
        self._policy = make_policy(policy, self, policy_options)
        self._core = _core.Engine(_spec_numbers(spec), policy, self._policy.engine_args(), record)

    @property
    def now(self) -> float:
        """Simulated seconds."""
        return self._core.now

    @property
    def trace(self) -> list[BlockGroup]:
        """Every block group recorded so far, in the order they ended (empty without ``record``). The engine
        keeps them as columns (``trace_columns``); this builds the groups not built yet, so it is for tests and
        small runs: a long run's millions are read as columns."""
        if len(self._trace) < self._core.trace_len():
            kernels, kernel, sm, count, start, end = self.trace_columns(len(self._trace))
            self._trace += map(BlockGroup, [kernels[k] for k in kernel.tolist()], sm.tolist(), count.tolist(),
                               start.tolist(), end.tolist())
        return self._trace

    def trace_columns(self, first: int = 0) -> tuple[list[Kernel], np.ndarray, np.ndarray, np.ndarray,
                                                     np.ndarray, np.ndarray]:
        """The recorded block groups from the ``first``-th on, as columns: group i ran ``count[i]`` blocks of
        ``kernels[kernel[i]]`` on SM ``sm[i]`` from ``start[i]`` to ``end[i]``, as ``trace[first + i]`` has them.

        Returns:
            (kernels, kernel, sm, count, start, end): every kernel recorded so far, and read-only arrays of
            int64 (kernel, sm, count) and float64 (start, end).
        """
        kernels, *columns = self._core.trace_columns(first)
        kernel, sm, count, start, end = (np.frombuffer(b, dtype=t) for b, t in
                                         zip(columns, (np.uint32, np.uint32, np.int64, np.float64, np.float64)))
        return kernels, kernel.astype(np.int64), sm.astype(np.int64), count, start, end

    def submit(self, op: Op) -> None:
        """Submit an op at the current time (sets ``op.submitted`` and ``op.seq``).

        Args:
            op: a Kernel, Copy or Marker not submitted before.

        Raises:
            ValueError: the op was already submitted; a kernel with blocks < 1, a block that cannot fit
                on an SM, or sm_cap < 1; a copy on an unknown engine or with negative nbytes,
                or over NVLink on a device without it.
            TypeError: not a Kernel, Copy or Marker.
        """
        if op.seq != -1:
            raise ValueError("op already submitted")
        if isinstance(op, Kernel):
            self.launch(op.client, op.stream, op.after, op.blocks, op.threads, op.cost, op.smem, op.priority,
                        op.sm_cap, op.regs_per_thread, op, overhead=op.launch_overhead)
        elif isinstance(op, Copy):
            if op.engine not in ENGINES:
                raise ValueError(f"unknown copy engine {op.engine!r}; known: {ENGINES}")
            if op.nbytes < 0:
                raise ValueError(f"nbytes must be >= 0, got {op.nbytes}")
            if op.engine.startswith("peer") and self.spec.nvlink_bandwidth <= 0:
                raise ValueError(f"{self.spec.name} has no NVLink: a copy between devices is staged")
            self._core.submit_copy(op, op.client, self._stream(op.client, op.stream), op.after,
                                   _ENGINE_CODES[op.engine], op.nbytes)
        elif isinstance(op, Marker):
            self._core.submit_marker(op, op.client, self._stream(op.client, op.stream), op.after)
        else:
            raise TypeError(f"cannot submit {type(op).__name__}")
        return None

    @property
    def handles(self) -> bool:
        """Whether ``launch`` may be used: not in a recorded run (its trace names the Kernel objects) nor under
        a policy written in Python (its dispatch is handed them)."""
        return self._core.handles

    def launch(self, client: int, stream: Hashable, after: tuple, blocks: int, threads: int, cost: BlockCost,
               smem: int = 0, priority: int = 0, sm_cap: int | None = None, regs_per_thread: int = 32,
               _kernel: Kernel | None = None, count: int = 1, overhead: float | None = None) -> Any:
        """Submit, at the current time, the kernel ``Kernel(client=client, stream=stream, ...)`` would be, with
        no Kernel made: what a daemon does for a launch whose only outcome it reads is when it ended. (``submit``
        hands a Kernel's own fields here with the Kernel as ``_kernel``: the checks and numbers are in one place,
        and a launch pays for no call more.) ``overhead``, if given, is the device's launch overhead before it in
        place of the spec's ``kernel_overhead`` (a graph's node: ``DeviceSpec.graph_node_overhead``).

        Returns:
            Its record: ``client``, ``seq``, ``submitted``, ``eligible``, ``started``, ``ended``, ``done`` and
            ``cancelled`` read as a Kernel's would, and ``tag`` is the caller's. It compares and hashes by
            identity, is named in later ops' ``after`` as a Kernel is, and is what ``advance``, ``run`` and
            ``cancel`` return for it. With ``count`` above 1, that many such kernels go one after another on
            the stream, the first after ``after``, and this is the last one's record: the others have none
            (``advance`` and ``cancel`` return nothing for them; the stream's order says when they end).

        Raises:
            ValueError: as ``submit`` for such a Kernel; ``handles`` is false; ``count`` is below 1; or
                ``overhead`` is negative or not finite.
        """
        if blocks < 1:
            raise ValueError(f"kernel needs at least one block, got {blocks}")
        shape = (threads, regs_per_thread, smem)
        numbers = self._launch.get(shape)
        if numbers is None:
            launch = self._shapes.launch(*shape)
            need = launch.need
            numbers = self._launch[shape] = (launch.shape, need.warps, need.regs, need.smem, launch.demand,
                                             launch.sm_share)
        if sm_cap is not None and sm_cap < 1:
            raise ValueError(f"sm_cap must be >= 1, got {sm_cap}")
        if overhead is not None and not 0 <= overhead < float("inf"):
            raise ValueError(f"a launch overhead is a finite time >= 0, not {overhead}")
        seconds = cost.seconds
        number = self._streams.get((client, stream))  # _stream, inlined: every launch comes here
        if number is None:
            number = self._stream(client, stream)
        return self._core.submit_kernel(_kernel, client, number, after, blocks, threads, priority, sm_cap,
                                        (seconds, cost.shared, cost.clocked, cost.dram, cost.weight), numbers,
                                        self._min_block if self._min_block > seconds else seconds, count,
                                        overhead)

    def _stream(self, client: int, stream: Hashable) -> int:
        key = (client, stream)
        n = self._streams.get(key)
        if n is None:
            n = self._streams[key] = next(self._stream_numbers)
            queues = self._queues.get(client)
            if queues is not None:  # round robin, as CUDA aliases a context's streams onto its connections
                numbers, made = queues
                self._core.stream_queue(n, client, numbers[next(made) % len(numbers)])
        return n

    def block_need(self, threads: int, regs_per_thread: int = 32, smem: int = 0) -> BlockNeed | None:
        """What one block of this shape takes from an SM, or None if one cannot fit (cached: every launch
        asks)."""
        return self._shapes.block_need(threads, regs_per_thread, smem)

    def configure_client(self, client: int, *, priority: int = 0, weight: float = 1.0,
                         partition: str | int | None = None, sms: tuple[int, int] | None = None,
                         connections: int | None = None) -> None:
        """Set how the policy treats ``client`` (call when it attaches; unconfigured clients get the defaults).

        Takes effect for blocks placed from now on; blocks already resident stay where they are.

        Args:
            client: the tenant id.
            priority: lower is more urgent: 0 normal, 1 below normal (CUDA_MPS_CLIENT_PRIORITY), other
                integers for finer daemon-side levels (used by "priority").
            weight: share of SM-time, > 0 (used by "fair").
            partition: MIG partition: index, its decimal string or a profile name; None for partition 0
                (used by "mig").
            sms: a static SM partition (MPS's -S), as (first SM, SM count): the client's blocks go only on
                those SMs (used by "mps"; copy engines and DRAM stay shared). None: any SM.
            connections: the hardware work queues its streams are aliased onto, round robin in the order the
                simulator first meets them (CUDA_DEVICE_MAX_CONNECTIONS; CUDA's default is 8): a kernel or
                marker then also waits until the earlier ones of its queue have become eligible, so streams
                sharing a queue falsely depend on each other. For streams met from now on. None: a queue per
                stream.

        Raises:
            ValueError: a non-integer priority, a weight that is not positive and finite, a partition
                the MIG layout does not have, SMs the device does not have or a policy other than "mps", or
                connections below 1.
        """
        if connections is not None:
            if type(connections) is not int or connections < 1:
                raise ValueError(f"connections must be an int >= 1, got {connections!r}")
            queues = self._queues.get(client)
            if queues is None or len(queues[0]) != connections:
                self._queues[client] = ([next(self._queue_numbers) for _ in range(connections)], itertools.count())
        config = ClientConfig(priority, weight, partition, sms)
        if sms is not None and self._policy.name != "mps":
            raise ValueError(f"a static SM partition needs the mps policy, not {self._policy.name}")
        self._policy.configure(client, config)  # checks it (a MIG partition must exist)
        self._clients[client] = config
        index = self._policy.resolve(partition) if isinstance(self._policy, MigPolicy) else 0
        window = None if sms is None else (sms[0], sms[0] + sms[1])
        self._core.configure_client(client, priority, float(weight), index, window)
        return None

    def forget_client(self, client: int) -> None:
        """A client is gone for good: cancel what it left, and keep nothing per client about it (its SM-time
        still counts in ``statistics().sm_seconds``)."""
        self._core.forget_client(client)
        self._policy.forget(client)
        self._clients.pop(client, None)
        self._queues.pop(client, None)
        for key in [key for key in self._streams if key[0] == client]:  # a daemon meets clients without end
            del self._streams[key]
        return None

    def client_config(self, client: int) -> ClientConfig:
        """The configuration ``client`` was given, or the defaults."""
        return self._clients.get(client, DEFAULT_CLIENT)

    @property
    def policy(self) -> BuiltinPolicy | Policy:
        """The policy in force (its name is ``policy.name``)."""
        return self._policy

    def next_time(self) -> float | None:
        """Time of the next internal event.

        Returns:
            ``now`` if completions are waiting to be returned, else the time of the earliest pending
            event, or None if nothing is running or waiting on time.
        """
        return self._core.next_time()

    def advance(self, until: float, max_instants: int | None = None) -> list[Op]:
        """Process every event with time <= ``until`` and move the clock to ``until``.

        Args:
            until: the new simulated time.
            max_instants: stop after this many instants with events; the clock then stays at the last
                one processed (below ``until``), so a caller in real time can yield and come back.

        Returns:
            The ops completed (including those completed at submit), in completion order, ties in
            submission order; each has started, ended and done set.

        Raises:
            ValueError: ``until`` is before ``now`` (or NaN).
        """
        now = self._core.now
        if not until >= now:
            raise ValueError(f"cannot go back in time from {now} to {until}")
        if max_instants is not None and max_instants < 0:
            max_instants = 0
        return self._core.advance(float(until), max_instants)

    def run(self) -> list[Op]:
        """Advance in virtual time until nothing is left to do.

        Returns:
            Every op completed, in completion order.
        """
        return self._core.run()

    def cancel(self, client: int) -> list[Op]:
        """A client's context is torn down (it died, or a fatal fault took it): drop all its work.

        Ops not yet started are dropped; running blocks are evicted at once and a copy in flight stops, as
        when the MPS server destroys a context. None of them is reported as completed. Other clients' ops
        that depend on any of them go ahead now.

        Args:
            client: the tenant id.

        Returns:
            The dropped (never started) ops, in submission order.
        """
        return self._core.cancel(client)

    def statistics(self) -> SimStatistics:
        """A snapshot of the counters (see ``SimStatistics``)."""
        now, kernels, blocks, copies, per_client, sm_seconds = self._core.statistics()
        return SimStatistics(now, kernels, blocks, copies, {c[0]: ClientStatistics(*c[1:]) for c in per_client},
                             sm_seconds)

    def busy_sms(self, client: int | None = None) -> int:
        """SMs with at least one resident block (of ``client``, if given)."""
        return self._core.busy_sms(client)

    def stranded_blocks(self) -> int:
        """Blocks of ready kernels that would fit now on SMs their client may use (its MIG window, its SM
        cap), yet wait: idle capacity while work is queued. Always 0 between calls under the
        work-conserving policies ("mps", "round-robin", "fair", "mig", and "priority" without aging)."""
        return self._core.stranded_blocks()
