# Ordering rules only: which ops may start, never when or where. An op is eligible once it is the head
# of its stream (identity (client, stream)) and every op in its `after` is done or resolved (dropped by
# cancel). Keeping this apart from the engine lets every policy share the same CUDA stream semantics.
"""Stream order and cross-stream dependencies."""

from __future__ import annotations

from collections import deque

from .ops import Op

__all__ = ["Streams"]


class Streams:
    """In-order queues per (client, stream) plus ``after`` dependency tracking."""

    __slots__ = ("_queues", "_blocked", "_waiters")

    def __init__(self) -> None:
        self._queues: dict[tuple, deque[Op]] = {}
        self._blocked: dict[Op, int] = {}  # stream heads -> deps still pending
        self._waiters: dict[Op, list[Op]] = {}  # dep -> stream heads waiting for it

    def add(self, op: Op) -> bool:
        """Queue a newly submitted op; True if it is eligible right away."""
        key = (op.client, op.stream)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        queue.append(op)
        return len(queue) == 1 and self._arrive(op)

    def _arrive(self, op: Op) -> bool:
        pending = 0
        for dep in op.after:
            if not (dep.done or dep.cancelled):
                self._waiters.setdefault(dep, []).append(op)
                pending += 1
        if pending:
            self._blocked[op] = pending
        return pending == 0

    def complete(self, op: Op) -> list[Op]:
        """``op`` completed: advance its stream and release its dependents.

        Returns:
            Ops that became eligible, in submission order.
        """
        eligible = []
        key = (op.client, op.stream)
        queue = self._queues.get(key)
        if queue and queue[0] is op:
            queue.popleft()
            if queue:
                if self._arrive(queue[0]):
                    eligible.append(queue[0])
            else:
                del self._queues[key]
        eligible.extend(self._release(op))
        eligible.sort(key=_seq)
        return eligible

    def resolve(self, op: Op) -> list[Op]:
        """``op`` will never complete (its client was cancelled): its dependents treat it as done.

        Returns:
            Ops that became eligible, in submission order.
        """
        # Marked on the op itself: the streams keep no reference to it, so a departed client's work goes.
        op.cancelled = True
        eligible = self._release(op)
        eligible.sort(key=_seq)
        return eligible

    def _release(self, op: Op) -> list[Op]:
        eligible = []
        for waiter in self._waiters.pop(op, ()):
            left = self._blocked.get(waiter)
            if left is None:  # dropped meanwhile
                continue
            if left == 1:
                del self._blocked[waiter]
                eligible.append(waiter)
            else:
                self._blocked[waiter] = left - 1
        return eligible

    def drop_client(self, client: int) -> list[Op]:
        """Forget every queued op of ``client`` (started or not).

        Returns:
            The ops removed, in submission order.
        """
        dropped: list[Op] = []
        for key in [k for k in self._queues if k[0] == client]:
            dropped.extend(self._queues.pop(key))
        for op in dropped:
            self._blocked.pop(op, None)
        dropped.sort(key=_seq)
        return dropped


def _seq(op: Op) -> int:
    return op.seq
