"""Every message between the learner's two processes (dilocod.learner.netproc, netchild), as frozen
dataclasses with an encoder (to_wire) and a validating decoder (from_wire, and note_from_wire for
whichever kind arrives).

Each note travels as one msgpack map {"k": kind, ...}, one datagram, and is read back field by
field with its type checked, so a note that is not what it says is an IpcError naming the note and
the field, not a KeyError or TypeError deep in either process. The two processes are one program,
so a bad note is a bug of ours; the check makes it say where. The notes:

- training process to network process, on the data socket: ConfigNote (first, once), NewBuffersNote
  (a snapshot buffer lent for the first time, its descriptor with the datagram) and OutboxNote (a
  step boundary's step reports, SnapshotNotes and the update buffers given back);
- network process to training process: InboxNote (plan, merged fragments, requests, lost pushes,
  a fatal error, as dilocod.learner.control's Control, with the buffers the updates are in and the
  snapshot buffers given back) and ReleaseNote (snapshot buffers given back alone);
- network process to training process, on the side socket: StatsNote (the link's statistics).

Fragment bytes are in none of them (they sit in memory both processes map; a note names buffers by
id). The inbox is decoded on the training thread at its step boundaries: the checks are plain type()
comparisons, no generators.

Must not import torch or networking (the network process imports this without them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dilocod.learner.bridge import Snapshot, StepReportItem
from dilocod.learner.control import Control, ControlError, control_from_raw
from dilocod.wire.errors import RemoteProtocolError
from dilocod.wire.limits import DEFAULT_LIMITS
from dilocod.wire.manifest import ModelEntry, parse_model

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
    if type(raw) is not int:  # True is an int, and must not pass for one
        raise IpcError(f"{what} is {raw!r:.200}, not an integer")
    return raw


def _fields(raw: Any, kind: str, count: int) -> list[Any]:
    if not isinstance(raw, list | tuple) or len(raw) != count:
        raise IpcError(f"a {kind} is {raw!r:.200}, not a list of {count} fields")
    return list(raw)


def _ids(raw: Any, what: str) -> tuple[int, ...]:
    """A list of buffer ids (non-negative integers)."""
    if type(raw) is not list:
        raise IpcError(f"{what} is {raw!r:.200}, not a list of buffer ids")
    for bid in raw:
        if type(bid) is not int or bid < 0:
            raise IpcError(f"{what} names buffer {bid!r:.200}")
    return tuple(raw)


def _body(raw: Any, kind: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """A note's map, with exactly its keys (and "k")."""
    note = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} note"
    if type(raw) is not dict:
        raise IpcError(f"{note} is {raw!r:.200}, not a map")
    for key in keys:
        if key not in raw:
            raise IpcError(f"{note} has no {key!r}")
    if len(raw) != len(keys) + 1:
        extra = sorted(str(key) for key in raw if key not in keys and key != "k")
        raise IpcError(f"{note} has fields it should not: {extra}")
    return raw


# ----------------------------------------------------------------------------- parts of notes


@dataclass(frozen=True, slots=True)
class NewBuffer:
    """A buffer of the sender's that the receiver maps from now on: a memfd whose descriptor comes
    with the datagram (offset None, descriptors in the order of the note's list), or the piece of
    the anchors' arena at `offset` (dilocod.learner.arena), which needs none."""

    buffer: int
    size: int
    offset: int | None = None

    def to_wire(self) -> list[int]:
        if self.offset is None:
            return [self.buffer, self.size]
        return [self.buffer, self.size, self.offset]

    @classmethod
    def from_wire(cls, raw: Any, what: str) -> NewBuffer:
        if type(raw) is not list or not 2 <= len(raw) <= 3:
            raise IpcError(f"{what} is {raw!r:.200}, not [buffer, size] or [buffer, size, offset]")
        for value in raw:
            if type(value) is not int or value < 0:
                raise IpcError(f"{what} is {raw!r:.200}, not of non-negative integers")
        return cls(raw[0], raw[1], raw[2] if len(raw) == 3 else None)


