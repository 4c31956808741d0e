"""Fuzz campaign: malformed and mutated frames and hostile control lines against one real daemon, then its counts.

    .venv/bin/python bench/fuzz.py [--seconds 60] [--items N] [--seed 1]

One daemon (protocol 3, so both control languages; --multiuser, so another uid may reach it) is attacked in
rounds until `--seconds` pass or `--items` connections and control lines have been sent:
  - the client socket: a connection per attack, a valid hello then a few random calls of the protocol's table
    with arguments of every msgpack shape, or garbage (random bytes, random headers, frames cut short), each also
    sent mutated (bytes flipped, inserted, dropped, a header's length or fd count rewritten); the daemon must
    answer and close, at a protocol error or at the end of our input, and never hang;
  - the control socket: legacy and v3 command lines with hostile arguments (4,301 and 5,000 digits, digits of
    other scripts, NUL, quotes), random bytes that are not UTF-8, lines of up to 70,000 bytes; as root (the
    daemon's owner) and, where this runs as root, as a second user (useradd) whose commands are mostly denied.
    Every line must get its whole answer, none of them an internal error.
The inputs are tests/fuzzing.py's, the tests' own generators, drawn by Hypothesis with a seed per round. A
healthy tenant process makes round trips all along (its slowest shows a stall). At the end the fuzzed settings
are put back and a new well-behaved client connects, allocates, writes and reads back. Exit status 1 where the
daemon died, hung, left a line unanswered, gave an internal error or a traceback, or did not serve that client.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import struct
import sys
import time
from collections import Counter
from pathlib import Path

import msgpack
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import mpsd_client  # noqa: E402
from daemons import DaemonProcess, as_user, drain_stderr, second_user, spawn_worker, start_daemon  # noqa: E402
from fuzzing import GARBAGE, HELLO, MESSAGES, control_packets, examples, frame  # noqa: E402
from mpsd_protocol import CONTROL_PACKET, PROTOCOL_ERROR, read_control_answer  # noqa: E402

TIMEOUT = 10.0  # seconds of silence from the daemon that count as a hang
ROUND = 40  # inputs of each kind drawn per round (Hypothesis takes a few ms each: rounds keep the mix even)

# Round trips until stdin closes; then how many, their median and the slowest, in ms.
TENANT = """
import statistics, sys, threading, time
import mpsd_client
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
times = []
with mpsd_client.connect() as ctx:
    p = ctx.malloc(1 << 20)
    print("ready", flush=True)
    while not stop.is_set():
        start = time.perf_counter()
        ctx.memset(p, len(times) & 0xFF, 4096)
        ctx.synchronize()
        times.append(time.perf_counter() - start)
        time.sleep(0.01)
