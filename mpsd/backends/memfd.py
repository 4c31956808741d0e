# Device memory of the simulated backend: memfd segments. Sparse (a 141 GB device costs no RAM until touched:
# mpsd.backends.hostmem keeps what is touched within a budget), nameless (nothing to leak on SIGKILL), mapped in
# the daemon so that the reference kernels compute on the bytes, and passable over SCM_RIGHTS so that IPC and
# host_view hand clients the same bytes. Each costs two fds: ours, and the one Python's mmap keeps.
"""memfd segments: the simulated backend's device memory."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from typing import Callable, Iterator

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# The kernel frees a memfd's pages at about 80 ms a GiB (munmap, then the last close), all in the one call that
# drops the last reference: a teardown gives them back this many bytes a step first (about 0.3 ms each).
GIVE_BACK = 4 << 20

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch(fd: int, offset: int, nbytes: int) -> None:
    """Give [offset, offset + nbytes) of the memfd `fd` back to the host: its pages read as zeros after.

    Raises:
        OSError: the kernel refused.
    """
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes) != 0:
        raise OSError(ctypes.get_errno(), "cannot punch a hole in device memory")


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

    def give_back(self) -> Iterator[None]:
        """Where this reference is the last, punch out the pages GIVE_BACK bytes a step, so that `release` then
        has nothing left to free (the budget in mpsd.backends.hostmem counts them until then)."""
        if self.refs != 1:
            return
        offset = 0
        while offset < self.size:
            try:
                offset = os.lseek(self.fd, offset, os.SEEK_DATA)  # the next page held: holes cost no steps
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # none from here to the end
                    return
                raise
            nbytes = min(GIVE_BACK, self.size - offset)
            punch(self.fd, offset, nbytes)
            offset += nbytes
            yield


def close_map(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # a view is still alive somewhere; the mapping goes when it does
