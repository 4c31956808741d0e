# `mpsd-control`: nvidia-cuda-mps-control for mpsd. With -d it starts the daemon in the background and returns
# once the daemon says it is ready (sd_notify over a private socket: no polling); with -f it becomes the
# daemon in the foreground; otherwise it sends each line of stdin to the daemon's control socket and prints
# what comes back, as MPS's tool does (bench/fidelity/mps_control_h200 has what an H200's printed): a line at a
# time, as it comes, so that it works on a terminal; a line is what C's fgets(4096) reads (a longer line goes
# as several commands of 4095 bytes); an empty line is a command too, and so is a last line without a newline;
# the answers go to stdout block-buffered on a pipe and line by line on a terminal. quit's answer is the
# daemon's exit. MPS's texts and exit codes: "Cannot find MPS control daemon process" (1) without a daemon,
# "Cannot send command to MPS control daemon process" (1) where it takes no more commands (quitting), help
# and version with 0, an unknown option with its help and 0.
#
# MPS v3 (NVIDIA's MPS documentation, releases 615 and 620): -p 3 / --protocol 3, or CUDA_MPS_PROTOCOL_VERSION=3
# (which wins), starts a daemon that also takes v3's module-verb commands; an invocation that finds a daemon
# running follows that daemon's protocol whatever its own -p says (the daemon says it in its pipe directory's
# mpsd-protocol file; none is protocol 2). Under v3 the command is the words on the command line
# (`nvidia-cuda-mps-control server list`), -q quits the daemon, -h prints v3's options, and a failed command's
# text goes to stderr with exit status 1. mpsd.daemon.control_v3 lists what had to be guessed; so does
# V3_HELP's text, which is mpsd's own.
from __future__ import annotations

import argparse
import datetime
import io
import os
import select
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO, Sequence, TextIO

from mpsd_protocol import (
    CONTROL_PACKET,
    PROTOCOL_FILE,
    V3_MODULES,
    MpsConnectionError,
    check_server,
    log_directory,
    pipe_directory,
    read_control_answer,
)

READY_TIMEOUT = 30.0
MPS_NAME = "nvidia-cuda-mps-control"  # this command's name where it stands in for MPS's
PID_FILE = "nvidia-cuda-mps-control.pid"
LINE = 4096  # MPS's tool reads its commands with fgets into a buffer this long
NO_DAEMON = "Cannot find MPS control daemon process"
NOT_TAKEN = "Cannot send command to MPS control daemon process"
RUNNING = "An instance of this daemon is already running"
VERSION = ("CUDA MPS Control for Linux/Unix/QNX. Binary version: 13000\n"
           "Copyright (C) 2003 - 2025 NVIDIA Corporation.\n\n")
