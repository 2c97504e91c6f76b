"""Control message bodies (msgpack) and the tensor manifest inside fragment stream headers.

(JOIN and PLAN round trips live here with every other message; their model and partition rules
are tested in test_join.py.)

Round trips of every message type over the whole documented range of each field (hypothesis),
the bounds each decoder enforces, and arbitrary bodies that must decode or raise
RemoteProtocolError and nothing else.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.wire.choices import PRECISIONS
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.frames import CODECS_BY_NAME, FrameType
from dilocod.wire.layouts import push_layout
from dilocod.wire.limits import Limits
from dilocod.wire.manifest import (
    DTYPE_SIZES,
    PACK_ALIGNMENT,
    ModelEntry,
    TensorEntry,
    pack_manifest,
    parse_manifest,
    piece_rows,
)
from dilocod.wire.messages import (
    AUTH_METHODS,
    MAC_BYTES,
    MAX_HAVE_BYTES,
    MAX_INCARNATION_BYTES,
    MAX_INSTANCE_BYTES,
    MESSAGE_TYPES,
    NONCE_BYTES,
    SESSION_ID_BYTES,
    AuthChallenge,
    AuthResponse,
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
    bitmap_chunks,
    chunk_bitmap,
    decode_body,
    encode_body,
    fits_chunks,
    held_current,
)

LIMITS = Limits()
U8, U16, U32, U64 = 2**8 - 1, 2**16 - 1, 2**32 - 1, 2**64 - 1


def uint(maximum: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, maximum), st.sampled_from([0, maximum]))


def text(max_bytes: int, min_size: int = 0) -> st.SearchStrategy[str]:
    """Strings of at most max_bytes UTF-8 bytes, multi-byte characters included."""
    return (
        st.text(min_size=min_size, max_size=max_bytes)
        .map(lambda s: s.encode()[:max_bytes].decode(errors="ignore"))
        .filter(lambda s: len(s) >= min_size)
    )


def blob(*sizes: int) -> st.SearchStrategy[bytes]:
    return st.one_of(*(st.binary(min_size=n, max_size=n) for n in sizes))


capabilities = st.lists(text(32), max_size=32).map(tuple)
nonce = blob(NONCE_BYTES)
mac = blob(0, MAC_BYTES)
finite = st.floats(min_value=0, allow_nan=False, allow_infinity=False)


@st.composite
def hellos(draw: st.DrawFn) -> Hello:
    low, high = sorted(draw(st.lists(uint(U8), min_size=2, max_size=2)))
    kind, session = draw(
        st.one_of(
            st.tuples(st.just("control"), st.just(b"")), st.tuples(st.just("data"), blob(SESSION_ID_BYTES))
        )
    )
    return Hello(
        low,
        high,
        kind,
        draw(text(32)),
        draw(text(LIMITS.max_peer_id_bytes)),
        draw(nonce),
        session,
        draw(capabilities),
    )


@st.composite
def manifests(draw: st.DrawFn) -> tuple[tuple[TensorEntry, ...], int, str]:
    """A stream's manifest at a precision (its dtypes that precision's), the raw bytes it fits in,
    and the precision."""
    precision = draw(st.sampled_from(PRECISIONS))
    names = draw(st.lists(text(64, min_size=1), max_size=6, unique=True))
    shapes = [
        (name, tuple(draw(st.lists(st.integers(0, 12), max_size=LIMITS.max_tensor_rank)))) for name in names
    ]
    entries, total = push_layout(shapes, precision)
    # Every dimension is at most raw_bytes (protocol/SPEC.md), even in an empty tensor.
    floor = max([total, *(d for _, shape in shapes for d in shape)])
    return entries, floor + draw(st.integers(0, 10_000)), precision


#: Shapes of every rank that fit one fragment whatever the dtype (12^8 x 8 bytes < 16 GiB), and
#: empty tensors whose other dimension is as large as a dimension may be.
model_shapes = st.one_of(
    st.lists(st.integers(0, 12), max_size=LIMITS.max_tensor_rank),
    st.tuples(st.just(0), uint(LIMITS.max_fragment_bytes)).map(list),
).map(tuple)


@st.composite
def models(draw: st.DrawFn) -> tuple[ModelEntry, ...]:
    """A JOIN or PLAN model: 1..8 uniquely named parameters of any dtype and rank."""
    names = draw(st.lists(text(64, min_size=1), min_size=1, max_size=8, unique=True))
    return tuple(
        ModelEntry(name, draw(st.sampled_from(sorted(DTYPE_SIZES))), draw(model_shapes)) for name in names
    )


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """A PLAN whose fragments cut a model's rows into pieces, shuffled into 1..pieces fragments."""
    model = draw(models())
    pieces: list[tuple[str, int, int]] = []
    for entry in model:
        rows = piece_rows(entry.shape)
        cuts = draw(st.sets(st.integers(1, max(1, rows - 1)), max_size=rows - 1))
        bounds = [0, *sorted(cuts), rows]
        pieces += [(entry.name, a, b) for a, b in itertools.pairwise(bounds)]
    pieces = draw(st.permutations(pieces))
    cuts = draw(st.sets(st.integers(1, max(1, len(pieces) - 1)), max_size=len(pieces) - 1))
    bounds = [0, *sorted(cuts), len(pieces)]
    fragments = tuple(tuple(pieces[a:b]) for a, b in itertools.pairwise(bounds))
    return Plan(
        draw(text(MAX_INCARNATION_BYTES)),
        model,
        fragments,
        tuple(draw(st.lists(uint(U64), min_size=len(fragments), max_size=len(fragments)))),
        draw(st.integers(1, U32)),
        draw(uint(U32)),
        draw(uint(U32)),  # 0: lock-step (QUORUM_ALL)
        draw(uint(U64)),
    )


