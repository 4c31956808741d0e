"""Malloc rate: the median microseconds of a malloc and of a free with 1,000, 10,000 and 50,000 allocations live,
in a client's address space (mpsd.runtime.memory.AddressSpace, in this process) and end to end (a blocking client
against a daemon process), beside baselines measured in the same run.

    .venv/bin/python bench/malloc_rate.py [--steps 2000] [--live 1000,10000,50000] [--pin] [--json]

At each level of live allocations, a fill makes 1.5x that many (seeded sizes: mostly a few 512-byte steps,
some up to 256 KiB, one in fifty a large one of 1 to 8 MiB) and frees a random third, so the arenas are full
of holes. Then two patterns are timed, call by call (medians, so that a preempted call on a busy machine
does not count):

    churn   each step mallocs a random size and frees a random live allocation: the count stays put and
            the holes keep moving (a first-fit scan mostly stops early, at a low hole that fits)
    no fit  each step mallocs 1 MiB, which no hole fits, and frees it: a first-fit scan walks every allocation
            (what issue 13 measured: 21 ms a malloc at 10,000 live)

The baselines:

    AddressSpace  the same steps with the placement mpsd had before its gap index (LinearArena below: first
                  fit by walking a copy of every allocation's start), at most 100 of them (it is slow)
    end to end    a raw msgpack request-reply between two processes (bench/_harness.py), the floor of a call

Target: our malloc at the most live allocations at most 2x what it is at the fewest, at both levels.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

from mpsd.backends.memfd import Segment  # noqa: E402
from mpsd.runtime.memory import CHUNK, SMALL_MAX, AddressSpace, Allocation  # noqa: E402

TARGET = 2.0  # our malloc at the most live / at the fewest, at most
LINEAR_STEPS = 100  # steps of the linear baseline at most (tens of ms each at 50,000)


def random_size(rng: random.Random) -> int:
    kind = rng.random()
    if kind < 0.85:
        return rng.randint(1, 4096)
    if kind < 0.98:
        return rng.randint(4097, 256 << 10)
    return rng.randint((1 << 20) + 1, 8 << 20)


def take_random(live: list[int], rng: random.Random) -> int:
    """Remove and return a random element in O(1) (the order of `live` does not matter)."""
    index = rng.randrange(len(live))
    live[index], live[-1] = live[-1], live[index]
    return live.pop()


def fill(malloc: Callable[[int], int], free: Callable[[int], None], n: int, rng: random.Random) -> list[int]:
    """Make 1.5 `n` allocations and free a random third of them: `n` live, with holes. Returns them."""
    live = [malloc(random_size(rng)) for _ in range(n + n // 2)]
    for _ in range(n // 2):
        free(take_random(live, rng))
    return live


def measure(malloc: Callable[[int], int], free: Callable[[int], None], live: list[int], steps: int,
            rng: random.Random) -> tuple[float, float]:
    """Time `steps` steps of one malloc and the free of a random live allocation: the median us of each."""
    clock = time.perf_counter
    mallocs, frees = [], []
    for _ in range(steps):
        size = random_size(rng)
        t0 = clock()
        addr = malloc(size)
        t1 = clock()
        live.append(addr)
        victim = take_random(live, rng)
        t2 = clock()
        free(victim)
        mallocs.append(t1 - t0)
        frees.append(clock() - t2)
    return statistics.median(mallocs) * 1e6, statistics.median(frees) * 1e6


def measure_no_fit(malloc: Callable[[int], int], free: Callable[[int], None], steps: int) -> float:
    """The median us of a malloc of 1 MiB, which none of the holes fits (it goes above every chunk in use),
    each freed again before the next: the case where a first-fit scan walks every allocation."""
    clock = time.perf_counter
    mallocs = []
    for _ in range(steps):
        t0 = clock()
        addr = malloc(SMALL_MAX)
        mallocs.append(clock() - t0)
        free(addr)
    return statistics.median(mallocs) * 1e6


class LinearArena:
    """The baseline only: the placement mpsd had before the gap index, first fit by walking a copy of every
    allocation's start, with the same interface as mpsd.runtime.memory._Arena."""

    def __init__(self, base: int, limit: int, unit: int, within: int = 0) -> None:
        self.base, self.limit, self.unit, self.within = base, limit, unit, within
        self.starts: list[int] = []
        self.allocs: dict[int, Allocation] = {}

    @classmethod
    def of(cls, arena, within: int = 0) -> LinearArena:
        """A linear arena holding what `arena` (an mpsd.runtime.memory._Arena) holds."""
        linear = cls(arena.base, arena.limit, arena.unit, within)
        linear.starts, linear.allocs = list(arena.starts), dict(arena.allocs)
        return linear

    def place(self, span: int) -> int:
        cursor, within = self.base, self.within
        for start in self.starts + [self.limit]:
            if within and cursor // within != (cursor + span - 1) // within:
                cursor = -(-cursor // within) * within
            if start - cursor >= span:
                return cursor
            if start == self.limit:
                break
            alloc = self.allocs[start]
            cursor = max(cursor, -(-(alloc.addr + alloc.span) // self.unit) * self.unit)
        raise MemoryError("device address space exhausted")

    def find(self, ptr: int) -> Allocation | None:
        index = bisect.bisect_right(self.starts, ptr) - 1
        alloc = self.allocs[self.starts[index]] if index >= 0 else None
        return alloc if alloc is not None and ptr < alloc.end else None

    def insert(self, alloc: Allocation) -> None:
        bisect.insort(self.starts, alloc.addr)
        self.allocs[alloc.addr] = alloc

    def remove(self, addr: int) -> Allocation | None:
        alloc = self.allocs.pop(addr, None)
        if alloc is not None:
            del self.starts[bisect.bisect_left(self.starts, addr)]
        return alloc


def in_process(n: int, steps: int, linear: bool) -> tuple[float, float, float]:
    """(malloc us, free us, no-fit malloc us) in an AddressSpace, as the daemon's context calls it; `linear`:
    with the old placement for the timed steps (the fill uses ours, which places the same, or it would take
    minutes)."""
    space = AddressSpace(Segment)

    def malloc(size: int) -> int:
        addr, span, _ = space.plan(size)
        space.allocate(addr, size, span)
        return addr

    def free(addr: int) -> None:
        space.remove(addr)[0].segment.release()  # as Context.free drops it

    rng = random.Random(n)
    live = fill(malloc, free, n, rng)
    if linear:
        space._small = LinearArena.of(space._small, within=CHUNK)  # type: ignore[assignment]
        space._large = LinearArena.of(space._large)  # type: ignore[assignment]
    result = measure(malloc, free, live, steps, rng) + (measure_no_fit(malloc, free, steps),)
    for addr in live:
        free(addr)  # close the memfds before the next level
    return result


def end_to_end(pipe_dir: Path, n: int, steps: int) -> tuple[float, float, float]:
    """(malloc us, free us, no-fit malloc us) from a blocking client of the daemon; a fresh context per
    level, whose exit reclaims what is left."""
    import mpsd_client

    with mpsd_client.connect(pipe_dir) as ctx:
        rng = random.Random(n)
        live = fill(ctx.malloc, ctx.free, n, rng)
        return measure(ctx.malloc, ctx.free, live, steps, rng) + (measure_no_fit(ctx.malloc, ctx.free, steps),)


def raw_round_trip(sock, reader: h.FrameReader, steps: int) -> float:
    """The median us of a msgpack request-reply shaped like a malloc, to the harness's peer process."""
    request = h.frame([0, 1, "malloc", {"nbytes": 4096}])
    clock = time.perf_counter
    samples = []
    for _ in range(steps):
        t0 = clock()
        sock.sendall(request)
        reader.next()
        samples.append(clock() - t0)
    return statistics.median(samples) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="timed malloc+free steps per level (default 2000)")
    p.add_argument("--live", default="1000,10000,50000", help="levels of live allocations (default 1000,10000,50000)")
    p.add_argument("--pin", action="store_true", help="pin the daemon and raw peer to CPU 0, this process to CPU 1")
    p.add_argument("--skip-baseline", action="store_true", help="measure only our side")
    p.add_argument("--json", action="store_true", help="also print one machine-readable JSON line")
    args = p.parse_args()
    levels = [int(v) for v in args.live.split(",")]
    started = time.monotonic()
    ours: dict[int, tuple[float, float, float]] = {}
    linear: dict[int, tuple[float, float, float]] = {}
    e2e: dict[int, tuple[float, float, float]] = {}
    raw: list[float] = []
    for n in levels:
        ours[n] = in_process(n, args.steps, linear=False)
        if not args.skip_baseline:
            linear[n] = in_process(n, min(args.steps, LINEAR_STEPS), linear=True)
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(h.daemon(time_scale=100.0, cpu=h.SERVER_CPU if args.pin else None))
        peer = None if args.skip_baseline else stack.enter_context(
            h.raw_peer(h.SERVER_CPU if args.pin else None))
        if args.pin:
            h.pin(0, h.CLIENT_CPU)
        if peer is not None:  # first, while the daemon is idle (it reclaims a level's allocations after it)
            raw_round_trip(*peer, 200)  # warm-up: the first waits for the peer process to start
            raw.append(raw_round_trip(*peer, args.steps))
        end_to_end(d.pipe_dir, 100, 500)  # warm-up: the daemon's first calls (imports, caches) are slower
        for n in levels:
            e2e[n] = end_to_end(d.pipe_dir, n, args.steps)

    first, last = levels[0], levels[-1]
    growth = {"AddressSpace": max(ours[last][i] / ours[first][i] for i in (0, 2)),
              "end to end": max(e2e[last][i] / e2e[first][i] for i in (0, 2))}
    rows = [("steps", f"{args.steps} of each pattern per level ({min(args.steps, LINEAR_STEPS)} for the linear "
                      "baseline), after a fill of 1.5x and frees of a random third"),
            ("patterns", "churn: malloc a random size, free a random live one;  no fit: malloc 1 MiB (no hole "
                         "fits it), free it")]
    for n in levels:
        row = f"churn malloc {ours[n][0]:6.2f} us  free {ours[n][1]:6.2f} us  no fit malloc {ours[n][2]:6.2f} us"
        if n in linear:
            row += (f"   | linear first fit: churn {linear[n][0]:8.1f} us  no fit {linear[n][2]:8.1f} us"
                    f"  ({linear[n][2] / ours[n][2]:,.0f}x ours)")
        rows.append((f"AddressSpace {n:>6,}", row))
    for n in levels:
        row = f"churn malloc {e2e[n][0]:6.1f} us  free {e2e[n][1]:6.1f} us  no fit malloc {e2e[n][2]:6.1f} us"
        if raw:
            row += f"   | {e2e[n][0] / raw[0]:.1f}x the raw round trip"
        rows.append((f"end to end   {n:>6,}", row))
    if raw:
        rows.append(("raw round trip", f"{raw[0]:.1f} us  (msgpack request-reply shaped like a malloc, two "
                                       "processes over a socketpair, blocking)"))
    rows += [(f"growth {first:,} -> {last:,}", "  ".join(f"{k} {v:.2f}x" for k, v in growth.items())
              + f" (the larger of churn and no-fit malloc; free {ours[last][1] / ours[first][1]:.2f}x and "
                f"{e2e[last][1] / e2e[first][1]:.2f}x)"
              + (f";  linear first fit no fit {linear[last][2] / linear[first][2]:.1f}x" if linear else "")),
             ("target", f"our malloc at {last:,} live at most {TARGET:g}x what it is at {first:,}, at both levels"),
             ("wall time", f"{time.monotonic() - started:.1f} s")]
    verdict = all(v <= TARGET for v in growth.values())
    line = {"bench": "malloc_rate", "steps": args.steps, "live": levels, "pass": verdict,
            "address_space_us": {n: [round(v, 3) for v in ours[n]] for n in levels},
            "end_to_end_us": {n: [round(v, 3) for v in e2e[n]] for n in levels},
            "linear_us": {n: [round(v, 3) for v in linear[n]] for n in linear}, "raw_round_trip_us": raw}
    h.report("malloc_rate", rows, verdict, line if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
