# Per-device policies in the TOML file: each [mpsd.device.N] table gives one device its policy and options,
# the command line and [mpsd] staying the defaults for the others. Parsing is checked on load_config itself;
# that the daemon really runs each device under its own policy is checked with a real daemon and clients.
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mpsd_client
from daemons import short_tempdir, start_daemon
from mpsd.daemon.config import ConfigError, load_config
from mpsd.sim import H200, MIG_PROFILES

BIN = Path(sys.executable).parent


def _config(tmp_path: Path, text: str, *argv: str):
    path = tmp_path / "mpsd.toml"
    path.write_text(text)
    return load_config(["--config", str(path), *argv], environ={})


def test_device_tables_override_the_defaults_for_their_device(tmp_path):
    """A [mpsd.device.1] table sets device 1's policy and options; device 0 keeps the command line's."""
    config = _config(tmp_path, """
        [mpsd]
        devices = "h200:3"
        [mpsd.device.1]
        policy = "timeslice"
        timeslice = 0.002
        context-switch = 0.0003
        [mpsd.device.2]
        policy = "mig"
        mig-partitions = ["3g.71gb", "1g.18gb"]
    """.replace("\n        ", "\n"), "--policy", "priority", "--aging", "0.01")
    assert config.device_policy(0) == ("priority", {"aging": 0.01})
    assert config.device_policy(1) == ("timeslice", {"timeslice": 0.002, "switch": 0.0003})
    assert config.device_policy(2) == ("mig", {"partitions": ["3g.71gb", "1g.18gb"]})


def test_a_device_inherits_the_default_options_its_policy_takes(tmp_path):
    """A table that keeps the default policy keeps its options; one that only changes an option changes that."""
    config = _config(tmp_path, '[mpsd]\ndevices = "h200:2"\n[mpsd.device.1]\ncontext-switch = 0.0005\n',
                     "--policy", "timeslice", "--timeslice", "0.004")
    assert config.device_policy(0) == ("timeslice", {"timeslice": 0.004})
    assert config.device_policy(1) == ("timeslice", {"timeslice": 0.004, "switch": 0.0005})


@pytest.mark.parametrize("table,message", [
    ('[mpsd.device.2]\npolicy = "fair"\n', "[mpsd.device.2]: there is no device 2"),
    ('[mpsd.device.1]\nweight = 2\n', "[mpsd.device.1]: unknown setting(s) weight"),
    ('[mpsd.device.1]\npolicy = "lottery"\n', "[mpsd.device.1]: unknown policy 'lottery'"),
    ('[mpsd.device.1]\naging = 0.1\n', "[mpsd.device.1]: policy mps: unknown option(s) ['aging']"),
    ('[mpsd.device.1]\npolicy = "timeslice"\ntimeslice = "long"\n', "timeslice must be a non-negative number"),
    ('[mpsd.device.0]\npolicy = "mig"\nmig-partitions = "7g.141gb,1g.18gb"\n', "does not fit"),
])
def test_bad_device_tables_are_config_errors(tmp_path, table, message):
    """Each mistake in a device table names the table and what is wrong with it."""
    with pytest.raises(ConfigError) as caught:
        _config(tmp_path, '[mpsd]\ndevices = "h200:2"\n' + table)
    assert message in str(caught.value)


@pytest.mark.parametrize("text,message", [
    ('[mpsd]\npolicyy = "fair"\n', "[mpsd]: unknown setting(s) policyy"),
    ('[mpsd]\ntime_scale = 2\n', "[mpsd]: unknown setting(s) time_scale"),
    ('[mpds]\npolicy = "fair"\n', "unknown table or key mpds"),
])
def test_unknown_settings_in_the_file_are_errors_naming_key_and_file(tmp_path, text, message):
    """A typo in the --config file is an error naming the key and the file, never a run on defaults."""
    with pytest.raises(ConfigError) as caught:
        _config(tmp_path, text)
    assert message in str(caught.value) and str(tmp_path / "mpsd.toml") in str(caught.value)