# MPS's help, as its -h printed it (a fact to match: scripts parse it)
HELP = (
    "CUDA MPS Control for Linux/Unix/QNX.\n"
    "Copyright (C) 2003 - 2025 NVIDIA Corporation.\n"
    "\n"
    "  This program allows multiple CUDA processes to share a single GPU context. For information on how"
    " to use the CUDA MPS, see the nvidia-cuda-mps-control manual page.\n"
    "\n"
    "nvidia-cuda-mps-control [options] [command]\n"
    "OPTIONS:\n"
    "  -h,--help                Print this message\n"
    "  -d,--daemon              Setup the daemon in the background\n"
    "  -f,--forground           Setup the daemon in the foreground\n"
    "  -M,--multiuser-server    Enable multi-user mode\n"
    "  -q,--ready-devices      Prepare the daemon to query devices on startup\n"
    "\n"
    "COMMAND:\n"
    "  start_server -uid <user id>\n"
    "                       Start a new instance of nvidia-cuda-mps-server with the given user ID\n"
    "  quit\n"
    "                       Terminate the controller\n"
    "  get_server_list\n"
    "                       Print out a list of servers\n"
    "  get_server_status <PID>\n"
    "                       Print out the status of the server\n"
    "  get_client_list <PID>\n"
    "                       List the client applications connected to the server\n"
    "  get_device_client_list [<PID>]\n"
    "                       List the devices and their client applications\n"
    "  ps [-p PID]\n"
    "                       Report a snapshot of the current client processes\n"
    "  set_default_active_thread_percentage <percentage>\n"
    "                       Set default active thread percentage for upcoming servers\n"
    "  get_default_active_thread_percentage\n"
    "                       Query the current default available thread percentage\n"
    "  set_active_thread_percentage <PID> <percentage>\n"
    "                       Override the active thread percentage of the MPS server\n"
    "  get_active_thread_percentage <PID>\n"
    "                       Query the current active thread percentage of the MPS server\n"
    "  set_default_device_pinned_mem_limit <dev> <value>\n"
    "                       Set default device pinned memory for upcoming servers\n"
    "  get_default_device_pinned_mem_limit <dev>\n"
    "                       Query the current default pinned memory limit for the device\n"
    "  set_device_pinned_mem_limit <PID> <dev> <value>\n"
    "                       Override the device pinned memory limit for MPS servers\n"
    "  get_device_pinned_mem_limit <PID> <dev>\n"
    "                       Query the current device pinned memory limit of the MPS server for the device\n"
    "  set_default_client_priority <priority>\n"
    "                       Sets default client priority for incoming clients\n"
    "  get_default_client_priority\n"
    "                       Query the current priority value that will be used for new clients\n"
    "  terminate_client <server PID> <client PID>\n"
    "                       Terminate all the outstanding GPU work of the MPS client process running on"
    " the MPS server\n"
    "  device_query [<PID>] [--csv]\n"
    "                       Enumerate all usable devices\n"
    "\n"
)
# mpsd's guess at v3's help (NVIDIA documents the options, not this text): the options as the v3 documentation
# lists them, then the module-verb commands mpsd takes.
V3_HELP = (
    "CUDA MPS Control for Linux/Unix/QNX (MPS v3).\n"
    "\n"
    "nvidia-cuda-mps-control [options] [<module> <verb> [--option=value ...]]\n"
    "OPTIONS:\n"
    "  -h,--help                Print this message\n"
    "  -d,--daemon              Setup the daemon in the background\n"
    "  -f,--foreground          Setup the daemon in the foreground\n"
    "  -m,--multiuser           Enable multiuser mode\n"
    "  -a,--apply <file>        Apply configuration from a TOML file\n"
    "  -p,--protocol <2|3>      Protocol 2 (legacy, default) or 3\n"
    "  -q,--quit                Quit and stop the daemon\n"
    "\n"
    "COMMANDS:\n"
    "  server list\n"
    "  server create --uid=UID\n"
    "  server delete --pid=PID [--force]\n"
    "  server set [--pid=PID] [--device=DEV] [--active-thread-percentage=PCT] [--pinned-memory-limit=LIMIT]"
    " [--client-priority=0|1]\n"
    "  server get [--pid=PID] [--device=DEV] --active-thread-percentage|--pinned-memory-limit|--client-priority\n"
    "  client list [--all]\n"
    "  client terminate --pid=PID\n"
    "  namespace list|create|delete|set|get [--server=NAME|--uid=UID|--pid=PID] [--name=NAME] [options]\n"
    "  partition list [--device=DEV]\n"
    "  partition create --device=DEV --chunks=N [--name=NAME] [--include-remainder]\n"
    "  partition delete --partition=ID|NAME\n"
    "\n"
)
APPLY_ALONE = "-a/--apply applies a configuration as the daemon starts: give it with -d or -f"  # mpsd's guess
BAD_PROTOCOL = 'Invalid protocol version "{}", expected 2 or 3'  # mpsd's guess: NVIDIA documents none
MPSD_OPTIONS = """mpsd-control also takes mpsd's daemon options after -d or -f (mpsd --help lists them), and
  --pipe-dir DIR           the daemon's pipe directory (default $CUDA_MPS_PIPE_DIRECTORY, /tmp/nvidia-mps)
"""


def _pipe_dir(option: str | None) -> Path:
    return pipe_directory(option)


