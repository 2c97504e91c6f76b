"""Where the syncer keeps the bytes of admitted pushes until they are merged or let go.

A push is received into a pool buffer (syncer.buffers) and stays there while its round is open:
it is merged within a grace window, a step or so later. A push that completes after its round
began merging is carried to its fragment's next round, a whole cycle (H steps) later
(docs/design.md §3.4, late pushes). With K = 1 up to M - 1 pushes of every round can be late, so
holding carried pushes in memory cost up to (M - 1) times the model: 10 times the model at M = 8,
where a round needs M + 2 fragments (bench/notes/late-pushes.md). So a carried push is written to a file
under the state directory, its buffer goes back to the pool, and the merge that takes it reads it
back in the merge worker. While memory is free the page cache keeps the file's bytes (memory the
kernel may reclaim, not the daemon's own), so the read-back is a copy; the disk is not in the path.

Nothing is lost on the way: a push whose write fails (a full disk) stays in memory, as before, and
the caller logs it; a push merged or let go while its write runs is taken from memory and the file
removed. The files mean nothing to another process: the directory is emptied when a store opens
and when it closes (a syncer restarting from a checkpoint has no pending pushes).

A push goes through these states, each on the event loop except the file I/O, which runs on one
writer thread:

    in memory --carry--> writing --written--> on disk
        |                   |                    |
        +------ take / drop (from any state: take hands the merge a Held to load) ------+

Written by hand because it is the syncer's own bookkeeping: which of its buffers hold which push.
Must not import networking or logging.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from dilocod.syncer.buffers import BufferPool
from dilocod.syncer.rounds import Push

#: The state directory's subdirectory for carried pushes.
LATE_DIR = "late-pushes"

#: A push by who sent it and which round it answered.
Key = tuple[str, int]


class Where(Enum):
    MEMORY = "memory"
    WRITING = "writing"  # in memory, and being written out
    DISK = "disk"
    GONE = "gone"  # taken by a merge or dropped


@dataclass(slots=True)
class Held:
    """One admitted push and where its bytes are."""

    push: Push
    buffer: memoryview | None
    precision: str
    #: The size of its bytes (a file read back must hold exactly this many).
    nbytes: int = 0
    where: Where = Where.MEMORY
    path: Path | None = None
    #: Taken by a merge while being written: the merge owns the buffer, the writer drops the file.
    taken: bool = False


class PushStore:
    """The admitted pushes of one syncer, by (learner, round)."""

    def __init__(self, pool: BufferPool, state_dir: Path) -> None:
        self.pool = pool
        self.directory = Path(state_dir) / LATE_DIR
        self._held: dict[Key, Held] = {}
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dilocod-late-pushes")
        #: Carried pushes written out and read back so far.
        self.written = 0
        self.read_back = 0
        self._clear()

    # ------------------------------------------------------------------ the event loop's side

    def pending(self) -> list[Key]:
        return sorted(self._held)

    def on_disk(self) -> int:
        """Carried pushes whose bytes are in files now."""
        return sum(1 for held in self._held.values() if held.where is Where.DISK)

    def hold(self, push: Push, buffer: memoryview, precision: str) -> None:
        """An admitted push, received into buffer (a pool buffer, now the store's)."""
        key = (push.learner, push.round_index)
        if key in self._held:
            raise KeyError(f"push {key} is already held")
        self._held[key] = Held(push, buffer, precision, buffer.nbytes)

    def get(self, key: Key) -> Held | None:
        return self._held.get(key)

    def replace(self, key: Key, buffer: memoryview) -> bool:
        """The push's bytes are now in buffer (decoded to float32); the old buffer goes back to the
        pool. False, and buffer back to the pool, when the push is no longer in memory here."""
        held = self._held.get(key)
        if held is None or held.where is not Where.MEMORY or held.buffer is None:
            self.pool.give(buffer.obj)  # type: ignore[arg-type]  # always a pool buffer
            return False
        self.pool.give(held.buffer.obj)  # type: ignore[arg-type]
        held.buffer, held.precision, held.nbytes = buffer, "fp32", buffer.nbytes
        return True

    def take(self, key: Key) -> Held | None:
        """The push, for a merge: its buffer if in memory (the caller's now), else its file to load()."""
        held = self._held.pop(key, None)
        if held is None:
            return None
        if held.where is Where.WRITING:
            held.taken = True
        if held.where is not Where.DISK:
            held.where = Where.GONE  # the buffer is the caller's; a write under way drops its file
        return held

    def drop(self, key: Key) -> Held | None:
        """Let the push go: its buffer back to the pool, its file removed (on the writer thread)."""
        held = self._held.pop(key, None)
        if held is None:
            return None
        if held.where is Where.MEMORY and held.buffer is not None:
            self.pool.give(held.buffer.obj)  # type: ignore[arg-type]
        elif held.where is Where.DISK and held.path is not None:
            self._writer.submit(_unlink, held.path)
        # WRITING: the writer gives the buffer back and removes the file when it is done.
        held.where = Where.GONE
        return held

    async def carry(self, key: Key) -> OSError | None:
        """Write a carried push out and give its buffer back to the pool. Returns the error of a
        write that failed (the push then stays in memory), else None."""
        held = self._held.get(key)
        if held is None or held.where is not Where.MEMORY or held.buffer is None:
            return None
        held.where = Where.WRITING
        path = self.directory / f"{key[0].encode().hex()}-{key[1]}.{held.precision}"
        buffer = held.buffer
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._writer, _write, path, buffer)
        except OSError as exc:
            if held.where is Where.WRITING:
                held.where = Where.MEMORY
            elif not held.taken:  # dropped meanwhile
                self.pool.give(buffer.obj)  # type: ignore[arg-type]
            self._writer.submit(_unlink, path)
            return exc
        if held.where is Where.WRITING:
            held.where, held.path, held.buffer = Where.DISK, path, None
            self.pool.give(buffer.obj)  # type: ignore[arg-type]
            self.written += 1
            return None
        # Taken by a merge (which owns the buffer now) or dropped while the write ran.
        if not held.taken:
            self.pool.give(buffer.obj)  # type: ignore[arg-type]
        self._writer.submit(_unlink, path)
        return None

    # ------------------------------------------------------------------ the merge worker's side

    def load(self, held: Held) -> memoryview:
        """The push's bytes in a buffer the caller owns: its own, or its file read back into a pool
        buffer (then removed). Runs in a worker thread, never on the event loop."""
        if held.buffer is not None:
            return held.buffer
        assert held.path is not None
        buffer = memoryview(self.pool.take(held.nbytes))
        try:
            got = 0
            with open(held.path, "rb", buffering=0) as file:
                # A read returns at most about 2 GiB on Linux: a fragment of a 12B model is that size.
                while got < held.nbytes and (n := file.readinto(buffer[got:])):
                    got += n
                extra = file.read(1)
            if got != held.nbytes or extra:
                raise OSError(f"carried push {held.path.name}: the file does not hold {held.nbytes} bytes")
        except BaseException:
            self.pool.give(buffer.obj)  # type: ignore[arg-type]
            raise
        finally:
            _unlink(held.path)
        self.read_back += 1
        return buffer

    def load_all(self, held: list[Held]) -> list[memoryview]:
        """load() each push, in order. If one fails, the buffers loaded so far go back to the
        pool and the files not read are removed before the error goes on."""
        loaded: list[memoryview] = []
        try:
            for item in held:
                loaded.append(self.load(item))
        except BaseException:
            for buffer in loaded:
                if not any(item.buffer is buffer for item in held):  # read back: a pool buffer
                    self.pool.give(buffer.obj)  # type: ignore[arg-type]
            self.discard(held[len(loaded) :])
            raise
        return loaded

    def discard(self, held: list[Held]) -> None:
        """Taken pushes that will not be merged: their files removed. Their buffers stay with
        the caller (a merge that failed part way may have left them anywhere)."""
        for item in held:
            if item.path is not None and item.buffer is None:
                _unlink(item.path)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Forget every push (a stopping syncer drops them, as its checkpoint says nothing of
        them) and empty the directory once the writer is done."""
        self._held.clear()
        self._writer.shutdown(wait=True, cancel_futures=True)
        self._clear()

    def _clear(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _write(path: Path, buffer: memoryview) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = buffer.cast("B")
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
