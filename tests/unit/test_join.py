"""JOIN and PLAN: the model each side declares, the partition a PLAN must be, and the join sequence.

Round trips of both messages are in test_messages.py with every other message; here are the rules
particular to them (which fault is BAD_MANIFEST, MALFORMED_BODY or LIMIT_EXCEEDED, the bounds on
tensors and fragments), arbitrary models that must parse or be refused, the join sequence of
protocol/SPEC.md §4.4 between two connected cores (JOIN, PLAN, one healing UPDATE_HEADER transfer
per fragment, then a round), and the line between the wire core and the syncer: the application
codes 24 to 27 are never raised by the core.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dilocod.wire
from dilocod.wire import codecs
from dilocod.wire.connection import Connection
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.events import ChunkReceived, Event, MessageReceived, PeerWentAway
from dilocod.wire.frames import ChunkHeader, Codec, FrameType, encode_header
from dilocod.wire.limits import Limits
from dilocod.wire.manifest import (
    DTYPE_SIZES,
    ModelEntry,
    fragment_manifest,
    fragment_shapes,
    parse_model,
    piece_rows,
)
from dilocod.wire.messages import (
    FragmentAck,
    FragmentEnd,
    FragmentRequest,
    Join,
    Plan,
    PushHeader,
    StepReport,
    StreamReset,
    UpdateHeader,
    decode_body,
    encode_body,
)
from dilocod.wire.states import State
from dilocod.wire.stream import FragmentAssembled, InboundStreams

Shuttle = Callable[[Connection, Connection], list[Event]]
Connect = Callable[..., tuple[Connection, Connection]]
LIMITS = Limits()
MAX_FRAGMENT_BYTES = LIMITS.max_fragment_bytes

MODEL = (
    ModelEntry("embed.weight", "bfloat16", (128, 32)),
    ModelEntry("blocks.0.weight", "float32", (16, 16)),
    ModelEntry("blocks.0.bias", "float32", (16,)),
    ModelEntry("head.scale", "float32", ()),
)
PLAN = Plan(
    "inc-2",
    MODEL,
    (
        (("blocks.0.weight", 0, 16), ("head.scale", 0, 1), ("embed.weight", 100, 128)),
        (("embed.weight", 0, 100), ("blocks.0.bias", 0, 16)),
    ),
    (11, 9),
    24,
    2,
    1,
)
WIRE_MODEL = [e.to_wire() for e in MODEL]


def packed(message: Join | Plan, **changes: object) -> bytes:
    raw = message.to_body()
    for key, value in changes.items():
        if value is KeyError:
            del raw[key]
        else:
            raw[key] = value
    return msgpack.packb(raw, use_bin_type=True)


def refused(frame_type: FrameType, raw: bytes, limits: Limits = LIMITS) -> ErrorCode:
    with pytest.raises(RemoteProtocolError) as info:
        decode_body(frame_type, raw, limits)
    return info.value.code


# ------------------------------------------------------------------------------------ model


def test_model_entry_size_and_wire_form() -> None:
    assert [e.nbytes for e in MODEL] == [8192, 1024, 64, 4]
    assert MODEL[3].to_wire() == ["head.scale", "float32", []]
    assert parse_model(WIRE_MODEL, LIMITS) == MODEL


def test_model_bounds_are_inclusive() -> None:
    """A model of exactly max_model_bytes passes; one more byte does not. A tensor larger than a
    fragment passes (it travels in row slices), a 12B-parameter float32 one included."""
    small = Limits(max_model_bytes=1000)
    assert parse_model([["a", "int8", [600]], ["b", "int8", [400]]], small)[1].nbytes == 400
    with pytest.raises(RemoteProtocolError) as info:
        parse_model([["a", "int8", [600]], ["b", "int8", [401]]], small)
    assert info.value.code is ErrorCode.BAD_MANIFEST
    assert parse_model([["a", "float32", [0, LIMITS.max_model_bytes]]], LIMITS)[0].nbytes == 0
    above_fragment = parse_model([["a", "float32", [MAX_FRAGMENT_BYTES // 4 + 1]]], LIMITS)
    assert above_fragment[0].nbytes > MAX_FRAGMENT_BYTES
    twelve_b = parse_model([[f"layers.{i}", "float32", [8192, 30_720]] for i in range(48)], LIMITS)
    assert sum(e.nbytes for e in twelve_b) // 4 > 12 * 10**9
    rank_8 = parse_model([["a", "int8", [1] * LIMITS.max_tensor_rank]], LIMITS)
    assert rank_8[0].shape == (1,) * 8


BAD_MODELS = [
    pytest.param(None, ErrorCode.BAD_MANIFEST, id="missing"),
    pytest.param({"a": 1}, ErrorCode.BAD_MANIFEST, id="not-an-array"),
    pytest.param([], ErrorCode.BAD_MANIFEST, id="empty"),
    pytest.param([["a", "int8"]], ErrorCode.BAD_MANIFEST, id="two-fields"),
    pytest.param([["a", "int8", [1], 0]], ErrorCode.BAD_MANIFEST, id="manifest-entry-with-offset"),
    pytest.param(["a"], ErrorCode.BAD_MANIFEST, id="entry-not-an-array"),
    pytest.param([["", "int8", [1]]], ErrorCode.BAD_MANIFEST, id="empty-name"),
    pytest.param([[b"a", "int8", [1]]], ErrorCode.BAD_MANIFEST, id="bin-name"),
    pytest.param([["n" * 1025, "int8", [1]]], ErrorCode.BAD_MANIFEST, id="name-1025-bytes"),
    pytest.param([["a", "int8", [1]], ["a", "int8", [1]]], ErrorCode.BAD_MANIFEST, id="duplicate"),
    pytest.param([["a", "float8", [1]]], ErrorCode.BAD_MANIFEST, id="unknown-dtype"),
    pytest.param([["a", ["int8"], [1]]], ErrorCode.BAD_MANIFEST, id="list-dtype"),
    pytest.param([["a", "int8", 1]], ErrorCode.BAD_MANIFEST, id="shape-not-an-array"),
    pytest.param([["a", "int8", [1] * 9]], ErrorCode.BAD_MANIFEST, id="rank-9"),
    pytest.param([["a", "int8", [-1]]], ErrorCode.BAD_MANIFEST, id="negative-dim"),
    pytest.param([["a", "int8", [True]]], ErrorCode.BAD_MANIFEST, id="bool-dim"),
    pytest.param([["a", "int8", [1.0]]], ErrorCode.BAD_MANIFEST, id="float-dim"),
    pytest.param(
        [["a", "int8", [LIMITS.max_model_bytes + 1, 0]]], ErrorCode.BAD_MANIFEST, id="dim-above-model-bytes"
    ),
    pytest.param([["a", "int8", [2**32] * 8]], ErrorCode.BAD_MANIFEST, id="huge-product"),
]


@pytest.mark.parametrize(("raw", "code"), BAD_MODELS)
def test_bad_model_is_refused(raw: object, code: ErrorCode) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        parse_model(raw, LIMITS)
    assert info.value.code is code
    # The same model in a JOIN and in a PLAN is refused with the same code.
    join = {"incarnation": ""} if raw is None else {"model": raw, "incarnation": ""}
    assert refused(FrameType.JOIN, msgpack.packb(join, use_bin_type=True)) is code
    assert refused(FrameType.PLAN, packed(PLAN, model=KeyError if raw is None else raw)) is code


def test_model_limits() -> None:
    limits = Limits(max_model_tensors=3, max_tensor_rank=2, max_name_bytes=4)
    ok = [[f"t{i}", "int8", [1, 1]] for i in range(3)]
    assert len(parse_model(ok, limits)) == 3
    with pytest.raises(RemoteProtocolError) as info:
        parse_model([None] * 4, limits)  # counted before any entry is looked at
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED
    for bad in ([["t", "int8", [1, 1, 1]]], [["tensor", "int8", [1]]]):
        with pytest.raises(RemoteProtocolError) as info:
            parse_model(bad, limits)
        assert info.value.code is ErrorCode.BAD_MANIFEST
    with pytest.raises(RemoteProtocolError) as info:
        parse_model([["a", "int8", [2000]]], Limits(max_model_bytes=1999))
    assert info.value.code is ErrorCode.BAD_MANIFEST


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(
    raw=st.one_of(
        json_like,
        st.lists(
            st.tuples(
                st.one_of(st.text(max_size=4), json_like),
                st.one_of(st.sampled_from(sorted(DTYPE_SIZES)), json_like),
                st.one_of(st.lists(st.integers(-2, 2**40), max_size=9), json_like),
            ).map(list),
            max_size=5,
        ),
    )
)
def test_any_model_parses_or_is_refused(raw: object) -> None:
    """A peer's model is decoded msgpack: anything at all."""
    try:
        entries = parse_model(raw, LIMITS)
    except RemoteProtocolError as exc:
        assert exc.code in (ErrorCode.BAD_MANIFEST, ErrorCode.LIMIT_EXCEEDED)
        return
    assert entries and len({e.name for e in entries}) == len(entries)
    assert all(e.dtype in DTYPE_SIZES and e.nbytes <= LIMITS.max_model_bytes for e in entries)


