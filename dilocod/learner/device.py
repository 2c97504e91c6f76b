"""Fragments between the training device and host memory, and the clock of a step (docs/design.md
§3.8): what the training loop copies out for a push, what it copies in to apply a merge, and how
long a step took.

On the CPU a snapshot is one copy into the network's buffer, an apply reads the update's buffer in
place, and a step's time is the host's clock (HostCopier, HostClock). On CUDA none of it may make
the training stream, or the training thread, wait for PCIe or for the GPU to drain (DeviceCopier,
DeviceClock):
- host buffers (the network's snapshot and update buffers) are page-locked once, at first use, for
  as long as they live (HostPins), never per copy; every registration's result is checked;
- a snapshot copies the fragment device-to-device into a staging buffer on the training stream (at
  HBM speed) and records an event; a side stream copies that buffer to the host after the event.
  The training stream never waits for the side stream; the network waits on the side stream's
  event (bridge.CopyInFlight) before it reads the bytes;
- an apply copies the update host-to-device on the side stream, non_blocking from pinned memory,
  into a staging buffer; the training stream waits for that copy on the device (an event, not the
  host) and the apply's kernels are queued behind it at once;
- staging buffers are reused (DeviceSlots): one is taken again only once the event of its last use
  has completed, so there are as many as are in flight at once;
- a host buffer a copy still reads is given back only once that copy's event has completed
  (Holds, settled at every step boundary);
- a step's time is the device's: an event at the end of each step on the training stream, read
  once the next one has completed (a step or so later), so reading never waits.

Why by hand: torch's pin_memory() allocates new pinned memory, and the buffers here are memory of
the network's pools (shared with the network process, or lent to it) that outlive any tensor.
cudaHostRegister over them is what torch offers (torch.cuda.cudart()); the lifetime (register once,
unregister when the memory goes) and the checking of its result are this module's.

The CUDA calls are confined to CudaStreams and HostPins.for_cuda(); everything else works through
the Streams protocol, which the tests drive with CPU stand-ins. Must not import networking.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dilocod.learner.bridge import Buffer, CopyInFlight
from dilocod.learner.layout import FragmentLayout
from dilocod.model.precision import byte_views

#: cudaHostRegisterPortable: the registration holds for every CUDA context of the process.
REGISTER_PORTABLE = 1
#: Device step times kept waiting for their end events; more means the host runs this many steps
#: ahead of the device, and the oldest are dropped (never waited for).
MAX_PENDING_STEP_EVENTS = 256


class DeviceError(RuntimeError):
    """A CUDA call the learner's copies depend on failed; the message names the call and the error."""


class Event(Protocol):
    """A point in a stream's work (torch.cuda.Event, or a stand-in)."""

    def query(self) -> bool:
        """Whether the work before it has completed; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block until the work before it has completed."""
        ...

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to `end` (both completed)."""
        ...


class Streams(Protocol):
    """The streams a DeviceCopier works with: the training stream (the current one) and a side
    stream of its own for the copies to and from the host."""

    def record_main(self, *, timing: bool = False) -> Event:
        """An event at this point of the training stream."""
        ...

    def record_side(self) -> Event:
        """An event at this point of the side stream."""
        ...

    def main_waits(self, event: Event) -> None:
        """The training stream's later work waits for the event (on the device)."""
        ...

    def side_waits(self, event: Event) -> None:
        """The side stream's later work waits for the event (on the device)."""
        ...

    def on_side(self) -> AbstractContextManager[None]:
        """Work queued inside runs on the side stream."""
        ...

    def synchronize(self) -> None:
        """Block until the work queued on both streams has completed."""
        ...


