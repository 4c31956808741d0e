# The daemon's directories and files, made safe as careful daemons make theirs (sshd, postfix, systemd): the
# default pipe directory /tmp/nvidia-mps is a name anyone can take first, and the daemon usually runs as root. So a
# pipe or log directory is used only if it is the daemon's own: a real directory (never a symlink, which could
# point anywhere), owned by the daemon's euid, and writable by nobody else (only then can nothing in it have
# been planted by another user). Group and others may read and search it (--multiuser lets other users' clients
# in that way); only writing is refused. The checks are made on an open descriptor (fstat, fchmod), so a name
# swapped between check and use cannot redirect them. Only the last component is checked: the parents are the
# operator's choice (/tmp and /run are safe, being sticky or root's).
#
# Files in such a directory are opened with O_NOFOLLOW and must turn out to be regular files of ours.
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TextIO


class UnsafePathError(Exception):
    """A directory or file the daemon would use is not safely its own; the message says why and what to do."""


def private_directory(path: Path, what: str, *, tighten: bool = False, mode: int = 0o700) -> None:
    """Make sure `path` is a directory that only the daemon's user controls, creating it (mode 0700, its
    parents as `mkdir -p` would) if it does not exist.

    Args:
        path: the directory.
        what: what it is, for messages ("pipe directory").
        tighten: give it `mode` once it has passed the checks.
        mode: 0700, or 0755 where other users must reach what is inside (--multiuser); never writable.

    Raises:
        UnsafePathError: it is a symlink, not a directory, owned by another uid, or writable by group or
            others (it is left as it is).
        OSError: it cannot be created or opened.
    """
    try:
        os.mkdir(path, 0o700)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    if stat.S_ISLNK(os.lstat(path).st_mode):
        raise UnsafePathError(f"the {what} {path} is a symbolic link; give the directory itself")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        # It became a symlink or stopped being a directory since lstat; either way it is not ours to use.
        raise UnsafePathError(f"the {what} {path} is not a directory ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafePathError(f"the {what} {path} belongs to uid {st.st_uid}, not to the daemon's uid "
                                  f"{os.geteuid()}; remove it or choose another")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafePathError(f"the {what} {path} is writable by its group or by others (mode "
                                  f"{stat.S_IMODE(st.st_mode):04o}); make it 0700 or 0755")
        if tighten and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def open_log(path: Path) -> TextIO:
    """`path` opened for appending lines, created 0600 if it does not exist; never through a symlink.

    Raises:
        UnsafePathError: it is a symlink, a FIFO or anything but a regular file, or another uid owns it.
        OSError: it cannot be opened.
    """
    # O_NONBLOCK: opening a FIFO for writing would otherwise wait for a reader forever. It changes nothing
    # for a regular file.
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        _refuse_unless_regular(path)
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path} is {describe(st.st_mode)}, not a regular file")
        if st.st_uid != os.geteuid():
            raise UnsafePathError(f"{path} belongs to uid {st.st_uid}, not to the daemon's uid {os.geteuid()}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "a", buffering=1, encoding="utf-8", errors="surrogateescape")  # bytes as they came
    except BaseException:
        os.close(fd)
        raise


def _refuse_unless_regular(path: Path) -> None:
    """Raise UnsafePathError naming what `path` is, unless it is a regular file (or missing)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise UnsafePathError(f"{path} is {describe(mode)}, not a regular file") from None


def describe(mode: int) -> str:
    """What a file of `mode` (from stat) is, in words ("a symbolic link")."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "something else"
