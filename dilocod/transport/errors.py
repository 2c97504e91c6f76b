"""Errors a transport user sees; each says what to do (retry, fix credentials, give up)."""

from __future__ import annotations

from dilocod.wire.errors import ErrorCode
from dilocod.wire.stream import DAMAGED_CHUNK_CODES


class SessionClosed(ConnectionError):
    """The session's control connection is gone; reconnect to go on. `code` is the error code the
    peer closed it with (ERROR frame), None for a goodbye or a lost connection; `detail` what the
    peer said (its ERROR's message or GOODBYE's reason), None when it said nothing."""

    def __init__(self, message: str, code: int | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail


class HandshakeFailed(ConnectionError):
    """The peer refused us or we refused it before the session opened (wrong secret, version)."""

    def __init__(self, code: ErrorCode | None, message: str) -> None:
        super().__init__(f"{code.name if code else 'CLOSED'}: {message}")
        self.code = code
        self.message = message


#: Codes a receiver resets a transfer with when its bytes arrived damaged (a chunk's, or the end
#: digest): the same bytes sent again may well arrive whole.
DAMAGED_IN_TRANSIT = DAMAGED_CHUNK_CODES | {ErrorCode.DIGEST_MISMATCH}


class TransferFailed(ConnectionError):
    """One fragment transfer failed as a whole; nothing partial was delivered. Safe to retry."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @property
    def damaged(self) -> bool:
        """The receiver found the bytes damaged on the way (DAMAGED_IN_TRANSIT), not refused them."""
        return self.code in DAMAGED_IN_TRANSIT
