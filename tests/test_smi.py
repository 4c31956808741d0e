# mpsd-smi speaks nvidia-smi where scripts parse it (issue 16, item 5): -L, --query-gpu= and --query-compute-apps=
# with --format=csv[,noheader][,nounits], -q with -d sections, -i, and the plain table when run as nvidia-smi, in
# the shapes an H200's nvidia-smi printed on the H200 machine (bench/fidelity/nvidia_smi_h200.txt and
# nvidia_smi_q_h200.txt); its errors and exit statuses. A real daemon, a real client.
from __future__ import annotations

import os
import subprocess
import sys

import re
from pathlib import Path

import psutil
import pytest

import mpsd_client
from daemons import start_daemon
from mpsd.sim import H200

MiB = 1 << 20
RECORDED = Path(__file__).parent.parent / "bench" / "fidelity" / "nvidia_smi_q_h200.txt"


def _recorded(args: str) -> list[str]:
    """What the H200's nvidia-smi printed for `args` (stdout and stderr together), and its exit status last."""
    text = RECORDED.read_text()
    start = text.index(f"===== nvidia-smi {args}\n") + len(f"===== nvidia-smi {args}\n")
    end = text.index("===== rc=", start)
    rc = text[end:].split("\n", 1)[0].removeprefix("===== rc=")
    return text[start:end].splitlines() + [rc]


def _smi(daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mpsd.tools.smi", "--pipe-dir", str(daemon.pipe_dir), *args],
                          capture_output=True, text=True, timeout=30, env=dict(os.environ))


