# A pool is the client's (mpsd_client._pools), as CUDA's is the driver's in the process: it picks addresses
# from the memory reserved here, so that malloc_async costs no round trip, and reports what it handed out,
# took back and gave back in one notification per batch (mem_pool_ops), which keeps the ledger's "in use"
# and checks that nothing is handed out twice. Kernels are checked against a reservation's bounds, not an
# allocation's: pool memory stays mapped, as on a GPU.
# Mixed into the context (mpsd.runtime.context.Context), whose address space and ledger the reservations are in.
"""A context's stream-ordered memory pools: their reservations and the allocations made in them."""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mpsd.backends.ops import OnStream, Record, Work
from mpsd.runtime.memory import CHUNK
from mpsd_protocol import (POOL_ALLOC, POOL_FREE, POOL_GRAPH_FREE, POOL_RELEASE, CudaError, InvalidResourceHandleError,
                           InvalidValueError, brief)

if TYPE_CHECKING:
    from mpsd.backends.base import Backend
    from mpsd.runtime.context import Counters
    from mpsd.runtime.device import Device
    from mpsd.runtime.ledger import Account
    from mpsd.runtime.memory import Allocation, AddressSpace
    from mpsd.runtime.streams import Stream

__all__ = ["PoolCalls", "Reservation"]


@dataclass(eq=False, slots=True)
class Reservation:
    """Memory a stream-ordered pool of the client holds, and the allocations the client made in it."""

    base: int
    size: int
    live: dict[int, int] = field(default_factory=dict)  # address -> bytes
    starts: list[int] = field(default_factory=list)  # the live addresses, sorted: no two may overlap
    in_use: int = 0

    def overlaps(self, ptr: int, nbytes: int) -> bool:
        """Whether [ptr, +nbytes) overlaps a live allocation (a forged batch could claim one range twice and
        make "in use" greater than what is reserved)."""
        i = bisect.bisect_right(self.starts, ptr)
        if i and self.starts[i - 1] + self.live[self.starts[i - 1]] > ptr:
            return True
        return i < len(self.starts) and self.starts[i] < ptr + nbytes


