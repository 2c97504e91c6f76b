"""Real file systems for the tests of what a disk can do to a state directory: a small tmpfs that a
test fills up (ENOSPC on the next write), and a read-only bind mount (EROFS, which root cannot
write through either, unlike a chmod). Both need root and mount (host.py: a skip on a developer's
machine, a failure where the host must have them), and both are unmounted in a finally.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from devkit.host import need_root, need_tool

#: What fills a tmpfs: one file, written until the file system refuses.
FILLER = ".filler"
_FILL_CHUNK_BYTES = 64 * 1024


@contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of size_bytes mounted at path (made if missing) for the duration."""
    need_root("mounts a small tmpfs to fill it")
    mount, umount = need_tool("mount", "util-linux"), need_tool("umount", "util-linux")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run([mount, "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        # Lazy: a daemon that a failed test left running must not keep the mount behind.
        subprocess.run([umount, "--lazy", str(path)], check=True)


@contextmanager
def read_only_bind(path: Path) -> Iterator[Path]:
    """path (a directory) bind-mounted read-only onto itself for the duration."""
    need_root("bind-mounts a directory read-only")
    mount, umount = need_tool("mount", "util-linux"), need_tool("umount", "util-linux")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run([mount, "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run([mount, "-o", "remount,bind,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run([umount, "--lazy", str(path)], check=True)


def fill(root: Path) -> Path:
    """Write root/FILLER until the file system is full; the filler's path (unlink it to free)."""
    filler = root / FILLER
    chunk = b"\0" * _FILL_CHUNK_BYTES
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        size = len(chunk)
        while size:  # down to single bytes, so that not even a small file fits afterwards
            try:
                os.write(fd, chunk[:size])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                size //= 2
    finally:
        os.close(fd)
    return filler
