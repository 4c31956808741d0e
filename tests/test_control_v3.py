# MPS v3's control interface (NVIDIA's MPS documentation, releases 615 and 620) as mpsd-control and a real
# daemon give it: how v3 is selected (-p 3, CUDA_MPS_PROTOCOL_VERSION=3, which wins; a running daemon's
# protocol, which a new invocation follows). The texts NVIDIA does not document are mpsd's guesses (listed in
# README): these tests pin them so that a change is deliberate.
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from daemons import short_tempdir, start_daemon
from mpsd.tools.control import HELP, MPSD_OPTIONS, V3_HELP

BIN = Path(sys.executable).parent


def tool(pipe_dir: Path, *args: str, stdin: str = "", env: dict[str, str] | None = None
         ) -> tuple[int, str, str]:
    """mpsd-control with `args` (and `stdin`) against the daemon on `pipe_dir`: (rc, stdout, stderr)."""
    environ = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_PROTOCOL_VERSION"}
    result = subprocess.run([BIN / "mpsd-control", *args], input=stdin, capture_output=True, text=True, timeout=60,
                            env={**environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir), **(env or {})})
    return result.returncode, result.stdout, result.stderr


def test_selecting_v3_and_following_the_running_daemon(daemon_factory):
    """-p 3 starts a v3 daemon, and a plain invocation then speaks v3; the variable beats -p; a v2 daemon
    makes -p 3 a legacy invocation (its command words are unrecognised options, as MPS's v2 tool says)."""
    pipe = short_tempdir() / "pipe"
    try:
        assert tool(pipe, "-p", "4") == (1, "", 'Invalid protocol version "4", expected 2 or 3\n')
        assert tool(pipe, "-p", "3", "server", "list") == (1, "", "Cannot find MPS control daemon process\n")
        assert tool(pipe, "-h", env={"CUDA_MPS_PROTOCOL_VERSION": "3"}) == (0, V3_HELP, "")
        assert tool(pipe, "-d", "-p", "3", "--time-scale", "100")[0] == 0
        assert (pipe / "mpsd-protocol").read_text() == "3\n"
        assert tool(pipe, stdin="get_server_list\n") == (0, "", "")  # the legacy language still answers
        assert tool(pipe, "-p", "2", "-h") == (0, V3_HELP, "")  # the running daemon's protocol wins
        assert tool(pipe, "-q") == (0, "", "")  # v3's -q quits
        assert not (pipe / "mpsd-protocol").exists() and not (pipe / "control").exists()  # gone with the daemon
        # The variable wins over -p 2: the daemon speaks v3.
        assert tool(pipe, "-d", "-p", "2", "--time-scale", "100", env={"CUDA_MPS_PROTOCOL_VERSION": "3"})[0] == 0
        assert tool(pipe, "-h") == (0, V3_HELP, "")
        assert tool(pipe, stdin="quit\n") == (0, "", "")
        # A v2 daemon: -p 3 follows it, so the words are unrecognised options (MPS prints a NUL for the name),
        # and on stdin `server` is an unknown legacy command; no protocol file is left beside MPS's files.
        d = start_daemon("--time-scale", "100", pipe_dir=pipe)
        daemon_factory.append(d)
        assert not (pipe / "mpsd-protocol").exists()
        assert tool(pipe, "-p", "3", "server", "list") == (0, "Unrecognized option \0\n" + HELP + MPSD_OPTIONS, "")
        assert tool(pipe, "-p", "3", stdin="server list\n") == (0, 'Unknown command "server"\n', "")
    finally:
        shutil.rmtree(pipe.parent, ignore_errors=True)
