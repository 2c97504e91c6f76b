"""Ownership of the learner's fragment buffers (dilocod.learner.buffers, and the bridges that use
it): a buffer is never handed out again while anyone holds it, and the number of buffers is what is
held at the busiest moment, not what passed through.

The bridge cases play both sides as the runtime and the Link do: updates received into the
bridge's buffers, taken and applied (the replaced anchor released), snapshots sent with their
anchor and the push done later. Across the process boundary (netproc), the same with the child on
its own event loop thread and real shared memory."""

from __future__ import annotations

import threading

import pytest

from devkit.bridge_child import ChildOnThread, drain_snapshots, receive_update, take_until
from dilocod.learner.bridge import Adopt, Bridge, Snapshot
from dilocod.learner.buffers import BufferOwnershipError, BufferPool
from dilocod.learner.netproc import ProcessBridge

SIZE = 256
FRAGMENTS = 6
OVERLAP = 2


def test_a_buffer_is_reused_only_after_its_last_holder_lets_go() -> None:
    pool = BufferPool()
    first = pool.acquire(SIZE)
    assert first.new and len(first.view) == SIZE and pool.id_of(first.view) == first.bid
    pool.hold(first.bid)  # a second holder (a push reading an anchor)
    assert not pool.release(first.bid)  # one still holds it ...
    second = pool.acquire(SIZE)
    assert second.bid != first.bid and second.new  # ... so it is not handed out again
    assert pool.release(first.bid)  # the last one lets go
    again = pool.acquire(SIZE)
    assert (again.bid, again.new) == (first.bid, False) and again.view is first.view
    other = pool.acquire(SIZE + 1)  # another size: another buffer
    assert other.new and other.bid not in (first.bid, second.bid)
    assert pool.buffers == 3 and pool.held == 3


def test_holding_or_releasing_what_nobody_holds_is_an_error() -> None:
    pool = BufferPool()
    lease = pool.acquire(SIZE)
    pool.release(lease.bid)
    with pytest.raises(BufferOwnershipError):
        pool.release(lease.bid)
    with pytest.raises(BufferOwnershipError):
        pool.hold(lease.bid)
    assert pool.id_of(memoryview(bytearray(SIZE))) is None  # not the pool's


def test_a_discarded_buffer_is_never_handed_out_again() -> None:
    """A transfer that failed while a decompression may still write into its buffer."""
    pool = BufferPool()
    lease = pool.acquire(SIZE)
    pool.discard(lease.bid)
    assert pool.id_of(lease.view) is None and pool.buffers == 0
    assert pool.acquire(SIZE).bid != lease.bid


def _cycle(
    bridge: Bridge, versions: dict[int, int], anchors: dict[int, memoryview], step: int
) -> list[Snapshot]:
    """One step of a steady decoupled run (H = P, tau steps from push to merge): the update of the
    fragment pushed tau steps ago arrives, is taken and applied (its old anchor released), and the
    next fragment is snapshotted; the pushes in flight are returned."""
    fragment = step % FRAGMENTS
    merged = (step - OVERLAP) % FRAGMENTS
    buffer = bridge.update_buffer(SIZE)  # the Link receives into the bridge's buffer
    versions[merged] += 1
    buffer[:] = bytes([versions[merged] % 256]) * SIZE
    bridge.post_update(Adopt(merged, versions[merged], buffer, False, "i"))
    for adopt in bridge.take().updates:  # the runtime's boundary
        replaced = anchors.get(adopt.fragment)
        anchors[adopt.fragment] = adopt.buffer  # type: ignore[assignment]
        if replaced is not None:
            bridge.release(replaced)
    theta = bridge.snapshot_buffer(SIZE)
    snapshot = Snapshot(fragment, step, versions[fragment], 1, 1, theta, anchors[fragment])
    bridge.send_snapshot(snapshot, wake=False)
    return bridge.drain()[0]


