# The compiled wire codec (mpsd_protocol._wire.Codec, protocol/src/wire.rs) against msgpack-python, the reference it
# replaced: what we encode is the bytes msgpack-python's Packer(use_bin_type=True) makes, what we decode is the
# message `from_wire(msgpack.unpackb(...))` made, and where msgpack-python refused a body (or a value), we do.
from __future__ import annotations

import enum
import math
import os
import subprocess
import sys
import threading

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import mpsd_protocol as p
from mpsd_protocol import _wire
from mpsd_protocol import (
    HEADER,
    Connection,
    LocalProtocolError,
    Notification,
    RemoteProtocolError,
    Reply,
    Request,
    Role,
)
from mpsd_protocol._connection import _CODEC, DEFAULT_MAX_FRAME
from mpsd_protocol._messages import MAX_ID, from_wire

LIMIT = DEFAULT_MAX_FRAME

# Lengths at msgpack's format boundaries (fixstr/str8/str16, bin8/bin16, fixarray/array16, fixmap/map16).
edge_lengths = st.sampled_from([0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536])
edge_ints = st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
                             -1, -32, -33, -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63])
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | edge_ints
           | st.floats(allow_nan=False) | st.text(max_size=40) | st.binary(max_size=40)
           | edge_lengths.map(lambda n: "é" * (n // 2) + "x" * (n % 2))  # multi-byte UTF-8 across a boundary
           | edge_lengths.map(lambda n: b"\x00" * n))
keys = st.text(max_size=12) | st.binary(max_size=6)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(keys, inner, max_size=6)
    | edge_lengths.filter(lambda n: n <= 256).map(lambda n: [None] * n),
    max_leaves=30,
)
arg_maps = st.dictionaries(keys, values, max_size=6)
messages = st.one_of(
    st.builds(Request, st.integers(0, MAX_ID), st.text(max_size=20), arg_maps),
    st.builds(Reply, st.integers(0, MAX_ID),
              st.none() | st.dictionaries(st.text(max_size=8), values, max_size=3), values),
    st.builds(Notification, st.text(max_size=20), arg_maps),
)


def decode(body: bytes, fds: tuple[int, ...] = (), limit: int = LIMIT):
    return _CODEC.decode(body, 0, len(body), fds, limit)


def reference(body: bytes, fds: tuple[int, ...] = (), limit: int = LIMIT):
    """What mpsd_protocol made of a body before the codec: msgpack-python's unpackb, then from_wire."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, max_bin_len=limit,
                              max_str_len=limit, max_array_len=limit, max_map_len=limit, max_ext_len=0)
    except Exception:
        return None
    return from_wire(obj, fds)


def same(a, b) -> bool:
    """Equal, with types compared too (True is not 1, 1.0 is not 1) and NaN equal to NaN. A loop, not
    recursion: values may be nested deeper than Python's recursion limit."""
    pairs = [(a, b)]
    while pairs:
        x, y = pairs.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, (Request, Reply, Notification)):
            if x.fds != y.fds:
                return False
            pairs.extend((getattr(x, f), getattr(y, f)) for f in x.__slots__ if f != "fds")
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            pairs.extend(zip(x, y))
        elif isinstance(x, dict):
            if x.keys() != y.keys():
                return False
            pairs.extend((x[k], y[k]) for k in x)
        elif isinstance(x, float):
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                return False
        elif x != y:
            return False
    return True


def has_ext(obj) -> bool:
    todo = [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, msgpack.ExtType):
            return True
        if isinstance(x, list):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
    return False


@settings(max_examples=300, deadline=None)
@given(messages)
def test_any_message_encodes_as_msgpack_python_does_and_decodes_back(message):
    """Our frame is msgpack-python's body behind the 8-byte header, and decoding it gives the message back."""
    frame = _CODEC.encode(message, LIMIT)
    body = msgpack.packb(message.to_wire(), use_bin_type=True)
    assert frame == HEADER.pack(len(body), 0) + body
    assert same(decode(frame[8:]), message)


def _outcome(fn, body):
    try:
        return fn(body)
    except RemoteProtocolError:
        return None


# Bodies that are nearly messages, so the property reaches past the first byte: a message's prefix, then anything.
prefixes = st.sampled_from([b"", b"\x94\x00\x01\xa4call", b"\x94\x01\x07", b"\x93\x02\xa6launch",
                            b"\x93\x02\xa6launch\x81\xa1k", b"\x94\x00\x01\xa1x\x81\xc4\x01k"])


