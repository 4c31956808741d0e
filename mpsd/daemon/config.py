# The daemon's settings: command-line options over the TOML file over the environment over defaults.
# Parsed once at start-up into a frozen Config; nothing else reads options or the environment.
from __future__ import annotations

import argparse
import ipaddress
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import psutil

from mpsd.backends.cuda import CudaDevice, cuda_device_count
from mpsd.backends.engine import DEFAULT_IDLE_GRACE
from mpsd.backends.factory import (DEFAULT_DEVICE, DEVICE_MODELS, POLICIES, DeviceDescription, accepted_options,
                                   check_policy)
from mpsd.daemon.channel import DEFAULT_SPIN, MAX_SPIN
from mpsd.daemon.mps_config import NamedServer, load_mps_config
from mpsd.runtime.dispatch import DEFAULT_IN_FLIGHT
from mpsd.runtime.dispatch_policies import kernel_policy
from mpsd.runtime.limits import LIMIT_SETTINGS, ClientLimits
from mpsd_protocol import log_directory, parse_integer, parse_mem_limits, parse_size, pipe_directory

CONTAINMENT = ("device", "client")
IPC_ACCESS = ("uid", "group", "any")
PEER_ACCESS = ("all", "none")
CLOCKS = ("wall", "virtual")
DISPATCH = ("block", "kernel")
HANDSHAKE_TIMEOUT = 10.0  # wall seconds a connection has to say hello (the client waits as long for the reply)


class ConfigError(Exception):
    """A setting is wrong; the message says which and why."""


