# What the policies share on the Python side: the per-client configuration and the base class of the built-in
# policies, which checks their options and names them. What a policy does at a dispatch is compiled with the
# engine (simcore/src/policy.rs, shares.rs, tenancy.rs); a policy written in Python is a Policy (custom.py).
"""Per-client configuration and the built-in policies' base class."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..specs import DeviceSpec

if TYPE_CHECKING:
    from ..simulator import Simulator

__all__ = ["DEFAULT_CLIENT", "BuiltinPolicy", "ClientConfig"]


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """How a policy treats one client (``Simulator.configure_client``).

    Attributes:
        priority: client priority, lower is more urgent: 0 normal, 1 below normal (CUDA_MPS_CLIENT_PRIORITY),
            any other integer for finer daemon-side levels.
        weight: share of SM-time under ``fair`` (> 0).
        partition: MIG partition under ``mig``: an index into the layout, its decimal string, or a profile
            name (the first partition of that profile); None for partition 0.
        sms: a static SM partition under ``mps`` (MPS's -S): (first SM, SM count); None for any SM.
    """

    priority: int = 0
    weight: float = 1.0
    partition: str | int | None = None
    sms: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")  # noqa: TRY004
        if not (isinstance(self.weight, (int, float)) and 0.0 < self.weight < math.inf):
            raise ValueError(f"weight must be a positive finite number, got {self.weight!r}")
        if self.partition is not None and (isinstance(self.partition, bool)
                                           or not isinstance(self.partition, (int, str))):
            raise ValueError(f"partition must be an index, a profile name or None, got {self.partition!r}")
        if self.sms is not None and not (isinstance(self.sms, tuple) and len(self.sms) == 2
                                         and all(type(n) is int and n >= 0 for n in self.sms) and self.sms[1] > 0):
            raise ValueError(f"sms must be (first SM, SM count), got {self.sms!r}")


DEFAULT_CLIENT = ClientConfig()


class BuiltinPolicy:
    """Base of the built-in policies' Python side: the name, the options and their check, and the check of a
    client's configuration. What each policy does at a dispatch is compiled (simcore/src: policy.rs, shares.rs,
    tenancy.rs); the class docstrings say what that is.

    Args:
        sim: the simulator this policy serves.
        options: policy-specific settings (see each policy); unknown keys are an error.

    Raises:
        ValueError: an unknown or invalid option.
    """

    name = "base"
    options: ClassVar[dict[str, Any]] = {}

    def __init__(self, sim: Simulator, options: dict[str, Any] | None = None) -> None:
        self.sim = sim
        self.spec: DeviceSpec = sim.spec
        given = dict(options or {})
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for policy {self.name!r}; known: {sorted(self.options)}")
        self.settings = {**self.options, **given}

    def configure(self, client: int, config: ClientConfig) -> None:
        """Check a client's configuration against this policy.

        Raises:
            ValueError: the configuration makes no sense here (a partition that does not exist).
        """

    def forget(self, client: int) -> None:
        """`client` is gone for good: drop whatever the policy keeps about it here."""

    def engine_args(self) -> object:
        """What the compiled policy needs of the checked settings (None: nothing)."""
        return None
