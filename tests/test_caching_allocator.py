# mpsd_client.CachingAllocator against PyTorch's own. bench/fidelity/record_torch_allocator.py recorded PyTorch
# 2.11's CUDA caching allocator on an H200: allocations of every size class on two streams, frees and empty_cache,
# under three PYTORCH_CUDA_ALLOC_CONF settings and, capped by set_per_process_memory_fraction so that allocations
# run out of memory, with and without garbage collection; with memory_stats() and every segment and block after
# each step.
# Replayed with the addresses cudaMalloc gave (they decide best fit between blocks of equal size: the H200's
# driver hands out addresses from the top down, the daemon from the bottom up), the allocator must give the same
# statistics and the same segments, split the same way, at the same addresses, after every step. On a real daemon
# the same traces must hold the allocator's own accounting together and give everything back.
from __future__ import annotations

import gzip
import json
from typing import Any
from pathlib import Path

import pytest

import mpsd_client
from daemons import start_daemon
from mpsd_client import CachingAllocator
from mpsd_protocol import OutOfMemoryError

RECORDED = Path(__file__).parent.parent / "bench" / "fidelity" / "torch_allocator_h200.json.gz"
TRACES = json.loads(gzip.open(RECORDED, "rt").read())
# Traces with expandable segments and with record_stream on busy streams, recorded on the H200 by
# record_torch_expandable.py (PyTorch 2.11): seeds 1 to 3 with expandable segments, seeds 4 and 5 busy, under the
# defaults and with expandable segments.
RECORDED_EXPANDABLE = RECORDED.with_name("torch_allocator_expandable_h200.json.gz")
EXPANDABLE_TRACES = json.loads(gzip.open(RECORDED_EXPANDABLE, "rt").read())
EXPANDABLE_IDS = [f"{t['config'] or 'defaults'}{'-busy' if t['busy'] else ''}-seed{t['seed']}"
                  for t in EXPANDABLE_TRACES]
IDS = [f"{t['config'] or 'defaults'}{'-fraction' if t['fraction'] else ''}"
       f"{'-record_stream' if t.get('record_streams') else ''}-seed{t['seed']}" for t in TRACES]


FRAGMENTATION_KEYS = ["fragmentation.external", "fragmentation.free_bytes", "fragmentation.internal",
                      "fragmentation.largest_free_block"]


class RecordedDevice:
    """The device as the recording saw it: each cudaMalloc returns the address it returned on the H200."""

    def __init__(self, trace: dict) -> None:
        self.steps = trace["steps"]
        self.total = trace["total_memory"]
        self.step = 0
        self.live: set[int] = set()

    def malloc(self, nbytes: int) -> int:
        fresh = [s["address"] for s in self.steps[self.step]["segments"]
                 if s["address"] not in self.live and s["total_size"] == nbytes]
        assert fresh, f"step {self.step}: PyTorch made no segment of {nbytes} bytes here"
        self.live.add(fresh[0])
        return fresh[0]

    def free(self, ptr: int) -> None:
        self.live.remove(ptr)

    def synchronize(self) -> None:
        """Nothing is queued on a replayed device."""

    def mem_get_info(self) -> tuple[int, int]:
        return 0, self.total

    def create_event(self, disable_timing: bool = False) -> IdleEvent:
        return IdleEvent()


