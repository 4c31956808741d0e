# Device memory of the simulated backend: memfd segments. Sparse (a 141 GB device costs no RAM until touched:
# mpsd.backends.hostmem keeps what is touched within a budget), nameless (nothing to leak on SIGKILL), mapped in
# the daemon so that the reference kernels compute on the bytes, and passable over SCM_RIGHTS so that IPC and
# host_view hand clients the same bytes. Each costs two fds: ours, and the one Python's mmap keeps.
"""memfd segments: the simulated backend's device memory."""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Callable

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Segment:
    """A memfd of `size` bytes mapped in the daemon; freed when the last reference is dropped."""

    __slots__ = ("fd", "size", "map", "refs", "on_release")
    offset = 0  # where its bytes begin in `fd` and `map` (a Slice's lie inside its chunk's)

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("mpsd-device", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # Sealed, so that no process this fd is ever passed to can shrink it under our mapping (SIGBUS).
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self.map = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self.size = size
        self.refs = 1  # mappings: the allocation that made it, and every IPC import of it
        self.on_release: list[Callable[[], None]] = []  # called when the last mapping goes

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            close_map(self.map)
            os.close(self.fd)
            for callback in self.on_release:
                callback()


def close_map(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # a view is still alive somewhere; the mapping goes when it does
