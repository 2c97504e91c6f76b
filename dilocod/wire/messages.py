"""Typed control messages and their msgpack bodies (protocol/SPEC.md §4).

Each message is a frozen dataclass with the frame type it travels in; bodies are msgpack maps with
short string keys, decoded with every container and string bounded by Limits, and each field's
type checked. Tensor payloads never travel in here. Must not import asyncio, socket, torch or logging.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack

from dilocod.wire.choices import PRECISIONS
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.frames import CODECS_BY_NAME, FrameType
from dilocod.wire.layouts import layout_fault
from dilocod.wire.limits import DEFAULT_LIMITS, Limits
from dilocod.wire.manifest import (
    ModelEntry,
    TensorEntry,
    fragment_manifest,
    parse_manifest,
    parse_model,
    piece_rows,
)

NONCE_BYTES = 32
SESSION_ID_BYTES = 16
MAC_BYTES = 32
CONNECTION_KINDS = ("control", "data")
AUTH_METHODS = ("hmac-sha256", "none")
U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
#: JOIN and PLAN name a syncer incarnation in at most this many UTF-8 bytes.
MAX_INCARNATION_BYTES = 128
#: JOIN's learner instance, in at most this many UTF-8 bytes.
MAX_INSTANCE_BYTES = 64
#: PLAN's quorum for lock-step: every live learner (K = M).
QUORUM_ALL = 0


def _malformed(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.MALFORMED_BODY, message)


class _Body:
    """Typed accessors over a decoded msgpack map; every miss is the peer's fault."""

    def __init__(self, name: str, raw: object) -> None:
        if not isinstance(raw, dict):
            raise _malformed(f"{name} body must be a map")
        self.name = name
        self.raw = raw

    def _get(self, key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in self.raw:
            raise _malformed(f"{self.name}: missing field {key!r}")
        value = self.raw[key]
        # bool is an int in Python; a field that wants an int must not accept True.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise _malformed(f"{self.name}.{key}: expected {kind}, got {type(value).__name__}")
        return value

    def uint(self, key: str, maximum: int = U64_MAX) -> int:
        value = self._get(key, int)
        if not 0 <= value <= maximum:
            raise _malformed(f"{self.name}.{key}: {value} outside 0..{maximum}")
        return value

    def number(self, key: str, maximum: float = math.inf) -> float:
        value = self._get(key, (int, float))
        if isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise _malformed(f"{self.name}.{key}: must be a finite non-negative number")
        if value > maximum:
            raise _malformed(f"{self.name}.{key}: {value:g} outside 0..{maximum:g}")
        return float(value)

    def text(self, key: str, max_bytes: int, choices: tuple[str, ...] | None = None) -> str:
        value = self._get(key, str)
        if len(value.encode()) > max_bytes:
            raise _malformed(f"{self.name}.{key}: longer than {max_bytes} bytes")
        if choices is not None and value not in choices:
            raise _malformed(f"{self.name}.{key}: {value!r} not one of {choices}")
        return value

    def optional_uint(self, key: str, maximum: int = U64_MAX) -> int | None:
        """An optional uint field (SPEC §4.1): None when absent, checked like uint() when present."""
        return self.uint(key, maximum) if key in self.raw else None

    def optional_text(self, key: str, max_bytes: int) -> str:
        """An optional str field (SPEC §4.1): "" when absent, checked like text() when present."""
        return self.text(key, max_bytes) if key in self.raw else ""

    def blob(self, key: str, sizes: tuple[int, ...]) -> bytes:
        value = self._get(key, bytes)
        if len(value) not in sizes:
            raise _malformed(f"{self.name}.{key}: {len(value)} bytes, expected one of {sizes}")
        return value

    def texts(self, key: str, max_items: int, max_bytes: int) -> tuple[str, ...]:
        value = self._get(key, list)
        if len(value) > max_items or not all(
            isinstance(v, str) and len(v.encode()) <= max_bytes for v in value
        ):
            raise _malformed(f"{self.name}.{key}: at most {max_items} strings of {max_bytes} bytes")
        return tuple(value)


@dataclass(frozen=True, slots=True)
class Hello:
    """First frame from the dialing side of every connection."""

    TYPE: ClassVar[FrameType] = FrameType.HELLO
    min_version: int
    max_version: int
    kind: str
    role: str
    peer_id: str
    nonce: bytes
    session: bytes = b""
    capabilities: tuple[str, ...] = ()

    def to_body(self) -> dict[str, Any]:
        return {
            "min_version": self.min_version,
            "max_version": self.max_version,
            "kind": self.kind,
            "role": self.role,
            "peer_id": self.peer_id,
            "nonce": self.nonce,
            "session": self.session,
            "capabilities": list(self.capabilities),
        }

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> Hello:
        min_version, max_version = b.uint("min_version", 255), b.uint("max_version", 255)
        if min_version > max_version:
            raise _malformed("HELLO: min_version above max_version")
        kind = b.text("kind", 16, CONNECTION_KINDS)
        session = b.blob("session", (0, SESSION_ID_BYTES))
        if (kind == "data") != bool(session):
            raise _malformed("HELLO: data connections name their session, control ones do not")
        return cls(
            min_version,
            max_version,
            kind,
            b.text("role", 32),
            b.text("peer_id", limits.max_peer_id_bytes),
            b.blob("nonce", (NONCE_BYTES,)),
            session,
            b.texts("capabilities", 32, 32),
        )


@dataclass(frozen=True, slots=True)
class AuthChallenge:
    TYPE: ClassVar[FrameType] = FrameType.AUTH_CHALLENGE
    version: int
    method: str
    nonce: bytes

    def to_body(self) -> dict[str, Any]:
        return {"version": self.version, "method": self.method, "nonce": self.nonce}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> AuthChallenge:
        return cls(
            b.uint("version", 255), b.text("method", 32, AUTH_METHODS), b.blob("nonce", (NONCE_BYTES,))
        )


@dataclass(frozen=True, slots=True)
class AuthResponse:
    TYPE: ClassVar[FrameType] = FrameType.AUTH_RESPONSE
    mac: bytes

    def to_body(self) -> dict[str, Any]:
        return {"mac": self.mac}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> AuthResponse:
        return cls(b.blob("mac", (0, MAC_BYTES)))


@dataclass(frozen=True, slots=True)
class Welcome:
    TYPE: ClassVar[FrameType] = FrameType.WELCOME
    session: bytes
    server_id: str
    incarnation: str
    mac: bytes
    capabilities: tuple[str, ...] = ()
    max_chunk_bytes: int = 0
    max_data_connections: int = 0

    def to_body(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "server_id": self.server_id,
            "incarnation": self.incarnation,
            "mac": self.mac,
            "capabilities": list(self.capabilities),
            "max_chunk_bytes": self.max_chunk_bytes,
            "max_data_connections": self.max_data_connections,
        }

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> Welcome:
        return cls(
            b.blob("session", (SESSION_ID_BYTES,)),
            b.text("server_id", 128),
            b.text("incarnation", 64),
            b.blob("mac", (0, MAC_BYTES)),
            b.texts("capabilities", 32, 32),
            b.uint("max_chunk_bytes", 2**32 - 1),
            b.uint("max_data_connections", 65535),
        )


@dataclass(frozen=True, slots=True)
class StepReport:
    TYPE: ClassVar[FrameType] = FrameType.STEP_REPORT
    step: int
    tokens: int
    step_time_s: float

    def to_body(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens, "step_time_s": self.step_time_s}

    @classmethod
    def within(
        cls, step: int, tokens: int, step_time_s: float, limits: Limits = DEFAULT_LIMITS
    ) -> StepReport:
        """The report an honest learner sends: each number brought into the range the syncer
        accepts, so that an odd one never costs the learner its session (a step that lasted longer
        than a day, e.g. a suspended host, is reported as a day; a clock that went back, as 0)."""
        if not math.isfinite(step_time_s):
            step_time_s = limits.max_step_time_s if step_time_s > 0 else 0.0
        return cls(
            min(max(step, 0), limits.max_reported_steps),
            min(max(tokens, 0), limits.max_step_tokens),
            min(max(step_time_s, 0.0), limits.max_step_time_s),
        )

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> StepReport:
        return cls(
            b.uint("step", limits.max_reported_steps),
            b.uint("tokens", limits.max_step_tokens),
            b.number("step_time_s", limits.max_step_time_s),
        )


@dataclass(frozen=True, slots=True)
class FragmentRequest:
    TYPE: ClassVar[FrameType] = FrameType.FRAGMENT_REQUEST
    fragment: int
    round: int
    version: int
    #: The chunks the syncer holds of this learner's push for this round that a lost session cut
    #: short (a chunk_bitmap; optional on the wire, b"" for none): the same push sent again may
    #: skip them (PushHeader.skip, SPEC §4.4).
    have: bytes = b""

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"fragment": self.fragment, "round": self.round, "version": self.version}
        if self.have:
            body["have"] = self.have
        return body

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> FragmentRequest:
        fragment, round_, version = b.uint("fragment", 2**32 - 1), b.uint("round"), b.uint("version")
        have = b._get("have", bytes) if "have" in b.raw else b""
        if len(have) > MAX_HAVE_BYTES:
            raise _malformed(f"FRAGMENT_REQUEST.have: {len(have)} bytes, at most {MAX_HAVE_BYTES}")
        return cls(fragment, round_, version, have)


