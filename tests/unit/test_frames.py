"""Frame layout: the 16-byte header, the CHUNK sub-header, and how bad ones are refused.

Every bad header must be refused by decode_header, and by a Connection on the header's 16th
byte: before any body byte is fed and before anything the size of the declared body is allocated.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.wire.connection import Connection
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.frames import (
    CHUNK_HEADER,
    CHUNK_HEADER_BYTES,
    FRAME_VERSION,
    HANDSHAKE_FRAMES,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    SHUFFLE_ITEM_SIZES,
    TRANSFER_FRAMES,
    ChunkHeader,
    Codec,
    FrameHeader,
    FrameType,
    decode_chunk_header,
    decode_header,
    encode_chunk_header,
    encode_header,
    max_body_bytes,
)
from dilocod.wire.limits import DEFAULT_LIMITS, Limits, MiB, chunk_payload_bound
from dilocod.wire.messages import Error, decode_body
from dilocod.wire.states import Role, State

Connect = Callable[..., tuple[Connection, Connection]]
LIMITS = DEFAULT_LIMITS
TID = 9


def header(
    frame_type: int,
    stream_id: int = 0,
    length: int = 0,
    *,
    magic: int = MAGIC,
    version: int = FRAME_VERSION,
    flags: int = 0,
    reserved: int = 0,
) -> bytes:
    return HEADER.pack(magic, version, frame_type, flags, reserved, stream_id, length)


def test_header_layout_is_pinned() -> None:
    """Big-endian magic, version, type, flags, reserved, stream id, body length."""
    assert HEADER_BYTES == 16 and CHUNK_HEADER_BYTES == 20
    assert encode_header(FrameType.PING, 0, 5) == bytes.fromhex("d10c0120000000000000000000000005")
    assert encode_header(FrameType.CHUNK, 0x01020304, 0x100) == bytes.fromhex(
        "d10c0140000000000102030400000100"
    )
    chunk = ChunkHeader(1, 4096, Codec.ZSTD, 2, 0x0102030405060708)
    assert encode_chunk_header(chunk) == bytes.fromhex("0000000100001000020200000102030405060708")


def test_frame_type_numbers_are_pinned() -> None:
    assert {t.name: t.value for t in FrameType} == {
        "HELLO": 0x01,
        "AUTH_CHALLENGE": 0x02,
        "AUTH_RESPONSE": 0x03,
        "WELCOME": 0x04,
        "STEP_REPORT": 0x10,
        "FRAGMENT_REQUEST": 0x11,
        "PUSH_HEADER": 0x12,
        "UPDATE_HEADER": 0x13,
        "FRAGMENT_ACK": 0x14,
        "JOIN": 0x15,
        "PLAN": 0x16,
        "NOTHING_TO_PUSH": 0x17,
        "PING": 0x20,
        "PONG": 0x21,
        "STATUS_REQUEST": 0x22,
        "STATUS_RESPONSE": 0x23,
        "ERROR": 0x30,
        "GOODBYE": 0x31,
        "CHUNK": 0x40,
        "FRAGMENT_END": 0x41,
        "STREAM_RESET": 0x42,
        "CHUNK_RESEND": 0x43,
    }


def test_error_code_numbers_are_pinned() -> None:
    """Codes travel in ERROR and STREAM_RESET: appended, never renumbered (SPEC §9)."""
    assert {c.name: c.value for c in ErrorCode} == {
        "BAD_MAGIC": 1,
        "UNSUPPORTED_VERSION": 2,
        "FRAME_TOO_LARGE": 3,
        "UNKNOWN_FRAME_TYPE": 4,
        "UNEXPECTED_FRAME": 5,
        "MALFORMED_BODY": 6,
        "BAD_RESERVED": 7,
        "AUTH_REQUIRED": 8,
        "AUTH_FAILED": 9,
        "CHECKSUM_MISMATCH": 10,
        "LENGTH_MISMATCH": 11,
        "LIMIT_EXCEEDED": 12,
        "UNSUPPORTED_CODEC": 13,
        "UNKNOWN_TRANSFER": 14,
        "DUPLICATE_TRANSFER": 15,
        "DIGEST_MISMATCH": 16,
        "BAD_MANIFEST": 17,
        "TRUNCATED": 18,
        "TIMEOUT": 19,
        "UNKNOWN_SESSION": 20,
        "TRANSFER_ABORTED": 21,
        "SHUTTING_DOWN": 22,
        "INTERNAL": 23,
        "MODEL_MISMATCH": 24,
        "NOT_REQUESTED": 25,
        "STALE_VERSION": 26,
        "NOT_JOINED": 27,
        "LEARNER_ID_IN_USE": 28,
    }


def test_body_caps_by_frame_type() -> None:
    limits = Limits(max_handshake_body_bytes=1000, max_control_body_bytes=50_000, max_message_bytes=2000)
    for frame_type in FrameType:
        open_cap = max_body_bytes(frame_type, limits, handshaking=False)
        if frame_type is FrameType.CHUNK:
            assert open_cap == CHUNK_HEADER_BYTES + chunk_payload_bound(limits.max_chunk_bytes)
        elif frame_type in (
            FrameType.PUSH_HEADER,
            FrameType.UPDATE_HEADER,
            FrameType.JOIN,
            FrameType.PLAN,
            FrameType.STATUS_RESPONSE,
        ):
            assert open_cap == 50_000
        else:
            assert open_cap == 2000
        if frame_type is not FrameType.CHUNK:
            assert max_body_bytes(frame_type, limits, handshaking=True) == 1000


@settings(max_examples=200, deadline=None)
@given(
    frame_type=st.sampled_from(list(FrameType)),
    stream_id=st.integers(1, 2**32 - 1),
    handshaking=st.booleans(),
    data=st.data(),
)
def test_header_round_trip(
    frame_type: FrameType, stream_id: int, handshaking: bool, data: st.DataObject
) -> None:
    sid = stream_id if frame_type in TRANSFER_FRAMES else 0
    low = CHUNK_HEADER_BYTES if frame_type is FrameType.CHUNK else 0
    length = data.draw(st.integers(low, max_body_bytes(frame_type, LIMITS, handshaking=handshaking)))
    decoded = decode_header(encode_header(frame_type, sid, length), LIMITS, handshaking=handshaking)
    assert decoded == FrameHeader(frame_type, 0, sid, length)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(min_size=16, max_size=16), handshaking=st.booleans())
def test_any_sixteen_bytes_decode_or_are_refused(raw: bytes, handshaking: bool) -> None:
    try:
        frame = decode_header(raw, LIMITS, handshaking=handshaking)
    except RemoteProtocolError:
        return
    assert raw[:3] == bytes.fromhex("d10c01")
    assert frame.flags == 0
    assert frame.body_length <= max_body_bytes(frame.frame_type, LIMITS, handshaking=handshaking)
    assert (frame.stream_id != 0) == (frame.frame_type in TRANSFER_FRAMES)


BAD_HEADERS = [
    pytest.param(header(FrameType.PING, magic=0xD10D), ErrorCode.BAD_MAGIC, id="magic"),
    pytest.param(header(FrameType.PING, magic=0x0CD1), ErrorCode.BAD_MAGIC, id="magic-swapped"),
    pytest.param(header(FrameType.PING, version=2), ErrorCode.UNSUPPORTED_VERSION, id="version-2"),
    pytest.param(header(FrameType.PING, version=0), ErrorCode.UNSUPPORTED_VERSION, id="version-0"),
    pytest.param(header(FrameType.PING, flags=1), ErrorCode.BAD_RESERVED, id="flags"),
    pytest.param(header(FrameType.PING, flags=0x8000), ErrorCode.BAD_RESERVED, id="flags-high"),
    pytest.param(header(FrameType.PING, reserved=1), ErrorCode.BAD_RESERVED, id="reserved"),
    pytest.param(header(0x00), ErrorCode.UNKNOWN_FRAME_TYPE, id="type-0"),
    pytest.param(header(0x05), ErrorCode.UNKNOWN_FRAME_TYPE, id="type-5"),
    pytest.param(header(0x44, TID), ErrorCode.UNKNOWN_FRAME_TYPE, id="type-0x44"),
    pytest.param(header(0xFF), ErrorCode.UNKNOWN_FRAME_TYPE, id="type-0xff"),
    pytest.param(header(FrameType.PING, TID, 4), ErrorCode.MALFORMED_BODY, id="stream-id-on-ping"),
    pytest.param(header(FrameType.CHUNK, 0, 100), ErrorCode.MALFORMED_BODY, id="chunk-without-transfer"),
    pytest.param(
        header(FrameType.CHUNK, TID, CHUNK_HEADER_BYTES - 1), ErrorCode.MALFORMED_BODY, id="chunk-short"
    ),
    pytest.param(header(FrameType.PING, 0, 2**32 - 1), ErrorCode.FRAME_TOO_LARGE, id="4GiB-ping"),
    pytest.param(
        header(FrameType.PING, 0, LIMITS.max_message_bytes + 1), ErrorCode.FRAME_TOO_LARGE, id="ping-cap+1"
    ),
    pytest.param(
        header(FrameType.PUSH_HEADER, TID, LIMITS.max_control_body_bytes + 1),
        ErrorCode.FRAME_TOO_LARGE,
        id="push-header-cap+1",
    ),
    pytest.param(
        header(FrameType.JOIN, 0, LIMITS.max_control_body_bytes + 1),
        ErrorCode.FRAME_TOO_LARGE,
        id="join-cap+1",
    ),
    pytest.param(
        header(FrameType.PLAN, 0, LIMITS.max_control_body_bytes + 1),
        ErrorCode.FRAME_TOO_LARGE,
        id="plan-cap+1",
    ),
    pytest.param(header(FrameType.JOIN, TID, 100), ErrorCode.MALFORMED_BODY, id="stream-id-on-join"),
    pytest.param(
        header(FrameType.CHUNK, TID, CHUNK_HEADER_BYTES + chunk_payload_bound(LIMITS.max_chunk_bytes) + 1),
        ErrorCode.FRAME_TOO_LARGE,
        id="chunk-cap+1",
    ),
]


@pytest.mark.parametrize(("raw", "code"), BAD_HEADERS)
def test_bad_header_is_refused(raw: bytes, code: ErrorCode) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_header(raw, LIMITS, handshaking=False)
    assert info.value.code is code


@pytest.mark.parametrize(("raw", "code"), BAD_HEADERS)
def test_connection_refuses_a_bad_header_on_its_sixteenth_byte(
    connect: Connect, raw: bytes, code: ErrorCode
) -> None:
    _, server = connect()
    for i in range(HEADER_BYTES - 1):
        assert server.receive_data(raw[i : i + 1]) == []
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError) as info:
            server.receive_data(raw[-1:])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code is code
    assert peak < 1 * MiB  # nothing sized by the declared body (up to 4 GiB here)
    assert server.state is State.CLOSED
    frames = b"".join(bytes(b) for b in server.data_to_send())
    sent = decode_header(frames[:HEADER_BYTES], LIMITS, handshaking=False)
    assert sent.frame_type is FrameType.ERROR
    error = decode_body(FrameType.ERROR, frames[HEADER_BYTES:], LIMITS)
    assert isinstance(error, Error) and error.code == code


@pytest.mark.parametrize(
    "frame_type", [*sorted(HANDSHAKE_FRAMES - {FrameType.HELLO}), FrameType.PUSH_HEADER], ids=lambda t: t.name
)
def test_handshake_bodies_are_small_before_authentication(frame_type: FrameType) -> None:
    """Before the handshake completes every frame (even one that is refused anyway) has the
    small handshake cap, so an unauthenticated peer cannot make the server buffer much."""
    sid = TID if frame_type in TRANSFER_FRAMES else 0
    cap = LIMITS.max_handshake_body_bytes
    with pytest.raises(RemoteProtocolError) as info:
        decode_header(header(frame_type, sid, cap + 1), LIMITS, handshaking=True)
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_hello_at_the_cap_is_read_and_above_it_is_not() -> None:
    cap = LIMITS.max_handshake_body_bytes
    at_cap = Connection(Role.SERVER, secret=None)
    assert at_cap.receive_data(header(FrameType.HELLO, 0, cap)) == []
    assert len(at_cap.get_buffer()) == cap  # waiting for the body
    above = Connection(Role.SERVER, secret=None)
    with pytest.raises(RemoteProtocolError) as info:
        above.receive_data(header(FrameType.HELLO, 0, cap + 1))
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_open_connection_uses_the_open_caps(connect: Connect) -> None:
    """A body at the open cap is read to its end (then decoded: these zeros are no map)."""
    _, server = connect()
    big = LIMITS.max_control_body_bytes
    assert server.receive_data(header(FrameType.PUSH_HEADER, TID, big)) == []
    assert server.receive_data(bytes(big - 1)) == []
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(b"\0")
    assert info.value.code is ErrorCode.MALFORMED_BODY


# ---------------------------------------------------------------------------- chunk sub-header


def sub(
    seq: int = 0,
    raw_length: int = 4096,
    codec: int = 0,
    shuffle: int = 0,
    reserved: int = 0,
    checksum: int = 0,
) -> bytes:
    return CHUNK_HEADER.pack(seq, raw_length, codec, shuffle, reserved, checksum)


@settings(max_examples=200, deadline=None)
@given(
    seq=st.integers(0, 2**32 - 1),
    raw_length=st.integers(1, LIMITS.max_chunk_bytes),
    codec=st.sampled_from(list(Codec)),
    shuffle=st.sampled_from(sorted(SHUFFLE_ITEM_SIZES)),
    checksum=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_chunk_header_round_trip(
    seq: int, raw_length: int, codec: Codec, shuffle: int, checksum: int, data: st.DataObject
) -> None:
    if shuffle:
        raw_length = max(shuffle, raw_length - raw_length % shuffle)
    payload = (
        raw_length if codec is Codec.NONE else data.draw(st.integers(0, chunk_payload_bound(raw_length)))
    )
    chunk = ChunkHeader(seq, raw_length, codec, shuffle, checksum)
    assert decode_chunk_header(encode_chunk_header(chunk), payload, LIMITS) == chunk


BAD_CHUNK_HEADERS = [
    pytest.param(sub(reserved=1), 4096, ErrorCode.BAD_RESERVED, id="reserved"),
    pytest.param(sub(codec=3), 4096, ErrorCode.UNSUPPORTED_CODEC, id="codec-3"),
    pytest.param(sub(codec=255), 4096, ErrorCode.UNSUPPORTED_CODEC, id="codec-255"),
    pytest.param(sub(shuffle=3), 4096, ErrorCode.MALFORMED_BODY, id="shuffle-3"),
    pytest.param(sub(shuffle=16), 4096, ErrorCode.MALFORMED_BODY, id="shuffle-16"),
    pytest.param(sub(raw_length=0), 0, ErrorCode.LIMIT_EXCEEDED, id="raw-0"),
    pytest.param(
        sub(raw_length=LIMITS.max_chunk_bytes + 1, codec=2), 10, ErrorCode.LIMIT_EXCEEDED, id="raw-cap+1"
    ),
    pytest.param(sub(raw_length=2**32 - 1, codec=1), 10, ErrorCode.LIMIT_EXCEEDED, id="raw-4GiB"),
    pytest.param(sub(raw_length=4096), 4095, ErrorCode.LENGTH_MISMATCH, id="none-short"),
    pytest.param(sub(raw_length=4096), 4097, ErrorCode.LENGTH_MISMATCH, id="none-long"),
    pytest.param(
        sub(raw_length=4096, codec=2),
        chunk_payload_bound(4096) + 1,
        ErrorCode.LIMIT_EXCEEDED,
        id="payload-bound+1",
    ),
    pytest.param(
        sub(raw_length=4097, codec=2, shuffle=2), 100, ErrorCode.LENGTH_MISMATCH, id="shuffle-remainder"
    ),
    pytest.param(
        sub(raw_length=4100, codec=1, shuffle=8), 100, ErrorCode.LENGTH_MISMATCH, id="shuffle-8-remainder"
    ),
]


@pytest.mark.parametrize(("raw", "payload_length", "code"), BAD_CHUNK_HEADERS)
def test_bad_chunk_header_is_refused(raw: bytes, payload_length: int, code: ErrorCode) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_chunk_header(raw, payload_length, LIMITS)
    assert info.value.code is code


@pytest.mark.parametrize(("raw", "payload_length", "code"), BAD_CHUNK_HEADERS)
def test_connection_refuses_a_bad_chunk_header_before_its_payload(
    connect: Connect, raw: bytes, payload_length: int, code: ErrorCode
) -> None:
    _, server = connect("data", session=bytes(16))
    frame_header = header(FrameType.CHUNK, TID, CHUNK_HEADER_BYTES + payload_length)
    assert server.receive_data(frame_header + raw[:-1]) == []
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(raw[-1:])
    assert info.value.code is code
    assert server.state is State.CLOSED


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(min_size=20, max_size=20), payload_length=st.integers(0, 32 * MiB))
def test_any_chunk_header_decodes_or_is_refused(raw: bytes, payload_length: int) -> None:
    try:
        chunk = decode_chunk_header(raw, payload_length, LIMITS)
    except RemoteProtocolError:
        return
    assert 1 <= chunk.raw_length <= LIMITS.max_chunk_bytes
    assert payload_length <= chunk_payload_bound(chunk.raw_length)
    assert chunk.shuffle in SHUFFLE_ITEM_SIZES
    assert chunk.shuffle == 0 or chunk.raw_length % chunk.shuffle == 0
    assert chunk.codec is not Codec.NONE or payload_length == chunk.raw_length
