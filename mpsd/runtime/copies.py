# A context's copies and memsets, with CUDA's rules: each end resolved against the client's address space or its
# pinned host buffers before the work is queued; a pageable (staged) source read at the call, in pieces of at most
# MAX_STAGED_COPY, a pinned one when the copy runs, as DMA from pinned memory does; a copy with an end on another
# device over NVLink between peers, else staged through host memory. Mixed into the context
# (mpsd.runtime.context.Context), whose work queue (_enqueue) they go through.
"""A context's copies and memsets."""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

from mpsd.backends.ops import Copy, Extent, Memset, OnStream, Work, stage
from mpsd.runtime.graphs import CAPTURED
from mpsd_protocol import InvalidValueError, brief, format_size

if TYPE_CHECKING:
    from mpsd.runtime.context import Context, Counters
    from mpsd.runtime.device import Device
    from mpsd.runtime.ipc import Export
    from mpsd.runtime.memory import AddressSpace
    from mpsd.runtime.streams import Stream

__all__ = ["CopyCalls", "MAX_STAGED_COPY"]

MAX_STAGED_COPY = 64 << 20  # the client stages pageable copies in pieces of 8 MiB


class CopyCalls:
    """The copy and memset calls of a context (mixed into mpsd.runtime.context.Context)."""

    if TYPE_CHECKING:  # what the Context they are mixed into has, for the type checker (the real ones are there)
        device: Device
        memory: AddressSpace
        counters: Counters
        imports: dict[int, Export]

        def _stream(self, stream: int | None) -> Stream: ...
        def _on(self, stream: Stream) -> OnStream: ...
        def _enqueue(self, stream: Stream, work: Work, count: int = 1) -> Work: ...
        def _device(self, ptr: int, nbytes: int, what: str) -> Extent: ...
        def _host(self, buffer_id: int, offset: int, nbytes: int) -> Extent: ...

    def memcpy_htod(self, dst: int, host: int, offset: int, nbytes: int, stream: int | None,
                    staged: bool) -> Work:
        """Copy host buffer bytes to the device. A staged (pageable) source is read now; a pinned one when
        the copy runs, as DMA from pinned memory does."""
        s = self._stream(stream)
        if staged and nbytes > MAX_STAGED_COPY:
            # A staged source is copied into the daemon's memory: bounded, so no client can exhaust it.
            raise InvalidValueError(f"a staged copy moves at most {format_size(MAX_STAGED_COPY)}; "
                                    "larger ones go in pieces")
        target = self._device(dst, nbytes, "destination")
        source = self._host(host, offset, nbytes)
        data = stage(source.memory.view(source.offset, nbytes)) if staged else None
        try:
            return self._copy(s, Copy(**self._on(s), kind="h2d", dst=target, src=None if staged else source,
                                      data=data))
        except BaseException:
            # Refused (the host budget, say): its staged bytes go now. The error's traceback holds the copy's
            # frames, and through them its mapping, until Python's cyclic collector runs: 80 refused 64-MiB
            # copies took the daemon's RSS to 2.35 GiB under a 512-MiB budget (issue 29, item 3).
            if isinstance(data, mmap.mmap):
                data.close()
            raise

    def memcpy_dtoh(self, host: int, offset: int, src: int, nbytes: int, stream: int | None) -> Work:
        s = self._stream(stream)
        source = self._device(src, nbytes, "source")
        return self._copy(s, Copy(**self._on(s), kind="d2h", dst=self._host(host, offset, nbytes), src=source))

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: int | None) -> Work:
        """Copy between device addresses of this context; an end in memory opened from another device's IPC
        handle (which maps only over peer access) makes it a copy over NVLink."""
        s = self._stream(stream)
        target, source = self._device(dst, nbytes, "destination"), self._device(src, nbytes, "source")
        return self._copy(s, Copy(**self._on(s), kind="d2d", dst=target, src=source, src_device=self._device_of(src),
                                  dst_device=self._device_of(dst)))

    def memcpy_peer(self, dst: int, source: Context, src: int, nbytes: int, stream: int | None,
                    peer_access: bool) -> Work:
        """cudaMemcpyPeerAsync into this context's `dst` from `src` of `source`, a context of the same process
        on another device, on this context's `stream`: over NVLink where the devices are peers
        (`peer_access`), else staged through host memory."""
        s = self._stream(stream)
        target = self._device(dst, nbytes, "destination")
        extent = source.memory.extent(src, nbytes)
        if extent is None:
            raise InvalidValueError(f"source [{brief(src, 20)}, +{brief(nbytes, 20)}) is not inside one live "
                                    f"allocation of device {source.device.index}")
        other = source.device.index
        return self._copy(s, Copy(**self._on(s), kind="d2d", dst=target, src=extent,
                                  src_device=None if other == self.device.index else other, peer_access=peer_access))

    def _device_of(self, ptr: int) -> int | None:
        """The other device whose memory `ptr` lies in (opened from its IPC handle), if it is another's."""
        alloc = self.memory.find(ptr)
        export = self.imports.get(alloc.addr) if alloc is not None else None
        return export.device if export is not None and export.device != self.device.index else None

    def memset(self, ptr: int, value: int, nbytes: int, stream: int | None) -> Work:
        s = self._stream(stream)
        target = self._device(ptr, nbytes, "memset range")
        # cudaMemset uses the low byte, as memset does
        return self._copy(s, Memset(**self._on(s), dst=target, value=value & 0xFF))

    def _copy(self, stream: Stream, work: Copy | Memset) -> Work:
        self._enqueue(stream, work)
        if work.handle is CAPTURED:  # a node of a graph now: not a copy made
            return work
        counters = self.counters
        counters.copies += 1
        counters.bytes_copied += work.dst.nbytes
        if isinstance(work, Copy) and (work.src_device is not None or work.dst_device is not None):
            if work.peer_access:
                counters.peer_copies_nvlink += 1
            else:
                counters.peer_copies_staged += 1
            counters.bytes_copied_peer += work.dst.nbytes
        return work
