# The host RAM that simulated device memory costs, and the budget it is kept within. Device memory lives in
# sparse memfds (mpsd.runtime.memory): an allocation costs nothing until it is touched, and then each page touched costs
# a page of the host's RAM (tmpfs pages, counted in the memfd's st_blocks). Reading through a mapping
# materialises pages as writing does, so every byte a copy, memset or kernel will touch counts.
#
# The budget is checked when a call is made, not when its work runs: the work is queued only if the pages it
# may touch for the first time fit beside what is resident and what work already queued may still touch. A
# client that would push the host toward the OOM killer gets cudaErrorMemoryAllocation for that call, and no
# other client notices. A memset to zero gives whole pages back (punches holes) instead of writing zeros, so
# clearing memory, the commonest first touch, costs nothing.
#
# A client's pinned host buffers are the client's memfds, mapped into the daemon so that copies never cross the
# socket. Every page of one that a copy makes the daemon touch joins the daemon's RAM (its resident set, and its
# cgroup where it faults the page in), whoever owns the file, and a client can give pages back (punch holes)
# while the daemon works on the buffer: no measurement made before a copy can bound what it will fault. So a
# buffer counts against the budget whole, from its registration (cudaHostAlloc or cudaHostRegister, which pin
# every page, as a real driver does) until the daemon unmaps it.
from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass, field

import psutil

from mpsd.backends.memfd import Segment, punch
from mpsd_protocol import OutOfMemoryError, format_size

PAGE = mmap.PAGESIZE
DEFAULT_SHARE = 0.5  # of the host's RAM, when no budget is given: room for the daemon, its clients and the rest


def default_budget() -> int:
    return int(psutil.virtual_memory().total * DEFAULT_SHARE)


@dataclass(eq=False, slots=True)
class Reservation:
    """Pages that one queued op may touch for the first time, counted until it has run (or never will)."""

    nbytes: int
    segments: list[Segment] = field(default_factory=list)


class HostMemory:
    """What the daemon's memfds hold of the host's RAM, against a budget shared by every device and client."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.resident = 0  # bytes of RAM the segments held when last measured
        self.pending = 0  # bytes that queued work may still materialise
        self.pinned = 0  # bytes of clients' pinned host buffers mapped here: the daemon may touch every page
        self._resident: dict[Segment, int] = {}

    def reserve(self, extents: list[tuple[Segment, int, int]]) -> Reservation:
        """Count the pages of `extents` ((segment, offset, bytes) each) not yet resident against the budget.

        Raises:
            OutOfMemoryError: they do not fit beside what is resident and reserved.
        """
        new = sum(self._holes(segment, offset, nbytes) for segment, offset, nbytes in extents)
        if new:
            self._check(new, "touching", "of simulated device memory")
        self.pending += new
        return Reservation(new, [segment for segment, _, _ in extents])

    def pin(self, nbytes: int) -> int:
        """Count a client's pinned host buffer of `nbytes`, which the daemon maps, against the budget; the
        bytes counted (whole pages), for `unpin`.

        Raises:
            OutOfMemoryError: it does not fit beside what is resident, reserved and pinned.
        """
        pages = -(-nbytes // PAGE) * PAGE
        self._check(pages, "mapping", "of pinned host memory")
        self.pinned += pages
        return pages

    def unpin(self, pages: int) -> None:
        """The daemon has unmapped a pinned buffer that `pin` counted as `pages`."""
        self.pinned -= pages

    def _check(self, new: int, doing: str, what: str) -> None:
        if self.resident + self.pending + self.pinned + new > self.budget:
            raise OutOfMemoryError(
                f"{doing} {format_size(new)} more {what} would take the daemon's host RAM past its budget of "
                f"{format_size(self.budget)} ({format_size(self.resident)} in use, {format_size(self.pending)} "
                f"reserved by queued work, {format_size(self.pinned)} of clients' pinned buffers; mpsd "
                f"--host-memory sets the budget)")

    def settle(self, reservation: Reservation) -> None:
        """The op ran, or never will: its pages are measured instead of reserved."""
        self.pending -= reservation.nbytes
        reservation.nbytes = 0
        for segment in reservation.segments:
            if segment.refs > 0:  # still open (a segment closes when its last mapping goes)
                self._measure(segment)
        reservation.segments.clear()

    def zero(self, segment: Segment, offset: int, nbytes: int) -> None:
        """Make [offset, offset + nbytes) of `segment` read as zeros: whole pages are given back to the host,
        and only the partial pages at either end that hold data are written."""
        start, end = offset, offset + nbytes
        first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
        if first >= last:
            first = last = end  # no whole page inside: write it all
        else:
            punch(segment.fd, first, last - first)
        for a, b in ((start, first), (last, end)):
            if a < b and self._holes(segment, a, b - a) < PAGE:  # a page that is a hole already reads as zeros
                segment.map[a:b] = bytes(b - a)
        self._measure(segment)

    def _measure(self, segment: Segment) -> None:
        now = os.fstat(segment.fd).st_blocks * 512
        before = self._resident.get(segment)
        if before is None:
            segment.on_release.append(lambda: self._forget(segment))
        self._resident[segment] = now
        self.resident += now - (before or 0)

    def _forget(self, segment: Segment) -> None:
        self.resident -= self._resident.pop(segment, 0)

    def _holes(self, segment: Segment, offset: int, nbytes: int) -> int:
        """Bytes of the pages [offset, offset + nbytes) touches that are not resident yet."""
        if nbytes <= 0 or self._resident.get(segment, 0) >= segment.size:
            return 0
        pos, end = offset // PAGE * PAGE, min(-(-(offset + nbytes) // PAGE) * PAGE, segment.size)
        holes = 0
        while pos < end:
            try:
                data = min(os.lseek(segment.fd, pos, os.SEEK_DATA), end)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                data = end  # nothing but a hole from here to the end of the file
            holes += data - pos
            if data >= end:
                break
            pos = os.lseek(segment.fd, data, os.SEEK_HOLE)
        return holes
