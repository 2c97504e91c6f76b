"""Frame layout: the fixed 16-byte header, frame types, and the CHUNK sub-header.

Owns byte layouts only (protocol/SPEC.md §2 to §3); it knows nothing of connection state.
Must not import asyncio, socket, torch or logging.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from dilocod.wire.choices import CODECS
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.limits import Limits, chunk_payload_bound

MAGIC = 0xD10C
FRAME_VERSION = 1
#: magic u16, version u8, type u8, flags u16, reserved u16, stream id u32, body length u32; big-endian.
HEADER = struct.Struct(">HBBHHII")
HEADER_BYTES = HEADER.size
#: seq u32, raw length u32, codec u8, shuffle item size u8, reserved u16, xxh3-64 of raw bytes u64.
CHUNK_HEADER = struct.Struct(">IIBBHQ")
CHUNK_HEADER_BYTES = CHUNK_HEADER.size


class FrameType(IntEnum):
    HELLO = 0x01
    AUTH_CHALLENGE = 0x02
    AUTH_RESPONSE = 0x03
    WELCOME = 0x04
    STEP_REPORT = 0x10
    FRAGMENT_REQUEST = 0x11
    PUSH_HEADER = 0x12
    UPDATE_HEADER = 0x13
    FRAGMENT_ACK = 0x14
    JOIN = 0x15
    PLAN = 0x16
    NOTHING_TO_PUSH = 0x17
    PING = 0x20
    PONG = 0x21
    STATUS_REQUEST = 0x22
    STATUS_RESPONSE = 0x23
    ERROR = 0x30
    GOODBYE = 0x31
    CHUNK = 0x40
    FRAGMENT_END = 0x41
    STREAM_RESET = 0x42
    CHUNK_RESEND = 0x43


class Codec(IntEnum):
    NONE = 0
    LZ4 = 1
    ZSTD = 2


CODEC_NAMES = dict(zip(Codec, CODECS, strict=True))
CODECS_BY_NAME = {name: codec for codec, name in CODEC_NAMES.items()}
#: Frame types whose stream id names a transfer (must be non-zero); all others carry 0.
TRANSFER_FRAMES = frozenset(
    {
        FrameType.PUSH_HEADER,
        FrameType.UPDATE_HEADER,
        FrameType.FRAGMENT_ACK,
        FrameType.CHUNK,
        FrameType.FRAGMENT_END,
        FrameType.STREAM_RESET,
        FrameType.CHUNK_RESEND,
    }
)
HANDSHAKE_FRAMES = frozenset(
    {FrameType.HELLO, FrameType.AUTH_CHALLENGE, FrameType.AUTH_RESPONSE, FrameType.WELCOME}
)
#: Control frames whose body may be as large as max_control_body_bytes (they list tensors or carry
#: a daemon's status); every other open-state control frame is capped at max_message_bytes.
LARGE_CONTROL_FRAMES = frozenset(
    {
        FrameType.PUSH_HEADER,
        FrameType.UPDATE_HEADER,
        FrameType.JOIN,
        FrameType.PLAN,
        FrameType.STATUS_RESPONSE,
    }
)
SHUFFLE_ITEM_SIZES = frozenset({0, 2, 4, 8})


@dataclass(frozen=True, slots=True)
class FrameHeader:
    frame_type: FrameType
    flags: int
    stream_id: int
    body_length: int


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    seq: int
    raw_length: int
    codec: Codec
    shuffle: int
    checksum: int


def encode_header(frame_type: FrameType, stream_id: int, body_length: int) -> bytes:
    return HEADER.pack(MAGIC, FRAME_VERSION, frame_type, 0, 0, stream_id, body_length)


def max_body_bytes(frame_type: FrameType, limits: Limits, *, handshaking: bool) -> int:
    if frame_type is FrameType.CHUNK:
        return CHUNK_HEADER_BYTES + chunk_payload_bound(limits.max_chunk_bytes)
    if handshaking:
        return limits.max_handshake_body_bytes
    if frame_type in LARGE_CONTROL_FRAMES:
        return limits.max_control_body_bytes
    return limits.max_message_bytes


def decode_header(raw: bytes | bytearray | memoryview, limits: Limits, *, handshaking: bool) -> FrameHeader:
    """Parse and check a 16-byte header before any of its body is buffered."""
    magic, version, type_value, flags, reserved, stream_id, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise RemoteProtocolError(ErrorCode.BAD_MAGIC, f"bad magic 0x{magic:04x}")
    if version != FRAME_VERSION:
        raise RemoteProtocolError(
            ErrorCode.UNSUPPORTED_VERSION, f"frame version {version}, this end speaks {FRAME_VERSION}"
        )
    try:
        frame_type = FrameType(type_value)
    except ValueError:
        raise RemoteProtocolError(
            ErrorCode.UNKNOWN_FRAME_TYPE, f"unknown frame type 0x{type_value:02x}"
        ) from None
    if flags or reserved:
        raise RemoteProtocolError(
            ErrorCode.BAD_RESERVED, f"flags 0x{flags:04x} / reserved 0x{reserved:04x} must be zero"
        )
    if (stream_id != 0) != (frame_type in TRANSFER_FRAMES):
        raise RemoteProtocolError(
            ErrorCode.MALFORMED_BODY,
            f"{frame_type.name} with stream id {stream_id} (transfer frames need one, others 0)",
        )
    cap = max_body_bytes(frame_type, limits, handshaking=handshaking)
    if length > cap:
        raise RemoteProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"{frame_type.name} body of {length} bytes exceeds {cap}"
        )
    if frame_type is FrameType.CHUNK and length < CHUNK_HEADER_BYTES:
        raise RemoteProtocolError(ErrorCode.MALFORMED_BODY, "CHUNK body shorter than its sub-header")
    return FrameHeader(frame_type, flags, stream_id, length)


def encode_chunk_header(chunk: ChunkHeader) -> bytes:
    return CHUNK_HEADER.pack(chunk.seq, chunk.raw_length, chunk.codec, chunk.shuffle, 0, chunk.checksum)


def decode_chunk_header(
    raw: bytes | bytearray | memoryview, payload_length: int, limits: Limits
) -> ChunkHeader:
    seq, raw_length, codec_value, shuffle, reserved, checksum = CHUNK_HEADER.unpack(raw)
    if reserved:
        raise RemoteProtocolError(ErrorCode.BAD_RESERVED, "chunk reserved field must be zero")
    try:
        codec = Codec(codec_value)
    except ValueError:
        raise RemoteProtocolError(ErrorCode.UNSUPPORTED_CODEC, f"unknown codec {codec_value}") from None
    if shuffle not in SHUFFLE_ITEM_SIZES:
        raise RemoteProtocolError(ErrorCode.MALFORMED_BODY, f"shuffle item size {shuffle}")
    if raw_length == 0 or raw_length > limits.max_chunk_bytes:
        raise RemoteProtocolError(
            ErrorCode.LIMIT_EXCEEDED, f"chunk raw length {raw_length} outside 1..{limits.max_chunk_bytes}"
        )
    if codec is Codec.NONE and payload_length != raw_length:
        raise RemoteProtocolError(
            ErrorCode.LENGTH_MISMATCH, f"uncompressed chunk carries {payload_length} of {raw_length} bytes"
        )
    if payload_length > chunk_payload_bound(raw_length):
        raise RemoteProtocolError(
            ErrorCode.LIMIT_EXCEEDED, f"chunk payload {payload_length} too large for raw {raw_length}"
        )
    if shuffle and raw_length % shuffle:
        raise RemoteProtocolError(
            ErrorCode.LENGTH_MISMATCH, f"raw length {raw_length} not a multiple of item size {shuffle}"
        )
    return ChunkHeader(seq, raw_length, codec, shuffle, checksum)
