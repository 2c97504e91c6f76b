"""A daemon's hold on its state directory: an exclusive lock (flock) on a file in it for the life
of the process, with the holder's pid written in for a person to read. The lock goes with the
process, however it ends, so a daemon killed with -9 never leaves it stale."""

from __future__ import annotations

import fcntl
import os
from contextlib import ExitStack
from pathlib import Path


class StateDirInUse(Exception):
    """The directory cannot be held: another live process holds it, or it cannot be made."""


def hold_state_dir(state_dir: Path, lock_file: str, holder: str, stack: ExitStack) -> None:
    """Lock state_dir/lock_file until `stack` closes; `holder` names the kind of daemon ("syncer",
    "learner") in the error when another one holds it."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        handle = stack.enter_context((state_dir / lock_file).open("a+"))
    except OSError as exc:
        raise StateDirInUse(f"--state-dir {state_dir}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        pid = handle.read().strip() or "unknown"
        raise StateDirInUse(f"--state-dir {state_dir} is in use by another {holder} (pid {pid})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