def _new(raw: Any, what: str) -> tuple[NewBuffer, ...]:
    if type(raw) is not list:
        raise IpcError(f"{what} is {raw!r:.200}, not a list")
    return tuple([NewBuffer.from_wire(item, what) for item in raw])


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
        return [
            self.fragment,
            self.round,
            self.base_version,
            self.c_steps,
            self.c_tokens,
            self.buffer,
            self.size,
            self.step,
            self.apply_late,
            self.anchor,
        ]

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


# ----------------------------------------------------------------------------- the notes


@dataclass(frozen=True, slots=True)
class ConfigNote:
    """The network process's configuration, the training process's first note: the LinkConfig's
    plain fields by name (netproc.encode_config), its TLS files and its advice (as the advice file's
    JSON), the model, the learner's incarnation, and whether the loop is uvloop's."""

    KIND: ClassVar[str] = "config"
    new: ClassVar[tuple[NewBuffer, ...]] = ()

    link: dict[str, Any]
    tls_files: tuple[str, ...] | None
    advice: dict[str, Any] | None
    model: tuple[ModelEntry, ...]
    incarnation: str
    use_uvloop: bool

    def to_wire(self) -> dict[str, Any]:
        return {
            "k": self.KIND,
            "link": self.link,
            "tls_files": None if self.tls_files is None else list(self.tls_files),
            "advice": self.advice,
            "model": [entry.to_wire() for entry in self.model],
            "incarnation": self.incarnation,
            "use_uvloop": self.use_uvloop,
        }

    @classmethod
    def from_wire(cls, raw: Any) -> ConfigNote:
        body = _body(raw, "config", ("link", "tls_files", "advice", "model", "incarnation", "use_uvloop"))
        link = body["link"]
        if type(link) is not dict or not all(type(key) is str for key in link):
            raise IpcError(f"a config note's link is {link!r:.200}, not a map of field names")
        files = body["tls_files"]
        if files is not None and (type(files) is not list or not all(type(f) is str for f in files)):
            raise IpcError(f"a config note's tls_files is {files!r:.200}, not a list of paths")
        advice = body["advice"]
        if advice is not None and type(advice) is not dict:
            raise IpcError(f"a config note's advice is {advice!r:.200}, not a map")
        try:
            model = parse_model(body["model"], DEFAULT_LIMITS)
        except RemoteProtocolError as exc:
            raise IpcError(f"a config note's model: {exc.message}") from None
        incarnation = body["incarnation"]
        if type(incarnation) is not str:
            raise IpcError(f"a config note's incarnation is {incarnation!r:.200}, not a string")
        uvloop = body["use_uvloop"]
        if type(uvloop) is not bool:
            raise IpcError(f"a config note's use_uvloop is {uvloop!r:.200}, not a boolean")
        return cls(link, None if files is None else tuple(files), advice, model, incarnation, uvloop)


@dataclass(frozen=True, slots=True)
class NewBuffersNote:
    """Snapshot buffers the training process lends the network process for the first time (their
    descriptors with the datagram); later snapshots in them name them by id only."""

    KIND: ClassVar[str] = "new"

    new: tuple[NewBuffer, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"k": self.KIND, "new": [buffer.to_wire() for buffer in self.new]}

    @classmethod
    def from_wire(cls, raw: Any) -> NewBuffersNote:
        body = _body(raw, "new", ("new",))
        return cls(_new(body["new"], "a new note's buffer"))


