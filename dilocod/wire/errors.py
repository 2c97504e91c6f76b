"""Error codes of the wire protocol and the two exception kinds that carry them.

A RemoteProtocolError is the peer's fault: the connection sends an ERROR frame and closes, every
other connection goes on. A LocalProtocolError is our own bug (we asked the core to do something the
protocol forbids) and should crash loudly. Must not import asyncio, socket, torch or logging.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Codes carried by ERROR and STREAM_RESET frames (protocol/SPEC.md §7)."""

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
