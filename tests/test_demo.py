# examples/demo.py is the tour of the client API (quotas, memory limits, kernels checked against numpy): it must
# keep working, end to end, with real processes. (`make demo` runs mpsd-stress; see test_stress_run.py.)
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).parent.parent / "examples" / "demo.py"


def test_demo_runs_and_every_check_passes():
    """The demo starts a daemon and four tenants, verifies their results, and stops the daemon with exit 0."""
    result = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "it exited with status 0" in out and "OK: demo took" in out
    for tenant, cap in (("inference", "132"), ("training", "66"), ("batch", "32"), ("background", "66")):
        row = next(fields for fields in map(str.split, out.splitlines())
                   if fields[:1] == [tenant] and len(fields) > 3 and fields[1].isdigit())
        assert row[3] == cap  # tenant, pid, ATP, SM cap
    assert "FAIL" not in out