@dataclass(frozen=True, slots=True)
class OutboxNote:
    """A step boundary's datagram to the network process: the steps reported, the snapshots of
    requested fragments, and the network process's update buffers the training side gives back
    (the child reads the snapshots first: what they name as anchors it holds from then on)."""

    KIND: ClassVar[str] = "outbox"
    new: ClassVar[tuple[NewBuffer, ...]] = ()

    steps: tuple[StepReportItem, ...]
    snapshots: tuple[SnapshotNote, ...]
    released: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "k": self.KIND,
            "steps": [step_to_wire(item) for item in self.steps],
            "snapshots": [note.to_wire() for note in self.snapshots],
            "release": list(self.released),
        }

    @classmethod
    def from_wire(cls, raw: Any) -> OutboxNote:
        body = _body(raw, "outbox", ("steps", "snapshots", "release"))
        steps, snapshots = body["steps"], body["snapshots"]
        if type(steps) is not list:
            raise IpcError(f"an outbox note's steps is {steps!r:.200}, not a list")
        if type(snapshots) is not list:
            raise IpcError(f"an outbox note's snapshots is {snapshots!r:.200}, not a list")
        return cls(
            tuple([step_from_wire(item) for item in steps]),
            tuple([SnapshotNote.from_wire(item) for item in snapshots]),
            _ids(body["release"], "an outbox note's released"),
        )


@dataclass(frozen=True, slots=True)
class InboxNote:
    """What the network posted for the training loop (Control, without the bytes), the network
    process's buffers its updates are in (one per update, in order; the new ones among them
    introduced), and the training process's snapshot buffers given back with it."""

    KIND: ClassVar[str] = "inbox"

    control: Control
    buffers: tuple[int, ...]
    new: tuple[NewBuffer, ...]
    released: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "k": self.KIND,
            "control": self.control.to_raw(),
            "ids": list(self.buffers),
            "new": [buffer.to_wire() for buffer in self.new],
            "release": list(self.released),
        }

    @classmethod
    def from_wire(cls, raw: Any) -> InboxNote:
        body = _body(raw, "inbox", ("control", "ids", "new", "release"))
        try:
            control = control_from_raw(body["control"])
        except ControlError as exc:
            raise IpcError(f"an inbox note's control: {exc}") from None
        buffers = _ids(body["ids"], "an inbox note's buffers")
        if len(buffers) != len(control.updates):
            raise IpcError(f"an inbox note names {len(buffers)} buffers for {len(control.updates)} updates")
        return cls(
            control,
            buffers,
            _new(body["new"], "an inbox note's new buffer"),
            _ids(body["release"], "an inbox note's released"),
        )


@dataclass(frozen=True, slots=True)
class ReleaseNote:
    """The training process's snapshot buffers given back alone (no inbox note came to carry them
    in time)."""

    KIND: ClassVar[str] = "release"
    new: ClassVar[tuple[NewBuffer, ...]] = ()

    released: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"k": self.KIND, "ids": list(self.released)}

    @classmethod
    def from_wire(cls, raw: Any) -> ReleaseNote:
        body = _body(raw, "release", ("ids",))
        return cls(_ids(body["ids"], "a release note's released"))


@dataclass(frozen=True, slots=True)
class StatsNote:
    """The link's statistics (dataclasses.asdict of LinkStats), on the side socket once a second."""

    KIND: ClassVar[str] = "stats"
    new: ClassVar[tuple[NewBuffer, ...]] = ()

    stats: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"k": self.KIND, "stats": self.stats}

    @classmethod
    def from_wire(cls, raw: Any) -> StatsNote:
        stats = _body(raw, "stats", ("stats",))["stats"]
        if type(stats) is not dict or not all(type(key) is str for key in stats):
            raise IpcError(f"a stats note's stats is {stats!r:.200}, not a map of names")
        return cls(stats)


Note = ConfigNote | NewBuffersNote | OutboxNote | InboxNote | ReleaseNote | StatsNote

_KINDS: dict[str, type[Note]] = {
    kind.KIND: kind for kind in (ConfigNote, NewBuffersNote, OutboxNote, InboxNote, ReleaseNote, StatsNote)
}


def note_from_wire(raw: Any) -> Note:
    """Whichever note a map read from msgpack is, checked; IpcError if it is none."""
    kind = raw.get("k") if type(raw) is dict else None
    decode = _KINDS.get(kind) if type(kind) is str else None
    if decode is None:
        raise IpcError(f"a note of no known kind: {kind!r:.200}")
    return decode.from_wire(raw)
