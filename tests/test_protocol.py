# The sans-IO protocol core: an in-memory pair of connections, Hypothesis round trips with the bytes fed in
# random chunks, random garbage (an error, never a hang), and fd pairing over a real socketpair.
from __future__ import annotations

import os
import socket

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpsd_protocol as p
from mpsd_protocol import (
    CLOSED,
    HEADER,
    NEED_DATA,
    Connection,
    LocalProtocolError,
    Notification,
    RemoteProtocolError,
    Reply,
    Request,
    Role,
)


def pair() -> tuple[Connection, Connection]:
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    server.receive_data(client.send(Request(0, "hello", {"version": p.PROTOCOL_VERSION})))
    assert isinstance(server.next_event(), Request)
    client.receive_data(server.send(Reply(0, None, {"ok": True})))
    assert isinstance(client.next_event(), Reply)
    return client, server


def drain(conn: Connection) -> list[object]:
    events = []
    while (event := conn.next_event()) not in (NEED_DATA, CLOSED):
        events.append(event)
    return events


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20,
)
messages = st.one_of(
    st.builds(Request, st.integers(0, p._messages.MAX_ID), st.text(min_size=1, max_size=12),
              st.dictionaries(st.text(max_size=8), values, max_size=4)),
    st.builds(Notification, st.text(min_size=1, max_size=12), st.dictionaries(st.text(max_size=8), values, max_size=4)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(messages, min_size=1, max_size=8), st.data())
def test_round_trip_in_random_chunks(batch, data):
    """Any sequence of messages survives encoding and decoding, however the bytes are split."""
    client, server = pair()
    wire = b"".join(client.send(m) for m in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    received = []
    for start, end in zip([0, *cuts], [*cuts, len(wire)]):
        if end > start:  # an empty chunk would mean end of file
            server.receive_data(wire[start:end])
        received.extend(drain(server))
    assert received == batch


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_is_an_error_or_a_wait_never_a_hang(garbage):
    """Random bytes either need more data or raise RemoteProtocolError; after EOF they always settle."""
    _, server = pair()
    server.receive_data(garbage)
    try:
        drain(server)
        server.receive_data(b"")
        assert drain(server) == []
    except RemoteProtocolError:
        with pytest.raises(RemoteProtocolError):
            server.next_event()  # a broken connection stays broken


def test_server_requires_hello_first():
    """A server rejects any first message other than the hello request."""
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    frame = HEADER.pack(*(len(body := msgpack.packb([0, 1, "malloc", {}])), 0)) + body
    server.receive_data(frame)
    with pytest.raises(RemoteProtocolError, match="hello"):
        server.next_event()
    with pytest.raises(LocalProtocolError):
        client.send(Request(1, "malloc", {}))


def test_oversized_frame_is_refused_before_its_body_arrives():
    """The length in the header is checked at once: a peer cannot make us buffer a huge frame."""
    _, server = pair()
    server.receive_data(HEADER.pack(p._connection.DEFAULT_MAX_FRAME + 1, 0))
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        server.next_event()


@pytest.mark.parametrize("body", [
    msgpack.packb([3, 1, 2]), msgpack.packb([0, -1, "x", {}]), msgpack.packb([0, 1, 2, {}]),
    msgpack.packb({"a": 1}), msgpack.packb([0, 1, "x", []]), b"\xc1", msgpack.packb([1]) + b"extra",
    b"\x91" * 2000 + b"\x90",
])
def test_malformed_bodies_name_the_problem(body):
    """Wrong shapes, types, reserved bytes, trailing data and deep nesting are protocol errors."""
    _, server = pair()
    server.receive_data(HEADER.pack(len(body), 0) + body)
    with pytest.raises(RemoteProtocolError):
        server.next_event()


def test_eof_mid_frame_is_an_error_and_between_frames_is_closed():
    """A clean EOF between frames is CLOSED; an EOF inside a frame is a protocol error."""
    client, server = pair()
    frame = client.send(Notification("launch", {}))
    server.receive_data(frame)
    server.receive_data(b"")
    assert isinstance(server.next_event(), Notification)
    assert server.next_event() is CLOSED
    client2, server2 = pair()
    server2.receive_data(client2.send(Notification("launch", {}))[:-1])
    server2.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle"):
        server2.next_event()


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("t")
    os.write(fd, content)
    return fd


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_fds_pair_with_their_frames_over_a_real_socketpair():
    """Fds sent with coalesced frames reach the frames that declared them, in order."""
    client, server = pair()
    a, b = socket.socketpair()
    fds = [_memfd(b"first"), _memfd(b"second")]
    messages = [Request(1, "host_register", {}, (fds[0],)), Notification("launch", {}),
                Request(2, "host_register", {}, (fds[1],))]
    for m in messages:
        data = client.send(m)
        a.sendmsg([data], p.pack_fds(m.fds))
    for fd in fds:
        os.close(fd)
    received = []
    while len(received) < 3:
        data, anc, flags, _ = b.recvmsg(1 << 16, p.ANCILLARY_SIZE, p.RECV_FLAGS)
        server.receive_data(data, p.unpack_fds(anc, flags))
        received.extend(drain(server))
    assert [len(m.fds) for m in received] == [1, 0, 1]
    assert os.pread(received[0].fds[0], 5, 0) == b"first"
    assert os.pread(received[2].fds[0], 6, 0) == b"second"
    for m in received:
        p.close_fds(m.fds)
    a.close()
    b.close()


def test_frame_claiming_missing_fds_closes_the_queue():
    """A frame that claims more fds than arrived is an error, and fds already queued are closed."""
    _, server = pair()
    before = _open_fds()
    fd = _memfd(b"x")
    body = msgpack.packb([2, "launch", {}])
    server.receive_data(HEADER.pack(len(body), 2) + body, [fd])
    with pytest.raises(RemoteProtocolError, match="file descriptors"):
        server.next_event()
    assert _open_fds() == before
    with pytest.raises(OSError):
        os.fstat(fd)


def test_fds_waiting_for_their_frames_are_bounded():
    """Fds that arrive with the body of a frame still incomplete (where no frame can begin to claim them)
    may not pile up: past MAX_QUEUED_FDS the connection fails and every one of them is closed."""
    _, server = pair()
    before = _open_fds()
    body = msgpack.packb([2, "launch", {"pad": "x" * 1000}])
    frame = HEADER.pack(len(body), 0) + body
    server.receive_data(frame[:9])
    for i in range(p._connection.MAX_QUEUED_FDS // 16 + 1):
        server.receive_data(frame[9 + i:10 + i], [_memfd(b"x") for _ in range(16)])
    with pytest.raises(RemoteProtocolError, match="at most 32 may wait"):
        server.next_event()
    assert _open_fds() == before


def test_a_frame_and_the_next_may_both_wait_with_their_fds():
    """The most an honest peer makes wait: a frame's fds with its first bytes, then the read with the rest of
    it and the next frame, which carries that frame's fds; each frame gets its own."""
    client, server = pair()
    first, second = [_memfd(b"1") for _ in range(16)], [_memfd(b"2") for _ in range(16)]
    a = client.send(Request(1, "host_register", {"pad": "x" * 1000}, tuple(first)))
    b = client.send(Request(2, "host_register", {}, tuple(second)))
    server.receive_data(a[:100], first)
    server.receive_data(a[100:] + b, second)
    received = drain(server)
    assert [os.pread(m.fds[0], 1, 0) for m in received] == [b"1", b"2"]
    assert [len(m.fds) for m in received] == [16, 16]
    for m in received:
        p.close_fds(m.fds)


def test_truncated_ancillary_data_is_detected():
    """MSG_CTRUNC (more fds than the reader made room for) is reported, and the fds that came are closed."""
    a, b = socket.socketpair()
    fds = [_memfd(b"x") for _ in range(8)]
    a.sendmsg([b"!"], p.pack_fds(fds))
    for fd in fds:
        os.close(fd)
    before = _open_fds()
    data, anc, flags, _ = b.recvmsg(16, socket.CMSG_SPACE(4), p.RECV_FLAGS)
    with pytest.raises(RemoteProtocolError, match="MSG_CTRUNC"):
        p.unpack_fds(anc, flags)
    assert _open_fds() == before
    a.close()
    b.close()


def test_received_fds_are_close_on_exec():
    """Fds arrive with FD_CLOEXEC set (MSG_CMSG_CLOEXEC), so they never leak into child processes."""
    import fcntl

    a, b = socket.socketpair()
    fd = _memfd(b"x")
    a.sendmsg([b"!"], p.pack_fds([fd]))
    os.close(fd)
    _, anc, flags, _ = b.recvmsg(16, p.ANCILLARY_SIZE, p.RECV_FLAGS)
    (received,) = p.unpack_fds(anc, flags)
    assert fcntl.fcntl(received, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    os.close(received)
    a.close()
    b.close()


def test_messages_are_checked_when_built():
    """A message that exists can be sent: bad ids, ops, args and fds are refused at construction."""
    for bad in (lambda: Request(-1, "x", {}), lambda: Request(1, 2, {}), lambda: Request(1, "x", []),
                lambda: Notification("x", {}, (-1,)), lambda: Reply(1, "error", None)):
        with pytest.raises(LocalProtocolError):
            bad()


def test_error_table_round_trips_every_code():
    """Every code in the table becomes the same class, code, name and message on the other side."""
    for code, cls in p.ERROR_CLASSES.items():
        error = p.error_from_wire(p.make_error(code, "detail").to_wire())
        assert type(error) is cls and error.code == code and error.name == cls.name
        assert error.message.endswith(": detail")
    assert isinstance(p.make_error(2), MemoryError) and isinstance(p.make_error(1), ValueError)
    assert isinstance(p.make_error(805), ConnectionError)
    assert p.error_name(400) == "cudaErrorInvalidResourceHandle" and p.error_string(600) == "device not ready"
    assert p.make_error(700).sticky and not p.make_error(2).sticky
    unknown = p.error_from_wire({"code": 4242, "message": ""})
    assert unknown.code == 4242 and isinstance(unknown, p.CudaError)
    assert p.error_from_wire("nonsense").code == 999


@pytest.mark.parametrize("text,expected", [
    ("1G", 1 << 30), ("512M", 512 << 20), ("512MB", 512 << 20), ("1.5G", 3 << 29), ("4096", 4096), ("2k", 2048),
])
def test_sizes_parse_in_mps_syntax(text, expected):
    """Sizes use binary units, with or without a B."""
    assert p.parse_size(text) == expected


def test_mem_limits_parse_per_device():
    """`0=1G,1=512M` gives per-device limits; a bare size applies to all devices."""
    assert p.parse_mem_limits("0=1G,1=512M") == {0: 1 << 30, 1: 512 << 20}
    assert p.parse_mem_limits("2G") == {-1: 2 << 30}
    for bad in ("x=1G", "0=lots", "1Q"):
        with pytest.raises(ValueError):
            p.parse_mem_limits(bad)
