"""Pre-shared-key authentication: HMAC-SHA256 over both nonces and the hello's identity.

Both sides prove knowledge of the key: the client answers the server's fresh nonce (no replay of an
old response), the server answers the client's (no impostor syncer). Pure: hmac and hashlib only.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from dilocod.wire.messages import Hello

CLIENT_LABEL = b"dilocod/1 client proof"
SERVER_LABEL = b"dilocod/1 server proof"
MIN_SECRET_BYTES = 16


def _field(value: bytes) -> bytes:
    return struct.pack(">H", len(value)) + value


def transcript(hello: Hello, version: int, server_nonce: bytes) -> bytes:
    """The bytes both proofs cover (protocol/SPEC.md §6): every field that names the connection."""
    return b"".join(
        (
            struct.pack(">B", version),
            _field(hello.kind.encode()),
            _field(hello.role.encode()),
            _field(hello.peer_id.encode()),
            _field(hello.session),
            _field(hello.nonce),
            _field(server_nonce),
        )
    )


def client_proof(secret: bytes, hello: Hello, version: int, server_nonce: bytes) -> bytes:
    return hmac.new(secret, CLIENT_LABEL + transcript(hello, version, server_nonce), hashlib.sha256).digest()


def server_proof(secret: bytes, hello: Hello, version: int, server_nonce: bytes, session: bytes) -> bytes:
    body = SERVER_LABEL + transcript(hello, version, server_nonce) + _field(session)
    return hmac.new(secret, body, hashlib.sha256).digest()


def verify(expected: bytes, presented: bytes) -> bool:
    return hmac.compare_digest(expected, presented)