# ------------------------------------------------------------------------------------ plan


def test_plan_decodes() -> None:
    assert decode_body(FrameType.PLAN, encode_body(PLAN), LIMITS) == PLAN
    # Pieces may come in any order and need not follow the model's order, nor be consecutive.
    shuffled = Plan(
        "",
        MODEL,
        (
            (("head.scale", 0, 1), ("embed.weight", 64, 128)),
            (("blocks.0.bias", 8, 16), ("embed.weight", 0, 64), ("blocks.0.weight", 0, 16)),
            (("blocks.0.bias", 0, 8),),
        ),
        (0, 0, 0),
        1,
        0,
        1,
    )
    assert decode_body(FrameType.PLAN, encode_body(shuffled), LIMITS) == shuffled


W0 = ["blocks.0.weight", 0, 16]
S0 = ["head.scale", 0, 1]
E_TAIL = ["embed.weight", 100, 128]
E_HEAD = ["embed.weight", 0, 100]
B0 = ["blocks.0.bias", 0, 16]

BAD_PLANS = [
    # Whether the pieces tile every parameter's rows exactly once: BAD_MANIFEST.
    pytest.param(
        {"fragments": [[W0, S0, E_TAIL], [E_HEAD, B0, S0]]},
        ErrorCode.BAD_MANIFEST,
        id="piece-in-two-fragments",
    ),
    pytest.param(
        {"fragments": [[W0, S0, E_TAIL], [["embed.weight", 0, 101], B0]]},
        ErrorCode.BAD_MANIFEST,
        id="overlapping-rows",
    ),
    pytest.param(
        {"fragments": [[W0, S0, E_TAIL], [["embed.weight", 0, 99], B0]]}, ErrorCode.BAD_MANIFEST, id="row-gap"
    ),
    pytest.param(
        {"fragments": [[W0, S0, E_TAIL], [E_HEAD, ["blocks.0.bias", 0, 17]]]},
        ErrorCode.BAD_MANIFEST,
        id="rows-past-the-end",
    ),
    pytest.param(
        {"fragments": [[W0, S0, E_TAIL], [E_HEAD, B0, ["blocks.0.bias", 3, 3]]]},
        ErrorCode.BAD_MANIFEST,
        id="empty-piece",
    ),
    pytest.param(
        {"fragments": [[W0, S0, E_TAIL], [E_HEAD, ["blocks.0.bias", -1, 16]]]},
        ErrorCode.BAD_MANIFEST,
        id="negative-start",
    ),
    pytest.param(
        {"fragments": [[W0, ["head.scale", 0, 2], E_TAIL], [E_HEAD, B0]]},
        ErrorCode.BAD_MANIFEST,
        id="0-d-tensor-of-two-rows",
    ),
    pytest.param(
        {"fragments": [[W0, S0, E_TAIL], [E_HEAD]]}, ErrorCode.BAD_MANIFEST, id="name-in-no-fragment"
    ),
    pytest.param(
        {"fragments": [[W0, S0, E_TAIL], [E_HEAD, B0, ["lm_head.weight", 0, 1]]]},
        ErrorCode.BAD_MANIFEST,
        id="unknown-name",
    ),
    pytest.param(
        {"fragments": [[W0, S0, E_TAIL], [E_HEAD, B0], []], "versions": [1, 2, 3]},
        ErrorCode.BAD_MANIFEST,
        id="empty-fragment",
    ),
    # Its structure: MALFORMED_BODY.
    pytest.param({"fragments": []}, ErrorCode.MALFORMED_BODY, id="no-fragments"),
    pytest.param({"fragments": {"0": [W0]}}, ErrorCode.MALFORMED_BODY, id="fragments-a-map"),
    pytest.param({"fragments": [[W0, [3, 0, 1]]]}, ErrorCode.MALFORMED_BODY, id="int-name"),
    pytest.param(
        {"fragments": [["blocks.0.weight", "head.scale"], ["embed.weight", "blocks.0.bias"]]},
        ErrorCode.MALFORMED_BODY,
        id="names-not-pieces",
    ),
    pytest.param({"fragments": [[["blocks.0.weight", 0]]]}, ErrorCode.MALFORMED_BODY, id="piece-of-two"),
    pytest.param({"fragments": [[["blocks.0.weight", 0, 16.0]]]}, ErrorCode.MALFORMED_BODY, id="float-row"),
    pytest.param({"fragments": [[["blocks.0.weight", True, 16]]]}, ErrorCode.MALFORMED_BODY, id="bool-row"),
    pytest.param(
        # A structural fault anywhere wins over a tiling fault earlier in the array.
        {"fragments": [[W0, W0], [None]]},
        ErrorCode.MALFORMED_BODY,
        id="structure-checked-before-tiling",
    ),
    pytest.param({"versions": [1]}, ErrorCode.MALFORMED_BODY, id="fewer-versions-than-fragments"),
    pytest.param({"versions": [1, 2, 3]}, ErrorCode.MALFORMED_BODY, id="more-versions-than-fragments"),
    pytest.param({"versions": [1, "2"]}, ErrorCode.MALFORMED_BODY, id="str-version"),
    pytest.param({"versions": 1}, ErrorCode.MALFORMED_BODY, id="versions-not-an-array"),
    pytest.param({"sync_every": 0}, ErrorCode.MALFORMED_BODY, id="sync-every-0"),
    pytest.param({"quorum": -1}, ErrorCode.MALFORMED_BODY, id="quorum-negative"),
    pytest.param({"next_round": "1"}, ErrorCode.MALFORMED_BODY, id="str-next-round"),
    pytest.param({"overlap": True}, ErrorCode.MALFORMED_BODY, id="bool-overlap"),
    pytest.param({"incarnation": "i" * 129}, ErrorCode.MALFORMED_BODY, id="incarnation-129-bytes"),
]


