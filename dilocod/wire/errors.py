"""Error codes of the wire protocol and the two exception kinds that carry them.

A RemoteProtocolError is the peer's fault: the connection sends an ERROR frame and closes, every
other connection goes on. A LocalProtocolError is our own bug (we asked the core to do something the
protocol forbids) and should crash loudly. Must not import asyncio, socket, torch or logging.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Codes carried by ERROR and STREAM_RESET frames (protocol/SPEC.md §9).

    Codes 24 and up are application-level: the syncer (for MODEL_MISMATCH, either end) sends them
    about what the peer asked for (its model, its pushes, the join order, its id); the wire core
    never raises them itself.
    """

    BAD_MAGIC = 1
    UNSUPPORTED_VERSION = 2
    FRAME_TOO_LARGE = 3
    UNKNOWN_FRAME_TYPE = 4
    UNEXPECTED_FRAME = 5
    MALFORMED_BODY = 6
    BAD_RESERVED = 7
    AUTH_REQUIRED = 8
    AUTH_FAILED = 9
    CHECKSUM_MISMATCH = 10
    LENGTH_MISMATCH = 11
    LIMIT_EXCEEDED = 12
    UNSUPPORTED_CODEC = 13
    UNKNOWN_TRANSFER = 14
    DUPLICATE_TRANSFER = 15
    DIGEST_MISMATCH = 16
    BAD_MANIFEST = 17
    TRUNCATED = 18
    TIMEOUT = 19
    UNKNOWN_SESSION = 20
    TRANSFER_ABORTED = 21
    SHUTTING_DOWN = 22
    INTERNAL = 23
    MODEL_MISMATCH = 24  # ERROR: the learner's JOIN model differs from the PLAN's (names the first)
    NOT_REQUESTED = 25  # STREAM_RESET: a push nobody asked for, or a second one for the same round
    STALE_VERSION = 26  # STREAM_RESET: a push's base version is too old, or newer than the syncer's
    NOT_JOINED = 27  # ERROR: STEP_REPORT or PUSH_HEADER before JOIN, or a second JOIN
    LEARNER_ID_IN_USE = 28  # ERROR: another learner's live session holds this id (names it, when to retry)


class ProtocolError(Exception):
    """Base of both protocol error kinds; carries the wire code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol; close that connection with an ERROR frame."""


class LocalProtocolError(ProtocolError):
    """We broke the protocol; a bug in the caller of the core."""