@st.composite
def push_headers(draw: st.DrawFn) -> PushHeader:
    manifest, raw_bytes, precision = draw(manifests())
    return PushHeader(
        manifest,
        raw_bytes,
        draw(st.sampled_from(sorted(CODECS_BY_NAME))),
        draw(st.integers(LIMITS.min_chunk_bytes, LIMITS.max_chunk_bytes)),
        fragment=draw(uint(U32)),
        round=draw(uint(U64)),
        base_version=draw(uint(U64)),
        c_steps=draw(uint(LIMITS.max_reported_steps)),
        c_tokens=draw(uint(LIMITS.max_push_tokens)),
        step=draw(st.none() | uint(LIMITS.max_reported_steps)),
        apply_late=draw(st.none() | uint(LIMITS.max_reported_steps)),
        precision=precision,
    )


@st.composite
def update_headers(draw: st.DrawFn) -> UpdateHeader:
    manifest, raw_bytes, precision = draw(manifests())
    return UpdateHeader(
        manifest,
        raw_bytes,
        draw(st.sampled_from(sorted(CODECS_BY_NAME))),
        draw(st.integers(LIMITS.min_chunk_bytes, LIMITS.max_chunk_bytes)),
        fragment=draw(uint(U32)),
        version=draw(uint(U64)),
        precision=precision,
    )


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)

#: One strategy per message type, covering each field's documented range.
STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    Hello: hellos(),
    AuthChallenge: st.builds(AuthChallenge, uint(U8), st.sampled_from(AUTH_METHODS), nonce),
    AuthResponse: st.builds(AuthResponse, mac),
    Welcome: st.builds(
        Welcome, blob(SESSION_ID_BYTES), text(128), text(64), mac, capabilities, uint(U32), uint(U16)
    ),
    StepReport: st.builds(
        StepReport,
        uint(LIMITS.max_reported_steps),
        uint(LIMITS.max_step_tokens),
        st.floats(0, LIMITS.max_step_time_s) | st.just(LIMITS.max_step_time_s),
    ),
    FragmentRequest: st.builds(FragmentRequest, uint(U32), uint(U64), uint(U64)),
    NothingToPush: st.builds(NothingToPush, uint(U32), uint(U64), uint(U64), uint(LIMITS.max_reported_steps)),
    Join: st.builds(
        Join,
        models(),
        text(MAX_INCARNATION_BYTES),
        text(MAX_INSTANCE_BYTES),
        st.lists(st.none() | uint(U64), max_size=8).map(tuple),
    ),
    Plan: plans(),
    PushHeader: push_headers(),
    UpdateHeader: update_headers(),
    FragmentEnd: st.builds(FragmentEnd, uint(LIMITS.max_chunks_per_fragment()), uint(U64)),
    FragmentAck: st.just(FragmentAck()),
    StreamReset: st.builds(StreamReset, uint(U16), text(1024)),
    ChunkResend: st.builds(ChunkResend, uint(U32)),
    Ping: st.builds(Ping, uint(U64)),
    Pong: st.builds(Pong, uint(U64)),
    StatusRequest: st.just(StatusRequest()),
    StatusResponse: st.builds(StatusResponse, st.dictionaries(st.text(max_size=10), json_like, max_size=5)),
    Error: st.builds(Error, uint(U16), text(1024)),
    Goodbye: st.builds(Goodbye, text(1024)),
}


def test_every_message_type_has_a_strategy() -> None:
    assert set(STRATEGIES) == set(MESSAGE_TYPES.values())
    assert all(cls.TYPE is frame_type for frame_type, cls in MESSAGE_TYPES.items())


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_round_trip(cls: type, data: st.DataObject) -> None:
    message = data.draw(STRATEGIES[cls])
    back = decode_body(cls.TYPE, encode_body(message), LIMITS)
    assert type(back) is cls
    assert back == message


#: A NOTHING_TO_PUSH to break field by field.
PASS = NothingToPush(1, 2, 3, 4)


def body(message: Message, **changes: object) -> bytes:
    raw = message.to_body()
    for key, value in changes.items():
        if value is KeyError:
            del raw[key]
        else:
            raw[key] = value
    return msgpack.packb(raw, use_bin_type=True)


