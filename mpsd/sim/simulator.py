# The simulator's public class. Its engine is compiled (the crate in simcore/, imported as mpsd.sim._core):
# this class checks what comes in, turns the spec and each launch's shape into the numbers the engine needs
# (once per device, once per launch shape), and hands the engine the caller's own op objects, which come
# back from advance/run/cancel with their times written on them. Policies the crate does not have yet run on
# the Python engine (engine.py), behind the same methods.
"""The simulated GPU: ``Simulator``."""

from __future__ import annotations

from typing import Any

from . import _core
from .engine import PythonEngine
from .ops import ENGINES, BlockGroup, Copy, Kernel, Marker, Op
from .policies import DEFAULT_CLIENT, ClientConfig, Policy, make_policy
from .shapes import Shapes
from .specs import H200, BlockNeed, DeviceSpec
from .stats import ClientStatistics, SimStatistics

__all__ = ["COMPILED_POLICIES", "Simulator"]

COMPILED_POLICIES = frozenset(_core.compiled_policies())
_ENGINE_CODES = {"d2h": 0, "h2d": 1}


def _spec_numbers(spec: DeviceSpec) -> tuple:
    """What the compiled engine needs of ``spec``, in the order it takes them."""
    duplex = dict(spec.copy_duplex)
    return (spec.sm_count, spec.max_threads_per_sm // spec.warp_size, spec.max_blocks_per_sm, spec.regs_per_sm,
            spec.smem_per_sm, spec.min_block_time, spec.kernel_overhead,
            ([(float(t), float(b)) for t, b in spec.dram_curve], spec.dram_knee, float(spec.dram_beyond)),
            (spec.copy_latency, spec.pcie_bandwidth, spec.copy_timeslice, duplex.get("d2h"), duplex.get("h2d")))


def _policy_args(policy: Policy, spec: DeviceSpec) -> object:
    """What the compiled policy needs of the settings its Python object checked (the same floats)."""
    if policy.name == "priority":
        return None if policy._aging is None else float(policy._aging)
    if policy.name == "timeslice":
        return (policy._slice, policy._switch, policy._state, policy._warp_slots)
    if policy.name == "mig":
        return [(p.first_sm, p.sm_count, p.memory / spec.total_memory if p.memory else p.sm_count / spec.sm_count)
                for p in policy.partitions]
    return None


class _CompiledPolicy:
    """The policy in force, as ``Simulator.policy`` shows it when the compiled engine runs it.

    What is fixed once the options are checked (name, settings, a MIG layout and how it names partitions)
    comes from the Python policy object that checked them; what moves as the simulation runs (timeslice's
    ``switches``) comes from the engine. Anything else is state the engine keeps and this does not show.
    """

    _STATIC = frozenset({"name", "options", "settings", "dispatch_when_idle", "partitions", "resolve",
                         "partition_of", "window", "copy_lane", "dram_share"})

    def __init__(self, policy: Policy, core: Any) -> None:
        self._policy = policy
        self._core = core

    def __getattr__(self, name: str) -> Any:
        value = self._core.policy_counter(name)
        if value is not None:
            return value
        if name in self._STATIC:
            return getattr(self._policy, name)
        raise AttributeError(f"{type(self._policy).__name__} keeps {name!r} in the compiled engine, which does not "
                             f"show it")

    def __repr__(self) -> str:
        return f"<compiled {self._policy.name} policy>"


