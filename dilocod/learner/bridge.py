"""The one thread boundary of the learner: bounded, lock-protected mailboxes between the training
loop (main thread) and the network (an event loop on its own thread).

Network to training: the plan, merged fragments to adopt (the newest per fragment replaces an older
one not yet applied), fragment requests (one per fragment), and a fatal error. The training thread
takes them all at a step boundary and never waits for them (except when told to: tau = 0, or the
first heal). Training to network: snapshots of requested fragments (one per fragment) and step
reports; the network loop is woken with call_soon_threadsafe, once per batch. Nothing here blocks
the training thread on the network. The mailbox's rules (Mailbox) are the network process's
bridge's too (dilocod.learner.netproc.ProcessBridge, on its side of the socket). Must not import
torch.

Fragment buffers have holders (dilocod.learner.buffers): an update is received straight into a
buffer of the bridge's pool (update_buffer), held by the mailbox until taken, then by the training
loop, which keeps it as the fragment's anchor until it has applied a newer version and gives it
back (release). A snapshot's buffer (snapshot_buffer) belongs to the network from send_snapshot on,
which also makes the snapshot a holder of its anchor, until the push no longer needs either
(snapshot_done): the outer gradient is computed in place in θ's buffer, from the anchor the
training side applied, with no copy of either (with a GPU's --anchors device the training side
computed it already: Snapshot.delta, no anchor). A buffer is reused only once nobody holds it, and
a dropped snapshot whose device copy still writes its buffer keeps it until the copy is done.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dilocod.learner.arena import Arena
from dilocod.learner.buffers import BufferPool, bytearray_buffer, mapped_buffer
from dilocod.wire.messages import FragmentRequest, Plan

#: Fragment bytes: a bytearray of this process, or a view of memory shared with the network process.
Buffer = bytearray | memoryview

#: Step reports kept for the network while it is away; older ones are dropped (the syncer only
#: uses them as a clock and a rate).
MAX_PENDING_STEPS = 10_000


class CopyInFlight(Protocol):
    """A device-to-host copy of a snapshot still running (CUDA): its buffer holds the fragment
    once done. The GPU runs behind the host, so the copy may finish only after the GPU has drained
    the step the host has already queued; waiting for it on the training thread stalls training."""

    def done(self) -> bool:
        """Whether the copy has finished; never blocks."""
        ...

    def wait(self) -> None:
        """Block until the copy has finished."""
        ...


@dataclass(frozen=True, slots=True)
class Adopt:
    """A merged fragment (wire layout, float32) to apply at the next step boundary."""

    fragment: int
    version: int
    buffer: Buffer
    #: From a (re)join: replaces the local fragment whatever the apply mode.
    heal: bool
    incarnation: str
    #: The update's bytes on their way to the training device, or there (learner.device.Upload:
    #: started when the training loop took it, or a GPU island's broadcast), applied from there;
    #: None: they are in `buffer` only.
    staged: Any = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A requested fragment as it was at a step boundary, for the network to turn into a push."""

    fragment: int
    round: int
    base_version: int
    c_steps: int
    c_tokens: int
    #: θ_p in wire layout (float32); the anchor is the buffer of the update last applied.
    theta: Buffer
    anchor: Buffer
    #: The device copy that fills theta, while it runs; None when theta is already complete.
    ready: CopyInFlight | None = None
    #: The learner's step at the snapshot, and how late (steps) it applied the fragment's last
    #: merge (None: not measured), for the push header.
    step: int | None = None
    apply_late: int | None = None
    #: theta holds δ = anchor - θ already, computed where the anchor lives (a GPU learner's
    #: --anchors device); anchor is then empty.
    delta: bool = False

    @property
    def empty(self) -> bool:
        """No step since the fragment's last push: answered with NOTHING_TO_PUSH, no bytes."""
        return self.c_steps == 0


@dataclass(frozen=True, slots=True)
class StepReportItem:
    step: int
    tokens: int
    step_time_s: float


@dataclass(slots=True)
class Inbox:
    plan: Plan | None = None
    updates: list[Adopt] = field(default_factory=list)
    requests: list[FragmentRequest] = field(default_factory=list)
    fatal: str | None = None
    #: Pushes the syncer never received whole: their session ended under them, or the syncer was
    #: away when they were made (Bridge.post_lost).
    lost: list[LostPush] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LostPush:
    """A push of this fragment for this round that never reached the syncer: the training side
    counts its steps again, in the fragment's next push (TrainingLoop._take)."""

    fragment: int
    round: int


def stale_under(plan: Plan, adopt: Adopt) -> bool:
    """Whether an update not yet applied means nothing under a new plan: it came from another
    syncer incarnation. One from the same incarnation (a session lost and joined again) is still
    that fragment's merged value, and a rejoin's JOIN counts it as held (Link._held)."""
    return adopt.incarnation != plan.incarnation