class CudaStreams:
    """Streams of a CUDA device: the current stream for training, a new one for copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = torch.cuda.Stream(device)

    def record_main(self, *, timing: bool = False) -> Event:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def record_side(self) -> Event:
        event = torch.cuda.Event()
        event.record(self._side)
        return event

    def main_waits(self, event: Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def side_waits(self, event: Event) -> None:
        self._side.wait_event(event)  # type: ignore[arg-type]

    def on_side(self) -> AbstractContextManager[None]:
        return torch.cuda.stream(self._side)

    def synchronize(self) -> None:
        self._side.synchronize()
        torch.cuda.current_stream(self.device).synchronize()


# ----------------------------------------------------------------------------- host memory


class HostPins:
    """Host memory page-locked for the device: each mapping (or bytearray) that holds a buffer is
    registered whole, once, the first time one of its buffers is copied to or from the device, and
    stays registered while it is held here (a pool's buffers live as long as the pool; a buffer the
    pool discards is unpinned). A region is registered whole because the pages it shares with no
    other buffer are what a mapping gives: two registrations may not overlap a page."""

    def __init__(
        self,
        register: Callable[[int, int], int],
        unregister: Callable[[int], int],
        explain: Callable[[int], str] = str,
    ) -> None:
        #: register(address, size) and unregister(address) return a CUDA error code (0: success).
        self._register = register
        self._unregister = unregister
        self._explain = explain
        #: id(owner) -> (owner, address): the owner is kept, so its id and memory stay its own.
        self._pinned: dict[int, tuple[object, int]] = {}
        #: The training thread pins; the network thread unpins what its pool discards.
        self._lock = threading.Lock()

    @classmethod
    def for_cuda(cls) -> HostPins:
        cudart = torch.cuda.cudart()
        return cls(
            lambda address, size: int(cudart.cudaHostRegister(address, size, REGISTER_PORTABLE)),
            lambda address: int(cudart.cudaHostUnregister(address)),
            lambda code: str(torch.cuda.CudaError(code)),
        )

    @property
    def pinned(self) -> int:
        """Regions registered now."""
        return len(self._pinned)

    def pin(self, buffer: Buffer) -> None:
        """Page-lock the memory that holds `buffer` (nothing if it is already)."""
        owner = _owner(buffer)
        with self._lock:
            if id(owner) in self._pinned or not len(owner):  # type: ignore[arg-type]
                return
            address, size = _address(owner), len(owner)  # type: ignore[arg-type]
            code = self._register(address, size)
            if code:
                raise DeviceError(
                    f"cudaHostRegister of {size} bytes at {address:#x} failed: {self._explain(code)}; "
                    "copies between the GPU and this memory would be synchronous. Is there room to "
                    "page-lock it (physical memory; a memory lock limit: ulimit -l, LimitMEMLOCK=)?"
                )
            self._pinned[id(owner)] = (owner, address)

    def unpin(self, buffer: Buffer) -> None:
        """The memory that holds `buffer` is going: unregister it (nothing if it never was)."""
        with self._lock:
            held = self._pinned.pop(id(_owner(buffer)), None)
        if held is not None:
            self._check_unregister(held[1])

    def unpin_all(self) -> None:
        with self._lock:
            pinned, self._pinned = list(self._pinned.values()), {}
        for _held, address in pinned:
            self._check_unregister(address)

    def _check_unregister(self, address: int) -> None:
        code = self._unregister(address)
        if code:
            raise DeviceError(f"cudaHostUnregister at {address:#x} failed: {self._explain(code)}")


def _owner(buffer: Buffer) -> object:
    """The object whose memory a buffer is: a view's mapping or bytearray, or the buffer itself."""
    return buffer.obj if isinstance(buffer, memoryview) else buffer


def _address(owner: object) -> int:
    """The address of an object's writable memory (a bytearray, a mapping)."""
    return int(np.frombuffer(owner, dtype=np.uint8).ctypes.data)  # type: ignore[call-overload]


# ----------------------------------------------------------------------------- device buffers


class DeviceSlots:
    """Flat device buffers (uint8) by size, each reused only once the event of its last use has
    completed: never waited for, a slot still in use makes a new one."""

    def __init__(self, make: Callable[[int], torch.Tensor]) -> None:
        self._make = make
        self._free: dict[int, deque[tuple[torch.Tensor, Event | None]]] = {}
        #: Buffers made so far (the most that were in use at once, as none is ever dropped).
        self.made = 0

    def take(self, size: int) -> torch.Tensor:
        free = self._free.get(size)
        if free:
            # The oldest first: the one most likely done. Only it is asked (events complete in
            # order on one stream, and the rest were given back later).
            flat, used = free[0]
            if used is None or used.query():
                free.popleft()
                return flat
        self.made += 1
        return self._make(size)

    def give(self, flat: torch.Tensor, used: Event | None) -> None:
        """Back for reuse once `used` (its last use) has completed."""
        self._free.setdefault(flat.numel(), deque()).append((flat, used))

    @property
    def free(self) -> int:
        return sum(len(free) for free in self._free.values())


