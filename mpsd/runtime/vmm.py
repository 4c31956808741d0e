# The driver's virtual memory management, as a context holds it: address ranges reserved without memory
# (cuMemAddressReserve), physical memory made without an address (cuMemCreate), and mappings of the second into
# the first (cuMemMap), so that an allocation can grow in place by mapping more memory at its end (PyTorch's
# expandable_segments, mpsd_client._expandable). Physical memory is what is charged, as cudaMalloc's is: against
# the client's pinned limit and the device when it is made, released when its handle is released and its last
# mapping is gone (the driver keeps it while it is mapped). Reservations cost nothing.
#
# Reservations live in an address range of their own above cudaMalloc's (mpsd.runtime.memory), so the two never
# interleave. Kernels and copies on an address in a reservation are checked page by page: every 2 MiB page they
# touch must be mapped, or the launch is an illegal address when it runs, as an unmapped page faults on a GPU.
# The backend holds the device side (mpsd.backends.vrange on the simulated one: each physical allocation is a
# memfd mapped at its place in one host mapping of the whole range, so the bytes are contiguous for kernels; on a
# real GPU the driver's own reservation and mappings, mpsd.backends.cuda.CudaRange).
"""Reserved address ranges, physical memory and their mappings (the driver's VMM calls)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from mpsd.backends.base import VIRTUAL_MEMORY, DeviceMemory
from mpsd.backends.ops import Extent
from mpsd.runtime.limits import refused
from mpsd.runtime.memory import CHUNK, _Arena, emptied
from mpsd_protocol import (
    InvalidValueError, NotSupportedError, OutOfMemoryError, brief, format_size)

if TYPE_CHECKING:
    from mpsd.backends.base import Backend, DeviceMemory
    from mpsd.runtime.device import Device
    from mpsd.runtime.ledger import Account
    from mpsd.runtime.limits import ClientLimits

GRANULARITY = CHUNK  # cuMemGetAllocationGranularity's answer on the H200, minimum and recommended alike: 2 MiB
VMM_BASE, VMM_LIMIT = 0x8000_0000_0000, 0x10_0000_0000_0000  # above cudaMalloc's range: room for many 159 GiB
# The address space one client may hold reserved, in device memories: a reservation is host address space in the
# daemon too (mpsd.backends.vrange), which all clients share (128 TiB on x86-64), so no client may take it all.
# PyTorch's expandable segments take 1 1/8 of the device per stream and pool: eight is room for three streams.
RESERVE_SHARE = 8


@dataclass(eq=False, slots=True)
class Physical:
    """Memory made by mem_create: its backing, whether its handle was released, how many mappings it has."""

    handle: int
    memory: DeviceMemory
    size: int
    released: bool = False
    mappings: int = 0


@dataclass(eq=False, slots=True)
class Mapping:
    """[addr, addr + size) of a reservation shows [offset, offset + size) of `physical`."""

    addr: int
    size: int
    physical: Physical
    offset: int


@dataclass(eq=False, slots=True)
class Reserved:
    """A reserved address range; `pages` maps each mapped 2 MiB page's index in it to its mapping."""

    addr: int
    size: int
    view: Any  # the backend's host side of it (mpsd.backends.vrange.VirtualRange on the simulated device)
    pages: dict[int, Mapping] = field(default_factory=dict)

    @property
    def span(self) -> int:
        return self.size

    @property
    def end(self) -> int:
        return self.addr + self.size


@dataclass(frozen=True, slots=True)
class Window:
    """What host_view is sent for an address in a mapping: the physical memory's fd, from `offset` in it."""

    fd: int
    offset: int


@dataclass(frozen=True, slots=True)
class MappedPiece:
    """A mapping as mem_fd describes it (the shape of an Allocation: base, size, and the fd window)."""

    addr: int
    size: int
    segment: Window