def newer_update(pending: Adopt | None, adopt: Adopt) -> Adopt | None:
    """What replaces a fragment's update not yet applied when another arrives: the newer one (or a
    heal, whatever its version), still a heal if either was; None when the arrival is older."""
    if pending is None:
        return adopt
    if pending.version > adopt.version and not adopt.heal:
        return None
    heal = adopt.heal or pending.heal
    return Adopt(adopt.fragment, adopt.version, adopt.buffer, heal, adopt.incarnation, adopt.staged)


class Mailbox:
    """What the network posted and the training loop has not taken yet, under the rules both
    bridges apply (Bridge here, the network process's ProcessBridge on its side of the socket):
    the newest update per fragment (newer_update), one request per fragment, a new plan clearing
    the requests and the updates it makes stale (stale_under), the fatal error kept. Plain data:
    the caller locks, and lets go of the buffers of the updates it is told will never be taken."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.updates: dict[int, Adopt] = {}
        self.requests: dict[int, FragmentRequest] = {}
        self.fatal: str | None = None
        self.lost: list[LostPush] = []

    def post_plan(self, plan: Plan) -> list[Adopt]:
        """A new session's plan; the updates it makes stale, which will never be taken."""
        self.plan = plan
        # Requests of an older session mean nothing under the new one; its updates do when they
        # come from the same syncer incarnation (a rejoin's JOIN says it holds them).
        dropped = [adopt for adopt in self.updates.values() if stale_under(plan, adopt)]
        for adopt in dropped:
            del self.updates[adopt.fragment]
        self.requests.clear()
        return dropped

    def post_update(self, adopt: Adopt) -> Adopt | None:
        """An update; the one that waits no more (the older one replaced, or this one refused)."""
        pending = self.updates.get(adopt.fragment)
        kept = newer_update(pending, adopt)
        if kept is None:
            return adopt
        self.updates[adopt.fragment] = kept
        return pending if pending is not None and pending.buffer is not kept.buffer else None

    def take(self) -> Inbox:
        """Everything posted since the last take, by fragment; the fatal error stays."""
        inbox = Inbox(
            self.plan,
            [self.updates.pop(k) for k in sorted(self.updates)],
            [self.requests.pop(k) for k in sorted(self.requests)],
            self.fatal,
            self.lost,
        )
        self.plan = None
        self.lost = []
        return inbox

    @property
    def idle(self) -> bool:
        """Nothing a waiting training loop would wake for (lost pushes wait for a boundary)."""
        return self.plan is None and not self.updates and not self.requests and self.fatal is None


class TrainingSide(Protocol):
    """What the training loop calls on its bridge, whether the network is a thread (Bridge) or a
    process (dilocod.learner.netproc.ProcessBridge). None of it waits, but wait()."""

    def take(self) -> Inbox: ...
    def wait(self, timeout_s: float) -> None: ...
    def snapshot_buffer(self, size: int) -> Buffer: ...
    def send_snapshot(self, snapshot: Snapshot, *, wake: bool = True) -> None: ...
    def report_step(self, item: StepReportItem, *, wake: bool = True) -> None: ...
    def flush(self) -> None: ...
    def release(self, buffer: Buffer) -> None: ...


