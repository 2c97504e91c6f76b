"""Configuration values shared by the commands: parsing of sizes, durations, lists and addresses
with messages that name the offending value, and the authentication every daemon requires beyond
loopback. Reads no files or environment. Must stay cheap to import (no torch)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

EX_CONFIG = 78  # sysexits EX_CONFIG: systemd's RestartPreventExitStatus keys on it

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and the value."""


def parse_size(text: str, *, key: str = "size") -> int:
    """'256MiB', '1GiB', '4096', '1.5GB' -> bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"{key}: cannot read {text!r} as a size (examples: 4096, 64KiB, 256MiB, 1GiB)")
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{key}: {text!r} must be positive")
    return value


def format_size(size: int) -> str:
    """Bytes as parse_size reads them back, in the largest binary unit that divides them: '1MiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str, *, key: str = "duration") -> float:
    """'20s', '50ms', '2m', '1.5' (seconds) -> seconds (positive)."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _DURATION_UNITS:
        raise ConfigError(f"{key}: cannot read {text!r} as a duration (examples: 50ms, 20s, 2m)")
    value = float(match.group(1)) * _DURATION_UNITS[unit]
    if value <= 0:
        raise ConfigError(f"{key}: {text!r} must be positive")
    return value


def parse_list(text: str, *, key: str, choices: tuple[str, ...] | None = None) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"{key}: empty list")
    if choices is not None:
        bad = [item for item in items if item not in choices]
        if bad:
            raise ConfigError(f"{key}: {', '.join(bad)} not among {', '.join(choices)}")
    return items


def parse_int_list(text: str, *, key: str, low: int, high: int) -> list[int]:
    values = []
    for item in parse_list(text, key=key):
        if not item.isdigit() or not low <= int(item) <= high:
            raise ConfigError(f"{key}: {item!r} is not an integer in {low}..{high}")
        values.append(int(item))
    return values


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        """Only literal loopback addresses and the name localhost: any other name may resolve
        (or be made to resolve) beyond this host, so it counts as remote."""
        if self.host.lower() == "localhost":
            return True
        try:
            ip = ipaddress.ip_address(self.host)
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is loopback too
        return ip.is_loopback


def require_authentication(
    address: Address, *, listening: bool, secret: bool, tls: bool, insecure: bool, tls_flags: bool = True
) -> None:
    """Security by default: a daemon that listens on or dials a non-loopback address must
    authenticate its peers (a shared secret, or mutual TLS) unless told --insecure explicitly.

    Raises ConfigError naming the fix. On loopback nothing is required: every process there
    already runs on this host. `tls_flags` says whether the command offers the --tls-* options.
    """
    if insecure and (secret or tls):
        given = "--secret-file" if secret else "--tls-cert/--tls-key/--tls-ca"
        raise ConfigError(f"{given} and --insecure exclude each other")
    if secret or tls or insecure or address.is_loopback:
        return
    where = f"listening on {address}" if listening else f"connecting to {address}"
    tls_fix = ", or --tls-cert FILE --tls-key FILE --tls-ca FILE for mutual TLS" if tls_flags else ""
    raise ConfigError(
        f"{where} beyond loopback without a shared secret{' or TLS' if tls_flags else ''}: "
        f"pass --secret-file FILE (make one with: openssl rand -hex 32 > FILE){tls_fix}, "
        "or --insecure on a trusted network"
    )


def tls_paths(cert: Path | None, key: Path | None, ca: Path | None) -> tuple[Path, Path, Path] | None:
    """The three mutual-TLS files, or None when none is given; some but not all is an error."""
    if cert is None and key is None and ca is None:
        return None
    if cert is None or key is None or ca is None:
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        missing = ", ".join(flag for flag, path in given.items() if path is None)
        raise ConfigError(f"mutual TLS needs --tls-cert, --tls-key and --tls-ca together: {missing} missing")
    return cert, key, ca


def parse_address(text: str, *, key: str = "address", default_port: int | None = None) -> Address:
    """'HOST:PORT', '[V6]:PORT', or 'HOST' when a default port exists."""
    match = re.match(r"^\[([0-9a-fA-F:.]+)\](?::(\d+))?$", text) or re.match(
        r"^([^:\[\]]+)(?::(\d+))?$", text
    )
    if match is None:
        raise ConfigError(f"{key}: cannot read {text!r} as HOST:PORT")
    host, port_text = match.group(1), match.group(2)
    if port_text is None:
        if default_port is None:
            raise ConfigError(f"{key}: {text!r} needs a port (HOST:PORT)")
        port_text = str(default_port)
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: port {port} outside 0..65535")
    return Address(host, port)
