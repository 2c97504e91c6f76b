"""A learner that is a torchrun job (an "island"): rank 0 alone talks to the syncer; at every step
boundary it shares what arrived with the other ranks through torch.distributed (gloo on CPU, NCCL
on GPU), so that every rank applies the same merged fragments at the same step and keeps the same
counters. Decisions that end a wait or the run are agreed collectively (a minimum over ranks), so
no rank is left alone in a collective.

Control travels as one small msgpack map (encode_control/decode_control) holding exactly what the
followers need: the PLAN and the fragment requests in their own wire encoding, read back by the
same checked decoders as from the network, and each update's fragment, version, heal flag,
incarnation and byte count. Never pickle: a process group's port is a network port too, and
unpickling what arrives there would run whatever a peer on it sent. Fragment bytes travel as
uint8 tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import msgpack
import torch
import torch.distributed as dist

from dilocod.learner.bridge import Adopt, Inbox
from dilocod.wire.errors import RemoteProtocolError
from dilocod.wire.frames import FrameType
from dilocod.wire.limits import DEFAULT_LIMITS
from dilocod.wire.messages import FragmentRequest, Plan, decode_body, encode_body

_CONTROL_KEYS = frozenset({"plan", "updates", "requests", "fatal"})


class IslandControlError(RuntimeError):
    """Rank 0's control cannot be read: ranks of different versions, or bytes not from rank 0."""


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


def encode_control(inbox: Inbox) -> bytes:
    """Rank 0's inbox without the fragment bytes, as msgpack."""
    return msgpack.packb(
        {
            "plan": None if inbox.plan is None else encode_body(inbox.plan),
            "updates": [[u.fragment, u.version, u.heal, u.incarnation, len(u.buffer)] for u in inbox.updates],
            "requests": [encode_body(request) for request in inbox.requests],
            "fatal": inbox.fatal,
        },
        use_bin_type=True,
    )


def decode_control(payload: bytes | bytearray) -> Control:
    """The inverse of encode_control; anything else raises IslandControlError."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise IslandControlError(f"island control is not msgpack: {exc}") from None
    if not isinstance(raw, dict) or set(raw) != _CONTROL_KEYS:
        raise IslandControlError(f"island control must be a map of {sorted(_CONTROL_KEYS)}")
    fatal = raw["fatal"]
    if fatal is not None and not isinstance(fatal, str):
        raise IslandControlError("island control: fatal must be a string or nil")
    plan = None if raw["plan"] is None else _message(raw["plan"], FrameType.PLAN, Plan)
    requests = tuple(
        _message(body, FrameType.FRAGMENT_REQUEST, FragmentRequest)
        for body in _list(raw["requests"], "requests")
    )
    updates = tuple(_update(item) for item in _list(raw["updates"], "updates"))
    return Control(plan, updates, requests, fatal)


M = TypeVar("M", Plan, FragmentRequest)


def _message(body: object, frame_type: FrameType, kind: type[M]) -> M:
    """A message in its wire encoding, through the same checked decoder as from the network."""
    if not isinstance(body, bytes):
        raise IslandControlError(f"island control: {frame_type.name} must be bytes")
    try:
        message = decode_body(frame_type, body, DEFAULT_LIMITS)
    except RemoteProtocolError as exc:
        raise IslandControlError(f"island control: {exc.message}") from None
    if not isinstance(message, kind):  # decode_body gives the frame type's class; for the checker
        raise IslandControlError(f"island control: {frame_type.name} decoded as {type(message).__name__}")
    return message


def _list(value: object, what: str) -> list[object]:
    if not isinstance(value, list):
        raise IslandControlError(f"island control: {what} must be an array")
    return value


def _update(item: object) -> UpdateNote:
    # type() rather than isinstance: True is an int, and an int field must not take it.
    kinds = (int, int, bool, str, int)
    if (
        not isinstance(item, list)
        or len(item) != len(kinds)
        or any(type(value) is not kind for value, kind in zip(item, kinds, strict=True))
        or min(item[0], item[1], item[4]) < 0
    ):
        raise IslandControlError(f"island control: bad update {item!r:.200}")
    return UpdateNote(*item)


@dataclass(frozen=True, slots=True)
class IslandConfig:
    rank: int
    world_size: int
    local_rank: int


class Island:
    def __init__(self, config: IslandConfig, device: torch.device) -> None:
        self.rank = config.rank
        self.world_size = config.world_size
        # NCCL moves CUDA tensors only; gloo moves CPU tensors.
        self.device = device if device.type == "cuda" else torch.device("cpu")

    @classmethod
    def start(cls, config: IslandConfig, device: torch.device) -> Island:
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        return cls(config, device)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def agree(self, local: bool) -> bool:
        """True only if every rank says True."""
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def total(self, value: int) -> int:
        """The sum over ranks (the island's tokens in one step)."""
        total = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return int(total.item())

    def _broadcast_bytes(self, payload: bytearray) -> bytearray:
        """Rank 0's bytes on every rank. (torch's broadcast_object_list would pickle.)"""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0)
        if not self.leader:
            payload = bytearray(int(size.item()))
        if payload:
            data = torch.frombuffer(payload, dtype=torch.uint8)
            if self.device.type == "cpu":
                dist.broadcast(data, src=0)
            else:
                moved = data.to(self.device)
                dist.broadcast(moved, src=0)
                data.copy_(moved.cpu())
        return payload

    def share(self, inbox: Inbox) -> Inbox:
        """Rank 0's inbox on every rank, fragment bytes included."""
        control = decode_control(
            self._broadcast_bytes(bytearray(encode_control(inbox)) if self.leader else bytearray())
        )
        shared = Inbox(control.plan, [], list(control.requests), control.fatal)
        for index, note in enumerate(control.updates):
            buffer = inbox.updates[index].buffer if self.leader else bytearray(note.nbytes)
            if note.nbytes:
                host = torch.frombuffer(buffer, dtype=torch.uint8)
                if self.device.type == "cpu":
                    dist.broadcast(host, src=0)  # in place, straight into the followers' buffers
                else:
                    moved = host.to(self.device)
                    dist.broadcast(moved, src=0)
                    if not self.leader:
                        host.copy_(moved.cpu())
            shared.updates.append(Adopt(note.fragment, note.version, buffer, note.heal, note.incarnation))
        return shared