class Simulator:
    """A simulated GPU shared by many clients.

    Args:
        spec: the device model.
        policy: dispatch policy name, a key of ``POLICIES``: "mps", "round-robin", "priority", "fair",
            "exclusive", "mig" or "timeslice".
        record: keep a trace of every block group in ``trace`` (a block preempted and resumed appears once
            per stretch it ran).
        policy_options: the policy's settings, e.g. ``{"aging": 0.005}`` for "priority",
            ``{"partitions": ["3g.71gb", "3g.71gb"]}`` for "mig", ``{"timeslice": 1e-3, "switch": 25e-6}``
            for "timeslice".

    Raises:
        ValueError: unknown policy, or an option it does not know or accept.
    """

    def __init__(self, spec: DeviceSpec = H200, policy: str = "mps", record: bool = False,
                 policy_options: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self._ref: PythonEngine | None = None
        if policy not in COMPILED_POLICIES:
            self._ref = PythonEngine(spec, policy, record, policy_options)
            self.trace: list[BlockGroup] = self._ref.trace
            return
        self.trace = []
        self._clients: dict[int, ClientConfig] = {}
        self._shapes = Shapes(spec)
        self._launch: dict[tuple[int, int, int], tuple] = {}  # (threads, regs, smem) -> the engine's numbers
        self._streams: dict[tuple, int] = {}  # (client, stream) -> the engine's number for it
        self._min_block = spec.min_block_time
        # The Python policy object checks the options and is what ``policy`` shows; the engine runs its own.
        self._policy = make_policy(policy, self, policy_options)
        self._core = _core.Engine(_spec_numbers(spec), policy, _policy_args(self._policy, spec), self.trace,
                                  BlockGroup, record)
        self._view = _CompiledPolicy(self._policy, self._core)

    @property
    def now(self) -> float:
        """Simulated seconds."""
        return self._core.now if self._ref is None else self._ref.now

    def submit(self, op: Op) -> None:
        """Submit an op at the current time (sets ``op.submitted`` and ``op.seq``).

        Args:
            op: a Kernel, Copy or Marker not submitted before.

        Raises:
            ValueError: the op was already submitted; a kernel with blocks < 1, a block that cannot fit
                on an SM, or sm_cap < 1; a copy on an unknown engine or with negative nbytes.
            TypeError: not a Kernel, Copy or Marker.
        """
        if self._ref is not None:
            return self._ref.submit(op)
        if op.seq != -1:
            raise ValueError("op already submitted")
        if isinstance(op, Kernel):
            if op.blocks < 1:
                raise ValueError(f"kernel needs at least one block, got {op.blocks}")
            shape = (op.threads, op.regs_per_thread, op.smem)
            numbers = self._launch.get(shape)
            if numbers is None:
                launch = self._shapes.launch(*shape)
                need = launch.need
                numbers = self._launch[shape] = (launch.shape, need.warps, need.regs, need.smem, launch.demand,
                                                 launch.sm_share)
            if op.sm_cap is not None and op.sm_cap < 1:
                raise ValueError(f"sm_cap must be >= 1, got {op.sm_cap}")
            cost = op.cost
            seconds = cost.seconds
            self._core.submit_kernel(op, op.client, self._stream(op), op.after, op.blocks, op.threads, op.priority,
                                     op.sm_cap, (seconds, cost.shared, cost.clocked, cost.dram, cost.weight),
                                     numbers, self._min_block if self._min_block > seconds else seconds)
        elif isinstance(op, Copy):
            if op.engine not in ENGINES:
                raise ValueError(f"unknown copy engine {op.engine!r}; known: {ENGINES}")
            if op.nbytes < 0:
                raise ValueError(f"nbytes must be >= 0, got {op.nbytes}")
            self._core.submit_copy(op, op.client, self._stream(op), op.after, _ENGINE_CODES[op.engine], op.nbytes)
        elif isinstance(op, Marker):
            self._core.submit_marker(op, op.client, self._stream(op), op.after)
        else:
            raise TypeError(f"cannot submit {type(op).__name__}")
        return None

    def _stream(self, op: Op) -> int:
        key = (op.client, op.stream)
        n = self._streams.get(key)
        if n is None:
            n = self._streams[key] = len(self._streams)
        return n

    def block_need(self, threads: int, regs_per_thread: int = 32, smem: int = 0) -> BlockNeed | None:
        """What one block of this shape takes from an SM, or None if one cannot fit (cached: every launch
        asks)."""
        if self._ref is not None:
            return self._ref.block_need(threads, regs_per_thread, smem)
        return self._shapes.block_need(threads, regs_per_thread, smem)

    def configure_client(self, client: int, *, priority: int = 0, weight: float = 1.0,
                         partition: str | int | None = None) -> None:
        """Set how the policy treats ``client`` (call when it attaches; unconfigured clients get the defaults).

        Takes effect for blocks placed from now on; blocks already resident stay where they are.

        Args:
            client: the tenant id.
            priority: lower is more urgent: 0 normal, 1 below normal (CUDA_MPS_CLIENT_PRIORITY), other
                integers for finer daemon-side levels (used by "priority").
            weight: share of SM-time, > 0 (used by "fair").
            partition: MIG partition: index, its decimal string or a profile name; None for partition 0
                (used by "mig").

        Raises:
            ValueError: a non-integer priority, a weight that is not positive and finite, or a partition
                the MIG layout does not have.
        """
        if self._ref is not None:
            return self._ref.configure_client(client, priority=priority, weight=weight, partition=partition)
        config = ClientConfig(priority, weight, partition)
        self._policy.configure(client, config)  # checks it (a MIG partition must exist)
        self._clients[client] = config
        index = self._policy.resolve(partition) if self._policy.name == "mig" else 0
        self._core.configure_client(client, priority, float(weight), index)
        return None

    def forget_client(self, client: int) -> None:
        """A client is gone for good: cancel what it left, and keep nothing per client about it (its SM-time
        still counts in ``statistics().sm_seconds``)."""
        if self._ref is not None:
            return self._ref.forget_client(client)
        self._core.forget_client(client)
        self._policy.forget(client)
        self._clients.pop(client, None)
        return None

    def client_config(self, client: int) -> ClientConfig:
        """The configuration ``client`` was given, or the defaults."""
        if self._ref is not None:
            return self._ref.client_config(client)
        return self._clients.get(client, DEFAULT_CLIENT)

    @property
    def policy(self) -> Policy:
        """The policy in force (its name is ``policy.name``)."""
        return self._view if self._ref is None else self._ref.policy

    def next_time(self) -> float | None:
        """Time of the next internal event.

        Returns:
            ``now`` if completions are waiting to be returned, else the time of the earliest pending
            event, or None if nothing is running or waiting on time.
        """
        if self._ref is not None:
            return self._ref.next_time()
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
        if self._ref is not None:
            return self._ref.advance(until, max_instants)
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
        if self._ref is not None:
            return self._ref.run()
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
        if self._ref is not None:
            return self._ref.cancel(client)
        return self._core.cancel(client)

    def statistics(self) -> SimStatistics:
        """A snapshot of the counters (see ``SimStatistics``)."""
        if self._ref is not None:
            return self._ref.statistics()
        now, kernels, blocks, copies, per_client, sm_seconds = self._core.statistics()
        return SimStatistics(now, kernels, blocks, copies, {c[0]: ClientStatistics(*c[1:]) for c in per_client},
                             sm_seconds)

    def busy_sms(self, client: int | None = None) -> int:
        """SMs with at least one resident block (of ``client``, if given)."""
        if self._ref is not None:
            return self._ref.busy_sms(client)
        return self._core.busy_sms(client)

    def stranded_blocks(self) -> int:
        """Blocks of ready kernels that would fit now on SMs their client may use (its MIG window, its SM
        cap), yet wait: idle capacity while work is queued. Always 0 between calls under the
        work-conserving policies ("mps", "round-robin", "fair", "mig", and "priority" without aging)."""
        if self._ref is not None:
            return self._ref.stranded_blocks()
        return self._core.stranded_blocks()