@pytest.mark.parametrize(("changes", "code"), BAD_PLANS)
def test_bad_plan_is_refused(changes: dict[str, object], code: ErrorCode) -> None:
    assert refused(FrameType.PLAN, packed(PLAN, **changes)) is code


def test_plan_limits() -> None:
    whole = [(e.name, 0, piece_rows(e.shape)) for e in MODEL]
    four = Plan("", MODEL, tuple((p,) for p in whole), (0, 0, 0, 0), 4, 1, 2)
    assert decode_body(FrameType.PLAN, encode_body(four), Limits(max_fragments=4)) == four
    assert refused(FrameType.PLAN, encode_body(four), Limits(max_fragments=3)) is ErrorCode.LIMIT_EXCEEDED
    # A name longer than any model may hold is refused as structure, whatever the model says.
    long_name = packed(PLAN, fragments=[[W0, S0, E_TAIL], [E_HEAD, ["x" * 20, 0, 1]]])
    assert refused(FrameType.PLAN, long_name, Limits(max_name_bytes=16)) is ErrorCode.MALFORMED_BODY
    # A fragment's float32 bytes (embed.weight rows 0..100: 12800, with the bias 12864) and its
    # pieces are bounded like a stream's.
    assert (
        refused(FrameType.PLAN, encode_body(PLAN), Limits(max_fragment_bytes=12_863))
        is ErrorCode.LIMIT_EXCEEDED
    )
    assert decode_body(FrameType.PLAN, encode_body(PLAN), Limits(max_fragment_bytes=12_864)) == PLAN
    assert refused(FrameType.PLAN, encode_body(PLAN), Limits(max_tensors_per_fragment=2)) is (
        ErrorCode.LIMIT_EXCEEDED
    )


