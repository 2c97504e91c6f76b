"""The anchors' memory: one region, faulted in at start, cut into one buffer per fragment.

A learner holds one float32 anchor per fragment, the model's size in all, and the first heal
writes every one of them. Memory a process has never touched costs a page fault per page on first
write, and that is what a heal into fresh buffers waited on: on the virtual machines this was
measured on, 0.4 to 2 s per GB against 0.03 s per GB into mapped memory (bench/notes/heals.md).
So the learner takes the whole region at start, before it joins, and faults it in on several
threads at once (faults taken in parallel ran 5 x faster there than one thread's); the buffer pool
then cuts each fragment's first anchor out of it and the heal writes into memory that is there.

The training process makes the region: a memfd when the network runs in its own process (which
maps it at its start, page tables filled, and names each piece it cuts by its offset) and anonymous
memory otherwise. After a plan, the
arena serves only its fragments' float32 sizes, once per fragment: the anchors, not the updates
and snapshots in flight, which the pool makes as it always has. Thread-safe: the pool calls take()
under its own lock, a plan calls expect() from the network's loop.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
import structlog

from dilocod.wire.manifest import ModelEntry

log = structlog.get_logger("dilocod.learner")

#: Pieces start on a page boundary (what a mapping at an offset needs).
ALIGN = mmap.ALLOCATIONGRANULARITY
#: Room for the page alignment of this many fragments, beyond the model's own bytes.
MAX_FRAGMENTS_ALIGNED = 1024
#: Threads that fault the region in, at most.
MAX_POPULATE_THREADS = 8


def anchor_bytes(model: Sequence[ModelEntry]) -> int:
    """The float32 bytes of every parameter: what all the fragments' anchors hold together."""
    return sum(4 * math.prod(entry.shape) for entry in model)


def anchors_ready(model: Sequence[ModelEntry], *, shared: bool) -> Arena:
    """The arena for this model's anchors, faulted in (before the learner joins: a heal then
    writes into memory that is there), and a log line saying what that took."""
    arena = Arena(arena_size(anchor_bytes(model)), shared=shared)
    seconds = arena.populate()
    log.info("anchor memory ready", gb=round(arena.size / 1e9, 3), seconds=round(seconds, 3))
    return arena


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def arena_size(anchors: int) -> int:
    """The region for anchors of `anchors` bytes in all, with room for their page alignment."""
    return _aligned(anchors) + ALIGN * min(MAX_FRAGMENTS_ALIGNED, max(1, anchors // ALIGN))


class Arena:
    def __init__(self, size: int, *, shared: bool, fd: int | None = None) -> None:
        """A region of `size` bytes (arena_size); shared: a memfd another process maps (fd), else
        anonymous memory of this process. With fd: the other process's memfd of that size, mapped
        with its pages in place (its owner populated them), the descriptor closed."""
        self.size = size
        self.fd: int | None = None
        if fd is not None:
            held = os.fstat(fd).st_size
            if held != size:
                os.close(fd)
                raise ValueError(f"the anchors' memfd holds {held} bytes, not {size}")
            try:
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            finally:
                os.close(fd)
        elif shared:
            self.fd = os.memfd_create("dilocod-anchors", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size)
        else:
            self._map = mmap.mmap(-1, size)
        self._lock = threading.Lock()
        self._next = 0
        self._wanted: Counter[int] = Counter()
        #: Bytes cut out so far, and the seconds populate() took.
        self.used = 0
        self.populate_s: float | None = None

    def populate(self, threads: int | None = None) -> float:
        """Fault every page in, on `threads` threads (default: the cores, at most
        MAX_POPULATE_THREADS); returns the seconds it took. A write of zero per page: the memory
        reads as it did (zeros), and the kernel backs every page now rather than at a heal's first
        write into it."""
        count = max(1, min(threads or os.cpu_count() or 1, MAX_POPULATE_THREADS))
        span = _aligned(-(-self.size // count))

        def touch(lo: int) -> None:
            np.frombuffer(self._map, dtype=np.uint8)[lo : min(lo + span, self.size) : mmap.PAGESIZE] = 0

        started = time.perf_counter()
        workers = [
            threading.Thread(target=touch, args=(lo,), name="dilocod-anchors", daemon=True)
            for lo in range(0, self.size, span)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        self.populate_s = time.perf_counter() - started
        return self.populate_s

    def expect(self, sizes: Iterable[int]) -> None:
        """The fragments' float32 sizes under a new plan: one piece of each may be cut (as long as
        the region has room), the rest of the pool's buffers are made elsewhere."""
        with self._lock:
            self._wanted = Counter(sizes)

    def view(self, offset: int, size: int) -> memoryview:
        """The piece at `offset` (one the other process cut: checked against the region)."""
        if offset < 0 or size < 0 or offset % ALIGN or offset + size > self.size:
            raise ValueError(f"no piece of {size} bytes at offset {offset} in an arena of {self.size}")
        return memoryview(self._map)[offset : offset + size]

    def take(self, size: int) -> tuple[int, memoryview] | None:
        """(offset, a view of `size` bytes) for a fragment's anchor the plan expects and the
        region still has room for, else None."""
        with self._lock:
            if self._wanted[size] < 1 or self._next + size > self.size:
                return None
            self._wanted[size] -= 1
            offset = self._next
            self._next = _aligned(offset + size)
            self.used += size
            return offset, memoryview(self._map)[offset : offset + size]

    def close(self) -> None:
        """Close the descriptor; the mapping lives on while any view of it does."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
