"""The learner's network in a process of its own (`--network process`, the default).

The Link (sessions with the syncer, pushes, updates, reconnects) and its event loop run in a child
process, so that neither their CPU time nor their hold on the GIL lands on the training thread: on
a learner host with a core to spare, the step pays only the boundary's own work (two fragment
copies and a few small messages). In a thread (`--network thread`) the same link shares the
training process's GIL, and every frame it parses can make a torch call of the step wait.

Two AF_UNIX SOCK_SEQPACKET socketpairs join the processes:
- data: child to parent the inbox (InboxNote: plan, merged fragments, requests, lost pushes, a
  fatal error; ReleaseNote), parent to child the configuration first (ConfigNote), then the outbox
  (OutboxNote: step reports, snapshots of requested fragments; NewBuffersNote). The
  training thread touches it only at step boundaries and never waits on it (except where the
  runtime waits anyway: the first heal, tau = 0). The child waits on it in its event loop like
  on any other socket, and forwards what the Link posts once per turn of its loop: one datagram
  for what arrived together, and nothing held back.
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

Every message is one small msgpack datagram, a note of dilocod.learner.ipc: a frozen dataclass
encoded by its to_wire and read back by a validating decoder, so that a note that is not what its
kind says is a NetworkProcessError naming the note and the field (this module reads no field of a
decoded map itself; Channel only frames them). Fragment bytes never go through a socket, and are
never copied between the processes: they sit in memory both map (memfd buffers, lent by the side that
writes them, their descriptors passed once with SCM_RIGHTS, reused once nobody holds them; see
dilocod.learner.buffers). Each fragment's anchor exists once, in the child's memory:
- an update is received from the syncer straight into a buffer the child lends (the session's
  allocator); the parent applies it and keeps it as the fragment's anchor, and gives it back (in
  a boundary's outbox, so a boundary sends one datagram) once the runtime has applied a newer
  version of the fragment or drops the update unapplied. The child holds it too while a push
  computes an outer gradient from it; it is reused only when neither side holds it;
- a snapshot is copied by the training thread into a buffer the parent lends; the snapshot's
  note names that buffer and its anchor's. The child's push worker writes δ = anchor - θ over θ
  in that same buffer, sends it, and gives the buffer back once the push is done, with its next
  inbox message (so the training side reads one datagram fewer) or alone RELEASE_DELAY_S later.
  With a GPU's --anchors device the anchors are on the GPU instead: the training thread copies
  out δ itself, the note names no anchor (DELTA_IN_THETA), and the child sends the bytes as they
  are; an update's buffer goes back once its copy to the GPU has landed.
Beyond the anchors, the buffers in use are the updates not yet applied and the snapshots whose
pushes are under way: about tau + 2 fragments.

The child imports no torch when pushes travel as fp32 (the default): δ is numpy's (see
dilocod.learner.delta), and nothing on its import path (this module, the Link, the transport,
dilocod.learner.plancheck) imports torch at module level; a lossy --precision imports it for the
encoding, at the child's start. torch would add about 200 MiB of memory the training process shares none of.

The child ignores SIGINT and SIGTERM: it stops when the parent closes the data socket (after the
training loop's last boundary) or dies, says goodbye to the syncer, and exits.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import itertools
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import structlog

from dilocod.learner.arena import Arena
from dilocod.learner.bridge import (
    Adopt,
    Bridge,
    Buffer,
    Inbox,
    LostPush,
    Mailbox,
    Snapshot,
    StepReportItem,
)
from dilocod.learner.buffers import BufferOwnershipError, BufferPool
from dilocod.learner.control import Control
from dilocod.learner.delta import import_encoder
from dilocod.learner.ipc import (
    DELTA_IN_THETA,
    NO_ANCHOR,
    NO_BUFFER,
    ConfigNote,
    InboxNote,
    IpcError,
    NewBuffer,
    NewBuffersNote,
    Note,
    OutboxNote,
    ReleaseNote,
    SnapshotNote,
    StatsNote,
    note_from_wire,
)
from dilocod.wire.manifest import ModelEntry

log = structlog.get_logger("dilocod.learner")

#: One datagram; large messages (a plan of a model with many tensors) travel in a lent buffer.
MAX_DATAGRAM_BYTES = 32 * 1024
#: Descriptors per datagram (the kernel's SCM_MAX_FD is 253).
MAX_FDS = 200
STATS_EVERY_S = 1.0
#: How long the child holds the snapshot buffers it gives back, waiting for an inbox message to
#: carry them (each datagram the training thread reads costs it a cold recvmsg and a decode). The
#: training side borrows a new buffer when none of a size is free, so this delays nothing.
RELEASE_DELAY_S = 0.05
STOP_TIMEOUT_S = 30.0
CONFIG_TIMEOUT_S = 30.0
#: recvmsg's arguments, computed once: the flags are IntFlag members, whose arithmetic runs Python
#: code on every message at the training thread's boundary.
_CUT_SHORT = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


class NetworkProcessError(RuntimeError):
    """The network process is gone or spoke out of turn; the learner cannot sync without it."""


class PeerClosedError(NetworkProcessError):
    """The other process closed its end of the data socket (it stopped, or died)."""


# ----------------------------------------------------------------------------- lent buffers


def _shared_memory(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A new memfd of `size` bytes (at least one) and this process's mapping of it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, max(size, 1))
    return fd, mmap.mmap(fd, max(size, 1))


class Lender:
    """Buffers this side writes and the other side maps: memfd-backed, reused once given back."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._sizes: dict[int, int] = {}
        self._free: dict[int, list[int]] = {}
        self._ids = itertools.count(1)
        self.lent = 0

    def borrow(self, size: int) -> tuple[int, memoryview, int | None]:
        """(id, a writable view of `size` bytes, the descriptor to pass when the buffer is new)."""
        free = self._free.get(size)
        fd = None
        if free:
            bid = free.pop()
        else:
            bid = next(self._ids)
            fd, self._maps[bid] = _shared_memory(f"dilocod-{bid}", size)
            self._sizes[bid] = size
        self.lent += 1
        return bid, memoryview(self._maps[bid])[:size], fd

    def give_back(self, bid: int) -> None:
        if bid not in self._sizes:
            raise NetworkProcessError(f"buffer {bid} given back, but it was never lent")
        self._free.setdefault(self._sizes[bid], []).append(bid)
        self.lent -= 1