@dataclass(frozen=True, slots=True)
class Join:
    """A learner's first word on an open session: its model, and whose fragments it holds."""

    TYPE: ClassVar[FrameType] = FrameType.JOIN
    model: tuple[ModelEntry, ...]
    #: The syncer incarnation the learner last adopted fragments from; "" when it has none.
    incarnation: str = ""
    #: The learner process's own id, kept across its reconnects (optional on the wire; "" for none):
    #: how the syncer tells the same learner coming back from another one under its id.
    instance: str = ""
    #: The version of each fragment the learner holds from `incarnation`, by that incarnation's
    #: fragment index, None where it holds none (optional on the wire; () for none): a syncer of
    #: that incarnation skips the heal of every fragment held at its current version (SPEC §4.4).
    held: tuple[int | None, ...] = ()
    #: Updates from `incarnation` cut short by a lost session, with the chunks the learner holds of
    #: each (optional on the wire; () for none): a syncer of that incarnation sending the same
    #: version again sends only the other chunks (UpdateHeader.skip, SPEC §4.4).
    partial: tuple[PartialUpdate, ...] = ()

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": [e.to_wire() for e in self.model],
            "incarnation": self.incarnation,
            "instance": self.instance,
        }
        if self.held:
            body["held"] = list(self.held)
        if self.partial:
            body["partial"] = [[u.fragment, u.version, u.have] for u in self.partial]
        return body

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> Join:
        return cls(
            parse_model(b.raw.get("model"), limits),
            b.text("incarnation", MAX_INCARNATION_BYTES),
            b.optional_text("instance", MAX_INSTANCE_BYTES),
            _parse_held(b, limits),
            _parse_partial(b, limits),
        )


