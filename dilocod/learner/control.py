"""The control part of an inbox (what the network posted for the training loop) as one small
msgpack map, for the two places it crosses a process boundary: rank 0 of a torchrun island sharing
it with the other ranks, and the learner's network process handing it to the training process.

It holds exactly what the receiving side needs: the PLAN in its own wire encoding, read back by the
same checked decoder as from the network; each fragment request as its three integers (fragment,
round, version); each update's fragment, version, heal flag, incarnation and byte count (the bytes
travel separately). Requests and updates are plain arrays because the network process's inbox is
read at every step boundary, on the training thread, where a wire body's decoder costs tens of
microseconds; every value is still checked. Never pickle: what arrives on a socket or a process
group's port could come from anyone who reached it. Must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from dilocod.learner.bridge import Inbox, LostPush
from dilocod.wire.errors import RemoteProtocolError
from dilocod.wire.frames import FrameType
from dilocod.wire.limits import DEFAULT_LIMITS
from dilocod.wire.messages import FragmentRequest, Plan, decode_body, encode_body

_CONTROL_KEYS = frozenset({"plan", "updates", "requests", "fatal", "lost"})


class ControlError(RuntimeError):
    """The control cannot be read: the two sides run different versions, or the bytes are not
    from the other side."""


@dataclass(frozen=True, slots=True)
class UpdateNote:
    """What a follower needs to receive one update's bytes and adopt them like rank 0."""

    fragment: int
    version: int
    heal: bool
    incarnation: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Control:
    plan: Plan | None
    updates: tuple[UpdateNote, ...]
    requests: tuple[FragmentRequest, ...]
    fatal: str | None
    lost: tuple[LostPush, ...] = ()

    @classmethod
    def of(cls, inbox: Inbox) -> Control:
        """Rank 0's inbox without the fragment bytes (each update's byte count instead)."""
        updates = tuple(
            [UpdateNote(u.fragment, u.version, u.heal, u.incarnation, len(u.buffer)) for u in inbox.updates]
        )
        return cls(inbox.plan, updates, tuple(inbox.requests), inbox.fatal, tuple(inbox.lost))

    def to_raw(self) -> dict[str, object]:
        """As plain values for msgpack (control_from_raw reads them back)."""
        return {
            "plan": None if self.plan is None else encode_body(self.plan),
            "updates": [[u.fragment, u.version, u.heal, u.incarnation, u.nbytes] for u in self.updates],
            "requests": [[r.fragment, r.round, r.version] for r in self.requests],
            "fatal": self.fatal,
            "lost": [[lost.fragment, lost.round] for lost in self.lost],
        }


def encode_control(inbox: Inbox) -> bytes:
    """Control.of(inbox) as msgpack."""
    return msgpack.packb(Control.of(inbox).to_raw(), use_bin_type=True)


def decode_control(payload: bytes | bytearray) -> Control:
    """The inverse of encode_control; anything else raises ControlError."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ControlError(f"inbox control is not msgpack: {exc}") from None
    return control_from_raw(raw)


def control_from_raw(raw: object) -> Control:
    """The inverse of Control.to_raw, for a map already read from msgpack; anything else raises
    ControlError."""
    if not isinstance(raw, dict) or set(raw) != _CONTROL_KEYS:
        raise ControlError(f"inbox control must be a map of {sorted(_CONTROL_KEYS)}")
    fatal = raw["fatal"]
    if fatal is not None and not isinstance(fatal, str):
        raise ControlError("inbox control: fatal must be a string or nil")
    plan = None if raw["plan"] is None else _plan(raw["plan"])
    requests = tuple([_request(item) for item in _list(raw["requests"], "requests")])
    updates = tuple([_update(item) for item in _list(raw["updates"], "updates")])
    lost = tuple([_lost(item) for item in _list(raw["lost"], "lost")])
    return Control(plan, updates, requests, fatal, lost)


def _plan(body: object) -> Plan:
    """The PLAN in its wire encoding, through the same checked decoder as from the network."""
    if not isinstance(body, bytes):
        raise ControlError("inbox control: PLAN must be bytes")
    try:
        message = decode_body(FrameType.PLAN, body, DEFAULT_LIMITS)
    except RemoteProtocolError as exc:
        raise ControlError(f"inbox control: {exc.message}") from None
    if not isinstance(message, Plan):  # decode_body gives the frame type's class; for the checker
        raise ControlError(f"inbox control: PLAN decoded as {type(message).__name__}")
    return message


def _list(value: object, what: str) -> list[object]:
    if not isinstance(value, list):
        raise ControlError(f"inbox control: {what} must be an array")
    return value


# Both checks below run at every step boundary of a learner with a network process, on the training
# thread, right after the user's step has left the caches cold: plain comparisons, no generators.
# type() rather than isinstance: True is an int, and an int field must not take it.


def _request(item: object) -> FragmentRequest:
    if type(item) is not list or len(item) != 3:
        raise ControlError(f"inbox control: bad request {item!r:.200}")
    fragment, round_, version = item
    if (
        type(fragment) is not int
        or type(round_) is not int
        or type(version) is not int
        or not 0 <= fragment < 2**32  # the wire's FRAGMENT_REQUEST bound
        or round_ < 0
        or version < 0
    ):
        raise ControlError(f"inbox control: bad request {item!r:.200}")
    return FragmentRequest(fragment, round_, version)


def _lost(item: object) -> LostPush:
    if (
        type(item) is not list
        or len(item) != 2
        or type(item[0]) is not int
        or type(item[1]) is not int
        or item[0] < 0
        or item[1] < 0
    ):
        raise ControlError(f"inbox control: bad lost push {item!r:.200}")
    return LostPush(item[0], item[1])


def _update(item: object) -> UpdateNote:
    if type(item) is not list or len(item) != 5:
        raise ControlError(f"inbox control: bad update {item!r:.200}")
    fragment, version, heal, incarnation, nbytes = item
    if (
        type(fragment) is not int
        or type(version) is not int
        or type(heal) is not bool
        or type(incarnation) is not str
        or type(nbytes) is not int
        or fragment < 0
        or version < 0
        or nbytes < 0
    ):
        raise ControlError(f"inbox control: bad update {item!r:.200}")
    return UpdateNote(fragment, version, heal, incarnation, nbytes)
