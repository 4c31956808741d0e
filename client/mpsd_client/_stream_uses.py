# record_stream's rule, which every strategy of the caching allocator keeps alike: a block freed while streams
# other than its own may still use it (torch.Tensor.record_stream) is not reused at once. An event is recorded
# on each such stream at the free, and the block waits until all of them have completed: it is no longer
# allocated but still active ("active_pending_free" in a snapshot). Events of one stream complete in the order
# they were recorded, so each stream's are checked from the oldest up to the first still pending, at each malloc
# (as PyTorch's process_events does); emptying the cache waits for all of them, the default stream's first.
# Spent events are kept for reuse, so that a training loop does not create an event per free.
"""Blocks freed under record_stream, waiting for their streams' events."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

__all__ = ["PendingFrees"]


class PendingFrees:
    """Events recorded at frees, by stream. What waits on them is any object with an ``event_count``."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self._events: dict[int, deque[tuple[Any, Any]]] = {}
        self._spare: list[Any] = []

    def hold(self, item: Any, streams: dict[int, Any]) -> None:
        """`item` waits for the work queued so far on each of `streams` (their keys and objects)."""
        for key, stream in streams.items():
            event = self._spare.pop() if self._spare else self.ctx.create_event(disable_timing=True)
            event.record(stream)
            self._events.setdefault(key, deque()).append((event, item))
            item.event_count += 1

    def process(self, done: Callable[[Any], None]) -> None:
        """Call `done` for each item whose events have all completed (without waiting for any)."""
        for key in list(self._events):
            waiting = self._events[key]
            while waiting and waiting[0][0].query():
                self._spent(*waiting.popleft(), done)
            if not waiting:
                del self._events[key]

    def synchronize(self, done: Callable[[Any], None]) -> None:
        """Wait for every event, calling `done` for every item held: stream by stream, each stream's in the order
        they were recorded. PyTorch goes through its streams in the order of a hash map of them: on the H200
        recordings (torch_allocator_expandable_h200.json.gz) the default stream's events came first, then the
        other stream's, and which blocks are merged first shows in the inactive_split peaks. So streams go in
        the order of their keys (the default stream's, 0, first); for three or more streams PyTorch's order is
        its hash's, which is not modelled."""
        for key in sorted(self._events):
            for event, item in self._events[key]:
                event.synchronize()
                self._spent(event, item, done)
        self._events.clear()

    def _spent(self, event: Any, item: Any, done: Callable[[Any], None]) -> None:
        self._spare.append(event)
        item.event_count -= 1
        if item.event_count == 0:
            done(item)
