"""The syncer's fragment-sized buffers: one pool for pushes, decoded pushes, merge outputs, the
merge's new momentum, masters and momenta retired by a merge, reused rather than allocated per round.

Each buffer has one owner at a time: whoever took it gives it back (or drops it, when something may
still write into it). Idle buffers are kept up to `max_idle` in all, whatever their sizes; a
buffer given back beyond that is freed (the oldest idle buffer of another size goes first, so the
sizes that are asked for stay), so the pool never keeps the memory of its worst moment for ever.

Buffers are anonymous memory maps: the kernel hands out zero pages as they are first written, so
taking a fresh buffer costs a system call, not a zero-fill of 100+ MB on the event loop (bytearray(n)
writes every byte while holding the GIL), and a freed buffer goes back to the system at once. The
unmapping itself runs on a thread of the pool's own: freeing a written map costs the kernel about
20 ms per 167 MB (a fragment of a 1B model) and would otherwise fall on whichever thread gave the
buffer back, often the event loop.

Thread-safe: the event loop takes and gives push buffers while the merge worker takes and gives
merge buffers. Must not import networking, torch or logging.
"""

from __future__ import annotations

import contextlib
import mmap
import queue
import threading
from collections import deque

#: What the pool hands out: a writable buffer of exactly the size asked for.
Buffer = mmap.mmap | bytearray

#: Idle buffers kept by default: the merge's two outputs (Θ_p and b_p), and a push per learner
#: of a small fleet; a larger fleet pays a system call (not a zero-fill) per buffer beyond that.
DEFAULT_MAX_IDLE = 4


def zeroed(size: int) -> Buffer:
    """A new zero-filled buffer whose pages cost memory only once written: Θ and b at start (a
    fresh syncer's b stays unmapped until the first merge of each fragment writes it)."""
    return mmap.mmap(-1, size) if size else bytearray()


class BufferPool:
    """Fragment-sized buffers, kept for reuse up to max_idle idle ones across all sizes."""

    def __init__(self, max_idle: int = DEFAULT_MAX_IDLE) -> None:
        if max_idle < 0:
            raise ValueError(f"max_idle must be at least 0, got {max_idle}")
        self.max_idle = max_idle
        self._idle: deque[Buffer] = deque()
        self._lock = threading.Lock()
        #: Buffers created so far (a steady state creates none).
        self.created = 0
        #: Buffers freed because max_idle were already kept.
        self.freed = 0
        self._unmapping: queue.SimpleQueue[Buffer] = queue.SimpleQueue()
        self._unmapper: threading.Thread | None = None

    @property
    def idle(self) -> int:
        return len(self._idle)

    def take(self, size: int) -> Buffer:
        """A buffer of size bytes, owned by the caller until give(); its contents are undefined."""
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if len(buffer) == size:
                    del self._idle[i]
                    return buffer
            self.created += 1
        # Outside the lock: a map is a system call, and nothing shared is touched.
        return zeroed(size)

    def give(self, buffer: Buffer) -> None:
        """Back to the pool: the caller and everyone it lent the buffer to are done with it."""
        with self._lock:
            if any(kept is buffer for kept in self._idle):
                raise RuntimeError("a buffer was given back twice")
            self._idle.append(buffer)
            while len(self._idle) > self.max_idle:
                # The oldest idle buffer of another size first, else the oldest.
                size = len(buffer)
                victim = next((i for i, b in enumerate(self._idle) if len(b) != size), 0)
                self._free(self._idle[victim])
                del self._idle[victim]  # by position: bytearrays compare by content
                self.freed += 1

    def _free(self, buffer: Buffer) -> None:
        """Unmap off the caller's thread (called with the lock held)."""
        if not isinstance(buffer, mmap.mmap):
            return  # a bytearray: the allocator frees it in no time
        if self._unmapper is None:
            self._unmapper = threading.Thread(target=self._unmap, name="dilocod-unmap", daemon=True)
            self._unmapper.start()
        self._unmapping.put(buffer)

    def _unmap(self) -> None:
        while True:
            buffer = self._unmapping.get()
            # A view of it still alive somewhere (BufferError): it is unmapped when that goes.
            with contextlib.suppress(BufferError):
                buffer.close()
            del buffer
