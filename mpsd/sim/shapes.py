# Launch shapes: what one block of a launch takes from an SM, and the small integer the engine names that
# block shape by. Every submitted kernel asks, and a daemon's launches repeat a handful of shapes, so the
# answers are cached here; the engine's ready keys are built from these shape numbers (cheaper to hash than a
# BlockNeed).
"""Block shapes of launches, cached."""

from __future__ import annotations

from typing import NamedTuple

from .specs import BlockNeed, DeviceSpec, block_need, occupancy

__all__ = ["LaunchShape", "Shapes"]


class LaunchShape(NamedTuple):
    """What the engine needs to know about a launch's block shape.

    Attributes:
        shape: small integer naming ``need`` (equal needs, equal numbers).
        need: resources one block takes.
        demand: share of an SM's issue rate one block asks for (shared kernels).
        sm_share: share of an SM's threads one block holds (SM-time statistics).
    """

    shape: int
    need: BlockNeed
    demand: float
    sm_share: float


class Shapes:
    """The block shapes seen so far on one device.

    Args:
        spec: the device.
    """

    def __init__(self, spec: DeviceSpec) -> None:
        self._spec = spec
        self._needs: dict[tuple[int, int, int], BlockNeed | None] = {}
        self._numbers: dict[BlockNeed, int] = {}  # every block shape seen -> a small integer naming it
        self.launches: dict[tuple[int, int, int], LaunchShape] = {}  # (threads, regs, smem) -> its shape

    def launch(self, threads: int, regs_per_thread: int, smem: int) -> LaunchShape:
        """The shape of a launch (look in ``launches`` first: this is the slow path that fills it).

        Raises:
            ValueError: a block of this shape cannot fit on an SM.
        """
        need = self.block_need(threads, regs_per_thread, smem)
        if need is None:
            raise ValueError(
                f"a block of {threads} threads, {regs_per_thread} registers/thread and "
                f"{smem} bytes of shared memory cannot fit on an SM"
            )
        shape = self._numbers.get(need)
        if shape is None:
            shape = self._numbers[need] = len(self._numbers)
        spec = self._spec
        launch = LaunchShape(shape, need, min(1.0, threads / spec.saturation_threads),
                             min(1.0, threads / spec.max_threads_per_sm))
        self.launches[threads, regs_per_thread, smem] = launch
        return launch

    def block_need(self, threads: int, regs_per_thread: int = 32, smem: int = 0) -> BlockNeed | None:
        """What one block of this shape takes from an SM, or None if one cannot fit (cached)."""
        key = (threads, regs_per_thread, smem)
        if key not in self._needs:
            fits = occupancy(self._spec, threads, regs_per_thread, smem) >= 1
            self._needs[key] = block_need(self._spec, threads, regs_per_thread, smem) if fits else None
        return self._needs[key]