def test_join_fields() -> None:
    join = Join(MODEL)
    assert join.incarnation == ""
    assert decode_body(FrameType.JOIN, encode_body(join), LIMITS) == join
    assert list(join.to_body()) == ["model", "incarnation", "instance"]
    assert list(PLAN.to_body()) == [
        "incarnation", "model", "fragments", "versions", "sync_every", "overlap", "quorum", "next_round",
    ]  # fmt: skip
    at_cap = Join(MODEL, "é" * 64)  # 128 bytes of UTF-8
    assert decode_body(FrameType.JOIN, encode_body(at_cap), LIMITS) == at_cap


def test_join_instance_is_optional_and_bounded() -> None:
    """JOIN's instance (SPEC §4.3) may be absent (a learner that sends none: ""), and holds at most
    64 bytes of UTF-8."""
    without = msgpack.packb({"model": [e.to_wire() for e in MODEL], "incarnation": "inc-1"})
    assert decode_body(FrameType.JOIN, without, LIMITS) == Join(MODEL, "inc-1", "")
    at_cap = Join(MODEL, "", "é" * 32)
    assert decode_body(FrameType.JOIN, encode_body(at_cap), LIMITS) == at_cap
    for bad in ("é" * 32 + "x", 7, b"bytes"):
        body = msgpack.packb({**Join(MODEL).to_body(), "instance": bad})
        assert refused(FrameType.JOIN, body, LIMITS) is ErrorCode.MALFORMED_BODY


