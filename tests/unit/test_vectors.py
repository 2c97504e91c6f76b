"""Golden vectors (protocol/vectors/) against the sans-IO wire core.

Every valid vector must decode whole, byte at a time and with trailing bytes, both at frame level
(decode_header + decode_body / decode_chunk_header) and through a real Connection in the vector's
receiving state, and must re-encode to the same bytes. Every invalid vector fed to a Connection in
its stated state must raise RemoteProtocolError with the stated code on its last byte and queue an
ERROR frame. A few checks recompute what SPEC.md states (header layout, HMAC transcript, shuffle,
digest) with hashlib/xxhash/lz4/zstandard directly, so a vector cannot merely agree with the code
that wrote it. Finally the files on disk must equal what generate.py writes now.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import json
import re
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import lz4.block
import msgpack
import pytest
import xxhash
import zstandard

from dilocod.wire import codecs
from dilocod.wire.connection import Connection
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.events import ChunkReceived, Event, HandshakeCompleted, MessageReceived, PeerWentAway
from dilocod.wire.frames import (
    CHUNK_HEADER_BYTES,
    HANDSHAKE_FRAMES,
    HEADER_BYTES,
    ChunkHeader,
    FrameHeader,
    FrameType,
    decode_chunk_header,
    decode_header,
    encode_chunk_header,
    encode_header,
)
from dilocod.wire.limits import DEFAULT_LIMITS
from dilocod.wire.messages import (
    Error,
    FragmentEnd,
    Message,
    PushHeader,
    UpdateHeader,
    decode_body,
    encode_body,
)
from dilocod.wire.states import State
from dilocod.wire.stream import FragmentAssembled, InboundStreams

VECTORS_DIR = Path(__file__).resolve().parents[2] / "protocol" / "vectors"


def _load_generator() -> ModuleType:
    name = "dilocod_protocol_vectors_generate"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, VECTORS_DIR / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
VALID: dict[str, Any] = json.loads((VECTORS_DIR / "valid.json").read_text())
INVALID: dict[str, Any] = json.loads((VECTORS_DIR / "invalid.json").read_text())
BY_NAME: dict[str, dict[str, Any]] = {v["name"]: v for v in VALID["vectors"]}
#: The first 10 bytes of a PING frame: the start of a next frame, not yet a whole header.
TRAILING = bytes.fromhex("d10c0120000000000000")


def _params(vectors: list[dict[str, Any]]) -> list[Any]:
    params = []
    for vector in vectors:
        marks = []
        if "known_deviation" in vector:
            marks.append(pytest.mark.xfail(strict=True, reason=vector["known_deviation"]))
        params.append(pytest.param(vector, id=vector["name"], marks=marks))
    return params


VALID_PARAMS = _params(VALID["vectors"])
INVALID_PARAMS = _params(INVALID["vectors"])


# ----------------------------------------------------------------------------- the files themselves


def test_files_on_disk_equal_what_the_generator_writes_now() -> None:
    valid, invalid = gen.build()
    assert (VECTORS_DIR / "valid.json").read_text() == gen.render(valid), "run protocol/vectors/generate.py"
    assert (VECTORS_DIR / "invalid.json").read_text() == gen.render(invalid), (
        "run protocol/vectors/generate.py"
    )


def test_the_generator_is_deterministic() -> None:
    assert gen.render(gen.build_valid()) == gen.render(gen.build_valid())


def test_every_frame_type_has_a_valid_vector() -> None:
    assert {v["frame_type"] for v in VALID["vectors"]} == {t.name for t in FrameType}


def test_vector_sets_are_large_and_names_unique() -> None:
    assert len(INVALID["vectors"]) >= 12
    names = [v["name"] for v in (*VALID["vectors"], *INVALID["vectors"], *INVALID["chunk_decode"])]
    assert len(names) == len(set(names))
    codecs_seen = {
        (v["decoded"]["codec"], v["decoded"]["shuffle"])
        for v in VALID["vectors"]
        if "raw_hex" in v["decoded"]
    }
    assert {("lz4", 4), ("zstd", 4), ("none", 0)} <= codecs_seen


def test_join_vectors_are_picked_up() -> None:
    """JOIN and PLAN (SPEC §4.3, §4.4) have valid vectors in the right receiving states, and the
    faults the spec names for them have invalid ones."""
    assert (BY_NAME["join"]["frame_type"], BY_NAME["join"]["receiver"]) == (
        "JOIN",
        "control_hmac:server:open",
    )
    assert (BY_NAME["plan"]["frame_type"], BY_NAME["plan"]["receiver"]) == (
        "PLAN",
        "control_hmac:client:open",
    )
    assert {param.id for param in VALID_PARAMS} >= {"join", "plan"}
    errors = {v["name"]: v["error"] for v in INVALID["vectors"]}
    assert {
        name: errors.get(name)
        for name in (
            "plan_from_client",
            "join_from_server",
            "join_on_data_connection",
            "plan_rows_in_two_fragments",
            "plan_versions_length_differs",
            "join_unknown_dtype",
            "join_duplicate_name",
        )
    } == {
        "plan_from_client": "UNEXPECTED_FRAME",
        "join_from_server": "UNEXPECTED_FRAME",
        "join_on_data_connection": "UNEXPECTED_FRAME",
        "plan_rows_in_two_fragments": "BAD_MANIFEST",
        "plan_versions_length_differs": "MALFORMED_BODY",
        "join_unknown_dtype": "BAD_MANIFEST",
        "join_duplicate_name": "BAD_MANIFEST",
    }


def test_readme_counts_match_the_files() -> None:
    rows = re.findall(
        r"^\| `(\w+)\.json` +\| `(\w+)` +\| +(\d+) +\|$", (VECTORS_DIR / "README.md").read_text(), re.M
    )
    files = {"valid": VALID, "invalid": INVALID}
    listed = {(f, array): int(n) for f, array, n in rows}
    actual = {(f, k): len(v) for f, doc in files.items() for k, v in doc.items() if isinstance(v, list)}
    assert listed == actual


# ----------------------------------------------------------------------------- frame-level decoding


def _is_handshake(frame: bytes) -> bool:
    """Handshake frames are capped at max_handshake_body_bytes (SPEC §10)."""
    return frame[3] in {t.value for t in HANDSHAKE_FRAMES}


def split_frame(buf: bytes) -> tuple[FrameHeader, bytes, bytes] | None:
    """One frame off the front of buf: (header, body, rest), or None while it is incomplete."""
    if len(buf) < HEADER_BYTES:
        return None
    header = decode_header(buf[:HEADER_BYTES], DEFAULT_LIMITS, handshaking=_is_handshake(buf))
    end = HEADER_BYTES + header.body_length
    if len(buf) < end:
        return None
    return header, buf[HEADER_BYTES:end], buf[end:]


def decode_frame_body(header: FrameHeader, body: bytes) -> Message | tuple[ChunkHeader, bytes]:
    if header.frame_type is FrameType.CHUNK:
        payload = body[CHUNK_HEADER_BYTES:]
        return decode_chunk_header(body[:CHUNK_HEADER_BYTES], len(payload), DEFAULT_LIMITS), payload
    return decode_body(header.frame_type, body, DEFAULT_LIMITS)


def check_decoded(vector: dict[str, Any], header: FrameHeader, body: bytes) -> None:
    assert header.frame_type.name == vector["frame_type"]
    assert int(header.frame_type) == vector["frame_type_code"]
    assert header.stream_id == vector["stream_id"]
    decoded = decode_frame_body(header, body)
    if isinstance(decoded, tuple):
        chunk, payload = decoded
        want = vector["decoded"]
        assert (chunk.seq, chunk.raw_length, chunk.codec.value, chunk.shuffle, chunk.checksum) == (
            want["seq"],
            want["raw_length"],
            want["codec_id"],
            want["shuffle"],
            want["checksum"],
        )
        assert payload.hex() == want["payload_hex"]
        out = memoryview(bytearray(chunk.raw_length))
        codecs.decompress_into(chunk, payload, out)
        assert bytes(out).hex() == want["raw_hex"]
    else:
        assert gen.jsonable(msgpack.unpackb(body, raw=False)) == vector["decoded"]
        assert gen.jsonable(decoded.to_body()) == vector["decoded"]


@pytest.mark.parametrize("vector", VALID_PARAMS)
def test_valid_frame_decodes_whole(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["hex"])
    split = split_frame(data)
    assert split is not None
    header, body, rest = split
    assert rest == b""
    check_decoded(vector, header, body)


@pytest.mark.parametrize("vector", VALID_PARAMS)
def test_valid_frame_decodes_byte_at_a_time(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["hex"])
    for n in range(len(data)):
        assert split_frame(data[:n]) is None, f"a frame completed after {n} of {len(data)} bytes"
    split = split_frame(data)
    assert split is not None
    check_decoded(vector, split[0], split[1])


@pytest.mark.parametrize("vector", VALID_PARAMS)
def test_valid_frame_leaves_trailing_bytes(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["hex"])
    split = split_frame(data + TRAILING)
    assert split is not None
    header, body, rest = split
    assert rest == TRAILING
    check_decoded(vector, header, body)


@pytest.mark.parametrize("vector", VALID_PARAMS)
def test_valid_frame_reencodes_to_the_same_bytes(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["hex"])
    split = split_frame(data)
    assert split is not None
    header, body, _ = split
    decoded = decode_frame_body(header, body)
    if isinstance(decoded, tuple):
        chunk, payload = decoded
        again = encode_header(FrameType.CHUNK, header.stream_id, CHUNK_HEADER_BYTES + len(payload))
        again += encode_chunk_header(chunk) + payload
    else:
        new_body = encode_body(decoded)
        again = encode_header(decoded.TYPE, header.stream_id, len(new_body)) + new_body
    assert again == data


@pytest.mark.parametrize("vector", VALID_PARAMS)
def test_valid_frame_header_matches_the_spec_layout(vector: dict[str, Any]) -> None:
    """SPEC §2, recomputed with struct: 16 bytes, big-endian, flags and reserved zero."""
    data = bytes.fromhex(vector["hex"])
    magic, version, type_code, flags, reserved, stream_id, length = struct.unpack(">HBBHHII", data[:16])
    assert (magic, version, flags, reserved) == (0xD10C, 1, 0, 0)
    assert (type_code, stream_id, length) == (vector["frame_type_code"], vector["stream_id"], len(data) - 16)


# ----------------------------------------------------------------------------- through a Connection


def _feed(conn: Connection, data: bytes, *, byte_at_a_time: bool) -> list[Event]:
    if not byte_at_a_time:
        return conn.receive_data(data)
    events: list[Event] = []
    for i in range(len(data)):
        got = conn.receive_data(data[i : i + 1])
        assert not got or i == len(data) - 1, f"an event after {i + 1} of {len(data)} bytes"
        events += got
    return events


def _sent(conn: Connection) -> bytes:
    return b"".join(bytes(part) for part in conn.data_to_send())


def check_connection_events(vector: dict[str, Any], conn: Connection, events: list[Event]) -> None:
    data = bytes.fromhex(vector["hex"])
    header = decode_header(data[:16], DEFAULT_LIMITS, handshaking=_is_handshake(data))
    kind = vector["event"]
    if kind == "none":
        assert events == []
    else:
        assert len(events) == 1, events
        assert type(events[0]).__name__ == kind
    event = events[0] if events else None
    if isinstance(event, MessageReceived):
        assert event.message == decode_body(header.frame_type, data[16:], DEFAULT_LIMITS)
        assert event.stream_id == vector["stream_id"]
    elif isinstance(event, ChunkReceived):
        want = vector["decoded"]
        assert event.transfer_id == vector["stream_id"]
        assert (event.chunk.seq, event.chunk.raw_length, event.chunk.checksum) == (
            want["seq"],
            want["raw_length"],
            want["checksum"],
        )
        assert bytes(event.payload).hex() == want["payload_hex"]
    elif isinstance(event, PeerWentAway):
        assert conn.state is State.CLOSED
        if vector["frame_type"] == "ERROR":
            assert event.error_code == vector["decoded"]["code"]
    elif isinstance(event, HandshakeCompleted):
        assert conn.state is State.OPEN
    assert _sent(conn).hex() == vector["reply_hex"]


@pytest.mark.parametrize("byte_at_a_time", [False, True], ids=["whole", "bytewise"])
@pytest.mark.parametrize("vector", VALID_PARAMS)
def test_valid_frame_through_a_connection(vector: dict[str, Any], byte_at_a_time: bool) -> None:
    conn = gen.connection_in_state(vector["receiver"])
    events = _feed(conn, bytes.fromhex(vector["hex"]), byte_at_a_time=byte_at_a_time)
    check_connection_events(vector, conn, events)


@pytest.mark.parametrize("vector", VALID_PARAMS)
def test_valid_frame_through_a_connection_with_trailing_bytes(vector: dict[str, Any]) -> None:
    conn = gen.connection_in_state(vector["receiver"])
    events = conn.receive_data(bytes.fromhex(vector["hex"]) + TRAILING)
    check_connection_events(vector, conn, events)
    if conn.state is State.CLOSED:
        return  # GOODBYE and ERROR end the connection: what follows them is never read
    # The trailing bytes are held as the start of the next frame's header, nothing more.
    assert conn.mid_frame
    assert len(conn.get_buffer()) == HEADER_BYTES - len(TRAILING)


# ----------------------------------------------------------------------------- handshakes


def spec_transcript(
    version: int, kind: str, role: str, peer_id: str, session: bytes, cn: bytes, sn: bytes
) -> bytes:
    """SPEC §7 transcript, written from the spec text rather than dilocod.wire.auth."""

    def field(value: bytes) -> bytes:
        return struct.pack(">H", len(value)) + value

    return bytes([version]) + b"".join(
        field(v) for v in (kind.encode(), role.encode(), peer_id.encode(), session, cn, sn)
    )


@pytest.mark.parametrize("record", VALID["handshakes"], ids=lambda r: r["name"])
def test_handshake_macs_follow_the_spec(record: dict[str, Any]) -> None:
    hello, challenge, response, welcome = (BY_NAME[name]["decoded"] for name in record["frames"])
    assert hello["nonce"] == record["client_nonce_hex"]
    assert challenge["nonce"] == record["server_nonce_hex"]
    assert welcome["session"] == record["session_hex"]
    assert challenge["version"] == record["version"]
    transcript = spec_transcript(
        record["version"],
        hello["kind"],
        hello["role"],
        hello["peer_id"],
        bytes.fromhex(hello["session"]),
        bytes.fromhex(hello["nonce"]),
        bytes.fromhex(challenge["nonce"]),
    )
    assert transcript.hex() == record["transcript_hex"]
    if record["secret_hex"] is None:
        assert challenge["method"] == "none"
        assert response["mac"] == welcome["mac"] == ""
        return
    assert challenge["method"] == "hmac-sha256"
    secret = bytes.fromhex(record["secret_hex"])
    session = bytes.fromhex(welcome["session"])
    client_mac = hmac.new(secret, b"dilocod/1 client proof" + transcript, hashlib.sha256).hexdigest()
    server_input = b"dilocod/1 server proof" + transcript + struct.pack(">H", len(session)) + session
    server_mac = hmac.new(secret, server_input, hashlib.sha256).hexdigest()
    assert response["mac"] == record["client_mac_hex"] == client_mac
    assert welcome["mac"] == record["server_mac_hex"] == server_mac
    assert record["server_mac_input_hex"] == server_input.hex()


@pytest.mark.parametrize("record", VALID["handshakes"], ids=lambda r: r["name"])
def test_real_cores_write_the_handshake_transcript(record: dict[str, Any]) -> None:
    """A client core and a server core with scripted randomness produce exactly the vectors."""
    hs = gen.HANDSHAKES[record["name"]]
    client, _ = gen.client_for(hs)
    server, _ = gen.server_for(hs)
    hello, challenge, response, welcome = (bytes.fromhex(BY_NAME[n]["hex"]) for n in record["frames"])
    client.start(kind=hs.kind, role=hs.client_role, session=hs.hello_session)
    assert _sent(client) == hello
    assert server.receive_data(hello) == []
    assert _sent(server) == challenge
    assert client.receive_data(challenge) == []
    assert _sent(client) == response
    (server_done,) = server.receive_data(response)
    assert _sent(server) == welcome
    (client_done,) = client.receive_data(welcome)
    assert isinstance(server_done, HandshakeCompleted) and isinstance(client_done, HandshakeCompleted)
    assert server_done.session == client_done.session == bytes.fromhex(record["session_hex"])
    assert server_done.peer_id == record["client"]["peer_id"]
    assert client_done.peer_id == record["server"]["server_id"]
    assert client.state is server.state is State.OPEN


# ----------------------------------------------------------------------------- chunks and streams


def _spec_unshuffle(planes: bytes, item_size: int) -> bytes:
    n = len(planes) // item_size
    return bytes(planes[(i % item_size) * n + i // item_size] for i in range(len(planes)))


@pytest.mark.parametrize(
    "vector", [v for v in VALID["vectors"] if v["frame_type"] == "CHUNK"], ids=lambda v: v["name"]
)
def test_chunk_payload_follows_the_spec(vector: dict[str, Any]) -> None:
    """SPEC §5 recomputed with the codec libraries: decode, unshuffle, xxh3-64, float32 LE."""
    want = vector["decoded"]
    payload = bytes.fromhex(want["payload_hex"])
    raw = bytes.fromhex(want["raw_hex"])
    if want["codec"] == "lz4":
        planes = lz4.block.decompress(payload, uncompressed_size=want["raw_length"])
    elif want["codec"] == "zstd":
        planes = zstandard.ZstdDecompressor().decompress(payload, max_output_size=want["raw_length"])
    else:
        planes = payload
    assert (_spec_unshuffle(planes, want["shuffle"]) if want["shuffle"] else planes) == raw
    assert xxhash.xxh3_64_intdigest(raw) == want["checksum"] == int(want["checksum_hex"], 16)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == want["raw_float32_le"]
    if want["codec"] == "none":
        assert len(payload) == len(raw)
    else:
        assert len(payload) < len(raw)


class Session:
    """The receiving side of one session: a control and a data core sharing InboundStreams,
    wired the way SPEC §6 describes (chunks may overtake headers; duplicates are dropped)."""

    def __init__(self, control_state: str, data_state: str) -> None:
        self.streams = InboundStreams(DEFAULT_LIMITS, lambda h: memoryview(bytearray(h.raw_bytes)))
        self.conns = {
            "control": gen.connection_in_state(control_state),
            "data": gen.connection_in_state(data_state),
        }
        for conn in self.conns.values():
            conn.chunk_sink = self.streams.chunk_target
        self.assembled: list[FragmentAssembled] = []

    def feed(self, connection: str, data: bytes) -> None:
        for event in self.conns[connection].receive_data(data):
            if isinstance(event, ChunkReceived):
                self._decode(event.transfer_id, event.chunk, event.payload, event.in_place)
            elif isinstance(event, MessageReceived) and isinstance(event.message, PushHeader | UpdateHeader):
                for early in self.streams.open(event.stream_id, event.message):
                    self._decode(event.stream_id, early.chunk, early.payload, False)
            elif isinstance(event, MessageReceived) and isinstance(event.message, FragmentEnd):
                self._collect(self.streams.end(event.stream_id, event.message))

    def _decode(self, transfer_id: int, chunk: ChunkHeader, payload: memoryview, in_place: bool) -> None:
        dest = self.streams.destination(transfer_id, chunk, payload, in_place)
        if dest is not None:
            codecs.decompress_into(chunk, payload, dest, in_place=in_place)
            self._collect(self.streams.chunk_verified(transfer_id, chunk))

    def _collect(self, done: FragmentAssembled | None) -> None:
        if done is not None:
            self.assembled.append(done)


def _stream_orders(stream: dict[str, Any]) -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    header = ("control", bytes.fromhex(BY_NAME[stream["header"]]["hex"]))
    chunks = [("data", bytes.fromhex(BY_NAME[name]["hex"])) for name in stream["chunks"]]
    end = ("control", bytes.fromhex(BY_NAME[stream["end"]]["hex"]))
    yield "in_order", [header, *chunks, end]
    yield "chunks_overtake_header", [*reversed(chunks), header, end]
    yield (
        "duplicates_on_both_connections",
        [header, *((c, d) for _, d in chunks for c in ("control", "data")), end],
    )
    yield "end_before_last_chunk", [header, *chunks[:-1], end, chunks[-1]]


@pytest.mark.parametrize("stream", VALID["streams"], ids=lambda s: s["name"])
def test_stream_reassembles_in_any_order(stream: dict[str, Any]) -> None:
    raw = bytes.fromhex(stream["raw_hex"])
    checksums = [BY_NAME[name]["decoded"]["checksum"] for name in stream["chunks"]]
    digest = xxhash.xxh3_64_intdigest(b"".join(struct.pack(">Q", c) for c in checksums))
    assert digest == stream["digest"] == BY_NAME[stream["end"]]["decoded"]["digest"]
    assert BY_NAME[stream["end"]]["decoded"]["chunks"] == len(stream["chunks"])
    for order, frames in _stream_orders(stream):
        session = Session(stream["receiver_control"], stream["receiver_data"])
        for connection, data in frames:
            session.feed(connection, data)
        assert len(session.assembled) == 1, order
        done = session.assembled[0]
        assert done.transfer_id == stream["transfer_id"]
        assert bytes(done.buffer) == raw, order


# ----------------------------------------------------------------------------- invalid inputs


def _error_frame_code(conn: Connection) -> int:
    sent = _sent(conn)
    split = split_frame(sent)
    assert split is not None, "no ERROR frame queued"
    header, body, rest = split
    assert header.frame_type is FrameType.ERROR and rest == b""
    message = decode_body(FrameType.ERROR, body, DEFAULT_LIMITS)
    assert isinstance(message, Error)
    return message.code


@pytest.mark.parametrize("vector", INVALID_PARAMS)
def test_invalid_input_is_rejected_with_its_code(vector: dict[str, Any]) -> None:
    conn = gen.connection_in_state(vector["state"])
    with pytest.raises(RemoteProtocolError) as caught:
        conn.receive_data(bytes.fromhex(vector["hex"]))
    assert caught.value.code.name == vector["error"]
    assert caught.value.code == vector["error_code"]
    assert _error_frame_code(conn) == vector["error_code"]
    assert conn.state is State.CLOSED


@pytest.mark.parametrize("vector", INVALID_PARAMS)
def test_invalid_input_is_rejected_on_its_last_byte(vector: dict[str, Any]) -> None:
    """Vectors are minimal: nothing is wrong until the last byte, where the error falls (so header
    faults are caught from 16 bytes, before any body is buffered)."""
    conn = gen.connection_in_state(vector["state"])
    data = bytes.fromhex(vector["hex"])
    for i in range(len(data) - 1):
        conn.receive_data(data[i : i + 1])
    with pytest.raises(RemoteProtocolError) as caught:
        conn.receive_data(data[-1:])
    assert caught.value.code.name == vector["error"]


@pytest.mark.parametrize("vector", _params(INVALID["chunk_decode"]))
def test_chunk_that_fails_to_decode(vector: dict[str, Any]) -> None:
    conn = gen.connection_in_state(vector["state"])
    (event,) = conn.receive_data(bytes.fromhex(vector["hex"]))
    assert isinstance(event, ChunkReceived)
    out = memoryview(bytearray(event.chunk.raw_length))
    with pytest.raises(RemoteProtocolError) as caught:
        codecs.decompress_into(event.chunk, event.payload, out)
    assert caught.value.code.name == vector["error"]


@pytest.mark.parametrize("vector", INVALID["transfers"], ids=lambda v: v["name"])
def test_transfer_that_fails(vector: dict[str, Any]) -> None:
    session = Session(vector["state"]["control"], vector["state"]["data"])
    *before, last = vector["frames"]
    for step in before:
        session.feed(step["connection"], bytes.fromhex(step["hex"]))
    with pytest.raises(RemoteProtocolError) as caught:
        session.feed(last["connection"], bytes.fromhex(last["hex"]))
    assert caught.value.code == ErrorCode[vector["error"]]


def test_every_state_named_by_a_vector_can_be_built() -> None:
    build: Callable[[str], Connection] = gen.connection_in_state
    named = {v["receiver"] for v in VALID["vectors"]} | {v["state"] for v in INVALID["vectors"]}
    assert named <= set(VALID["states"])
    for key, info in VALID["states"].items():
        conn = build(key)
        assert conn.state.value == info["core_state"]
        assert conn.role.value == info["role"]