print(len(times), statistics.median(times) * 1e3, max(times) * 1e3, flush=True)
"""


def mutate(data: bytes, rng: random.Random) -> bytes:
    """`data` with one to four random edits: bytes flipped, inserted or dropped, or a header field rewritten."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        edit = rng.randrange(5)
        at = rng.randrange(len(out) + 1)
        if edit == 0 and out:
            out[min(at, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif edit == 1:
            out[at:at] = rng.randbytes(rng.randint(1, 8))
        elif edit == 2:
            del out[at:at + rng.randint(1, 8)]
        elif edit == 3 and len(out) >= 8:  # the first header: a length past any bound, or fds never attached
            struct.pack_into("<I", out, rng.choice([0, 4]), rng.choice([0, 1, 255, 1 << 20, 2**32 - 1]))
        else:
            out = out[:at]  # cut short
    return bytes(out)


def attack(path: Path, data: bytes) -> str:
    """Send `data` on a new connection, end our input, and read until the daemon closes: "protocol error" (it
    said so before closing), "reset" (it closed while we sent), "end of input" (it answered and closed when our
    input ended), "hang" (silence for TIMEOUT seconds) or "not accepted" (no connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT)
        received = bytearray()
        try:
            sock.connect(str(path))
        except OSError:
            return "not accepted"  # the daemon is gone (the campaign stops), or its backlog is full
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(1 << 16):
                received += chunk
        except socket.timeout:
            return "hang"
        except (BrokenPipeError, ConnectionResetError):
            return "reset"
    return "protocol error" if _said_protocol_error(bytes(received)) else "end of input"


def _said_protocol_error(data: bytes) -> bool:
    at = 0
    while at + 8 <= len(data):
        length, _ = struct.unpack_from("<II", data, at)
        body = data[at + 8:at + 8 + length]
        at += 8 + length
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
        if message[:2] == [2, PROTOCOL_ERROR]:
            return True
    return False


def frames_round(daemon: DaemonProcess, counts: Counter[str], rng: random.Random, seed: int) -> int:
    """One round on the client socket: ROUND connections of calls and ROUND of garbage, each also mutated."""
    attacks = [(frame(HELLO) + b"".join(frame(list(m)) for m in messages), 1 + len(messages))
               for messages in examples(MESSAGES, ROUND, seed)]
    attacks += [(data, 1) for data in examples(GARBAGE, ROUND, seed) if data]
    attacks += [(mutate(data, rng), frames) for data, frames in attacks]
    for data, frames in attacks:
        outcome = attack(daemon.socket_path, data)
        counts["connections"] += 1
        counts["frames"] += frames
        counts[outcome] += 1
    return len(attacks)


def send_control(path: Path, packets: list[bytes]) -> str:
    """Send each packet on one control connection (a new one where the daemon closed it), read each answer;
    the counts as JSON (for a child of another uid to hand back)."""
    counts: Counter[str] = Counter()
    sock = None
    for packet in packets:
        counts["sent"] += 1
        try:
            if sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                sock.settimeout(TIMEOUT)
                sock.connect(str(path))
            sock.send(packet)
            answer = read_control_answer(lambda: sock.recv(CONTROL_PACKET))  # noqa: B023 (used at once)
        except socket.timeout:
            answer = None
            counts["hung"] += 1
        except OSError:
            answer = None
        if answer is None:
            counts["unanswered"] += 1
            if sock is not None:
                sock.close()
            sock = None
            continue
        counts["answered"] += 1
        counts["failed"] += answer[1]  # a v3 command's failure ("!"): an answer too
        if answer[0].startswith(b"Internal error"):
            counts["internal errors"] += 1
    if sock is not None:
        sock.close()
    return json.dumps(counts)


def well_behaved(daemon: DaemonProcess) -> str:
    """Put back what fuzzed commands may have set for new clients, then a new client's round trip and
    allocation, written and read back: "" if it worked, else what went wrong."""
    pid = daemon.proc.pid
    send_control(daemon.pipe_dir / "control", [
        b"set_default_device_pinned_mem_limit 0 0", f"set_device_pinned_mem_limit {pid} 0 0".encode(),
        b"set_default_active_thread_percentage 100", f"set_active_thread_percentage {pid} 100".encode(),
        b"set_default_client_priority 0"])
    try:
        with mpsd_client.connect(daemon.pipe_dir, timeout=TIMEOUT) as ctx:
            ctx.mem_get_info()
            p = ctx.malloc(1 << 20)
            ctx.memset(p, 0x5A, 1 << 20)
            out = bytearray(4096)
            ctx.memcpy_dtoh(out, p + 4096)
            ctx.free(p)
            return "" if out == b"\x5a" * 4096 else "read back the wrong bytes"
    except (mpsd_client.CudaError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"


def held(proc: psutil.Process) -> tuple[int, int]:
    """The daemon's open fds and RSS, once the connections just closed have left its fd table."""
    time.sleep(0.5)
    return proc.num_fds(), proc.memory_info().rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to attack (default 60)")
    parser.add_argument("--items", type=int, help="stop once this many connections and control lines were sent")
    parser.add_argument("--seed", type=int, default=1)
    options = parser.parse_args()
    rng = random.Random(options.seed)
    daemon = start_daemon("--protocol", "3", "--multiuser", "--time-scale", "100")
    reader = drain_stderr(daemon)
    for path in (daemon.pipe_dir.parent, daemon.pipe_dir):
        os.chmod(path, 0o755)  # let the second user reach the control socket at all
    other = second_user()
    tenant = spawn_worker(TENANT, daemon.pipe_dir)
    assert tenant.stdout is not None and tenant.stdin is not None
    if tenant.stdout.readline() != "ready\n":
        print(f"the healthy tenant failed to start: {tenant.communicate()[1]}")
        return 1
    frames: Counter[str] = Counter()
    lines = {"owner": Counter[str](), "other uid": Counter[str]()}
    pid, control = str(daemon.proc.pid), daemon.pipe_dir / "control"
    proc = psutil.Process(daemon.proc.pid)
    baseline = (0, 0)
    started = time.monotonic()
    items, round_ = 0, 0
    while (time.monotonic() - started < options.seconds and (options.items is None or items < options.items)
           and daemon.proc.poll() is None):
        seed = options.seed * 1_000_003 + round_
        items += frames_round(daemon, frames, rng, seed)
        packets = examples(control_packets(pid), ROUND, seed)
        lines["owner"].update(json.loads(send_control(control, packets)))
        items += len(packets)
        if other is not None:
            packets = examples(control_packets(pid), ROUND, seed + 500_000)  # lines of its own
            lines["other uid"].update(json.loads(as_user(other, lambda p=packets: send_control(control, p))))
            items += len(packets)
        round_ += 1
        if round_ == 1:  # what the daemon holds once every kind of attack has been met once
            baseline = held(proc)
    elapsed = time.monotonic() - started
    alive = daemon.proc.poll() is None
    end = held(proc) if alive else (0, 0)
    served = well_behaved(daemon) if alive else "the daemon is gone"
    tenant_out, tenant_err = tenant.communicate("stop\n", timeout=60)
    if alive:
        daemon.proc.send_signal(signal.SIGTERM)
    code = daemon.proc.wait(30)
    reader.join(30)
    shutil.rmtree(daemon.pipe_dir.parent, ignore_errors=True)
    tracebacks = sum("Traceback" in line for line in daemon.stderr_lines)

    print(f"fuzz: {elapsed:.0f} s, {round_} rounds of seed {options.seed}, daemon pid {pid}")
    print(f"frames sent: {frames['frames']} on {frames['connections']} connections; the daemon closed "
          f"{frames['protocol error']} at a protocol error, {frames['reset']} while they sent, "
          f"{frames['end of input']} at the end of their input; hung: {frames['hang']}; "
          f"not accepted: {frames['not accepted']}")
    for who, c in lines.items():
        if who == "other uid" and other is None:
            print("control lines of another uid: none (needs root to make a second user)")
            continue
        print(f"control lines ({who}): {c['sent']} sent, {c['answered']} answered ({c['failed']} failed commands), "
              f"{c['unanswered']} unanswered, {c['hung']} hung, {c['internal errors']} internal errors")
    rounds = tenant_out.split()
    if tenant.returncode == 0 and len(rounds) == 3:
        print(f"healthy tenant: {rounds[0]} round trips, median {float(rounds[1]):.2f} ms, "
              f"worst {float(rounds[2]):.2f} ms")
    else:
        print(f"healthy tenant FAILED (exit {tenant.returncode}): {tenant_err.strip()[-500:]}")
    if round_ and alive:
        print(f"daemon fds: {baseline[0]} after the first round, {end[0]} at the end; RSS {baseline[1] / 2**20:.0f} "
              f"MiB, then {end[1] / 2**20:.0f} MiB")
    print(f"daemon crashes: {0 if alive else 1}; exit after SIGTERM {code}; tracebacks on its stderr: {tracebacks}")
    print(f"a new well-behaved client at the end: {served or 'connected, allocated, wrote and read back'}")
    bad = (not alive or code != 0 or tracebacks or served or frames["hang"] or frames["not accepted"]
           or tenant.returncode != 0
           or any(c["unanswered"] or c["hung"] or c["internal errors"] for c in lines.values()))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