class RecordedVirtualDevice(RecordedDevice):
    """The device of a trace recorded by record_torch_expandable.py: each reservation at the address the H200's
    cuMemAddressReserve gave (where the segment's first mapped run begins in the recording), and, in a busy
    trace, events that complete only once the device is synchronised (its streams sleep until then)."""

    def __init__(self, trace: dict) -> None:
        super().__init__(trace)
        self.busy = trace.get("busy", False)
        self.reserved: list[tuple[int, int]] = []
        self.clock = self.synced = 0

    def mem_address_reserve(self, size: int, alignment: int = 0) -> int:
        fresh = [s["address"] for s in self.steps[self.step]["segments"] if s["is_expandable"]
                 and not any(base <= s["address"] < base + n for base, n in self.reserved)]
        assert fresh, f"step {self.step}: PyTorch made no expandable segment here"
        self.reserved.append((fresh[0], size))
        return fresh[0]

    def mem_address_free(self, ptr: int, size: int) -> None:
        self.reserved.remove((ptr, size))

    def mem_create(self, size: int) -> int:
        return 1

    def mem_map(self, ptr: int, size: int, offset: int, handle: int) -> None:
        """Nothing to check beyond what the snapshot of the step shows."""

    def mem_unmap(self, ptr: int, size: int) -> None:
        """Nothing to check beyond what the snapshot of the step shows."""

    def mem_release(self, handle: int) -> None:
        """Nothing to check beyond what the snapshot of the step shows."""

    def synchronize(self) -> None:
        self.synced = self.clock

    def create_event(self, disable_timing: bool = False) -> Any:
        return BusyEvent(self) if self.busy else IdleEvent()


class BusyEvent:
    """An event on a busy stream of a recorded trace: complete once the device has been synchronised since it
    was recorded, or it was waited for itself."""

    def __init__(self, device: RecordedVirtualDevice) -> None:
        self.device, self.at, self.done = device, 0, False

    def record(self, stream: object = None) -> None:
        self.device.clock += 1
        self.at, self.done = self.device.clock, False

    def query(self) -> bool:
        return self.done or self.device.synced >= self.at

    def synchronize(self) -> None:
        self.done = True


class IdleEvent:
    """An event on a recorded trace's idle stream: complete by the next step (record_torch_allocator.py)."""

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _replay(allocator: CachingAllocator, trace: dict, side: object, each_step) -> None:
    if trace["fraction"] is not None:
        allocator.set_per_process_memory_fraction(trace["fraction"])
    pointers: dict[int, int] = {}
    streams: dict[int, int] = {}
    for n, recorded in enumerate(trace["steps"]):
        step = recorded["step"]
        oom = False
        if step[0] == "alloc":
            _, ident, size, stream = step
            try:
                pointers[ident] = allocator.malloc(size, side if stream else None)
                streams[ident] = stream
            except OutOfMemoryError:
                oom = True
        elif step[0] == "record_stream":  # used on the other stream too
            if step[1] in pointers:
                allocator.record_stream(pointers[step[1]], None if streams[step[1]] else side)
        elif step[0] == "free":
            if step[1] in pointers:
                allocator.free(pointers.pop(step[1]))
        else:
            allocator.empty_cache()
        each_step(n, recorded, oom)


@pytest.mark.parametrize("trace", TRACES, ids=IDS)
def test_a_recorded_pytorch_trace_replays_step_for_step(trace):
    _replay_step_for_step(trace, RecordedDevice(trace))


@pytest.mark.parametrize("trace", EXPANDABLE_TRACES, ids=EXPANDABLE_IDS)
def test_a_recorded_expandable_or_busy_trace_replays_step_for_step(trace):
    """Expandable segments and record_stream on busy streams, as PyTorch did them on the H200 (only traces whose
    streams stayed busy as meant: `held`)."""
    assert trace["held"], "a stream's sleep ended before the next empty_cache: record it again"
    _replay_step_for_step(trace, RecordedVirtualDevice(trace))


def _replay_step_for_step(trace: dict, device: RecordedDevice) -> None:
    allocator = CachingAllocator(device, config=trace["config"])

    def check(n: int, recorded: dict, oom: bool) -> None:
        assert oom == recorded["oom"], f"step {n}: {recorded['step']}"
        stats = allocator.memory_stats()
        ours = {key: stats.pop(key) for key in list(stats) if key.startswith("fragmentation.")}  # mpsd's, not torch's
        assert stats == recorded["stats"], f"step {n}: {recorded['step']}"
        assert sorted(ours) == FRAGMENTATION_KEYS
        segments = [{"address": s["address"], "total_size": s["total_size"], "segment_type": s["segment_type"],
                     "stream": s["stream"], "blocks": [[b["size"], b["state"]] for b in s["blocks"]]}
                    | ({"is_expandable": s["is_expandable"]} if "held" in trace else {})  # a later recorder's key
                    for s in allocator.memory_snapshot()]
        assert segments == recorded["segments"], f"step {n}: {recorded['step']}"
        device.step = n + 1

    _replay(allocator, trace, 1, check)
    if "summary" in trace:  # recorded since memory_summary() was built
        assert allocator.memory_summary() == trace["summary"]


