"""The learner's network process (dilocod.learner.netproc starts it): the Link and its event loop,
behind the ChildBridge that turns the training side's notes into the Link's snapshots and step
reports and what the Link posts into inbox notes.

The child waits on its data socket in its event loop like on any other socket, and forwards what
the Link posts once per turn of its loop: one datagram for what arrived together, and nothing held
back. Its pool's buffers are memory the parent maps (dilocod.learner.channel): an update is received
from the syncer straight into one, and the parent holds it as the fragment's anchor until it gives
it back. The snapshot buffers the parent lends go back with the next inbox message (so the training
side reads one datagram fewer) or alone RELEASE_DELAY_S later.

The child imports no torch when pushes travel as fp32 (the default): δ is numpy's (see
dilocod.learner.delta), and nothing on its import path (this module, the Link, the transport,
dilocod.learner.plancheck) imports torch at module level; a lossy --precision imports it for the
encoding, at the child's start. torch would add about 200 MiB of memory the training process shares none of.

The child ignores SIGINT and SIGTERM: it stops when the parent closes the data socket (after the
training loop's last boundary) or dies, says goodbye to the syncer, and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import mmap
import os
import select
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import structlog

from dilocod.learner.arena import Arena
from dilocod.learner.bridge import Adopt, Bridge, Buffer, Inbox, LostPush, Snapshot
from dilocod.learner.buffers import BufferOwnershipError, BufferPool
from dilocod.learner.channel import (
    MAX_FDS,
    Channel,
    Mapper,
    NetworkProcessError,
    PeerClosedError,
    read_note,
    shared_memory,
)
from dilocod.learner.control import Control
from dilocod.learner.delta import import_encoder
from dilocod.learner.ipc import (
    DELTA_IN_THETA,
    ConfigNote,
    InboxNote,
    IpcError,
    NewBuffer,
    NewBuffersNote,
    OutboxNote,
    ReleaseNote,
    StatsNote,
)
from dilocod.wire.manifest import ModelEntry

log = structlog.get_logger("dilocod.learner")

STATS_EVERY_S = 1.0
#: How long the child holds the snapshot buffers it gives back, waiting for an inbox message to
#: carry them (each datagram the training thread reads costs it a cold recvmsg and a decode). The
#: training side borrows a new buffer when none of a size is free, so this delays nothing.
RELEASE_DELAY_S = 0.05
CONFIG_TIMEOUT_S = 30.0


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
        fd, self._maps[bid] = shared_memory(f"dilocod-{bid}", size)
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
            note = read_note(raw, fds, self._mapper, "the training process's message")
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
