"""The advice `dilocod bench` saves for `dilocod learner --streams auto --codec auto`: what one
link was measured to carry and what to use on it (Advice), its JSON form, and the file that holds
one entry per target ($DILOCOD_ADVICE, else $XDG_CONFIG_HOME/dilocod/link-advice.json), written
atomically and read leniently (an unusable file is named in a warning, never a crash).

Must not import torch, asyncio or socket.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from dilocod.tuning.codecs import CodecFigure
from dilocod.wire.choices import CODECS

log = structlog.get_logger("dilocod.tuning")


@dataclass(frozen=True, slots=True)
class Advice:
    """What `dilocod bench` recommends for one link; JSON-serialisable (save_advice)."""

    #: "host:port" of the syncer (or bench server) it was measured against; "" = any.
    target: str
    #: Measured link rate: the raw TCP ceiling.
    rate_gbps: float
    rtt_ms: float
    streams: int
    codec: str
    chunk_bytes: int
    #: ISO 8601 time of the measurement.
    measured_at: str
    figures: tuple[CodecFigure, ...] = ()


ADVICE_SCHEMA = "dilocod-link-advice/1"


def advice_to_json(advice: Advice) -> dict[str, Any]:
    out = asdict(advice)
    # JSON has no infinity: an unbounded codec speed (none) is written as null.
    out["figures"] = [
        {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(f).items()}
        for f in advice.figures
    ]
    return out


class _Invalid(ValueError):
    pass


def _field(entry: Mapping[str, Any], key: str, kind: Any) -> Any:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _Invalid(f"{key} is {value!r}")
    return value


def _speed(value: object, key: str) -> float:
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise _Invalid(f"{key} is {value!r}")
    return float(value)


def advice_from_json(entry: object) -> Advice:
    """Raises ValueError naming the first field that is missing or of the wrong kind."""
    if not isinstance(entry, dict):
        raise _Invalid(f"an entry is {type(entry).__name__}, not an object")
    codec = _field(entry, "codec", str)
    if codec not in CODECS:
        raise _Invalid(f"codec is {codec!r}")
    streams = _field(entry, "streams", int)
    chunk = _field(entry, "chunk_bytes", int)
    if not 0 <= streams <= 64 or chunk <= 0:
        raise _Invalid(f"streams {streams} or chunk_bytes {chunk} out of range")
    figures = []
    listed = entry.get("figures", [])
    if not isinstance(listed, list):
        raise _Invalid(f"figures is {listed!r}")
    for figure in listed:
        if not isinstance(figure, dict) or figure.get("codec") not in CODECS:
            raise _Invalid(f"a codec figure is {figure!r}")
        ratio = _speed(figure.get("ratio"), "ratio")
        compress = _speed(figure.get("compress_gbps"), "compress_gbps")
        decompress = _speed(figure.get("decompress_gbps"), "decompress_gbps")
        figures.append(CodecFigure(figure["codec"], ratio, compress, decompress))
    rate, rtt = float(_field(entry, "rate_gbps", int | float)), float(_field(entry, "rtt_ms", int | float))
    if not (math.isfinite(rate) and math.isfinite(rtt) and rate >= 0 and rtt >= 0):
        raise _Invalid(f"rate_gbps {rate} or rtt_ms {rtt} out of range")
    return Advice(
        target=_field(entry, "target", str),
        rate_gbps=rate,
        rtt_ms=rtt,
        streams=streams,
        codec=codec,
        chunk_bytes=chunk,
        measured_at=_field(entry, "measured_at", str),
        figures=tuple(figures),
    )


def advice_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where `dilocod bench` saves link advice and the learner looks for it: $DILOCOD_ADVICE when
    set, else $XDG_CONFIG_HOME/dilocod/link-advice.json, with XDG_CONFIG_HOME defaulting to
    ~/.config (the XDG base directory rule). Under systemd, set DILOCOD_ADVICE in the unit (or
    give the service user a home): a service has no ~/.config of a person's."""
    env = os.environ if environ is None else environ
    explicit = env.get("DILOCOD_ADVICE")
    if explicit:
        return Path(explicit).expanduser()
    config_home = env.get("XDG_CONFIG_HOME")
    base = Path(config_home) if config_home and Path(config_home).is_absolute() else Path.home() / ".config"
    return base / "dilocod" / "link-advice.json"


def _read_links(path: Path) -> dict[str, Any]:
    """The file's entries keyed by target; raises ValueError saying what is wrong with it."""
    try:
        document = json.loads(path.read_text())
    except UnicodeDecodeError as exc:
        raise ValueError(f"not text: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(document, dict) or document.get("schema") != ADVICE_SCHEMA:
        found = document.get("schema") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"schema is {found!r}, not {ADVICE_SCHEMA!r}")
    links = document.get("links")
    if not isinstance(links, dict):
        raise ValueError("no 'links' object")
    return links


def save_advice(advice: Advice, path: Path | None = None) -> Path:
    """Write `advice` into the advice file (advice_path() unless given), keeping the entries of
    other targets: one file, a dict keyed by target. Atomic: a temporary file in the same
    directory, fsync, rename, fsync of the directory, so a reader sees the old file or the new
    one, never half of one. A corrupt file is replaced (with a warning). Returns the path."""
    path = path or advice_path()
    links: dict[str, Any] = {}
    try:
        links = _read_links(path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        log.warning("replacing an unusable link advice file", path=str(path), problem=str(exc))
    links[advice.target] = advice_to_json(advice)
    text = json.dumps({"schema": ADVICE_SCHEMA, "links": links}, indent=2, sort_keys=True) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path


def load_advice(target: str, path: Path | None = None) -> Advice | None:
    """The advice saved for `target` ("host:port" exactly as saved), else the one saved for any
    target (""), else None. A file that cannot be read, is not JSON, has another schema or holds
    a malformed entry logs a warning saying so and gives None: the learner then tunes itself."""
    path = path or advice_path()
    try:
        links = _read_links(path)
        entry = links.get(target, links.get(""))
        return None if entry is None else advice_from_json(entry)
    except FileNotFoundError:
        return None
    except OSError as exc:
        problem = exc.strerror or str(exc)
    except ValueError as exc:
        problem = str(exc)
    log.warning("ignoring the link advice file", path=str(path), target=target, problem=problem)
    return None