def test_nvidia_smi_lists_and_queries(daemon_factory):
    daemon = start_daemon("--time-scale", "100", "--devices", "h200:2")
    daemon_factory.append(daemon)
    with mpsd_client.connect(daemon.pipe_dir, device=1) as ctx:
        ctx.malloc(256 << 20)
        uuid = ctx.device_properties()["uuid"]
        listed = _smi(daemon, "-L").stdout.splitlines()
        assert listed[1] == f"GPU 1: NVIDIA H200 (UUID: {uuid})"
        assert listed[0].startswith("GPU 0: NVIDIA H200 (UUID: GPU-")
        gpus = _smi(daemon, "--query-gpu=index,name,memory.total,memory.used,utilization.gpu", "--format=csv")
        lines = gpus.stdout.splitlines()
        assert lines[0] == "index, name, memory.total [MiB], memory.used [MiB], utilization.gpu [%]"
        assert lines[2].startswith("1, NVIDIA H200, 143156 MiB, ") and lines[2].endswith(" %")
        used = [int(line.split(", ")[3].split()[0]) for line in lines[1:]]
        # the MPS server's memory on each; on device 1 also the client's context and its allocation
        assert used == [round(H200.server_memory / MiB),
                        round((H200.server_memory + H200.context_memory + (256 << 20)) / MiB)]
        bare = _smi(daemon, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits").stdout
        assert bare.splitlines() == ["0, 143156", "1, 143156"]
        apps = _smi(daemon, "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv")
        # the MPS server (type C) on the device with a client, then the client (M+C)
        server = f"{daemon.proc.pid}, {psutil.Process(daemon.proc.pid).name()}, {round(H200.server_memory / MiB)} MiB"
        assert apps.stdout.splitlines() == ["pid, process_name, used_gpu_memory [MiB], gpu_uuid",
                                            f"{server}, {uuid}",
                                            f"{os.getpid()}, {psutil.Process().name()}, 256 MiB, {uuid}"]
        # the fields scripts read first: a value where the model has one, nvidia-smi's [N/A] (no unit) where not
        more = _smi(daemon, "--query-gpu=driver_version,temperature.gpu,power.draw,utilization.memory,"
                    "memory.reserved,mig.mode.current,clocks.sm", "--format=csv").stdout.splitlines()
        assert more[0] == ("driver_version, temperature.gpu, power.draw [W], utilization.memory [%], "
                           "memory.reserved [MiB], mig.mode.current, clocks.current.sm [MHz]")
        assert more[1] == "580.159.04, [N/A], [N/A], [N/A], [N/A], Disabled, 1980 MHz"
    wrong = _smi(daemon, "--query-gpu=bogus")
    assert (wrong.returncode, wrong.stdout) == (2, 'Field "bogus" is not a valid field to query.\n\n')


def _keys(lines: list[str]) -> list[str]:
    """-q's lines up to where each reading starts (its keys are padded to column 55, then ": ")."""
    return [line[:57] if ": " in line else line for line in lines]


def test_nvidia_smi_table_report_and_ids(daemon_factory):
    """The plain table (as nvidia-smi), -q and its sections, and -i, beside what the H200's nvidia-smi printed:
    the lines that hold no reading (borders, headings, the report's layout) are the same bytes; readings are
    mpsd's, and what a simulated GPU has no reading for is N/A."""
    daemon = start_daemon("--time-scale", "100", "--devices", "h200:2")
    daemon_factory.append(daemon)
    with mpsd_client.connect(daemon.pipe_dir, device=0) as ctx:
        ctx.malloc(256 << 20)
        props = ctx.device_properties()
        bus = "{:08X}:{:02X}:{:02X}.0".format(props["pci_domain_id"], props["pci_bus_id"], props["pci_device_id"])
        shown = _smi(daemon, "--smi-name")
        assert shown.returncode == 0
        ours, real = shown.stdout.splitlines(), _recorded("")[:-1]
        assert all(len(line) == 91 for line in ours[1:] if line)
        for line in real[3:8] + real[11:12] + real[13:18]:  # headings and borders, whole
            assert line in ours
        assert re.fullmatch(r"\|   0  NVIDIA H200 +N/A  \|   " + re.escape(bus) + r" Off \| +0 \|", ours[8])
        processes = ours[ours.index(real[17]) + 1:-1]
        assert [line.split()[5] for line in processes] == ["C", "M+C"]
        assert processes[1].split()[4] == str(os.getpid()) and processes[1].endswith(" 256MiB |")

        report = _smi(daemon, "-q", "-i", "0", "-d", "MEMORY,PIDS").stdout.splitlines()
        recorded = _recorded("-q -d MEMORY")
        assert _keys(report[:8]) == _keys(recorded[:8])  # the heading, with its keys where the readings start
        assert _keys(report[9:12]) == _keys(recorded[9:12])  # FB Memory's Total and Reserved
        assert report[8] == f"GPU {bus}" and report[10].endswith(f": {round(props['total_memory'] / MiB)} MiB")
        assert report[14] == "    Processes" and "            Type" + " " * 39 + ": M+C" in report
        for args in (("-i", "7"), ("-i", props["uuid"][:10], "-q"), ("-i", "3", "--query-gpu=name", "--format=csv")):
            missing = _smi(daemon, *args)
            assert (missing.returncode, missing.stdout) == (6, "No devices were found\n")
        assert (_recorded("-i 7") == _recorded("-i GPU-8 --query-gpu=index --format=csv")
                == ["No devices were found", "6"])
        by_uuid = _smi(daemon, "-i", props["uuid"], "--query-gpu=index", "--format=csv,noheader").stdout
        by_bus = _smi(daemon, "-i", bus, "--query-gpu=index", "--format=csv,noheader").stdout
        assert by_uuid == by_bus == "0\n"
        for args, words in ((("-L", "-i", "0"), _recorded("-i 0 -L")),
                            (("-q", "-d", "BOGUS"), _recorded("-q -d BOGUS"))):
            refused = _smi(daemon, *args)
            assert [*refused.stdout.splitlines(), str(refused.returncode)] == words


def test_compute_mode(daemon):
    """-c as nvidia-smi: PROHIBITED refuses new clients (cudaErrorDevicesUnavailable), the reports say the mode,
    DEFAULT lets clients in again; a mode nvidia-smi does not take is its error and exit status 2."""
    set_prohibited = _smi(daemon, "-c", "PROHIBITED")
    assert (set_prohibited.returncode, set_prohibited.stdout.splitlines()[-1]) == (0, "All done.")
    assert "    Compute Mode" + " " * 39 + ": Prohibited" in _smi(daemon, "-q", "-d", "COMPUTE").stdout
    with pytest.raises(mpsd_client.DevicesUnavailableError):
        mpsd_client.connect(daemon.pipe_dir)
    assert _smi(daemon, "-c", "0").returncode == 0
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        assert ctx.malloc(16)
    assert _smi(daemon, "-c", "1").returncode == 2
