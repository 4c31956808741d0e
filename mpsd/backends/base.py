# What the runtime asks of a device, whatever runs it: the seam between CUDA's semantics (mpsd.runtime: contexts,
# streams, events, memory accounting, IPC) and what actually does the work (mpsd.backends.sim, the calibrated
# simulated H200; mpsd.backends.cuda, a real GPU through the driver API). The runtime speaks only this protocol and the
# vocabulary of mpsd.backends.ops; it imports nothing from the simulator.
"""The backend protocol."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

import trio

from mpsd.backends.ops import Work
from mpsd_protocol import DEFAULT_CONNECTIONS, CudaError

__all__ = ["Backend", "Client", "DeviceMemory", "Gate", "Instance", "HOST_VIEW", "VIRTUAL_MEMORY", "when_all"]

# Capabilities a backend may have.
HOST_VIEW = "host_view"  # device memory is host memory the daemon can hand a client to map (a memfd)
VIRTUAL_MEMORY = "virtual_memory"  # address ranges reserved apart from memory, mapped piece by piece (`reserve`)


@dataclass(frozen=True, slots=True)
class Instance:
    """A partition of the device a client can be bound to: a MIG GPU instance, or a custom SM partition.
    `memory` is 0 where it has none of its own (it shares the device's)."""

    name: str
    sm_count: int
    memory: int


class Gate(Protocol):
    """A flag work given with it waits at on the device, once what it waits for has ended, until it is open
    (Dispatcher: work released ahead that the policy may still hold back). Open when made."""

    def set(self, closed: bool) -> None:
        """Close it, or open it: work already past it runs on."""

    def free(self) -> None:
        """Give it back, open: nothing waits at it any more."""


class DeviceMemory(Protocol):
    """Device memory a backend made: reference counted (IPC maps it into several address spaces), an fd a
    client may be sent (a memfd, or a driver's exported handle), and with HOST_VIEW a mapping in the daemon."""

    fd: int
    size: int
    offset: int  # 0: where its bytes begin in `fd` (the runtime's slices of it have offsets of their own)
    refs: int
    on_release: list[Callable[[], None]]

    def release(self) -> None: ...

    def give_back(self) -> Iterator[None]:
        """Where this reference is the last (`release` is next), give what freeing costs time per byte of back
        a piece at a time, a step per piece, so that a client's teardown never spends long in one step
        (mpsd.runtime.teardown); nothing where another reference remains."""
        ...


class Client(Protocol):
    """What a backend may know of a client (the runtime's Context satisfies it)."""

    id: int
    pid: int
    uid: int


class Backend(Protocol):
    """One device. Work is submitted in stream order; completions are reported through `when_done`."""

    name: str
    policy: str  # how it shares the device among clients (a real GPU under MPS: "mps")
    capabilities: frozenset[str]
    instances: tuple[Instance, ...]
    total_memory: int
    server_memory: int  # what the MPS server itself holds of it
    context_memory: int  # what each client's context holds of it
    memory_fds: int  # the fds of the daemon one allocation from `allocate` holds open while it lives
    # The daemon's memory mappings (vm.max_map_count counts them) one allocation or reserved range holds; a piece
    # mapped into a range holds twice as many (itself, and the split of the rest).
    host_maps: int
    virtual: Any  # the virtual clock's driver (mpsd.backends.engine.VirtualEngine), where it runs one, else None
    on_fault: Callable[[int, CudaError], None]  # told of a fatal error in a client's work, to contain it
    on_idle: Callable[[int, float, float], None]  # virtual clock: (client, its clock, grace) counted idle

    def properties(self, index: int) -> dict[str, Any]:
        """``cudaGetDeviceProperties`` for the whole device, in snake_case."""

    def allocate(self, nbytes: int) -> DeviceMemory:
        """Back `nbytes` of device memory.

        Raises:
            OSError: the host cannot back it.
        """

    def reserve(self, nbytes: int) -> Any:
        """With VIRTUAL_MEMORY: the device side of a reserved address range of `nbytes`, into which memory
        from `allocate` is mapped: ``map(offset, memory, memory_offset, nbytes)``, ``unmap(offset, nbytes)``,
        ``close()``; work on it is given extents whose memory is this object.

        Raises:
            OSError: the host cannot reserve it.
        """

    def fits(self, threads: int, shared_mem: int, regs: int = 32) -> bool:
        """Whether one block of `threads` threads of `regs` registers each and `shared_mem` bytes of shared memory
        fits on an SM."""

    def occupancy(self, function: Any, threads: int, shared_mem: int) -> int:
        """``cudaOccupancyMaxActiveBlocksPerMultiprocessor``: the blocks of `threads` threads of `function` (a
        declared kernel, mpsd.modules.Kernel) with `shared_mem` bytes of dynamic shared memory one SM holds at
        once (0: none fits)."""

    def load_module(self, module: Any) -> None:
        """Make a module's kernels (mpsd.modules.Module) ready to launch, once per daemon for each module read.

        Raises:
            ValueError: this device cannot run them (the reason: no twin for a GPU, a compile error).
        """

    def sm_cap(self, active_thread_percentage: float) -> int:
        """SMs a client at that active thread percentage may hold at once."""

    def attach(self, client: Client, *, sm_cap: int, priority: int, weight: float, instance: int | None,
               sms: tuple[int, int] | None = None, connections: int = DEFAULT_CONNECTIONS) -> None:
        """A client arrived, or its scheduling settings changed (from its next placement on); `sms` is the
        static SM partition (MPS's -S) it is pinned to, as (first SM, SM count); `connections` the hardware
        work queues its streams share (CUDA_DEVICE_MAX_CONNECTIONS), for streams made from now on."""

    def release_host(self, buffer: Any) -> None:
        """A client's pinned host buffer is about to be unmapped (a GPU must unregister it first)."""

    def received(self, at: float) -> None:
        """The calls served next were read from their client's socket at trio time `at`: work they queue
        arrived then, however long the daemon took to get to it."""

    def submit(self, work: Work, count: int = 1, gate: Gate | None = None, late: float = 0.0) -> None:
        """Queue `work` after the work it names in `after` and the work before it on its stream: the one way
        work reaches a backend. A Launch may come `count` times over (a client's loop launching one plan again
        and again): the launches go one after another on its stream, the first after what `after` names, and
        `work` stands for the last of them, its record saying when all have ended. Only a launch that touches
        no memory (no `extents`) comes more than once. With `gate` (one of this backend's), it waits at the gate
        too, once what it waits for has ended. `late`: seconds a model is to add before a kernel may start, once
        it could (the daemon's reaction to the end it was released on, Dispatcher's `reaction`); a real GPU
        takes that time by itself, and ignores it.

        Raises:
            OutOfMemoryError: the backend cannot hold what the work would touch (the call fails; nothing is
                queued).
        """

    def gate(self) -> Gate | None:
        """A new gate, or None where a backend needs none: it hears of work's end the instant it happens (the
        simulator, whose clock stands still while the daemon decides), so nothing need be released ahead."""
        return None

    def when_done(self, work: Iterable[Work | None], callback: Callable[[], None]) -> None:
        """Call `callback` (now, if they are) once all of `work` has completed or was cancelled."""

    def cancel(self, client: int) -> None:
        """Tear down the client's work: queued work is dropped, running work evicted, waiters told."""

    def forget(self, client: int) -> None:
        """The client has gone: keep nothing about it."""

    def now(self) -> float:
        """The device's time, in seconds."""

    def statistics(self) -> Any:
        """What the device did: `now`, `sm_seconds` in all, and `per_client` (kernels, blocks, block_seconds,
        sm_seconds, max_sms of each client)."""

    def busy_sms(self) -> int: ...

    def utilization(self) -> float | None:
        """The device's own figure for how busy it was lately (a GPU's NVML), or None: then the daemon counts
        it from `statistics().sm_seconds`."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Drive the device until cancelled."""

    def clock_info(self) -> dict[str, Any]:
        """How clients relate the device's time to theirs (the hello reply's "clock")."""

    def write_trace(self, index: int) -> Path | None:
        """Write the device's timeline where the daemon was asked to (at exit); where it went, if anywhere.

        Raises:
            OSError: it cannot be written.
        """

    def timeline(self, index: int) -> tuple[Any, dict[str, Any]] | None:
        """What `write_trace` writes, as data, for a caller in the daemon's own process, which then needs no
        file: the device's timeline (mpsd.record.timeline.Timeline) and what maps it onto the clients (a
        trace's otherData["mpsd"]); None where the device keeps none."""


def when_all(pending: list[Any], wait: Callable[[Any, Callable[[], None]], None], callback: Callable[[], None]) -> None:
    """Call `callback` once every one of `pending` has called back through `wait(item, told)` (now, if none is
    pending): how a backend's `when_done` waits on several pieces of work with one callback each."""
    if not pending:
        callback()
        return
    left = len(pending)

    def told() -> None:
        nonlocal left
        left -= 1
        if left == 0:
            callback()

    for item in pending:
        wait(item, told)