class Mapper:
    """The other side's buffers, mapped once each by id, and the pieces it cut from the anchors'
    arena (this side's, when it has one)."""

    def __init__(self, arena: Arena | None = None) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self.arena = arena
        self._pieces: dict[int, memoryview] = {}

    def add(self, bid: int, fd: int, size: int) -> None:
        try:
            self._maps[bid] = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)

    def add_piece(self, bid: int, size: int, offset: int) -> None:
        """Buffer `bid` is the piece of the anchors' arena (ours, mapped already) at `offset`."""
        if self.arena is None:
            raise NetworkProcessError(f"buffer {bid} passed as a piece of an arena this side has not got")
        try:
            self._pieces[bid] = self.arena.view(offset, size)
        except ValueError as exc:
            raise NetworkProcessError(f"buffer {bid}: {exc}") from None

    def view(self, bid: int, size: int) -> memoryview:
        piece = self._pieces.get(bid)
        if piece is not None and len(piece) == size:
            return piece
        buffer = self._maps.get(bid)
        if buffer is None or len(buffer) < size:
            raise NetworkProcessError(f"buffer {bid} of {size} bytes was never passed")
        return memoryview(buffer)[:size]


# ----------------------------------------------------------------------------- datagrams


class Channel:
    """One end of a SEQPACKET socket: messages out without ever blocking (what the socket cannot
    take now waits here for the next send()), messages in as they are there."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._out: deque[tuple[bytes, list[int]]] = deque()
        self._eof = False

    def queue(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        body = msgpack.packb(message, use_bin_type=True)
        if len(body) > MAX_DATAGRAM_BYTES:
            raise NetworkProcessError(f"a {message.get('k')} message of {len(body)} bytes does not fit")
        self._out.append((body, list(fds)))

    def send(self) -> bool:
        """Send what the socket takes now; True when nothing is left queued."""
        while self._out:
            body, fds = self._out[0]
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            try:
                self.sock.sendmsg([body], ancillary)
            except BlockingIOError:
                return False
            except OSError as exc:
                raise NetworkProcessError(f"the other process is gone: {exc}") from None
            for fd in fds:
                os.close(fd)  # the other side holds its own copy of the descriptor now
            self._out.popleft()
        return True

    def receive(self) -> list[tuple[dict[str, Any], list[int]]]:
        """Every message the socket holds now, with the descriptors that came with it."""
        out: list[tuple[dict[str, Any], list[int]]] = []
        if self._eof:
            raise PeerClosedError("the other process closed its end")
        reset = False
        while True:
            try:
                body, ancillary, flags, _ = self.sock.recvmsg(MAX_DATAGRAM_BYTES, _ANCILLARY_BYTES)
            except BlockingIOError:
                return out
            except ConnectionResetError:
                # The other end closed with datagrams of ours unread in its queue, as a routine stop
                # does (the training side closes after its last boundary, whatever the child sent
                # since). The kernel reports that once, before what the other end sent us: read on,
                # to those datagrams and then the end (EOF).
                if reset:
                    raise PeerClosedError("the other process closed its end") from None
                reset = True
                continue
            except OSError as exc:
                raise NetworkProcessError(f"the other process is gone: {exc}") from None
            if not body:
                self._eof = True  # what came before the end is handed out first
                if out:
                    return out
                raise PeerClosedError("the other process closed its end")
            fds: list[int] = []
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
            if flags & _CUT_SHORT:
                for fd in fds:
                    os.close(fd)
                raise NetworkProcessError("a message from the other process was cut short")
            try:
                message = msgpack.unpackb(body, raw=False, strict_map_key=True)
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
                raise NetworkProcessError(f"an unreadable message from the other process: {exc}") from None
            if not isinstance(message, dict):  # what kind of note it is, dilocod.learner.ipc reads
                raise NetworkProcessError("a message from the other process that is not a map")
            out.append((message, fds))


def _read(raw: dict[str, Any], fds: list[int], mapper: Mapper, sender: str) -> Note:
    """A message as its note (dilocod.learner.ipc), the buffers it introduces mapped; one that is
    not what its kind says is a NetworkProcessError naming the note and the field, and the
    descriptors that came with it are closed."""
    try:
        note = note_from_wire(raw)
    except IpcError as exc:
        for fd in fds:
            os.close(fd)
        raise NetworkProcessError(f"{sender}: {exc}") from None
    _take_fds(note.new, fds, mapper)
    return note


def _take_fds(new: Sequence[NewBuffer], fds: list[int], mapper: Mapper) -> None:
    """Map the buffers a note introduces: one descriptor each, in order, but for the pieces of the
    anchors' arena (an offset), which need none."""
    owned = [buffer for buffer in new if buffer.offset is None]
    if len(owned) != len(fds):
        for fd in fds:
            os.close(fd)
        raise NetworkProcessError(f"{len(new)} new buffers announced, {len(fds)} descriptors passed")
    for buffer, fd in zip(owned, fds, strict=True):
        mapper.add(buffer.buffer, fd, buffer.size)
    for buffer in new:
        if buffer.offset is not None:
            mapper.add_piece(buffer.buffer, buffer.size, buffer.offset)


