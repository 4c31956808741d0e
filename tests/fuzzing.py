# The hostile inputs of the fuzz tests (tests/test_fuzz.py, tests/test_hardening.py) and of the fuzz campaign
# (bench/fuzz.py), in one place so that a campaign of hours and a test of seconds try the same things: Hypothesis
# strategies for the client socket's frames and for the control socket's command lines (the legacy v2 language,
# MPS v3's module-verb commands, raw bytes), and `examples`, which draws them outside a test.
from __future__ import annotations

import struct
from typing import Any

import msgpack
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as seeded
from hypothesis import strategies as st

from mpsd_protocol import CALLS as TABLE, PROTOCOL_VERSION

__all__ = ["ARGUMENTS", "COMMANDS", "GARBAGE", "HELLO", "MESSAGES", "V3_COMMANDS", "VALUES",
           "command_lines", "control_packets", "ends_nothing", "examples", "frame", "v3_command_lines"]

# -- the client socket ---------------------------------------------------------------------------------------
HELLO = [0, 1, "hello", {"version": PROTOCOL_VERSION, "pid": 1, "device": 0, "visible": None, "limits": {}}]
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**64, 2**64 - 1).filter(lambda n: -2**63 <= n < 2**64)
    | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
CALLS = [*TABLE, "hello", "no_such_call"]
KEYS = sorted({arg.name for call in TABLE.values() for arg in call.args})
ARGS = st.dictionaries(st.sampled_from(KEYS), VALUES | st.integers(0, 2**47), max_size=6) | VALUES
# A few requests (0) and notifications (2) of every call of the table, with arguments of every msgpack shape.
MESSAGES = st.lists(st.tuples(st.sampled_from([0, 2]), st.integers(0, 2**32 - 1), st.sampled_from(CALLS), ARGS),
                    min_size=1, max_size=5)


def frame(message: Any) -> bytes:
    """`message` as one frame of the wire (header: body length, no fds; msgpack body)."""
    body = msgpack.packb(message, use_bin_type=True)
    return struct.pack("<II", len(body), 0) + body


_HEADER = st.builds(lambda n, f: struct.pack("<II", n, f), st.integers(0, 2**32 - 1), st.integers(0, 300))
# What a broken or hostile peer sends instead of frames: random bytes, random headers (lengths past any bound, fds
# it does not attach) before random bytes, and a hello then a frame cut short.
GARBAGE = (st.binary(max_size=200) | st.tuples(_HEADER, st.binary(max_size=64)).map(lambda t: t[0] + t[1])
           | st.lists(MESSAGES, max_size=1).map(lambda m: frame(HELLO) + frame(list(m[0][0]))[:-3] if m else b""))

# -- the control socket --------------------------------------------------------------------------------------
# Each legacy command the fuzz sends, with the number of arguments it takes (quit, shutdown_server and
# terminate_client would end what is being fuzzed; tests/test_hardening.py sends shutdown_server on its own).
COMMANDS = {
    "get_server_list": 0, "get_server_status": 1, "start_server": 2, "get_client_list": 1,
    "get_device_client_list": 1, "ps": 2, "get_default_active_thread_percentage": 0,
    "set_default_active_thread_percentage": 1, "get_active_thread_percentage": 1,
    "set_active_thread_percentage": 2, "get_default_device_pinned_mem_limit": 1,
    "set_default_device_pinned_mem_limit": 2, "get_device_pinned_mem_limit": 2, "set_device_pinned_mem_limit": 3,
    "get_default_client_priority": 0, "set_default_client_priority": 1, "set_client_priority": 2,
    "get_client_priority": 1, "set_client_weight": 2, "get_client_weight": 1, "mpsd_status": 0,
    "no_such_command": 1,
}
ARGUMENTS = st.one_of(
    st.sampled_from(["-t", "-f", "-uid", "-p", "uid:", "0", "1", "-1", "50", "0.5", "1e400", "nan", "inf", "1_0",
                     "9" * 5000, "9" * 4301, "1.5G", "0x10", " 5 ", "'", '"', "\\", "\0"]),
    st.text(alphabet="0123456789²³①⑨٥٠०۵𝟘½uid:-.G", min_size=1, max_size=4),  # digits and their lookalikes
    st.text(alphabet=st.characters(whitelist_categories=("Nd", "No", "Nl")), min_size=1, max_size=4),
    st.integers(-10**12, 10**12).map(str),
    st.text(max_size=8),
)
# MPS v3's module-verb commands with the options each takes (mpsd.daemon.control_v3), but for `server delete` and
# `client terminate`, which end the server or a client being fuzzed beside; unknown verbs and options too.
V3_COMMANDS = {
    "server": {"list": [], "create": ["uid"], "set": ["pid", "device", "active-thread-percentage",
                                                      "pinned-memory-limit", "client-priority"],
               "get": ["pid", "device", "active-thread-percentage", "pinned-memory-limit", "client-priority"]},
    "client": {"list": ["all"]},
    "namespace": {verb: ["server", "uid", "pid", "name", "active-thread-percentage", "pinned-memory-limit",
                         "client-priority", "cgroup"] for verb in ("list", "create", "delete", "set", "get")},
    "partition": {"list": ["device"], "create": ["device", "chunks", "name", "include-remainder"],
                  "delete": ["partition"]},
}


