"""The learner's one thread boundary (dilocod.learner.bridge.Bridge), driven from real threads and a
real asyncio loop on its own thread: what the network posts, what the training thread takes, what
goes back, and when the network is woken. Waiting is on events and observed thread states with
deadlines, never on a timer."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from dilocod.learner import bridge as bridge_module
from dilocod.learner.bridge import Adopt, Bridge, LostPush, Mailbox, Snapshot, StepReportItem
from dilocod.wire.manifest import ModelEntry
from dilocod.wire.messages import FragmentRequest, Plan

DEADLINE_S = 10.0

MODEL = (ModelEntry("a", "float32", (2,)), ModelEntry("b", "float32", (3,)))


def plan(incarnation: str = "inc-1") -> Plan:
    return Plan(incarnation, MODEL, ((("a", 0, 2),), (("b", 0, 3),)), (0, 0), 2, 2, 1)


def adopt(fragment: int, version: int, heal: bool = False, fill: int = 0) -> Adopt:
    return Adopt(fragment, version, bytearray([fill]) * 8, heal, "inc-1")


def snapshot(fragment: int, round_index: int) -> Snapshot:
    return Snapshot(fragment, round_index, 0, 1, 10, bytearray(8), bytearray(8))


def blocked_in_bridge_wait(thread: threading.Thread) -> bool:
    """Whether `thread` is inside threading.Condition.wait called from Bridge.wait.

    Once its innermost frames are Condition.wait under Bridge.wait, the thread either still holds the
    lock (and registers itself as a waiter before releasing it) or waits: a post that takes the
    lock after this is seen is bound to wake it.
    """
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        back = frame.f_back
        if (
            frame.f_code is threading.Condition.wait.__code__
            and back is not None
            and back.f_code is Bridge.wait.__code__
        ):
            return True
        frame = back
    return False


def until(predicate: Callable[[], bool], what: str) -> None:
    """Poll an observable state with a deadline (no fixed sleep before an assert)."""
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


# ---------------------------------------------------------------------------- network -> training


def test_newest_update_per_fragment_wins() -> None:
    bridge = Bridge()
    bridge.post_update(adopt(0, 3, fill=3))
    bridge.post_update(adopt(0, 5, fill=5))
    bridge.post_update(adopt(0, 4, fill=4))  # older than the pending one: dropped
    bridge.post_update(adopt(1, 1, fill=1))
    inbox = bridge.take()
    # Mutation caught: replacing unconditionally (dropping `pending.version <= adopt.version`).
    assert [(u.fragment, u.version, bytes(u.buffer)) for u in inbox.updates] == [
        (0, 5, bytes([5]) * 8),
        (1, 1, bytes([1]) * 8),
    ]
    assert bridge.take().updates == []


def test_heal_flag_is_never_lost() -> None:
    bridge = Bridge()
    # A heal, then a newer merged update before the training thread took the heal: the newest
    # bytes, still applied as a heal (overwrite whatever the mode).
    bridge.post_update(adopt(0, 2, heal=True, fill=2))
    bridge.post_update(adopt(0, 3, fill=3))
    # An older non-heal update behind a pending heal changes nothing.
    bridge.post_update(adopt(1, 7, heal=True, fill=7))
    bridge.post_update(adopt(1, 6, fill=6))
    # A heal replaces a pending update even when its version is lower (a syncer restarted from an
    # older checkpoint: its fragments are the truth now).
    bridge.post_update(adopt(2, 9, fill=9))
    bridge.post_update(adopt(2, 4, heal=True, fill=4))
    got = {u.fragment: (u.version, u.heal, bytes(u.buffer)[0]) for u in bridge.take().updates}
    # Mutation caught: `adopt.heal or (pending is not None and pending.heal)` -> `adopt.heal`.
    assert got == {0: (3, True, 3), 1: (7, True, 7), 2: (4, True, 4)}


def test_new_plan_clears_stale_requests_and_updates() -> None:
    bridge = Bridge()
    bridge.post_update(adopt(0, 3))
    bridge.post_request(FragmentRequest(1, 5, 3))
    new_plan = plan("inc-2")
    bridge.post_plan(new_plan)
    bridge.post_update(adopt(1, 1, heal=True))
    inbox = bridge.take()
    # Mutation caught: dropping the two clear() calls in post_plan.
    assert inbox.plan is new_plan
    assert [(u.fragment, u.heal) for u in inbox.updates] == [(1, True)]
    assert inbox.requests == []
    # The plan is handed over once.
    assert bridge.take().plan is None


def test_a_new_session_of_the_same_incarnation_keeps_its_updates() -> None:
    """A session lost and joined again: the syncer's incarnation is the one the waiting update
    came from, so that update is still the fragment's merged value (and the JOIN said it holds it).
    The requests of the old session are gone all the same."""
    bridge = Bridge()
    bridge.post_update(adopt(0, 3, fill=3))
    bridge.post_request(FragmentRequest(1, 5, 3))
    again = plan("inc-1")
    bridge.post_plan(again)
    inbox = bridge.take()
    assert inbox.plan is again
    assert [(u.fragment, u.version, bytes(u.buffer)[0]) for u in inbox.updates] == [(0, 3, 3)]
    assert inbox.requests == []


def test_one_request_per_fragment_and_take_empties() -> None:
    bridge = Bridge()
    bridge.post_request(FragmentRequest(1, 4, 0))
    bridge.post_request(FragmentRequest(0, 5, 0))
    bridge.post_request(FragmentRequest(1, 6, 0))
    inbox = bridge.take()
    assert [(r.fragment, r.round) for r in inbox.requests] == [(0, 5), (1, 6)]
    again = bridge.take()
    assert (again.plan, again.updates, again.requests, again.fatal) == (None, [], [], None)


def test_fatal_stays_until_the_training_thread_stops() -> None:
    bridge = Bridge()
    bridge.post_fatal("the syncer's model is not ours")
    assert bridge.take().fatal == "the syncer's model is not ours"
    assert bridge.take().fatal == "the syncer's model is not ours"
    started = time.monotonic()
    bridge.wait(DEADLINE_S)  # a fatal is something to take: no waiting
    assert time.monotonic() - started < DEADLINE_S / 2


# ---------------------------------------------------------------------------- training -> network


def test_one_snapshot_per_fragment_newest_wins() -> None:
    bridge = Bridge()
    bridge.send_snapshot(snapshot(1, 3))
    bridge.send_snapshot(snapshot(0, 4))
    bridge.send_snapshot(snapshot(1, 5))
    snapshots, steps = bridge.drain()
    assert [(s.fragment, s.round) for s in snapshots] == [(0, 4), (1, 5)]
    assert steps == []
    assert bridge.drain() == ([], [])


def test_step_reports_are_bounded_keeping_the_newest() -> None:
    bridge = Bridge()
    extra = 5
    for step in range(1, bridge_module.MAX_PENDING_STEPS + extra + 1):
        bridge.report_step(StepReportItem(step, 10, 0.01))
    _, steps = bridge.drain()
    # Mutation caught: an unbounded deque (maxlen removed) keeps MAX + 5.
    assert len(steps) == bridge_module.MAX_PENDING_STEPS
    assert steps[0].step == extra + 1 and steps[-1].step == bridge_module.MAX_PENDING_STEPS + extra
    assert bridge.drain() == ([], [])


@contextmanager
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-network", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(DEADLINE_S)
        loop.close()


def flush(loop: asyncio.AbstractEventLoop) -> None:
    """Return once every callback scheduled on loop before this call has run (FIFO order)."""
    done = threading.Event()
    loop.call_soon_threadsafe(done.set)
    assert done.wait(DEADLINE_S)


def test_network_is_woken_once_per_batch() -> None:
    bridge = Bridge()
    calls: list[str] = []
    woken = threading.Event()

    def on_outbox() -> None:
        calls.append(threading.current_thread().name)
        woken.set()

    with loop_thread() as loop:
        bridge.attach(loop, on_outbox)
        for step in range(5):
            bridge.report_step(StepReportItem(step + 1, 10, 0.01))
        bridge.send_snapshot(snapshot(0, 1))
        bridge.send_snapshot(snapshot(1, 1))
        assert woken.wait(DEADLINE_S)
        bridge.report_step(StepReportItem(6, 10, 0.01))  # still the same batch: not drained yet
        flush(loop)
        # Mutation caught: not setting _wake_scheduled (one call_soon_threadsafe per item: 8 calls).
        assert calls == ["test-network"]  # on the network loop's thread

        snapshots, steps = bridge.drain()
        assert len(snapshots) == 2 and [s.step for s in steps] == [1, 2, 3, 4, 5, 6]
        woken.clear()
        bridge.report_step(StepReportItem(7, 10, 0.01))  # a new batch after the drain
        assert woken.wait(DEADLINE_S)
        flush(loop)
        # Mutation caught: drain() not resetting _wake_scheduled (the second batch is never announced).
        assert len(calls) == 2
        assert [s.step for s in bridge.drain()[1]] == [7]


def test_closed_network_loop_is_not_an_error_for_the_training_thread() -> None:
    bridge = Bridge()
    closed = asyncio.new_event_loop()
    closed.close()
    bridge.attach(closed, lambda: None)
    bridge.send_snapshot(snapshot(0, 1))
    bridge.report_step(StepReportItem(1, 10, 0.01))
    snapshots, steps = bridge.drain()
    assert [s.fragment for s in snapshots] == [0] and [s.step for s in steps] == [1]


def test_nothing_attached_nothing_woken() -> None:
    bridge = Bridge()
    bridge.send_snapshot(snapshot(0, 1))  # no loop yet: the outbox simply waits for a drain
    assert [s.fragment for s in bridge.drain()[0]] == [0]


# ---------------------------------------------------------------------------- blocking behaviour


@pytest.mark.parametrize(
    "post",
    [
        pytest.param(lambda b: b.post_plan(plan()), id="plan"),
        pytest.param(lambda b: b.post_update(adopt(0, 1)), id="update"),
        pytest.param(lambda b: b.post_request(FragmentRequest(0, 1, 0)), id="request"),
        pytest.param(lambda b: b.post_fatal("gone"), id="fatal"),
    ],
)
def test_wait_returns_when_the_network_posts(post: Callable[[Bridge], None]) -> None:
    bridge = Bridge()
    main = threading.current_thread()
    failures: list[BaseException] = []

    def network() -> None:
        try:
            until(lambda: blocked_in_bridge_wait(main), "the training thread to wait")
            post(bridge)
        except BaseException as exc:
            failures.append(exc)

    poster = threading.Thread(target=network)
    poster.start()
    started = time.monotonic()
    bridge.wait(3 * DEADLINE_S)
    waited = time.monotonic() - started
    poster.join(DEADLINE_S)
    assert not failures, failures
    # Mutation caught: dropping notify_all() in the post_* method (wait runs to its timeout).
    assert waited < DEADLINE_S
    inbox = bridge.take()
    assert inbox.plan or inbox.updates or inbox.requests or inbox.fatal


def test_wait_returns_at_its_timeout_when_nothing_comes() -> None:
    bridge = Bridge()
    started = time.monotonic()
    bridge.wait(0.05)
    assert 0.04 <= time.monotonic() - started < DEADLINE_S


def test_take_never_blocks_while_the_training_side_waits_or_the_network_posts() -> None:
    bridge = Bridge()
    waiter = threading.Thread(target=bridge.wait, args=(3 * DEADLINE_S,))
    waiter.start()
    until(lambda: blocked_in_bridge_wait(waiter), "a thread waiting in Bridge.wait")
    # take() from another thread while one waits: the waiter does not hold the lock.
    started = time.monotonic()
    for _ in range(100):
        inbox = bridge.take()
    assert time.monotonic() - started < 1.0
    assert (inbox.plan, inbox.updates, inbox.requests, inbox.fatal) == (None, [], [], None)
    assert waiter.is_alive()  # take() posts nothing, so the waiter still waits
    bridge.post_request(FragmentRequest(0, 1, 0))
    waiter.join(DEADLINE_S)
    assert not waiter.is_alive()


def test_the_mailbox_both_bridges_keep() -> None:
    """The rules the thread's Bridge and the network process's ProcessBridge share: the newest update
    per fragment (the one that waits no more is handed back, its buffer to let go of), one request
    per fragment, a plan that clears requests and the updates of another incarnation."""
    box = Mailbox()
    assert box.idle
    first, second = Adopt(0, 1, bytearray(1), False, "inc-1"), Adopt(0, 2, bytearray(1), False, "inc-1")
    assert box.post_update(first) is None
    assert box.post_update(second) is first  # replaced: first's buffer goes back
    assert box.post_update(Adopt(0, 1, bytearray(1), False, "inc-1")).version == 1  # older: refused
    other = Adopt(1, 5, bytearray(1), False, "inc-0")
    assert box.post_update(other) is None and not box.idle
    box.requests[2] = FragmentRequest(2, 9, 0)
    assert box.post_plan(plan("inc-1")) == [other]  # another incarnation's update means nothing
    box.lost.append(LostPush(3, 4))
    box.fatal = "gone"
    inbox = box.take()
    assert (inbox.plan, inbox.updates, inbox.requests, inbox.lost) == (
        plan("inc-1"),
        [second],
        [],
        [LostPush(3, 4)],
    )
    assert box.take().fatal == "gone" and not box.idle  # the fatal error stays
