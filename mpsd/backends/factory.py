# Where the daemon gets its backends, as trio picks its IO manager in one place: a device description (a
# simulated model's DeviceSpec, or a real GPU's CudaDevice) goes in, a Backend comes out. What the daemon's
# settings are judged by before it starts, the device models by name and the simulator's policies with the
# options each accepts, comes from here too, so that the daemon (mpsd.daemon) never imports the simulator
# (mpsd.sim): tests/test_layers.py fails if it does.
"""Backends by device description, and the device models and policies a configuration may name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeAlias

from mpsd.backends.base import Backend
from mpsd.backends.cuda import CudaBackend, CudaDevice
from mpsd.backends.engine import DEFAULT_IDLE_GRACE
from mpsd.backends.hostmem import HostMemory
from mpsd.backends.sim import SimBackend
from mpsd.sim import H200, DeviceSpec, Simulator
from mpsd.sim import POLICIES as _SIM_POLICIES

__all__ = ["DEFAULT_DEVICE", "DEVICE_MODELS", "POLICIES", "DeviceDescription", "GpuUnavailableError",
           "accepted_options", "check_policy", "open_backend"]

# What a configuration names a device by: a model of the simulator's, or a real GPU by its ordinal.
DeviceDescription: TypeAlias = DeviceSpec | CudaDevice
DEVICE_MODELS: dict[str, DeviceSpec] = {"h200": H200}  # the simulated models, by the name --devices takes
DEFAULT_DEVICE: DeviceSpec = H200  # what a daemon runs when nothing else is said, and where there is no GPU
POLICIES: tuple[str, ...] = tuple(_SIM_POLICIES)  # the built-in policies, whatever the simulator offers


class GpuUnavailableError(Exception):
    """A real GPU cannot be opened; the message says which and why."""


def accepted_options(policy: str) -> frozenset[str]:
    """The options a built-in policy accepts (none for a policy written in Python, named module:Class)."""
    return frozenset(_SIM_POLICIES[policy].options) if policy in _SIM_POLICIES else frozenset()


def check_policy(device: DeviceDescription, policy: str, options: dict[str, Any] | None) -> None:
    """Judge a block-level policy's settings as the simulator would when it starts: against the device's own
    model, or for a real GPU the H200's.

    Raises:
        ValueError: an unknown policy, or an option it does not know or accept (the message says which).
    """
    Simulator(device if isinstance(device, DeviceSpec) else DEFAULT_DEVICE, policy=policy, policy_options=options)


def open_backend(device: DeviceDescription, *, policy: str = "mps", policy_options: dict[str, Any] | None = None,
                 clock: str = "wall", time_scale: float = 1.0, idle_grace: float = DEFAULT_IDLE_GRACE,
                 trace: Path | None = None, host_memory: HostMemory | None = None) -> Backend:
    """What runs `device`'s work: a real GPU through the CUDA driver, or the simulator.

    Args:
        device: the device's description.
        policy, policy_options, clock, time_scale, idle_grace, trace, host_memory: a simulated device's
            settings (mpsd.backends.sim.SimBackend); a real GPU places blocks as its hardware does, on the
            wall clock, and takes only `trace` of them.

    Returns:
        The backend, not started.

    Raises:
        GpuUnavailableError: the real GPU cannot be opened (no cuda-python, no driver, no such ordinal).
        ValueError: the simulator refuses the policy's settings.
    """
    if isinstance(device, CudaDevice):
        try:
            return CudaBackend(device.ordinal, trace=trace)
        except (ImportError, OSError, RuntimeError) as exc:  # cuda-python's and the driver's, made ours here
            raise GpuUnavailableError(f"cannot open GPU cuda:{device.ordinal}: {exc}") from None
    return SimBackend(device, policy=policy, policy_options=policy_options, clock=clock,
                      time_scale=time_scale, idle_grace=idle_grace, trace=trace, host_memory=host_memory)
