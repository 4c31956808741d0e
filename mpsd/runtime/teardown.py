# A departing client's teardown, as units of work its driver paces. A client may hold hundreds of thousands of
# objects, and the daemon serves every client from one thread: freed in one go, 300,000 VMM reservations froze
# every other client for 9.8 s, 300,000 small allocations for 5.1 s; and the kernel frees pages a client wrote
# at about 80 ms a GiB. So the teardown is an iterator that frees one object, lets go of one batch of index
# entries or gives a few MiB of pages back (DeviceMemory.give_back) per step, and the daemon (Daemon.detach)
# lets every other task run whenever a millisecond of steps has gone by. Nothing here waits or reads a clock.
#
# What holds between any two steps, so that nothing another client sees is ever half torn down:
# - Memory is charged until it is freed: each object's bytes leave the ledger with that object, so nobody can
#   allocate what the departing client still holds (the device never gives out more than it has), and what is
#   freed is free for the others at once.
# - The context is closed and its work cancelled from the first step (the dispatcher's queue dropped with it):
#   no call of it is served, and nothing of it runs.
# - Its IPC exports open no more from the first step (IpcRegistry.context_closing), as when all went at once.
# - Nothing is placed in its address spaces again, so their placement indexes are not kept up as objects go
#   (AddressSpace.drain): that upkeep, not the frees, was most of the cost.
# The context stays among its device's clients until the last step, so that whoever counts them (max clients,
# a server waiting to exit, mpsd-smi) sees it there for as long as it holds memory.
"""Tearing down a departed client in pieces."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from mpsd.runtime.memory import BATCH, emptied

if TYPE_CHECKING:
    from mpsd.runtime.context import Context
    from mpsd.runtime.memory import Allocation

__all__ = ["Teardown"]


class Teardown:
    """Iterating it tears `context` down, a unit of work (microseconds, a few hundred at most) per step;
    `reclaimed` says what was reclaimed, complete once the iteration ends."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.reclaimed = {"allocations": 0, "bytes": 0, "imports": 0, "streams": max(len(context.streams) - 1, 0),
                          "events": len(context.events), "host_buffers": len(context.host),
                          "reservations": len(context.vmm.arena.allocs), "physical": 0}
        self._steps = self._run()

    def __iter__(self) -> Iterator[None]:
        return self._steps

    def _run(self) -> Iterator[None]:
        ctx, reclaimed = self.context, self.reclaimed
        ctx.closed = True
        ctx.backend.cancel(ctx.id)
        for _ in ctx.ipc.context_closing(ctx):
            reclaimed["imports"] += 1
            yield
        for reservation in ctx.reservations.values():  # a pool's: what it holds in use stays counted till it goes
            yield from emptied(reservation.live)
            starts = reservation.starts
            while starts:
                del starts[-BATCH:]
                yield
        yield from ctx.memory.drain(self._drop)
        yield from ctx.drain_virtual_memory(self._freed)
        ctx.device.ledger.move(None, -ctx.backend.context_memory, partition=ctx.partition)
        events = ctx.events
        while events:
            ctx.ipc.event_closed(ctx, events.popitem()[1].cell)
            yield
        host = ctx.host
        while host:
            buffer = host.popitem()[1]
            yield from buffer.give_back()
            ctx._unmap_host(buffer)
            yield
        yield from emptied(ctx.streams)
        ctx.capturing.clear()
        ctx.graphs.clear()
        ctx.execs.clear()
        ctx._orphans.clear()
        ctx.last_op = None
        ctx.ipc.context_closed(ctx)

    def _drop(self, alloc: Allocation, released: int) -> None:
        self.context._drop(alloc, released)
        self.reclaimed["allocations"] += 1
        self.reclaimed["bytes"] += released

    def _freed(self, nbytes: int) -> None:
        self.reclaimed["physical"] += 1
        self.reclaimed["bytes"] += nbytes