# ---------------------------------------------------------------------- the join sequence


def fragment_bytes(plan: Plan, index: int) -> tuple[UpdateHeader, bytes]:
    """What a syncer sends to heal one fragment: its pieces in fragment order, packed as float32
    (whatever the parameters' own dtypes: protocol/SPEC.md §5.2)."""
    shapes = {e.name: e.shape for e in plan.model}
    entries, raw_bytes = fragment_manifest(plan.fragments[index], shapes)
    header = UpdateHeader(
        tuple(entries), raw_bytes, "none", LIMITS.min_chunk_bytes, index, plan.versions[index]
    )
    return header, bytes((index * 31 + i) % 251 for i in range(raw_bytes))


def test_join_plan_heal_then_rounds(connect: Connect, shuttle: Shuttle) -> None:
    """SPEC §4.4 between two cores: JOIN, PLAN, one UPDATE_HEADER transfer per fragment carrying
    its current value and version, then a round (STEP_REPORT, FRAGMENT_REQUEST, PUSH_HEADER)."""
    learner, syncer = connect()
    learner.send(Join(MODEL, ""))
    (joined,) = shuttle(learner, syncer)
    assert isinstance(joined, MessageReceived) and joined.message == Join(MODEL, "")

    syncer.send(PLAN)
    (planned,) = shuttle(syncer, learner)
    assert isinstance(planned, MessageReceived) and planned.message == PLAN

    streams = InboundStreams(LIMITS, lambda h: memoryview(bytearray(h.raw_bytes)))
    learner.chunk_sink = streams.chunk_target
    healed: dict[int, FragmentAssembled] = {}
    for index in range(len(PLAN.fragments)):
        transfer_id = 2 * (index + 1)  # server-sent transfers have even ids
        header, raw = fragment_bytes(PLAN, index)
        syncer.send(header, transfer_id)
        (opened,) = shuttle(syncer, learner)
        assert isinstance(opened, MessageReceived) and opened.message == header
        assert streams.open(transfer_id, header) == []  # no chunk came before its header
        checksums = []
        for seq in range(header.chunks):
            piece = raw[seq * header.chunk_bytes : (seq + 1) * header.chunk_bytes]
            checksums.append(codecs.checksum(piece))
            syncer.send_chunk(transfer_id, ChunkHeader(seq, len(piece), Codec.NONE, 0, checksums[-1]), piece)
        syncer.send(FragmentEnd(header.chunks, codecs.fragment_digest(checksums)), transfer_id)
        for event in shuttle(syncer, learner):
            done = None
            if isinstance(event, ChunkReceived):
                assert event.in_place  # uncompressed chunks land straight in the fragment buffer
                done = streams.chunk_verified(event.transfer_id, event.chunk)
            elif isinstance(event, MessageReceived) and isinstance(event.message, FragmentEnd):
                done = streams.end(event.stream_id, event.message)
            if done is not None:
                healed[index] = done
                learner.send(FragmentAck(), done.transfer_id)
        assert bytes(healed[index].buffer) == raw
        assert header.chunks == (2, 4)[index]  # 4,672 and 12,864 bytes of float32 in 4 KiB chunks
        assert shuttle(learner, syncer) == [MessageReceived(FragmentAck(), transfer_id)]
    for index, done in healed.items():
        assert isinstance(done.header, UpdateHeader)
        labels = [
            label for label, _ in fragment_shapes(PLAN.fragments[index], {e.name: e.shape for e in MODEL})
        ]
        assert [e.name for e in done.header.manifest] == labels
        assert done.header.version == PLAN.versions[index]
    assert labels == ["embed.weight[0:100]", "blocks.0.bias"]

    learner.send(StepReport(1, 4096, 0.5))
    assert shuttle(learner, syncer) == [MessageReceived(StepReport(1, 4096, 0.5))]
    syncer.send(FragmentRequest(1, 0, PLAN.versions[1]))
    assert shuttle(syncer, learner) == [MessageReceived(FragmentRequest(1, 0, PLAN.versions[1]))]
    push = PushHeader((), 0, "none", LIMITS.min_chunk_bytes, 1, 0, PLAN.versions[1], 1, 4096)
    learner.send(push, 1)
    assert shuttle(learner, syncer) == [MessageReceived(push, 1)]


