# The registry of dispatch policies, by the names the daemon's --policy offers. One module per family:
# mps (the hardware), shares (block-by-block sharing among clients), tenancy (one client at a time), mig
# (static partitions); base holds what they all share; custom the interface of policies written in Python.
"""Dispatch policies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import DEFAULT_CLIENT, BuiltinPolicy, ClientConfig
from .custom import Policy, ReadyKernel, load_policy
from .mig import MIG_PROFILES, MigPartition, MigPolicy, mig_layout
from .mps import MpsPolicy
from .shares import FairPolicy, PriorityPolicy, RoundRobinPolicy
from .tenancy import ExclusivePolicy, TimeslicePolicy

if TYPE_CHECKING:
    from ..simulator import Simulator

__all__ = [
    "DEFAULT_CLIENT",
    "MIG_PROFILES",
    "POLICIES",
    "ClientConfig",
    "BuiltinPolicy",
    "MigPartition",
    "Policy",
    "ReadyKernel",
    "load_policy",
    "make_policy",
    "mig_layout",
]

POLICIES: dict[str, type[BuiltinPolicy]] = {
    p.name: p
    for p in (MpsPolicy, RoundRobinPolicy, PriorityPolicy, FairPolicy, ExclusivePolicy, MigPolicy, TimeslicePolicy)
}


def make_policy(name: str, sim: Simulator, options: dict[str, Any] | None = None) -> BuiltinPolicy:
    """Build the named policy for ``sim``.

    Raises:
        ValueError: unknown policy name, or options it does not accept.
    """
    try:
        cls = POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
    return cls(sim, options)
