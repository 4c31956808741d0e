# MPS v3's namespaces (NVIDIA's MPS documentation, releases 615 and 620): groups of one server's clients with
# their own active thread percentage, pinned memory limit and client priority, inside the server's. Every
# server has an implicit `default` namespace, which is the server itself. A client lands in a namespace by the
# socket it connected to ($PIPE/<server>/<namespace>/, mpsd.daemon.routes) or, on the main socket, by its
# cgroup (a namespace's `cgroup`: the client's cgroup v2 path is it or lies under it).
#
# This module holds the model only (what a namespace is, its name's rules, how its settings combine with its
# server's), so that the -a file's parser, the control language and the daemon's attach share one copy.
#
# mpsd's guesses (NVIDIA documents none of them): the name's rules (a path component: letters, digits, '_',
# '.', '-', at most 64, not starting with '.' or '-', none of the pipe directory's own names, not "default");
# that a namespace's value above its server's is cut to the server's (a namespace subdivides, it never adds);
# that a namespace belongs to the server of one user (its key is that uid, so it outlives the server's restarts,
# as the -a file's named servers do); and that the first namespace whose cgroup holds the client's wins, in the
# order they were made.
#
# A namespace's `devices` (release 620's [[servers.<s>.namespaces.<ns>.devices]], each a GPU `uuid` and maybe an
# `sm_partition` by name): mpsd's guesses are that a client in the namespace sees those devices only, in the
# order given, as if they were its CUDA_VISIBLE_DEVICES (its own CUDA_VISIBLE_DEVICES then picks among them:
# an index counts in the namespace's list, a UUID must be one of them), and that on a device with a partition it
# runs in that partition (a CUDA_MPS_SM_PARTITION naming another is refused). A `cgroup` may be given as the
# documentation's example writes it, a path under /sys/fs/cgroup, or as /proc/PID/cgroup writes one.
from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT = "default"
CGROUP_MOUNT = "/sys/fs/cgroup"  # where cgroup v2 is mounted, as NVIDIA's example cgroup paths are written
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", re.ASCII)
# What a pipe directory (or a server's directory in it) already holds: no server or namespace may take these.
RESERVED = frozenset({"control", "mpsd.sock", "mpsd-protocol", "nvidia-cuda-mps-control.pid", "log",
                      "control_lock", "control_privileged"})


@dataclass(frozen=True)
class NamespaceDevice:
    """One device a namespace's clients see, and the SM partition (by name) they run in there, if any."""

    uuid: str
    sm_partition: str | None = None


@dataclass
class Namespace:
    """One namespace of a server: what a client in it gets at most (None: the server's)."""

    name: str
    active_thread_percentage: float | None = None
    pinned_memory_limit: int | None = None  # bytes, on every device
    client_priority: int | None = None  # 1 (below normal) wins over the server's 0
    cgroup: str | None = None  # clients of the main socket whose cgroup is this or under it
    devices: tuple[NamespaceDevice, ...] = ()  # the only devices its clients see, in order; none: the server's

    def percentage(self, server: float) -> float:
        """The active thread percentage a client of this namespace gets, under its server's `server`."""
        own = self.active_thread_percentage
        return server if own is None else min(server, own)

    def memory_limit(self, server: int | None) -> int | None:
        """The pinned memory limit (bytes) under the server's `server` (None: no limit)."""
        own = self.pinned_memory_limit
        return own if server is None else server if own is None else min(server, own)

    def priority(self, server: int) -> int:
        own = self.client_priority
        return server if own is None else max(server, own)

    def holds_cgroup(self, path: str | None) -> bool:
        """Whether a client in cgroup `path` (cgroup v2's, as /proc/PID/cgroup gives it) belongs here."""
        if self.cgroup is None or path is None:
            return False
        mine = self.cgroup.rstrip("/") or "/"
        return path == mine or mine == "/" or path.startswith(mine + "/")


def check_name(text: str, what: str = "namespace") -> str:
    """`text` if it can name a namespace (or a server: it is a directory of the pipe directory).

    Raises:
        ValueError: it cannot.
    """
    if not _NAME.fullmatch(text) or text in RESERVED or (what == "namespace" and text == DEFAULT):
        raise ValueError(f'Invalid {what} name "{text[:24]}": letters, digits, "_", "." and "-", at most 64, '
                         "none of the pipe directory's own names"
                         + (f' nor "{DEFAULT}"' if what == "namespace" else ""))
    return text


def cgroup_path(text: str) -> str:
    """A namespace's cgroup as /proc/PID/cgroup writes it: /sys/fs/cgroup/a/b is /a/b.

    Raises:
        ValueError: `text` is not an absolute path.
    """
    if not text.startswith("/"):
        raise ValueError(f'Invalid cgroup "{text[:24]}", expected a path such as /user.slice/job1')
    if text == CGROUP_MOUNT or text.startswith(CGROUP_MOUNT + "/"):
        return text[len(CGROUP_MOUNT):] or "/"
    return text
