# Where a sweep's points run, behind one small protocol (as httpcore's network backends): the sweep command hands
# an executor tasks (a point's key, workload document, base directory and path) and takes back (key, figures)
# as each point finishes, in whatever order, or (key, the error) for a point that failed, so that the command
# names the point whichever executor ran it. What is done with them (results files, progress, the table's
# order) is the command's, so every executor gives the same table, byte for byte: a point's figures depend on
# its workload document alone. An executor is opened once for the whole command and given batches: a capacity
# search (sweep_find.py) runs many small ones, and a pool of processes for each would cost its start-up each time.
#
# LocalExecutor: worker processes, spawned, not forked, so that none inherits a parent's trio or threads; a
# worker runs one point at a time (the in-process daemon is one per process) and is reused for the next. The
# pool starts with the first batch that has work, so that a rerun that finds every point done starts none.
# RayExecutor (sweep_ray.py): tasks on a Ray cluster.
"""The executors a sweep's points run on: local worker processes, or Ray."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Protocol, Sequence

from mpsd.stress.runner import RunError
from mpsd.stress.sweep import run_point
from mpsd.stress.workload import WorkloadError

__all__ = ["EXECUTORS", "Executor", "LocalExecutor", "Outcome", "Task", "open_executor"]

EXECUTORS = ("local", "ray")
Outcome = dict[str, Any] | RunError | WorkloadError  # a point's figures (run_point's), or why it has none


class Task(NamedTuple):
    """One point to run: its key (what the figures come back under) and run_point's arguments."""

    key: str
    document: dict[str, Any]
    base: Path
    path: str


class Executor(Protocol):
    def run(self, tasks: Sequence[Task]) -> Iterator[tuple[str, Outcome]]:
        """Run the tasks and yield (key, figures) for each as it finishes, in whatever order; for a point that
        failed, (key, its RunError or WorkloadError), after which the caller stops (the rest are cancelled)."""
        ...

    def close(self) -> None:
        """End the workers (or the connection), cancelling what has not started."""
        ...


class LocalExecutor:
    """Points in at most ``jobs`` spawned worker processes, the pool kept from batch to batch."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def run(self, tasks: Sequence[Task]) -> Iterator[tuple[str, Outcome]]:
        if not tasks:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                min(self.jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn"))
        futures = {self._pool.submit(run_point, t.document, t.base, t.path): t.key for t in tasks}
        try:
            for future in concurrent.futures.as_completed(futures):
                try:
                    outcome: Outcome = future.result()
                except (RunError, WorkloadError) as exc:
                    outcome = exc
                yield futures[future], outcome
        finally:  # what has not started yet never will (an error, Ctrl-C); the points done were yielded
            for future in futures:
                future.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def open_executor(name: str, jobs: int, address: str | None = None) -> Iterator[Executor]:
    """The executor of that name, closed (its workers ended, or the Ray connection) on leaving.

    Args:
        name: "local" or "ray".
        jobs: the most points run at once by local workers (Ray schedules by its cluster's CPUs).
        address: the Ray cluster's address (None: Ray's own choice, a local cluster where there is none).

    Raises:
        WorkloadError: Ray is asked for and is not installed.
    """
    executor: Executor
    if name == "ray":
        from mpsd.stress.sweep_ray import RayExecutor

        executor = RayExecutor(address)
    else:
        executor = LocalExecutor(jobs)
    try:
        yield executor
    finally:
        executor.close()
