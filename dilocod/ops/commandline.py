"""What every `dilocod` command shares on its command line: the configuration error (a message,
then exit 78), values parsed with that error, the shared secret and mutual TLS read from the flags
(required beyond loopback unless --insecure), and the options that name them. Used by dilocod.cli
(the daemons' commands) and dilocod.linkbench.commands (`dilocod bench`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from dilocod.config import EX_CONFIG, Address, ConfigError, require_authentication

if TYPE_CHECKING:
    import ssl


def config_error(message: str) -> NoReturn:
    click.echo(f"dilocod: configuration error: {message}", err=True)
    sys.exit(EX_CONFIG)


def parsed(parse: Callable[[], Any]) -> Any:
    try:
        return parse()
    except ConfigError as exc:
        config_error(str(exc))


def credentials(
    secret_file: Path | None,
    insecure: bool,
    address: Address,
    *,
    listening: bool,
    tls: tuple[Path, Path, Path] | None = None,
    tls_flags: bool = True,
) -> tuple[bytes | None, ssl.SSLContext | None]:
    """The shared secret and the mutual-TLS context this command authenticates with. Beyond
    loopback one of them is required unless --insecure is given (exit 78 naming the fix)."""
    from dilocod.transport.credentials import (  # noqa: PLC0415
        CredentialError,
        TlsFiles,
        client_context,
        load_secret,
        server_context,
    )

    parsed(
        lambda: require_authentication(
            address,
            listening=listening,
            secret=secret_file is not None,
            tls=tls is not None,
            insecure=insecure,
            tls_flags=tls_flags,
        )
    )
    try:
        secret = load_secret(secret_file) if secret_file is not None else None
        context = None
        if tls is not None:
            files = TlsFiles(*tls)
            context = server_context(files) if listening else client_context(files)
    except CredentialError as exc:
        config_error(str(exc))
    return secret, context


secret_option = click.option(
    "--secret-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the shared secret (at least 16 bytes) for HMAC authentication.",
)
insecure_option = click.option(
    "--insecure", is_flag=True, help="Run without authentication (loopback and trusted networks only)."
)

TLS_FLAGS = (
    ("cert", "Mutual TLS: this end's certificate chain (PEM)."),
    ("key", "Mutual TLS: the private key of --tls-cert (PEM)."),
    ("ca", "Mutual TLS: the CA (PEM) that signs the peers' certificates."),
)


def tls_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--tls-cert, --tls-key and --tls-ca: mutual TLS 1.3, all three or none."""
    for name, what in reversed(TLS_FLAGS):
        command = click.option(
            f"--tls-{name}", f"tls_{name}", type=click.Path(path_type=Path, dir_okay=False), help=what
        )(command)
    return command