@settings(max_examples=1000, deadline=None)
@given(prefixes, st.binary(max_size=60))
@example(b"", b"\xc7\x00\x05")  # a zero-length ext 8: msgpack-python gives an ExtType, we refuse every ext
@example(b"\x93\x02\xa6launch\x81\xa1k", b"\xd4\x01\x00")
@example(b"\x93\x02\xa6launch\x81\xa1k", b"\x91" * 1020 + b"\x90")  # MAX_DEPTH, msgpack-python's stack
@example(b"\x93\x02\xa6launch\x81\xa1k", b"\x91" * 1021 + b"\x90")
@example(b"", b"\x94\x00\xc3\xa1x\x80")  # a kind or an id that is a bool: from_wire's judgement, as before
@example(b"", b"\x94\xc3\x01\xc0\xc0")
@example(b"", b"\x94\xcb" + b"\x00" * 8 + b"\x01\xa1x\x80")
def test_our_decoder_agrees_with_msgpack_python_and_from_wire(prefix, tail):
    """On any bytes, the message from_wire made of msgpack-python's value, or both refuse."""
    body = prefix + tail
    ours = _outcome(decode, body)
    theirs = _outcome(reference, body)
    if theirs is not None and has_ext([getattr(theirs, f, None) for f in ("args", "error", "result")]):
        assert ours is None  # every extension type is refused (max_ext_len=0 let a zero-length one through)
        return
    assert same(ours, theirs), (body, ours, theirs)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_any_value_agrees_inside_a_message(tail):
    """A value of arbitrary bytes, where a launch's argument would be: the same value, or both refuse."""
    body = b"\x93\x02\xa6launch\x81\xa1k" + tail
    ours = _outcome(decode, body)
    try:
        theirs = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception:
        theirs = None
    if theirs is None or has_ext(theirs):
        assert ours is None
    else:
        assert ours is not None and same(ours.args, theirs[2])


def test_nesting_is_bounded_as_msgpack_pythons_stack_was():
    """MAX_DEPTH containers decode (and encode); one more is a protocol error (and cannot be sent)."""
    assert _wire.MAX_DEPTH == 1024
    deepest = b"\x93\x02\xa1x\x81\xa1k" + b"\x91" * (_wire.MAX_DEPTH - 3) + b"\x90"
    message = decode(deepest)
    assert _CODEC.encode(message, LIMIT)[8:] == deepest
    with pytest.raises(RemoteProtocolError, match="deeper than 1024"):
        decode(b"\x93\x02\xa1x\x81\xa1k" + b"\x91" * (_wire.MAX_DEPTH - 2) + b"\x90")
    with pytest.raises(msgpack.StackError):
        msgpack.unpackb(b"\x91" * _wire.MAX_DEPTH + b"\x90")
    value: list = []
    for _ in range(_wire.MAX_DEPTH - 2):
        value = [value]
    with pytest.raises(LocalProtocolError, match="cannot encode Notification: containers nested deeper"):
        _CODEC.encode(Notification("x", {"k": value}), LIMIT)
    _CODEC.encode(Notification("x", {"k": value[0]}), LIMIT)


def test_a_frame_at_the_limit_passes_and_one_byte_more_does_not():
    """The body limit holds both ways, at the exact byte: sending and receiving."""
    limit = 300
    base = len(msgpack.packb([2, "x", {"k": b""}], use_bin_type=True))
    fits = Notification("x", {"k": b"\x00" * (limit - base - 1)})  # bin8's length byte
    frame = _CODEC.encode(fits, limit)
    assert len(frame) == 8 + limit
    assert decode(frame[8:], limit=limit) == fits
    over = Notification("x", {"k": b"\x00" * (limit - base)})
    with pytest.raises(LocalProtocolError, match=f"frame of {limit + 1} bytes exceeds the limit of {limit}"):
        _CODEC.encode(over, limit)
    # A str or bin the header says is longer than the limit is refused before its bytes are looked for.
    with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
        decode(b"\x93\x02\xa1x\x81\xa1k\xc5" + (limit + 1).to_bytes(2, "big"), limit=limit)


class Colour(enum.IntEnum):
    RED = 3


class Name(str, enum.Enum):
    SPIN = "spin"


@pytest.mark.parametrize("value", [
    (1, 2, (3,)), bytearray(b"ab"), memoryview(b"cd"), Colour.RED, Name.SPIN, 2**64 - 1, -(2**63), 1.5,
    {b"k": 1, "j": [None, True, False]},
])
def test_values_beyond_the_plain_types_encode_as_msgpack_python_encodes_them(value):
    """Tuples as arrays, bytes-likes as bin, int and str subclasses as ints and strs."""
    assert _CODEC.encode(Notification("x", {"v": value}), LIMIT)[8:] == msgpack.packb(
        [2, "x", {"v": value}], use_bin_type=True)


@pytest.mark.parametrize("value,words", [
    (object(), "can not serialize 'object' object"), (2**64, "Integer value out of range"),
    (-(2**63) - 1, "Integer value out of range"), ("\ud800", "surrogates not allowed"), ({1, 2}, "'set' object"),
])
def test_what_msgpack_python_refused_to_encode_is_a_local_protocol_error(value, words):
    """The words name the message's class and the value's problem; the connection is still usable."""
    with pytest.raises((TypeError, ValueError, OverflowError)):
        msgpack.packb(value, use_bin_type=True)
    client = Connection(Role.CLIENT)
    with pytest.raises(LocalProtocolError, match=f"cannot encode Request: .*{words}"):
        client.send(Request(0, "hello", {"v": value}))
    body = msgpack.packb([0, 0, "hello", {}])
    assert client.send(Request(0, "hello", {})) == HEADER.pack(len(body), 0) + body