# ----------------------------------------------------------------------------- the parent's side


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
            note = _read(raw, fds, self._mapper, "the network process's message")
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
        command = [sys.executable, "-m", "dilocod.learner.netproc"]
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


class ChildBridge(Bridge):
    """The Link's Bridge in the child: what the Link posts is forwarded to the parent (once per
    turn of the loop), what the parent sends is handed to the Link as snapshots and step reports.

    Its pool's buffers are shared memory the parent maps: the Link receives updates into them,
    and the parent holds each one it was sent until it gives it back ("release" in its outbox)."""

    def __init__(self, channel: Channel, arena: Arena | None = None) -> None:
        super().__init__(arena)
        self.channel = channel
        self._mapper = Mapper()
        #: This side's buffers' mappings and the descriptors not yet passed to the parent, and the
        #: offsets of the arena's pieces not yet passed.
        self._maps: dict[int, mmap.mmap] = {}
        self._unsent_fds: dict[int, int] = {}
        self._offsets: dict[int, int] = {}
        self.pool = BufferPool(self._shared_buffer)
        #: id(θ view) -> (the parent's buffer id, the view) for the snapshots the Link holds.
        self._thetas: dict[int, tuple[int, memoryview]] = {}
        #: The forward scheduled for the loop's next turn (what is posted before it shares its datagram).
        self._forward_handle: asyncio.Handle | None = None
        #: The training side's snapshot buffers, pushed and waiting to be given back with the
        #: next inbox message (or alone, RELEASE_DELAY_S after the first of them).
        self._releases: list[int] = []
        self._release_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = asyncio.Event()

    def _shared_buffer(self, bid: int, size: int) -> memoryview:
        """The pool's make: a piece of the arena for an anchor it expects, else a memfd of its own;
        passed to the parent with the first update it carries."""
        piece = None if self.arena is None else self.arena.take(size)
        if piece is not None:
            self._offsets[bid], view = piece
            return view
        fd, self._maps[bid] = _shared_memory(f"dilocod-{bid}", size)
        self._unsent_fds[bid] = fd
        return memoryview(self._maps[bid])[:size]

    def update_failed(self, buffer: Buffer) -> None:
        bid = self.pool.id_of(buffer)
        super().update_failed(buffer)
        if bid is not None:
            # Never handed out again; the mapping lives on while the transport's view of it does.
            self._maps.pop(bid, None)
            self._offsets.pop(bid, None)
            fd = self._unsent_fds.pop(bid, None)
            if fd is not None:
                os.close(fd)

    def snapshot_done(self, snapshot: Snapshot) -> None:
        """The push is done with θ (the parent's buffer: given back) and the anchor (ours)."""
        self.release(snapshot.anchor)
        lent = self._thetas.pop(id(snapshot.theta), None)
        if lent is not None and lent[1] is snapshot.theta:
            self._give_back(lent[0])

    def _give_back(self, bid: int) -> None:
        """Give a snapshot buffer back to the parent with the next inbox message, or alone."""
        self._releases.append(bid)
        if self._release_timer is None and self._loop is not None:
            self._release_timer = self._loop.call_later(RELEASE_DELAY_S, self._release_alone)

    def start(
        self, loop: asyncio.AbstractEventLoop, backlog: Sequence[tuple[dict[str, Any], list[int]]]
    ) -> None:
        """Serve the data socket on loop, starting with messages read before (with the config)."""
        self._loop = loop
        self._handle(backlog)
        loop.add_reader(self.channel.sock.fileno(), self._on_readable)

    # -- the Link posts (on the loop)

    def post_plan(self, plan: Any) -> None:
        super().post_plan(plan)
        self._schedule()

    def post_update(self, adopt: Adopt) -> None:
        super().post_update(adopt)
        self._schedule()

    def post_request(self, request: Any) -> None:
        super().post_request(request)
        self._schedule()

    def post_fatal(self, message: str) -> None:
        super().post_fatal(message)
        self._schedule()

    def post_lost(self, lost: LostPush) -> None:
        super().post_lost(lost)
        self._schedule()

    def _schedule(self) -> None:
        """Forward what was posted on the loop's next turn, with whatever else is posted before it."""
        if self._loop is not None and self._forward_handle is None:
            self._forward_handle = self._loop.call_soon(self._forward)

    def _forward(self) -> None:
        self._forward_handle = None
        inbox = self.take()
        # A heal delivers every fragment at once: several messages, each within the descriptor limit.
        updates = inbox.updates
        first = True
        while first or updates:
            batch, updates = updates[:MAX_FDS], updates[MAX_FDS:]
            part = Inbox(
                inbox.plan if first else None,
                batch,
                inbox.requests if first else [],
                None,
                inbox.lost if first else [],
            )
            if not updates:
                part.fatal = inbox.fatal
            ids: list[int] = []
            new: list[NewBuffer] = []
            fds: list[int] = []
            for update in batch:
                # Received in one of our buffers (update_buffer): the mailbox's hold on it becomes
                # the parent's. Other memory is copied into one.
                bid = self.pool.id_of(update.buffer)
                if bid is None:
                    lease = self.pool.acquire(len(update.buffer))
                    lease.view[:] = update.buffer
                    bid = lease.bid
                ids.append(bid)
                fd = self._unsent_fds.pop(bid, None)
                offset = self._offsets.pop(bid, None)
                if fd is not None:
                    new.append(NewBuffer(bid, len(update.buffer)))
                    fds.append(fd)
                elif offset is not None:
                    new.append(NewBuffer(bid, len(update.buffer), offset))
            note = InboxNote(Control.of(part), tuple(ids), tuple(new), tuple(self._releases))
            self._releases = []
            self.channel.queue(note.to_wire(), fds)
            first = False
        self._cancel_release_timer()
        self._send()

    def _release_alone(self) -> None:
        self._release_timer = None
        if self._releases:
            note = ReleaseNote(tuple(self._releases))
            self._releases = []
            self.channel.queue(note.to_wire())
            self._send()

    def _cancel_release_timer(self) -> None:
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None

    def _send(self) -> None:
        try:
            done = self.channel.send()
        except NetworkProcessError:
            self.closed.set()
            return
        if not done and self._loop is not None:
            self._loop.add_writer(self.channel.sock.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        assert self._loop is not None
        self._loop.remove_writer(self.channel.sock.fileno())
        self._send()

    # -- the parent's outbox (on the loop)

    def _on_readable(self) -> None:
        try:
            messages = self.channel.receive()
        except PeerClosedError:
            self._stop_reading()  # the parent has left (or died)
            return
        except NetworkProcessError as exc:
            log.error("the training process's messages cannot be read: the network stops", error=str(exc))
            self._stop_reading()
            return
        if messages:  # a message handled wrongly is logged by the loop, and reading goes on
            self._handle(messages)

    def _stop_reading(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self.channel.sock.fileno())
        self.closed.set()

    def _handle(self, messages: Sequence[tuple[dict[str, Any], list[int]]]) -> None:
        for raw, fds in messages:
            note = _read(raw, fds, self._mapper, "the training process's message")
            if isinstance(note, OutboxNote):
                self._take_outbox(note)
            elif not isinstance(note, NewBuffersNote):  # mapped already
                log.error("unexpected message from the training process", kind=note.KIND)
        self.flush()

    def _take_outbox(self, outbox: OutboxNote) -> None:
        """A boundary's step reports and snapshots to the Link, then the buffers given back."""
        for item in outbox.steps:
            self.report_step(item, wake=False)
        for note in outbox.snapshots:
            empty = bytearray()
            if note.empty:  # NOTHING_TO_PUSH: no buffer
                nothing = Snapshot(
                    note.fragment, note.round, note.base_version, 0, 0, empty, empty, step=note.step
                )
                self.send_snapshot(nothing, wake=False)
                continue
            theta = self._mapper.view(note.buffer, note.size)
            self._thetas[id(theta)] = (note.buffer, theta)
            snapshot = Snapshot(
                note.fragment,
                note.round,
                note.base_version,
                note.c_steps,
                note.c_tokens,
                theta,
                empty,
                step=note.step,
                apply_late=note.apply_late,
                # δ computed where the anchor lives (--anchors device): no anchor here.
                delta=note.anchor == DELTA_IN_THETA,
            )
            if snapshot.delta:
                self.send_snapshot(snapshot, wake=False)
                continue
            self._snapshot(snapshot, note.anchor)
        # After the snapshots, which hold the anchors they name: what the parent gives back here
        # may be one of them, and must not be reused while a push reads it.
        for bid in outbox.released:
            try:
                self.pool.release(bid)
            except BufferOwnershipError as exc:
                raise NetworkProcessError(f"the training process gave back {bid}: {exc}") from None

    def _snapshot(self, snapshot: Snapshot, anchor_bid: int) -> None:
        """Hand a snapshot (θ in the parent's buffer) to the Link with its anchor: our buffer the
        parent applied, held by the snapshot until the push is done (snapshot_done)."""
        anchor = self.pool.view(anchor_bid) if self.pool.holders(anchor_bid) > 0 else None
        if anchor is None or len(anchor) != len(snapshot.theta):
            log.warning(
                "no anchor for a snapshot: not pushed",
                fragment=snapshot.fragment,
                base_version=snapshot.base_version,
            )
            self.snapshot_done(snapshot)
            return
        # send_snapshot holds the anchor for the push.
        self.send_snapshot(dataclasses.replace(snapshot, anchor=anchor), wake=False)


@dataclass(frozen=True, slots=True)
class ChildConfig:
    """The network process's configuration, as its ConfigNote is read back."""

    link: Any  # a LinkConfig (dilocod.learner.link, imported where the Link runs)
    model: tuple[ModelEntry, ...]
    incarnation: str
    use_uvloop: bool


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


def decode_config(raw: Any) -> ChildConfig:
    """The configuration note as it arrived (a map read from msgpack); NetworkProcessError naming
    the field if it is not one, or its link fields are not a LinkConfig's."""
    from pathlib import Path  # noqa: PLC0415

    from dilocod.learner.link import LinkConfig  # noqa: PLC0415
    from dilocod.transport.credentials import TlsFiles, client_context  # noqa: PLC0415
    from dilocod.tuning.advice import advice_from_json  # noqa: PLC0415

    try:
        note = ConfigNote.from_wire(raw)
        paths = None if note.tls_files is None else tuple(Path(p) for p in note.tls_files)
        files = None if paths is None else TlsFiles(*paths)
        advice = None if note.advice is None else advice_from_json(note.advice)
    except (IpcError, TypeError, ValueError) as exc:
        raise NetworkProcessError(f"the network process's configuration: {exc}") from None
    tls = None if files is None else client_context(files)
    try:
        link = LinkConfig(**note.link, tls=tls, tls_files=paths, advice=advice)
    except TypeError as exc:  # a field the LinkConfig has not got, or one it needs missing
        raise NetworkProcessError(
            f"the network process's configuration: a config note's link: {exc}"
        ) from None
    return ChildConfig(link, note.model, note.incarnation, note.use_uvloop)


async def _child_main(
    channel: Channel,  # the data socket's, already past the configuration
    side: socket.socket,
    config: ChildConfig,
    backlog: Sequence[tuple[dict[str, Any], list[int]]],
    arena: Arena | None,
) -> None:
    from dilocod.learner.link import Link  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    bridge = ChildBridge(channel, arena)
    bridge.start(loop, backlog)
    link = Link(config.link, config.model, bridge)
    link.incarnation = config.incarnation
    stop = asyncio.Event()
    side_channel = Channel(side)

    async def stats() -> None:
        while not stop.is_set():
            side_channel.queue(StatsNote(asdict(link.stats)).to_wire())
            with contextlib.suppress(NetworkProcessError):
                side_channel.send()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STATS_EVERY_S):
                    await stop.wait()

    async def until_parent_leaves() -> None:
        await bridge.closed.wait()
        stop.set()

    async with asyncio.TaskGroup() as tasks:
        helpers = [tasks.create_task(stats()), tasks.create_task(until_parent_leaves())]
        try:
            await link.run(stop)
        finally:
            stop.set()
            for helper in helpers:
                helper.cancel()
    # The last word: what the session did to the end (the parent logs it as the learner stops).
    side_channel.queue(StatsNote(asdict(link.stats)).to_wire())
    side.setblocking(True)
    with contextlib.suppress(NetworkProcessError, OSError):
        side_channel.send()