HELLO = Hello(1, 1, "control", "learner", "a", bytes(NONCE_BYTES))
JOIN = Join((ModelEntry("w", "float32", (8,)), ModelEntry("b", "bfloat16", ())), "inc-0")
PLAN = Plan("inc-1", JOIN.model, ((("w", 0, 8),), (("b", 0, 1),)), (3, 4), 24, 2, 1)
ENTRIES, RAW = pack_manifest([("w", "float32", [8])])
PUSH = PushHeader(tuple(ENTRIES), RAW, "zstd", LIMITS.min_chunk_bytes, 1)

MALFORMED = [
    pytest.param(FrameType.PING, msgpack.packb([1]), id="not-a-map"),
    pytest.param(FrameType.PING, msgpack.packb(None), id="nil"),
    pytest.param(FrameType.PING, b"", id="empty"),
    pytest.param(FrameType.PING, body(Ping(1), seq=KeyError), id="missing-field"),
    pytest.param(FrameType.PING, body(Ping(1), seq=True), id="bool-for-int"),
    pytest.param(FrameType.PING, body(Ping(1), seq=1.0), id="float-for-int"),
    pytest.param(FrameType.PING, body(Ping(1), seq=-1), id="negative"),
    pytest.param(FrameType.PING, body(Ping(1), seq="1"), id="str-for-int"),
    pytest.param(FrameType.PING, body(Ping(1)) + b"\x00", id="trailing-byte"),
    pytest.param(FrameType.PING, body(Ping(1))[:-1], id="truncated"),
    pytest.param(FrameType.PING, b"\x81\x01\x02", id="int-key"),
    pytest.param(FrameType.PING, b"\xdd\xff\xff\xff\xff", id="array-of-4G"),
    pytest.param(FrameType.PING, b"\x81\xa3seq\xd6\x05\x00\x00\x00\x00", id="ext-type"),
    pytest.param(FrameType.PING, b"\x81\xa3seq\xd6\xff\x00\x00\x00\x00", id="timestamp"),
    pytest.param(FrameType.GOODBYE, b"\x81\xa6reason\xa2\xc3\x28", id="invalid-utf8"),
    pytest.param(FrameType.GOODBYE, body(Goodbye("é" * 512 + "x")), id="reason-1025-bytes"),
    pytest.param(FrameType.STATUS_RESPONSE, b"\x81\xa6status" + b"\x91" * 3000 + b"\xc0", id="deep-nesting"),
    pytest.param(FrameType.STATUS_RESPONSE, body(StatusResponse(), status=[1]), id="status-not-a-map"),
    pytest.param(FrameType.ERROR, body(Error(1, "x"), code=U16 + 1), id="code-above-u16"),
    pytest.param(FrameType.STEP_REPORT, body(StepReport(1, 1, 0.5), step_time_s=float("nan")), id="nan"),
    pytest.param(FrameType.STEP_REPORT, body(StepReport(1, 1, 0.5), step_time_s=float("inf")), id="inf"),
    pytest.param(FrameType.STEP_REPORT, body(StepReport(1, 1, 0.5), step_time_s=-0.5), id="negative-time"),
    pytest.param(FrameType.STEP_REPORT, body(StepReport(1, 1, 0.5), step_time_s=True), id="bool-time"),
    pytest.param(FrameType.HELLO, body(HELLO, min_version=2, max_version=1), id="min-above-max"),
    pytest.param(FrameType.HELLO, body(HELLO, max_version=256), id="version-above-u8"),
    pytest.param(FrameType.HELLO, body(HELLO, kind="both"), id="unknown-kind"),
    pytest.param(FrameType.HELLO, body(HELLO, kind="data"), id="data-without-session"),
    pytest.param(FrameType.HELLO, body(HELLO, session=bytes(16)), id="control-with-session"),
    pytest.param(FrameType.HELLO, body(HELLO, kind="data", session=bytes(15)), id="short-session"),
    pytest.param(FrameType.HELLO, body(HELLO, nonce=bytes(31)), id="short-nonce"),
    pytest.param(FrameType.HELLO, body(HELLO, nonce="x" * 32), id="str-nonce"),
    pytest.param(FrameType.HELLO, body(HELLO, role="r" * 33), id="long-role"),
    pytest.param(FrameType.HELLO, body(HELLO, peer_id="p" * 129), id="long-peer-id"),
    pytest.param(FrameType.HELLO, body(HELLO, capabilities=["c"] * 33), id="too-many-capabilities"),
    pytest.param(FrameType.HELLO, body(HELLO, capabilities=["c" * 33]), id="long-capability"),
    pytest.param(FrameType.HELLO, body(HELLO, capabilities=[1]), id="int-capability"),
    pytest.param(
        FrameType.AUTH_CHALLENGE, body(AuthChallenge(1, "none", bytes(32)), method="md5"), id="method"
    ),
    pytest.param(FrameType.AUTH_RESPONSE, body(AuthResponse(b""), mac=bytes(31)), id="short-mac"),
    pytest.param(FrameType.WELCOME, body(Welcome(bytes(16), "s", "i", b""), session=b""), id="no-session"),
    pytest.param(FrameType.PUSH_HEADER, body(PUSH, codec="brotli"), id="unknown-codec"),
    pytest.param(
        FrameType.PUSH_HEADER, body(PUSH, chunk_bytes=LIMITS.max_chunk_bytes + 1), id="chunk-above-max"
    ),
    pytest.param(
        FrameType.PUSH_HEADER, body(PUSH, raw_bytes=LIMITS.max_fragment_bytes + 1), id="raw-above-max"
    ),
    pytest.param(FrameType.PUSH_HEADER, body(PUSH, fragment=U32 + 1), id="fragment-above-u32"),
    pytest.param(FrameType.JOIN, body(JOIN, incarnation="i" * 129), id="join-incarnation-129-bytes"),
    pytest.param(FrameType.JOIN, body(JOIN, incarnation=KeyError), id="join-without-incarnation"),
    pytest.param(FrameType.PLAN, body(PLAN, incarnation=b"inc-1"), id="plan-incarnation-bin"),
    pytest.param(FrameType.PLAN, body(PLAN, fragments=KeyError), id="plan-without-fragments"),
    pytest.param(FrameType.PLAN, body(PLAN, fragments=[]), id="plan-no-fragments"),
    pytest.param(FrameType.PLAN, body(PLAN, fragments=["w", "b"]), id="plan-fragment-not-an-array"),
    pytest.param(FrameType.PLAN, body(PLAN, fragments=[["w"], ["b"]]), id="plan-names-not-pieces"),
    pytest.param(FrameType.PLAN, body(PLAN, fragments=[[["w", 0, 8]], [[b"b", 0, 1]]]), id="plan-bin-name"),
    pytest.param(
        FrameType.PLAN, body(PLAN, fragments=[[["w", 0, 8]], [["b" * 1025, 0, 1]]]), id="plan-name-1025-bytes"
    ),
    pytest.param(FrameType.PLAN, body(PLAN, fragments=[[["w", 0, 8]], [["b", 0]]]), id="plan-piece-of-two"),
    pytest.param(
        FrameType.PLAN, body(PLAN, fragments=[[["w", 0, 8]], [["b", False, 1]]]), id="plan-bool-row"
    ),
    pytest.param(FrameType.PLAN, body(PLAN, fragments=[[["w", 0, 8.0]], [["b", 0, 1]]]), id="plan-float-row"),
    pytest.param(FrameType.PLAN, body(PLAN, versions=[3]), id="plan-too-few-versions"),
    pytest.param(FrameType.PLAN, body(PLAN, versions=[3, 4, 5]), id="plan-too-many-versions"),
    pytest.param(FrameType.PLAN, body(PLAN, versions=[3, -1]), id="plan-negative-version"),
    pytest.param(FrameType.PLAN, body(PLAN, versions=[3, True]), id="plan-bool-version"),
    pytest.param(FrameType.PLAN, body(PLAN, versions=KeyError), id="plan-without-versions"),
    pytest.param(FrameType.PLAN, body(PLAN, sync_every=0), id="plan-sync-every-0"),
    pytest.param(FrameType.PLAN, body(PLAN, sync_every=U32 + 1), id="plan-sync-every-above-u32"),
    pytest.param(FrameType.PLAN, body(PLAN, overlap=-1), id="plan-negative-overlap"),
    pytest.param(FrameType.PLAN, body(PLAN, quorum=-1), id="plan-negative-quorum"),
    pytest.param(FrameType.PLAN, body(PLAN, next_round=-1), id="plan-negative-next-round"),
    pytest.param(FrameType.NOTHING_TO_PUSH, body(PASS, step=KeyError), id="pass-no-step"),
    pytest.param(FrameType.NOTHING_TO_PUSH, body(PASS, round=-1), id="pass-negative-round"),
    pytest.param(FrameType.PLAN, body(PLAN, quorum=1.0), id="plan-float-quorum"),
    pytest.param(
        FrameType.FRAGMENT_END,
        body(FragmentEnd(1, 0), chunks=LIMITS.max_chunks_per_fragment() + 1),
        id="chunks",
    ),
]


