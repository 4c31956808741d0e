"""Does a stream's synchronize through mpsd return only once its work has run? On the H200 machine: a client
(the async client, as mpsd-stress's tenants use) makes requests of two full-device 0.5-ms kernels on a stream of
the greatest priority between two events, synchronizing the stream, alone and then beside closed-loop
best-effort clients; for each request it checks that the end event has fired when the synchronize returns,
that the request took no less wall time than the GPU's time between the events, and no less than two
waves can take.

    python3 bench/fidelity/check_sync.py [--devices cuda:0] [--policy mps] [--requests 200] [--beside 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import _harness as h  # noqa: E402

import trio  # noqa: E402

import mpsd_client  # noqa: E402

HALF_MS = int(1.98e9 * 0.5e-3)
BEST_EFFORT = """
import mpsd_client
ctx = mpsd_client.connect()
while True:
    for _ in range(2):
        ctx.launch("work", 132, 1024, [93638])
    ctx.synchronize()
"""


async def probe(pipe_dir: Path, requests: int, events: bool) -> dict[str, float]:
    async with mpsd_client.open_context(str(pipe_dir)) as ctx:
        stream = await ctx.create_stream(priority=-5)
        start, end = await ctx.create_event(), await ctx.create_event()
        early = unfired = short = 0
        walls, gpus = [], []
        for _ in range(requests):
            if events:
                await start.record(stream)
            t0 = time.perf_counter()
            for _ in range(2):
                await ctx.launch("spin", 264, 1024, [HALF_MS], stream=stream)
            if events:
                await end.record(stream)
            await stream.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
            if not events:  # the stream's last work is a kernel, as in mpsd-stress's requests
                await end.record(stream)
            fired = await end.query()
            gpu = await start.elapsed_ms(end) if fired and events else float("nan")
            unfired += not fired
            early += fired and wall < 0.95 * gpu  # (the start event fires a little after t0)
            short += wall < 0.95  # two full waves of 0.5 ms cannot take less than about 1 ms
            walls.append(wall)
            gpus.append(gpu)
            await trio.sleep(0.01)
        return {"requests": requests, "unfired": unfired, "early": early, "under 0.95 ms": short,
                "wall p50": statistics.median(walls), "wall min": min(walls),
                "gpu p50": statistics.median([g for g in gpus if g == g] or [float("nan")])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="cuda:0")
    p.add_argument("--policy", default="mps")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--beside", type=int, default=5)
    p.add_argument("--no-events", action="store_true",
                   help="no events around a request's kernels (recorded after its synchronize instead)")
    args = p.parse_args()
    with h.daemon(time_scale=1.0, devices=args.devices, policy=args.policy) as d:
        print("alone ", trio.run(probe, d.pipe_dir, args.requests, not args.no_events))
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(d.pipe_dir), "CUDA_MPS_CLIENT_PRIORITY": "1"}
        others = [subprocess.Popen([sys.executable, "-c", BEST_EFFORT], env=env) for _ in range(args.beside)]
        try:
            time.sleep(1.0)
            print("beside", trio.run(probe, d.pipe_dir, args.requests, not args.no_events))
        finally:
            for o in others:
                o.kill()
                o.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
