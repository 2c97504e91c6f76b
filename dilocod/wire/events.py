"""Events the Connection core hands to its user: frozen dataclasses named as past facts.

Must not import asyncio, socket, torch or logging.
"""

from __future__ import annotations

from dataclasses import dataclass

from dilocod.wire.frames import ChunkHeader
from dilocod.wire.messages import Message


@dataclass(frozen=True, slots=True)
class HandshakeCompleted:
    """Both sides are authenticated and agree on a version; frames may flow."""

    version: int
    kind: str  # "control" or "data"
    role: str  # the client's role ("learner", "status", "bench", ...)
    peer_id: str  # the client's id; on the client, the server's id
    session: bytes
    incarnation: str  # the server's incarnation (a restarted server has a new one)
    capabilities: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MessageReceived:
    message: Message
    stream_id: int = 0


@dataclass(frozen=True, slots=True)
class ChunkReceived:
    """A chunk's bytes are in payload (a view the receiver's sink lent, or a fresh buffer).

    Not yet verified: the checksum is checked when the chunk is decoded. in_place is true when
    the payload already sits in the destination slice the chunk sink lent.
    """

    transfer_id: int
    chunk: ChunkHeader
    payload: memoryview
    in_place: bool = False


@dataclass(frozen=True, slots=True)
class PeerWentAway:
    """The peer said GOODBYE, sent an ERROR, or closed cleanly between frames."""

    reason: str
    error_code: int | None = None


Event = HandshakeCompleted | MessageReceived | ChunkReceived | PeerWentAway
