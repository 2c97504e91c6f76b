"""Fragment-sized buffers of the learner, reused by size, each with a count of its holders.

A fragment's bytes are received, applied, kept as its anchor, read by the push worker (the anchor
of an outer gradient) and copied into for snapshots. Each of those is a holder of a buffer; a
buffer goes back to the free list only when the last holder lets go, and a new one is made only
when none of the size is free. So a buffer is never written while anyone still reads it, and the
number of buffers is what is held at the busiest moment: one anchor per fragment, plus the
updates and snapshots in flight.

A pool does not know what its buffers are made of (make: bytearrays in one process, shared memory
lent to the network process), nor what the holders are: it counts them. Thread-safe (the training
thread, the event loop and the push worker hold and release). Must not import torch or asyncio.
"""

from __future__ import annotations

import itertools
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass


class BufferOwnershipError(RuntimeError):
    """A buffer released more often than it was held, or one this pool never made: our bug."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A buffer as acquire() hands it out: its id, a writable view of exactly the size asked for,
    and whether it was made for this call (not reused)."""

    bid: int
    view: memoryview
    new: bool


def bytearray_buffer(bid: int, size: int) -> memoryview:
    """A pool's default make: memory of this process."""
    return memoryview(bytearray(size))


def mapped_buffer(bid: int, size: int) -> memoryview:
    """A pool's make for memory a GPU copies to and from: an anonymous mapping of its own, whole
    pages that no other buffer shares (page-locking one locks nothing else; learner.device)."""
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


class BufferPool:
    def __init__(self, make: Callable[[int, int], memoryview] = bytearray_buffer) -> None:
        #: make(id, size): a new writable buffer of exactly `size` bytes.
        self._make = make
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._views: dict[int, memoryview] = {}
        self._holders: dict[int, int] = {}
        self._free: dict[int, list[int]] = {}
        #: id(view) -> buffer id, for the views handed out (kept alive in _views, so their ids stay
        #: theirs).
        self._by_view: dict[int, int] = {}
        #: The most buffers this pool has had at once (made and not discarded).
        self.peak = 0

    def acquire(self, size: int) -> Lease:
        """A free buffer of `size` bytes (one made when none is), held once by the caller."""
        with self._lock:
            free = self._free.get(size)
            new = not free
            if free:
                bid = free.pop()
                view = self._views[bid]
            else:
                bid = next(self._ids)
                view = self._make(bid, size)
                if len(view) != size:
                    raise BufferOwnershipError(f"made a buffer of {len(view)} bytes for {size}")
                self._views[bid] = view
                self._by_view[id(view)] = bid
                self.peak = max(self.peak, len(self._views))
            self._holders[bid] = 1
            return Lease(bid, view, new)

    def hold(self, bid: int) -> None:
        """One more holder of a buffer that is held now."""
        with self._lock:
            if self._holders.get(bid, 0) < 1:
                raise BufferOwnershipError(f"buffer {bid} held again after its last holder let go")
            self._holders[bid] += 1

    def release(self, bid: int) -> bool:
        """One holder fewer; True when that was the last one (the buffer is free for reuse)."""
        with self._lock:
            holders = self._holders.get(bid, 0)
            if holders < 1:
                raise BufferOwnershipError(f"buffer {bid} released, but nobody holds it")
            if holders > 1:
                self._holders[bid] = holders - 1
                return False
            del self._holders[bid]
            self._free.setdefault(len(self._views[bid]), []).append(bid)
            return True

    def discard(self, bid: int) -> None:
        """Forget a held buffer for good, whoever holds it: something may still write into it (a
        transfer that failed while a decompression ran), so it is never handed out again."""
        with self._lock:
            if self._holders.pop(bid, None) is None:
                raise BufferOwnershipError(f"buffer {bid} discarded, but nobody holds it")
            view = self._views.pop(bid)
            del self._by_view[id(view)]

    def id_of(self, buffer: object) -> int | None:
        """The id of a view this pool handed out (the very object), else None."""
        with self._lock:
            bid = self._by_view.get(id(buffer))
            return bid if bid is not None and self._views[bid] is buffer else None

    def view(self, bid: int) -> memoryview:
        with self._lock:
            view = self._views.get(bid)
            if view is None:
                raise BufferOwnershipError(f"buffer {bid} is not this pool's")
            return view

    def holders(self, bid: int) -> int:
        with self._lock:
            return self._holders.get(bid, 0)

    @property
    def held(self) -> int:
        """Buffers held now."""
        with self._lock:
            return len(self._holders)

    @property
    def buffers(self) -> int:
        """Buffers this pool has now, held or free."""
        with self._lock:
            return len(self._views)
