"""Record PyTorch's CUDA caching allocator on a real GPU, step by step, for mpsd_client.CachingAllocator to be
checked against (tests/test_caching_allocator.py replays every trace recorded here).

    python3 bench/fidelity/record_torch_allocator.py OUT.json.gz

Each trace is a seeded sequence of steps on one device: allocate N bytes on stream S (0: the default stream,
1: a second stream), free an earlier allocation, or empty the cache. Sizes are drawn from every size class the
allocator treats apart: under 512 B, small (up to 1 MiB), 1 to 10 MiB (packed in 20 MiB segments), and large. After
every step it records memory_stats() and the segments (their addresses: what cudaMalloc returned) with their
blocks (sizes and states, in address order within a segment). Each trace runs in a process of its own, under its
own PYTORCH_CUDA_ALLOC_CONF and, for some, set_per_process_memory_fraction (then allocations run out of memory,
and their retries and garbage collection are recorded too). Each trace ends with memory_summary()'s table.

The traces of RECORD_STREAM_SEEDS also mark some allocations, before they are freed, as used on the other stream
(Tensor.record_stream, so those allocations are tensors): such a block waits for an event on that stream, and is
reused only once a later allocation finds the event complete (the other stream is idle here, so it always has by
then, and the trace is the same on every run).
"""
from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys

# (PYTORCH_CUDA_ALLOC_CONF, set_per_process_memory_fraction or None): 0.004 of an H200 is about 573 MiB, so the
# traces under it run out of memory, retry and collect garbage.
CONFIGS = [("", None), ("max_split_size_mb:40", None), ("roundup_power2_divisions:4", None), ("", 0.004),
           ("garbage_collection_threshold:0.6", 0.004)]
SEEDS = [1, 2, 3]
RECORD_STREAM_SEEDS = [4, 5]  # under the default configuration
STEPS = 300


def sizes(rng: random.Random) -> int:
    kind = rng.random()
    if kind < 0.1:
        return rng.randint(1, 511)
    if kind < 0.5:
        return rng.randint(512, 1 << 20)
    if kind < 0.8:
        return rng.randint((1 << 20) + 1, 10 << 20)
    return rng.randint(10 << 20, 96 << 20)


def steps(seed: int, record_streams: bool = False) -> list[list]:
    rng = random.Random(seed)
    live: list[int] = []
    out: list[list] = []
    for n in range(STEPS):
        roll = rng.random()
        if roll < 0.02:
            out.append(["empty_cache"])
        elif live and roll < 0.45:
            victim = live.pop(rng.randrange(len(live)))
            if record_streams and rng.random() < 0.5:  # (the other traces draw the same numbers as before)
                out.append(["record_stream", victim])
            out.append(["free", victim])
        else:
            out.append(["alloc", n, sizes(rng), 1 if rng.random() < 0.2 else 0])
            live.append(n)
    return out


def layout(torch) -> list[dict]:
    """The segments in address order, each with its blocks."""
    segments = []
    for seg in torch.cuda.memory_snapshot():
        segments.append({"address": seg["address"], "total_size": seg["total_size"],
                         "segment_type": seg["segment_type"], "stream": 0 if seg["stream"] == 0 else 1,
                         "blocks": [[b["size"], b["state"]] for b in seg["blocks"]]})
    return segments


def record(config: str, fraction: float | None, seed: int, record_streams: bool = False) -> dict:
    import torch

    torch.cuda.init()
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction)
    side = torch.cuda.Stream()
    streams = {0: torch.cuda.current_stream(), 1: side}
    pointers: dict[int, int] = {}
    tensors: dict[int, tuple] = {}  # with record_streams: each allocation a uint8 tensor, and its stream
    out = []
    for step in steps(seed, record_streams):
        oom = False
        if step[0] == "alloc":
            _, n, size, stream = step
            try:
                if record_streams:
                    with torch.cuda.stream(streams[stream]):
                        tensors[n] = (torch.empty(size, dtype=torch.uint8, device="cuda"), stream)
                else:
                    pointers[n] = torch.cuda.caching_allocator_alloc(size, 0, streams[stream])
            except torch.cuda.OutOfMemoryError:
                oom = True
        elif step[0] == "record_stream":
            if step[1] in tensors:  # (no name of ours may hold the tensor past its free step)
                tensors[step[1]][0].record_stream(streams[1 - tensors[step[1]][1]])
        elif step[0] == "free":
            if step[1] in pointers:  # an allocation that ran out of memory has nothing to free
                torch.cuda.caching_allocator_delete(pointers.pop(step[1]))
            tensors.pop(step[1], None)  # its last reference: the allocator frees it
        else:
            torch.cuda.empty_cache()
        segments = layout(torch)
        stats = {k: v for k, v in torch.cuda.memory_stats().items() if isinstance(v, int)}
        out.append({"step": step, "oom": oom, "stats": stats, "segments": segments})
    return {"config": config, "fraction": fraction, "seed": seed, "torch": torch.__version__,
            "record_streams": record_streams, "total_memory": torch.cuda.mem_get_info()[1], "steps": out,
            "summary": torch.cuda.memory_summary()}


def main() -> int:
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--one":
        fraction = None if sys.argv[2] == "-" else float(sys.argv[2])
        print(json.dumps(record(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), fraction, int(sys.argv[3]),
                                record_streams=sys.argv[4:] == ["--record-streams"])))
        return 0
    traces = []
    runs = [(config, fraction, seed, False) for config, fraction in CONFIGS for seed in SEEDS]
    runs += [("", None, seed, True) for seed in RECORD_STREAM_SEEDS]
    for config, fraction, seed, record_streams in runs:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=config)
        result = subprocess.run([sys.executable, __file__, "--one", "-" if fraction is None else str(fraction),
                                 str(seed), *(["--record-streams"] if record_streams else [])], env=env,
                                capture_output=True, text=True, check=True)
        traces.append(json.loads(result.stdout))
        ooms = sum(s["oom"] for s in traces[-1]["steps"])
        print(f"recorded {config or 'defaults'} fraction {fraction} seed {seed}: "
              f"{len(traces[-1]['steps'])} steps, {ooms} out of memory", flush=True)
    with gzip.open(sys.argv[1], "wt") as f:
        json.dump(traces, f, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
