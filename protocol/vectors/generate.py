"""Golden vectors for protocol/SPEC.md, produced by the reference encoder in dilocod.wire.

Run `python protocol/vectors/generate.py` from the repository root to rewrite valid.json and
invalid.json next to this file; `--check` only compares and exits 1 when they differ. Everything is
deterministic: secrets, nonces, session ids and payloads are fixed below, and the Connection cores
draw their randomness from a script. The handshake frames are not written by hand: a real client
core and a real server core talk to each other and the bytes they queue are the vectors.

tests/unit/test_vectors.py loads this file by path (protocol/ is not a package) for build(),
render(), HANDSHAKES, client_for()/server_for(), connection_in_state() and jsonable(). Imports
dilocod.wire, its codec libraries (msgpack, lz4, zstandard) and the standard library; never torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lz4.block
import msgpack
import zstandard

from dilocod.wire import auth, codecs
from dilocod.wire.connection import PROTOCOL_MAX_VERSION, Connection
from dilocod.wire.errors import ErrorCode
from dilocod.wire.events import HandshakeCompleted
from dilocod.wire.frames import (
    CHUNK_HEADER,
    CODEC_NAMES,
    FRAME_VERSION,
    HEADER,
    MAGIC,
    ChunkHeader,
    Codec,
    FrameType,
    encode_chunk_header,
    encode_header,
)
from dilocod.wire.limits import DEFAULT_LIMITS, chunk_payload_bound
from dilocod.wire.manifest import ModelEntry, pack_manifest
from dilocod.wire.messages import (
    MAX_HAVE_BYTES,
    ChunkResend,
    Error,
    FragmentAck,
    FragmentEnd,
    FragmentRequest,
    Goodbye,
    Hello,
    Join,
    Message,
    NothingToPush,
    PartialUpdate,
    Ping,
    Plan,
    Pong,
    PushHeader,
    StatusRequest,
    StatusResponse,
    StepReport,
    StreamReset,
    UpdateHeader,
    Welcome,
    chunk_bitmap,
    decode_body,
    encode_body,
)
from dilocod.wire.states import Role

HERE = Path(__file__).resolve().parent
VALID_PATH = HERE / "valid.json"
INVALID_PATH = HERE / "invalid.json"
FORMAT = "dilocod-wire-vectors/1"

# ----------------------------------------------------------------------------- fixed inputs

#: The pre-shared key of every authenticated vector (32 bytes: a0 a1 ... bf).
SECRET = bytes(range(0xA0, 0xC0))
#: The control session the server hands out in the control_hmac handshake (40 41 ... 4f).
SESSION = bytes(range(0x40, 0x50))
#: A session id no server ever handed out (used to make a WELCOME answer for the wrong session).
OTHER_SESSION = bytes(range(0xE0, 0xF0))


@dataclass(frozen=True, slots=True)
class HandshakeSpec:
    """Everything that fixes one handshake transcript byte for byte."""

    name: str
    description: str
    secret: bytes | None
    kind: str
    client_id: str
    client_role: str
    client_capabilities: tuple[str, ...]
    server_id: str
    incarnation: str
    server_capabilities: tuple[str, ...]
    client_nonce: bytes
    server_nonce: bytes
    #: The session the HELLO names (data connections) or b"" (control connections).
    hello_session: bytes
    #: The session id the server draws for a new control session (b"" when the HELLO names one).
    new_session: bytes


HANDSHAKES: dict[str, HandshakeSpec] = {
    spec.name: spec
    for spec in (
        HandshakeSpec(
            name="control_hmac",
            description="learner opens the control connection of a new session; both ends hold SECRET",
            secret=SECRET,
            kind="control",
            client_id="learner-3",
            client_role="learner",
            client_capabilities=("lz4", "zstd"),
            server_id="syncer-0",
            incarnation="inc-0001",
            server_capabilities=("lz4", "zstd"),
            client_nonce=bytes(range(0x00, 0x20)),
            server_nonce=bytes(range(0x20, 0x40)),
            hello_session=b"",
            new_session=SESSION,
        ),
        HandshakeSpec(
            name="data_hmac",
            description="the same learner opens a data connection of that session; both ends hold SECRET",
            secret=SECRET,
            kind="data",
            client_id="learner-3",
            client_role="learner",
            client_capabilities=("lz4", "zstd"),
            server_id="syncer-0",
            incarnation="inc-0001",
            server_capabilities=("lz4", "zstd"),
            client_nonce=bytes(range(0x50, 0x70)),
            server_nonce=bytes(range(0x70, 0x90)),
            hello_session=SESSION,
            new_session=b"",
        ),
        HandshakeSpec(
            name="control_none",
            description="a status client on loopback; neither end holds a secret (method none)",
            secret=None,
            kind="control",
            client_id="dilocod-status",
            client_role="status",
            client_capabilities=(),
            server_id="syncer-0",
            incarnation="inc-0001",
            server_capabilities=(),
            client_nonce=bytes(range(0x90, 0xB0)),
            server_nonce=bytes(range(0xB0, 0xD0)),
            hello_session=b"",
            new_session=bytes(range(0xD0, 0xE0)),
        ),
    )
}

#: Receiving states the vectors refer to: (handshake, role, transcript frames already exchanged).
#: Transcript frames are numbered 0 HELLO, 1 AUTH_CHALLENGE, 2 AUTH_RESPONSE, 3 WELCOME.
_STATE_SHAPES: tuple[tuple[str, Role, int, str], ...] = (
    ("server:await_hello", Role.SERVER, 0, "await_hello"),
    ("client:await_challenge", Role.CLIENT, 1, "await_challenge"),
    ("server:await_response", Role.SERVER, 2, "await_response"),
    ("client:await_welcome", Role.CLIENT, 3, "await_welcome"),
    ("server:open", Role.SERVER, 4, "open"),
    ("client:open", Role.CLIENT, 4, "open"),
)


def state_table() -> dict[str, dict[str, Any]]:
    """Every named receiving state: which core, in which handshake, after which frames."""
    table: dict[str, dict[str, Any]] = {}
    for hs in HANDSHAKES.values():
        for suffix, role, frames, core_state in _STATE_SHAPES:
            table[f"{hs.name}:{suffix}"] = {
                "handshake": hs.name,
                "role": role.value,
                "kind": hs.kind,
                "frames_exchanged": frames,
                "core_state": core_state,
                "has_secret": hs.secret is not None,
            }
    return table


# ----------------------------------------------------------------------------- helpers


class Script:
    """Deterministic stand-in for secrets.token_bytes: hands out preset values in order."""

    def __init__(self, values: Sequence[bytes]) -> None:
        self._values = list(values)

    def __call__(self, n: int) -> bytes:
        if not self._values:
            raise RuntimeError("the core asked for more random bytes than the script holds")
        value = self._values.pop(0)
        if len(value) != n:
            raise RuntimeError(f"the core asked for {n} random bytes, the script holds {len(value)}")
        return value

    @property
    def exhausted(self) -> bool:
        return not self._values


def jsonable(value: object) -> Any:
    """A msgpack-decoded value as JSON: bytes become lowercase hex strings, tuples lists."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {(k.hex() if isinstance(k, bytes) else k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def frame(message: Message, stream_id: int = 0) -> bytes:
    """One whole control frame as the reference encoder writes it."""
    body = encode_body(message)
    return encode_header(message.TYPE, stream_id, len(body)) + body


