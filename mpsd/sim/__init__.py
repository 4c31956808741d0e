# The public surface of the GPU model; everything the daemon codes against is re-exported here and the
# modules behind it stay free to move. Pure: no I/O, no wall clock, no trio, no threads.
"""mpsd.sim: a deterministic model of a GPU shared under NVIDIA MPS."""

from .costs import COPY_KINDS, KERNEL_COSTS, BlockCost, copy_kernel, declared_cost, function_cost, kernel_cost
from .simulator import Simulator
from .ops import ENGINES, BlockGroup, Copy, Kernel, Marker, Op
from .policies import MIG_PROFILES, POLICIES, ClientConfig, MigPartition, Policy, ReadyKernel, mig_layout
from .specs import H200, BlockNeed, DeviceSpec, block_need, occupancy, sm_cap
from .stats import ClientStatistics, SimStatistics

__all__ = [
    "COPY_KINDS",
    "ENGINES",
    "H200",
    "KERNEL_COSTS",
    "MIG_PROFILES",
    "POLICIES",
    "BlockCost",
    "BlockGroup",
    "BlockNeed",
    "ClientConfig",
    "ClientStatistics",
    "Copy",
    "DeviceSpec",
    "Kernel",
    "Marker",
    "MigPartition",
    "Op",
    "Policy",
    "ReadyKernel",
    "SimStatistics",
    "Simulator",
    "block_need",
    "copy_kernel",
    "declared_cost",
    "function_cost",
    "kernel_cost",
    "mig_layout",
    "occupancy",
    "sm_cap",
]