class Bridge:
    def __init__(
        self,
        arena: Arena | None = None,
        *,
        page_aligned: bool = False,
        on_discard: Callable[[Buffer], None] | None = None,
    ) -> None:
        #: Where the fragments' first anchors are cut from (memory faulted in at start), if anywhere.
        self.arena = arena
        #: Buffers in mappings of their own (whole pages): a GPU page-locks them (learner.device).
        self._make: Callable[[int, int], memoryview] = mapped_buffer if page_aligned else bytearray_buffer
        #: Called with a buffer the pool forgets (update_failed): its memory may be unpinned.
        self.on_discard = on_discard
        #: Update and snapshot buffers, by size (the network process's bridge lends shared memory
        #: instead, its own pools).
        self.pool = BufferPool(self._local_buffer)
        self._lock = threading.Lock()
        self._posted = threading.Condition(self._lock)
        self._mailbox = Mailbox()
        self._snapshots: dict[int, Snapshot] = {}
        self._steps: deque[StepReportItem] = deque(maxlen=MAX_PENDING_STEPS)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_outbox: Callable[[], None] | None = None
        self._wake_scheduled = False
        #: Snapshots dropped while their device copy still wrote θ: let go of once it is done.
        self._copying: list[Snapshot] = []

    # ------------------------------------------------------------------ network side

    def attach(self, loop: asyncio.AbstractEventLoop, on_outbox: Callable[[], None]) -> None:
        with self._lock:
            self._loop, self._on_outbox = loop, on_outbox

    def _local_buffer(self, bid: int, size: int) -> memoryview:
        """The pool's make: a piece of the arena for an anchor it expects, else a bytearray."""
        piece = None if self.arena is None else self.arena.take(size)
        return self._make(bid, size) if piece is None else piece[1]

    def expect_anchors(self, sizes: list[int]) -> None:
        """A new plan's fragment sizes (float32): what the arena may serve as their anchors."""
        if self.arena is not None:
            self.arena.expect(sizes)

    def update_buffer(self, size: int) -> memoryview:
        """Where an update stream of `size` bytes is received (the session's allocator): held by
        the network until it posts the update (or update_failed)."""
        return self.pool.acquire(size).view

    def update_failed(self, buffer: Buffer) -> None:
        """An update stream that failed after update_buffer: its buffer may still be written (a
        decompression running), so it is never reused."""
        bid = self.pool.id_of(buffer)
        if bid is not None:
            self.pool.discard(bid)
            if self.on_discard is not None:
                self.on_discard(buffer)

    def post_plan(self, plan: Plan) -> None:
        with self._posted:
            dropped = self._mailbox.post_plan(plan)
            self._posted.notify_all()
        for adopt in dropped:
            self._drop_update(adopt)

    def post_update(self, adopt: Adopt) -> None:
        """Hand an update (and the buffer it was received in) to the training side."""
        with self._posted:
            gone = self._mailbox.post_update(adopt)
            self._posted.notify_all()
        # The update that waits no more (the older one, replaced or refused) lets go of its buffer.
        if gone is not None:
            self._drop_update(gone)

    def _drop_update(self, adopt: Adopt) -> None:
        """An update the training side will never see: its buffer goes back."""
        self.release(adopt.buffer)

    def snapshot_done(self, snapshot: Snapshot) -> None:
        """The push no longer needs the snapshot's θ and anchor (it is sent, refused, or dropped).
        One dropped while its device copy still writes θ (replaced before the network took it)
        keeps both until the copy is done: its buffer is not reused under the copy."""
        if snapshot.ready is not None and not snapshot.ready.done():
            with self._lock:
                self._copying.append(snapshot)
            return
        self.release(snapshot.theta)
        self.release(snapshot.anchor)

    def _settle_copies(self) -> None:
        """Let go of the dropped snapshots whose device copies are done (never waits)."""
        with self._lock:
            copying, self._copying = self._copying, []
        for snapshot in copying:
            self.snapshot_done(snapshot)

    @property
    def copying(self) -> int:
        """Dropped snapshots whose device copies have not finished yet."""
        with self._lock:
            return len(self._copying)

    def post_request(self, request: FragmentRequest) -> None:
        with self._posted:
            self._mailbox.requests[request.fragment] = request
            self._posted.notify_all()

    def post_fatal(self, message: str) -> None:
        with self._posted:
            self._mailbox.fatal = message
            self._posted.notify_all()

    def post_lost(self, lost: LostPush) -> None:
        """A push that never reached the syncer whole (see LostPush)."""
        with self._posted:
            self._mailbox.lost.append(lost)

    def drain(self) -> tuple[list[Snapshot], list[StepReportItem]]:
        if self._copying:
            self._settle_copies()
        with self._lock:
            snapshots = [self._snapshots.pop(k) for k in sorted(self._snapshots)]
            steps = list(self._steps)
            self._steps.clear()
            self._wake_scheduled = False
        return snapshots, steps

    # ------------------------------------------------------------------ training side

    def take(self) -> Inbox:
        """Everything the network posted since the last call (never waits)."""
        with self._lock:
            return self._mailbox.take()

    def wait(self, timeout_s: float) -> None:
        """Block until the network posts something or timeout_s passes (tau = 0, first heal)."""
        with self._posted:
            if self._mailbox.idle:
                self._posted.wait(timeout_s)

    def snapshot_buffer(self, size: int) -> memoryview:
        """Where the training loop copies a requested fragment for its snapshot (the network's
        from send_snapshot on)."""
        return self.pool.acquire(size).view

    def send_snapshot(self, snapshot: Snapshot, *, wake: bool = True) -> None:
        # The push reads the anchor after the training side may have replaced it.
        self.hold(snapshot.anchor)
        with self._lock:
            replaced = self._snapshots.get(snapshot.fragment)
            self._snapshots[snapshot.fragment] = snapshot
        if replaced is not None:
            self.snapshot_done(replaced)
        if self._copying:
            self._settle_copies()
        if wake:
            self._wake()

    def hold(self, buffer: Buffer) -> None:
        """One more holder of one of the pool's buffers (nothing for other memory)."""
        bid = self.pool.id_of(buffer)
        if bid is not None:
            self.pool.hold(bid)

    def release(self, buffer: Buffer) -> None:
        """One holder fewer of one of the pool's buffers (nothing for other memory): the training
        loop's anchor replaced, an update it will not apply, a push done."""
        bid = self.pool.id_of(buffer)
        if bid is not None:
            self.pool.release(bid)

    def report_step(self, item: StepReportItem, *, wake: bool = True) -> None:
        with self._lock:
            self._steps.append(item)
        if wake:
            self._wake()

    def flush(self) -> None:
        """Wake the network for whatever was queued with wake=False (once)."""
        with self._lock:
            queued = bool(self._snapshots or self._steps)
        if queued:
            self._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._wake_scheduled or self._loop is None or self._on_outbox is None:
                return
            self._wake_scheduled = True
            loop, callback = self._loop, self._on_outbox
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the network loop has closed: nothing will read the outbox
            with self._lock:
                self._wake_scheduled = False
