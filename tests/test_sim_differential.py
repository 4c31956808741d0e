"""The engine against the Python engine it replaced, scenario by scenario: the Python engine's record of
every seeded scenario (sim_golden.py: 2,000 per policy, written before it was deleted, after the compiled one
had matched it to the bit on every one) is what the engine must still give, to the bit: every op's times and
flags, every block group, every list returned, next_time, busy and stranded counts along the way, and the
statistics."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_golden  # noqa: E402
from sim_scenarios import first_difference, play  # noqa: E402

from mpsd.sim import Simulator  # noqa: E402

GOLDEN = sim_golden.load()


@pytest.mark.parametrize("policy", sim_golden.POLICIES)
def test_every_scenario_gives_the_recorded_behaviour_to_the_bit(policy):
    """Each policy's 2,000 seeded scenarios give exactly what the Python engine gave."""
    digests = GOLDEN["digests"][policy]
    assert len(digests) == GOLDEN["scenarios"] == sim_golden.SCENARIOS
    for seed, want in enumerate(digests):
        record = sim_golden.normal(play(Simulator, seed, policy))
        if sim_golden.digest(record) != want:
            kept = GOLDEN["records"][policy]
            where = first_difference(record, kept[seed]) if seed < len(kept) else "(record not kept)"
            pytest.fail(f"policy {policy}, seed {seed} parts from the recorded behaviour: {where}")


def test_the_record_tells_policies_apart():
    """The record is fine enough to see another policy's timeline (so a pass above means something)."""
    differ = sum(sim_golden.digest(sim_golden.normal(play(Simulator, seed, "round-robin"))) != want
                 for seed, want in enumerate(GOLDEN["digests"]["mps"][:100]))
    assert differ > 20
