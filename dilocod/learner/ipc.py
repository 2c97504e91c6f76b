"""The notes of the training process's outbox to its network process (dilocod.learner.netproc), as
frozen dataclasses with validating decoders: each travels as a msgpack list and is read back field
by field with its type checked, so a note that is not what it says is an IpcError naming the field,
not an exception deep in the network process. The two processes are one program, so a bad note is
a bug of ours; the check makes it say where.

Must not import torch or networking (the network process imports this without them).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

from dilocod.learner.bridge import Snapshot, StepReportItem

#: A snapshot note's anchor when the training side computed δ itself (Snapshot.delta): the buffer
#: holds the outer gradient, and no anchor of the network process's is named.
DELTA_IN_THETA = -2
#: A snapshot note's anchor that is none of the network process's buffers.
NO_ANCHOR = -1
#: A snapshot note's buffer for NOTHING_TO_PUSH: no bytes travel.
NO_BUFFER = -1


class IpcError(ValueError):
    """A note between the learner's two processes that is not what its kind says."""


def _int(raw: Any, what: str, *, optional: bool = False) -> int | None:
    if raw is None and optional:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise IpcError(f"{what} is {raw!r}, not an integer")
    return raw


def _fields(raw: Any, kind: str, count: int) -> list[Any]:
    if not isinstance(raw, list | tuple) or len(raw) != count:
        raise IpcError(f"a {kind} is {raw!r}, not a list of {count} fields")
    return list(raw)


@dataclass(frozen=True, slots=True)
class SnapshotNote:
    """A snapshot as the outbox carries it: its counters, where its bytes are, and its anchor."""

    fragment: int
    round: int
    base_version: int
    c_steps: int
    c_tokens: int
    #: The training process's lent buffer that holds θ (or δ); NO_BUFFER for NOTHING_TO_PUSH.
    buffer: int
    size: int
    step: int | None
    apply_late: int | None
    #: The network process's buffer that is the push's anchor, NO_ANCHOR or DELTA_IN_THETA.
    anchor: int

    @classmethod
    def of(cls, snapshot: Snapshot, buffer: int, anchor: int) -> SnapshotNote:
        """The note of a snapshot whose bytes are in `buffer`, pushed from `anchor`; NOTHING_TO_PUSH
        (no step since the last push) names neither."""
        empty = snapshot.empty
        return cls(
            snapshot.fragment,
            snapshot.round,
            snapshot.base_version,
            snapshot.c_steps,
            snapshot.c_tokens,
            NO_BUFFER if empty else buffer,
            0 if empty else len(snapshot.theta),
            snapshot.step,
            None if empty else snapshot.apply_late,
            NO_ANCHOR if empty else anchor,
        )

    def to_wire(self) -> list[int | None]:
        return list(astuple(self))

    @classmethod
    def from_wire(cls, raw: Any) -> SnapshotNote:
        values = _fields(raw, "snapshot note", 10)
        names = ("fragment", "round", "base_version", "c_steps", "c_tokens", "buffer", "size")
        ints = [
            _int(value, f"a snapshot note's {name}") for name, value in zip(names, values[:7], strict=True)
        ]
        step = _int(values[7], "a snapshot note's step", optional=True)
        late = _int(values[8], "a snapshot note's apply_late", optional=True)
        anchor = _int(values[9], "a snapshot note's anchor")
        note = cls(*ints, step, late, anchor)  # type: ignore[arg-type]
        if note.buffer < NO_BUFFER or note.size < 0 or note.anchor < DELTA_IN_THETA:
            raise IpcError(
                f"a snapshot note names buffer {note.buffer} of {note.size} bytes, anchor {note.anchor}"
            )
        return note

    @property
    def empty(self) -> bool:
        return self.buffer == NO_BUFFER


def step_to_wire(item: StepReportItem) -> list[int | float]:
    return [item.step, item.tokens, item.step_time_s]


def step_from_wire(raw: Any) -> StepReportItem:
    step, tokens, seconds = _fields(raw, "step report", 3)
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or not seconds >= 0:
        raise IpcError(f"a step report's step_time_s is {seconds!r}")
    return StepReportItem(
        _int(step, "a step report's step"), _int(tokens, "a step report's tokens"), float(seconds)
    )  # type: ignore[arg-type]
