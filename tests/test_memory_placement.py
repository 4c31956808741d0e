# Placement in a client's address space (mpsd.runtime.memory.AddressSpace), checked against a brute-force model: the
# free ranges found by looking at every taken range, and the lowest one that fits. The address space keeps an
# index of its free gaps so that malloc costs O(log n); this pins that the index picks what a first-fit scan
# would, through frees that fragment, ranges that IPC importers keep taken, and chunks that come and go.
from __future__ import annotations

import random

from mpsd.backends.memfd import Segment
from mpsd.runtime.memory import CHUNK, LARGE_BASE, LARGE_LIMIT, SMALL_BASE, SMALL_LIMIT, SMALL_MAX, AddressSpace

SMALL_ALIGN = 512


def first_fit(taken: dict[int, int], base: int, limit: int, span: int, within: int = 0) -> int:
    """The lowest address in [base, limit) where `span` bytes are free (and, with `within`, do not cross a
    `within`-byte boundary), found by walking the free ranges between the `taken` ones (start -> end)."""
    cursor = base
    for start, end in sorted(taken.items()) + [(limit, limit)]:
        addr = cursor
        if within and addr // within != (addr + span - 1) // within:
            addr = -(-addr // within) * within
        if addr + span <= start:
            return addr
        cursor = max(cursor, end)
    raise AssertionError("the model ran out of address space")


def random_size(rng: random.Random) -> int:
    kind = rng.random()
    if kind < 0.45:
        return rng.randint(1, 4096)  # a few 512-byte steps: many to a chunk
    if kind < 0.75:
        return rng.randint(1, SMALL_MAX)  # up to a whole small allocation
    return rng.randint(SMALL_MAX + 1, 12 << 20)  # large: 2 MiB aligned, a segment of its own


def test_placement_is_first_fit_through_fragmenting_frees_and_ipc_holds():
    """Every malloc and import lands where a first-fit scan over the taken ranges puts it, and the charges
    follow the chunk rules (a chunk charged with its first live allocation, released with its last)."""
    rng = random.Random(13)
    space, importer = AddressSpace(Segment), AddressSpace(Segment)
    live: dict[int, object] = {}  # the exporter's allocations, by address
    small: dict[int, int] = {}  # the model of the exporter's small arena: taken ranges, live and held
    large: dict[int, int] = {}
    held: dict[int, object] = {}  # freed small allocations an import still maps, by address
    imported: dict[int, tuple[object, object]] = {}  # id(exported allocation) -> (it, the importer's mapping)
    imports: dict[int, int] = {}  # the model of the importer's large arena
    placed = 0
    for _ in range(4000):
        op = rng.random()
        if op < 0.5 or not live:
            size = random_size(rng)
            if size <= SMALL_MAX:
                span = -(-size // SMALL_ALIGN) * SMALL_ALIGN
                expected = first_fit(small, SMALL_BASE, SMALL_LIMIT, span, within=CHUNK)
                chunk_live = any(a // CHUNK == expected // CHUNK for a in live if a < SMALL_LIMIT)
                charge = 0 if chunk_live else CHUNK
            else:
                span = -(-size // CHUNK) * CHUNK
                expected, charge = first_fit(large, LARGE_BASE, LARGE_LIMIT, span), span
            assert space.plan(size) == (expected, span, charge)
            alloc = space.allocate(expected, size, span)
            live[expected] = alloc
            (small if size <= SMALL_MAX else large)[expected] = expected + span
            placed += 1
        elif op < 0.85:
            addr = rng.choice(list(live))
            alloc = live.pop(addr)
            removed, released = space.remove(addr)
            assert removed is alloc
            if addr >= SMALL_LIMIT:
                del large[addr]
                assert released == alloc.span
            elif any(a // CHUNK == addr // CHUNK for a in live if a < SMALL_LIMIT):
                assert released == 0
                if id(alloc) in imported:
                    held[addr] = alloc  # an importer maps it: its range stays taken
                else:
                    del small[addr]
            else:  # the chunk's last live allocation: the chunk goes, and what was held in it
                assert released == CHUNK
                for gone in [a for a in held if a // CHUNK == addr // CHUNK] + [addr]:
                    held.pop(gone, None)
                    del small[gone]
            alloc.segment.release()  # as the context drops it
        elif op < 0.95:
            alloc = live[rng.choice(list(live))]
            if id(alloc) in imported:
                continue
            span = -(-alloc.size // CHUNK) * CHUNK
            expected = first_fit(imports, LARGE_BASE, LARGE_LIMIT, span)
            mapping = importer.map_import(alloc.segment, alloc.size)  # as IpcRegistry.open_memory does
            alloc.segment.refs += 1
            assert mapping.addr == expected
            imports[expected] = expected + span
            imported[id(alloc)] = (alloc, mapping)
        elif imported:
            alloc, mapping = imported.pop(rng.choice(list(imported)))
            importer.remove(mapping.addr)  # as IpcRegistry._unmap does
            mapping.segment.release()
            del imports[mapping.addr]
            if held.get(alloc.addr) is alloc:  # the last importer let go: the range is free again
                del held[alloc.addr]
                del small[alloc.addr]
        assert len(space) == len(live)
    assert placed > 1500 and held, "the sequence should place many and hold some"
    # Everything freed, holds let go: both arenas are whole again, so placement starts at their bases.
    for _, mapping in list(imported.values()):
        importer.remove(mapping.addr)
        mapping.segment.release()
    for addr in list(live):
        space.remove(addr)[0].segment.release()
    assert len(space) == 0
    assert space.plan(1)[0] == SMALL_BASE and space.plan(CHUNK)[0] == LARGE_BASE
    assert importer.plan(CHUNK)[0] == LARGE_BASE


def test_a_small_allocation_that_does_not_fit_its_chunk_starts_the_next():
    """A small allocation never straddles a 2 MiB boundary; the chunk's rest stays free for smaller ones."""
    space = AddressSpace(Segment)
    first = space.plan(SMALL_MAX)
    space.allocate(first[0], SMALL_MAX, first[1])
    second = space.plan(SMALL_MAX - SMALL_ALIGN)
    space.allocate(second[0], SMALL_MAX - SMALL_ALIGN, second[1])
    assert second[0] == SMALL_BASE + SMALL_MAX
    third = space.plan(SMALL_MAX)  # 512 bytes left in the first chunk: the next chunk, charged anew
    assert third == (SMALL_BASE + CHUNK, SMALL_MAX, CHUNK)
    space.allocate(third[0], SMALL_MAX, third[1])
    assert space.plan(SMALL_ALIGN) == (SMALL_BASE + CHUNK - SMALL_ALIGN, SMALL_ALIGN, 0)
