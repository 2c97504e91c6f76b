"""Credentials: the pre-shared secret file and mutual-TLS contexts.

A secret file holds at least 16 bytes of key material (surrounding whitespace is stripped so a
hex or base64 line from `openssl rand -hex 32` works as is).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from dilocod.wire.auth import MIN_SECRET_BYTES


class CredentialError(ValueError):
    """A secret or certificate that cannot be used; the message names the file and the problem."""


def load_secret(path: str | Path) -> bytes:
    path = Path(path)
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise CredentialError(f"cannot read secret file {path}: {exc.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise CredentialError(
            f"secret file {path} holds {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed "
            "(make one with: openssl rand -hex 32 > FILE)"
        )
    return secret


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for mutual TLS: our certificate chain and key, and the CA that signs the peers."""

    cert: Path
    key: Path
    ca: Path


def server_context(files: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    _load(ctx, files)
    ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: a client without a CA-signed cert is refused
    return ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    _load(ctx, files)
    return ctx


def _load(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    try:
        ctx.load_cert_chain(files.cert, files.key)
        ctx.load_verify_locations(files.ca)
    except (OSError, ssl.SSLError) as exc:
        raise CredentialError(
            f"cannot load the TLS files (cert {files.cert}, key {files.key}, CA {files.ca}): {exc}"
        ) from None
