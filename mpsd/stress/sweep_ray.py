# `--executor ray`: a sweep's points as Ray tasks (pip install 'mpsd[ray]'), on the cluster at --address or, with
# none, whichever Ray finds (a local one it starts where there is none). Each task is run_point itself, which
# Ray ships by reference: the cluster's nodes need mpsd installed, and a workload's trace files at the same
# path. Ray is imported only here and only when asked for (it is large and optional), through importlib so
# that the type checker passes with or without it. Its errors are converted where they enter: a point's
# RunError or WorkloadError comes back wrapped in a RayTaskError and is handed on as itself (any other failure of
# a task as a RunError), so that the command says what it says for a local point.
"""The Ray executor of a sweep."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Iterator, Sequence

from mpsd.stress.runner import RunError
from mpsd.stress.sweep import run_point
from mpsd.stress.sweep_executors import Outcome, Task
from mpsd.stress.workload import WorkloadError

__all__ = ["RayExecutor", "import_ray"]


def import_ray() -> ModuleType:
    """Ray, imported.

    Raises:
        WorkloadError: Ray is not installed.
    """
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise WorkloadError("--executor ray needs Ray, which is not installed (pip install 'mpsd[ray]')") from None


class RayExecutor:
    """Points as Ray tasks, one CPU each, every task of a batch submitted at once and taken back as each ends."""

    def __init__(self, address: str | None) -> None:
        """Connect to the cluster at ``address`` (None: Ray's own choice), unless Ray is connected already.

        Raises:
            WorkloadError: Ray is not installed.
            RunError: no cluster Ray can join is there.
        """
        self._ray = import_ray()
        self._started = not self._ray.is_initialized()
        if self._started:
            try:
                self._ray.init(address=address, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:  # no cluster there, or not one Ray can join
                raise RunError(f"Ray: no cluster at {address or 'the address Ray looks for'}: {exc}") from None
        self._remote: Any = self._ray.remote(num_cpus=1)(run_point)

    def run(self, tasks: Sequence[Task]) -> Iterator[tuple[str, Outcome]]:
        ray = self._ray
        pending = {self._remote.remote(t.document, t.base, t.path): t.key for t in tasks}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    key = pending.pop(ref)
                    try:
                        outcome: Outcome = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        cause = getattr(exc, "cause", None)
                        outcome = cause if isinstance(cause, (RunError, WorkloadError)) else RunError(f"Ray: {exc}")
                    yield key, outcome
        finally:  # an error or Ctrl-C: the points not done yet are cancelled
            for ref in pending:
                ray.cancel(ref)

    def close(self) -> None:
        if self._started:  # a Ray this command connected to, or started, is left as the command found it
            self._ray.shutdown()