def ends_nothing(packet: bytes) -> bool:
    """Random bytes that are no quit or shutdown_server (which would end what is being fuzzed: a quit with a
    client gets no answer until the daemon has gone, as MPS's does)."""
    return not any(line.split()[:1] in ([b"quit"], [b"shutdown_server"]) for line in packet.split(b"\n"))


def command_lines(pid: str) -> st.SearchStrategy[bytes]:
    """A legacy command with as many arguments as it takes (or any number), each one hostile, plausible or `pid`
    (the daemon's, the server's pid)."""
    argument = st.one_of(ARGUMENTS, st.just(pid))
    return st.sampled_from(sorted(COMMANDS.items())).flatmap(lambda command: st.tuples(
        st.just(command[0]),
        st.lists(argument, min_size=command[1], max_size=command[1]) | st.lists(argument, max_size=3),
    )).map(lambda line: " ".join([line[0], *line[1]]).encode())


def v3_command_lines(pid: str) -> st.SearchStrategy[bytes]:
    """A v3 command, `module verb` (or an unknown verb), then options it takes or not, as --name=value,
    `--name value` or a bare --name, each value hostile, plausible or `pid`; and words that are no options."""
    value = st.one_of(ARGUMENTS, st.just(pid))
    pairs = [(module, verb) for module, verbs in sorted(V3_COMMANDS.items()) for verb in sorted(verbs)]
    names = sorted({name for verbs in V3_COMMANDS.values() for options in verbs.values() for name in options})
    option = st.tuples(st.sampled_from([*names, "force", "no-such-option", ""]), value,
                       st.sampled_from(["=", " ", ""])).map(
        lambda o: f"--{o[0]}{o[2]}{o[1]}" if o[2] else f"--{o[0]}")
    command = st.sampled_from(pairs) | st.tuples(st.sampled_from(sorted(V3_COMMANDS)), st.text(max_size=6))
    return st.tuples(command, st.lists(option | value, max_size=5)).map(
        lambda line: " ".join([*line[0], *line[1]]).encode())


def control_packets(pid: str) -> st.SearchStrategy[bytes]:
    """Every kind of control packet: legacy and v3 command lines, random bytes (not UTF-8, NULs, newlines), and
    a command line with an argument of up to 70,000 bytes (a packet larger than the daemon reads)."""
    long_line = st.tuples(command_lines(pid) | v3_command_lines(pid), st.sampled_from(b"9 x\xff\0"),
                          st.integers(60_000, 70_000)).map(lambda t: t[0] + b" " + bytes([t[1]]) * t[2])
    return (command_lines(pid) | v3_command_lines(pid) | st.binary(min_size=1, max_size=64).filter(ends_nothing)
            | long_line)



# -- outside a test ------------------------------------------------------------------------------------------
def examples(strategy: st.SearchStrategy[Any], count: int, seed: int) -> list[Any]:
    """Up to `count` values of `strategy`, drawn as a test would draw them (Hypothesis's own mix of small, large
    and boundary values, not `.example()`'s), the same ones for the same `seed`; fewer where it has run out."""
    drawn: list[Any] = []

    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate], verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck))
    @seeded(seed)
    @given(strategy)
    def draw(value: Any) -> None:
        drawn.append(value)

    draw()
    return drawn
