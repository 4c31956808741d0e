# The control socket's wire format: nvidia-cuda-mps-control's, one command per SEQPACKET packet in, and its
# output back after a one-byte marker (an empty packet would read as end of file). An output larger than a
# packet (mpsd_status or ps with hundreds of clients) goes in several: "+" marks a packet that more follow,
# "=" the last, so that no reader ever gets a cut reply; "!" is a last packet too, of a command that failed
# (only MPS v3's module-verb commands fail so: the tool then exits 1; a v2 command's answer is always "=").
# Sans-IO: the caller sends and receives.
from __future__ import annotations

from typing import Callable

CONTROL_PACKET = 1 << 16  # bytes in one packet, marker included
MAX_CONTROL_REPLY = 64 << 20  # what a reader accepts in all, so a broken peer cannot exhaust it
MORE, LAST, FAILED = b"+", b"=", b"!"
# MPS v3's command modules (a v3 command is `<module> <verb> [--option=value ...]`), which a daemon started
# with protocol 3 takes beside the legacy commands; none of them is a legacy command's name.
V3_MODULES = frozenset({"server", "client", "namespace", "partition"})
# mpsd's own (MPS's name for it is not documented): the control protocol of a daemon started with protocol 3,
# in its pipe directory, which a new nvidia-cuda-mps-control invocation follows, as NVIDIA documents; no file
# means protocol 2.
PROTOCOL_FILE = "mpsd-protocol"


def control_packets(output: str, failed: bool = False) -> list[bytes]:
    """The packets that carry one command's `output`, in order; the last says whether it `failed`."""
    data = output.encode(errors="surrogateescape")  # bytes a command quoted go back as they came
    size = CONTROL_PACKET - 1
    chunks = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
    return [MORE + chunk for chunk in chunks[:-1]] + [(FAILED if failed else LAST) + chunks[-1]]


def read_control_reply(receive: Callable[[], bytes]) -> bytes | None:
    """One command's output, from packets `receive()` returns; None if the peer closed first.

    Raises:
        ValueError: a packet without a marker, or a reply past MAX_CONTROL_REPLY.
    """
    answer = read_control_answer(receive)
    return None if answer is None else answer[0]


def read_control_answer(receive: Callable[[], bytes]) -> tuple[bytes, bool] | None:
    """One command's output and whether the command failed; None if the peer closed first.

    Raises:
        ValueError: a packet without a marker, or a reply past MAX_CONTROL_REPLY.
    """
    parts: list[bytes] = []
    total = 0
    while True:
        packet = receive()
        if not packet:
            return None
        marker, body = packet[:1], packet[1:]
        if marker not in (MORE, LAST, FAILED):
            raise ValueError(f"control reply packet starts with {marker!r}, not +, = or !")
        total += len(body)
        if total > MAX_CONTROL_REPLY:
            raise ValueError(f"control reply larger than {MAX_CONTROL_REPLY} bytes")
        parts.append(body)
        if marker != MORE:
            return b"".join(parts), marker == FAILED
