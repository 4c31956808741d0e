"""The compiled engine against the Python one, scenario by scenario: the same record to the bit (every op's
times and flags, every block group, every list returned, next_time, busy and stranded counts along the way,
and the statistics). MPSD_DIFF_SCENARIOS sets how many seeded scenarios each policy plays (default 1000; the
figure in the notes is from a run of thousands)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_scenarios import first_difference, play  # noqa: E402

from mpsd.sim import Simulator  # noqa: E402
from mpsd.sim.engine import PythonEngine  # noqa: E402
from mpsd.sim.simulator import COMPILED_POLICIES  # noqa: E402

SCENARIOS = int(os.environ.get("MPSD_DIFF_SCENARIOS", "1000"))


@pytest.mark.parametrize("policy", sorted(COMPILED_POLICIES))
def test_compiled_engine_matches_the_python_one_to_the_bit(policy):
    """Every seeded scenario gives the compiled engine the Python engine's record exactly."""
    for seed in range(SCENARIOS):
        ours = play(Simulator, seed, policy)
        reference = play(PythonEngine, seed, policy)
        assert ours == reference, f"seed {seed}, policy {policy}: {first_difference(ours, reference)}"


def test_the_record_tells_engines_apart():
    """The record is fine enough to see a different policy (so a pass above means something)."""
    differ = sum(play(Simulator, seed, "mps") != play(lambda s, p, r, o: PythonEngine(s, "round-robin", r, o),
                                                         seed, "mps") for seed in range(60))
    assert differ > 10
