# `mpsd-control`: nvidia-cuda-mps-control for mpsd. With -d it starts the daemon in the background and returns
# once the daemon says it is ready (sd_notify over a private socket: no polling); with -f it becomes the
# daemon in the foreground; otherwise it sends each line of stdin to the daemon's control socket and prints
# what comes back. Exit codes: 0 done, 1 no daemon (or it failed to start), 2 bad usage.
from __future__ import annotations

import argparse
import os
import select
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from mpsd_protocol import (  # type: ignore[attr-defined]
    CONTROL_PACKET,
    MpsConnectionError,
    check_server,
    pipe_directory,
    read_control_reply,
)

READY_TIMEOUT = 30.0
MPS_NAME = "nvidia-cuda-mps-control"  # this command's name where it stands in for MPS's


def _pipe_dir(option: str | None) -> Path:
    return pipe_directory(option)


def start_background(daemon_args: list[str]) -> int:
    """Start `mpsd` detached (its own session, no terminal) and wait for its READY=1."""
    # Its stderr goes to an unlinked file: readable here if it fails to start, harmless once we are gone.
    with tempfile.TemporaryDirectory(prefix="mpsd-control-") as scratch, tempfile.TemporaryFile("w+") as errors:
        address = os.path.join(scratch, "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.bind(address)
            child = subprocess.Popen(
                [sys.executable, "-m", "mpsd", *daemon_args], start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors,
                env={**os.environ, "NOTIFY_SOCKET": address})
            # Wait for READY=1 or for the child to exit (its pidfd becomes readable), whichever comes first.
            with os.fdopen(os.pidfd_open(child.pid), "rb", buffering=0) as exited:
                while True:
                    ready, _, _ = select.select([notify, exited], [], [], READY_TIMEOUT)
                    if notify in ready and "READY=1" in notify.recv(4096).decode().splitlines():
                        return 0
                    if not ready or exited in ready:
                        break
            errors.seek(0)
            problem = errors.read().strip() if child.poll() is not None else "it did not become ready"
            print(f"mpsd-control: the daemon failed to start: {problem}", file=sys.stderr)
            return 1


def send_commands(pipe_dir: Path, lines: Sequence[bytes]) -> int:
    path = pipe_dir / "control"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        try:
            sock.connect(str(path))
        except OSError as exc:
            print(f"mpsd-control: cannot reach the control daemon at {path}: {exc.strerror}", file=sys.stderr)
            return 1
        try:
            check_server(sock, path)  # a control socket another user serves gets no command of ours
        except MpsConnectionError as exc:
            print(f"mpsd-control: {exc.detail}", file=sys.stderr)
            return 1
        for line in lines:
            if not line.strip():
                continue
            try:
                sock.send(line.strip())
                reply = read_control_reply(lambda: sock.recv(CONTROL_PACKET))
            except (OSError, ValueError):
                reply = None
            if reply is None:  # the daemon went away (after quit, it does)
                break
            text = reply.decode(errors="replace")
            if text:
                print(text, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpsd-control", description="Control mpsd with the nvidia-cuda-mps-control command language "
                                         "(commands one per line on stdin).")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("-d", action="store_true", help="start the daemon in the background")
    mode.add_argument("-f", action="store_true", help="run the daemon in the foreground")
    parser.add_argument("--pipe-dir",
                        help="the daemon's pipe directory (default $CUDA_MPS_PIPE_DIRECTORY, /tmp/nvidia-mps)")
    options, rest = parser.parse_known_args(argv)
    daemon_args = (["--pipe-dir", options.pipe_dir] if options.pipe_dir else []) + rest
    if os.path.basename(sys.argv[0]) == MPS_NAME:  # run as MPS's own command: the daemon shows as MPS's
        daemon_args.append("--mps-names")
    if options.d:
        return start_background(daemon_args)
    if options.f:
        os.execv(sys.executable, [sys.executable, "-m", "mpsd", *daemon_args])
    if rest:
        parser.error(f"unexpected arguments {' '.join(rest)} (commands go on stdin)")
    # Bytes, not text: a line that is not UTF-8 goes to the daemon as it is, which says so, and the rest go on.
    return send_commands(_pipe_dir(options.pipe_dir), sys.stdin.buffer.read().splitlines())


if __name__ == "__main__":
    sys.exit(main())
