"""The learner's network in a process of its own (`--network process`, the default): the training
side's half, the ProcessBridge the training loop calls and the reader of the child's statistics.

The Link (sessions with the syncer, pushes, updates, reconnects) and its event loop run in a child
process (dilocod.learner.netchild), so that neither their CPU time nor their hold on the GIL lands
on the training thread: on a learner host with a core to spare, the step pays only the boundary's
own work (two fragment copies and a few small messages). In a thread (`--network thread`) the same
link shares the training process's GIL, and every frame it parses can make a torch call of the
step wait.

Two AF_UNIX SOCK_SEQPACKET socketpairs join the processes (dilocod.learner.channel frames them):
- data: child to parent the inbox (InboxNote: plan, merged fragments, requests, lost pushes, a
  fatal error; ReleaseNote), parent to child the configuration first (ConfigNote), then the outbox
  (OutboxNote: step reports, snapshots of requested fragments; NewBuffersNote). The
  training thread touches it only at step boundaries and never waits on it (except where the
  runtime waits anyway: the first heal, tau = 0).
- side: the child's link statistics (StatsNote) once a second, read by a small thread of the
  parent for progress and STATUS lines and for the watchdog (a child whose loop stalls stops the
  pings).

The training side reads the data socket at each boundary, to its end (which also shows a peer that
has gone): one non-blocking recvmsg when nothing came, 2-3 µs. Three devices once saved the
training thread microseconds at its boundary and are gone, because none paid at the steps of 100 ms
and more this is for (bench/notes/network-process-polling.md): a page of sent counts both
processes mapped, to skip that empty read (2-3 µs); the child reading its socket on a 1 ms timer,
so that the boundary's send never woke a process (8-10 µs a send, for 0.6-0.9 % of the child's
core at a 100 ms step); and holding what arrived in a step's first half for one datagram at
half-step (one read and decode, about 30 µs).

Fragment bytes sit in memory both processes map (dilocod.learner.channel). Each fragment's anchor
exists once, in the child's memory:
- an update is received from the syncer straight into a buffer the child lends (the session's
  allocator); the parent applies it and keeps it as the fragment's anchor, and gives it back (in
  a boundary's outbox, so a boundary sends one datagram) once the runtime has applied a newer
  version of the fragment or drops the update unapplied. The child holds it too while a push
  computes an outer gradient from it; it is reused only when neither side holds it;
- a snapshot is copied by the training thread into a buffer the parent lends; the snapshot's
  note names that buffer and its anchor's. The child's push worker writes δ = anchor - θ over θ
  in that same buffer, sends it, and gives the buffer back once the push is done, with its next
  inbox message (so the training side reads one datagram fewer) or alone a moment later.
  With a GPU's --anchors device the anchors are on the GPU instead: the training thread copies
  out δ itself, the note names no anchor (DELTA_IN_THETA), and the child sends the bytes as they
  are; an update's buffer goes back once its copy to the GPU has landed.
Beyond the anchors, the buffers in use are the updates not yet applied and the snapshots whose
pushes are under way: about tau + 2 fragments.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from dilocod.learner.arena import Arena
from dilocod.learner.bridge import Adopt, Buffer, Inbox, Mailbox, Snapshot, StepReportItem
from dilocod.learner.buffers import BufferOwnershipError
from dilocod.learner.channel import Channel, Lender, Mapper, NetworkProcessError, read_note
from dilocod.learner.ipc import (
    DELTA_IN_THETA,
    NO_ANCHOR,
    NO_BUFFER,
    ConfigNote,
    InboxNote,
    IpcError,
    NewBuffer,
    NewBuffersNote,
    OutboxNote,
    ReleaseNote,
    SnapshotNote,
    StatsNote,
    note_from_wire,
)
from dilocod.wire.manifest import ModelEntry

log = structlog.get_logger("dilocod.learner")

STOP_TIMEOUT_S = 30.0


class ProcessBridge:
    """The training loop's Bridge when the network is a child process: the same calls (take, wait,
    send_snapshot, report_step, flush), all non-blocking but wait()."""

    def __init__(self) -> None:
        data, self._child_data = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.channel = Channel(data)
        self.process: subprocess.Popen[bytes] | None = None
        self._mapper = Mapper()
        self._lender = Lender()
        #: The inbox's control, under Bridge's rules; its updates' buffers are in _views.
        self._mailbox = Mailbox()
        #: The child's update buffers this side holds (the mailbox, the runtime, snapshots not yet
        #: sent that name them as anchor): buffer id -> holders; and id(view) -> (buffer id, view)
        #: for the views handed to the runtime (the view is kept, so its id stays its own).
        self._holders: dict[int, int] = {}
        self._views: dict[int, tuple[int, memoryview]] = {}
        #: The child's buffers to give back: they go with the boundary's outbox (one datagram, one
        #: sendmsg per boundary instead of two; a sendmsg is 30 µs of the training thread's time).
        self._releases: list[int] = []
        self._steps: list[StepReportItem] = []
        self._snapshots: list[Snapshot] = []
        self._lent_views: dict[int, tuple[int, memoryview]] = {}  # id(view) -> (buffer id, view)
        self.closed = False

    # -- what the runtime calls

    def take(self) -> Inbox:
        self._pump()
        # The mailbox's hold on an update's buffer becomes the runtime's (release gives it back).
        return self._mailbox.take()

    def release(self, buffer: Buffer) -> None:
        """The runtime no longer reads an update's buffer (its anchor replaced, or the update not
        applied): given back with the boundary's outbox, unless a snapshot not sent yet names it."""
        held = self._views.get(id(buffer))
        if held is not None and held[1] is buffer:
            self._let_go(held[0])

    def _hold(self, bid: int) -> None:
        self._holders[bid] = self._holders.get(bid, 0) + 1

    def _let_go(self, bid: int) -> None:
        holders = self._holders.get(bid, 0) - 1
        if holders < 0:
            raise BufferOwnershipError(f"the network process's buffer {bid} let go of, but not held")
        if holders:
            self._holders[bid] = holders
            return
        del self._holders[bid]
        for key, (held, _view) in list(self._views.items()):
            if held == bid:
                del self._views[key]
        self._releases.append(bid)

    def _anchor_id(self, anchor: Buffer) -> int:
        """The child's buffer id of a snapshot's anchor (-1: not one of its buffers)."""
        held = self._views.get(id(anchor))
        return held[0] if held is not None and held[1] is anchor else -1

    def wait(self, timeout_s: float) -> None:
        """Block until the child sends something or timeout_s passes (tau = 0, the first heal)."""
        if self._mailbox.idle:
            select.select([self.channel.sock], [], [], max(0.0, timeout_s))  # read at the next take

    def snapshot_buffer(self, size: int) -> memoryview:
        """Where the runtime copies a requested fragment: a buffer the child maps."""
        bid, view, fd = self._lender.borrow(size)
        if fd is not None:
            self.channel.queue(NewBuffersNote((NewBuffer(bid, size),)).to_wire(), [fd])
        self._lent_views[id(view)] = (bid, view)
        return view

    def send_snapshot(self, snapshot: Snapshot, *, wake: bool = True) -> None:
        anchor = self._anchor_id(snapshot.anchor)
        if anchor >= 0:
            self._hold(anchor)  # until the note naming it is queued (a deferred copy may wait)
        self._snapshots.append(snapshot)
        if wake:
            self.flush()

    def report_step(self, item: StepReportItem, *, wake: bool = True) -> None:
        self._steps.append(item)
        if wake:
            self.flush()

    def flush(self, *, wait: bool = False) -> None:
        """Hand the child what the boundary queued. A snapshot whose device copy is still running
        stays for the next boundary (a step later, within tau) unless `wait`: the training thread
        must not wait for the GPU to drain the step it has just queued."""
        snapshots, self._snapshots = self._snapshots, []
        notes: list[SnapshotNote] = []
        noted: list[int] = []  # anchors named by the notes: let go of once the notes are queued
        for snapshot in snapshots:
            if snapshot.empty:
                # NOTHING_TO_PUSH: no bytes travel, no buffer is lent.
                notes.append(SnapshotNote.of(snapshot, NO_BUFFER, NO_ANCHOR))
                continue
            if snapshot.ready is not None and not snapshot.ready.done():
                if not wait:
                    self._snapshots.append(snapshot)
                    continue
                snapshot.ready.wait()
            lent = self._lent_views.pop(id(snapshot.theta), None)
            if lent is None:  # not copied into a lent buffer: copy it into one now
                view = self.snapshot_buffer(len(snapshot.theta))
                view[:] = snapshot.theta
                lent = self._lent_views.pop(id(view))
            bid = lent[0]
            anchor = DELTA_IN_THETA if snapshot.delta else self._anchor_id(snapshot.anchor)
            if anchor >= 0:
                noted.append(anchor)
            notes.append(SnapshotNote.of(snapshot, bid, anchor))
        for anchor in noted:
            # The child reads the notes before the releases of the same message: it holds the
            # anchor from its note on, whatever this side gives back now.
            self._let_go(anchor)
        if notes or self._steps or self._releases:
            outbox = OutboxNote(tuple(self._steps), tuple(notes), tuple(self._releases))
            self._steps, self._releases = [], []
            self.channel.queue(outbox.to_wire())
        self._send()

    # -- the socket

    def _send(self) -> None:
        try:
            self.channel.send()
        except NetworkProcessError as exc:
            self._died(str(exc))

    def _pump(self) -> None:
        self._send()
        try:
            messages = self.channel.receive()
        except NetworkProcessError as exc:
            self._died(str(exc))
            return
        for raw, fds in messages:
            note = read_note(raw, fds, self._mapper, "the network process's message")
            if isinstance(note, InboxNote):
                self._on_inbox(note)
            elif isinstance(note, ReleaseNote):
                for bid in note.released:
                    self._lender.give_back(bid)
            else:
                raise NetworkProcessError(f"the network process sent a {note.KIND} note")

    def _on_inbox(self, note: InboxNote) -> None:
        control = note.control
        for bid in note.released:
            self._lender.give_back(bid)
        if control.plan is not None:
            for dropped in self._mailbox.post_plan(control.plan):
                self.release(dropped.buffer)
        for update, bid in zip(control.updates, note.buffers, strict=True):
            view = self._mapper.view(bid, update.nbytes)
            if bid in self._holders:
                raise NetworkProcessError(f"buffer {bid} lent again while this side still holds it")
            self._hold(bid)  # the mailbox's, then the runtime's
            self._views[id(view)] = (bid, view)
            gone = self._mailbox.post_update(
                Adopt(update.fragment, update.version, view, update.heal, update.incarnation)
            )
            if gone is not None:  # the older update replaced, or this one refused
                self.release(gone.buffer)
        for request in control.requests:
            self._mailbox.requests[request.fragment] = request
        self._mailbox.lost.extend(control.lost)
        if control.fatal is not None:
            self._mailbox.fatal = control.fatal

    def _died(self, why: str) -> None:
        status = None if self.process is None else self.process.poll()
        raise NetworkProcessError(f"the learner's network process stopped ({why}; exit status {status})")

    def spawn(self, config: ConfigNote, side: socket.socket, arena: Arena | None = None) -> None:
        """Start the child on the other ends of the sockets and hand it its configuration, and the
        anchors' arena (a shared one, populated) to cut the first anchors from."""
        command = [sys.executable, "-m", "dilocod.learner.netchild"]
        fds: tuple[int, ...] = (self._child_data.fileno(), side.fileno())
        command += ["--data-fd", str(fds[0]), "--side-fd", str(fds[1])]
        if arena is not None and arena.fd is not None:
            fds += (arena.fd,)
            command += ["--arena-fd", str(arena.fd), "--arena-bytes", str(arena.size)]
            self._mapper.arena = arena
        try:
            self.process = subprocess.Popen(command, pass_fds=fds)
        finally:
            self._child_data.close()
            side.close()
            if arena is not None:
                arena.close()  # the child has its own descriptor; the mapping stays
        self.channel.queue(config.to_wire())
        self._send()

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Tell the child to stop (EOF on its data socket) and wait for it; its exit status."""
        if self.closed:
            return None if self.process is None else self.process.returncode
        self.closed = True
        with contextlib.suppress(OSError):
            if self._snapshots:
                self.flush(wait=True)  # the last boundary's deferred pushes still go
            self.channel.send()
        with contextlib.suppress(OSError):
            self.channel.sock.shutdown(socket.SHUT_RDWR)
        self.channel.sock.close()
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the network process did not stop in time: killed", timeout_s=timeout_s)
            self.process.kill()
            return self.process.wait()


@dataclass(slots=True)
class SideReader:
    """The parent's view of the child's statistics (the side socket), read on an event loop."""

    sock: socket.socket
    stats: dict[str, Any] = field(default_factory=dict)
    last_heard: float = field(default_factory=time.monotonic)
    #: Set once the child has closed its end (after its last statistics).
    finished: threading.Event = field(default_factory=threading.Event)

    async def run(self, stop: asyncio.Event) -> None:
        channel = Channel(self.sock)
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        loop.add_reader(self.sock.fileno(), readable.set)
        try:
            while not stop.is_set():
                waiter = asyncio.ensure_future(readable.wait())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                stopper.cancel()
                readable.clear()
                try:
                    messages = channel.receive()
                except NetworkProcessError:
                    self.finished.set()
                    return  # the child is gone: the training side reports it
                for raw, fds in messages:
                    for fd in fds:
                        os.close(fd)
                    try:
                        note = note_from_wire(raw)
                    except IpcError as exc:
                        log.error("the network process's statistics cannot be read", error=str(exc))
                        self.finished.set()
                        return
                    if isinstance(note, StatsNote):
                        self.stats = note.stats
                        self.last_heard = time.monotonic()
        finally:
            loop.remove_reader(self.sock.fileno())

    def alive(self, limit_s: float) -> bool:
        return time.monotonic() - self.last_heard < limit_s


def open_network_process() -> tuple[ProcessBridge, SideReader, socket.socket]:
    """The parent's ends (the bridge, the statistics reader) and the child's side socket; the child
    starts with bridge.spawn(config, side) once the configuration is complete."""
    side_parent, side_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return ProcessBridge(), SideReader(side_parent), side_child


# ----------------------------------------------------------------------------- the child's side


def encode_config(link: Any, model: Sequence[ModelEntry], incarnation: str, use_uvloop: bool) -> ConfigNote:
    """The child's configuration note, generated from the LinkConfig dataclass (a new field
    travels without a word here; the TLS context is rebuilt from its files)."""
    from dilocod.tuning.advice import advice_to_json  # noqa: PLC0415

    # Every field of the LinkConfig as it is, but the three that are not plain values: the TLS
    # context (the child makes its own from the files), the files (as strings) and the advice.
    values = {
        field.name: getattr(link, field.name)
        for field in dataclasses.fields(link)
        if field.name not in ("tls", "tls_files", "advice")
    }
    return ConfigNote(
        values,
        None if link.tls_files is None else tuple(str(p) for p in link.tls_files),
        None if link.advice is None else advice_to_json(link.advice),
        tuple(model),
        incarnation,
        use_uvloop,
    )
