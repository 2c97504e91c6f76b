"""The learner's own state on disk: model, inner optimizer, the user's state (a data cursor), and
counters, written atomically (temporary file, fsync, rename, fsync the directory) and read back
with torch.load(weights_only=True), so nothing but tensors and plain values is ever unpickled.

The global fragments are not saved here: after a restart the learner heals from the syncer. Must
not import networking.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from pickle import UnpicklingError  # the exception only: nothing here unpickles but torch's weights_only
from typing import Any

import torch

STATE_FILE = "learner-state.pt"
FORMAT = "dilocod-learner-state/1"


class LocalStateError(Exception):
    """The saved state cannot be used; the message names the file and the problem."""


def save_local_state(state_dir: Path, state: Mapping[str, Any]) -> Path:
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
