"""The outbox's notes between the learner's two processes (dilocod.learner.ipc): every note survives
msgpack as itself, and a note that is not what it says is refused naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dilocod.learner.bridge import Snapshot, StepReportItem
from dilocod.learner.ipc import (
    DELTA_IN_THETA,
    NO_ANCHOR,
    NO_BUFFER,
    IpcError,
    SnapshotNote,
    step_from_wire,
    step_to_wire,
)
from dilocod.learner.link import LinkConfig
from dilocod.learner.netproc import decode_config, encode_config
from dilocod.tuning.advice import Advice
from dilocod.tuning.codecs import CodecFigure
from dilocod.wire.manifest import ModelEntry

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
    raw = through_msgpack(encode_config(link, model, "inc-7", True))
    child = decode_config(raw)
    assert child.link == link and child.model == model and child.incarnation == "inc-7" and child.use_uvloop