@pytest.mark.parametrize("trace", TRACES[::3], ids=IDS[::3])
def test_on_a_daemon_the_accounting_holds_and_everything_goes_back(daemon, trace):
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        free_before = ctx.mem_get_info()[0]
        allocator = CachingAllocator(ctx, config=trace["config"])

        def check(n: int, recorded: dict, oom: bool) -> None:
            stats, segments = allocator.memory_stats(), allocator.memory_snapshot()
            blocks = [b for s in segments for b in s["blocks"]]
            assert stats["reserved_bytes.all.current"] == sum(s["total_size"] for s in segments)
            assert stats["allocated_bytes.all.current"] == sum(b["size"] for b in blocks
                                                               if b["state"] == "active_allocated")
            assert stats["segment.all.current"] == len(segments)
            assert all(a["address"] + a["size"] == b["address"]
                       for s in segments for a, b in zip(s["blocks"], s["blocks"][1:]))

        _replay(allocator, trace, ctx.create_stream(), check)
        for ptr in [b["address"] for s in allocator.memory_snapshot() for b in s["blocks"]
                    if b["state"] == "active_allocated"]:
            allocator.free(ptr)
        allocator.empty_cache()
        assert allocator.memory_reserved() == 0 and ctx.mem_get_info()[0] == free_before


def test_out_of_memory_frees_the_cache_retries_then_raises_as_pytorch(daemon_factory):
    daemon = start_daemon("--time-scale", "100", "--pinned-mem-limit", "1G")
    daemon_factory.append(daemon)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:  # about 510 MiB left beside the context's own
        allocator = CachingAllocator(ctx, config="")
        allocator.free(allocator.malloc(200 << 20))  # 200 MiB cached, unused
        kept = allocator.malloc(320 << 20)  # fits only once the cache has gone back to the device: a retry
        stats = allocator.memory_stats()
        assert stats["num_alloc_retries"] == 1 and stats["num_device_free"] == 1
        with pytest.raises(OutOfMemoryError, match=r"CUDA out of memory. Tried to allocate 400.00 MiB. GPU 0 has a "
                                                   r"total capacity of .* Of the allocated memory 320.00 MiB is "
                                                   r"allocated by PyTorch, and 0 bytes is reserved"):
            allocator.malloc(400 << 20)
        assert allocator.memory_stats()["num_ooms"] == 1
        allocator.free(kept)
        allocator.empty_cache()
        assert allocator.memory_reserved() == 0 and ctx.mem_get_info()[0] > 400 << 20


def test_a_block_used_on_another_stream_waits_for_that_stream_before_reuse(ctx):
    """record_stream: a block freed while another stream's work may still use it is 'active_pending_free' (no
    longer allocated, still active) and not handed out until that stream's work has completed; then the next
    malloc finds it again. Without record_stream it is reused at once."""
    allocator = CachingAllocator(ctx, config="")
    side = ctx.create_stream()
    a = allocator.malloc(1 << 20)
    ctx.launch("spin", 8, 32, [int(20 * 1.98e9)], stream=side)  # 20 simulated seconds: 0.2 s of wall time here
    allocator.record_stream(a, side)
    allocator.record_stream(a, None)  # its own stream: nothing to wait for
    allocator.free(a)
    stats = allocator.memory_stats()
    assert (stats["allocated_bytes.all.current"], stats["active_bytes.all.current"]) == (0, 1 << 20)
    states = [b["state"] for s in allocator.memory_snapshot() for b in s["blocks"]]
    assert states == ["active_pending_free", "inactive"]
    b = allocator.malloc(1 << 20)
    assert b != a and not side.query()  # the block still waits for the side stream
    side.synchronize()
    c = allocator.malloc(1 << 20)
    assert c == a
    allocator.free(c)
    assert allocator.malloc(1 << 20) == a  # freed with no other stream: back at once
    with pytest.raises(ValueError):
        allocator.record_stream(b + 512, side)


