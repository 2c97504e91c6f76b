"""Configuration values shared by the commands: parsing of sizes, rates and addresses with
messages that name the offending value. Only cli.py and this module read argv, files or the
environment. Must stay cheap to import (no torch)."""

from __future__ import annotations

import re
from dataclasses import dataclass

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
        return self.host in ("localhost", "::1") or self.host.startswith("127.")


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
