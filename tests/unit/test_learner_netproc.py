"""The process boundary of the learner's network (dilocod.learner.channel, netproc, netchild) on real
sockets and real shared memory, both ends in this process: datagrams with descriptors, lent buffers
and their return, and the two bridges talking (an update reaches the training side byte for byte in memory
the child received it in; a snapshot reaches the child with that very buffer as its anchor and θ in
the parent's buffer; superseded and replaced buffers come back, and a buffer a push still reads is
not reused)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Iterator

import pytest
import structlog

from devkit.bridge_child import DEADLINE_S, ChildOnThread, drain_snapshots, receive_update, take_until
from dilocod.learner import netchild
from dilocod.learner.arena import ALIGN, Arena, arena_size
from dilocod.learner.bridge import Adopt, LostPush, Snapshot, StepReportItem, newer_update
from dilocod.learner.channel import (
    MAX_DATAGRAM_BYTES,
    Channel,
    Lender,
    Mapper,
    NetworkProcessError,
    PeerClosedError,
    _take_fds,
)
from dilocod.learner.ipc import NewBuffer
from dilocod.learner.link import compute_push
from dilocod.learner.netchild import ChildBridge
from dilocod.learner.netproc import ProcessBridge
from dilocod.wire.manifest import TensorEntry
from dilocod.wire.messages import FragmentRequest

#: The training side and the network process's side of one boundary, both in this process.
Pair = tuple[ProcessBridge, ChildOnThread]


def test_datagrams_carry_messages_and_descriptors() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a, b = Channel(left), Channel(right)
    read, write = os.pipe()
    a.queue({"k": "one", "n": 1})
    a.queue({"k": "two", "blob": b"\x00" * 1000}, [write])
    assert a.send()
    messages = b.receive()
    assert [m["k"] for m, _ in messages] == ["one", "two"]
    ((_, none), (two, fds)) = messages
    assert none == [] and two["blob"] == b"\x00" * 1000 and len(fds) == 1
    os.write(fds[0], b"x")  # the descriptor that arrived is the pipe's write end
    assert os.read(read, 1) == b"x"
    for fd in (*fds, read):
        os.close(fd)
    assert b.receive() == []  # nothing more: never waits
    with pytest.raises(NetworkProcessError, match="does not fit"):
        a.queue({"k": "big", "blob": b"\x00" * MAX_DATAGRAM_BYTES})
    a.queue({"k": "last"})
    a.send()
    left.close()
    # What came before the end is handed out first; then the end is reported.
    assert [m["k"] for m, _ in b.receive()] == ["last"]
    with pytest.raises(NetworkProcessError, match="closed its end"):
        b.receive()
    right.close()


def test_lent_buffers_are_shared_and_reused() -> None:
    lender, mapper = Lender(), Mapper()
    bid, view, fd = lender.borrow(4096 + 3)
    assert fd is not None
    mapper.add(bid, os.dup(fd), 4096 + 3)
    os.close(fd)
    view[:5] = b"hello"
    assert bytes(mapper.view(bid, 5)) == b"hello"  # one memory, two mappings
    lender.give_back(bid)
    again, view2, fd2 = lender.borrow(4096 + 3)
    assert (again, fd2) == (bid, None) and bytes(view2[:5]) == b"hello"
    with pytest.raises(NetworkProcessError, match="never lent"):
        lender.give_back(999)
    with pytest.raises(NetworkProcessError, match="never passed"):
        mapper.view(999, 1)


@pytest.fixture
def pair() -> Iterator[Pair]:
    parent = ProcessBridge()
    child = ChildOnThread(parent._child_data)
    try:
        yield parent, child
    finally:
        parent.close()
        child.close()


def test_updates_cross_in_shared_memory_and_snapshots_come_back(pair: Pair) -> None:
    parent, child = pair
    first = bytearray(range(256)) * 16

    def post_both() -> memoryview:  # in one turn of the child's loop, so they are forwarded together
        buffer = child.bridge.update_buffer(len(first))
        buffer[:] = first
        child.bridge.post_update(Adopt(3, 7, buffer, True, "inc"))
        child.bridge.post_request(FragmentRequest(3, 11, 7))
        return buffer

    received = child.call(post_both)
    inbox = take_until(parent, lambda i: i.updates)
    (update,) = inbox.updates
    assert (update.fragment, update.version, update.heal, update.incarnation) == (3, 7, True, "inc")
    assert isinstance(update.buffer, memoryview) and bytes(update.buffer) == bytes(first)
    assert [r.round for r in inbox.requests] == [11]
    # The training side copies θ into a buffer the child maps and reports a step.
    theta = parent.snapshot_buffer(len(first))
    theta[:] = bytes(reversed(first))
    parent.send_snapshot(Snapshot(3, 11, 7, 5, 640, theta, update.buffer), wake=False)
    parent.report_step(StepReportItem(5, 128, 0.02), wake=False)
    parent.flush()
    for _ in range(100):
        snapshots, steps = child.call(child.bridge.drain)
        if snapshots:
            break
        threading.Event().wait(DEADLINE_S / 100)
    (snapshot,) = snapshots
    assert (
        snapshot.fragment,
        snapshot.round,
        snapshot.base_version,
        snapshot.c_steps,
        snapshot.c_tokens,
    ) == (
        3,
        11,
        7,
        5,
        640,
    )
    assert bytes(snapshot.theta) == bytes(reversed(first))
    # The anchor is the buffer the update was received in (one copy of it, shared), θ the parent's.
    assert snapshot.anchor is received
    update.buffer[0] ^= 0xFF
    assert snapshot.anchor[0] == first[0] ^ 0xFF
    theta[1] ^= 0xFF
    assert snapshot.theta[1] == first[-2] ^ 0xFF
    assert steps == [StepReportItem(5, 128, 0.02)]
    # θ is the push's until it is done; then it goes back, and the next snapshot reuses it.
    assert parent._lender.lent == 1
    child.call(child.bridge.snapshot_done, snapshot)
    take_until(parent, lambda _: parent._lender.lent == 0)
    assert parent.snapshot_buffer(len(first)).obj is theta.obj


def test_a_lost_push_crosses_to_the_training_side(pair: Pair) -> None:
    """The Link's word that a push never reached the syncer (Bridge.post_lost) reaches the
    training process with the inbox, as it does the runtime of the thread bridge. Several in one
    turn of the loop (a session's pushes all fail as it closes) are forwarded together."""
    parent, child = pair

    def post_three() -> None:
        for round_ in (9, 10, 11):
            child.bridge.post_lost(LostPush(2, round_))

    child.call(post_three)
    inbox = take_until(parent, lambda i: len(i.lost) == 3)
    assert inbox.lost == [LostPush(2, 9), LostPush(2, 10), LostPush(2, 11)]
    assert parent.take().lost == []


def test_posts_in_one_turn_of_a_uvloop_loop() -> None:
    """Posts of one turn on uvloop (three pushes failing as their session closed) share a forward;
    uvloop gives a call due now a plain Handle, without when(), which once raised here."""
    uvloop = pytest.importorskip("uvloop")
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    bridge = ChildBridge(Channel(mine))
    loop = uvloop.new_event_loop()

    async def post_in_one_turn() -> None:
        bridge.start(asyncio.get_running_loop(), [])
        bridge.post_fatal("gone")  # urgent: due now
        bridge.post_lost(LostPush(0, 1))
        bridge.post_lost(LostPush(0, 2))

    try:
        # Mutation caught: asking the Handle for when() (AttributeError).
        loop.run_until_complete(post_in_one_turn())
        loop.run_until_complete(asyncio.sleep(0))  # the forward's turn
        raw, _fds = Channel(theirs).receive()[0]
        assert raw["k"] == "inbox" and not Channel(theirs).receive()  # one datagram
    finally:
        loop.close()
        mine.close()
        theirs.close()


def test_superseded_and_replaced_updates_are_given_back(pair: Pair) -> None:
    parent, child = pair
    held = lambda: child.call(lambda: child.bridge.pool.held)  # noqa: E731
    for version in (1, 2):
        receive_update(child, 0, version, bytes([version]) * 64)
        child.forwarded()  # each in its own datagram: two inbox messages, two buffers
    inbox = take_until(parent, lambda i: i.updates)
    assert [u.version for u in inbox.updates] == [2]  # the newer replaced the older before it was taken
    take_until(parent, lambda _: held() == 1)
    anchor = inbox.updates[0].buffer
    receive_update(child, 0, 3, bytes([3]) * 64)
    inbox = take_until(parent, lambda i: i.updates)
    assert bytes(inbox.updates[0].buffer) == bytes([3]) * 64
    # Version 2 is the runtime's anchor until it says otherwise (it applied version 3).
    for _ in range(3):
        take_until(parent, lambda _: True)
    assert held() == 2
    parent.release(anchor)
    take_until(parent, lambda _: held() == 1)
    assert child.call(lambda: child.bridge.pool.buffers) == 2  # two buffers made, one reused


def test_a_child_that_is_gone_is_an_error_not_a_hang(pair: Pair) -> None:
    parent, child = pair
    child.call(child.bridge.channel.sock.close)
    with pytest.raises(NetworkProcessError, match="network process stopped"):
        take_until(parent, lambda _: False)


def test_an_unreadable_message_stops_the_child_with_a_reason(pair: Pair) -> None:
    """Not msgpack from the training side: the child says why and stops its network (the network
    process then exits, and the training side sees it gone), where it used to stop without a word,
    as if the training side had left."""
    parent, child = pair
    with structlog.testing.capture_logs() as logs:  # before sending: the child may read it at once
        parent.channel.sock.sendmsg([b"\xc1 not msgpack"])
        for _ in range(100):
            if child.call(child.bridge.closed.is_set):
                break
            threading.Event().wait(DEADLINE_S / 100)
    assert child.call(child.bridge.closed.is_set)
    (record,) = [r for r in logs if r["log_level"] == "error"]
    assert "unreadable message" in record["error"]


def test_which_update_waits_for_the_boundary() -> None:
    """The one rule both bridges apply to a fragment's update not yet taken."""
    old, new = Adopt(0, 1, bytearray(1), True, "i"), Adopt(0, 2, bytearray(1), False, "i")
    assert newer_update(None, new) == new
    assert newer_update(old, new) == Adopt(0, 2, new.buffer, True, "i")  # still a heal
    assert newer_update(new, Adopt(0, 1, bytearray(1), False, "i")) is None  # older: dropped
    heal = Adopt(0, 1, bytearray(1), True, "j")
    assert newer_update(new, heal) == heal  # a heal replaces whatever its version


class _CopyInFlight:
    """A device copy that finishes when the test says so (the CUDA side stream's event)."""

    def __init__(self) -> None:
        self.finished = False
        self.waited = 0

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.waited += 1
        self.finished = True


def _snapshot_in_flight(
    parent: ProcessBridge, child: ChildOnThread, *, fragment: int, round_: int, size: int
) -> tuple[Snapshot, _CopyInFlight]:
    """A healed fragment (the child delivered its anchor) and a snapshot of it, θ = 0, 1, 2, ...,
    whose device copy is still running."""
    child.call(child.bridge.post_update, Adopt(fragment, 1, bytearray(size), True, "inc"))
    (update,) = take_until(parent, lambda i: i.updates).updates
    theta = parent.snapshot_buffer(size)
    theta[:] = bytes(range(size))
    copy = _CopyInFlight()
    return Snapshot(fragment, round_, 1, 3, 300, theta, update.buffer, copy), copy


def test_a_snapshot_whose_device_copy_runs_waits_for_a_later_boundary(
    pair: Pair,
) -> None:
    """flush() never waits for the GPU: a snapshot whose copy is still running goes at a later
    boundary, once done, and the steps reported meanwhile are not held back with it."""
    parent, child = pair
    snapshot, copy = _snapshot_in_flight(parent, child, fragment=2, round_=5, size=64)
    parent.send_snapshot(snapshot, wake=False)
    parent.report_step(StepReportItem(3, 100, 0.01), wake=False)
    parent.flush()
    for _ in range(20):  # the step report arrives; the snapshot must not
        snapshots, steps = child.call(child.bridge.drain)
        assert snapshots == []
        if steps:
            break
        threading.Event().wait(DEADLINE_S / 100)
    assert steps == [StepReportItem(3, 100, 0.01)]
    assert copy.waited == 0
    copy.finished = True  # the GPU got there; the next boundary sends it
    parent.flush()
    (sent,) = drain_snapshots(child, 1)
    assert (sent.fragment, sent.round) == (2, 5) and bytes(sent.theta) == bytes(range(64))
    assert copy.waited == 0  # never waited on the training thread


def test_an_outer_gradient_computed_on_the_device_crosses_without_an_anchor(
    pair: Pair,
) -> None:
    """--anchors device: the snapshot's buffer holds δ already; its note names no anchor, and the
    child's push sends those bytes as they are."""
    parent, child = pair
    delta = parent.snapshot_buffer(64)
    delta[:] = bytes(range(64))
    parent.send_snapshot(Snapshot(1, 4, 2, 3, 30, delta, bytearray(), delta=True), wake=False)
    parent.flush()
    (sent,) = drain_snapshots(child, 1)
    assert sent.delta and len(sent.anchor) == 0 and bytes(sent.theta) == bytes(range(64))
    manifest = (TensorEntry("w", "float32", (16,), 0),)
    _manifest, out, _sums = compute_push(sent, manifest, 32, in_place=True)
    assert out is sent.theta and bytes(out) == bytes(range(64))


def test_closing_waits_out_a_deferred_device_copy(pair: Pair) -> None:
    """The last boundary's push is not lost when the copy is still running at shutdown."""
    parent, child = pair
    snapshot, copy = _snapshot_in_flight(parent, child, fragment=0, round_=9, size=32)
    parent.send_snapshot(snapshot)  # deferred
    parent.close()
    assert copy.waited == 1
    (sent,) = drain_snapshots(child, 1)
    assert sent.round == 9


def test_given_back_buffers_ride_on_the_next_inbox_message(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child holds the snapshot buffers it copied out until its next inbox message, so the
    training side reads one datagram per boundary fewer (alone after RELEASE_DELAY_S, above)."""
    monkeypatch.setattr(netchild, "RELEASE_DELAY_S", DEADLINE_S)  # only the inbox message can carry it
    parent, child = pair
    snapshot, copy = _snapshot_in_flight(parent, child, fragment=1, round_=4, size=128)
    copy.finished = True
    parent.send_snapshot(snapshot)
    (pushed,) = drain_snapshots(child, 1)
    assert child.call(lambda: list(child.bridge._releases)) == []  # the push holds θ
    child.call(child.bridge.snapshot_done, pushed)  # the push is done
    pending = child.call(lambda: list(child.bridge._releases))
    assert len(pending) == 1 and parent._lender.lent == 1  # pushed, held by the child
    receive_update(child, 1, 2, bytes(128))
    inbox = take_until(parent, lambda i: i.updates)
    assert [u.version for u in inbox.updates] == [2]
    assert parent._lender.lent == 0  # given back by the very message that brought the update
    assert child.call(lambda: (child.bridge._releases, child.bridge._release_timer)) == ([], None)


def _count_datagrams(child: ChildOnThread) -> list[str]:
    """The kinds of the messages the child sends from now on."""
    kinds: list[str] = []
    queue = child.bridge.channel.queue

    def counting(message, fds=()):  # type: ignore[no-untyped-def]
        kinds.append(message["k"])
        queue(message, fds)

    child.bridge.channel.queue = counting  # type: ignore[method-assign]
    return kinds


def test_what_is_posted_in_one_turn_shares_one_datagram_and_nothing_waits(pair: Pair) -> None:
    """The child forwards on its loop's next turn: posts of one turn (a request and an update that
    arrived together) go in one datagram, and a post alone goes at once, with no boundary seen and
    nothing held for a later one (the half-step coalescing is gone)."""
    parent, child = pair
    kinds = _count_datagrams(child)

    def post_two() -> None:
        child.bridge.post_request(FragmentRequest(1, 5, 0))
        child.bridge.post_update(Adopt(0, 1, bytearray(16), False, "inc"))

    child.call(post_two)
    inbox = take_until(parent, lambda i: i.requests)
    assert [u.version for u in inbox.updates] == [1] and kinds == ["inbox"]
    child.call(child.bridge.post_request, FragmentRequest(0, 6, 0))  # no outbox since: not held
    assert [r.round for r in take_until(parent, lambda i: i.requests).requests] == [6]
    # Mutation caught: a forward per post (three datagrams), or one held for a boundary.
    assert kinds == ["inbox", "inbox"]


def test_the_child_reads_an_outbox_as_it_arrives(pair: Pair) -> None:
    """The child waits on its socket, not on a timer near the boundary it expects: a step report
    sent long before any boundary the child could expect reaches the Link."""
    parent, child = pair
    parent.report_step(StepReportItem(2, 64, 60.0), wake=False)
    parent.flush()
    for _ in range(100):
        _snapshots, steps = child.call(child.bridge.drain)
        if steps:
            break
        threading.Event().wait(DEADLINE_S / 100)
    assert [(s.step, s.tokens) for s in steps] == [(2, 64)]


def test_a_peer_that_closes_with_messages_unread_is_a_close_not_a_fault() -> None:
    """A process that closes its end while datagrams of ours sit unread in its queue makes the
    kernel report ECONNRESET before the datagrams it sent us: what it sent is still handed out, and
    the end is the routine PeerClosedError, not a fault."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a, b = Channel(left), Channel(right)
    b.queue({"k": "never read"})
    b.send()
    a.queue({"k": "last"})
    a.send()
    left.close()
    # Mutation caught: ConnectionResetError taken as "the other process is gone" (a fault, and the
    # last datagram lost).
    assert [m["k"] for m, _ in b.receive()] == ["last"]
    with pytest.raises(PeerClosedError):
        b.receive()
    right.close()


def test_the_training_side_leaving_with_an_inbox_unread_is_no_error(
    pair: Pair,
) -> None:
    """A routine stop: the training loop's last boundary is past, the child forwards one more inbox
    (a request, an update), and the training side closes its end without reading it. The child
    stops its network without logging an error (it did: "the training process's messages cannot
    be read")."""
    parent, child = pair
    child.call(child.bridge.post_request, FragmentRequest(1, 4, 2))
    child.forwarded()
    with structlog.testing.capture_logs() as logs:
        parent.close()
        for _ in range(100):
            if child.call(child.bridge.closed.is_set):
                break
            threading.Event().wait(DEADLINE_S / 100)
    assert child.call(child.bridge.closed.is_set)
    assert [r for r in logs if r["log_level"] in ("error", "warning")] == []


def test_first_anchors_cross_as_pieces_of_the_training_sides_arena() -> None:
    """The training side's arena, mapped by the child: an update the plan expects lands in a piece of
    it and reaches the parent as an offset (no descriptor, no new mapping); one it does not expect (a
    second of that size while the first is held) lands in a memfd of the child's own."""
    owner = Arena(arena_size(4 * ALIGN), shared=True)
    assert owner.fd is not None
    parent = ProcessBridge()
    parent._mapper.arena = owner  # as spawn does
    child = ChildOnThread(parent._child_data, Arena(owner.size, shared=True, fd=os.dup(owner.fd)))
    try:
        child.call(child.bridge.expect_anchors, [ALIGN + 5, 64])
        receive_update(child, 0, 1, b"\x07" * (ALIGN + 5), heal=True)
        receive_update(child, 1, 1, b"\x09" * 64, heal=True)
        anchors: dict[int, memoryview] = {}
        while len(anchors) < 2:
            for update in take_until(parent, lambda i: i.updates).updates:
                anchors[update.fragment] = update.buffer
        assert bytes(anchors[0]) == b"\x07" * (ALIGN + 5) and bytes(anchors[1]) == b"\x09" * 64
        # The parent reads them in its own arena: the first at 0, the second on the next page but one.
        assert bytes(owner.view(0, ALIGN + 5)) == bytes(anchors[0])
        assert bytes(owner.view(2 * ALIGN, 64)) == bytes(anchors[1])
        receive_update(child, 0, 2, b"\x08" * (ALIGN + 5))
        (newer,) = take_until(parent, lambda i: i.updates).updates
        assert bytes(newer.buffer) == b"\x08" * (ALIGN + 5)
        assert bytes(owner.view(0, ALIGN + 5)) == b"\x07" * (ALIGN + 5)  # not written over the anchor
        assert child.call(lambda: child.bridge.arena.used) == ALIGN + 5 + 64
    finally:
        parent.close()
        child.close()
        owner.close()


def test_a_piece_of_an_arena_the_parent_has_not_got_is_refused() -> None:
    with pytest.raises(NetworkProcessError, match="arena this side has not got"):
        _take_fds([NewBuffer(1, 10, 0)], [], Mapper())
    read, write = os.pipe()
    with pytest.raises(NetworkProcessError, match="1 new buffers announced, 2 descriptors passed"):
        _take_fds([NewBuffer(1, 10)], [read, write], Mapper())
    for fd in (read, write):
        with pytest.raises(OSError):
            os.fstat(fd)  # closed: nothing leaks from a bad message
    arena = Arena(2 * ALIGN, shared=False)
    with pytest.raises(NetworkProcessError, match="buffer 1: no piece"):
        _take_fds([NewBuffer(1, 10, 3)], [], Mapper(arena))
