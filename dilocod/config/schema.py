"""How a daemon's configuration is declared and read. Each key is declared once, as a field of the
daemon's frozen dataclass made by `setting`: its name and type are the field's, its default the
field's default, and the field's metadata holds how a TOML value or a flag's text is read and what
--help says. From that one declaration come the defaults, the keys a TOML file may hold
(load_config), and the daemon's click options with their defaults shown (cli.py).

Reads the one TOML file it is given; never argv or the environment. Must stay cheap to import.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dilocod.config.values import Address, ConfigError, parse_address, parse_size
from dilocod.wire.choices import AUTO
from dilocod.wire.messages import QUORUM_ALL

#: Reads one value (from TOML, or a flag's text) under a key named in its errors.
Parse = Callable[[object, str], Any]
C = TypeVar("C")
_SETTING = "dilocod.setting"


@dataclass(frozen=True, slots=True)
class Setting:
    """What a configuration key is beyond its name, type and default (the dataclass field's)."""

    parse: Parse
    #: One or more sentences for --help, without the default (help_text appends it).
    help: str
    #: --help's words for the default, where the value alone says too little ("3 days", what None
    #: means): a text, or a function of the default. None: the default as written (default_text).
    shown: str | Callable[[Any], str] | None = None
    #: No default: the command refuses to start without it (from a flag or the TOML file).
    required: bool = False


def setting(
    default: Any,
    parse: Parse,
    help: str,
    *,
    shown: str | Callable[[Any], str] | None = None,
    required: bool = False,
) -> Any:
    """A field of a daemon's configuration dataclass: its default, how it is read, its --help."""
    return dataclasses.field(default=default, metadata={_SETTING: Setting(parse, help, shown, required)})


def settings(cls: type) -> dict[str, Setting]:
    """The settings of a daemon's configuration dataclass, by field name, in declaration order
    (the order of --help and of the known keys an error lists)."""
    return {f.name: f.metadata[_SETTING] for f in dataclasses.fields(cls) if _SETTING in f.metadata}


def defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls) if _SETTING in f.metadata}


def flag_of(name: str) -> str:
    """A field's flag: `sync_every` is --sync-every (and `sync-every` in the TOML file)."""
    return "--" + name.replace("_", "-")


def default_text(cls: type, name: str) -> str:
    """How --help shows a field's default: '[default: 1MiB]', or '[required]'."""
    spec, default = settings(cls)[name], defaults(cls)[name]
    if spec.required:
        return "[required]"
    if callable(spec.shown):
        return f"[default: {spec.shown(default)}]"
    if spec.shown is not None:
        return f"[default: {spec.shown}]"
    if isinstance(default, bool):
        return f"[default: {'on' if default else 'off'}]"
    if isinstance(default, float):
        return f"[default: {default:g}]"
    return f"[default: {'none' if default is None else default}]"


def help_text(cls: type, name: str) -> str:
    return f"{settings(cls)[name].help}  {default_text(cls, name)}"


def load_config(cls: type[C], path: Path | None, flags: dict[str, object]) -> C:
    """Defaults < the TOML file at path < flags (None: not given). TOML keys are the flag names
    without their dashes (`sync-every = 24`; `sync_every` also works). Every value is checked; an
    unknown key or a bad value raises ConfigError naming the key (and the file)."""
    fields = settings(cls)
    values: dict[str, object] = {}
    if path is not None:
        try:
            document = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"--config: cannot read {path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--config: {path} is not valid TOML: {exc}") from None
        for raw_key, value in document.items():
            key = raw_key.replace("-", "_")
            if key not in fields:
                known = ", ".join(k.replace("_", "-") for k in fields)
                raise ConfigError(f"{path}: unknown key {raw_key!r} (known keys: {known})")
            values[key] = fields[key].parse(value, f"{raw_key} (in {path})")
    for key, value in flags.items():
        if key not in fields:
            raise ConfigError(f"{flag_of(key)}: not a setting of this command")
        if value is not None:
            values[key] = fields[key].parse(value, flag_of(key))
    config = cls(**values)
    check = getattr(config, "check", None)
    if check is not None:
        check()
    return config


def missing(config: object) -> list[str]:
    """The required settings a loaded configuration still lacks."""
    return [
        name
        for name, spec in settings(type(config)).items()
        if spec.required and getattr(config, name) is None
    ]


# ---------------------------------------------------------------- value parsers


def integer(low: int, high: int | None = None) -> Parse:
    def parse(value: object, key: str) -> int:
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if type(value) is not int or value < low or (high is not None and value > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            raise ConfigError(f"{key}: {value!r} is not an integer {bound}")
        return value

    return parse


def number(low: float, high: float | None = None, *, low_open: bool = False) -> Parse:
    def parse(value: object, key: str) -> float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: {value!r} is not a number") from None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{key}: {value!r} is not a finite number")
        if value < low or (low_open and value == low) or (high is not None and value > high):
            bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
            raise ConfigError(f"{key}: {value!r} must be {bound}")
        return float(value)

    return parse


def quorum_or_all(value: object, key: str) -> int:
    """K: a count of learners, or "all" (lock-step: every live learner), kept as QUORUM_ALL."""
    if value == "all":
        return QUORUM_ALL
    try:
        return int(integer(1, 65_536)(value, key))
    except ConfigError:
        raise ConfigError(f"{key}: {value!r} is neither all nor an integer 1..65536") from None


def text(choices: tuple[str, ...] | None = None) -> Parse:
    def parse(value: object, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: {value!r} is not a non-empty string")
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")
        return value

    return parse


def flag(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not true or false")
    return value


def path(value: object, key: str) -> Path:
    if not isinstance(value, str | Path) or not str(value):
        raise ConfigError(f"{key}: {value!r} is not a path")
    return Path(value).expanduser()


def address(default_port: int) -> Parse:
    def parse(value: object, key: str) -> Address:
        if isinstance(value, Address):
            return value
        if not isinstance(value, str):
            raise ConfigError(f"{key}: {value!r} is not HOST:PORT")
        return parse_address(value, key=key, default_port=default_port)

    return parse


def size(value: object, key: str) -> int:
    if type(value) is int and value > 0:
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{key}: {value!r} is not a size")
    return parse_size(value, key=key)


def auto_or(parse: Parse) -> Parse:
    """AUTO ("auto"), or a value parse reads."""

    def parsed(value: object, key: str) -> object:
        return AUTO if value == AUTO else parse(value, key)

    return parsed


def learner_id(value: object, key: str) -> str:
    name = text()(value, key)
    if len(name.encode()) > 128 or not name.isprintable():
        raise ConfigError(f"{key}: {name!r} must be printable and at most 128 bytes")
    return name