def _running(pipe_dir: Path) -> bool:
    """Whether the daemon that wrote `pipe_dir`'s pid file still runs (asked without connecting, which the
    daemon would log)."""
    try:
        pid = int((pipe_dir / PID_FILE).read_text())
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def _note_in_server_log(pipe_dir: Path, text: str) -> None:
    """A line in the running daemon's server.log from this process (MPS's second -d writes one there),
    where this user may append to it; never through a symlink, and nothing is created."""
    directory, _ = log_directory(None, pipe_dir)
    now = datetime.datetime.now()
    stamp = now.strftime("%Y-%m-%d %H:%M:%S.") + f"{now.microsecond // 1000:03d}"
    try:
        fd = os.open(directory / "server.log", os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    with os.fdopen(fd, "a", encoding="utf-8", errors="surrogateescape") as f:
        f.write(f"[{stamp} Other {os.getpid():5d}] {text}\n")


def start_background(daemon_args: list[str], pipe_dir: Path | None = None) -> int:
    """Start `mpsd` detached (its own session, no terminal) and wait for its READY=1; where a daemon already
    answers on the pipe directory, say so as MPS does and exit 1."""
    if pipe_dir is not None and _running(pipe_dir):
        _note_in_server_log(pipe_dir, f"Using log directory: {log_directory(None, pipe_dir)[0]}")
        print(RUNNING, flush=True)
        return 1
    # Its stderr goes to an unlinked file: readable here if it fails to start, harmless once we are gone.
    with tempfile.TemporaryDirectory(prefix="mpsd-control-") as scratch, tempfile.TemporaryFile("w+") as errors:
        address = os.path.join(scratch, "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.bind(address)
            # -P: `python -m` would put the working directory first on the path, and from a clone's directory
            # import its unbuilt mpsd/ ("No module named 'mpsd._core'") rather than the installed one.
            child = subprocess.Popen(
                [sys.executable, "-P", "-m", "mpsd", *daemon_args], start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors,
                env={**os.environ, "NOTIFY_SOCKET": address})
            # Wait for READY=1 or for the child to exit (its pidfd becomes readable), whichever comes first.
            with os.fdopen(os.pidfd_open(child.pid), "rb", buffering=0) as exited:
                watched: list[socket.socket | io.FileIO] = [notify, exited]
                while True:
                    ready, _, _ = select.select(watched, [], [], READY_TIMEOUT)
                    if notify in ready and "READY=1" in notify.recv(4096).decode().splitlines():
                        return 0
                    if not ready or exited in ready:
                        break
            errors.seek(0)
            problem = errors.read().strip() if child.poll() is not None else "it did not become ready"
            print(f"mpsd-control: the daemon failed to start: {problem}", file=sys.stderr)
            return 1


def daemon_protocol(pipe_dir: Path) -> int | None:
    """The control protocol of the daemon running on `pipe_dir`, None where none runs."""
    if not _running(pipe_dir):
        return None
    try:
        return 3 if (pipe_dir / PROTOCOL_FILE).read_text().strip() == "3" else 2
    except OSError:
        return 2


def talk(pipe_dir: Path, stdin: BinaryIO, stdout: BinaryIO, stderr: TextIO) -> int:
    """Send each line of `stdin` to the daemon on `pipe_dir` as it comes and write the answers to `stdout`
    (flushed after each where it is a terminal), a failed command's (MPS v3's) to `stderr`; returns the exit
    status: 1 where a command failed."""
    status = 0
    path = pipe_dir / "control"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            print(NO_DAEMON, file=stderr)
            return 1
        try:
            check_server(sock, path)  # a control socket another user serves gets no command of ours
        except MpsConnectionError as exc:
            print(f"mpsd-control: {exc.detail}", file=stderr)
            return 1
        interactive = stdout.isatty()
        while line := stdin.readline(LINE - 1):
            command = line[:-1] if line.endswith(b"\n") else line
            command = command[:-1] if command.endswith(b"\r") else command
            # The NUL ends the command as C's string does; it also keeps an empty line's packet from being
            # read as the end of the connection.
            command = command.split(b"\0", 1)[0] + b"\0"
            try:
                sock.send(command)
                answer = read_control_answer(lambda: sock.recv(CONTROL_PACKET))
            except (OSError, ValueError):
                answer = None
            if answer is None:  # after quit the daemon has gone: that is quit's answer
                stdout.flush()
                if command.rstrip(b"\0").split()[:1] == [b"quit"]:
                    return status
                print(NOT_TAKEN, file=stderr)
                return 1
            reply, failed = answer
            if failed:
                stdout.flush()
                stderr.write(reply.decode(errors="replace") + "\n")
                stderr.flush()
                status = 1
            elif reply:
                stdout.write(reply + b"\n")
                if interactive:
                    stdout.flush()
    stdout.flush()
    return status


def _options(argv: Sequence[str], v3: bool = False) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="mpsd-control", add_help=False, allow_abbrev=False)
    if v3:  # the legacy tool has no -a: there it stays an unrecognised option
        parser.add_argument("-a", "--apply")
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("-v", "--version", action="store_true")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("-d", "--daemon", action="store_true", dest="d")
    mode.add_argument("-f", "--foreground", "--forground", action="store_true", dest="f")
    parser.add_argument("-M", "--multiuser-server", "-multiuser-server", "-m", action="store_true", dest="multiuser")
    parser.add_argument("-q", "--ready-devices", "--quit", action="store_true")  # v2: MPS queries devices at
    # start, and so do we; v3: quit
    parser.add_argument("-p", "--protocol")
    parser.add_argument("-S", "--static-partitioning", action="store_true")
    parser.add_argument("--pipe-dir")
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    options, rest = _options(args)  # as the legacy tool reads them: unchanged where the protocol is 2
    words: list[str] = []
    requested = os.environ.get("CUDA_MPS_PROTOCOL_VERSION") or options.protocol or "2"
    if requested not in ("2", "3"):
        print(BAD_PROTOCOL.format(requested[:24]), file=sys.stderr)
        return 1
    pipe_dir = _pipe_dir(options.pipe_dir)
    running = None if options.d or options.f else daemon_protocol(pipe_dir)
    protocol = running or int(requested)  # a running daemon's protocol wins, as NVIDIA documents
    as_mps = os.path.basename(sys.argv[0]) == MPS_NAME
    help_text = V3_HELP if protocol == 3 else HELP if as_mps else HELP + MPSD_OPTIONS
    if protocol == 3:  # a v3 command is the words from its module on: only those before it are options
        start = next((i for i, word in enumerate(args) if word in V3_MODULES), len(args))
        options, rest = _options(args[:start], v3=True)
        words = args[start:]
    if options.help:
        sys.stdout.write(help_text)
        return 0
    if options.version:
        sys.stdout.write(VERSION)
        return 0
    daemon_args = (["--pipe-dir", options.pipe_dir] if options.pipe_dir else [])
    daemon_args += ["--protocol", "3"] if protocol == 3 else []
    if getattr(options, "apply", None):  # v3's configuration file, for the daemon to apply as it starts
        if not (options.d or options.f):
            print(APPLY_ALONE, file=sys.stderr)
            return 1
        daemon_args += ["--apply", os.path.abspath(options.apply)]
    daemon_args += ["--multiuser"] if options.multiuser else []
    daemon_args += ["--static-partitioning"] if options.static_partitioning else []
    daemon_args += rest
    if as_mps:  # run as MPS's own command: the daemon shows as MPS's
        daemon_args.append("--mps-names")
    if options.d:
        return start_background(daemon_args, pipe_dir)
    if options.f:  # MPS's -f prints control.log's lines as it goes
        os.execv(sys.executable, [sys.executable, "-P", "-m", "mpsd", "--control-log-stdout", *daemon_args])
    if rest:  # MPS prints the NUL where the option's name would go
        sys.stdout.write("Unrecognized option \0\n" + help_text)
        return 0
    # stdout as C's stdio has it, whatever PYTHONUNBUFFERED says: a buffer of a page on a pipe or file, each
    # answer at once on a terminal (talk flushes there).
    stdout = sys.stdout.buffer if sys.stdout.isatty() else io.BufferedWriter(io.FileIO(sys.stdout.fileno(), "w",
                                                                                      closefd=False), 4096)
    commands: BinaryIO = sys.stdin.buffer
    if protocol == 3 and (words or options.ready_devices):  # v3: the command line's command, or -q's quit
        commands = io.BytesIO(os.fsencode(" ".join(words) if words else "quit") + b"\n")
    try:
        return talk(pipe_dir, commands, stdout, sys.stderr)
    finally:
        stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
