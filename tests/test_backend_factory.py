"""The backend factory: a device description in, a backend out, and the settings judged as the backend will."""

from __future__ import annotations

import pytest

from mpsd.backends.cuda import CudaDevice
from mpsd.backends.factory import (DEFAULT_DEVICE, DEVICE_MODELS, POLICIES, GpuUnavailableError, accepted_options,
                                   check_policy, open_backend)
from mpsd.backends.sim import SimBackend


def test_a_model_gives_the_simulator_with_its_settings():
    """A simulated model's description opens a SimBackend of that model, on the clock and policy asked for."""
    backend = open_backend(DEVICE_MODELS["h200"], policy="timeslice", policy_options={"timeslice": 0.001},
                           clock="virtual")
    assert isinstance(backend, SimBackend)
    assert (backend.spec, backend.policy, backend.virtual is backend.engine) == (DEFAULT_DEVICE, "timeslice", True)
    assert backend.engine.device_clock is backend.device_clock  # one clock, the engine's and the backend's


def test_a_gpu_that_cannot_be_opened_is_one_error_naming_it():
    """No driver, no cuda-python or no such ordinal: the factory's own error, saying which GPU."""
    with pytest.raises(GpuUnavailableError, match=r"cannot open GPU cuda:4096: "):
        open_backend(CudaDevice(4096))


def test_settings_are_judged_as_the_simulator_judges_them():
    """A policy's options are those the simulator takes; a real GPU's settings are judged by the H200's model."""
    assert "mps" in POLICIES and "timeslice" in accepted_options("timeslice")
    assert accepted_options("my.module:Policy") == frozenset()
    check_policy(CudaDevice(0), "timeslice", {"timeslice": 0.001})
    with pytest.raises(ValueError, match="bogus"):
        check_policy(DEFAULT_DEVICE, "timeslice", {"bogus": 1.0})