@pytest.mark.parametrize("strategy, config", [("pytorch", ""), ("pytorch", "expandable_segments:True"),
                                              ("buddy", None), ("slab", None)])
def test_a_busy_stream_holds_a_freed_block_past_mallocs_until_its_event_completes(ctx, strategy, config):
    """record_stream under every strategy (and with expandable segments): while the other stream still runs
    long work queued before the free, the block is active_pending_free and mallocs of its size get other
    memory, however many; once that stream's event has completed, the next malloc gets the block back."""
    allocator = CachingAllocator(ctx, strategy=strategy, **({"config": config} if config is not None else {}))
    side = ctx.create_stream()
    held = allocator.malloc(1 << 20)
    ctx.launch("spin", 8, 32, [int(20 * 1.98e9)], stream=side)  # 20 simulated seconds: 0.2 s of wall time here
    allocator.record_stream(held, side)
    allocator.free(held)
    stats = allocator.memory_stats()
    assert (stats["allocated_bytes.all.current"], stats["active.all.current"]) == (0, 1)
    assert stats["active_bytes.all.current"] >= 1 << 20
    states = {b["address"]: b["state"] for s in allocator.memory_snapshot() for b in s["blocks"]}
    assert states[held] == "active_pending_free"
    others = [allocator.malloc(1 << 20) for _ in range(3)]
    assert held not in others and not side.query()  # the spin is still running: the event has not completed
    side.synchronize()
    again = allocator.malloc(1 << 20)
    assert again == held
    for ptr in others + [again]:
        allocator.free(ptr)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0


@pytest.mark.parametrize("strategy", ["buddy", "slab"])
def test_empty_cache_waits_for_a_strategys_pending_blocks(ctx, strategy):
    """Buddy and slab: empty_cache synchronises the events of blocks freed under record_stream, so their
    segments go back too, and record_stream on no live allocation is a ValueError."""
    allocator = CachingAllocator(ctx, strategy=strategy)
    side = ctx.create_stream()
    free_before = ctx.mem_get_info()[0]
    p = allocator.malloc(3 << 20)
    ctx.launch("spin", 8, 32, [int(5 * 1.98e9)], stream=side)
    allocator.record_stream(p, side)
    allocator.free(p)
    with pytest.raises(ValueError):
        allocator.record_stream(p, side)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0 and allocator.memory_stats()["active_bytes.all.current"] == 0
    assert ctx.mem_get_info()[0] == free_before


def test_empty_cache_waits_for_pending_blocks_and_gives_everything_back(ctx):
    """empty_cache synchronises the events of blocks freed under record_stream, so their segments go too."""
    allocator = CachingAllocator(ctx, config="")
    side = ctx.create_stream()
    free_before = ctx.mem_get_info()[0]
    p = allocator.malloc(3 << 20)
    ctx.launch("spin", 8, 32, [int(5 * 1.98e9)], stream=side)
    allocator.record_stream(p, side)
    allocator.free(p)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0 and allocator.memory_stats()["active_bytes.all.current"] == 0
    assert ctx.mem_get_info()[0] == free_before


def test_each_context_has_one_default_allocator(daemon):
    """mpsd_client.caching_allocator(ctx) is the same allocator for a context every time, another for another."""
    with mpsd_client.connect(daemon.pipe_dir) as one, mpsd_client.connect(daemon.pipe_dir) as two:
        first = mpsd_client.caching_allocator(one)
        assert mpsd_client.caching_allocator(one) is first and mpsd_client.caching_allocator(two) is not first
        first.free(first.malloc(4096))
        assert mpsd_client.caching_allocator(one).memory_reserved() == 2 << 20
