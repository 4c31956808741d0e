"""The golden record of the simulator's behaviour: for each policy and each seeded scenario of sim_scenarios,
a digest of everything the scenario shows (sim_scenarios.play), plus the whole record of the first few, so
that a failure can say where the engine parts from it.

The file was written by the Python engine (mpsd/sim/engine.py as of commit 4b5f63d's model) just before it was
deleted, the compiled engine having matched it to the bit on every scenario of every policy (issue 14);
test_sim_differential.py holds the compiled engine to it. Rewriting it takes the current engine's behaviour
as the new reference: do it only for an intended change of the model, and say so.

    .venv/bin/python tests/sim_golden.py --write    # only for an intended change of the model: say so
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_scenarios import play  # noqa: E402

PATH = Path(__file__).resolve().parent / "sim_golden.json.gz"
POLICIES = ("mps", "round-robin", "priority", "fair", "exclusive", "mig", "timeslice")
SCENARIOS = 2000  # per policy
KEPT = 8  # whole records kept per policy, for failure messages


def normal(record: list) -> list:
    """The record as JSON gives it back (tuples become lists)."""
    return json.loads(json.dumps(record))


def digest(record: list) -> str:
    return hashlib.blake2b(json.dumps(record).encode(), digest_size=16).hexdigest()


def write(make, path: Path = PATH) -> None:
    golden = {"scenarios": SCENARIOS, "digests": {}, "records": {}}
    for policy in POLICIES:
        records = [normal(play(make, seed, policy)) for seed in range(SCENARIOS)]
        golden["digests"][policy] = [digest(r) for r in records]
        golden["records"][policy] = records[:KEPT]
    with gzip.open(path, "wt", encoding="ascii") as f:
        json.dump(golden, f, separators=(",", ":"))


def load(path: Path = PATH) -> dict:
    with gzip.open(path, "rt", encoding="ascii") as f:
        return json.load(f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the current engine's behaviour")
    args = parser.parse_args()
    if args.write:
        from mpsd.sim import Simulator

        write(Simulator)
        print(f"wrote {PATH} ({PATH.stat().st_size:,} bytes)")