@pytest.mark.parametrize(("frame_type", "raw"), MALFORMED)
def test_malformed_body_is_refused(frame_type: FrameType, raw: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_body(frame_type, raw, LIMITS)
    assert info.value.code is ErrorCode.MALFORMED_BODY


#: Every number a learner reports, with its bound: (frame type, message, field, largest accepted).
REPORTED_NUMBERS = [
    (FrameType.STEP_REPORT, StepReport(1, 1, 0.5), "step", LIMITS.max_reported_steps),
    (FrameType.STEP_REPORT, StepReport(1, 1, 0.5), "tokens", LIMITS.max_step_tokens),
    (FrameType.STEP_REPORT, StepReport(1, 1, 0.5), "step_time_s", LIMITS.max_step_time_s),
    (FrameType.PUSH_HEADER, PUSH, "c_steps", LIMITS.max_reported_steps),
    (FrameType.PUSH_HEADER, PUSH, "c_tokens", LIMITS.max_push_tokens),
]


@pytest.mark.parametrize(
    ("frame_type", "message", "key", "bound"), REPORTED_NUMBERS, ids=[r[2] for r in REPORTED_NUMBERS]
)
def test_reported_numbers_are_range_checked(
    frame_type: FrameType, message: Message, key: str, bound: float
) -> None:
    """A learner's step time of 1e308 or a token count of 2**64 - 1 stalled the rounds, broke every
    checkpoint and `dilocod status`, and won it the whole merge weight: each reported number has a
    documented range, and a value outside it is a malformed message naming the field and the bound."""
    assert bound < 2**53  # exact in float64 and in JSON, with room for the syncer's totals
    accepted = decode_body(frame_type, body(message, **{key: bound}), LIMITS)
    assert getattr(accepted, key) == bound
    for beyond in (bound + 1, 2**64 - 1) if isinstance(bound, int) else (bound * 1.0001, 1e308):
        with pytest.raises(RemoteProtocolError) as info:
            decode_body(frame_type, body(message, **{key: beyond}), LIMITS)
        assert info.value.code is ErrorCode.MALFORMED_BODY
        assert key in str(info.value) and (f"{bound:g}" if isinstance(bound, float) else str(bound)) in str(
            info.value
        )


@pytest.mark.parametrize(
    ("step_time_s", "sent"),
    [
        (1e9, LIMITS.max_step_time_s),
        (math.inf, LIMITS.max_step_time_s),
        (-0.5, 0.0),
        (math.nan, 0.0),
        (0.25, 0.25),
    ],
)
def test_an_honest_learners_odd_report_is_brought_into_range(step_time_s: float, sent: float) -> None:
    """A learner suspended for longer than a day, or a user's step returning an absurd token count,
    must not cost it its session: what it sends decodes, at the nearest value in range."""
    report = StepReport.within(2**41, 2**41, step_time_s, LIMITS)
    decoded = decode_body(FrameType.STEP_REPORT, body(report), LIMITS)
    assert decoded == StepReport(LIMITS.max_reported_steps, LIMITS.max_step_tokens, sent)


def test_text_bounds_count_bytes_not_characters() -> None:
    assert decode_body(FrameType.GOODBYE, body(Goodbye("é" * 512)), LIMITS) == Goodbye("é" * 512)
    hello = decode_body(FrameType.HELLO, body(HELLO, peer_id="p" * 128), LIMITS)
    assert isinstance(hello, Hello) and hello.peer_id == "p" * 128


JOIN_HELD_MALFORMED = [
    pytest.param(body(JOIN, held={"0": 1}), id="map"),
    pytest.param(body(JOIN, held=[1, -1]), id="negative"),
    pytest.param(body(JOIN, held=[True]), id="bool"),
    pytest.param(body(JOIN, held=[1.0]), id="float"),
    pytest.param(body(JOIN, held=["1"]), id="str"),
]


@pytest.mark.parametrize("raw", JOIN_HELD_MALFORMED)
def test_join_held_is_u64_or_nil(raw: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_body(FrameType.JOIN, raw, LIMITS)
    assert info.value.code is ErrorCode.MALFORMED_BODY and "held" in str(info.value)


def test_join_held_is_counted_before_its_entries() -> None:
    small = Limits(max_fragments=4)
    assert decode_body(FrameType.JOIN, body(JOIN, held=[None, 1, 2, 3]), small) == Join(
        JOIN.model, JOIN.incarnation, held=(None, 1, 2, 3)
    )
    with pytest.raises(RemoteProtocolError) as info:
        decode_body(FrameType.JOIN, body(JOIN, held=["x"] * 5), small)
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED


@settings(max_examples=50, deadline=None)
@given(chunks=st.integers(1, 300), data=st.data())
def test_a_chunk_bitmap_names_exactly_its_chunks(chunks: int, data: st.DataObject) -> None:
    seqs = data.draw(st.sets(st.integers(0, chunks - 1)))
    bitmap = chunk_bitmap(seqs, chunks)
    assert bitmap_chunks(bitmap) == sorted(seqs)
    assert fits_chunks(bitmap, chunks)
    assert not fits_chunks(bitmap + b"\x00", chunks)
    if chunks % 8:  # a bit past the last chunk
        assert not fits_chunks(bitmap[:-1] + bytes([bitmap[-1] | 0x80]), chunks)
    with pytest.raises(ValueError, match="outside"):
        chunk_bitmap([chunks], chunks)


def test_a_resumed_update_and_the_join_that_asks_for_it_round_trip() -> None:
    """JOIN.partial and UPDATE_HEADER.skip are optional on the wire: absent when empty, and
    what is sent is what decodes."""
    resume = Join(JOIN.model, "inc-1", held=(3, None), partial=(PartialUpdate(1, 4, b"\x05"),))
    assert decode_body(FrameType.JOIN, body(resume), LIMITS) == resume
    assert "partial" not in JOIN.to_body()
    entries, raw = pack_manifest([("w", "float32", [3000])])  # 12,000 bytes: 3 chunks of 4 KiB
    update = UpdateHeader(tuple(entries), raw, "none", LIMITS.min_chunk_bytes, fragment=1, version=4)
    assert "skip" not in update.to_body()
    resumed = dataclasses.replace(update, skip=chunk_bitmap([0, 2], update.chunks))
    assert decode_body(FrameType.UPDATE_HEADER, body(resumed), LIMITS) == resumed
    assert resumed.skipped == [0, 2]
    assert resumed.skipped_bytes == 4096 + (raw - 2 * 4096)  # the last chunk is short
    assert dataclasses.replace(update, skip=chunk_bitmap([1], 3)).skipped_bytes == 4096


def test_join_partial_is_counted_before_its_entries() -> None:
    small = Limits(max_fragments=2)
    entries = [[p, 1, b"\x01"] for p in range(3)]
    with pytest.raises(RemoteProtocolError) as info:
        decode_body(FrameType.JOIN, body(JOIN, partial=entries), small)
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED
    longest = Join(JOIN.model, "inc-1", partial=(PartialUpdate(0, 1, bytes(MAX_HAVE_BYTES)),))
    assert decode_body(FrameType.JOIN, body(longest), LIMITS) == longest
    with pytest.raises(RemoteProtocolError) as info:
        decode_body(FrameType.JOIN, body(JOIN, partial=[[0, 1, bytes(MAX_HAVE_BYTES + 1)]]), LIMITS)
    assert info.value.code is ErrorCode.MALFORMED_BODY and "partial" in str(info.value)
    request = FragmentRequest(0, 1, 2, bytes(MAX_HAVE_BYTES))
    assert decode_body(FrameType.FRAGMENT_REQUEST, body(request), LIMITS) == request
    with pytest.raises(RemoteProtocolError) as info:
        decode_body(FrameType.FRAGMENT_REQUEST, body(request, have=bytes(MAX_HAVE_BYTES + 1)), LIMITS)
    assert info.value.code is ErrorCode.MALFORMED_BODY and "have" in str(info.value)


def test_a_join_without_held_encodes_as_before() -> None:
    """held is optional on the wire: absent when empty, so a first JOIN is what it always was."""
    assert "held" not in JOIN.to_body()
    assert decode_body(FrameType.JOIN, body(JOIN), LIMITS) == JOIN


@pytest.mark.parametrize(
    ("join_incarnation", "held", "skipped"),
    [
        pytest.param("inc-1", (3, 4), {0, 1}, id="all-current"),
        pytest.param("inc-1", (3, 2), {0}, id="one-moved"),
        pytest.param("inc-1", (None, 4), {1}, id="one-not-held"),
        pytest.param("inc-1", (3,), {0}, id="shorter"),
        pytest.param("inc-1", (3, 4, 5), {0, 1}, id="longer"),
        pytest.param("inc-1", (), set(), id="none-held"),
        pytest.param("inc-0", (3, 4), set(), id="another-incarnation"),
        pytest.param("", (3, 4), set(), id="no-incarnation"),
        pytest.param("inc-1", (4, 5), set(), id="ahead"),
    ],
)
def test_held_current_skips_only_what_the_learner_holds_as_it_is(
    join_incarnation: str, held: tuple[int | None, ...], skipped: set[int]
) -> None:
    """PLAN: incarnation inc-1, fragment versions (3, 4)."""
    join = Join(JOIN.model, join_incarnation, "me", held)
    assert held_current(join, PLAN) == skipped


def test_stream_header_limits() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_body(FrameType.PUSH_HEADER, body(PUSH, chunk_bytes=LIMITS.min_chunk_bytes - 1), LIMITS)
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED
    with pytest.raises(RemoteProtocolError) as info:
        decode_body(FrameType.PUSH_HEADER, body(PUSH, manifest=KeyError), LIMITS)
    assert info.value.code is ErrorCode.BAD_MANIFEST
    with pytest.raises(RemoteProtocolError) as info:
        decode_body(FrameType.UPDATE_HEADER, body(UpdateHeader(tuple(ENTRIES), RAW - 1, "lz4", 4096)), LIMITS)
    assert info.value.code is ErrorCode.BAD_MANIFEST  # the tensor ends past raw_bytes
    small = Limits(max_fragment_bytes=1000)
    with pytest.raises(RemoteProtocolError):
        decode_body(FrameType.PUSH_HEADER, body(PUSH, raw_bytes=1001), small)


def test_stream_header_chunk_count() -> None:
    assert PushHeader((), 1, "none", 4096).chunks == 1
    assert PushHeader((), 4096, "none", 4096).chunks == 1
    assert PushHeader((), 4097, "none", 4096).chunks == 2
    assert PushHeader((), 0, "none", 4096).chunks == 0


json_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), U64),
    st.floats(),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.lists(st.integers(0, 300) | st.text(max_size=8), max_size=4),
)