def test_help_documents_device_tables():
    """`mpsd --help` says where per-device policies go."""
    result = subprocess.run([BIN / "mpsd", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "[mpsd.device.N]" in result.stdout


def test_a_bad_device_table_stops_the_daemon_with_one_line(tmp_path):
    """The daemon refuses to start on a bad device table: exit 2 and one line on stderr."""
    path = tmp_path / "mpsd.toml"
    path.write_text('[mpsd.device.3]\npolicy = "fair"\n')
    result = subprocess.run([BIN / "mpsd", "--config", str(path), "--pipe-dir", str(short_tempdir() / "p")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["mpsd: [mpsd.device.3]: there is no device 3 (devices 0 to 0)"]


def test_each_device_runs_its_own_policy(daemon_factory, tmp_path):
    """Device 1 under mig with a 1g instance, device 0 under the default mps: clients see each device's own
    SMs and memory, and mpsd-smi shows each device's policy."""
    path = tmp_path / "mpsd.toml"
    path.write_text('[mpsd]\ndevices = "h200:2"\n[mpsd.device.1]\npolicy = "mig"\nmig-partitions = "1g.18gb"\n')
    d = start_daemon("--time-scale", "100", "--config", str(path))
    daemon_factory.append(d)
    sms, _, eighths = MIG_PROFILES["1g.18gb"]
    with mpsd_client.connect(d.pipe_dir, device=0) as whole, mpsd_client.connect(d.pipe_dir, device=1) as mig:
        assert whole.device_properties()["multiprocessor_count"] == H200.sm_count
        assert mig.device_properties()["multiprocessor_count"] == sms
        assert mig.mem_get_info()[1] == H200.total_memory * eighths // 8
        status = subprocess.run([BIN / "mpsd-smi", "--json"], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "MPSD_PIPE_DIRECTORY": str(d.pipe_dir)})
    assert [dev["policy"] for dev in json.loads(status.stdout)["devices"]] == ["mps", "mig"]
    assert "policy mps, mig" in d.server_log()


def test_a_policy_written_in_python_is_named_module_colon_class(tmp_path):
    """--policy module:Class runs a Python policy (built by the simulator); one that cannot be loaded is a usage
    error naming it."""
    config = _config(tmp_path, "", "--policy", "examples.sjf_policy:ShortestJobFirst")
    assert config.policy == "examples.sjf_policy:ShortestJobFirst"
    with pytest.raises(ConfigError, match="no_such_module"):
        _config(tmp_path, "", "--policy", "no_such_module:Policy")


def test_look_ahead_reaches_the_priority_policy_and_is_off_by_default():
    """`--look-ahead on` gives the kernel-level priority policy `ahead`; without it, or off, it has none; a value
    that is not a truth is refused by the policy itself."""
    from mpsd.runtime.dispatch_policies import Priority, kernel_policy

    def policy(*argv: str) -> Priority:
        config = load_config(["--policy", "priority", "--dispatch", "kernel", *argv], environ={})
        made = kernel_policy(config.policy, config.policy_options)
        assert isinstance(made, Priority)
        return made

    assert policy("--look-ahead", "on").ahead is True
    assert policy("--look-ahead", "off").ahead is False
    assert policy().ahead is False
    with pytest.raises(ValueError, match="ahead must be true or false"):
        Priority(ahead="yes")  # type: ignore[arg-type]


def test_mps_variables_in_the_daemons_environment_are_its_clients_defaults():
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT in the control daemon's environment
    are the defaults for its clients, as real MPS takes them; the daemon's own options win; a bad value names
    the variable."""
    environ = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"}
    config = load_config([], environ=environ)
    assert config.active_thread_percentage == 25.0 and config.pinned_mem_limit(0) == 2 << 30
    config = load_config(["--active-thread-percentage", "50", "--pinned-mem-limit", "1G"], environ=environ)
    assert config.active_thread_percentage == 50.0 and config.pinned_mem_limit(0) == 1 << 30
    assert load_config([], environ={}).active_thread_percentage == 100.0
    with pytest.raises(ConfigError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        load_config([], environ={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "lots"})
    with pytest.raises(ConfigError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE must be in"):
        load_config([], environ={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "0"})
    with pytest.raises(ConfigError, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        load_config([], environ={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=lots"})
