"""The notes between the learner's two processes (dilocod.learner.ipc): every note survives msgpack
as itself, and a note that is not what it says is refused naming the note and the field."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dilocod.learner.bridge import LostPush, Snapshot, StepReportItem
from dilocod.learner.channel import Mapper, NetworkProcessError, read_note
from dilocod.learner.control import Control, UpdateNote
from dilocod.learner.ipc import (
    DELTA_IN_THETA,
    NO_ANCHOR,
    NO_BUFFER,
    ConfigNote,
    InboxNote,
    IpcError,
    NewBuffer,
    NewBuffersNote,
    Note,
    OutboxNote,
    ReleaseNote,
    SnapshotNote,
    StatsNote,
    note_from_wire,
    step_from_wire,
    step_to_wire,
)
from dilocod.learner.link import LinkConfig
from dilocod.learner.netchild import decode_config
from dilocod.learner.netproc import ProcessBridge, encode_config
from dilocod.tuning.advice import Advice
from dilocod.tuning.codecs import CodecFigure
from dilocod.wire.manifest import ModelEntry
from dilocod.wire.messages import FragmentRequest, Plan

counts = st.integers(0, 2**62)
optional = st.none() | counts
notes = st.builds(
    SnapshotNote,
    counts, counts, counts, counts, counts,
    st.integers(NO_BUFFER, 2**31), counts, optional, optional, st.integers(DELTA_IN_THETA, 2**31),
)  # fmt: skip


def through_msgpack(value: Any) -> Any:
    return msgpack.unpackb(msgpack.packb(value), use_list=True)


@given(notes)
def test_a_note_survives_msgpack_as_itself(note: SnapshotNote) -> None:
    assert SnapshotNote.from_wire(through_msgpack(note.to_wire())) == note


@given(st.integers(0, 2**40), counts, st.floats(0, 1e6))
def test_a_step_report_survives_msgpack_as_itself(step: int, tokens: int, seconds: float) -> None:
    item = StepReportItem(step, tokens, seconds)
    assert step_from_wire(through_msgpack(step_to_wire(item))) == item


def test_a_snapshot_becomes_its_note() -> None:
    theta = bytearray(64)
    pushed = Snapshot(3, 11, 7, 5, 640, theta, bytearray(64), step=20, apply_late=1)
    assert SnapshotNote.of(pushed, 9, 4) == SnapshotNote(3, 11, 7, 5, 640, 9, 64, 20, 1, 4)
    nothing = Snapshot(3, 12, 7, 0, 0, bytearray(), bytearray(), step=21, apply_late=2)
    note = SnapshotNote.of(nothing, 9, 4)
    assert note.empty and (note.buffer, note.size, note.apply_late, note.anchor) == (
        NO_BUFFER,
        0,
        None,
        NO_ANCHOR,
    )


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ([1, 2, 3], "not a list of 10 fields"),
        ({"fragment": 1}, "not a list of 10 fields"),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, "10"], "anchor is '10'"),
        ([1, 2, 3, 4, 5, 6, 7.5, 8, 9, 10], "size is 7.5"),
        ([True, 2, 3, 4, 5, 6, 7, 8, 9, 10], "fragment is True"),
        ([1, 2, 3, 4, 5, 6, 7, "8", 9, 10], "step is '8'"),
        ([1, 2, 3, 4, 5, -7, 7, 8, 9, 10], "names buffer -7"),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, -3], "anchor -3"),
    ],
)
def test_a_note_that_is_not_what_it_says_is_refused_naming_the_field(raw: Any, named: str) -> None:
    with pytest.raises(IpcError, match=named):
        SnapshotNote.from_wire(raw)


@pytest.mark.parametrize("raw", [[1, 2], [1, 2, "0.5"], [1, 2, -1.0], [1, "2", 0.5], [1, 2, float("nan")]])
def test_a_step_report_that_is_not_one_is_refused(raw: Any) -> None:
    with pytest.raises(IpcError):
        step_from_wire(raw)


def test_the_network_processs_config_carries_every_field_of_the_link() -> None:
    """Generated from the LinkConfig dataclass: every field set off its default comes back."""
    advice = Advice("syncer:7070", 4.5, 30.0, 7, "zstd", 1 << 20, "2026-12-01T00:00:00Z",
                    (CodecFigure("zstd", 1.4, 0.9, 2.0),))  # fmt: skip
    link = LinkConfig(
        "syncer.example", 7070, "site-a", b"s" * 16, streams=7, codec="zstd", advice=advice,
        precision="bf16", chunk_bytes=1 << 18, join_timeout_s=5.0, backoff_min_s=0.25,
        backoff_max_s=9.0, instance="i-1",
    )  # fmt: skip
    defaults = LinkConfig("h", 1, "l", None)
    changed = {f.name for f in dataclasses.fields(link) if getattr(link, f.name) != getattr(defaults, f.name)}
    assert changed == {f.name for f in dataclasses.fields(link)} - {"tls", "tls_files"}
    model = (ModelEntry("w", "float32", (4, 3)),)
    raw = through_msgpack(encode_config(link, model, "inc-7", True).to_wire())
    child = decode_config(raw)
    assert child.link == link and child.model == model and child.incarnation == "inc-7" and child.use_uvloop


# ----------------------------------------------------------------------------- every note


def _plan(overlap: int) -> Plan:
    model = (ModelEntry("a", "float32", (4,)), ModelEntry("b", "float32", (4,)))
    return Plan("inc", model, ((("a", 0, 4),), (("b", 0, 4),)), (0, 0), 2, overlap, 1)


texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
ids = st.lists(st.integers(0, 2**31), max_size=4).map(tuple)
new_buffers = st.lists(
    st.builds(NewBuffer, st.integers(0, 2**31), counts, st.none() | counts), max_size=4
).map(tuple)
steps = st.builds(StepReportItem, st.integers(0, 2**40), counts, st.floats(0, 1e6))
plain = st.none() | st.booleans() | counts | st.floats(allow_nan=False) | texts
models = st.sampled_from([(ModelEntry("w", "float32", (4, 3)),), _plan(0).model])


@st.composite
def inbox_notes(draw: st.DrawFn) -> InboxNote:
    updates = draw(st.lists(st.builds(UpdateNote, counts, counts, st.booleans(), texts, counts), max_size=4))
    control = Control(
        draw(st.none() | st.integers(0, 8).map(_plan)),
        tuple(updates),
        tuple(draw(st.lists(st.builds(FragmentRequest, st.integers(0, 2**32 - 1), counts, counts)))),
        draw(st.none() | texts),
        tuple(draw(st.lists(st.builds(LostPush, counts, counts)))),
    )
    buffers = tuple(draw(st.lists(st.integers(0, 2**31), min_size=len(updates), max_size=len(updates))))
    return InboxNote(control, buffers, draw(new_buffers), draw(ids))


every_note = st.one_of(
    st.builds(
        ConfigNote,
        st.dictionaries(texts, plain, max_size=5),
        st.none() | st.lists(texts, max_size=3).map(tuple),
        st.none() | st.dictionaries(texts, plain, max_size=3),
        models,
        texts,
        st.booleans(),
    ),
    st.builds(NewBuffersNote, new_buffers),
    st.builds(
        OutboxNote, st.lists(steps, max_size=3).map(tuple), st.lists(notes, max_size=3).map(tuple), ids
    ),
    inbox_notes(),
    st.builds(ReleaseNote, ids),
    st.builds(StatsNote, st.dictionaries(texts, plain | st.dictionaries(texts, st.floats(0, 1e3)))),
)


@given(every_note)
def test_every_note_survives_msgpack_as_itself(note: Note) -> None:
    wire = through_msgpack(note.to_wire())
    assert note_from_wire(wire) == note
    assert type(note).from_wire(wire) == note


_OUTBOX = OutboxNote((StepReportItem(1, 2, 0.5),), (SnapshotNote(1, 2, 3, 4, 5, 6, 7, 8, 9, 10),), (3,))
_INBOX = InboxNote(
    Control(_plan(2), (UpdateNote(0, 1, True, "inc", 16),), (FragmentRequest(1, 2, 0),), None, ()),
    (5,),
    (),
    (),
)
_CONFIG = ConfigNote({"host": "h"}, None, None, (ModelEntry("w", "float32", (4, 3)),), "inc", False)


def _with(note: Note, **fields: Any) -> dict[str, Any]:
    """The note's wire map with some of its fields replaced (None: left out)."""
    wire = through_msgpack(note.to_wire())
    for key, value in fields.items():
        if value is None:
            del wire[key]
        else:
            wire[key] = value
    return wire


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ([1, 2], "no known kind: None"),
        ({"k": "gossip"}, "no known kind: 'gossip'"),
        (_with(_CONFIG, link=[1]), "config note's link is"),
        (_with(_CONFIG, link={1: 2}), "config note's link is"),
        (_with(_CONFIG, tls_files=["a", 2]), "config note's tls_files"),
        (_with(_CONFIG, advice="fast"), "config note's advice"),
        (_with(_CONFIG, model=[["w", "float99", [1]]]), "config note's model"),
        (_with(_CONFIG, incarnation=7), "config note's incarnation"),
        (_with(_CONFIG, use_uvloop=1), "config note's use_uvloop"),
        (_with(_CONFIG, incarnation=None), "config note has no 'incarnation'"),
        (_with(NewBuffersNote((NewBuffer(1, 2),)), new=[[1]]), "new note's buffer is \\[1\\]"),
        (_with(NewBuffersNote((NewBuffer(1, 2),)), new=[[1, -2]]), "new note's buffer is \\[1, -2\\]"),
        (_with(NewBuffersNote(()), new={}), "new note's buffer is {}"),
        (_with(_OUTBOX, steps=[[1, 2]]), "step report is \\[1, 2\\]"),
        (_with(_OUTBOX, steps=7), "outbox note's steps is 7"),
        (_with(_OUTBOX, snapshots=[[1]]), "snapshot note is \\[1\\]"),
        (_with(_OUTBOX, snapshots=None), "outbox note has no 'snapshots'"),
        (_with(_OUTBOX, release=["3"]), "outbox note's released names buffer '3'"),
        (_with(_OUTBOX, extra=1), "outbox note has fields it should not: \\['extra'\\]"),
        (_with(_INBOX, control={"plan": None}), "inbox note's control: inbox control must be a map"),
        (_with(_INBOX, ids=[]), "inbox note names 0 buffers for 1 updates"),
        (_with(_INBOX, ids=[True]), "inbox note's buffers names buffer True"),
        (_with(_INBOX, new=[[1, 2, 3, 4]]), "inbox note's new buffer is"),
        (_with(_INBOX, release=None), "an inbox note has no 'release'"),
        (_with(ReleaseNote((1,)), ids=[-1]), "release note's released names buffer -1"),
        (_with(ReleaseNote((1,)), ids=None), "release note has no 'ids'"),
        (_with(StatsNote({}), stats=[1]), "stats note's stats is \\[1\\]"),
    ],
)
def test_a_note_that_is_not_what_its_kind_says_is_refused_naming_the_field(raw: Any, named: str) -> None:
    with pytest.raises(IpcError, match=named):
        note_from_wire(raw)


def test_a_bad_note_stops_the_training_side_with_its_name_and_closes_its_descriptors() -> None:
    """Read by the network process's code, not deep in it: a NetworkProcessError that names the
    note and the field, and the descriptors that came with the datagram closed."""
    read, write = os.pipe()
    with pytest.raises(NetworkProcessError, match="the child: an inbox note names 0 buffers for 1 updates"):
        read_note(_with(_INBOX, ids=[]), [read, write], Mapper(), "the child")
    for fd in (read, write):
        with pytest.raises(OSError):
            os.fstat(fd)
    parent = ProcessBridge()
    try:
        parent._child_data.sendmsg([msgpack.packb(_with(_INBOX, control=[]))])
        with pytest.raises(NetworkProcessError, match="an inbox note's control"):
            parent.take()
    finally:
        parent.close()