@dataclass(frozen=True)
class Config:
    pipe_dir: Path
    log_dir: Path
    default_log_dir: bool = False  # MPS's /var/log/nvidia-mps, left for the pipe directory if it cannot be written
    devices: tuple[DeviceDescription, ...] = (DEFAULT_DEVICE,)
    policy: str = "mps"
    time_scale: float = 1.0
    clock: str = "wall"  # "virtual": simulated time moves only as the clients' simulated host clocks allow
    host_time: float | None = None  # virtual clock: None, a client's own code costs nothing; else the factor
    idle_grace: float = DEFAULT_IDLE_GRACE  # virtual clock: wall seconds before a silent client counts as idle
    spin: float = DEFAULT_SPIN  # seconds a session keeps reading its emptied socket before it parks (channel.Spin)
    # Every client is a process of its own even though they share one pid (no option: mpsd-stress --virtual-time
    # plays every tenant in its own process, beside the daemon).
    shared_process: bool = False
    active_thread_percentage: float = 100.0
    pinned_mem_limits: dict[int, int] = field(default_factory=dict)  # device -> bytes; -1: every device
    client_priority: int = 0
    fault_containment: str = "device"
    ipc_access: str = "uid"
    # Whether a client on one device may map another device's memory (an IPC handle opened across devices):
    # "all" as the GPUs of an HGX H200 board over NVLink, "none" as GPUs without peer access.
    peer_access: str = "all"
    multiuser: bool = False  # one server for every user, instead of one user's server at a time
    mps_names: bool = False  # the process shows as nvidia-cuda-mps-control
    static_partitioning: bool = False  # MPS's -S: sm_partition add|rm, lspart, CUDA_MPS_SM_PARTITION
    control_log_stdout: bool = False  # control.log's lines also on stdout, as MPS's -f prints them
    # MPS's control protocol: 2, the legacy shell (the default), or 3, which adds MPS v3's module-verb
    # commands (mpsd.daemon.control_v3); CUDA_MPS_PROTOCOL_VERSION wins over --protocol, as NVIDIA documents.
    protocol: int = 2
    apply: Path | None = None  # MPS v3's configuration file (-a/--apply), applied once at start
    servers: tuple[NamedServer, ...] = ()  # its named servers (mpsd.daemon.mps_config)
    max_clients: int = 48  # per device, as Volta+ MPS (CUDA 13.0, measured driver)
    handshake_timeout: float = HANDSHAKE_TIMEOUT  # seconds from connecting to hello, after which it is closed
    shutdown_retry: float = 0.2  # seconds before a refused shutdown is tried again (then doubling), as MPS's
    host_memory: int | None = None  # host RAM simulated device memory may take; None: half the host's
    policy_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"timeslice": 0.001}
    trace: Path | None = None  # record the device timeline; written there at exit
    # Per-device policy and options from [mpsd.device.N] sections; devices without one use policy and policy_options.
    device_policies: dict[int, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    # Where the policy acts: "block", in the simulator's block scheduler (simulated devices), or "kernel", in the
    # daemon's dispatcher in front of the device (mpsd.runtime.dispatch; a real GPU's only choice).
    dispatch: str = "block"
    kernels_in_flight: int = DEFAULT_IN_FLIGHT  # kernel dispatch: a client's kernels on the device at once
    dispatch_reaction: float = 0.0  # kernel dispatch on a simulated device: the daemon's modelled reaction (s)
    client_limits: ClientLimits = ClientLimits()  # what one client may make the daemon hold (mpsd.runtime.limits)
    # Where Prometheus scrapes the daemon (mpsd.daemon.metrics): (host, port), or None (off, the default). A host
    # that is not a loopback address is taken only with metrics_remote (--metrics-allow-remote): the series name
    # every client's pid and uid, which other hosts need not see unless the operator says so twice.
    metrics: tuple[str, int] | None = None
    metrics_remote: bool = False
    # The directories clients may load modules (kernels of their own: mpsd.modules) from, in search order: a
    # module's code runs in the daemon, so only where the operator says (none: the built-in kernels only).
    module_path: tuple[Path, ...] = ()

    @property
    def kernel_dispatch(self) -> bool:
        """Whether a dispatcher runs in front of the devices (`mps` is pass-through: it needs none)."""
        return self.dispatch == "kernel" and self.policy != "mps"

    @property
    def socket_path(self) -> Path:
        return self.pipe_dir / "mpsd.sock"

    def trace_path(self, device: int) -> Path | None:
        """Device 0's trace goes to the file named; device N's beside it, as NAME.devN.json."""
        if self.trace is None or device == 0:
            return self.trace
        return self.trace.with_name(f"{self.trace.stem}.dev{device}{self.trace.suffix or '.json'}")

    def pinned_mem_limit(self, device: int) -> int | None:
        return self.pinned_mem_limits.get(device, self.pinned_mem_limits.get(-1))

    def device_policy(self, device: int) -> tuple[str, dict[str, Any]]:
        """The scheduling policy of `device` and its options: its own section's, else the defaults."""
        return self.device_policies.get(device, (self.policy, self.policy_options))


def _index(text: str) -> int | None:
    """A device count or index written in ASCII digits (str.isdigit() would take "²", which int() refuses)."""
    try:
        return parse_integer(text)
    except ValueError:
        return None


def parse_devices(text: str) -> tuple[DeviceDescription, ...]:
    """``h200:2`` (two simulated H200s), ``h200``, ``h200,h200``; ``cuda:0`` or ``cuda:0,cuda:1`` (real GPUs by
    driver ordinal); ``auto`` (every real GPU there is, else one simulated H200)."""
    if text.strip().lower() == "auto":
        found = cuda_device_count()
        return tuple(CudaDevice(i) for i in range(found)) if found else (DEFAULT_DEVICE,)
    devices: list[DeviceDescription] = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        model, _, count = part.partition(":")
        if model == "cuda":
            ordinal = _index(count)
            if ordinal is None:
                raise ConfigError(f"bad GPU ordinal {count!r} in {text!r} (cuda:0, cuda:1, ...)")
            devices.append(CudaDevice(ordinal))
            continue
        if model not in DEVICE_MODELS:
            raise ConfigError(f"unknown device model {model!r} (known: {', '.join(DEVICE_MODELS)}, cuda:N, auto)")
        number = _index(count) if count else 1
        if not (number is not None and 1 <= number <= 64):
            raise ConfigError(f"bad device count {count!r} in {text!r}")
        devices.extend([DEVICE_MODELS[model]] * number)
    if not devices:
        raise ConfigError("no devices")
    return tuple(devices)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpsd", description="An emulated MPS server: shares simulated GPUs among client processes.",
        epilog="Per-device policies go in the --config file: a [mpsd.device.N] table (N the device index) "
               "may set policy, timeslice, context-switch, aging and mig-partitions for that device. The "
               "policy options given here (or under [mpsd]) are the defaults for every device; a device "
               "inherits those its policy accepts.")
    parser.add_argument("--config", type=Path, help="TOML file with the same settings (options win)")
    parser.add_argument("--pipe-dir", help="directory for the sockets (default $CUDA_MPS_PIPE_DIRECTORY, or its alias "
                                           "$MPSD_PIPE_DIRECTORY, or /tmp/nvidia-mps as MPS)")
    parser.add_argument("--log-dir", help="directory for control.log and server.log "
                                          "(default $CUDA_MPS_LOG_DIRECTORY or its alias $MPSD_LOG_DIRECTORY; else "
                                          "the pipe directory when one was named, else /var/log/nvidia-mps as MPS)")
    parser.add_argument("--devices", help="GPUs: simulated (h200, h200:2; the default is one h200), real "
                                          "(cuda:0, cuda:0,cuda:1), or auto (the real ones if any, else h200)")
    parser.add_argument("--policy", help=f"scheduling policy: {', '.join(POLICIES)}, or a policy written in Python "
                                         "(mpsd.sim.Policy) named module:Class (default mps)")
    parser.add_argument("--dispatch", choices=DISPATCH,
                        help="where the policy acts: block (default on simulated devices: the simulator's block "
                             "scheduler) or kernel (the daemon releases each client's kernels to the device by "
                             "the policy; the only choice on a real GPU, where any policy but mps implies it)")
    parser.add_argument("--kernels-in-flight", type=int, metavar="N",
                        help=f"kernel dispatch: most kernels of one client on the device at once "
                             f"(default {DEFAULT_IN_FLIGHT})")
    parser.add_argument("--dispatch-reaction", type=float, metavar="SECONDS",
                        help="kernel dispatch on simulated devices: the time the daemon takes on a real GPU from a "
                             "kernel's end to the launch it decides on then, added to such launches (default 0, an "
                             "ideal daemon; 0.0001 is mpsd's on an H200), so that the model predicts the GPU")
    parser.add_argument("--timeslice", type=float, metavar="SECONDS",
                        help="timeslice policy: length of a slice (default 0.0020854, measured on an H200 without MPS; "
                             "shorter by up to 38 us for contexts that hold many warps)")
    parser.add_argument("--context-switch", type=float, metavar="SECONDS",
                        help="timeslice policy: cost of a context switch (default 0.0001643, measured likewise; "
                             "up to 69 us more for contexts that hold many warps)")
    parser.add_argument("--aging", type=float, metavar="SECONDS",
                        help="priority policy: wait after which a low-priority kernel is served first")
    parser.add_argument("--look-ahead", choices=("on", "off", "True", "False"), metavar="on|off",
                        help="priority policy with --dispatch kernel on a real GPU: less urgent work that fills the "
                             "device goes to the GPU ahead, behind a gate the daemon closes while urgent work is "
                             "there (off by default: experimental, see the README)")
    parser.add_argument("--mig-partitions", metavar="PROFILES",
                        help="mig policy: GPU instances, e.g. 3g.71gb,2g.35gb,1g.18gb (default two 3g.71gb)")
    parser.add_argument("--clock", choices=CLOCKS,
                        help="wall (default): simulated time follows the wall clock x --time-scale; virtual: it "
                             "moves only as the clients' simulated host clocks allow, so what they measure is "
                             "what an H200 would give, whatever the host's speed")
    parser.add_argument("--time-scale", type=float, help="wall clock: simulated seconds per wall second (default 1.0)")
    parser.add_argument("--host-time", metavar="free|measured[:FACTOR]",
                        help="virtual clock: what a client's own code between calls costs in simulated time: "
                             "nothing (free, the default), or the thread CPU time it measured, times FACTOR")
    parser.add_argument("--idle-grace", type=float, metavar="SECONDS",
                        help="virtual clock: wall seconds a client may compute without calling before the "
                             f"others go on without it (default {DEFAULT_IDLE_GRACE})")
    parser.add_argument("--spin", type=float, metavar="SECONDS",
                        help="how long a session keeps reading its client's socket once it is empty before it "
                             "waits, while the daemon has no more clients than cores, as the CUDA runtime spins "
                             f"on a result rather than yield (default {DEFAULT_SPIN * 1e6:g} us; at most "
                             f"{MAX_SPIN * 1e3:g} ms; 0: never)")
    parser.add_argument("--active-thread-percentage", type=float,
                        help="default CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for clients (default 100)")
    parser.add_argument("--pinned-mem-limit", help="default pinned device memory limit, e.g. 4G or 0=4G,1=2G")
    parser.add_argument("--client-priority", type=int, choices=(0, 1), help="default client priority")
    parser.add_argument("--fault-containment", choices=CONTAINMENT,
                        help="who gets a fatal GPU error: every client on the device (default) or the culprit")
    parser.add_argument("--multiuser", action="store_true", default=None,
                        help="one server serves every user (otherwise other users' clients wait their turn)")
    parser.add_argument("--max-clients", type=int, help="clients per device (default 48, as Volta+ MPS)")
    parser.add_argument("--mps-names", action="store_true", default=None,
                        help="show the process as nvidia-cuda-mps-control, as MPS's does, for scripts that look for it "
                             "by name (pgrep, pidof); the nvidia-cuda-mps-control command sets it")
    parser.add_argument("-S", "--static-partitioning", action="store_true", default=None,
                        help="static SM partitioning, as MPS's -S: partitions of 8-SM chunks (sm_partition add, "
                             "lspart) that clients pick with CUDA_MPS_SM_PARTITION (simulated devices, mps policy)")
    parser.add_argument("--handshake-timeout", type=float, metavar="SECONDS",
                        help=f"wall seconds a connection may take to say hello before it is closed "
                             f"(default {HANDSHAKE_TIMEOUT:g})")
    parser.add_argument("--control-log-stdout", action="store_true", default=None,
                        help="print control.log's lines on stdout too, as nvidia-cuda-mps-control -f does "
                             "(mpsd-control -f sets it), instead of the line that says the daemon is ready")
    parser.add_argument("--protocol", choices=("2", "3"),
                        help="MPS control protocol: 2, legacy (default), or 3, MPS v3's module-verb commands; "
                             "$CUDA_MPS_PROTOCOL_VERSION wins over it")
    parser.add_argument("--apply", metavar="FILE",
                        help="MPS v3's TOML configuration of named servers, applied once at start (needs protocol 3)")
    parser.add_argument("--shutdown-retry", type=float, metavar="SECONDS",
                        help="seconds after which a shutdown its clients held up is tried again, doubling each time "
                             "(default 0.2, as MPS)")
    parser.add_argument("--host-memory", metavar="SIZE|PERCENT",
                        help="host RAM the simulated device memory may take, e.g. 16G or 25%% of this host's "
                             "(default 50%%); touching more fails with cudaErrorMemoryAllocation")
    parser.add_argument("--trace", metavar="FILE",
                        help="record every device's timeline and write it at exit as Chrome/Perfetto trace JSON "
                             "(opens in ui.perfetto.dev)")
    parser.add_argument("--ipc-access", choices=IPC_ACCESS,
                        help="who may open an IPC handle: the exporter's uid (default, as CUDA), its group, anyone")
    parser.add_argument("--peer-access", choices=PEER_ACCESS,
                        help="simulated devices: all (default) map each other's memory, as NVLink peers; none "
                             "(an IPC handle opened on another device is cudaErrorPeerAccessUnsupported)")
    parser.add_argument("--metrics", metavar="HOST:PORT",
                        help="serve Prometheus metrics over HTTP there (off by default): DCGM-exporter's series per "
                             "device and mpsd_* series per client; a bare PORT is 127.0.0.1:PORT, port 0 picks a free "
                             "one (server.log says which); a host that is not loopback needs --metrics-allow-remote")
    parser.add_argument("--module-path", action="append", metavar="DIR",
                        help="a directory clients may load modules (kernels of their own) from; repeatable, "
                             "searched in order (the file's module-path: a list)")
    parser.add_argument("--metrics-allow-remote", action="store_true", default=None,
                        help="let --metrics listen on an address other hosts can reach (0.0.0.0, a LAN address): "
                             "its series show every client's pid and uid; server.log says it listens so")
    _add_limits(parser)
    return parser


