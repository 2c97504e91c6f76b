"""The learner's own state on disk: model, inner optimizer, the user's state (a data cursor), and
counters, written atomically (temporary file, fsync, rename, fsync the directory) and read back
with torch.load(weights_only=True), so nothing but tensors and plain values is ever unpickled.

What that load would refuse is refused before it is written (check_loadable, with the same
unpickler): a learner must never save a file that makes its next start fail. The learner also runs
the check on the factory's initial state at startup, so such a state is reported within seconds.

The directory also holds the learner's instance id: the syncer lets a learner that comes back with
the instance of a session it still holds take that session's place at once (a restart after a
crash, whose old connections may look alive for a while), and refuses another learner under the
same --id. A lock on the directory keeps a second process off it.

The global fragments are not saved here: after a restart the learner heals from the syncer. Must
not import networking.
"""

from __future__ import annotations

import io
import os
import re
import secrets
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from pickle import UnpicklingError  # the exception only: nothing here unpickles but torch's weights_only
from typing import Any

import torch

STATE_FILE = "learner-state.pt"
FORMAT = "dilocod-learner-state/1"
#: Held (flock) by the learner process that uses the directory, for its whole life.
LOCK_FILE = "learner.lock"
#: This learner's instance id (JOIN's instance): made at the first start, kept across restarts.
INSTANCE_FILE = "instance"
_INSTANCE = re.compile(r"[0-9a-f]{32}")
#: How the top-level parts of the state are named to the user, in check_loadable's message.
PART_NAMES = {
    "user": "Trainer.state_dict()",
    "optimizer": "the inner optimizer's state_dict()",
    "model": "the model's state_dict()",
}
#: Containers the check looks into (exactly these types: a subclass is pickled with its class,
#: which the load refuses, so it is checked whole).
_CONTAINERS = (dict, OrderedDict, list, tuple)
#: Tensor types that always load: left out of the check, so that it copies no parameters.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class LocalStateError(Exception):
    """The saved state cannot be used; the message names the file and the problem."""


def check_loadable(state: Mapping[str, Any]) -> None:
    """Raise LocalStateError unless load_local_state could read `state` back once saved; the
    message is one paragraph naming the first refused value by its key and type.

    The state's structure is saved with torch.save and read back with torch.load(weights_only=True),
    the very load a restart makes, with every plain tensor left out (those always load, and copying
    them would cost a model's worth of memory)."""
    if _round_trip_problem(_without_tensors(state)) is None:
        return
    for where, value in _values(state, ""):
        problem = _round_trip_problem(_without_tensors(value))
        if problem is not None:
            raise LocalStateError(_refusal(where, value, problem))
    raise LocalStateError(_refusal("the learner's state", state, "which is refused as a whole"))


def _without_tensors(value: Any) -> Any:
    kind = type(value)
    if kind in _PLAIN_TENSORS:
        return None
    if kind in (dict, OrderedDict):
        return kind((key, _without_tensors(item)) for key, item in value.items())
    if kind in (list, tuple):
        return kind(_without_tensors(item) for item in value)
    return value


def _values(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Every value below the containers, with its path; depth first, in order."""
    if type(value) not in _CONTAINERS:
        yield where, value
        return
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        path = PART_NAMES.get(key, f"[{key!r}]") if where == "" else f"{where}[{key!r}]"
        yield from _values(item, path)


def _round_trip_problem(value: Any) -> str | None:
    """None if `value` saves and loads back with weights_only=True, else what went wrong."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception as exc:
        return f"which torch.save cannot write ({type(exc).__name__}: {_first_line(exc)})"
    buffer.seek(0)
    try:
        torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as exc:
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        detail = f" (it names {named.group(1)})" if named else ""
        return f"which torch.load(weights_only=True) refuses{detail}"
    return None


def _refusal(where: str, value: Any, problem: str) -> str:
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return (
        f"the learner's state cannot be saved for the next start to load: {where} is a {name}, "
        f"{problem}. The state must be tensors and plain values (dict, list, tuple, set, str, int, "
        "float, bool, None): turn numpy values into Python ones (.item(), .tolist()) or tensors "
        "(torch.from_numpy), and save a generator's state (numpy: rng.bit_generator.state; torch: "
        "generator.get_state()) rather than the generator"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def save_local_state(state_dir: Path, state: Mapping[str, Any]) -> Path:
    """Write the state atomically; refused (LocalStateError, the old file kept) if it would not load."""
    check_loadable(state)
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / STATE_FILE
    temporary = state_dir / f".{STATE_FILE}.{os.getpid()}.tmp"
    try:
        with temporary.open("wb") as handle:
            torch.save({"format": FORMAT, **state}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        directory = os.open(state_dir, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def load_local_state(state_dir: Path) -> dict[str, Any] | None:
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except UnpicklingError as exc:
        # torch's own text suggests retrying with weights_only=False: the one thing not to do here.
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        detail = f" (it names {named.group(1)})" if named else ""
        raise LocalStateError(
            f"{path} is refused: it is not made of tensors and plain values only{detail}, and loading "
            "it anyway could run code. Move it away to start fresh"
        ) from None
    except Exception as exc:
        raise LocalStateError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}); move it away to start fresh"
        ) from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise LocalStateError(f"{path} is not a dilocod learner state ({FORMAT})")
    return state


def rank_state_dir(state_dir: Path | None, rank: int | None) -> Path | None:
    """Where one process keeps its state: --state-dir itself, or one directory per rank of an
    island (rank is None outside torchrun)."""
    if state_dir is None or rank is None:
        return state_dir
    return state_dir / f"rank-{rank}"


def learner_instance(state_dir: Path) -> str:
    """The instance id kept in state_dir, made (random, 128 bits) and written atomically at the
    first start or when the file is missing or unreadable."""
    path = state_dir / INSTANCE_FILE
    try:
        found = path.read_text().strip()
    except OSError:
        found = ""
    if _INSTANCE.fullmatch(found):
        return found
    instance = secrets.token_hex(16)
    state_dir.mkdir(parents=True, exist_ok=True)
    temporary = state_dir / f".{INSTANCE_FILE}.{os.getpid()}.tmp"
    temporary.write_text(instance + "\n")
    os.replace(temporary, path)
    return instance
