# CUDA IPC across client processes: exports of device allocations and of interprocess events, held by the
# daemon and named by 64-byte handles with a random secret. Opening a memory handle maps the exporter's memfd
# segment into the importer's address space (the same bytes, counted once on the device, to the exporter) and
# passes the memfd itself back over SCM_RIGHTS. A mapping also counts against the importer's own pinned limit:
# the bytes outlive their exporter's exit, and were they charged to no live client, clients that export, let
# importers keep the memory and reconnect would hold more than their limits add up to. An event handle shares
# the event's record cell, so records, waits and queries in any process see the same marker in the simulator.
#
# Lifetime (where CUDA says "undefined"): the bytes live until the exporter has freed the allocation (or
# exited) and every importer has closed it (or exited); an importer never loses data to the exporter's exit.
from __future__ import annotations

import hmac
import itertools
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from mpsd.runtime.memory import CHUNK, Allocation
from mpsd_protocol import (
    EVENT,
    IPC_FREED,
    MEMORY,
    DeviceUninitializedError,
    InvalidResourceHandleError,
    InvalidValueError,
    IpcHandle,
    NotPermittedError,
    OutOfMemoryError,
    PeerAccessUnsupportedError,
    brief,
    format_size,
)

if TYPE_CHECKING:
    from mpsd.backends.base import DeviceMemory
    from mpsd.runtime.memory import Slice
    from mpsd.daemon.servlog import ServerLog
    from mpsd.runtime.context import Context
    from mpsd.runtime.streams import EventCell



@dataclass(eq=False)
class Export:
    """One exported allocation or event."""

    id: int
    kind: int
    secret: bytes
    device: int
    pid: int
    process: int  # the exporter's Context.process
    uid: int
    gid: int
    allocation: Allocation | None = None  # memory exports
    cell: EventCell | None = None  # event exports
    importers: dict[int, tuple[Context, Allocation]] = field(default_factory=dict)  # context id -> it, its mapping
    counts: dict[int, int] = field(default_factory=dict)  # context id -> opens not yet closed
    exporter: int | None = None  # the id of the context that exported it

    def handle(self) -> bytes:
        return IpcHandle(self.kind, self.device, self.id, self.secret).to_bytes()