def parse_metrics_address(text: str, allow_remote: bool) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or a bare ``PORT`` (on 127.0.0.1) for --metrics, as (host, port).

    The rule: a literal loopback address (127.0.0.0/8, ::1) or ``localhost`` is taken as it is; any other host,
    a name included (it may resolve to anything), only with `allow_remote`, the operator's explicit word.

    Raises:
        ConfigError: it is malformed, or names a host that is not loopback without `allow_remote`.
    """
    text = str(text).strip()
    host, colon, port_text = text.rpartition(":")
    if not colon:
        host, port_text = "127.0.0.1", text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = _index(port_text)
    if not host or port is None or port > 65535:
        raise ConfigError(f"--metrics must be HOST:PORT, [IPV6]:PORT or PORT (0 to 65535), not {text[:64]!r}")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_remote:
        raise ConfigError(f"--metrics {text[:64]}: {host} is not a loopback address; the metrics name every "
                          "client's pid and uid, so listening where other hosts can reach them needs "
                          "--metrics-allow-remote as well")
    return host, port


def _add_limits(parser: argparse.ArgumentParser) -> None:
    """The per-client limits (mpsd.runtime.limits), one group of options."""
    defaults = ClientLimits()
    group = parser.add_argument_group(
        "limits per client", "the most of each kind of object one client may make the daemon hold; a call past a "
                             "limit fails with cudaErrorMemoryAllocation")
    for name, option, _, text in LIMIT_SETTINGS:
        group.add_argument(option, type=int, metavar="N",  # [mpsd]'s key: the option's name
                           help=f"{text} (default {getattr(defaults, name):,})")


def _limits(pick: Any) -> ClientLimits:
    """The per-client limits from their options or [mpsd] keys, each a whole number (at least 1; the fd reserve
    may be 0).

    Raises:
        ConfigError: one is not.
    """
    values: dict[str, int] = {}
    defaults = ClientLimits()
    for name, option, _, _ in LIMIT_SETTINGS:
        value = pick(option[2:].replace("-", "_"), getattr(defaults, name))
        least = 0 if name == "fd_reserve" else 1
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= 1 << 31:
            raise ConfigError(f"{option} must be a whole number from {least} to {1 << 31}, not {str(value)[:24]!r}")
        values[name] = value
    return ClientLimits(**values)


def load_config(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> Config:
    """Build the Config from options, the TOML file and the environment.

    Raises:
        ConfigError: a setting is invalid.
        SystemExit: bad command-line syntax (argparse prints the usage).
    """
    environ = dict(os.environ if environ is None else environ)
    options = build_parser().parse_args(argv)
    file_settings: dict[str, Any] = {}
    if options.config is not None:
        try:
            document = tomllib.loads(options.config.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read {options.config}: {exc}") from None
        file_settings = _file_settings(document, options.config)

    def pick(name: str, default: Any = None) -> Any:
        value = getattr(options, name)
        return value if value is not None else file_settings.get(name.replace("_", "-"), default)

    pipe_dir = pipe_directory(pick("pipe_dir"), environ)
    log_dir, default_log = log_directory(pick("log_dir"), pipe_dir, environ)
    time_scale = float(pick("time_scale", 1.0))
    if not 0 < time_scale < float("inf"):
        raise ConfigError(f"--time-scale must be positive, not {time_scale}")
    clock = pick("clock", "wall")
    if clock not in CLOCKS:
        raise ConfigError(f"--clock must be one of {', '.join(CLOCKS)}, not {clock!r}")
    host_time = _host_time(str(pick("host_time", "free")))
    idle_grace = float(pick("idle_grace", DEFAULT_IDLE_GRACE))
    if not 0 < idle_grace < float("inf"):
        raise ConfigError(f"--idle-grace must be a positive number of seconds, not {idle_grace}")
    spin = float(pick("spin", DEFAULT_SPIN))
    if not 0 <= spin <= MAX_SPIN:
        raise ConfigError(f"--spin must be 0 to {MAX_SPIN} seconds, not {spin}")
    # As real MPS takes them from its control daemon's environment: the defaults for its servers' clients (an
    # option or the file, where given, wins).
    atp_variable, limit_variable = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
    given = pick("active_thread_percentage")
    try:
        percentage = float(given if given is not None else environ.get(atp_variable, 100.0))
    except ValueError:
        raise ConfigError(f"{atp_variable} in the daemon's environment must be a number, not "
                          f"{environ[atp_variable][:40]!r}") from None
    if not 0 < percentage <= 100:
        where = "--active-thread-percentage" if given is not None else atp_variable
        raise ConfigError(f"{where} must be in (0, 100], not {percentage}")
    limits_text = pick("pinned_mem_limit")
    where = "--pinned-mem-limit"
    if limits_text is None and environ.get(limit_variable):
        limits_text, where = environ[limit_variable], limit_variable
    try:
        limits = parse_mem_limits(str(limits_text)) if limits_text else {}
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    policy = pick("policy", "mps")
    containment = pick("fault_containment", "device")
    if policy not in POLICIES and ":" not in str(policy):
        raise ConfigError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)}, or module:Class)")
    if containment not in CONTAINMENT:
        raise ConfigError(f"fault containment must be one of {', '.join(CONTAINMENT)}")
    ipc_access = pick("ipc_access", "uid")
    if ipc_access not in IPC_ACCESS:
        raise ConfigError(f"IPC access must be one of {', '.join(IPC_ACCESS)}")
    peer_access = pick("peer_access", "all")
    if peer_access not in PEER_ACCESS:
        raise ConfigError(f"peer access must be one of {', '.join(PEER_ACCESS)}")
    policy_options: dict[str, Any] = {}
    for name, key in (("timeslice", "timeslice"), ("context_switch", "switch"), ("aging", "aging")):
        value = pick(name)
        if value is not None:
            if not float(value) >= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be a non-negative number of seconds")
            policy_options[key] = float(value)
    look_ahead = pick("look_ahead")
    if look_ahead is not None:
        policy_options["ahead"] = str(look_ahead) in ("on", "True", "true")
    partitions = pick("mig_partitions")
    if partitions:
        policy_options["partitions"] = _partitions(partitions)
    devices = parse_devices(pick("devices", "h200"))
    real = any(isinstance(d, CudaDevice) for d in devices)
    dispatch = pick("dispatch", "kernel" if real and policy != "mps" else "block")
    if dispatch not in DISPATCH:
        raise ConfigError(f"--dispatch must be one of {', '.join(DISPATCH)}, not {str(dispatch)[:24]!r}")
    in_flight = int(pick("kernels_in_flight", DEFAULT_IN_FLIGHT))
    if not 1 <= in_flight <= 1024:
        raise ConfigError(f"--kernels-in-flight must be between 1 and 1024, not {in_flight}")
    reaction = float(pick("dispatch_reaction", 0.0))
    if not 0 <= reaction <= 1:
        raise ConfigError(f"--dispatch-reaction must be between 0 and 1 second, not {reaction}")
    if reaction and (real or dispatch != "kernel"):
        raise ConfigError("--dispatch-reaction models the daemon's reaction for --dispatch kernel on simulated "
                          "devices (on a real GPU the daemon takes it by itself)")
    if real and (dispatch == "block" and policy != "mps" or clock == "virtual" or file_settings.get("device")):
        raise ConfigError("a real GPU (cuda:N) places blocks as its hardware does, on the wall clock: a policy acts "
                          "there by kernel (--dispatch kernel), and [mpsd.device.N] and --clock virtual need "
                          "simulated devices")
    if dispatch == "kernel":
        if file_settings.get("device"):
            raise ConfigError("[mpsd.device.N] sections set block-level policies: not with --dispatch kernel")
        if policy != "mps":
            try:  # the dispatcher's policies judge their own settings, as the simulator's do below
                kernel_policy(policy, policy_options)
            except ValueError as exc:
                raise ConfigError(f"--policy {policy} with --dispatch kernel: {exc}") from None
    else:
        try:  # the simulator judges its own settings; asking it now turns a mistake into a usage error
            check_policy(devices[0], policy, policy_options)
        except ValueError as exc:
            raise ConfigError(f"--policy {policy}: {exc}") from None
    device_policies = _device_policies(file_settings.get("device", {}), devices, policy, policy_options)
    max_clients = int(pick("max_clients", 48))
    if not 1 <= max_clients <= 4096:
        raise ConfigError(f"--max-clients must be between 1 and 4096, not {max_clients}")
    handshake_timeout = float(pick("handshake_timeout", HANDSHAKE_TIMEOUT))
    if not 0 < handshake_timeout < float("inf"):
        raise ConfigError(f"--handshake-timeout must be a positive number of seconds, not {handshake_timeout}")
    shutdown_retry = float(pick("shutdown_retry", 0.2))
    if not 0 < shutdown_retry < float("inf"):
        raise ConfigError(f"--shutdown-retry must be a positive number of seconds, not {shutdown_retry}")
    host_memory = _host_memory(pick("host_memory"))
    priority = int(pick("client_priority", 0))
    if priority not in (0, 1):
        raise ConfigError("client priority must be 0 or 1")
    protocol = environ.get("CUDA_MPS_PROTOCOL_VERSION") or pick("protocol", "2")
    if str(protocol) not in ("2", "3"):
        raise ConfigError(f"the MPS control protocol must be 2 or 3, not {str(protocol)[:24]!r}")
    apply = Path(pick("apply")) if pick("apply") else None
    metrics_remote = bool(pick("metrics_allow_remote", False))
    metrics = pick("metrics")
    metrics_address = parse_metrics_address(metrics, metrics_remote) if metrics is not None else None
    servers: tuple[NamedServer, ...] = ()
    if apply is not None:
        if str(protocol) != "3":
            raise ConfigError("--apply (MPS v3's configuration file) needs protocol 3")
        try:
            servers = load_mps_config(apply)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return Config(pipe_dir=pipe_dir, protocol=int(protocol), apply=apply, servers=servers, log_dir=log_dir,
                  default_log_dir=default_log, devices=devices,
                  policy=policy, time_scale=time_scale, clock=clock, host_time=host_time, idle_grace=idle_grace,
                  spin=spin,
                  active_thread_percentage=percentage,
                  pinned_mem_limits=limits, client_priority=priority, fault_containment=containment,
                  ipc_access=ipc_access, peer_access=peer_access, max_clients=max_clients,
                  handshake_timeout=handshake_timeout, shutdown_retry=shutdown_retry, host_memory=host_memory,
                  policy_options=policy_options,
                  multiuser=bool(pick("multiuser", False)), mps_names=bool(pick("mps_names", False)),
                  static_partitioning=bool(pick("static_partitioning", False)),
                  control_log_stdout=bool(pick("control_log_stdout", False)),
                  device_policies=device_policies, dispatch=dispatch, kernels_in_flight=in_flight,
                  dispatch_reaction=reaction,
                  client_limits=_limits(pick), metrics=metrics_address, metrics_remote=metrics_remote,
                  trace=Path(trace) if (trace := pick("trace")) else None,
                  module_path=_module_path(pick("module_path")))


def _module_path(value: Any) -> tuple[Path, ...]:
    """``--module-path`` (a list of directories, from the options or the file), each one that exists.

    Raises:
        ConfigError: not a list of strings, or a directory that is not one.
    """
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"module-path must be a list of directories, not {value!r:.60}")
    found = []
    for text in value:
        path = Path(text).expanduser()
        if not path.is_dir():
            raise ConfigError(f"--module-path {text!r}: no such directory")
        found.append(path.resolve())
    return tuple(found)


def _file_settings(document: dict[str, Any], path: Path) -> dict[str, Any]:
    """The [mpsd] table of a --config file, every key of it one the daemon knows.

    Raises:
        ConfigError: another top-level table or key, or an unknown setting (a typo must not run on defaults).
    """
    extra = sorted(set(document) - {"mpsd"})
    if extra:
        raise ConfigError(f"{path}: unknown table or key {', '.join(extra)} (the daemon reads [mpsd])")
    settings = document.get("mpsd", {})
    if not isinstance(settings, dict):
        raise ConfigError(f"{path}: mpsd must be a table")
    known = {action.dest.replace("_", "-") for action in build_parser()._actions
             if action.dest not in ("help", "config")} | {"device"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(f"{path}: [mpsd]: unknown setting(s) {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(known))})")
    return settings


def _host_memory(value: Any) -> int | None:
    """``--host-memory``: a size (``16G``) or a share of the host's RAM (``25%``); None when not given."""
    if value is None:
        return None
    text = str(value).strip()
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if not 0 < share <= 100:
                raise ValueError
            return int(psutil.virtual_memory().total * share / 100)
        size = parse_size(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise ConfigError(f"--host-memory must be a size such as 16G or a share such as 25%, not {text!r}")
    return size


def _host_time(text: str) -> float | None:
    """``free`` (None), ``measured`` (1.0) or ``measured:FACTOR``."""
    kind, _, factor = text.partition(":")
    if kind == "free" and not factor:
        return None
    if kind == "measured":
        try:
            value = float(factor) if factor else 1.0
        except ValueError:
            value = math.nan
        if 0 <= value < math.inf:
            return value
    raise ConfigError(f"--host-time must be free, measured or measured:FACTOR (a factor >= 0), not {text!r}")


# What a [mpsd.device.N] table may hold: its key -> the simulator's option name (None: the policy itself).
DEVICE_KEYS = {"policy": None, "timeslice": "timeslice", "context-switch": "switch", "aging": "aging",
               "mig-partitions": "partitions"}


def _partitions(value: Any) -> list[str]:
    """MIG profiles from ``"3g.71gb,2g.35gb"`` or a TOML list of them."""
    parts = value if isinstance(value, list) else str(value).split(",")
    return [str(p).strip() for p in parts if str(p).strip()]


def _device_policies(tables: Any, devices: tuple[DeviceDescription, ...], policy: str,
                     options: dict[str, Any]) -> dict[int, tuple[str, dict[str, Any]]]:
    """Each [mpsd.device.N] table as (policy, options). A device keeps the default policy unless its table
    names another, and inherits the default options its policy accepts; its own options come on top.

    Raises:
        ConfigError: a table names a device that does not exist, holds an unknown key, or a setting the
            simulator refuses.
    """
    if not isinstance(tables, dict):
        raise ConfigError("[mpsd.device] must hold one table per device index, e.g. [mpsd.device.1]")
    out: dict[int, tuple[str, dict[str, Any]]] = {}
    for key, table in tables.items():
        where = f"[mpsd.device.{key}]"
        index = _index(key)
        if index is None or index >= len(devices) or not isinstance(table, dict):
            raise ConfigError(f"{where}: there is no device {key} (devices 0 to {len(devices) - 1})")
        unknown = sorted(set(table) - set(DEVICE_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)} "
                              f"(known: {', '.join(DEVICE_KEYS)})")
        name = table.get("policy", policy)
        if name not in POLICIES and ":" not in str(name):
            raise ConfigError(f"{where}: unknown policy {name!r} (known: {', '.join(POLICIES)}, or module:Class)")
        accepted = accepted_options(name)
        merged = {k: v for k, v in options.items() if k in accepted}
        for setting, option in DEVICE_KEYS.items():
            if option is None or setting not in table:
                continue
            value = table[setting]
            if option == "partitions":
                merged[option] = _partitions(value)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{where}: {setting} must be a non-negative number of seconds")
            else:
                merged[option] = float(value)
        try:
            check_policy(devices[index], name, merged)
        except ValueError as exc:
            raise ConfigError(f"{where}: policy {name}: {exc}") from None
        out[index] = (name, merged)
    return out
