# Policies written in Python: the engine stays compiled and calls out to the policy only where it decides
# which ready kernel gets freed capacity (its dispatch) and which SMs a client may use (its window). What the
# policy sees is the ready kernels in hardware order, each with the Kernel op the caller submitted; what it
# does is place blocks, through the engine's own placement rule (spread over the SMs with the most room,
# within the client's SM cap and window), so the accounting stays the engine's.
"""The interface for dispatch policies written in Python: ``Policy`` and ``ReadyKernel``."""

from __future__ import annotations

from typing import Any, ClassVar

from mpsd.plugins import load

from ..ops import Kernel
from .base import ClientConfig

__all__ = ["Policy", "ReadyKernel", "load_policy"]


class ReadyKernel:
    """A kernel past its launch overhead with blocks left to place, as a dispatch sees it.

    Attributes:
        kernel: the Kernel op as submitted (read its client, stream, priority, blocks, threads, cost, tag,
            seq; do not change it).
        unplaced: its blocks not on an SM now (kept current as ``place`` places them).
        eligible: when it became eligible (head of its stream, dependencies done).
    """

    __slots__ = ("_handle", "_placer", "eligible", "kernel", "unplaced")

    def __init__(self, kernel: Kernel, unplaced: int, eligible: float, handle: int, placer: Any) -> None:
        self.kernel = kernel
        self.unplaced = unplaced
        self.eligible = eligible
        self._handle = handle
        self._placer = placer

    def place(self, limit: int | None = None) -> int:
        """Place up to ``limit`` of its unplaced blocks (all of them if None) where they fit now.

        Blocks go where the engine's rule puts them: spread over the SMs with the most room, within the
        client's SM cap and the window the policy gives it.

        Returns:
            Blocks placed (0 when none fits).

        Raises:
            RuntimeError: called outside the dispatch that handed it out.
        """
        placed = self._placer.place(self._handle, self.unplaced if limit is None else limit)
        self.unplaced -= placed
        return placed

    def __repr__(self) -> str:
        return f"ReadyKernel({self.kernel!r}, unplaced={self.unplaced})"


class Policy:
    """A dispatch policy written in Python: subclass it and implement ``dispatch``.

    Pass an instance as the simulator's policy (``Simulator(policy=MyPolicy())``), or name its class as
    ``"module:Class"`` wherever a policy name goes (``Simulator(policy="mymodule:MyPolicy",
    policy_options={...})`` builds it with the options as keyword arguments; a workload's ``[run] policy``
    for ``mpsd simulate`` too). The engine calls ``dispatch`` at the end of every instant where capacity was
    freed or a kernel became ready, with the ready kernels in hardware order (stream priority, when eligible,
    launch order); whatever it leaves unplaced waits for the next dispatch. ``window`` says which SMs a client
    may use. Everything else (time, events, stream order, SM accounting, processor sharing, DRAM, copies,
    statistics, the trace) is the engine's, as for the built-in policies.

    A Python policy is much slower than the built-in ones, about 80 times on a busy device: each dispatch
    builds the ready list in Python and each placement is a call from Python into the engine. On the mixed
    scenario of ``bench/sim_rate.py`` (851,793 blocks, up to 128 kernels ready at once),
    ``examples/sjf_policy.py``'s shortest-job-first ran at 46,000 blocks/s where the built-in ``mps`` ran at
    3.8 million (``bench/sim_rate.py --policy examples.sjf_policy:ShortestJobFirst`` beside ``--policy mps``,
    medians of 3 in one session on a shared 2-core machine).

    Attributes:
        name: what statistics and reports call it.
        dispatch_when_idle: call ``dispatch`` at the end of every instant where something changed, even with
            no kernel ready (a policy that hands the GPU from client to client must notice an owner running
            out of work).
    """

    name: ClassVar[str] = "python"
    dispatch_when_idle: ClassVar[bool] = False

    def dispatch(self, ready: list[ReadyKernel]) -> None:
        """Offer the free capacity: call ``place`` on the ready kernels you choose, in the order you choose.

        Args:
            ready: the ready kernels with blocks to place, in hardware order; valid during this call only.
        """
        raise NotImplementedError

    def window(self, client: int) -> tuple[int, int] | None:
        """The SMs ``client`` may use, as a half-open index range; None for all (asked once per client until
        a client is configured)."""
        return None

    def configure(self, client: int, config: ClientConfig) -> None:
        """``client`` was configured (``Simulator.configure_client``); check or remember its settings.

        Raises:
            ValueError: the configuration makes no sense to this policy.
        """

    def forget(self, client: int) -> None:
        """``client`` is gone for good, its work torn down."""

    def _dispatch(self, entries: list[tuple[Kernel, int, float, int]], placer: Any) -> None:
        # What the engine calls: the ready kernels as (kernel, unplaced, eligible, handle) and its placer.
        self.dispatch([ReadyKernel(k, n, e, h, placer) for k, n, e, h in entries])


def load_policy(name: str, options: dict[str, Any] | None) -> Policy:
    """The policy named ``"module:Class"``, built with ``options`` as keyword arguments.

    Raises:
        ValueError: the module or class cannot be found, is not a Policy, or refuses the options.
    """
    return load(name, Policy, options)