def test_a_steady_run_needs_the_anchors_and_tau_plus_two_more_buffers() -> None:
    bridge = Bridge()
    versions = dict.fromkeys(range(FRAGMENTS), 0)
    anchors: dict[int, memoryview] = {}
    for fragment in range(FRAGMENTS):  # the heal
        buffer = bridge.update_buffer(SIZE)
        bridge.post_update(Adopt(fragment, 0, buffer, True, "i"))
    for adopt in bridge.take().updates:
        anchors[adopt.fragment] = adopt.buffer  # type: ignore[assignment]
    in_flight: list[Snapshot] = []
    for step in range(10 * FRAGMENTS):
        in_flight += _cycle(bridge, versions, anchors, step)
        # Each push reads its anchor and θ until done; then they go back.
        for snapshot in in_flight:
            assert bridge.pool.holders(bridge.pool.id_of(snapshot.anchor) or -1) >= 1
        while len(in_flight) > OVERLAP - 1:
            bridge.snapshot_done(in_flight.pop(0))
        held_now = {bridge.pool.id_of(a) for a in anchors.values()}
        assert len(held_now) == FRAGMENTS  # one anchor each, never shared
    # One anchor per fragment, and tau + 2 beyond them however long the run.
    assert bridge.pool.peak <= FRAGMENTS + OVERLAP + 2
    for snapshot in in_flight:
        bridge.snapshot_done(snapshot)
    assert bridge.pool.held == FRAGMENTS


def test_an_anchor_a_push_reads_is_not_reused_when_the_runtime_replaces_it() -> None:
    """Thread mode: the runtime applies a newer version (releasing the old anchor) while the push
    of the old one still computes δ from it: the next update must land elsewhere."""
    bridge = Bridge()
    old = bridge.update_buffer(SIZE)
    bridge.post_update(Adopt(0, 1, old, True, "i"))
    (heal,) = bridge.take().updates
    theta = bridge.snapshot_buffer(SIZE)
    bridge.send_snapshot(Snapshot(0, 0, 1, 1, 1, theta, heal.buffer), wake=False)
    (push,) = bridge.drain()[0]
    new = bridge.update_buffer(SIZE)
    bridge.post_update(Adopt(0, 2, new, False, "i"))
    bridge.take()
    bridge.release(old)  # the runtime's anchor is version 2 now
    landed = bridge.update_buffer(SIZE)
    assert landed is not old and landed is not theta  # both are the push's still
    bridge.snapshot_done(push)
    assert {id(bridge.update_buffer(SIZE)), id(bridge.update_buffer(SIZE))} == {id(old), id(theta)}


def test_across_processes_an_anchor_given_back_while_a_push_reads_it_is_kept() -> None:
    """The parent names the anchor in the snapshot's note and gives it back in the same outbox
    (the runtime applied a newer version at that boundary): the child holds it for the push,
    and an update that arrives meanwhile lands in another buffer."""
    parent = ProcessBridge()
    child = ChildOnThread(parent._child_data)
    try:
        receive_update(child, 0, 1, bytes([1]) * SIZE, heal=True)
        (heal,) = take_until(parent, lambda i: i.updates).updates
        theta = parent.snapshot_buffer(SIZE)
        theta[:] = bytes([9]) * SIZE
        parent.send_snapshot(Snapshot(0, 0, 1, 1, 1, theta, heal.buffer), wake=False)
        receive_update(child, 0, 2, bytes([2]) * SIZE)
        (newer,) = take_until(parent, lambda i: i.updates).updates
        parent.release(heal.buffer)  # applied version 2: version 1 goes back with this outbox
        parent.flush()
        (push,) = drain_snapshots(child, 1)
        assert bytes(push.anchor) == bytes([1]) * SIZE
        take_until(parent, lambda _: not parent._holders.get(1))
        anchor_id = child.call(lambda: child.bridge.pool.id_of(push.anchor))
        for _ in range(100):  # the release has reached the child: only the push holds it now
            if child.call(lambda: child.bridge.pool.holders(anchor_id)) == 1:
                break
            threading.Event().wait(0.05)
        assert child.call(lambda: child.bridge.pool.holders(anchor_id)) == 1
        landed = receive_update(child, 1, 1, bytes([3]) * SIZE)
        assert landed is not push.anchor
        child.call(child.bridge.snapshot_done, push)
        assert child.call(lambda: child.bridge.pool.holders(anchor_id)) == 0
        assert receive_update(child, 2, 1, bytes([4]) * SIZE) is push.anchor  # free now: reused
        assert bytes(newer.buffer) == bytes([2]) * SIZE
    finally:
        parent.close()
        child.close()
