"""A daemon's state directory: its hold on it, and the care every reader and writer of one takes.

The hold is an exclusive lock (flock) on a file in the directory for the life of the process, with
the holder's pid written in for a person to read. The lock goes with the process, however it ends,
so a daemon killed with -9 never leaves it stale.

The care: files are opened only when they are regular files, without ever blocking (a FIFO in a
file's place would block a plain open), and read with a bound; at start a daemon tries a write in
the directory (probe_writes), so that a read-only, unwritable or unreadable directory is named then
(a configuration error), not at the first save. Write errors of the disk itself (DISK_ERRNOS: full,
over quota, I/O error) are not configuration errors: the daemon runs on and its next save retries.

Plain blocking file I/O; must not import networking or logging (the daemons log what is returned).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import BinaryIO

#: errno values that say the disk failed a write (no space, over quota, an I/O error) rather than
#: that the directory is misconfigured: at start they are a warning, later a save that is retried.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})
#: The exit status of a daemon that stopped as asked but could not write its state on the way out
#: (the syncer's final checkpoint, the learner's final local state): sysexits' EX_IOERR. The
#: previous checkpoint or state file is intact; systemd's Restart=on-failure restarts it from there.
EX_STATE_NOT_SAVED = 74
#: The most bytes read from a lock file: a pid and a newline.
MAX_PID_BYTES = 32
#: The file the start-up write probe writes, syncs and removes (under the lock: no one else uses it).
PROBE_FILE = ".dilocod-write-probe"


class StateDirError(Exception):
    """The state directory cannot be used as configured; the message names it and says why."""


class StateDirInUse(StateDirError):
    """Another live process holds the state directory."""


class StateNotSaved(Exception):
    """A daemon stopped as asked, but its state could not be written on the way out (the
    message says what and why); the command exits with EX_STATE_NOT_SAVED."""


class NotARegularFile(OSError):
    """A FIFO, a directory, a device or a socket where a regular file was expected."""


def hold_state_dir(state_dir: Path, lock_file: str, holder: str, stack: ExitStack) -> None:
    """Lock state_dir/lock_file until `stack` closes (making state_dir if missing); `holder` names
    the kind of daemon ("syncer", "learner") in the error when another one holds it."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StateDirError(f"--state-dir {state_dir} exists and is not a directory") from None
    except OSError as exc:
        raise StateDirError(f"--state-dir {state_dir}: {exc.strerror or exc}") from None
    path = state_dir / lock_file
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise StateDirError(
            f"--state-dir {state_dir}: cannot open {lock_file}: {exc.strerror or exc}"
        ) from None
    stack.callback(os.close, fd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise StateDirError(
            f"--state-dir {state_dir}: {lock_file} is {file_kind(mode)}, not a file: remove it"
        )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, MAX_PID_BYTES, 0).decode(errors="replace").strip() or "unknown"
        raise StateDirInUse(f"--state-dir {state_dir} is in use by another {holder} (pid {pid})") from None
    # The pid is for a person to read; the lock holds without it, so a full disk does not stop a start.
    with suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def probe_writes(state_dir: Path) -> str | None:
    """Write, fsync and remove a small file in state_dir, and fsync the directory, as every save
    will. StateDirError when that fails because of the configuration (a read-only file system, no
    permission to write or to read the directory, a FIFO or directory in the probe's place); the
    failure as text when it is the disk's (DISK_ERRNOS): the daemon starts and says so."""
    probe = state_dir / PROBE_FILE
    try:
        try:
            fd = os.open(
                probe,
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            try:
                os.write(fd, b"dilocod\n")
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            with suppress(OSError):  # nothing there, or nothing that can be removed
                probe.unlink()
        fsync_dir(state_dir)
    except OSError as exc:
        reason = f"--state-dir {state_dir}: a test write failed: {exc.strerror or exc}"
        if exc.errno in DISK_ERRNOS:
            return reason
        raise StateDirError(reason) from None
    return None


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading (a binary file object) if it is a regular file, else
    NotARegularFile (an OSError, as a failed open is).

    Opened without blocking (a FIFO in a file's place would block a plain open until something
    writes to it), then checked with fstat, so that what is read is what was checked."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(errno.EINVAL, f"{path.name} is {file_kind(mode)}, not a file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file at `path`, refused (OSError) if it holds more than max_bytes."""
    with open_regular(path) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"{path.name} is larger than {max_bytes} bytes")
    return data


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_kind(mode: int) -> str:
    """What a non-regular file is, for a message ("a FIFO")."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISREG, "a regular file"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")