def test_a_subclass_goes_through_its_to_wire():
    """A message class of another shape (not one of the three) is encoded from its to_wire()."""
    class Tagged(Notification):
        __slots__ = ()

        def to_wire(self):
            return [2, self.op, dict(self.args, tagged=True)]

    frame = _CODEC.encode(Tagged("launch", {}, (5,)), LIMIT)
    assert frame[8:] == msgpack.packb([2, "launch", {"tagged": True}]) and HEADER.unpack(frame[:8])[1] == 1


def test_a_launchs_keys_and_op_are_the_same_str_objects_every_time():
    """Map keys and op names come from the codec's cache, not a fresh str per frame."""
    frame = _CODEC.encode(Notification("launch", {"name": "spin", "grid": [1, 1, 1], "block": [32, 1, 1],
                                                  "args": [0], "shared_mem": 0, "stream": None}), LIMIT)
    a, b = decode(frame[8:]), decode(frame[8:])
    assert a == b and a.op is b.op
    assert all(x is y for x, y in zip(a.args, b.args))
    assert a.args["name"] is b.args["name"]  # a short str value too


def test_frames_decoded_in_many_threads_at_once_are_each_right():
    """The cache is shared; threads switching inside decodes do not mix their messages up."""
    wrong = []

    def work(n: int) -> None:
        for i in range(400):
            message = Request(i, f"op{n}", {f"k{n}{i % 7}": [n, i, "v" * (i % 40)]})
            frame = _CODEC.encode(message, LIMIT)
            if not same(decode(frame[8:]), message):
                wrong.append(message)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_fds_that_the_dataclass_refuses_are_refused_as_from_wire_words_it():
    """A bad fd tuple takes from_wire's path, and its words."""
    body = msgpack.packb([2, "launch", {}])
    assert decode(body, (3, 4)).fds == (3, 4)
    with pytest.raises(RemoteProtocolError, match="malformed message: bad file descriptors"):
        decode(body, (-1,))
    with pytest.raises(RemoteProtocolError, match="malformed message: bad file descriptors"):
        decode(body, tuple(range(p.MAX_FDS_PER_FRAME + 1)))
    assert decode(body, (2**70,)).fds == (2**70,)  # what the dataclass accepts, though no fd is that large


def test_the_codec_knows_every_field_of_the_messages():
    """The codec fills these slots by name, in this order, and checks what __post_init__ checks: a field added
    to a message class must be added to protocol/src/python_wire.rs too."""
    import dataclasses

    assert [f.name for f in dataclasses.fields(Request)] == ["id", "op", "args", "fds"]
    assert [f.name for f in dataclasses.fields(Reply)] == ["id", "error", "result", "fds"]
    assert [f.name for f in dataclasses.fields(Notification)] == ["op", "args", "fds"]


def test_the_protocol_package_loads_neither_the_emulator_nor_msgpack():
    """The client imports mpsd_protocol: its compiled codec comes without anything of mpsd and without msgpack."""
    code = ("import sys, mpsd_protocol; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mpsd', 'msgpack') "
            "or m.startswith('mpsd_protocol._')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "mpsd_protocol._wire" in eval(out) and not [m for m in eval(out) if not m.startswith("mpsd_protocol.")]


def test_large_frames_with_fds_keep_their_stream_offsets_across_compaction():
    """Frames larger than the buffer's compaction threshold, each read ending inside the next frame (which
    carries that frame's fds, as the kernel hands them over): every frame gets its own fds, in order."""
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    server.receive_data(client.send(Request(0, "hello", {"version": p.PROTOCOL_VERSION})))
    server.next_event()
    fds = [os.memfd_create("t") for _ in range(6)]
    for i, fd in enumerate(fds):
        os.write(fd, bytes([i]))
    frames = [client.send(Request(i + 1, "host_register", {"pad": b"x" * (70_000 + 1000 * i)}, (fd,)))
              for i, fd in enumerate(fds)]
    received = []
    server.receive_data(frames[0][:100], [os.dup(fds[0])])
    for i in range(1, len(frames)):
        server.receive_data(frames[i - 1][100:] + frames[i][:100], [os.dup(fds[i])])
        received += [m for m in iter(server.next_event, p.NEED_DATA)]
    server.receive_data(frames[-1][100:])
    received.append(server.next_event())
    assert [m.id for m in received] == list(range(1, 7))
    assert [os.pread(m.fds[0], 1, 0) for m in received] == [bytes([i]) for i in range(6)]
    assert all(len(m.args["pad"]) == 70_000 + 1000 * i for i, m in enumerate(received))
    for m in received:
        p.close_fds(m.fds)
    p.close_fds(fds)


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_any_bytes_like_read_is_taken(kind):
    """What a socket read gives (bytes, or a bytearray or memoryview from recv_into) is copied in, not kept."""
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    data = bytearray(client.send(Request(0, "hello", {"version": p.PROTOCOL_VERSION})))
    server.receive_data(kind(data))
    data[:] = b"\x00" * len(data)  # the reader's buffer, reused for the next read
    assert server.next_event() == Request(0, "hello", {"version": p.PROTOCOL_VERSION})