class IpcRegistry:
    """Every export of one daemon."""

    def __init__(self, access: str, log: ServerLog,
                 peers: Callable[[int, int], bool] = lambda exporter, importer: False) -> None:
        self.access = access  # who may open a handle: "uid" (the exporter's, CUDA's rule), "group", "any"
        self.log = log
        self.peers = peers  # whether a context on device `importer` may map memory of device `exporter`
        self._ids = itertools.count(1)
        self._exports: dict[int, Export] = {}
        self._by_allocation: dict[Allocation, Export] = {}
        self._closing: set[int] = set()  # contexts being torn down: their exports open no more

    # -- memory ----------------------------------------------------------------------------------------
    def export_memory(self, ctx: Context, ptr: int) -> bytes:
        """``cudaIpcGetMemHandle``: the handle of the allocation based at `ptr` (the same one each time).

        Raises:
            InvalidValueError: `ptr` is not the base of an allocation this context made.
        """
        alloc = ctx.memory.get(ptr) if isinstance(ptr, int) else None
        if alloc is None or alloc.imported:
            raise InvalidValueError(f"{brief(ptr, 20)} is not the base of an allocation made by this context")
        if alloc.pool:  # CUDA shares pool memory only through an exportable pool (not built), never this way
            raise InvalidValueError(f"{brief(ptr, 20)} is memory of a stream-ordered pool, which has no IPC handle")
        export = self._by_allocation.get(alloc)
        if export is None:
            export = self._new(ctx, MEMORY, allocation=alloc, exporter=ctx.id)
            self._by_allocation[alloc] = export
        return export.handle()

    def open_memory(self, ctx: Context, handle: object) -> Allocation:
        """``cudaIpcOpenMemHandle``: map the export into `ctx` (again: the same mapping, one more reference).

        Raises:
            InvalidValueError: malformed handle.
            PeerAccessUnsupportedError: the export is another device's, and this one cannot map its memory
                (opened across devices, cudaIpcMemLazyEnablePeerAccess enables peer access where it can).
            InvalidResourceHandleError: no such export (forged, or its memory is gone).
            DeviceUninitializedError: opened in the exporting process.
            NotPermittedError: the access policy refuses this client.
            OutOfMemoryError: past the client's pinned limit, or it holds as many allocations as it may.
        """
        export = self._find(ctx, handle, MEMORY)
        if export.process == ctx.process:
            raise DeviceUninitializedError("an IPC memory handle cannot be opened in the process that exported it")
        entry = export.importers.get(ctx.id)
        if entry is None:
            ctx.check_allocations()  # a mapping of the daemon's like any other, whoever made its memory
            assert export.allocation is not None  # _find refuses exports whose memory was freed
            size = export.allocation.size
            charge = _charge(size)
            room = ctx.room_under_limit()
            if charge > room:
                raise OutOfMemoryError(
                    f"mapping {format_size(charge)} through IPC would take this client past its pinned limit "
                    f"({format_size(max(room, 0))} left): memory it maps counts against its limit, since it outlives "
                    "its exporter")
            segment = export.allocation.segment
            mapping = ctx.memory.map_import(segment, size)
            segment.refs += 1
            ctx.account.imported += charge
            export.importers[ctx.id] = (ctx, mapping)
            ctx.imports[mapping.addr] = export
        else:
            mapping = entry[1]
        export.counts[ctx.id] = export.counts.get(ctx.id, 0) + 1
        return mapping

    def close_memory(self, ctx: Context, ptr: int) -> DeviceMemory | Slice | None:
        """``cudaIpcCloseMemHandle``: one reference less. With the last, the pointer leaves `ctx`'s address
        space now, and the mapping's segment comes back to the caller, to release once the work queued before
        the close has run (that work may still touch the bytes).

        Raises:
            InvalidValueError: `ptr` is not a pointer this context opened.
        """
        export = ctx.imports.get(ptr) if isinstance(ptr, int) else None
        if export is None:
            raise InvalidValueError(f"{brief(ptr, 20)} is not a pointer opened from an IPC handle in this context")
        export.counts[ctx.id] -= 1
        return self._unmap(ctx, export) if export.counts[ctx.id] == 0 else None

    def _unmap(self, ctx: Context, export: Export) -> DeviceMemory | Slice:
        """Take `export`'s mapping out of `ctx`; its segment, for the caller to release."""
        del export.counts[ctx.id]
        _, mapping = export.importers.pop(ctx.id)
        ctx.imports.pop(mapping.addr, None)  # (a departing client's teardown has taken it out already)
        ctx.memory.remove(mapping.addr)
        ctx.account.imported -= _charge(mapping.size)
        if export.allocation is None and not export.importers:
            del self._exports[export.id]
        return mapping.segment

    def allocation_freed(self, alloc: Allocation) -> None:
        """The exporter freed (or lost) an allocation: no new opens; existing mappings live on, and each
        importer is told, so that its last close of the mapping, which now frees the bytes, waits for that."""
        export = self._by_allocation.pop(alloc, None)
        if export is not None:
            export.allocation = None
            if not export.importers:
                del self._exports[export.id]
            for ctx, mapping in export.importers.values():
                ctx.tell(IPC_FREED, {"ptr": mapping.addr})

    # -- events ----------------------------------------------------------------------------------------
    def export_event(self, ctx: Context, cell: EventCell) -> bytes:
        """``cudaIpcGetEventHandle`` for an interprocess event's record cell."""
        export = cell.export
        if export is None:
            export = cell.export = self._new(ctx, EVENT, cell=cell, exporter=ctx.id)
        return export.handle()

    def open_event(self, ctx: Context, handle: object) -> EventCell:
        """``cudaIpcOpenEventHandle``: the shared record cell, for a new event in `ctx`."""
        export = self._find(ctx, handle, EVENT)
        assert export.cell is not None
        return export.cell

    def event_destroyed(self, cell: EventCell) -> None:
        """An event was destroyed; the export goes when no event shares its cell any more."""
        cell.users -= 1
        if cell.users == 0 and cell.export is not None:
            self._exports.pop(cell.export.id, None)

    # -- clients ---------------------------------------------------------------------------------------
    def context_closing(self, ctx: Context) -> Iterator[None]:
        """A client is being torn down (mpsd.runtime.teardown): from now on its exports open no more, as if
        all its memory were freed at once, though the teardown frees it in pieces; then everything it imported
        is closed, a unit of work per mapping, yielded between. Its own exports end with its allocations and
        its events (`event_closed`): what others opened of them goes on, but a handle to one no longer opens."""
        self._closing.add(ctx.id)
        imports = ctx.imports
        while imports:
            _, export = imports.popitem()  # the last: taking the first again and again costs time quadratic in them
            segment = self._unmap(ctx, export)  # its work was cancelled already: nothing touches the bytes
            yield from segment.give_back()  # (where this mapping was the last)
            segment.release()
            yield

    def event_closed(self, ctx: Context, cell: EventCell) -> None:
        """An event of a departing client goes: its export, if the client made it, opens no more."""
        export = cell.export
        if export is not None and export.exporter == ctx.id:
            self._exports.pop(export.id, None)
        self.event_destroyed(cell)

    def context_closed(self, ctx: Context) -> None:
        """The client's teardown is over: what it exported is gone (freed, or ended with its events)."""
        self._closing.discard(ctx.id)

    # -- shared ----------------------------------------------------------------------------------------
    def _new(self, ctx: Context, kind: int, **what: Any) -> Export:  # (what: the kind's own Export fields)
        export = Export(next(self._ids), kind, secrets.token_bytes(16), ctx.device.index, ctx.pid, ctx.process,
                        ctx.uid, ctx.gid, **what)
        self._exports[export.id] = export
        return export

    def _find(self, ctx: Context, handle: object, kind: int) -> Export:
        parsed = IpcHandle.from_bytes(handle, kind)
        export = self._exports.get(parsed.export_id)
        if export is None or not hmac.compare_digest(export.secret, parsed.secret) or (
                kind == MEMORY and export.allocation is None) or export.exporter in self._closing:
            raise InvalidResourceHandleError("no such IPC export (the handle is stale or forged)")
        if parsed.device != ctx.device.index:
            if kind != MEMORY:
                raise InvalidValueError(f"the handle is for device {parsed.device}, this context is on "
                                        f"device {ctx.device.index}")
            if not self.peers(parsed.device, ctx.device.index):
                raise PeerAccessUnsupportedError(f"device {ctx.device.index} cannot map device {parsed.device}'s "
                                                 "memory (no peer access between them)")
        allowed = (self.access == "any" or ctx.uid == export.uid
                   or (self.access == "group" and ctx.gid == export.gid))
        if not allowed:
            self.log.complaint(("uid", ctx.uid),
                               f"Client {ctx.pid} (uid {ctx.uid}) was refused an IPC handle exported by "
                            f"client {export.pid} (uid {export.uid}); access policy: {self.access}")
            raise NotPermittedError(f"the IPC access policy ({self.access}) does not let uid {ctx.uid} open a "
                                    f"handle exported by uid {export.uid}")
        return export


def _charge(size: int) -> int:
    """What a mapping of `size` bytes holds against its importer's limit: the driver's 2 MiB steps."""
    return -(-size // CHUNK) * CHUNK