def chunk_frame(transfer_id: int, chunk: ChunkHeader, payload: bytes) -> bytes:
    head = encode_header(FrameType.CHUNK, transfer_id, CHUNK_HEADER.size + len(payload))
    return head + encode_chunk_header(chunk) + payload


def raw_header(
    type_value: int,
    stream_id: int,
    body_length: int,
    *,
    magic: int = MAGIC,
    version: int = FRAME_VERSION,
    flags: int = 0,
    reserved: int = 0,
) -> bytes:
    """A frame header with any field set, including the ones the encoder never gets wrong."""
    return HEADER.pack(magic, version, type_value, flags, reserved, stream_id, body_length)


def raw_frame(frame_type: FrameType, body: bytes, stream_id: int = 0) -> bytes:
    return raw_header(frame_type, stream_id, len(body)) + body


def raw_chunk_head(
    seq: int, raw_length: int, codec: int, shuffle: int, checksum: int, reserved: int = 0
) -> bytes:
    return CHUNK_HEADER.pack(seq, raw_length, codec, shuffle, reserved, checksum)


def packb(body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def float32_le(values: Sequence[float]) -> bytes:
    """Tensor bytes as they travel: row-major, little-endian."""
    return struct.pack(f"<{len(values)}f", *values)


def _lcg_floats(count: int, seed: int) -> list[float]:
    """Pseudo-random small floats (incompressible mantissas), identical on every platform."""
    out: list[float] = []
    x = seed
    for _ in range(count):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(((x >> 7) / 2**24 - 0.5) * 0.01)
    return out


# ----------------------------------------------------------------------------- handshakes


def client_for(hs: HandshakeSpec) -> tuple[Connection, Script]:
    script = Script([hs.client_nonce])
    conn = Connection(
        Role.CLIENT,
        secret=hs.secret,
        local_id=hs.client_id,
        capabilities=hs.client_capabilities,
        random_bytes=script,
    )
    return conn, script


def server_for(hs: HandshakeSpec) -> tuple[Connection, Script]:
    script = Script([hs.server_nonce, *([hs.new_session] if hs.new_session else [])])
    conn = Connection(
        Role.SERVER,
        secret=hs.secret,
        local_id=hs.server_id,
        incarnation=hs.incarnation,
        capabilities=hs.server_capabilities,
        random_bytes=script,
    )
    return conn, script


def _drain(conn: Connection) -> bytes:
    return b"".join(bytes(part) for part in conn.data_to_send())


def run_handshake(hs: HandshakeSpec) -> list[bytes]:
    """Let a client core and a server core shake hands; returns the four frames they wrote."""
    client, client_script = client_for(hs)
    server, server_script = server_for(hs)
    client.start(kind=hs.kind, role=hs.client_role, session=hs.hello_session)
    hello = _drain(client)
    if server.receive_data(hello):
        raise RuntimeError("HELLO produced an event")
    challenge = _drain(server)
    if client.receive_data(challenge):
        raise RuntimeError("AUTH_CHALLENGE produced an event")
    response = _drain(client)
    server_events = server.receive_data(response)
    welcome = _drain(server)
    client_events = client.receive_data(welcome)
    if not (
        len(server_events) == 1
        and isinstance(server_events[0], HandshakeCompleted)
        and len(client_events) == 1
        and isinstance(client_events[0], HandshakeCompleted)
        and client_script.exhausted
        and server_script.exhausted
    ):
        raise RuntimeError(f"handshake {hs.name} did not complete as scripted")
    return [hello, challenge, response, welcome]


def connection_in_state(key: str) -> Connection:
    """A fresh core in a named receiving state (see state_table()), by replaying its handshake."""
    info = state_table()[key]
    hs = HANDSHAKES[info["handshake"]]
    frames = run_handshake(hs)
    exchanged = info["frames_exchanged"]
    if info["role"] == Role.CLIENT.value:
        conn, _ = client_for(hs)
        conn.start(kind=hs.kind, role=hs.client_role, session=hs.hello_session)
        received = (1, 3)
    else:
        conn, _ = server_for(hs)
        received = (0, 2)
    for index in received:
        if index < exchanged:
            conn.receive_data(frames[index])
    conn.data_to_send()
    if conn.state.value != info["core_state"]:
        raise RuntimeError(f"{key}: core is in {conn.state.value}, expected {info['core_state']}")
    return conn


def _handshake_record(hs: HandshakeSpec, frames: list[bytes]) -> dict[str, Any]:
    hello = decode_body(FrameType.HELLO, frames[0][16:], DEFAULT_LIMITS)
    welcome = decode_body(FrameType.WELCOME, frames[3][16:], DEFAULT_LIMITS)
    if not (isinstance(hello, Hello) and isinstance(welcome, Welcome)):
        raise RuntimeError(f"{hs.name}: the transcript does not start with HELLO and end with WELCOME")
    version = PROTOCOL_MAX_VERSION
    transcript = auth.transcript(hello, version, hs.server_nonce)
    record: dict[str, Any] = {
        "name": hs.name,
        "description": hs.description,
        "secret_hex": hs.secret.hex() if hs.secret is not None else None,
        "version": version,
        "kind": hs.kind,
        "client": {
            "peer_id": hs.client_id,
            "role": hs.client_role,
            "capabilities": list(hs.client_capabilities),
        },
        "server": {
            "server_id": hs.server_id,
            "incarnation": hs.incarnation,
            "capabilities": list(hs.server_capabilities),
            "max_chunk_bytes": DEFAULT_LIMITS.max_chunk_bytes,
            "max_data_connections": DEFAULT_LIMITS.max_data_connections,
        },
        "client_nonce_hex": hs.client_nonce.hex(),
        "server_nonce_hex": hs.server_nonce.hex(),
        "hello_session_hex": hs.hello_session.hex(),
        "session_hex": welcome.session.hex(),
        "transcript_hex": transcript.hex(),
        "frames": [f"{hs.name}/{name}" for name in ("hello", "auth_challenge", "auth_response", "welcome")],
    }
    if hs.secret is not None:
        record["client_mac_input_hex"] = (auth.CLIENT_LABEL + transcript).hex()
        record["client_mac_hex"] = auth.client_proof(hs.secret, hello, version, hs.server_nonce).hex()
        record["server_mac_input_hex"] = (
            auth.SERVER_LABEL + transcript + struct.pack(">H", len(welcome.session)) + welcome.session
        ).hex()
        record["server_mac_hex"] = auth.server_proof(
            hs.secret, hello, version, hs.server_nonce, welcome.session
        ).hex()
    else:
        record["client_mac_hex"] = ""
        record["server_mac_hex"] = ""
    return record


# ----------------------------------------------------------------------------- valid vectors


def _message_vector(
    name: str, message: Message, stream_id: int, receiver: str, event: str, reply: bytes = b""
) -> dict[str, Any]:
    data = frame(message, stream_id)
    return {
        "name": name,
        "frame_type": message.TYPE.name,
        "frame_type_code": int(message.TYPE),
        "stream_id": stream_id,
        "hex": data.hex(),
        "decoded": jsonable(message.to_body()),
        "receiver": receiver,
        "event": event,
        "reply_hex": reply.hex(),
    }


def _handshake_vectors(hs: HandshakeSpec, frames: list[bytes]) -> list[dict[str, Any]]:
    names = ("hello", "auth_challenge", "auth_response", "welcome")
    receivers = (
        "server:await_hello",
        "client:await_challenge",
        "server:await_response",
        "client:await_welcome",
    )
    events = ("none", "none", "HandshakeCompleted", "HandshakeCompleted")
    vectors = []
    for index, data in enumerate(frames):
        frame_type = FrameType(data[3])
        message = decode_body(frame_type, data[16:], DEFAULT_LIMITS)
        vector = _message_vector(
            f"{hs.name}/{names[index]}",
            message,
            0,
            f"{hs.name}:{receivers[index]}",
            events[index],
            frames[index + 1] if index < 3 else b"",
        )
        if vector["hex"] != data.hex():
            raise RuntimeError(f"{vector['name']}: the core's bytes differ from the encoder's")
        vectors.append(vector)
    return vectors


@dataclass(frozen=True, slots=True)
class _Transfer:
    """One small fragment stream: its header, the raw bytes, and the chunks the sender made."""

    transfer_id: int
    header: PushHeader | UpdateHeader
    raw: bytes
    chunks: list[tuple[ChunkHeader, bytes]]

    @property
    def digest(self) -> int:
        return codecs.fragment_digest(chunk.checksum for chunk, _ in self.chunks)


def _make_transfer(
    transfer_id: int,
    tensors: Sequence[tuple[str, str, Sequence[int], bytes]],
    codec: Codec,
    shuffle: int,
    make_header: Callable[[tuple[Any, ...], int, str, int], PushHeader | UpdateHeader],
) -> _Transfer:
    entries, raw_bytes = pack_manifest([(name, dtype, shape) for name, dtype, shape, _ in tensors])
    raw = bytearray(raw_bytes)
    for entry, (_, _, _, data) in zip(entries, tensors, strict=True):
        raw[entry.offset : entry.offset + len(data)] = data
    chunk_bytes = DEFAULT_LIMITS.min_chunk_bytes
    header = make_header(tuple(entries), raw_bytes, CODEC_NAMES[codec], chunk_bytes)
    chunks = []
    for seq in range(header.chunks):
        piece = bytes(raw[seq * chunk_bytes : min(raw_bytes, (seq + 1) * chunk_bytes)])
        used, used_shuffle, payload = codecs.compress(codec, piece, shuffle)
        chunks.append(
            (ChunkHeader(seq, len(piece), used, used_shuffle, codecs.checksum(piece)), bytes(payload))
        )
    return _Transfer(transfer_id, header, bytes(raw), chunks)


def _transfers() -> tuple[_Transfer, _Transfer]:
    """Transfer 1: a learner's push (lz4; the second chunk falls back to none). Transfer 2: the
    syncer's update (zstd). Odd ids are client-sent, even ids server-sent."""
    weight = float32_le([((i * 7) % 64 - 32) / 1024 for i in range(32 * 32)])
    bias = float32_le(_lcg_floats(64, seed=12345))
    push = _make_transfer(
        1,
        [
            ("blocks.0.attn.weight", "float32", (32, 32), weight),
            ("blocks.0.attn.bias", "float32", (64,), bias),
        ],
        Codec.LZ4,
        4,
        lambda m, raw_bytes, codec, chunk_bytes: PushHeader(
            m,
            raw_bytes,
            codec,
            chunk_bytes,
            fragment=5,
            round=130,
            base_version=6,
            c_steps=24,
            c_tokens=98304,
            step=3144,
            apply_late=0,
            precision="fp32",
        ),
    )
    mlp = float32_le([((i % 16) - 8) / 256 for i in range(8 * 16)])
    scale = float32_le([1.0] * 16)
    update = _make_transfer(
        2,
        [("blocks.0.mlp.weight", "float32", (8, 16), mlp), ("blocks.0.ln.weight", "float32", (16,), scale)],
        Codec.ZSTD,
        4,
        lambda m, raw_bytes, codec, chunk_bytes: UpdateHeader(
            m, raw_bytes, codec, chunk_bytes, fragment=5, version=7, precision="fp32"
        ),
    )
    expected = [(Codec.LZ4, 4), (Codec.NONE, 0)], [(Codec.ZSTD, 4)]
    for transfer, codecs_used in zip((push, update), expected, strict=True):
        if [(c.codec, c.shuffle) for c, _ in transfer.chunks] != codecs_used:
            raise RuntimeError(f"transfer {transfer.transfer_id}: chunks did not compress as planned")
    return push, update


def _join_and_plan() -> tuple[Join, Plan]:
    """A learner restarting after the syncer did, and the syncer's answer. The model is the four
    tensors of the two transfers, in module order; the two fragments are what docs/design.md §3.1's
    plan makes of them: rows 0..19 of the 32 x 32 weight, then its rows 19..32 and the other three
    tensors whole (1216 and 1232 elements)."""
    push, update = _transfers()
    model = tuple(
        ModelEntry(e.name, e.dtype, e.shape) for e in (*push.header.manifest, *update.header.manifest)
    )
    join = Join(model, incarnation="inc-0000", instance="5f0c1e2d3c4b5a69788796a5b4c3d2e1")
    fragments = (
        (("blocks.0.attn.weight", 0, 19),),
        (
            ("blocks.0.attn.weight", 19, 32),
            ("blocks.0.attn.bias", 0, 64),
            ("blocks.0.mlp.weight", 0, 8),
            ("blocks.0.ln.weight", 0, 16),
        ),
    )
    plan = Plan(
        "inc-0001", model, fragments, versions=(7, 6), sync_every=24, overlap=2, quorum=0, next_round=131
    )
    return join, plan


def _chunk_vector(name: str, transfer: _Transfer, seq: int, receiver: str) -> dict[str, Any]:
    chunk, payload = transfer.chunks[seq]
    start = seq * transfer.header.chunk_bytes
    raw = transfer.raw[start : start + chunk.raw_length]
    return {
        "name": name,
        "frame_type": FrameType.CHUNK.name,
        "frame_type_code": int(FrameType.CHUNK),
        "stream_id": transfer.transfer_id,
        "hex": chunk_frame(transfer.transfer_id, chunk, payload).hex(),
        "decoded": {
            "seq": chunk.seq,
            "raw_length": chunk.raw_length,
            "codec": CODEC_NAMES[chunk.codec],
            "codec_id": int(chunk.codec),
            "shuffle": chunk.shuffle,
            "reserved": 0,
            "checksum": chunk.checksum,
            "checksum_hex": f"{chunk.checksum:016x}",
            "payload_length": len(payload),
            "payload_hex": payload.hex(),
            "raw_hex": raw.hex(),
            "raw_float32_le": list(struct.unpack(f"<{len(raw) // 4}f", raw)),
        },
        "receiver": receiver,
        "event": "ChunkReceived",
        "reply_hex": "",
    }


def _stream_record(
    name: str, transfer: _Transfer, control: str, data: str, header: str, chunks: list[str], end: str
) -> dict[str, Any]:
    return {
        "name": name,
        "transfer_id": transfer.transfer_id,
        "receiver_control": control,
        "receiver_data": data,
        "header": header,
        "chunks": chunks,
        "end": end,
        "raw_hex": transfer.raw.hex(),
        "digest": transfer.digest,
        "digest_hex": f"{transfer.digest:016x}",
    }


def build_valid() -> dict[str, Any]:
    handshakes = []
    vectors: list[dict[str, Any]] = []
    for hs in HANDSHAKES.values():
        frames = run_handshake(hs)
        handshakes.append(_handshake_record(hs, frames))
        vectors.extend(_handshake_vectors(hs, frames))

    server_control, client_control = "control_hmac:server:open", "control_hmac:client:open"
    server_data, client_data = "data_hmac:server:open", "data_hmac:client:open"
    push, update = _transfers()
    join, plan = _join_and_plan()
    # The same learner back on the syncer's incarnation after a lost session: it holds fragment 0
    # at its current version 7 (not sent again, SPEC §4.4) and nothing of fragment 1.
    rejoin = dataclasses.replace(join, incarnation=plan.incarnation, held=(7, None))
    # The same, its session lost in the middle of fragment 1's update to version 6: of its 12
    # chunks it holds 0, 1, 2 and 9 (a resumed transfer skips them, SPEC §4.4).
    resume = dataclasses.replace(rejoin, partial=(PartialUpdate(1, 6, chunk_bitmap([0, 1, 2, 9], 12)),))
    # The update of §5 sent again to a learner that held its one chunk: header and FRAGMENT_END only.
    resumed_update = dataclasses.replace(update.header, skip=chunk_bitmap([0], update.header.chunks))
    # The push of §5 cut short after its first chunk; the syncer asks for its round again.
    push_have = chunk_bitmap([0], push.header.chunks)
    resumed_push = dataclasses.replace(push.header, skip=push_have)
    status = {
        "role": "syncer", "incarnation": "inc-0001", "round": 130, "fragments": 24,
        "learners": ["learner-3"], "versions": [7, 6], "quorum": 1, "grace_s": 0.125,
    }  # fmt: skip
    reset = StreamReset(int(ErrorCode.CHECKSUM_MISMATCH), "chunk 0: checksum of its raw bytes differs")
    error = Error(int(ErrorCode.UNKNOWN_TRANSFER), "chunks for undeclared transfer 9")
    received, went_away = "MessageReceived", "PeerWentAway"
    # fmt: off
    table: list[tuple[str, Message, int, str, str]] = [
        ("join", join, 0, server_control, received),
        ("join_rejoin", rejoin, 0, server_control, received),
        ("join_resume", resume, 0, server_control, received),
        ("plan", plan, 0, client_control, received),
        ("step_report", StepReport(1200, 4_915_200, 0.25), 0, server_control, received),
        ("fragment_request", FragmentRequest(5, 130, 6), 0, client_control, received),
        ("fragment_request_resume", FragmentRequest(3, 130, 6, push_have), 0, client_control, received),
        ("nothing_to_push", NothingToPush(5, 130, 6, 3144), 0, server_control, received),
        ("push_header", push.header, 1, server_control, received),
        ("push_header_resumed", resumed_push, 5, server_control, received),
        ("fragment_end_push", FragmentEnd(len(push.chunks), push.digest), 1, server_control, received),
        ("fragment_ack_push", FragmentAck(), 1, client_control, received),
        ("update_header", update.header, 2, client_control, received),
        ("update_header_resumed", resumed_update, 4, client_control, received),
        ("fragment_end_update", FragmentEnd(len(update.chunks), update.digest), 2, client_control, received),
        ("fragment_ack_update", FragmentAck(), 2, server_control, received),
        ("stream_reset", reset, 2, server_control, received),
        ("chunk_resend", ChunkResend(1), 1, client_control, received),
        ("ping", Ping(7), 0, server_data, received),
        ("pong", Pong(7), 0, client_data, received),
        ("status_request", StatusRequest(), 0, server_control, received),
        ("status_response", StatusResponse(status), 0, client_control, received),
        ("error", error, 0, client_data, went_away),
        ("goodbye", Goodbye("shutting down"), 0, server_control, went_away),
    ]
    # fmt: on
    vectors += [_message_vector(*row) for row in table]
    vectors += [
        _chunk_vector("chunk_lz4_shuffle4", push, 0, server_data),
        _chunk_vector("chunk_none_fallback", push, 1, server_data),
        _chunk_vector("chunk_zstd_shuffle4", update, 0, client_data),
    ]
    streams = [
        _stream_record("push_lz4", push, server_control, server_data, "push_header",
                       ["chunk_lz4_shuffle4", "chunk_none_fallback"], "fragment_end_push"),
        _stream_record("update_zstd", update, client_control, client_data, "update_header",
                       ["chunk_zstd_shuffle4"], "fragment_end_update"),
    ]  # fmt: skip
    names = {v["name"] for v in vectors}
    for stream in streams:
        if not {stream["header"], *stream["chunks"], stream["end"]} <= names:
            raise RuntimeError(f"stream {stream['name']} names a missing vector")
    return {
        "format": FORMAT,
        "generated_by": "protocol/vectors/generate.py",
        "limits": {
            **dataclasses.asdict(DEFAULT_LIMITS),
            "max_chunks_per_fragment": DEFAULT_LIMITS.max_chunks_per_fragment(),
            "max_chunk_payload_bytes": chunk_payload_bound(DEFAULT_LIMITS.max_chunk_bytes),
        },
        "states": state_table(),
        "handshakes": handshakes,
        "vectors": vectors,
        "streams": streams,
    }


# ----------------------------------------------------------------------------- invalid vectors


def _invalid(name: str, state: str, error: ErrorCode, description: str, data: bytes) -> dict[str, Any]:
    return {
        "name": name,
        "hex": data.hex(),
        "state": state,
        "error": error.name,
        "error_code": int(error),
        "description": description,
    }


def build_invalid() -> dict[str, Any]:
    return {
        "format": FORMAT,
        "generated_by": "protocol/vectors/generate.py",
        "states": state_table(),
        "vectors": _connection_vectors(),
        "chunk_decode": _chunk_decode_vectors(),
        "transfers": _transfer_vectors(),
    }


def _connection_vectors() -> list[dict[str, Any]]:
    """Bytes a Connection in the named state must answer with an ERROR frame carrying the code.

    Each is as short as the check allows: a header-level fault is just the 16-byte header, a
    sub-header fault stops after the 20-byte CHUNK sub-header, so the error falls on the last byte.
    """
    frames = {hs.name: run_handshake(hs) for hs in HANDSHAKES.values()}
    control, data, none = frames["control_hmac"], frames["data_hmac"], frames["control_none"]
    hello_body = msgpack.unpackb(control[0][16:], raw=False)
    welcome_body = msgpack.unpackb(control[3][16:], raw=False)
    data_hello = decode_body(FrameType.HELLO, data[0][16:], DEFAULT_LIMITS)
    if not isinstance(data_hello, Hello):
        raise RuntimeError("the data handshake starts without a HELLO")
    push, update = _transfers()
    push_body, update_body = push.header.to_body(), update.header.to_body()
    join, plan = _join_and_plan()
    join_body, plan_body = join.to_body(), plan.to_body()
    limits = DEFAULT_LIMITS
    lim = limits.max_chunk_bytes
    F = FrameType

    def hello_with(**changes: object) -> bytes:
        return raw_frame(F.HELLO, packb({**hello_body, **changes}))

    def push_with(**changes: object) -> bytes:
        return raw_frame(F.PUSH_HEADER, packb({**push_body, **changes}), 1)

    def join_with(**changes: object) -> bytes:
        return raw_frame(F.JOIN, packb({**join_body, **changes}))

    def update_with(**changes: object) -> bytes:
        return raw_frame(F.UPDATE_HEADER, packb({**update_body, **changes}), 2)

    def plan_with(**changes: object) -> bytes:
        return raw_frame(F.PLAN, packb({**plan_body, **changes}))

    def chunk_head(
        raw_length: int, codec: int, shuffle: int, payload_length: int, reserved: int = 0
    ) -> bytes:
        """A CHUNK header and sub-header only: the core rejects these before any payload."""
        head = raw_header(F.CHUNK, 1, CHUNK_HEADER.size + payload_length)
        return head + raw_chunk_head(0, raw_length, codec, shuffle, 0, reserved)

    no_role = raw_frame(F.HELLO, packb({k: v for k, v in hello_body.items() if k != "role"}))
    truncated = raw_frame(F.HELLO, packb(hello_body)[:-7])
    wrong_welcome = {**welcome_body, "mac": bytes(b ^ 1 for b in welcome_body["mac"])}
    other_mac = auth.server_proof(
        SECRET, data_hello, PROTOCOL_MAX_VERSION, HANDSHAKES["data_hmac"].server_nonce, OTHER_SESSION
    )
    other_session = {**msgpack.unpackb(data[3][16:], raw=False), "session": OTHER_SESSION, "mac": other_mac}
    bad_version = {"version": 4, "method": "hmac-sha256", "nonce": HANDSHAKES["control_hmac"].server_nonce}
    report = {"step": 1, "tokens": 4096}
    w, b = "blocks.0.attn.weight", "blocks.0.attn.bias"

    await_hello = "control_hmac:server:await_hello"
    await_challenge = "control_hmac:client:await_challenge"
    await_response = "control_hmac:server:await_response"
    await_welcome = "control_hmac:client:await_welcome"
    server_open = "control_hmac:server:open"
    client_open = "control_hmac:client:open"
    data_open = "data_hmac:server:open"
    E = ErrorCode
    model = [e.to_wire() for e in join.model]
    ln = "blocks.0.ln.weight"
    *fragment_0, fragment_1 = plan_body["fragments"]
    # fmt: off
    table: list[tuple[str, str, ErrorCode, str, bytes]] = [
        # --- the 16-byte header, checked before any body is buffered (SPEC §2)
        ("bad_magic", await_hello, E.BAD_MAGIC, "magic 0xD10D instead of 0xD10C",
         raw_header(F.PING, 0, 9, magic=0xD10D)),
        ("frame_version_2", await_hello, E.UNSUPPORTED_VERSION, "frame version byte 2",
         raw_header(F.HELLO, 0, 10, version=2)),
        ("nonzero_flags", server_open, E.BAD_RESERVED, "flags 0x0001 on a PING",
         raw_header(F.PING, 0, 9, flags=0x0001)),
        ("nonzero_reserved", server_open, E.BAD_RESERVED, "reserved 0x8000 on a PING",
         raw_header(F.PING, 0, 9, reserved=0x8000)),
        ("unknown_frame_type", await_hello, E.UNKNOWN_FRAME_TYPE, "frame type 0x05 is not assigned",
         raw_header(0x05, 0, 1)),
        ("stream_id_on_control_frame", server_open, E.MALFORMED_BODY, "PING with stream id 7",
         raw_header(F.PING, 7, 9)),
        ("transfer_frame_without_stream_id", server_open, E.MALFORMED_BODY, "FRAGMENT_ACK with stream id 0",
         raw_header(F.FRAGMENT_ACK, 0, 1)),
        ("handshake_body_above_4kib", await_hello, E.FRAME_TOO_LARGE, "HELLO declaring a 4097-byte body",
         raw_header(F.HELLO, 0, limits.max_handshake_body_bytes + 1)),
        ("error_body_above_4kib_before_auth", await_challenge, E.FRAME_TOO_LARGE,
         "even ERROR is capped at 4 KiB until the connection is open",
         raw_header(F.ERROR, 0, limits.max_handshake_body_bytes + 1)),
        ("control_body_above_limit", server_open, E.FRAME_TOO_LARGE, "PING declaring a 4097-byte body",
         raw_header(F.PING, 0, limits.max_message_bytes + 1)),
        ("header_body_above_limit", server_open, E.FRAME_TOO_LARGE, "PUSH_HEADER declaring 4 MiB + 1 bytes",
         raw_header(F.PUSH_HEADER, 1, limits.max_control_body_bytes + 1)),
        ("join_body_above_limit", server_open, E.FRAME_TOO_LARGE, "JOIN declaring 4 MiB + 1 bytes",
         raw_header(F.JOIN, 0, limits.max_control_body_bytes + 1)),
        ("chunk_body_above_bound", data_open, E.FRAME_TOO_LARGE,
         "CHUNK body of 20 + the payload bound of max_chunk_bytes, plus 1",
         raw_header(F.CHUNK, 1, CHUNK_HEADER.size + chunk_payload_bound(lim) + 1)),
        ("chunk_body_shorter_than_subheader", data_open, E.MALFORMED_BODY, "CHUNK declaring a 19-byte body",
         raw_header(F.CHUNK, 1, CHUNK_HEADER.size - 1)),
        # --- the state table (SPEC §8): checked right after the header, still before the body
        ("chunk_before_auth", await_hello, E.UNEXPECTED_FRAME, "CHUNK while the server awaits HELLO",
         raw_header(F.CHUNK, 1, CHUNK_HEADER.size + 4096)),
        ("auth_response_before_hello", await_hello, E.UNEXPECTED_FRAME,
         "AUTH_RESPONSE while the server awaits HELLO", raw_header(F.AUTH_RESPONSE, 0, 40)),
        ("hello_on_open_connection", server_open, E.UNEXPECTED_FRAME, "a second HELLO after the handshake",
         raw_header(F.HELLO, 0, 200)),
        ("update_header_from_client", server_open, E.UNEXPECTED_FRAME, "only the server sends UPDATE_HEADER",
         raw_header(F.UPDATE_HEADER, 1, 200)),
        ("step_report_on_data_connection", data_open, E.UNEXPECTED_FRAME, "STEP_REPORT on a data connection",
         raw_header(F.STEP_REPORT, 0, 40)),
        ("fragment_end_on_data_connection", data_open, E.UNEXPECTED_FRAME,
         "FRAGMENT_END travels on the control connection only", raw_header(F.FRAGMENT_END, 1, 20)),
        ("chunk_resend_on_data_connection", data_open, E.UNEXPECTED_FRAME,
         "CHUNK_RESEND travels on the control connection only", raw_header(F.CHUNK_RESEND, 1, 6)),
        ("chunk_resend_without_stream_id", server_open, E.MALFORMED_BODY, "CHUNK_RESEND with stream id 0",
         raw_header(F.CHUNK_RESEND, 0, 6)),
        ("plan_from_client", server_open, E.UNEXPECTED_FRAME, "only the server sends PLAN",
         raw_header(F.PLAN, 0, len(packb(plan_body)))),
        ("join_from_server", client_open, E.UNEXPECTED_FRAME, "only the client sends JOIN",
         raw_header(F.JOIN, 0, len(packb(join_body)))),
        ("join_on_data_connection", data_open, E.UNEXPECTED_FRAME,
         "JOIN travels on the control connection only", raw_header(F.JOIN, 0, len(packb(join_body)))),
        # --- control bodies (SPEC §4)
        ("hello_truncated_msgpack", await_hello, E.MALFORMED_BODY, "HELLO whose map ends 7 bytes early",
         truncated),
        ("hello_not_a_map", await_hello, E.MALFORMED_BODY, "HELLO body is an array",
         raw_frame(F.HELLO, packb([1, 1, "control"]))),
        ("hello_trailing_bytes_in_body", await_hello, E.MALFORMED_BODY, "a msgpack nil after the map",
         raw_frame(F.HELLO, packb(hello_body) + b"\xc0")),
        ("hello_wrong_typed_field", await_hello, E.MALFORMED_BODY, "min_version is a string",
         hello_with(min_version="1")),
        ("hello_bool_for_int", await_hello, E.MALFORMED_BODY, "max_version is a boolean",
         hello_with(max_version=True)),
        ("hello_missing_field", await_hello, E.MALFORMED_BODY, "HELLO without role", no_role),
        ("hello_short_nonce", await_hello, E.MALFORMED_BODY, "31-byte nonce", hello_with(nonce=bytes(31))),
        ("hello_nonce_as_string", await_hello, E.MALFORMED_BODY, "nonce sent as str, not bin",
         hello_with(nonce="0" * 32)),
        ("hello_data_without_session", await_hello, E.MALFORMED_BODY, "a data connection names its session",
         hello_with(kind="data")),
        ("hello_control_with_session", await_hello, E.MALFORMED_BODY, "a control connection names none",
         hello_with(session=SESSION)),
        ("hello_unknown_kind", await_hello, E.MALFORMED_BODY, "kind bulk", hello_with(kind="bulk")),
        ("hello_min_above_max", await_hello, E.MALFORMED_BODY, "min_version 2 above max_version 1",
         hello_with(min_version=2, max_version=1)),
        ("hello_extension_type", await_hello, E.MALFORMED_BODY, "msgpack extension types are never valid",
         hello_with(peer_id=msgpack.Timestamp(0))),
        ("hello_unsupported_version_range", await_hello, E.UNSUPPORTED_VERSION, "client 4..5, server 3..3",
         hello_with(min_version=4, max_version=5)),
        ("hello_version_1_only", await_hello, E.UNSUPPORTED_VERSION,
         "client 1..1 (PLAN of whole parameters), server 3..3", hello_with(min_version=1, max_version=1)),
        ("hello_version_2_only", await_hello, E.UNSUPPORTED_VERSION,
         "client 1..2 (stream headers without their precision), server 3..3",
         hello_with(min_version=1, max_version=2)),
        ("step_report_negative_time", server_open, E.MALFORMED_BODY, "step_time_s -0.5",
         raw_frame(F.STEP_REPORT, packb({**report, "step_time_s": -0.5}))),
        ("step_report_nan_time", server_open, E.MALFORMED_BODY, "step_time_s NaN",
         raw_frame(F.STEP_REPORT, packb({**report, "step_time_s": float("nan")}))),
        ("ping_negative_seq", server_open, E.MALFORMED_BODY, "seq is unsigned",
         raw_frame(F.PING, packb({"seq": -1}))),
        ("error_message_too_long", server_open, E.MALFORMED_BODY, "ERROR message of 1025 bytes",
         raw_frame(F.ERROR, packb({"code": 23, "message": "x" * 1025}))),
        ("fragment_end_too_many_chunks", server_open, E.MALFORMED_BODY,
         "more chunks than max_fragment_bytes / min_chunk_bytes",
         raw_frame(F.FRAGMENT_END, packb({"chunks": limits.max_chunks_per_fragment() + 1, "digest": 0}), 1)),
        # --- JOIN and PLAN bodies (SPEC §4.3): model entries are BAD_MANIFEST, structure MALFORMED_BODY
        ("join_unknown_dtype", server_open, E.BAD_MANIFEST, "a parameter of dtype float8",
         join_with(model=[*model[:3], [ln, "float8", [16]]])),
        ("join_duplicate_name", server_open, E.BAD_MANIFEST, "the same parameter name twice",
         join_with(model=[*model, model[0]])),
        ("join_empty_model", server_open, E.BAD_MANIFEST, "a model without parameters",
         join_with(model=[])),
        ("join_entry_with_offset", server_open, E.BAD_MANIFEST,
         "a stream manifest entry [name, dtype, shape, offset] where a model entry has three fields",
         join_with(model=[[ln, "float32", [16], 0]])),
        ("join_model_above_limit", server_open, E.BAD_MANIFEST,
         "a float32 tensor of 2^20 x (2^18 + 1) elements: 4 MiB above max_model_bytes (1 TiB)",
         join_with(model=[[ln, "float32", [1 << 20, (1 << 18) + 1]]])),
        ("join_incarnation_too_long", server_open, E.MALFORMED_BODY, "incarnation of 129 bytes",
         join_with(incarnation="i" * 129)),
        ("join_instance_too_long", server_open, E.MALFORMED_BODY, "instance of 65 bytes",
         join_with(instance="i" * 65)),
        ("join_held_not_array", server_open, E.MALFORMED_BODY, "held is a map", join_with(held={"0": 7})),
        ("join_held_negative", server_open, E.MALFORMED_BODY, "a held version of -1",
         join_with(held=[7, -1])),
        ("join_held_boolean", server_open, E.MALFORMED_BODY, "a held version of true",
         join_with(held=[True])),
        ("join_partial_not_array", server_open, E.MALFORMED_BODY, "partial is a map",
         join_with(partial={"1": [6, b"\x07"]})),
        ("join_partial_entry_short", server_open, E.MALFORMED_BODY, "a partial entry without its bitmap",
         join_with(partial=[[1, 6]])),
        ("join_partial_have_not_bin", server_open, E.MALFORMED_BODY, "a partial bitmap sent as a string",
         join_with(partial=[[1, 6, "\x07"]])),
        ("join_partial_twice", server_open, E.MALFORMED_BODY, "fragment 1 named twice in partial",
         join_with(partial=[[1, 6, b"\x07"], [1, 5, b"\x01"]])),
        ("update_skip_too_long", client_open, E.MALFORMED_BODY, "a skip of 2 bytes for a 1-chunk update",
         update_with(skip=b"\x01\x00")),
        ("push_skip_too_long", server_open, E.MALFORMED_BODY, "a push skip one byte longer than its chunks",
         push_with(skip=bytes(-(-push.header.chunks // 8) + 1))),
        ("fragment_request_have_too_long", client_open, E.MALFORMED_BODY,
         "a have of 2049 bytes (at most 2048)",
         raw_frame(F.FRAGMENT_REQUEST, packb({"fragment": 3, "round": 130, "version": 6,
                                              "have": bytes(MAX_HAVE_BYTES + 1)}))),
        ("update_skip_past_the_end", client_open, E.MALFORMED_BODY,
         "a skip naming chunk 1 of a 1-chunk update", update_with(skip=b"\x02")),
        ("chunk_resend_seq_above_u32", server_open, E.MALFORMED_BODY, "CHUNK_RESEND of chunk 2^32",
         raw_frame(F.CHUNK_RESEND, packb({"seq": 1 << 32}), 1)),
        ("chunk_resend_without_seq", server_open, E.MALFORMED_BODY, "CHUNK_RESEND with an empty body",
         raw_frame(F.CHUNK_RESEND, packb({}), 1)),
        ("plan_rows_in_two_fragments", client_open, E.BAD_MANIFEST,
         "rows 18..19 of blocks.0.attn.weight in fragment 0 and again in fragment 1",
         plan_with(fragments=[*fragment_0, [["blocks.0.attn.weight", 18, 32], *fragment_1[1:]]])),
        ("plan_rows_in_no_fragment", client_open, E.BAD_MANIFEST,
         "row 19 of blocks.0.attn.weight in no fragment",
         plan_with(fragments=[*fragment_0, [["blocks.0.attn.weight", 20, 32], *fragment_1[1:]]])),
        ("plan_name_in_no_fragment", client_open, E.BAD_MANIFEST, "blocks.0.ln.weight left out",
         plan_with(fragments=[*fragment_0, fragment_1[:-1]])),
        ("plan_rows_past_end", client_open, E.BAD_MANIFEST, "rows 0..17 of the 16 of blocks.0.ln.weight",
         plan_with(fragments=[*fragment_0, [*fragment_1[:-1], [ln, 0, 17]]])),
        ("plan_empty_piece", client_open, E.BAD_MANIFEST, "a piece of rows 5..5 (start must be below stop)",
         plan_with(fragments=[*fragment_0, [*fragment_1, ["blocks.0.attn.bias", 5, 5]]])),
        ("plan_unknown_name", client_open, E.BAD_MANIFEST, "a fragment names a parameter the model lacks",
         plan_with(fragments=[*fragment_0, [*fragment_1, ["blocks.1.ln.weight", 0, 16]]])),
        ("plan_names_not_pieces", client_open, E.MALFORMED_BODY,
         "protocol version 1's fragments, arrays of names, where version 2 lists [name, start, stop]",
         plan_with(fragments=[["blocks.0.attn.weight"], [e[0] for e in model[1:]]])),
        ("plan_empty_fragment", client_open, E.BAD_MANIFEST, "a third fragment with no parameters",
         plan_with(fragments=[*fragment_0, fragment_1, []], versions=[7, 6, 0])),
        ("plan_no_fragments", client_open, E.MALFORMED_BODY, "fragments is an empty array",
         plan_with(fragments=[], versions=[])),
        ("plan_versions_length_differs", client_open, E.MALFORMED_BODY, "three versions for two fragments",
         plan_with(versions=[7, 6, 5])),
        ("plan_sync_every_zero", client_open, E.MALFORMED_BODY, "sync_every (H) 0",
         plan_with(sync_every=0)),
        ("plan_quorum_negative", client_open, E.MALFORMED_BODY, "quorum (K) -1", plan_with(quorum=-1)),
        ("plan_next_round_string", client_open, E.MALFORMED_BODY, "next_round is a str",
         plan_with(next_round="131")),
        ("nothing_to_push_missing_round", server_open, E.MALFORMED_BODY, "no round",
         raw_frame(F.NOTHING_TO_PUSH, packb({"fragment": 5, "base_version": 6, "step": 3144}))),
        ("push_header_negative_step", server_open, E.MALFORMED_BODY, "step -1",
         raw_frame(F.PUSH_HEADER, packb({**push_body, "step": -1}), 1)),
        ("push_header_without_precision", server_open, E.MALFORMED_BODY,
         "no precision (protocol version 2's header)",
         raw_frame(F.PUSH_HEADER, packb({k: v for k, v in push_body.items() if k != "precision"}), 1)),
        ("push_header_unknown_precision", server_open, E.MALFORMED_BODY, "precision fp16",
         push_with(precision="fp16")),
        ("push_header_precision_not_the_manifest", server_open, E.BAD_MANIFEST,
         "precision bf16 over a manifest of float32 tensors", push_with(precision="bf16")),
        ("update_header_int8_without_scales", client_open, E.BAD_MANIFEST,
         "precision int8 over a manifest of float32 tensors", update_with(precision="int8")),
        # --- handshake and authentication (SPEC §7)
        ("auth_response_wrong_mac", await_response, E.AUTH_FAILED, "32 zero bytes instead of the proof",
         raw_frame(F.AUTH_RESPONSE, packb({"mac": bytes(32)}))),
        ("auth_response_empty_mac", await_response, E.AUTH_FAILED, "no proof; the server holds a secret",
         raw_frame(F.AUTH_RESPONSE, packb({"mac": b""}))),
        ("welcome_wrong_mac", await_welcome, E.AUTH_FAILED, "the control_hmac WELCOME, MAC bytes xor 1",
         raw_frame(F.WELCOME, packb(wrong_welcome))),
        ("challenge_method_none_to_client_with_secret", await_challenge, E.AUTH_REQUIRED,
         "downgrade: the control_none AUTH_CHALLENGE (method none)", none[1]),
        ("challenge_hmac_to_client_without_secret", "control_none:client:await_challenge", E.AUTH_REQUIRED,
         "the control_hmac AUTH_CHALLENGE to a client with no secret", control[1]),
        ("challenge_unsupported_version", await_challenge, E.UNSUPPORTED_VERSION,
         "the server picks version 4, which the client never offered",
         raw_frame(F.AUTH_CHALLENGE, packb(bad_version))),
        ("welcome_for_another_session", "data_hmac:client:await_welcome", E.UNKNOWN_SESSION,
         "data connection WELCOME naming another session, with a MAC valid for that session",
         raw_frame(F.WELCOME, packb(other_session))),
        # --- the CHUNK sub-header (SPEC §5), checked before any payload is buffered
        ("chunk_raw_length_above_limit", data_open, E.LIMIT_EXCEEDED, "raw length max_chunk_bytes + 1",
         chunk_head(lim + 1, Codec.LZ4, 0, 1000)),
        ("chunk_raw_length_zero", data_open, E.LIMIT_EXCEEDED, "raw length 0",
         chunk_head(0, Codec.LZ4, 0, 10)),
        ("chunk_uncompressed_length_mismatch", data_open, E.LENGTH_MISMATCH,
         "codec none with a 4095-byte payload for 4096 raw bytes", chunk_head(4096, Codec.NONE, 0, 4095)),
        ("chunk_payload_above_bound", data_open, E.LIMIT_EXCEEDED,
         "compressed payload of raw + raw/128 + 1024 + 1 bytes",
         chunk_head(4096, Codec.ZSTD, 0, chunk_payload_bound(4096) + 1)),
        ("chunk_shuffle_3", data_open, E.MALFORMED_BODY, "shuffle item size 3",
         chunk_head(4095, Codec.LZ4, 3, 100)),
        ("chunk_shuffle_not_dividing", data_open, E.LENGTH_MISMATCH, "shuffle item size 4, 4098 raw bytes",
         chunk_head(4098, Codec.ZSTD, 4, 100)),
        ("chunk_unknown_codec", data_open, E.UNSUPPORTED_CODEC, "codec 3", chunk_head(4096, 3, 0, 100)),
        ("chunk_reserved_nonzero", data_open, E.BAD_RESERVED, "sub-header reserved field 1",
         chunk_head(4096, Codec.LZ4, 0, 100, reserved=1)),
        # --- fragment stream headers and manifests (SPEC §5)
        ("manifest_overlapping_offsets", server_open, E.BAD_MANIFEST,
         "the bias starts at 4032, inside the weight (bytes 0..4096)",
         push_with(manifest=[[w, "float32", [32, 32], 0], [b, "float32", [64], 4032]])),
        ("manifest_misaligned_offset", server_open, E.BAD_MANIFEST, "float32 tensor at offset 2",
         push_with(manifest=[[w, "float32", [32, 32], 2]])),
        ("manifest_unknown_dtype", server_open, E.BAD_MANIFEST, "dtype float8",
         push_with(manifest=[[w, "float8", [32, 32], 0]])),
        ("manifest_past_raw_bytes", server_open, E.BAD_MANIFEST, "an 8192-byte tensor in 4352 bytes",
         push_with(manifest=[[w, "float32", [32, 64], 0]])),
        ("manifest_duplicate_name", server_open, E.BAD_MANIFEST, "the same name twice",
         push_with(manifest=[[w, "float32", [16], 0], [w, "float32", [16], 64]])),
        ("manifest_rank_9", server_open, E.BAD_MANIFEST, "a rank-9 shape",
         push_with(manifest=[[w, "float32", [1] * 9, 0]])),
        ("manifest_not_an_array", server_open, E.BAD_MANIFEST, "manifest is a map",
         push_with(manifest={"w": 1})),
        ("stream_chunk_bytes_below_minimum", server_open, E.LIMIT_EXCEEDED, "chunk_bytes 4095",
         push_with(chunk_bytes=limits.min_chunk_bytes - 1)),
        ("stream_unknown_codec_name", server_open, E.MALFORMED_BODY, "codec brotli",
         push_with(codec="brotli")),
    ]
    # fmt: on
    vectors = [_invalid(*row) for row in table]
    deviation = _invalid(
        "manifest_dtype_not_a_string", server_open, E.BAD_MANIFEST, "dtype is an array",
        push_with(manifest=[[w, ["float32"], [32, 32], 0]]),
    )  # fmt: skip
    return [*vectors, deviation]


def _chunk_decode_vectors() -> list[dict[str, Any]]:
    """CHUNK frames a connection accepts whose payload then fails to decode or verify."""
    push, _ = _transfers()
    chunk, payload = push.chunks[0]
    plain = push.raw[: chunk.raw_length]
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False)
    sized = zstandard.ZstdCompressor(level=1)
    state, E = "data_hmac:server:open", ErrorCode

    def head(raw_length: int, codec: Codec, checksum: int) -> ChunkHeader:
        return ChunkHeader(0, raw_length, codec, 0, checksum)

    # fmt: off
    table: list[tuple[str, ErrorCode, str, ChunkHeader, bytes]] = [
        ("checksum_mismatch_lz4", E.CHECKSUM_MISMATCH, "the lz4 vector chunk, checksum low bit flipped",
         dataclasses.replace(chunk, checksum=chunk.checksum ^ 1), payload),
        ("checksum_mismatch_none", E.CHECKSUM_MISMATCH, "an uncompressed chunk with a wrong checksum",
         head(64, Codec.NONE, codecs.checksum(plain[:64]) ^ 1), plain[:64]),
        ("lz4_garbage", E.LENGTH_MISMATCH, "an lz4 payload of zero bytes, not a valid block",
         chunk, bytes(len(payload))),
        ("lz4_decodes_short", E.LENGTH_MISMATCH, "an lz4 block of 2048 bytes in a chunk declaring 4096",
         chunk, lz4.block.compress(plain[:2048], store_size=False)),
        ("zstd_declared_size_differs", E.LENGTH_MISMATCH,
         "a zstd frame whose content size field says 4097 in a chunk declaring 4096",
         head(4096, Codec.ZSTD, chunk.checksum), sized.compress(plain + b"\0")),
        ("zstd_decodes_long", E.LENGTH_MISMATCH,
         "a zstd frame without content size that inflates to 4096 bytes in a chunk declaring 2048",
         head(2048, Codec.ZSTD, codecs.checksum(plain[:2048])), unsized.compress(plain)),
        ("zstd_trailing_bytes", E.LENGTH_MISMATCH, "a valid zstd frame followed by 3 stray bytes",
         head(4096, Codec.ZSTD, chunk.checksum), unsized.compress(plain) + b"\x01\x02\x03"),
    ]
    # fmt: on
    vectors = [_invalid(name, state, error, text, chunk_frame(1, h, p)) for name, error, text, h, p in table]
    return vectors


def _transfer_vectors() -> list[dict[str, Any]]:
    """Frame sequences a session accepts frame by frame whose transfer bookkeeping then fails."""
    push, _ = _transfers()
    header = frame(push.header, 1)
    chunks = [chunk_frame(1, c, p) for c, p in push.chunks]
    end = frame(FragmentEnd(len(push.chunks), push.digest), 1)
    c0, p0 = push.chunks[0]
    seq_2 = chunk_frame(1, dataclasses.replace(c0, seq=2), p0)
    too_long = chunk_frame(1, ChunkHeader(1, 4096, Codec.NONE, 0, 0), bytes(4096))
    bad_end = frame(FragmentEnd(len(push.chunks), push.digest ^ 1), 1)
    ctl, dat, E = "control", "data", ErrorCode
    # fmt: off
    table: list[tuple[str, ErrorCode, str, list[tuple[str, bytes]]]] = [
        ("digest_mismatch", E.DIGEST_MISMATCH, "FRAGMENT_END digest with its low bit flipped",
         [(ctl, header), (dat, chunks[0]), (dat, chunks[1]), (ctl, bad_end)]),
        ("end_chunk_count_differs", E.LENGTH_MISMATCH, "FRAGMENT_END counts 3 chunks, the header implies 2",
         [(ctl, header), (ctl, frame(FragmentEnd(3, 0), 1))]),
        ("end_for_unknown_transfer", E.UNKNOWN_TRANSFER, "FRAGMENT_END for a transfer no header opened",
         [(ctl, end)]),
        ("duplicate_transfer_id", E.DUPLICATE_TRANSFER, "a completed transfer id opened again",
         [(ctl, header), (dat, chunks[0]), (dat, chunks[1]), (ctl, end), (ctl, header)]),
        ("transfer_id_decreasing", E.DUPLICATE_TRANSFER, "a header for transfer 1 after one for transfer 3",
         [(ctl, frame(push.header, 3)), (ctl, header)]),
        ("chunk_seq_out_of_range", E.LENGTH_MISMATCH, "chunk 2 of a 2-chunk fragment",
         [(ctl, header), (dat, seq_2)]),
        ("chunk_raw_length_wrong_for_seq", E.LENGTH_MISMATCH, "chunk 1 covers 256 raw bytes, not 4096",
         [(ctl, header), (dat, too_long)]),
    ]
    # fmt: on
    return [
        {
            "name": name,
            "state": {"control": "control_hmac:server:open", "data": "data_hmac:server:open"},
            "frames": [{"connection": conn, "hex": data.hex()} for conn, data in steps],
            "error": error.name,
            "error_code": int(error),
            "description": text,
        }
        for name, error, text, steps in table
    ]


# ----------------------------------------------------------------------------- output


def build() -> tuple[dict[str, Any], dict[str, Any]]:
    return build_valid(), build_invalid()


def render(document: dict[str, Any]) -> str:
    """JSON with one key per line, but arrays of scalars (shapes, float lists) kept on one line."""
    return _dump(document, "") + "\n"


def _dump(value: object, indent: str) -> str:
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {_dump(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        return "[\n" + ",\n".join(inner + _dump(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value, ensure_ascii=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the files on disk; write nothing")
    args = parser.parse_args(argv)
    valid, invalid = build()
    outputs = {VALID_PATH: render(valid), INVALID_PATH: render(invalid)}
    if args.check:
        stale = [p.name for p, text in outputs.items() if not p.exists() or p.read_text() != text]
        if stale:
            print(
                f"stale vectors: {', '.join(stale)}; run python protocol/vectors/generate.py", file=sys.stderr
            )
            return 1
        return 0
    for path, text in outputs.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