# ------------------------------------------------------------- application codes, not the core's


def test_the_core_does_not_enforce_the_join_order(connect: Connect, shuttle: Shuttle) -> None:
    """STEP_REPORT before JOIN and a second JOIN pass the core: NOT_JOINED is the syncer's call."""
    learner, syncer = connect()
    learner.send(StepReport(1, 1, 0.1))
    learner.send(Join(MODEL))
    learner.send(Join(MODEL))
    assert [type(e.message) for e in shuttle(learner, syncer) if isinstance(e, MessageReceived)] == [
        StepReport,
        Join,
        Join,
    ]


@pytest.mark.parametrize("code", [ErrorCode.MODEL_MISMATCH, ErrorCode.NOT_JOINED], ids=lambda c: c.name)
def test_application_errors_travel_as_error_frames(
    connect: Connect, shuttle: Shuttle, code: ErrorCode
) -> None:
    learner, syncer = connect()
    syncer.fail(code, "blocks.0.weight: float32 [16, 16] here, float32 [16, 8] in the plan")
    (event,) = shuttle(syncer, learner)
    assert isinstance(event, PeerWentAway) and event.error_code == code


@pytest.mark.parametrize("code", [ErrorCode.NOT_REQUESTED, ErrorCode.STALE_VERSION], ids=lambda c: c.name)
def test_application_resets_leave_the_connection_open(
    connect: Connect, shuttle: Shuttle, code: ErrorCode
) -> None:
    learner, syncer = connect()
    push = PushHeader((), 0, "none", LIMITS.min_chunk_bytes, 3, 7, 2, 1, 1)
    learner.send(push, 5)
    shuttle(learner, syncer)
    syncer.send(StreamReset(int(code), "fragment 3 was not asked of this learner in round 7"), 5)
    assert shuttle(syncer, learner) == [
        MessageReceived(StreamReset(int(code), "fragment 3 was not asked of this learner in round 7"), 5)
    ]
    assert learner.state is syncer.state is State.OPEN


def test_the_core_never_raises_application_codes() -> None:
    """Codes 24 and up are the syncer's: nothing in dilocod/wire raises them."""
    application = {c.name for c in ErrorCode if c >= ErrorCode.MODEL_MISMATCH}
    assert application == {
        "MODEL_MISMATCH", "NOT_REQUESTED", "STALE_VERSION", "NOT_JOINED", "LEARNER_ID_IN_USE",
    }  # fmt: skip
    root = Path(dilocod.wire.__file__).parent
    for path in root.glob("*.py"):
        if path.name == "errors.py":
            continue
        text = path.read_text()
        assert not any(f"ErrorCode.{name}" in text for name in application), path.name


def test_join_and_plan_bodies_may_be_large(connect: Connect) -> None:
    """JOIN and PLAN list whole models: they take the control body cap, not the message cap."""
    _, syncer = connect()
    big = LIMITS.max_message_bytes + 1
    assert syncer.receive_data(encode_header(FrameType.JOIN, 0, big)) == []
    assert len(syncer.get_buffer()) == big