class VirtualMemory:
    """One context's reservations and physical allocations."""

    def __init__(self) -> None:
        self.arena: _Arena[Reserved] = _Arena(VMM_BASE, VMM_LIMIT, GRANULARITY)
        self.physical: dict[int, Physical] = {}
        self.reserved_bytes = 0  # address space held in reservations
        self.maps = 0  # the daemon's memory mappings its ranges and the pieces mapped into them hold (host_maps)
        self._next_handle = 1

    def reserved(self, ptr: int) -> Reserved | None:
        return self.arena.find(ptr)

    def extent(self, ptr: int, nbytes: int) -> Extent | None:
        """Where [ptr, ptr + nbytes) is, if every page of it is mapped in one reservation; else None."""
        found = self.reserved(ptr)
        if found is None or nbytes < 0 or ptr + nbytes > found.end:
            return None
        first, last = (ptr - found.addr) // GRANULARITY, (ptr + max(nbytes, 1) - 1 - found.addr) // GRANULARITY
        if any(page not in found.pages for page in range(first, last + 1)):
            return None
        return Extent(found.view, ptr - found.addr, nbytes)


class VirtualMemoryCalls:
    """The calls, as methods of the runtime's Context (which the session dispatches to by name)."""

    vmm: VirtualMemory

    if TYPE_CHECKING:  # what the Context they are mixed into has, for the type checker (the real ones are there)
        device: Device
        backend: Backend
        account: Account
        limits: ClientLimits
        partition: int | None

        def _allocate(self, nbytes: int) -> DeviceMemory: ...
        def check_allocations(self) -> None: ...
        def take_host(self, fds: int, maps: int) -> None: ...
        def give_host(self, fds: int, maps: int) -> None: ...
        def mem_get_info(self) -> tuple[int, int]: ...

    def _vmm(self) -> VirtualMemory:
        if VIRTUAL_MEMORY not in self.backend.capabilities:
            raise NotSupportedError(f"the driver's virtual memory calls need the {VIRTUAL_MEMORY} capability, "
                                    f"which {self.device.name}'s backend does not have in mpsd")
        return self.vmm

    def mem_get_allocation_granularity(self) -> int:
        self._vmm()
        return GRANULARITY

    def mem_address_reserve(self, size: int, alignment: int) -> int:
        """cuMemAddressReserve: `size` bytes of address space (a multiple of the granularity), no memory.

        Raises:
            InvalidValueError: a size of no whole pages, or an alignment that is not a power of two up to the
                granularity (the driver takes larger ones; mpsd places every reservation 2 MiB aligned).
            OutOfMemoryError: the address space is exhausted, or this client holds as many reservations as it may.
        """
        vmm = self._vmm()
        _whole_pages("mem_address_reserve", "size", size)
        if alignment and (alignment & (alignment - 1) or alignment > GRANULARITY):
            raise InvalidValueError(f"mem_address_reserve: alignment {alignment} is not a power of two up to "
                                    f"{GRANULARITY} (larger alignments are not emulated)")
        if len(vmm.arena.allocs) >= self.limits.reservations:
            raise refused("reservations", self.limits.reservations)
        allowed = RESERVE_SHARE * self.device.memory_total(self.partition)
        if vmm.reserved_bytes + size > allowed:
            raise OutOfMemoryError(f"mem_address_reserve: {format_size(size)} more would pass the "
                                   f"{format_size(allowed)} of address space a client may reserve")
        try:
            addr = vmm.arena.place(size)
        except MemoryError:
            raise OutOfMemoryError(f"no {format_size(size)} of virtual address space left") from None
        maps = self.backend.host_maps
        self.take_host(0, maps)
        try:
            view = self.backend.reserve(size)
        except OSError as exc:
            self.give_host(0, maps)
            raise OutOfMemoryError(f"the daemon could not reserve {format_size(size)}: {exc.strerror}") from None
        vmm.arena.insert(Reserved(addr, size, view))
        vmm.reserved_bytes += size
        vmm.maps += maps
        return addr

    def mem_address_free(self, ptr: int, size: int) -> None:
        """cuMemAddressFree: the whole reservation `ptr` gave, with nothing mapped in it any more.

        Raises:
            InvalidValueError: no reservation starts at `ptr` with that size, or pages of it are still mapped.
        """
        vmm = self._vmm()
        found = vmm.reserved(ptr)
        if found is None or found.addr != ptr or found.size != size:
            raise InvalidValueError(f"mem_address_free: [{ptr:#x}, +{size}) is not a reservation of this context")
        if found.pages:
            raise InvalidValueError(f"mem_address_free: {len(found.pages)} pages of {ptr:#x} are still mapped")
        vmm.arena.remove(ptr)
        vmm.reserved_bytes -= size
        found.view.close()
        vmm.maps -= self.backend.host_maps
        self.give_host(0, self.backend.host_maps)

    def mem_create(self, size: int) -> int:
        """cuMemCreate: `size` bytes of device memory (whole pages), charged as cudaMalloc's; its handle.

        Raises:
            InvalidValueError: not a whole number of pages.
            OutOfMemoryError: past the device's free memory or this client's pinned limit, or its limits on
                allocations and fds.
        """
        vmm = self._vmm()
        _whole_pages("mem_create", "size", size)
        self.check_allocations()
        free, _ = self.mem_get_info()
        if size > free:
            raise OutOfMemoryError(f"mem_create: tried to make {format_size(size)}; {format_size(free)} free")
        try:
            memory = self._allocate(size)
        except OSError as exc:
            raise OutOfMemoryError(f"the daemon could not back {format_size(size)}: {exc.strerror}") from None
        handle = vmm._next_handle
        vmm._next_handle += 1
        vmm.physical[handle] = Physical(handle, memory, size)
        self.device.ledger.move(self.account, size, size)
        return handle

    def mem_release(self, handle: int) -> None:
        """cuMemRelease: the handle goes now; the memory once nothing maps it.

        Raises:
            InvalidValueError: no such handle (or released already).
        """
        physical = self._physical(handle)
        physical.released = True
        del self.vmm.physical[handle]
        if not physical.mappings:
            self._free_physical(physical)

    def mem_map(self, ptr: int, size: int, offset: int, handle: int) -> None:
        """cuMemMap, with cuMemSetAccess's read-write access for this device folded in: [ptr, ptr + size) of a
        reservation shows [offset, offset + size) of the handle's memory.

        Raises:
            InvalidValueError: unaligned, outside one reservation or the memory, or over pages already mapped.
            OutOfMemoryError: past this client's limit on the daemon's memory mappings or into their reserve.
        """
        physical = self._physical(handle)
        for name, value in (("ptr", ptr), ("size", size), ("offset", offset)):
            _whole_pages("mem_map", name, value, zero_ok=name != "size")
        found = self.vmm.reserved(ptr)
        if found is None or ptr + size > found.end:
            raise InvalidValueError(f"mem_map: [{ptr:#x}, +{size}) is not inside one reservation")
        if offset + size > physical.size:
            raise InvalidValueError(f"mem_map: [{offset}, +{size}) is beyond the {physical.size} bytes of handle "
                                    f"{handle}")
        first = (ptr - found.addr) // GRANULARITY
        pages = range(first, first + size // GRANULARITY)
        if any(page in found.pages for page in pages):
            raise InvalidValueError(f"mem_map: [{ptr:#x}, +{size}) overlaps pages already mapped")
        maps = 2 * self.backend.host_maps  # the piece, and the split of what is left of the range around it
        self.take_host(0, maps)
        try:
            found.view.map(ptr - found.addr, physical.memory, offset, size)
        except OSError as exc:
            self.give_host(0, maps)
            raise OutOfMemoryError(f"mem_map: the daemon could not map {format_size(size)}: {exc.strerror}") from None
        self.vmm.maps += maps
        mapping = Mapping(ptr, size, physical, offset)
        for page in pages:
            found.pages[page] = mapping
        physical.mappings += 1

    def mem_unmap(self, ptr: int, size: int) -> None:
        """cuMemUnmap: [ptr, ptr + size) must be whole mappings. It does not wait for queued work: on the
        simulated device work that touches the range when it runs is an illegal address (PyTorch synchronises
        its stream first); the CUDA backend puts the driver's unmapping off until that work has run instead.

        Raises:
            InvalidValueError: the range is not made of whole mappings of one reservation.
        """
        self._vmm()
        found = self.vmm.reserved(ptr)
        if found is None or not isinstance(size, int) or size <= 0 or ptr + size > found.end \
                or (ptr - found.addr) % GRANULARITY or size % GRANULARITY:
            raise InvalidValueError(f"mem_unmap: [{ptr:#x}, +{brief(size, 20)}) is not whole pages of one "
                                    "reservation")
        first = (ptr - found.addr) // GRANULARITY
        pages = range(first, first + size // GRANULARITY)
        mappings = {id(m): m for m in (found.pages.get(page) for page in pages) if m is not None}
        if len(found.pages.keys() & set(pages)) != len(pages) or any(
                m.addr < ptr or m.addr + m.size > ptr + size for m in mappings.values()):
            raise InvalidValueError(f"mem_unmap: [{ptr:#x}, +{size}) is not made of whole mappings")
        found.view.unmap(ptr - found.addr, size)
        maps = 2 * self.backend.host_maps * len(mappings)
        self.vmm.maps -= maps
        self.give_host(0, maps)
        for page in pages:
            del found.pages[page]
        for mapping in mappings.values():
            mapping.physical.mappings -= 1
            if mapping.physical.released and not mapping.physical.mappings:
                self._free_physical(mapping.physical)

    def mapped_piece(self, ptr: int) -> MappedPiece | None:
        """The mapping that holds `ptr`, as host_view's mem_fd sends it (its bytes end where the mapping does)."""
        found = self.vmm.reserved(ptr)
        mapping = found.pages.get((ptr - found.addr) // GRANULARITY) if found is not None else None
        if mapping is None:
            return None
        return MappedPiece(mapping.addr, mapping.size,
                           Window(mapping.physical.memory.fd, mapping.physical.memory.offset + mapping.offset))

    def drain_virtual_memory(self, freed: Callable[[int], None]) -> Iterator[None]:
        """Unmap, release and free everything (the client went), each physical allocation's bytes told to
        `freed` as they are given back; a unit of work per mapping, per reservation and per physical allocation,
        and per batch of index entries let go, yielded between (mpsd.runtime.teardown paces them). As with
        AddressSpace.drain, nothing is reserved here again, so the reservations' index is not kept up as they
        go (it cost two thirds of tearing down 300,000 reservations)."""
        vmm = self.vmm
        arena, physicals = vmm.arena, vmm.physical
        vmm.arena, vmm.physical, vmm.reserved_bytes = arena.fresh(), {}, 0
        reservations = arena.allocs
        for addr, found in reservations.items():
            reservations[addr] = None  # type: ignore[assignment]  # (a new value is no change of size)
            pages = found.pages
            for page, mapping in pages.items():
                if mapping.addr != addr + page * GRANULARITY:
                    continue  # a page after a mapping's first: the first stood for it
                physical = mapping.physical
                physical.mappings -= 1
                if physical.released and not physical.mappings:
                    yield from physical.memory.give_back()
                    freed(physical.size)
                    self._free_physical(physical)
                yield
            found.view.close()
            yield
            yield from emptied(pages)
        for physical in physicals.values():
            physical.released = True
            yield from physical.memory.give_back()
            freed(physical.size)
            self._free_physical(physical)
            yield
        yield from emptied(physicals)
        yield from arena.emptied()
        self.give_host(0, vmm.maps)  # the mappings its ranges and pieces held, closed above
        vmm.maps = 0

    def _physical(self, handle: int) -> Physical:
        physical = self._vmm().physical.get(handle) if isinstance(handle, int) else None
        if physical is None:
            raise InvalidValueError(f"{brief(handle, 20)} is not a live memory handle of this context")
        return physical

    def _free_physical(self, physical: Physical) -> None:
        self.device.ledger.move(self.account, -physical.size, -physical.size)
        physical.memory.release()


def _whole_pages(call: str, name: str, value: Any, zero_ok: bool = False) -> None:
    if not isinstance(value, int) or value < 0 or value % GRANULARITY or (value == 0 and not zero_ok):
        raise InvalidValueError(f"{call}: {name} {brief(value, 20)} is not a multiple of the {GRANULARITY}-byte "
                                "granularity")