def _field_names() -> list[str]:
    samples: list[Message] = [
        HELLO,
        AuthChallenge(1, "none", bytes(32)),
        AuthResponse(b""),
        Welcome(bytes(16), "s", "i", b""),
        StepReport(1, 1, 1.0),
        FragmentRequest(1, 1, 1),
        JOIN,
        PLAN,
        PUSH,
        UpdateHeader((), 0, "none", 4096),
        FragmentEnd(1, 1),
        StreamReset(1, "x"),
        Ping(1),
        StatusResponse(),
        Error(1, "x"),
        Goodbye("x"),
    ]
    return sorted({key for m in samples for key in m.to_body()})


FIELD_NAMES = _field_names()


@settings(max_examples=300, deadline=None)
@given(
    frame_type=st.sampled_from(sorted(MESSAGE_TYPES)),
    raw=st.one_of(
        st.binary(max_size=200),
        st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=12).map(
            lambda d: msgpack.packb(d, use_bin_type=True)
        ),
    ),
)
def test_any_body_decodes_or_is_refused(frame_type: FrameType, raw: bytes) -> None:
    try:
        message = decode_body(frame_type, raw, LIMITS)
    except RemoteProtocolError:
        return
    assert type(message) is MESSAGE_TYPES[frame_type]


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda c: c.__name__)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_mutated_valid_body_decodes_or_is_refused(cls: type, data: st.DataObject) -> None:
    raw = bytearray(encode_body(data.draw(STRATEGIES[cls])))
    for _ in range(data.draw(st.integers(1, 4))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        message = decode_body(cls.TYPE, bytes(raw), LIMITS)
    except RemoteProtocolError:
        return
    assert type(message) is cls


# ---------------------------------------------------------------------------------- manifest


@settings(max_examples=100, deadline=None)
@given(
    tensors=st.lists(
        st.tuples(st.sampled_from(sorted(DTYPE_SIZES)), st.lists(st.integers(0, 40), max_size=4)), max_size=10
    )
)
def test_pack_manifest_alignment(tensors: list[tuple[str, list[int]]]) -> None:
    named = [(f"t{i}", dtype, shape) for i, (dtype, shape) in enumerate(tensors)]
    entries, total = pack_manifest(named)
    end = 0
    for entry, (name, dtype, shape) in zip(entries, named, strict=True):
        assert (entry.name, entry.dtype, entry.shape) == (name, dtype, tuple(shape))
        assert entry.offset % PACK_ALIGNMENT == 0
        assert end <= entry.offset < end + PACK_ALIGNMENT
        end = entry.offset + entry.nbytes
    assert total == end
    # Every dimension is at most raw_bytes (protocol/SPEC.md), even in an empty tensor.
    raw_bytes = max([total, *(d for _, _, shape in named for d in shape)])
    assert parse_manifest([e.to_wire() for e in entries], raw_bytes, LIMITS) == tuple(entries)


def test_pack_manifest_example() -> None:
    entries, total = pack_manifest([("a", "int8", [3]), ("b", "float32", [2, 2]), ("c", "bfloat16", [])])
    assert [(e.offset, e.nbytes) for e in entries] == [(0, 3), (64, 16), (128, 2)]
    assert total == 130
    assert pack_manifest([]) == ([], 0)


def test_empty_tensors() -> None:
    entries, total = pack_manifest([("a", "float32", [0, 7]), ("b", "int8", [8])])
    assert total == 8 and [e.nbytes for e in entries] == [0, 8]
    assert parse_manifest([e.to_wire() for e in entries], total, LIMITS) == tuple(entries)


def test_parse_manifest_accepts_any_item_alignment() -> None:
    wire = [["a", "int8", [1], 0], ["b", "float32", [1], 4], ["c", "float64", [2], 8], ["d", "bool", [0], 24]]
    parsed = parse_manifest(wire, 24, LIMITS)
    assert [e.offset for e in parsed] == [0, 4, 8, 24]


BAD_MANIFESTS = [
    pytest.param({"w": 1}, 100, ErrorCode.BAD_MANIFEST, id="not-an-array"),
    pytest.param([["w", "float32", [1]]], 100, ErrorCode.BAD_MANIFEST, id="three-fields"),
    pytest.param(["w"], 100, ErrorCode.BAD_MANIFEST, id="entry-not-an-array"),
    pytest.param([["w", "float8", [1], 0]], 100, ErrorCode.BAD_MANIFEST, id="unknown-dtype"),
    pytest.param([["w", "complex64", [1], 0]], 100, ErrorCode.BAD_MANIFEST, id="complex"),
    pytest.param([["w", 4, [1], 0]], 100, ErrorCode.BAD_MANIFEST, id="int-dtype"),
    pytest.param([["w", ["float32"], [1], 0]], 100, ErrorCode.BAD_MANIFEST, id="list-dtype"),
    pytest.param([["w", {"a": 1}, [1], 0]], 100, ErrorCode.BAD_MANIFEST, id="map-dtype"),
    pytest.param([[["w"], "int8", [1], 0]], 100, ErrorCode.BAD_MANIFEST, id="list-name"),
    pytest.param([["w", "int8", [1], 0], ["w", "int8", [1], 1]], 100, ErrorCode.BAD_MANIFEST, id="duplicate"),
    pytest.param([["a", "int8", [8], 0], ["b", "int8", [1], 4]], 100, ErrorCode.BAD_MANIFEST, id="overlap"),
    pytest.param(
        [["a", "int8", [1], 64], ["b", "int8", [1], 0]], 100, ErrorCode.BAD_MANIFEST, id="backwards"
    ),
    pytest.param([["a", "float32", [1], 2]], 100, ErrorCode.BAD_MANIFEST, id="misaligned"),
    pytest.param([["a", "float64", [1], 4]], 100, ErrorCode.BAD_MANIFEST, id="misaligned-8"),
    pytest.param([["a", "float32", [26], 0]], 100, ErrorCode.BAD_MANIFEST, id="past-the-end"),
    pytest.param([["a", "int8", [1], 100]], 100, ErrorCode.BAD_MANIFEST, id="starts-at-the-end"),
    pytest.param([["a", "int8", [100] * 8, 0]], 100, ErrorCode.BAD_MANIFEST, id="huge-product"),
    pytest.param([["a", "int8", [1] * 9, 0]], 100, ErrorCode.BAD_MANIFEST, id="rank-9"),
    pytest.param([["a", "int8", 5, 0]], 100, ErrorCode.BAD_MANIFEST, id="shape-not-an-array"),
    pytest.param([["a", "int8", [-1], 0]], 100, ErrorCode.BAD_MANIFEST, id="negative-dim"),
    pytest.param([["a", "int8", [True], 0]], 100, ErrorCode.BAD_MANIFEST, id="bool-dim"),
    pytest.param([["a", "int8", [1.0], 0]], 100, ErrorCode.BAD_MANIFEST, id="float-dim"),
    pytest.param([["a", "int8", [101], 0]], 100, ErrorCode.BAD_MANIFEST, id="dim-above-raw-bytes"),
    pytest.param([["a", "int8", [1], -1]], 100, ErrorCode.BAD_MANIFEST, id="negative-offset"),
    pytest.param([["a", "int8", [1], True]], 100, ErrorCode.BAD_MANIFEST, id="bool-offset"),
    pytest.param([["a", "int8", [1], 0.0]], 100, ErrorCode.BAD_MANIFEST, id="float-offset"),
    pytest.param([["", "int8", [1], 0]], 100, ErrorCode.BAD_MANIFEST, id="empty-name"),
    pytest.param([[b"a", "int8", [1], 0]], 100, ErrorCode.BAD_MANIFEST, id="bytes-name"),
    pytest.param([["n" * 1025, "int8", [1], 0]], 2000, ErrorCode.BAD_MANIFEST, id="long-name"),
    pytest.param([["é" * 513, "int8", [1], 0]], 2000, ErrorCode.BAD_MANIFEST, id="long-name-bytes"),
]


@pytest.mark.parametrize(("raw", "raw_bytes", "code"), BAD_MANIFESTS)
def test_parse_manifest_rejects(raw: object, raw_bytes: int, code: ErrorCode) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_manifest(raw, raw_bytes, LIMITS)
    assert info.value.code is code


@settings(max_examples=200, deadline=None)
@given(
    raw=st.one_of(
        json_like,
        st.lists(st.one_of(json_like, st.lists(json_like, min_size=4, max_size=4)), max_size=5),
        st.lists(
            st.tuples(
                st.one_of(st.text(max_size=4), json_like),
                st.one_of(st.sampled_from(sorted(DTYPE_SIZES)), json_like),
                st.one_of(st.lists(st.integers(-2, 300), max_size=9), json_like),
                st.one_of(st.integers(-2, 10_000), json_like),
            ).map(list),
            max_size=5,
        ),
    ),
    raw_bytes=st.integers(0, 10_000),
)
def test_any_manifest_parses_or_is_refused(raw: object, raw_bytes: int) -> None:
    """What a peer puts in a stream header's manifest is decoded msgpack: anything at all."""
    try:
        entries = parse_manifest(raw, raw_bytes, LIMITS)
    except RemoteProtocolError as exc:
        assert exc.code in (ErrorCode.BAD_MANIFEST, ErrorCode.LIMIT_EXCEEDED)
        return
    end = 0
    for entry in entries:
        assert entry.offset >= end and entry.offset % DTYPE_SIZES[entry.dtype] == 0
        end = entry.offset + entry.nbytes
    assert end <= raw_bytes


def test_parse_manifest_limits() -> None:
    limits = Limits(max_tensors_per_fragment=3, max_tensor_rank=2, max_name_bytes=4)
    ok = [[f"t{i}", "int8", [1, 1], i] for i in range(3)]
    assert len(parse_manifest(ok, 3, limits)) == 3
    with pytest.raises(RemoteProtocolError) as info:
        parse_manifest([*ok, ["t3", "int8", [1], 3]], 4, limits)
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED
    with pytest.raises(RemoteProtocolError) as info:
        parse_manifest([["t", "int8", [1, 1, 1], 0]], 4, limits)
    assert info.value.code is ErrorCode.BAD_MANIFEST
    with pytest.raises(RemoteProtocolError) as info:
        parse_manifest([["tensor", "int8", [1], 0]], 4, limits)
    assert info.value.code is ErrorCode.BAD_MANIFEST


def test_too_many_tensors_refused_before_looking_at_them() -> None:
    limits = Limits(max_tensors_per_fragment=10)
    with pytest.raises(RemoteProtocolError) as info:
        parse_manifest([None] * 11, 100, limits)
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED


def test_every_dtype_has_its_size() -> None:
    assert DTYPE_SIZES == {
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "float64": 8,
        "int8": 1,
        "uint8": 1,
        "int16": 2,
        "int32": 4,
        "int64": 8,
        "bool": 1,
    }
