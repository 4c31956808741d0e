"""Record PyTorch's CUDA caching allocator where record_torch_allocator.py does not: with expandable segments, and
with record_stream while the other stream is busy, for tests/test_caching_allocator.py to replay.

    python3 bench/fidelity/record_torch_expandable.py bench/fidelity/torch_allocator_expandable_h200.json.gz

Run on the H200 machine (torch is installed there); its recording, torch_allocator_expandable_h200.json.gz, is
what tests/test_caching_allocator.py replays.

The traces take the steps of record_torch_allocator.py (the same seeds give the same steps):
- expandable_segments:True, seeds 1 to 3: the segments grow in place, in 20 MiB and 2 MiB pages; after every
  step memory_stats() and the snapshot are recorded, `is_expandable` with each segment;
- record_stream on busy streams, seeds 4 and 5, under the default configuration and with expandable segments:
  from the start and after every empty_cache both streams run a torch.cuda._sleep of BUSY_SECONDS, so every event
  the allocator records at a free stays pending until the next empty_cache synchronises it, and no block freed
  under record_stream is reused before then. That keeps the trace the same on every run; `held` says whether
  each sleep outlasted the steps up to the next empty_cache (a trace where one did not is no such trace).
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_torch_allocator import steps  # noqa: E402

EXPANDABLE = "expandable_segments:True"
RUNS = [(EXPANDABLE, seed, False) for seed in (1, 2, 3)] + [
    (config, seed, True) for config in ("", EXPANDABLE) for seed in (4, 5)]
# Longer than the steps between two empty_caches take (at most about 120 steps, each a snapshot and the stats: well
# under a second), with room to spare; every empty_cache waits for the sleep to end (it synchronises the events
# of blocks freed under record_stream), so the busy traces take this long for each of their 34 sleeps.
BUSY_SECONDS = 2.0
CLOCK_HZ = 1.98e9  # the H200's SM clock, which torch.cuda._sleep counts cycles of


def layout(torch) -> list[dict]:
    """The segments in address order, each with its blocks, and whether it is expandable."""
    return [{"address": seg["address"], "total_size": seg["total_size"], "segment_type": seg["segment_type"],
             "stream": 0 if seg["stream"] == 0 else 1, "is_expandable": bool(seg["is_expandable"]),
             "blocks": [[b["size"], b["state"]] for b in seg["blocks"]]}
            for seg in torch.cuda.memory_snapshot()]


def record(config: str, seed: int, busy: bool) -> dict:
    import torch

    torch.cuda.init()
    side = torch.cuda.Stream()
    streams = {0: torch.cuda.current_stream(), 1: side}
    held = True
    marks: list = []

    def sleep() -> None:  # both streams busy for BUSY_SECONDS from here
        marks.clear()
        for stream in streams.values():
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(BUSY_SECONDS * CLOCK_HZ))
                marks.append(torch.cuda.Event())
                marks[-1].record(stream)

    if busy:
        sleep()
    tensors: dict[int, tuple] = {}  # each allocation a uint8 tensor, and its stream
    out = []
    for step in steps(seed, record_streams=busy):
        if step[0] == "alloc":
            _, n, size, stream = step
            with torch.cuda.stream(streams[stream]):
                tensors[n] = (torch.empty(size, dtype=torch.uint8, device="cuda"), stream)
        elif step[0] == "record_stream":
            if step[1] in tensors:
                tensors[step[1]][0].record_stream(streams[1 - tensors[step[1]][1]])
        elif step[0] == "free":
            tensors.pop(step[1], None)  # its last reference: the allocator frees it
        else:
            if busy:
                held = held and not any(mark.query() for mark in marks)
            torch.cuda.empty_cache()
            if busy:
                sleep()
        out.append({"step": step, "oom": False, "segments": layout(torch),
                    "stats": {k: v for k, v in torch.cuda.memory_stats().items() if isinstance(v, int)}})
    if busy:
        held = held and not any(mark.query() for mark in marks)
    torch.cuda.synchronize()
    return {"config": config, "fraction": None, "seed": seed, "torch": torch.__version__, "record_streams": busy,
            "busy": busy, "held": held, "total_memory": torch.cuda.mem_get_info()[1], "steps": out,
            "summary": torch.cuda.memory_summary()}


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(record(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), int(sys.argv[2]),
                                sys.argv[3] == "busy")))
        return 0
    traces = []
    failed = 0
    for config, seed, busy in RUNS:
        result = subprocess.run([sys.executable, __file__, "--one", str(seed), "busy" if busy else "idle"],
                                env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=config), capture_output=True,
                                text=True)
        if result.returncode:  # keep the other traces, and say why this one is missing
            failed += 1
            print(f"FAILED {config or 'defaults'} seed {seed}:\n{result.stderr[-4000:]}", flush=True)
            continue
        traces.append(json.loads(result.stdout))
        print(f"recorded {config or 'defaults'} seed {seed}{' busy' if busy else ''}: held {traces[-1]['held']}",
              flush=True)
    with gzip.open(sys.argv[1], "wt") as f:
        json.dump(traces, f, separators=(",", ":"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