class Holds:
    """Host buffers a device copy still reads: each let go of (its release called) once the
    copy's event has completed; settle() at every step boundary, never waiting."""

    def __init__(self) -> None:
        self._pending: deque[tuple[Event, Callable[[], None]]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def after(self, event: Event | None, release: Callable[[], None]) -> None:
        if event is None or (not self._pending and event.query()):
            release()
        else:
            self._pending.append((event, release))

    def settle(self) -> None:
        """Let go of what the completed copies held (in order: the copies run on one stream)."""
        while self._pending and self._pending[0][0].query():
            self._pending.popleft()[1]()

    def drain(self) -> None:
        """Wait for every copy and let go of all (at the end of training)."""
        while self._pending:
            event, release = self._pending.popleft()
            event.synchronize()
            release()


@dataclass(frozen=True, slots=True)
class Upload:
    """An update on its way to the training device, taken at the boundary it arrived at: a slot
    (flat uint8, wire layout) and the event of the side stream's copy that fills it; None when the
    bytes are there in the training stream's order already (an island's broadcast)."""

    flat: torch.Tensor
    arrived: Event | None = None

    def landed(self) -> bool:
        """Whether the copy has completed (never waits): applied now, it costs the stream nothing."""
        return self.arrived is None or self.arrived.query()


@dataclass(frozen=True, slots=True)
class Staged:
    """A fragment's update where the apply reads it: views in wire layout (on the training device),
    and the slot they are views of (None: the host buffer itself)."""

    views: list[torch.Tensor]
    flat: torch.Tensor | None = None


class DeviceCopy:
    """A snapshot's device-to-host copy, running on the side stream (bridge.CopyInFlight)."""

    def __init__(self, event: Event) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event.query()

    def wait(self) -> None:
        self._event.synchronize()


# ----------------------------------------------------------------------------- copiers


class Copier(Protocol):
    """What the training loop asks of its device path."""

    def copy_out(
        self,
        layout: FragmentLayout,
        allocate: Callable[[int], Buffer],
        anchor: torch.Tensor | None = None,
    ) -> tuple[Buffer, CopyInFlight | None]:
        """The fragment's parameters in wire layout (float32), in a buffer from allocate(size), or
        with `anchor` (its bytes in wire layout, where the parameters are) the outer gradient
        δ = anchor - θ; with the copy still running when the second item is not None."""
        ...

    def prefetch(self, buffer: Buffer) -> Upload | None:
        """Start copying an update to the training device now, at the boundary that took it: by
        its apply, usually a step later, the copy has landed and the stream waits for nothing.
        None: the apply reads the host buffer in place (the CPU)."""
        ...

    def stage(self, layout: FragmentLayout, buffer: Buffer, upload: Upload | None = None) -> Staged:
        """Where the apply reads an update: the upload's slot (the training stream's work queued
        from now on waits for its copy, on the device; started now if there is none) or the host
        buffer itself. done(staged) once the apply is queued."""
        ...

    def done(self, staged: Staged) -> None:
        """The apply that reads `staged` is queued: its device buffer may be reused after it."""
        ...

    def discard(self, upload: Upload) -> None:
        """An update dropped unapplied: its slot may be reused once its copy has landed."""
        ...

    def let_go(self, buffer: Buffer, release: Callable[[], None]) -> None:
        """release() once no copy reads `buffer` any more (at once, or at a later settle())."""
        ...

    def settle(self) -> None:
        """At a step boundary: let go of what completed copies held. Never waits."""
        ...

    def forget(self, buffer: Buffer) -> None:
        """The memory of `buffer` is going (a pool discarded it): unpin it. Any thread."""
        ...

    def close(self) -> None:
        """At the end of training: wait for the copies, let go of everything, unpin."""
        ...


class HostCopier:
    """The CPU's device path: the parameters are host memory already."""

    def copy_out(
        self,
        layout: FragmentLayout,
        allocate: Callable[[int], Buffer] = bytearray,
        anchor: torch.Tensor | None = None,
    ) -> tuple[Buffer, CopyInFlight | None]:
        buffer = allocate(layout.raw_bytes)
        _fill(layout.views(buffer), layout, anchor)
        return buffer, None

    def prefetch(self, buffer: Buffer) -> Upload | None:
        return None

    def stage(self, layout: FragmentLayout, buffer: Buffer, upload: Upload | None = None) -> Staged:
        return Staged(layout.views(buffer))

    def done(self, staged: Staged) -> None:
        pass

    def discard(self, upload: Upload) -> None:
        pass

    def let_go(self, buffer: Buffer, release: Callable[[], None]) -> None:
        release()

    def settle(self) -> None:
        pass

    def forget(self, buffer: Buffer) -> None:
        pass

    def close(self) -> None:
        pass


def _fill(views: list[torch.Tensor], layout: FragmentLayout, anchor: torch.Tensor | None) -> None:
    """The fragment's parameters into views of its wire layout (float32), or with `anchor` the
    outer gradient anchor - θ: float32 subtraction element by element, the parameter upcast exactly
    first, the same bits as the network's (learner.delta) but for NaN payloads."""
    with torch.no_grad():
        if anchor is None:
            for view, param in zip(views, layout.params, strict=True):
                view.copy_(param)
            return
        anchors = byte_views(anchor, layout.manifest)
        for view, param, held in zip(views, layout.params, anchors, strict=True):
            torch.sub(held, param, out=view)


class DeviceCopier:
    """A GPU's device path (module docstring): snapshots staged on the device and copied out on a
    side stream, updates copied in on it from pinned memory, staging buffers reused."""

    def __init__(self, device: torch.device, streams: Streams, pins: HostPins) -> None:
        self.device = device
        self.streams = streams
        self.pins = pins
        self.slots = DeviceSlots(lambda size: torch.zeros(size, dtype=torch.uint8, device=device))
        self.holds = Holds()
        #: id(host buffer) -> (buffer, the event of the last copy that reads it): a copy in
        #: flight is a holder of its source.
        self._reading: dict[int, tuple[Buffer, Event]] = {}

    @classmethod
    def for_cuda(cls, device: torch.device) -> DeviceCopier:
        return cls(device, CudaStreams(device), HostPins.for_cuda())

    def copy_out(
        self,
        layout: FragmentLayout,
        allocate: Callable[[int], Buffer],
        anchor: torch.Tensor | None = None,
    ) -> tuple[Buffer, CopyInFlight | None]:
        buffer = allocate(layout.raw_bytes)
        if not layout.raw_bytes:
            return buffer, None
        self.pins.pin(buffer)
        flat = self.slots.take(layout.raw_bytes)
        # On the training stream, ordered after the step that made the values: device to device,
        # into the float32 wire layout (the padding stays the slot's zeros, or the anchor's).
        _fill(byte_views(flat, layout.manifest), layout, anchor)
        with torch.no_grad():
            staged = self.streams.record_main()
            self.streams.side_waits(staged)
            host = torch.frombuffer(buffer, dtype=torch.uint8)
            with self.streams.on_side():
                host.copy_(flat, non_blocking=True)
            copied = self.streams.record_side()
        self.slots.give(flat, copied)
        return buffer, DeviceCopy(copied)

    def prefetch(self, buffer: Buffer) -> Upload | None:
        if not len(buffer):
            return None
        self.pins.pin(buffer)
        flat = self.slots.take(len(buffer))
        with torch.no_grad():
            with self.streams.on_side():
                flat.copy_(torch.frombuffer(buffer, dtype=torch.uint8), non_blocking=True)
            arrived = self.streams.record_side()
        self._reading[id(buffer)] = (buffer, arrived)  # the copy holds its source (let_go)
        return Upload(flat, arrived)

    def stage(self, layout: FragmentLayout, buffer: Buffer, upload: Upload | None = None) -> Staged:
        if upload is None:
            upload = self.prefetch(buffer)
            if upload is None:
                return Staged(layout.views(buffer))
        if upload.flat.numel() != layout.raw_bytes:
            raise ValueError(
                f"fragment {layout.index}: {upload.flat.numel()} bytes, the layout has {layout.raw_bytes}"
            )
        return Staged(byte_views(self.ready(upload), layout.manifest), upload.flat)

    def ready(self, upload: Upload) -> torch.Tensor:
        """The upload's slot, for the training stream's work queued from now on (which waits for
        the copy on the device, if it has not landed)."""
        if upload.arrived is not None:
            self.streams.main_waits(upload.arrived)
        return upload.flat

    def slot(self, size: int) -> torch.Tensor:
        """A device slot of `size` bytes, for bytes that arrive on the device (an island's
        broadcast); it goes back with done()."""
        return self.slots.take(size)

    def done(self, staged: Staged) -> None:
        if staged.flat is not None:
            self.slots.give(staged.flat, self.streams.record_main())

    def discard(self, upload: Upload) -> None:
        # Only the copy (side stream) has used it, unless it was readied for the training stream.
        self.slots.give(
            upload.flat, upload.arrived if upload.arrived is not None else self.streams.record_main()
        )

    def let_go(self, buffer: Buffer, release: Callable[[], None]) -> None:
        reading = self._reading.pop(id(buffer), None)
        self.holds.after(reading[1] if reading is not None and reading[0] is buffer else None, release)

    def settle(self) -> None:
        self.holds.settle()
        for key, (_buffer, event) in list(self._reading.items()):
            if event.query():
                del self._reading[key]

    def forget(self, buffer: Buffer) -> None:
        self.pins.unpin(buffer)

    def close(self) -> None:
        # Every copy done first: a copy to or from memory unregistered under it is undefined.
        self.streams.synchronize()
        self.holds.drain()
        self._reading.clear()
        self.pins.unpin_all()


def copier_for(device: torch.device) -> Copier:
    return DeviceCopier.for_cuda(device) if device.type == "cuda" else HostCopier()


# ----------------------------------------------------------------------------- step clock


class StepClock(Protocol):
    def start(self) -> None:
        """A step begins (on the host)."""
        ...

    def stop(self) -> float:
        """A step's work is queued: the seconds of the latest step measured."""
        ...


class HostClock:
    """The host's clock: on the CPU, a step's work is done when its call returns."""

    def __init__(self) -> None:
        self._started = time.monotonic()

    def start(self) -> None:
        self._started = time.monotonic()

    def stop(self) -> float:
        return time.monotonic() - self._started


class DeviceClock:
    """Wall time per step on a GPU, where the host runs ahead of the device and a step's call
    returns when its work is queued: an event at the end of every step on the training stream, and
    a step's time is the time between its end and the previous one's, read once both have
    completed, a step or so later. Until the first pair has, the host's time is reported."""

    def __init__(self, record: Callable[[], Event]) -> None:
        #: record(): a timing event at this point of the training stream.
        self._record = record
        self._ends: deque[Event] = deque()
        self._host = HostClock()
        self._latest: float | None = None

    @classmethod
    def for_cuda(cls, streams: CudaStreams) -> DeviceClock:
        return cls(lambda: streams.record_main(timing=True))

    def start(self) -> None:
        self._host.start()

    def stop(self) -> float:
        host = self._host.stop()
        self._ends.append(self._record())
        while len(self._ends) > MAX_PENDING_STEP_EVENTS:
            self._ends.popleft()
        while len(self._ends) >= 2 and self._ends[1].query():
            start = self._ends.popleft()
            self._latest = start.elapsed_time(self._ends[0]) / 1000.0
        return host if self._latest is None else self._latest


def clock_for(copier: Copier) -> StepClock:
    if isinstance(copier, DeviceCopier) and isinstance(copier.streams, CudaStreams):
        return DeviceClock.for_cuda(copier.streams)
    return HostClock()
