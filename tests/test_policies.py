# Scheduling policies chosen with --policy reach the daemon's simulator: the timelines themselves are pinned
# by the simulator's own tests; here real clients see what the policy does to them.
from __future__ import annotations

import pytest

import mpsd_client
from daemons import spawn_worker, start_daemon

SECOND = int(1.98e9)  # spin cycles


def _wait_behind_other_client(d) -> float:
    """Simulated ms for one tiny kernel of ours while another client runs a 0.3 s single-block kernel."""
    other = spawn_worker("""
        import mpsd_client
        ctx = mpsd_client.connect()
        ctx.launch("spin", 1, 32, [int(0.3 * 1.98e9)])
        print("running", flush=True)
        ctx.synchronize()
    """, d.pipe_dir)
    assert other.stdout.readline().strip() == "running"
    with mpsd_client.connect(d.pipe_dir) as ctx:
        start, end = ctx.create_event(), ctx.create_event()
        start.record()
        ctx.launch("spin", 1, 32, [SECOND // 1000])
        end.record()
        end.synchronize()
        elapsed = start.elapsed_ms(end)
    other.communicate(timeout=60)
    return elapsed


@pytest.mark.parametrize("policy,waits", [("mps", False), ("exclusive", True), ("timeslice", True)])
def test_sharing_policies_as_clients_see_them(daemon_factory, policy, waits):
    """Under MPS a small kernel runs beside another client's; exclusive and time-sliced GPUs make it wait."""
    # A slice longer than the other client's kernel: we must wait for that kernel, never for a slice boundary
    # that might come at any moment.
    extra = ["--timeslice", "1.0"] if policy == "timeslice" else []
    d = start_daemon("--time-scale", "1", "--policy", policy, *extra)
    daemon_factory.append(d)
    elapsed = _wait_behind_other_client(d)
    if waits:
        assert elapsed > 20  # behind the other context's slice or whole kernel, not beside it
    else:
        assert elapsed < 20  # about 1 ms of kernel, plus however long this host took to send the launch


def test_mig_partitions_bind_clients(daemon_factory, monkeypatch):
    """Under --policy mig a client sees its GPU instance's SMs, chosen with MPSD_MIG_PARTITION."""
    d = start_daemon("--time-scale", "100", "--policy", "mig", "--mig-partitions", "3g.71gb,2g.35gb")
    daemon_factory.append(d)
    with mpsd_client.connect(d.pipe_dir) as first:
        assert first.device_properties()["multiprocessor_count"] == 60
    monkeypatch.setenv("MPSD_MIG_PARTITION", "1")
    with mpsd_client.connect(d.pipe_dir) as second:
        assert second.device_properties()["multiprocessor_count"] == 32
        second.launch("spin", 264, 1024, [1000])
        second.synchronize()
        assert second.statistics()["max_sms"] == 32
    monkeypatch.setenv("MPSD_MIG_PARTITION", "2")
    with pytest.raises(mpsd_client.InvalidValueError, match="partition"):
        mpsd_client.connect(d.pipe_dir)


@pytest.mark.parametrize("args,message", [
    (["--policy", "mps", "--timeslice", "0.002"], "--policy mps: unknown option(s) ['timeslice']"),
    (["--policy", "mig", "--mig-partitions", "9g.bad"], "--policy mig: unknown MIG profile '9g.bad'"),
])
def test_policy_settings_are_checked_at_start(args, message):
    """Settings the chosen policy does not take, or cannot use, are usage errors (exit 2)."""
    import subprocess
    import sys

    from daemons import short_tempdir

    proc = subprocess.run([sys.executable, "-m", "mpsd", "--pipe-dir", str(short_tempdir()), *args],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.startswith(f"mpsd: {message}")