def child(argv: Sequence[str] | None = None) -> int:
    """The child process: read the configuration, run the Link until the parent leaves."""
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(description="dilocod learner's network process (started by the learner)")
    parser.add_argument("--data-fd", type=int, required=True)
    parser.add_argument("--side-fd", type=int, required=True)
    parser.add_argument("--arena-fd", type=int, help="the anchors' memfd (dilocod.learner.arena)")
    parser.add_argument("--arena-bytes", type=int, help="its size")
    args = parser.parse_args(argv)
    # The parent decides when to stop (it finishes its step, saves, then closes our socket); a
    # Ctrl-C on the terminal or systemd's SIGTERM to the whole unit must not cut the goodbye short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from dilocod.ops.logging import configure_logging  # noqa: PLC0415
    from dilocod.transport.loop import run  # noqa: PLC0415

    configure_logging()
    data = socket.socket(fileno=args.data_fd)
    side = socket.socket(fileno=args.side_fd)
    if not select.select([data], [], [], CONFIG_TIMEOUT_S)[0]:
        log.error("no configuration from the learner", waited_s=CONFIG_TIMEOUT_S)
        return 1
    channel = Channel(data)
    first = channel.receive()
    if not first:
        log.error("no configuration from the learner")
        return 1
    (raw, fds), backlog = first[0], first[1:]
    for fd in fds:
        os.close(fd)  # a configuration introduces no buffers
    try:
        config = decode_config(raw)
    except NetworkProcessError as exc:
        log.error("the learner's first message is not the configuration", error=str(exc))
        return 1
    import_encoder(config.link.precision)  # torch for a lossy precision: not in the first push
    arena = None if args.arena_fd is None else Arena(args.arena_bytes, shared=True, fd=args.arena_fd)
    run(_child_main(channel, side, config, backlog, arena), use_uvloop=config.use_uvloop)
    return 0


if __name__ == "__main__":
    sys.exit(child())