@dataclass(frozen=True, slots=True)
class PartialUpdate:
    """JOIN.partial's entry: of the update carrying `version` of `fragment`, the learner holds the
    chunks whose bits are set in `have` (chunk_bitmap), each verified on arrival."""

    fragment: int
    version: int
    have: bytes


#: The longest chunk bitmap JOIN.partial and FRAGMENT_REQUEST.have carry (16,384 chunks: 16 GiB at
#: the default 1 MiB chunk), so a request stays a small message (max_message_bytes); a transfer
#: of more chunks is not offered for resuming, and goes again whole.
MAX_HAVE_BYTES = 2048


def chunk_bitmap(seqs: Iterable[int], chunks: int) -> bytes:
    """Chunk sequence numbers as a bitmap: bit seq % 8 (least significant first) of byte seq // 8,
    ceil(chunks / 8) bytes (JOIN.partial's `have`, UPDATE_HEADER's `skip`)."""
    bitmap = bytearray(-(-chunks // 8))
    for seq in seqs:
        if not 0 <= seq < chunks:
            raise ValueError(f"chunk {seq} outside 0..{chunks - 1}")
        bitmap[seq // 8] |= 1 << (seq % 8)
    return bytes(bitmap)


def bitmap_chunks(bitmap: bytes) -> list[int]:
    """The sequence numbers whose bits a chunk bitmap sets, in order."""
    return [i * 8 + bit for i, byte in enumerate(bitmap) if byte for bit in range(8) if byte >> bit & 1]


def fits_chunks(bitmap: bytes, chunks: int) -> bool:
    """Whether a bitmap is one of a transfer of `chunks` chunks: its length, and no bit past the end."""
    return len(bitmap) == -(-chunks // 8) and (chunks % 8 == 0 or not bitmap[-1] >> (chunks % 8))


def held_current(join: Join, plan: Plan) -> frozenset[int]:
    """The fragments whose healing transfer the syncer skips (SPEC §4.4): JOIN names the PLAN's own
    incarnation and holds the fragment at the version PLAN gives it. Both ends decide with this."""
    if not join.held or join.incarnation != plan.incarnation:
        return frozenset()
    return frozenset(
        p for p, (held, current) in enumerate(zip(join.held, plan.versions, strict=False)) if held == current
    )


def _per_fragment(b: _Body, key: str, limits: Limits) -> list[Any]:
    """An optional JOIN list of at most one entry per fragment: [] when absent; more than
    max_fragments entries is LIMIT_EXCEEDED, counted before any entry is looked at."""
    if key not in b.raw:
        return []
    entries = b._get(key, list)
    if len(entries) > limits.max_fragments:
        raise RemoteProtocolError(
            ErrorCode.LIMIT_EXCEEDED, f"JOIN.{key}: {len(entries)} entries, limit {limits.max_fragments}"
        )
    return entries


def _parse_partial(b: _Body, limits: Limits) -> tuple[PartialUpdate, ...]:
    """JOIN.partial (optional, absent = none): at most max_fragments entries (LIMIT_EXCEEDED,
    counted first), each [fragment u32, version u64, have bin] with `have` at most MAX_HAVE_BYTES,
    and at most one entry per fragment (MALFORMED_BODY).
    Whether `have` fits the fragment is the syncer's to decide (it sends whole what does not)."""
    max_have = MAX_HAVE_BYTES
    partial = []
    for entry in _per_fragment(b, "partial", limits):
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and type(entry[0]) is int
            and 0 <= entry[0] <= 2**32 - 1
            and type(entry[1]) is int
            and 0 <= entry[1] <= U64_MAX
            and isinstance(entry[2], bytes)
            and len(entry[2]) <= max_have
        ):
            raise _malformed(
                f"JOIN.partial: each entry [fragment u32, version u64, have bin of at most {max_have} bytes]"
            )
        partial.append(PartialUpdate(entry[0], entry[1], entry[2]))
    if len({u.fragment for u in partial}) != len(partial):
        raise _malformed("JOIN.partial: a fragment named twice")
    return tuple(partial)


def _parse_held(b: _Body, limits: Limits) -> tuple[int | None, ...]:
    """JOIN.held (optional, absent = none): at most max_fragments entries (LIMIT_EXCEEDED, counted
    first), each a u64 or nil (MALFORMED_BODY)."""
    held = _per_fragment(b, "held", limits)
    if not all(v is None or (type(v) is int and 0 <= v <= U64_MAX) for v in held):
        raise _malformed("JOIN.held: each entry a u64 version or nil")
    return tuple(held)


@dataclass(frozen=True, slots=True)
class Plan:
    """The syncer's answer to JOIN: its model, how it is cut into fragments, each fragment's
    version, and the schedule (H = sync_every, tau = overlap, K = quorum; quorum QUORUM_ALL is
    lock-step: every live learner)."""

    TYPE: ClassVar[FrameType] = FrameType.PLAN
    incarnation: str
    model: tuple[ModelEntry, ...]
    #: Pieces (name, start, stop) per fragment: rows [start, stop) of a parameter along dim 0;
    #: together they cover every row of every parameter exactly once (protocol/SPEC.md §4.4).
    fragments: tuple[tuple[tuple[str, int, int], ...], ...]
    versions: tuple[int, ...]
    sync_every: int
    overlap: int
    quorum: int
    #: The first round the syncer may open after this PLAN (optional on the wire; 0 when absent):
    #: a lock-step learner waits at a round's due step only for rounds from here on.
    next_round: int = 0

    @property
    def lockstep(self) -> bool:
        return self.quorum == QUORUM_ALL

    def to_body(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "model": [e.to_wire() for e in self.model],
            "fragments": [[[n, start, stop] for n, start, stop in pieces] for pieces in self.fragments],
            "versions": list(self.versions),
            "sync_every": self.sync_every,
            "overlap": self.overlap,
            "quorum": self.quorum,
            "next_round": self.next_round,
        }

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> Plan:
        incarnation = b.text("incarnation", MAX_INCARNATION_BYTES)
        model = parse_model(b.raw.get("model"), limits)
        fragments = _parse_fragments(b, model, limits)
        versions = b._get("versions", list)
        if len(versions) != len(fragments) or not all(type(v) is int and 0 <= v <= U64_MAX for v in versions):
            raise _malformed(f"PLAN.versions: one u64 per fragment ({len(fragments)}) expected")
        sync_every = b.uint("sync_every", U32_MAX)
        overlap = b.uint("overlap", U32_MAX)
        quorum = b.uint("quorum", U32_MAX)
        if sync_every < 1:
            raise _malformed("PLAN: sync_every must be at least 1")
        next_round = b.optional_uint("next_round") or 0
        return cls(incarnation, model, fragments, tuple(versions), sync_every, overlap, quorum, next_round)


def _parse_fragments(
    b: _Body, model: tuple[ModelEntry, ...], limits: Limits
) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """PLAN.fragments: first its shape (MALFORMED_BODY, or LIMIT_EXCEEDED for too many), then
    whether its pieces tile the model (BAD_MANIFEST): every piece [name, start, stop] names a
    parameter, 0 <= start < stop <= its rows (piece_rows: a tensor without rows is [0, 1)), no
    fragment is empty, and each parameter's pieces cover its rows exactly once."""
    raw = b._get("fragments", list)
    if len(raw) > limits.max_fragments:
        raise RemoteProtocolError(
            ErrorCode.LIMIT_EXCEEDED, f"PLAN declares {len(raw)} fragments, limit {limits.max_fragments}"
        )
    if not raw:
        raise _malformed("PLAN.fragments: at least one fragment expected")
    if any(isinstance(pieces, list) and len(pieces) > limits.max_tensors_per_fragment for pieces in raw):
        most = limits.max_tensors_per_fragment
        raise RemoteProtocolError(ErrorCode.LIMIT_EXCEEDED, f"PLAN: a fragment of more than {most} pieces")
    # A name longer than max_name_bytes is in no model; refusing it here also keeps what an error
    # message may quote short.
    if not all(
        isinstance(pieces, list)
        and all(
            isinstance(p, list)
            and len(p) == 3
            and isinstance(p[0], str)
            and len(p[0].encode()) <= limits.max_name_bytes
            and type(p[1]) is int
            and type(p[2]) is int
            for p in pieces
        )
        for pieces in raw
    ):
        raise _malformed(
            "PLAN.fragments: each must be an array of pieces [name, start, stop], names of at most "
            f"{limits.max_name_bytes} bytes, start and stop integers"
        )
    rows = {entry.name: piece_rows(entry.shape) for entry in model}
    spans: dict[str, list[tuple[int, int]]] = {name: [] for name in rows}
    for index, pieces in enumerate(raw):
        if not pieces:
            raise RemoteProtocolError(ErrorCode.BAD_MANIFEST, f"fragment {index} is empty")
        for name, start, stop in pieces:
            if name not in rows:
                raise RemoteProtocolError(ErrorCode.BAD_MANIFEST, f"fragment {index}: unknown name {name!r}")
            if not 0 <= start < stop <= rows[name]:
                raise RemoteProtocolError(
                    ErrorCode.BAD_MANIFEST,
                    f"fragment {index}: rows [{start}, {stop}) of {name!r}, which has {rows[name]}",
                )
            spans[name].append((start, stop))
    shapes = {entry.name: entry.shape for entry in model}
    for index, pieces in enumerate(raw):
        raw_bytes = fragment_manifest(pieces, shapes)[1]
        if raw_bytes > limits.max_fragment_bytes:
            raise RemoteProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"fragment {index}: {raw_bytes} bytes in float32, limit {limits.max_fragment_bytes}",
            )
    for entry in model:
        covered = 0
        for start, stop in sorted(spans[entry.name]):
            if start != covered:
                what = "overlap" if start < covered else "leave a gap"
                row = min(start, covered)
                raise RemoteProtocolError(
                    ErrorCode.BAD_MANIFEST, f"the pieces of {entry.name!r} {what} at row {row}"
                )
            covered = stop
        if covered != rows[entry.name]:
            raise RemoteProtocolError(
                ErrorCode.BAD_MANIFEST,
                f"the pieces of {entry.name!r} cover {covered} of its {rows[entry.name]} rows",
            )
    return tuple(tuple((name, start, stop) for name, start, stop in pieces) for pieces in raw)


@dataclass(frozen=True, slots=True)
class StreamHeader:
    """What both fragment stream headers share: the layout of the bytes that follow."""

    manifest: tuple[TensorEntry, ...]
    raw_bytes: int
    codec: str
    chunk_bytes: int

    if TYPE_CHECKING:  # not fields here: each header type declares them as its last two fields
        #: The wire precision the manifest lays the values out at (wire.choices.PRECISIONS): the
        #: receiver reads it, never infers it from the manifest.
        precision: str
        #: Chunks not sent (a chunk_bitmap; optional on the wire, b"" for none): the receiver holds
        #: them from a transfer of the same bytes that a lost session cut short (SPEC §4.4).
        skip: bytes

    @property
    def chunks(self) -> int:
        return -(-self.raw_bytes // self.chunk_bytes)

    @property
    def skipped(self) -> list[int]:
        return bitmap_chunks(self.skip)

    @property
    def skipped_bytes(self) -> int:
        """The raw bytes of the skipped chunks (the last chunk may be short)."""
        seqs = self.skipped
        total = len(seqs) * self.chunk_bytes
        if seqs and seqs[-1] == self.chunks - 1:
            total -= self.chunks * self.chunk_bytes - self.raw_bytes
        return total

    def skip_body(self, body: dict[str, Any]) -> dict[str, Any]:
        body["precision"] = self.precision
        if self.skip:
            body["skip"] = self.skip
        return body

    @staticmethod
    def parse_precision(b: _Body, manifest: tuple[TensorEntry, ...]) -> str:
        """`precision`: one of wire.choices.PRECISIONS (MALFORMED_BODY), whose layout the
        manifest's dtypes must be (BAD_MANIFEST)."""
        precision = b.text("precision", 8, PRECISIONS)
        fault = layout_fault(manifest, precision)
        if fault is not None:
            raise RemoteProtocolError(ErrorCode.BAD_MANIFEST, f"{b.name}.manifest: {fault}")
        return precision

    @staticmethod
    def parse_skip(b: _Body, raw_bytes: int, chunk_bytes: int) -> bytes:
        """`skip` (optional): a bitmap of exactly the transfer's chunks (MALFORMED_BODY)."""
        skip = b._get("skip", bytes) if "skip" in b.raw else b""
        chunks = -(-raw_bytes // chunk_bytes)
        if skip and not fits_chunks(skip, chunks):
            raise _malformed(f"{b.name}.skip: not a bitmap of {chunks} chunks ({len(skip)} bytes)")
        return skip

    def stream_body(self) -> dict[str, Any]:
        return {
            "manifest": [e.to_wire() for e in self.manifest],
            "raw_bytes": self.raw_bytes,
            "codec": self.codec,
            "chunk_bytes": self.chunk_bytes,
        }

    @staticmethod
    def parse_stream(b: _Body, limits: Limits) -> tuple[tuple[TensorEntry, ...], int, str, int]:
        raw_bytes = b.uint("raw_bytes", limits.max_fragment_bytes)
        chunk_bytes = b.uint("chunk_bytes", limits.max_chunk_bytes)
        if chunk_bytes < limits.min_chunk_bytes:
            raise RemoteProtocolError(
                ErrorCode.LIMIT_EXCEEDED, f"chunk_bytes {chunk_bytes} below {limits.min_chunk_bytes}"
            )
        codec = b.text("codec", 16, tuple(CODECS_BY_NAME))
        manifest = parse_manifest(b.raw.get("manifest"), raw_bytes, limits)
        return manifest, raw_bytes, codec, chunk_bytes


@dataclass(frozen=True, slots=True)
class PushHeader(StreamHeader):
    """A learner's outer gradient for one fragment follows as chunks of this transfer."""

    TYPE: ClassVar[FrameType] = FrameType.PUSH_HEADER
    fragment: int = 0
    round: int = 0
    base_version: int = 0
    c_steps: int = 0
    c_tokens: int = 0
    #: Optional (None: not sent): the learner's step at the snapshot, and how many steps late it
    #: applied the fragment's previous merge; the syncer's status reports both as lateness.
    step: int | None = None
    apply_late: int | None = None
    precision: str = "fp32"  # StreamHeader.precision: the learner's --precision
    skip: bytes = b""  # StreamHeader.skip: the chunks of that round's push FRAGMENT_REQUEST.have named

    def to_body(self) -> dict[str, Any]:
        body = {
            **self.stream_body(),
            "fragment": self.fragment,
            "round": self.round,
            "base_version": self.base_version,
            "c_steps": self.c_steps,
            "c_tokens": self.c_tokens,
        }
        if self.step is not None:
            body["step"] = self.step
        if self.apply_late is not None:
            body["apply_late"] = self.apply_late
        return self.skip_body(body)

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> PushHeader:
        stream = cls.parse_stream(b, limits)
        return cls(
            *stream,
            fragment=b.uint("fragment", 2**32 - 1),
            round=b.uint("round"),
            base_version=b.uint("base_version"),
            c_steps=b.uint("c_steps", limits.max_reported_steps),
            c_tokens=b.uint("c_tokens", limits.max_push_tokens),
            step=b.optional_uint("step", limits.max_reported_steps),
            apply_late=b.optional_uint("apply_late", limits.max_reported_steps),
            precision=cls.parse_precision(b, stream[0]),
            skip=cls.parse_skip(b, stream[1], stream[3]),
        )


@dataclass(frozen=True, slots=True)
class NothingToPush:
    """A learner's answer to FRAGMENT_REQUEST when it trained no step since its last push of the
    fragment: no outer gradient follows, and the round need not wait for one."""

    TYPE: ClassVar[FrameType] = FrameType.NOTHING_TO_PUSH
    fragment: int
    round: int
    base_version: int
    #: The learner's step at the boundary that answered.
    step: int

    def to_body(self) -> dict[str, Any]:
        return {
            "fragment": self.fragment,
            "round": self.round,
            "base_version": self.base_version,
            "step": self.step,
        }

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> NothingToPush:
        return cls(
            b.uint("fragment", 2**32 - 1),
            b.uint("round"),
            b.uint("base_version"),
            b.uint("step", limits.max_reported_steps),
        )


@dataclass(frozen=True, slots=True)
class UpdateHeader(StreamHeader):
    """The syncer's merged fragment at a new version follows as chunks of this transfer."""

    TYPE: ClassVar[FrameType] = FrameType.UPDATE_HEADER
    fragment: int = 0
    version: int = 0
    precision: str = "fp32"  # StreamHeader.precision: the syncer's --update-precision
    skip: bytes = b""  # StreamHeader.skip: the chunks of that version JOIN.partial named

    def to_body(self) -> dict[str, Any]:
        return self.skip_body({**self.stream_body(), "fragment": self.fragment, "version": self.version})

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> UpdateHeader:
        stream = cls.parse_stream(b, limits)
        fragment, version = b.uint("fragment", 2**32 - 1), b.uint("version")
        return cls(
            *stream,
            fragment=fragment,
            version=version,
            precision=cls.parse_precision(b, stream[0]),
            skip=cls.parse_skip(b, stream[1], stream[3]),
        )


@dataclass(frozen=True, slots=True)
class FragmentEnd:
    """All chunks of a transfer were handed to the data connections; the digest covers them."""

    TYPE: ClassVar[FrameType] = FrameType.FRAGMENT_END
    chunks: int
    digest: int

    def to_body(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "digest": self.digest}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> FragmentEnd:
        return cls(b.uint("chunks", limits.max_chunks_per_fragment()), b.uint("digest"))


@dataclass(frozen=True, slots=True)
class FragmentAck:
    """The receiver holds the whole transfer, verified; the sender may release its buffers."""

    TYPE: ClassVar[FrameType] = FrameType.FRAGMENT_ACK

    def to_body(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> FragmentAck:
        return cls()


#: The capability (HELLO and WELCOME `capabilities`) of a peer that resends a chunk it is asked for
#: again (CHUNK_RESEND); a receiver asks only such a peer, and resets the transfer otherwise.
CHUNK_RESEND_CAPABILITY = "chunk-resend"


@dataclass(frozen=True, slots=True)
class ChunkResend:
    """The receiver of a transfer asks for one chunk again: it arrived damaged (its checksum or
    its decoding failed). Sent only to a peer whose handshake listed CHUNK_RESEND_CAPABILITY."""

    TYPE: ClassVar[FrameType] = FrameType.CHUNK_RESEND
    seq: int

    def to_body(self) -> dict[str, Any]:
        return {"seq": self.seq}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> ChunkResend:
        return cls(b.uint("seq", U32_MAX))


@dataclass(frozen=True, slots=True)
class StreamReset:
    """Abandon one transfer (either direction) without closing the connection."""

    TYPE: ClassVar[FrameType] = FrameType.STREAM_RESET
    code: int
    message: str

    def to_body(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> StreamReset:
        return cls(b.uint("code", 65535), b.text("message", 1024))


@dataclass(frozen=True, slots=True)
class Ping:
    TYPE: ClassVar[FrameType] = FrameType.PING
    seq: int

    def to_body(self) -> dict[str, Any]:
        return {"seq": self.seq}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> Ping:
        return cls(b.uint("seq"))


@dataclass(frozen=True, slots=True)
class Pong:
    TYPE: ClassVar[FrameType] = FrameType.PONG
    seq: int

    def to_body(self) -> dict[str, Any]:
        return {"seq": self.seq}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> Pong:
        return cls(b.uint("seq"))


@dataclass(frozen=True, slots=True)
class StatusRequest:
    TYPE: ClassVar[FrameType] = FrameType.STATUS_REQUEST

    def to_body(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> StatusRequest:
        return cls()


@dataclass(frozen=True, slots=True)
class StatusResponse:
    """A daemon's status as a JSON-compatible map (its schema belongs to the daemon)."""

    TYPE: ClassVar[FrameType] = FrameType.STATUS_RESPONSE
    status: dict[str, Any] = field(default_factory=dict)

    def to_body(self) -> dict[str, Any]:
        return {"status": self.status}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> StatusResponse:
        return cls(b._get("status", dict))


@dataclass(frozen=True, slots=True)
class Error:
    TYPE: ClassVar[FrameType] = FrameType.ERROR
    code: int
    message: str

    def to_body(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> Error:
        return cls(b.uint("code", 65535), b.text("message", 1024))


@dataclass(frozen=True, slots=True)
class Goodbye:
    TYPE: ClassVar[FrameType] = FrameType.GOODBYE
    reason: str

    def to_body(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def from_body(cls, b: _Body, limits: Limits) -> Goodbye:
        return cls(b.text("reason", 1024))


Message = (
    Hello
    | AuthChallenge
    | AuthResponse
    | Welcome
    | StepReport
    | FragmentRequest
    | NothingToPush
    | Join
    | Plan
    | PushHeader
    | UpdateHeader
    | FragmentEnd
    | FragmentAck
    | ChunkResend
    | StreamReset
    | Ping
    | Pong
    | StatusRequest
    | StatusResponse
    | Error
    | Goodbye
)
MESSAGE_TYPES: dict[FrameType, Any] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        AuthChallenge,
        AuthResponse,
        Welcome,
        StepReport,
        FragmentRequest,
        NothingToPush,
        Join,
        Plan,
        PushHeader,
        UpdateHeader,
        FragmentEnd,
        FragmentAck,
        ChunkResend,
        StreamReset,
        Ping,
        Pong,
        StatusRequest,
        StatusResponse,
        Error,
        Goodbye,
    )
}


def encode_body(message: Message) -> bytes:
    return msgpack.packb(message.to_body(), use_bin_type=True)


def decode_body(frame_type: FrameType, body: bytes | bytearray | memoryview, limits: Limits) -> Message:
    """Decode one control body; anything but a well-formed message is a RemoteProtocolError."""
    cls = MESSAGE_TYPES[frame_type]
    size = len(body)
    try:
        raw = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=0,
        )
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        UnicodeDecodeError,
    ) as exc:
        raise _malformed(f"{frame_type.name}: undecodable msgpack ({exc})") from None
    return cls.from_body(_Body(frame_type.name, raw), limits)
