# The Prometheus exporter (--metrics), as Prometheus meets it: a real daemon, real client processes doing work,
# and scrapes over real HTTP (urllib), read with prometheus-client's own parser of the text format. The series
# must say what the clients did; the address rule (loopback unless --metrics-allow-remote) is pinned as the
# operator meets it, by exit codes and the log; the shipped dashboard must name only series that are served.
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemons import short_tempdir, spawn_worker, start_daemon
from mpsd.daemon.config import ConfigError, load_config, parse_metrics_address
from mpsd.daemon.metrics import exposed_names
from mpsd.sim import H200

MIB = 1 << 20
SPIN_100_US = int(1e-4 * 1.98e9)  # spin cycles for 0.1 ms at the H200's 1.98 GHz
# A limit counts the context's own charge: the tight client's leaves it room for its allocations above that.
LIMIT_MIB = -(-H200.context_memory // MIB) + 64
DASHBOARD = Path(__file__).resolve().parent.parent / "systemd" / "mpsd-grafana-dashboard.json"

# A client that allocates, launches and synchronizes, says what it did, then does more when told.
WORKER = """
    import json, sys, numpy as np, mpsd_client
    alloc, launches, copy = (int(a) for a in sys.argv[1:4])
    with mpsd_client.connect() as ctx:
        ptrs = [ctx.malloc(alloc) for _ in range(3)]
        if copy:
            ctx.memcpy_htod(ptrs[0], np.zeros(copy, np.uint8))
        for _ in range(launches):
            ctx.launch("spin", 132, 1024, [%d])
        ctx.synchronize()
        print(json.dumps({"pid": ctx.statistics()["pid"]}), flush=True)
        for line in sys.stdin:
            if line.strip() == "more":
                for _ in range(launches):
                    ctx.launch("spin", 132, 1024, [%d])
                ctx.synchronize()
                print("done", flush=True)
            else:
                break
""" % (SPIN_100_US, SPIN_100_US)


def said(worker: subprocess.Popen[str]) -> dict:
    """The worker's first line, once it has done its work (or why it died)."""
    line = worker.stdout.readline()
    if not line:
        worker.wait(30)
        raise AssertionError(f"the worker exited {worker.returncode}: {worker.stderr.read()}")
    return json.loads(line)


def finish(worker: subprocess.Popen[str]) -> int:
    """Tell the worker to end (its stdin closes), wait for it and close its pipes; its exit code."""
    for pipe in (worker.stdin, worker.stdout, worker.stderr):
        if not pipe.closed:
            pipe.close()
    return worker.wait(30)


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample the endpoint serves now: sample name -> [(labels, value)]."""
    with urllib.request.urlopen(url, timeout=30) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for have, v in samples.get(name, []) if labels.items() <= have.items()]
    assert len(found) == 1, f"{name} {labels}: {found} among {samples.get(name)}"
    return found[0]


def metrics_url(server_log: str) -> str:
    found = re.search(r"Metrics for Prometheus at (http://\S+/metrics)", server_log)
    assert found, server_log
    return found.group(1)


@pytest.fixture
def metrics_daemon():
    d = start_daemon("--time-scale", "100", "--metrics", "127.0.0.1:0", "--pinned-mem-limit", "2G")
    yield d
    assert d.stop() == 0, d.stderr_lines
    shutil.rmtree(d.pipe_dir.parent, ignore_errors=True)


def test_scrapes_show_what_real_clients_did(metrics_daemon):
    """Two client processes work; the scrape's per-device DCGM series and per-client mpsd series, with their
    labels, say what they did, and what one does next shows in the next scrape."""
    url = metrics_url(metrics_daemon.server_log())
    assert url.startswith("http://127.0.0.1:")
    tight = spawn_worker(WORKER, metrics_daemon.pipe_dir, str(8 * MIB), "10", "0",
                         env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={LIMIT_MIB}M",
                              "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"})
    loose = spawn_worker(WORKER, metrics_daemon.pipe_dir, str(2 * MIB), "4", str(MIB))
    try:
        pids = [said(w)["pid"] for w in (tight, loose)]
        first = scrape(url)
        gpu = {"gpu": "0", "device": "nvidia0", "modelName": "NVIDIA H200", "Hostname": socket.gethostname()}
        used, free = value(first, "DCGM_FI_DEV_FB_USED", **gpu), value(first, "DCGM_FI_DEV_FB_FREE", **gpu)
        assert used >= 3 * (8 + 2) and used + free in (H200.total_memory // MIB - 1, H200.total_memory // MIB)
        [(labels, _)] = first["DCGM_FI_DEV_FB_USED"]
        assert labels["UUID"].startswith("GPU-") and labels["pci_bus_id"] == "00000000:18:00.0"
        assert 0 <= value(first, "DCGM_FI_DEV_GPU_UTIL", gpu="0") <= 100
        assert value(first, "DCGM_FI_DEV_SM_CLOCK", gpu="0") == 1980
        assert value(first, "mpsd_device_clients", gpu="0") == 2
        assert value(first, "mpsd_device_sm_seconds_total", gpu="0") > 0

        me = {"uid": str(os.getuid()), "namespace": "default", "gpu": "0"}
        a, b = ({**me, "pid": str(pid)} for pid in pids)
        # the server's pid: the daemon's own, where the server has no process of its own (--mps-names)
        assert {labels["server"] for labels, _ in first["mpsd_client_launches_total"]} == {str(metrics_daemon.proc.pid)}
        assert value(first, "mpsd_client_launches_total", **a) == 10
        assert value(first, "mpsd_client_launches_total", **b) == 4
        assert value(first, "mpsd_client_kernels_completed_total", **a) == 10
        assert value(first, "mpsd_client_sm_seconds_total", **a) > value(first, "mpsd_client_sm_seconds_total", **b) > 0
        assert value(first, "mpsd_client_memory_in_use_bytes", **a) == 3 * 8 * MIB
        assert value(first, "mpsd_client_memory_in_use_bytes", **b) == 3 * 2 * MIB
        assert value(first, "mpsd_client_memory_used_bytes", **a) >= 3 * 8 * MIB
        assert value(first, "mpsd_client_memory_limit_bytes", **a) == LIMIT_MIB * MIB  # the client's own, tighter
        assert value(first, "mpsd_client_memory_limit_bytes", **b) == 2048 * MIB  # the daemon's
        assert value(first, "mpsd_client_sm_quota", **a) == 66 and value(first, "mpsd_client_sm_quota", **b) == 132
        assert value(first, "mpsd_client_active_thread_percentage", **a) == 50
        assert value(first, "mpsd_client_copied_bytes_total", **b) == MIB
        assert value(first, "mpsd_client_copies_total", **a) == 0
        assert value(first, "mpsd_client_sticky_error", **a) == 0
        assert "mpsd_client_queued_kernels" not in first  # no kernel dispatcher: the daemon holds no kernels
        synced = value(first, "mpsd_client_sync_call_seconds_count", **a)
        assert synced >= 1
        assert value(first, "mpsd_client_sync_call_seconds_bucket", **a, le="+Inf") == synced
        assert value(first, "mpsd_host_memory_budget_bytes") > 0

        tight.stdin.write("more\n")
        tight.stdin.flush()
        assert tight.stdout.readline().strip() == "done"
        second = scrape(url)
        assert value(second, "mpsd_client_launches_total", **a) == 20
        assert value(second, "mpsd_client_launches_total", **b) == 4
        assert value(second, "mpsd_client_sync_call_seconds_count", **a) == synced + 1
        assert value(second, "mpsd_client_sm_seconds_total", **a) > value(first, "mpsd_client_sm_seconds_total", **a)

        assert finish(loose) == 0  # the client exits: its series go with it
        third = scrape(url)
        assert [labels["pid"] for labels, _ in third["mpsd_client_launches_total"]] == [str(pids[0])]
    finally:
        for w in (tight, loose):
            finish(w)


# A client whose kernel writes past its allocation, and stays connected with its sticky error.
FAULTING = """
    import json, sys, mpsd_client
    with mpsd_client.connect() as ctx:
        p = ctx.malloc(4096)
        ctx.launch("fill_f32", 4, 256, [p, 1.0, 1025])  # one float too many
        try:
            ctx.synchronize()
        except mpsd_client.IllegalAddressError:
            pass
        print(json.dumps({"pid": ctx.statistics()["pid"]}), flush=True)
        sys.stdin.read()
"""


def test_kernel_dispatch_serves_queue_depth_and_a_sticky_error_its_code():
    """Under the kernel dispatcher the client's held kernels and those in flight are served too; a client's
    sticky error is served as its CUDA code (contained to it here), a bystander's as 0."""
    d = start_daemon("--time-scale", "100", "--dispatch", "kernel", "--policy", "fair", "--metrics", "0",
                     "--fault-containment", "client")
    try:
        url = metrics_url(d.server_log())
        worker = spawn_worker(WORKER, d.pipe_dir, str(MIB), "3", "0")
        faulting = None
        try:
            pid = said(worker)["pid"]  # connected first: a client that comes while a fault is handled waits
            faulting = spawn_worker(FAULTING, d.pipe_dir)
            culprit = said(faulting)["pid"]
            samples = scrape(url)
            assert value(samples, "mpsd_client_queued_kernels", pid=str(pid)) == 0  # it synchronized: none held
            assert value(samples, "mpsd_client_kernels_in_flight", pid=str(pid)) == 0
            assert value(samples, "mpsd_client_launches_total", pid=str(pid)) == 3
            assert value(samples, "mpsd_client_sticky_error", pid=str(culprit)) == 700  # cudaErrorIllegalAddress
            assert value(samples, "mpsd_client_sticky_error", pid=str(pid)) == 0
        finally:
            assert finish(worker) == 0
            if faulting is not None:
                finish(faulting)
    finally:
        assert d.stop() == 0, d.stderr_lines
        shutil.rmtree(d.pipe_dir.parent, ignore_errors=True)


# -- the address rule: loopback, unless the operator also says --metrics-allow-remote ----------------------------
@pytest.mark.parametrize("text, expected", [
    ("9400", ("127.0.0.1", 9400)), ("127.0.0.1:0", ("127.0.0.1", 0)), ("127.8.9.10:9400", ("127.8.9.10", 9400)),
    ("localhost:9400", ("localhost", 9400)), ("[::1]:9400", ("::1", 9400)),
])
def test_loopback_addresses_are_taken(text, expected):
    """A loopback address (or a bare port, on 127.0.0.1) needs no other option."""
    assert parse_metrics_address(text, allow_remote=False) == expected


@pytest.mark.parametrize("text", ["0.0.0.0:9400", "[::]:9400", "10.1.2.3:9400", "gpu-node-7:9400"])
def test_other_addresses_need_allow_remote(text):
    """Any other host, a name included, is refused unless --metrics-allow-remote is given too."""
    with pytest.raises(ConfigError, match="--metrics-allow-remote"):
        parse_metrics_address(text, allow_remote=False)
    assert parse_metrics_address(text, allow_remote=True)[1] == 9400


@pytest.mark.parametrize("text", ["", ":", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:http", "1:2:x"])
def test_malformed_addresses_are_refused(text):
    with pytest.raises(ConfigError, match="--metrics"):
        parse_metrics_address(text, allow_remote=True)


def test_metrics_are_off_by_default():
    """Nothing listens unless --metrics is given."""
    assert load_config(["--pipe-dir", "/tmp/x"], environ={}).metrics is None


def test_non_loopback_refused_at_start_and_allowed_when_said(tmp_path):
    """`mpsd --metrics 0.0.0.0:0` exits 2 saying why; with --metrics-allow-remote it serves, and server.log says
    that other hosts can reach it."""
    base = short_tempdir()
    try:
        refused = subprocess.run([sys.executable, "-m", "mpsd", "--pipe-dir", str(base / "p"), "--metrics",
                                  "0.0.0.0:0"], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2
        assert "not a loopback address" in refused.stderr and "--metrics-allow-remote" in refused.stderr
        assert "Traceback" not in refused.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)
    d = start_daemon("--metrics", "0.0.0.0:0", "--metrics-allow-remote")
    try:
        log = d.server_log()
        assert "reachable from other hosts (--metrics-allow-remote)" in log
        port = metrics_url(log).rsplit(":", 1)[1].split("/")[0]
        assert value(scrape(f"http://127.0.0.1:{port}/metrics"), "mpsd_device_clients", gpu="0") == 0
    finally:
        assert d.stop() == 0, d.stderr_lines
        shutil.rmtree(d.pipe_dir.parent, ignore_errors=True)


def test_a_port_in_use_is_a_clean_start_failure():
    """A --metrics port already bound: the daemon exits 1 with one line, not a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        base = short_tempdir()
        try:
            result = subprocess.run([sys.executable, "-m", "mpsd", "--pipe-dir", str(base / "p"), "--metrics",
                                     f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    assert result.returncode == 1
    assert f"cannot serve --metrics on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


# -- the Grafana dashboard shipped beside the units ----------------------------------------------------------------
def test_dashboard_is_json_naming_only_served_series():
    """systemd/mpsd-grafana-dashboard.json loads, every panel has a query, and every series a query (or a
    variable's) names is one the exporter serves."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    assert len(panels) >= 6
    served = exposed_names()
    named: set[str] = set()
    for panel in panels:
        exprs = [t["expr"] for t in panel.get("targets", [])]
        assert exprs, f"panel {panel.get('title')} has no query"
        for expr in exprs:
            named |= set(re.findall(r"\b(?:DCGM_FI_[A-Z_]+|mpsd_[a-z_]+)\b", expr))
    for variable in dashboard["templating"]["list"]:  # the variables' queries too
        named |= set(re.findall(r"\b(?:DCGM_FI_[A-Z_]+|mpsd_[a-z_]+)\b", variable.get("definition", "")))
    assert named and named <= served, named - served
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "mpsd_client_launches_total",
            "mpsd_client_memory_in_use_bytes", "mpsd_client_sync_call_seconds_bucket"} <= named
