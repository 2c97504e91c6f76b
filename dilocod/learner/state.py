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

Every file is opened only if it is a regular file, without blocking (dilocod.ops.statedir): a FIFO
or a directory in place of learner-state.pt or of the instance file is named at start (exit 78),
never waited on. A write that the disk fails (full, over quota, an I/O error) raises
LocalStateNotSaved with the previous file intact and no temporary file left: the learner trains on
and tries again at its next save.

The global fragments are not saved here: after a restart the learner heals from the syncer. Must
not import networking.
"""

from __future__ import annotations

import contextlib
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

from dilocod.ops.statedir import DISK_ERRNOS, NotARegularFile, fsync_dir, open_regular, read_regular

STATE_FILE = "learner-state.pt"
FORMAT = "dilocod-learner-state/1"
#: Held (flock) by the learner process that uses the directory, for its whole life.
LOCK_FILE = "learner.lock"
#: This learner's instance id (JOIN's instance): made at the first start, kept across restarts.
INSTANCE_FILE = "instance"
_INSTANCE = re.compile(r"[0-9a-f]{32}")
#: The most bytes read from the instance file (32 hex digits and a newline; more is not ours).
MAX_INSTANCE_BYTES = 64
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


class LocalStateNotSaved(Exception):
    """Writing the state failed for a reason of the disk or the file system (full, an I/O error);
    the previous file is intact and the next save may succeed. The message names the cause."""


class _RecordingWriter:
    """A file that remembers the OSError a write raised: torch.save reports a failed write as a
    RuntimeError about stream positions, and the cause (no space left) would be lost."""

    def __init__(self, handle: io.BufferedWriter) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.handle.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.handle.flush()


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
    """Write the state atomically (temporary file, fsync, rename, fsync the directory).

    Refused with LocalStateError (nothing written) if it would not load. LocalStateNotSaved when
    writing fails: the previous file is kept whole and no temporary file is left."""
    check_loadable(state)
    path = state_dir / STATE_FILE
    temporary = state_dir / f".{STATE_FILE}.{os.getpid()}.tmp"
    writer: _RecordingWriter | None = None
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        temporary.unlink(missing_ok=True)  # a leftover of this pid's earlier life; O_EXCL below
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(temporary, flags, 0o644), "wb") as handle:
            writer = _RecordingWriter(handle)
            torch.save({"format": FORMAT, **state}, writer)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        fsync_dir(state_dir)
    except OSError as exc:
        raise LocalStateNotSaved(_not_saved(path, exc)) from exc
    except RuntimeError as exc:
        if writer is None or writer.error is None:
            raise
        raise LocalStateNotSaved(_not_saved(path, writer.error)) from exc
    finally:
        with contextlib.suppress(OSError):  # a directory in its place: the next save's unlink says so
            temporary.unlink(missing_ok=True)
    return path


def _not_saved(path: Path, exc: OSError) -> str:
    kept = "the previous file is kept" if os.path.exists(path) else "there is no earlier file"
    return f"{path} not written: {exc.strerror or exc} ({kept})"


def load_local_state(state_dir: Path) -> dict[str, Any] | None:
    """The saved state, None if there is none; LocalStateError when it cannot be used (not a
    regular file, unreadable, not ours, or holding what weights_only refuses)."""
    path = state_dir / STATE_FILE
    try:
        handle = open_regular(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LocalStateError(
            f"{path} cannot be read: {exc.strerror or exc}; move it away to start fresh"
        ) from None
    try:
        with handle:
            state = torch.load(handle, map_location="cpu", weights_only=True)
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
    first start or when the file is missing or does not hold one.

    LocalStateError when something other than a regular file is in its place (named at start, not
    waited on). When the disk fails the write (DISK_ERRNOS) the new id is used unsaved: a restart
    then comes back as a new process of the same learner id, which the syncer also accepts."""
    path = state_dir / INSTANCE_FILE
    try:
        found = read_regular(path, MAX_INSTANCE_BYTES).decode(errors="replace").strip()
    except NotARegularFile as exc:
        raise LocalStateError(f"{path}: {exc.strerror}: move it away") from None
    except OSError:
        found = ""  # missing, or unreadable (EFBIG, EIO): made anew
    if _INSTANCE.fullmatch(found):
        return found
    instance = secrets.token_hex(16)
    state_dir.mkdir(parents=True, exist_ok=True)
    temporary = state_dir / f".{INSTANCE_FILE}.{os.getpid()}.tmp"
    try:
        temporary.write_text(instance + "\n")
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        if exc.errno not in DISK_ERRNOS:
            raise
    return instance
