# `mpsd`: the daemon in the foreground. Exit codes: 0 after a clean shutdown, 1 when it cannot start,
# 2 for bad options. User mistakes get one line on stderr, never a traceback.
from __future__ import annotations

import logging
import sys
from typing import Sequence

import setproctitle
import trio

from mpsd.daemon.config import ConfigError, load_config
from mpsd.daemon.server import Daemon, DaemonError

MPS_CONTROL_NAME = "nvidia-cuda-mps-control"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["simulate"]:  # the GPU model alone, in virtual time (mpsd.tools.simulate)
        from mpsd.tools.simulate import main as simulate

        return simulate(args[1:])
    try:
        config = load_config(args)
    except ConfigError as exc:
        print(f"mpsd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="mpsd: %(levelname)s: %(message)s")
    if config.mps_names:  # the command line and /proc/PID/comm (15 characters: nvidia-cuda-mps) say MPS's name
        setproctitle.setproctitle(MPS_CONTROL_NAME)
    try:
        daemon = Daemon(config)
    except DaemonError as exc:
        print(f"mpsd: {exc}", file=sys.stderr)
        return 1

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            path = await nursery.start(daemon.serve)
            # One line that says the daemon is ready: scripts and tests wait for it instead of polling. (With
            # control.log on stdout, as MPS's -f, its start-up lines say it there.)
            if not config.control_log_stdout:
                print(f"mpsd: ready on {path}", file=sys.stderr, flush=True)

    failure: DaemonError | None = None
    try:
        trio.run(serve)
    except* DaemonError as group:  # raised inside the nursery, so it arrives in a group
        failure = group.exceptions[0]  # type: ignore[assignment]  # (trio raises it in one group, unnested)
    if failure is not None:
        print(f"mpsd: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
