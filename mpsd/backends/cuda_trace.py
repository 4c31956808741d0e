# A real GPU's side of the daemon's trace (`mpsd --devices cuda:0 --trace FILE`), from what the GPU reported: a
# traced device runs the built-in kernels that write, for each block, when it began and ended by the GPU's global
# timer and which SM ran it (mpsd.backends.cuda_kernels), into slots in device memory that each launch is given
# here. At exit the slots are copied back and become the timeline's kernels and spans (one span a block), on the
# backend's clock: the GPU's timer is mapped onto it by stamps a kernel takes, at start and at the end.
# Events alone date a stream's work, not where its blocks ran or how long they waited for SMs; this is what
# gives the real GPU SM-time, SMs held and idle SMs while work was queued, as the simulator's trace does.
"""Block records of a traced real GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpsd.backends.cuda_driver import _check
from mpsd.record.timeline import KernelRecord, Spans

__all__ = ["BlockTrace", "CHUNK_RECORDS", "MAX_RECORDS"]

RECORD = 16  # bytes of one block's record: two 64-bit words
CHUNK_RECORDS = 1 << 20  # records of one chunk of device memory (16 MiB), allocated as launches need them
MAX_RECORDS = 1 << 26  # at most 1 GiB of them: past that a daemon's kernels run untraced (the trace says so)


@dataclass(slots=True)
class _Launch:
    client: int
    stream: tuple[int, int]
    name: str
    blocks: int
    threads: int
    submitted: float  # the backend's seconds when it was given to the driver
    chunk: int
    first: int  # its first slot in the chunk


@dataclass(eq=False)
class BlockTrace:
    """Slots for traced launches' block records, and what each launch was.

    Args:
        cu: cuda.bindings' driver module.
        max_threads_per_sm: the device's thread slots per SM (a span's share of its SM).
    """

    cu: Any
    max_threads_per_sm: int
    chunks: list[int] = field(default_factory=list)  # device addresses, CHUNK_RECORDS records each
    used: int = CHUNK_RECORDS  # slots taken in the last chunk (full: the first launch allocates one)
    launches: list[_Launch] = field(default_factory=list)
    untraced: int = 0  # launches that found no room
    stamps: list[tuple[int, float]] = field(default_factory=list)  # (GPU timer ns, backend seconds)

    def slots(self, client: int, stream: tuple[int, int], name: str, blocks: int, threads: int,
              submitted: float) -> int:
        """The device address of `blocks` slots for one launch, recorded as its; 0 where there is no room (a
        grid larger than a chunk, or MAX_RECORDS taken): its blocks then write nothing."""
        if blocks > CHUNK_RECORDS:
            self.untraced += 1
            return 0
        if self.used + blocks > CHUNK_RECORDS:
            if (len(self.chunks) + 1) * CHUNK_RECORDS > MAX_RECORDS:
                self.untraced += 1
                return 0
            cu = self.cu
            address = _check(cu.cuMemAlloc(CHUNK_RECORDS * RECORD))
            # A slot no block wrote (its kernel faulted, say) reads as zero, and is left out.
            _check(cu.cuMemsetD8(address, 0, CHUNK_RECORDS * RECORD))
            self.chunks.append(int(address))
            self.used = 0
        first, self.used = self.used, self.used + blocks
        self.launches.append(_Launch(client, stream, name, blocks, threads, submitted, len(self.chunks) - 1, first))
        return self.chunks[-1] + first * RECORD

    def read(self, names: dict[int, str]) -> tuple[list[KernelRecord], Spans]:
        """Every launch as a kernel, and its blocks as spans, in the backend's seconds (the device must have
        finished them, and `stamps` hold at least one stamp); launches of clients not in `names` are left
        out. A kernel's `eligible` is when its stream's turn came: given, and the kernel before it ended."""
        cu = self.cu
        words = np.zeros((len(self.chunks) * CHUNK_RECORDS, 2), dtype=np.uint64)
        for n, address in enumerate(self.chunks):
            count = self.used if n == len(self.chunks) - 1 else CHUNK_RECORDS
            if count:
                _check(cu.cuMemcpyDtoH(words[n * CHUNK_RECORDS:].ctypes.data, address, count * RECORD))
        return self.drawn(words, names)

    def drawn(self, words: np.ndarray, names: dict[int, str]) -> tuple[list[KernelRecord], Spans]:
        """`read`'s kernels and spans from the chunks' records as they were copied back (`words`: two columns,
        CHUNK_RECORDS rows a chunk)."""
        kept = [(n, launch) for n, launch in enumerate(self.launches) if launch.client in names]
        blocks = np.array([launch.blocks for _, launch in kept], dtype=np.int64)
        first = np.array([launch.chunk * CHUNK_RECORDS + launch.first for _, launch in kept], dtype=np.int64)
        owner = np.repeat(np.arange(len(kept)), blocks)  # each slot's launch, in `kept`
        slot = np.repeat(first - np.cumsum(blocks) + blocks, blocks) + np.arange(int(blocks.sum()))
        records = words[slot]
        written = records[:, 0] != 0
        owner, records = owner[written], records[written]
        scale, offset = self._clock()
        began = records[:, 0].astype(np.float64)
        start = began * scale + offset
        end = (began + (records[:, 1] >> np.uint64(32)).astype(np.float64)) * scale + offset
        started, ended = np.full(len(kept), np.inf), np.full(len(kept), -np.inf)
        np.minimum.at(started, owner, start)
        np.maximum.at(ended, owner, end)
        code: dict[str, int] = {}
        tenant = np.array([code.setdefault(names[launch.client], len(code)) for _, launch in kept], dtype=np.int64)
        threads = np.array([launch.threads for _, launch in kept], dtype=np.float64)
        kernels = []
        last_end: dict[tuple[int, tuple[int, int]], float] = {}
        for i, (n, launch) in enumerate(kept):
            key = (launch.client, launch.stream)
            done = float(ended[i]) if math.isfinite(ended[i]) else math.nan
            kernels.append(KernelRecord(names[launch.client], n, launch.name, launch.blocks, launch.submitted,
                                        float(started[i]) if math.isfinite(started[i]) else math.nan, done,
                                        max(launch.submitted, last_end.get(key, -math.inf))))
            if done == done:
                last_end[key] = done
        ids = np.array([n for n, _ in kept], dtype=np.int64)
        spans = Spans(list(code), tenant[owner], ids[owner], (records[:, 1] & np.uint64(0xFFFFFFFF)).astype(np.int64),
                      np.ones(len(owner), dtype=np.int64), np.minimum(1.0, threads[owner] / self.max_threads_per_sm),
                      start, end)
        return kernels, spans

    def _clock(self) -> tuple[float, float]:
        """Backend seconds per GPU timer nanosecond, and at the timer's 0: the line through the first and last
        stamps (the two clocks run at the same rate but for drift; one stamp gives the offset alone)."""
        (t0, s0), (t1, s1) = self.stamps[0], self.stamps[-1]
        scale = (s1 - s0) / (t1 - t0) if t1 - t0 > 1e8 else 1e-9  # over at least 0.1 s, else the nominal rate
        return scale, s0 - t0 * scale

    def free(self) -> None:
        for address in self.chunks:
            self.cu.cuMemFree(address)
        self.chunks.clear()

