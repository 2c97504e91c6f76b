"""Configuration values shared by the commands: parsing of sizes, rates and addresses with
messages that name the offending value. Only cli.py and this module read argv, files or the
environment. Must stay cheap to import (no torch)."""

from __future__ import annotations

import hashlib
import ipaddress
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from dilocod.wire.messages import QUORUM_ALL

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


# ---------------------------------------------------------------- daemon configuration files

Parse = Callable[[object, str], object]
C = TypeVar("C")


def _integer(low: int, high: int | None = None) -> Parse:
    def parse(value: object, key: str) -> int:
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if type(value) is not int or value < low or (high is not None and value > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            raise ConfigError(f"{key}: {value!r} is not an integer {bound}")
        return value

    return parse


def _number(low: float, high: float | None = None, *, low_open: bool = False) -> Parse:
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


def _quorum(value: object, key: str) -> int:
    """K: a count of learners, or "all" (lock-step: every live learner), kept as QUORUM_ALL."""
    if value == "all":
        return QUORUM_ALL
    try:
        return int(_integer(1, 65_536)(value, key))  # type: ignore[call-overload]
    except ConfigError:
        raise ConfigError(f"{key}: {value!r} is neither all nor an integer 1..65536") from None


def _text(choices: tuple[str, ...] | None = None) -> Parse:
    def parse(value: object, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: {value!r} is not a non-empty string")
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")
        return value

    return parse


def _flag(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not true or false")
    return value


def _path(value: object, key: str) -> Path:
    if not isinstance(value, str | Path) or not str(value):
        raise ConfigError(f"{key}: {value!r} is not a path")
    return Path(value).expanduser()


def _address(default_port: int) -> Parse:
    def parse(value: object, key: str) -> Address:
        if isinstance(value, Address):
            return value
        if not isinstance(value, str):
            raise ConfigError(f"{key}: {value!r} is not HOST:PORT")
        return parse_address(value, key=key, default_port=default_port)

    return parse


def _size(value: object, key: str) -> int:
    if type(value) is int and value > 0:
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{key}: {value!r} is not a size")
    return parse_size(value, key=key)


DEFAULT_PORT = 7070
#: The embedded default model of both daemons: a byte-level GPT on the Python standard library.
DEFAULT_ENTRY = "dilocod.examples.charlm:make_trainer"
MERGES = ("rda", "mean")
WIRE_CODECS = ("none", "lz4", "zstd")
#: Wire precisions of updates (dilocod.precision): the syncer rounds what it sends, never its master.
UPDATE_PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True, slots=True)
class SyncerConfig:
    """`dilocod syncer`: defaults here, then a TOML file, then flags (docs/design.md §3.6 defaults)."""

    listen: Address = Address("0.0.0.0", DEFAULT_PORT)
    entry: str = DEFAULT_ENTRY
    state_dir: Path | None = None
    fragments: int = 24
    sync_every: int = 24
    overlap: int = 2
    #: K; QUORUM_ALL (--quorum all) is lock-step: every live learner, at every round's due step.
    quorum: int = 1
    grace_factor: float = 0.5
    merge: str = "rda"
    embedding_pattern: str = "*embed*"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    secret_file: Path | None = None
    insecure: bool = False
    #: Mutual TLS: this daemon's certificate chain and key, and the CA that signs its peers.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    metrics: Address | None = None
    checkpoint_every_s: float = 300.0
    #: Learners gone longer than this are dropped from the roster, the status and the checkpoint.
    roster_retention_s: float = 3 * 86_400.0
    #: A late push may still be merged this many versions after its base.
    staleness: int = 1
    #: Outer gradients with a norm above this multiple of the running median are rejected.
    max_norm_ratio: float = 10.0
    #: Outer gradients with a norm above this multiple of their fragment's (at least 1 per value,
    #: RMS) are rejected from the first push on. The value of outer.guard.DEFAULT_MAX_FRAGMENT_RATIO
    #: (this module stays torch-free; tests/unit/test_config_daemons.py holds them equal).
    max_fragment_ratio: float = 10.0
    #: How updates travel: chunk size and codec (learners choose their own for pushes).
    chunk: int = 1 << 20
    codec: str = "none"
    #: Wire precision of updates: fp32, or bf16 (half the bytes; the master stays float32).
    update_precision: str = "fp32"
    seed: int = 0

    @property
    def lockstep(self) -> bool:
        return self.quorum == QUORUM_ALL

    def check(self) -> None:
        """What no single key can say: in lock-step a fragment's merge must be applied (tau steps
        after its push) no later than its next push, H steps after the last."""
        if self.lockstep and self.overlap > self.sync_every:
            raise ConfigError(
                f"--overlap: {self.overlap} is above --sync-every ({self.sync_every}); with --quorum all a "
                "fragment's merge is applied tau steps after its push and must be back before its next one"
            )


SYNCER_FIELDS: dict[str, Parse] = {
    "listen": _address(DEFAULT_PORT),
    "entry": _text(),
    "state_dir": _path,
    "fragments": _integer(1, 65_536),
    "sync_every": _integer(1, 1_000_000),
    "overlap": _integer(0, 1_000_000),
    "quorum": _quorum,
    "grace_factor": _number(0.0, 100.0),
    "merge": _text(MERGES),
    "embedding_pattern": _text(),
    "outer_lr": _number(0.0, 100.0, low_open=True),
    "outer_momentum": _number(0.0, 1.0),
    "secret_file": _path,
    "insecure": _flag,
    "tls_cert": _path,
    "tls_key": _path,
    "tls_ca": _path,
    "metrics": _address(9464),
    "checkpoint_every_s": _number(0.0, low_open=True),
    "roster_retention_s": _number(0.0, low_open=True),
    "staleness": _integer(0, 1_000),
    "max_norm_ratio": _number(1.0),
    "max_fragment_ratio": _number(0.0, low_open=True),
    "chunk": _size,
    "codec": _text(WIRE_CODECS),
    "update_precision": _text(UPDATE_PRECISIONS),
    "seed": _integer(0, 2**63 - 1),
}


def load_config(cls: type[C], fields: dict[str, Parse], path: Path | None, flags: dict[str, object]) -> C:
    """Defaults < the TOML file at path < flags. TOML keys are the flag names without their dashes
    (`sync-every = 24`; `sync_every` also works). Every value is checked; an unknown key or a bad
    value raises ConfigError naming the key (and the file)."""
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
            values[key] = fields[key](value, f"{raw_key} (in {path})")
    for key, value in flags.items():
        if value is not None:
            values[key] = fields[key](value, f"--{key.replace('_', '-')}")
    config = cls(**values)
    check = getattr(config, "check", None)
    if check is not None:
        check()
    return config


APPLY_MODES = ("overwrite", "mix", "keep-local")
PRECISIONS = ("fp32", "bf16", "int8", "int4")


def _auto_or(parse: Parse) -> Parse:
    def parsed(value: object, key: str) -> object:
        return "auto" if value == "auto" else parse(value, key)

    return parsed


def _learner_id(value: object, key: str) -> str:
    text = _text()(value, key)
    if len(text.encode()) > 128 or not text.isprintable():
        raise ConfigError(f"{key}: {text!r} must be printable and at most 128 bytes")
    return text


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    """`dilocod learner`: defaults here, then a TOML file, then flags."""

    syncer: Address | None = None
    entry: str = DEFAULT_ENTRY
    id: str | None = None
    state_dir: Path | None = None
    #: "auto" picks cuda when this host has it, else cpu.
    device: str = "auto"
    steps: int | None = None
    #: Data connections to the syncer; "auto": what `dilocod bench run` saved for this syncer,
    #: else enough for 5 Gbit/s at the RTT measured on connecting (dilocod.learner.link).
    streams: int | str = "auto"
    #: Codec of pushes; "auto": what `dilocod bench run` saved for this syncer, else tuned on the
    #: learner's own outer gradients and push throughput (dilocod.tuning.tuner.CodecTuner).
    codec: str = "auto"
    precision: str = "fp32"
    apply: str = "overwrite"
    mix_alpha: float = 0.5
    #: On a GPU, where the anchors live: "host" or "device" (learner.runtime.RuntimeConfig.anchors).
    anchors: str = "host"
    secret_file: Path | None = None
    insecure: bool = False
    #: Mutual TLS: this learner's certificate chain and key, and the CA that signs the syncer's.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    chunk: int = 1 << 20
    save_every_s: float = 300.0
    join_timeout_s: float = 60.0
    progress_every_s: float = 5.0
    #: None: learner_seed(id), so that every learner reads different data (an explicit seed wins).
    seed: int | None = None
    #: Where the link to the syncer runs: "process" (a child process, so its CPU time and the GIL
    #: stay off the training thread) or "thread" (in this process, on its own event-loop thread).
    network: str = "process"


LEARNER_FIELDS: dict[str, Parse] = {
    "syncer": _address(DEFAULT_PORT),
    "entry": _text(),
    "id": _learner_id,
    "state_dir": _path,
    "device": _text(),
    "steps": _integer(1),
    "streams": _auto_or(_integer(0, 64)),
    "codec": _text(("auto", *WIRE_CODECS)),
    "precision": _text(PRECISIONS),
    "apply": _text(APPLY_MODES),
    "mix_alpha": _number(0.0, 1.0),
    "anchors": _text(("host", "device")),
    "secret_file": _path,
    "insecure": _flag,
    "tls_cert": _path,
    "tls_key": _path,
    "tls_ca": _path,
    "chunk": _size,
    "save_every_s": _number(0.0, low_open=True),
    "join_timeout_s": _number(0.0, low_open=True),
    "progress_every_s": _number(0.0, low_open=True),
    "seed": _integer(0, 2**63 - 1),
    "network": _text(("process", "thread")),
}


def learner_seed(learner_id: str) -> int:
    """The default seed of a learner: the first 31 bits of SHA-256 of its id. Different ids read
    different data, a restart of one id reads the same (unlike hash(), which is salted per
    process), and 31 bits fit every RNG's seed (numpy's legacy seed takes < 2**32)."""
    digest = hashlib.sha256(learner_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1