class PoolCalls:
    """The stream-ordered pool calls of a context (mixed into mpsd.runtime.context.Context)."""

    reservations: dict[int, Reservation]  # by base address
    _last_reservation: Reservation | None

    if TYPE_CHECKING:  # what the Context they are mixed into has, for the type checker (the real ones are there)
        device: Device
        backend: Backend
        account: Account
        memory: AddressSpace
        counters: Counters

        def _map_new(self, nbytes: int, pool: bool) -> int: ...
        def _drop(self, alloc: Allocation, released: int, in_use: int | None = None) -> None: ...
        def _stream(self, stream: int | None) -> Stream: ...
        def _on(self, stream: Stream) -> OnStream: ...
        def _enqueue(self, stream: Stream, work: Work, count: int = 1) -> Work: ...
        def _graph_free(self, ptr: object, stream: object) -> None: ...
        def tails(self) -> list[Work]: ...

    def mem_pool_reserve(self, nbytes: int) -> int:
        """Reserve `nbytes` (a multiple of 2 MiB) for a pool: charged to this client, none of it in use."""
        if nbytes == 0 or nbytes % CHUNK:
            raise InvalidValueError(f"a pool reserves whole 2 MiB pages, not {nbytes} bytes")
        addr = self._map_new(nbytes, pool=True)
        self.reservations[addr] = Reservation(addr, nbytes)
        return addr

    def mem_pool_ops(self, ops: list[object]) -> None:
        """The client's pool operations since its last message, in order (mpsd_protocol.POOL_ALLOC and the
        rest). A bad one is skipped and its error raised once the others are applied."""
        error: CudaError | None = None
        in_use = 0
        for op in ops:
            try:
                fields: list[Any] = op if isinstance(op, list) else []  # (anything else is no operation)
                kind = fields[0] if fields else None
                if kind == POOL_ALLOC and len(fields) == 5:
                    in_use += self._pool_alloc(*fields[1:])
                elif kind == POOL_FREE and len(fields) == 3:
                    in_use -= self._pool_free(*fields[1:])
                elif kind == POOL_RELEASE and len(fields) == 2:
                    self._pool_release(fields[1])
                elif kind == POOL_GRAPH_FREE and len(fields) == 3:
                    self._graph_free(*fields[1:])
                else:
                    raise InvalidValueError(f"mem_pool_ops: {brief(op, 40)} is no pool operation")
            except CudaError as exc:
                error = error or exc
            except (TypeError, ValueError, OverflowError) as exc:  # a malformed operation of a client of its own
                error = error or InvalidValueError(f"mem_pool_ops: {brief(op, 40)}: {type(exc).__name__}")
        self.device.ledger.move(self.account, 0, in_use)
        if error is not None:
            raise error

    def _reservation(self, ptr: object, nbytes: object) -> Reservation:
        last = self._last_reservation  # a pool hands out most allocations from its latest reservation
        if (last is not None and type(ptr) is int and type(nbytes) is int and last.base <= ptr < last.base + last.size
                and 0 <= nbytes and ptr + nbytes <= last.base + last.size and self.reservations.get(last.base) is last):
            return last
        alloc = self.memory.find(ptr) if isinstance(ptr, int) and isinstance(nbytes, int) and nbytes >= 0 else None
        # (alloc is looked up only for int ptr and nbytes)
        if alloc is None or not alloc.pool or ptr + nbytes > alloc.end:  # type: ignore[operator]
            raise InvalidValueError(f"[{brief(ptr, 20)}, +{brief(nbytes, 20)}) is not inside one of this context's "
                                    "memory pools")
        self._last_reservation = self.reservations[alloc.addr]
        return self._last_reservation

    def _pool_alloc(self, ptr: int, nbytes: int, stream: int | None, after: object) -> int:
        """The pool handed out [ptr, +nbytes) on `stream`, after the work queued so far on the streams in `after`
        (memory freed there, reused without an event between); the bytes now in use."""
        s = self._pool_stream(stream)
        if not isinstance(after, list):
            raise InvalidValueError(f"malloc_async waits for a list of streams, not {brief(after, 20)}")
        waits = [self._pool_stream(a).tail for a in after]
        reservation = self._reservation(ptr, nbytes)
        if ptr in reservation.live or reservation.overlaps(ptr, nbytes):
            raise InvalidValueError(f"[{ptr:#x}, +{nbytes}) was handed out twice by its pool")
        reservation.live[ptr] = nbytes
        bisect.insort(reservation.starts, ptr)
        reservation.in_use += nbytes
        self.counters.async_mallocs += 1
        pending = tuple(w for w in waits if w is not None and not w.done)
        if pending:
            self._enqueue(s, Record(**self._on(s), after=pending))
        return nbytes

    def _pool_free(self, ptr: int, stream: int | None) -> int:
        reservation = self._reservation(ptr, 0)
        nbytes = reservation.live.pop(ptr, None)
        if nbytes is None:
            raise InvalidValueError(f"{ptr:#x} is no live allocation of a memory pool")
        del reservation.starts[bisect.bisect_left(reservation.starts, ptr)]
        reservation.in_use -= nbytes
        self.counters.async_frees += 1
        self._pool_stream(stream)  # after the bookkeeping: the pool that sent it counts the bytes free either way
        return nbytes

    def _pool_stream(self, stream: object) -> Stream:
        """A stream named inside a pool operation: no row of the table has checked its kind."""
        if stream is not None and type(stream) is not int:
            raise InvalidResourceHandleError(f"no stream {brief(stream, 20)} in this context")
        return self._stream(stream)

    def _pool_release(self, ptr: object) -> None:
        """The pool gives a reservation back. Its address range goes now; its memory once the work queued so far,
        which may still use it, has run."""
        alloc = self.memory.get(ptr) if isinstance(ptr, int) else None
        if alloc is None or not alloc.pool:
            raise InvalidValueError(f"{brief(ptr, 20)} is not a memory pool's reservation in this context")
        _, released = self.memory.remove(alloc.addr)
        in_use = self.reservations.pop(alloc.addr).in_use  # nothing, unless the client let go of live allocations
        self.backend.when_done(self.tails(), functools.partial(self._drop, alloc, released, in_use))
