"""ξ_sync, the sync time the grace window budgets for (docs/design.md §3.4 step 1), runs from a
round's merge starting until every learner the round asked holds the merged fragment: merge and
send-back, not the merge alone. Pure Rounds with explicit `now` values, then the service with a
fake clock and sessions whose sends the test completes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from dilocod.config import SyncerConfig
from dilocod.model.params import model_entries
from dilocod.model.plan import plan_fragments
from dilocod.outer.guard import ACCEPTED, Verdict
from dilocod.syncer.model import GlobalModel
from dilocod.syncer.rounds import CLOSED_ROUNDS_PER_FRAGMENT, Merge, Push, Request, RoundConfig, Rounds
from dilocod.syncer.service import SyncerService, _Peer

OK = Verdict(True, ACCEPTED, 1.0, None)
#: A generous bound on waiting for a signal of the service under test.
SIGNAL_TIMEOUT_S = 30.0


def of(kind: type, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]


def merge_round(
    rounds: Rounds, learners: tuple[str, ...], now: float, pushing: tuple[str, ...] | None = None
) -> Merge:
    """Every live learner steps until a round opens; `pushing` (default: all) push at `now`, and the
    round starts merging then."""
    actions: list = []
    while not of(Request, actions):
        for learner in rounds.live():
            actions += rounds.step(learner, 10, 1.0, now)
    (request,) = of(Request, actions)
    merges = []
    for learner in learners if pushing is None else pushing:
        push = Push(learner, request.round_index, request.fragment, request.version, 1, 10)
        assert rounds.admit(push, now) is None
        merges += of(Merge, rounds.push_complete(push, OK, now))
    merges += of(Merge, rounds.tick(now))
    (merge,) = merges
    return merge


def started(learners: tuple[str, ...], **config: Any) -> Rounds:
    rounds = Rounds(RoundConfig(**{"fragments": 1, "sync_every": 1, "quorum": len(learners), **config}))
    for learner in learners:
        rounds.join(learner, 0.0)
    return rounds


def test_the_sync_time_runs_until_every_asked_learner_holds_the_merge() -> None:
    """Merge from 10.0 to 10.5, then the update reaches a at 11.0 and b at 13.0: ξ_sync is 3.0 s.
    It was 0.5 s (the merge alone), so the grace window budgeted nothing for the send-back."""
    rounds = started(("a", "b"))
    merge = merge_round(rounds, ("a", "b"), now=10.0)
    version = rounds.merged(merge.round_index, now=10.5)
    assert rounds.sync_time_s is None
    rounds.update_done("a", merge.fragment, version, now=11.0)
    assert rounds.sync_time_s is None  # b does not hold it yet
    rounds.update_done("b", merge.fragment, version - 1, now=12.0)  # an older version is not it
    assert rounds.sync_time_s is None
    rounds.update_done("b", merge.fragment, version, now=13.0)
    assert rounds.sync_time_s == pytest.approx(3.0)


def test_a_learner_that_leaves_or_gets_a_newer_version_no_longer_holds_the_sync_up() -> None:
    rounds = started(("a", "b"), fragments=2, sync_every=2, quorum=1)
    merge = merge_round(rounds, ("a", "b"), now=0.0)
    version = rounds.merged(merge.round_index, now=1.0)
    rounds.update_done("a", merge.fragment, version + 3, now=2.0)  # a newer version answers for it
    rounds.leave("b", now=4.0)
    assert rounds.sync_time_s == pytest.approx(4.0)


def test_a_learner_not_asked_does_not_count_and_with_nobody_to_send_to_the_merge_is_the_sync() -> None:
    rounds = started(("a",), quorum=1)
    merge = merge_round(rounds, ("a",), now=0.0)
    rounds.join("late", now=0.5)  # joins while the round merges: not asked in it
    rounds.leave("a", now=0.6)
    rounds.merged(merge.round_index, now=2.0)
    assert rounds.sync_time_s == pytest.approx(2.0)


def test_a_send_back_that_never_ends_is_counted_at_least_as_long_as_it_took() -> None:
    """A learner that never acknowledges (and never leaves) holds at most two cycles of rounds
    pending; the oldest then gives the lower bound it is known to have taken."""
    fragments = 2
    # No overlap, no grace: a round merges as soon as a has pushed.
    rounds = started(("a", "b"), fragments=fragments, sync_every=fragments, quorum=1, overlap=0)
    now = 0.0
    for _ in range(CLOSED_ROUNDS_PER_FRAGMENT * fragments):
        merge = merge_round(rounds, ("a", "b"), now=now, pushing=("a",))
        version = rounds.merged(merge.round_index, now + 0.5)
        rounds.update_done("a", merge.fragment, version, now + 0.5)  # b never answers
        now += 1.0
    assert rounds.sync_time_s is None
    merge = merge_round(rounds, ("a", "b"), now=now, pushing=("a",))
    rounds.merged(merge.round_index, now + 0.5)
    assert rounds.sync_time_s == pytest.approx(now + 0.5)  # the first round, merged at 0.0


def test_a_slow_send_back_shortens_the_grace_window() -> None:
    """The grace window, gamma * (tau * step - (quorum + sync)) clamped to [0, step], shrinks with
    a slow send-back: 0.5 s here, where the merge alone (0.5 s) left the whole step (1 s)."""
    rounds = started(("a", "b", "c"), fragments=1, sync_every=1, quorum=2, overlap=8, grace_factor=0.5)
    merge = merge_round(rounds, ("a", "b", "c"), now=0.0)
    version = rounds.merged(merge.round_index, now=0.5)
    for learner in ("a", "b"):
        rounds.update_done(learner, merge.fragment, version, now=1.0)
    rounds.update_done("c", merge.fragment, version, now=7.0)
    assert rounds.sync_time_s == pytest.approx(7.0)
    # Next round: a and b answer at once (quorum 2, step 1 s): slack 8 - (0 + 7) = 1, grace 0.5 s.
    actions = []
    for learner in ("a", "b", "c"):
        actions += rounds.step(learner, 10, 1.0, now=10.0)
    (request,) = of(Request, actions)
    for learner in ("a", "b"):
        push = Push(learner, request.round_index, request.fragment, request.version, 1, 10)
        rounds.admit(push, now=10.0)
        assert of(Merge, rounds.push_complete(push, OK, now=10.0)) == []
    assert rounds.next_deadline() == pytest.approx(10.5)


# --- the service ---------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _HeldSession:
    """A learner's session whose update sends complete when the test says so (the acknowledgement)."""

    def __init__(self) -> None:
        self.sending = asyncio.Event()
        self.acknowledge = asyncio.Event()

    async def send_fragment(self, header: object, buffer: object, *, checksums: object = None) -> int:
        self.sending.set()
        await self.acknowledge.wait()
        return 1

    def round_trip_s(self) -> float | None:
        return None  # as on a socket the kernel says nothing of: one update at a time


def _service(clock: _Clock, state_dir: Path, fragments: int = 1) -> SyncerService:
    module = torch.nn.Linear(4, 2) if fragments == 1 else torch.nn.Linear(64, 2 * fragments, bias=False)
    specs = model_entries(module)
    model = GlobalModel(
        plan_fragments([(s.name, s.shape) for s in specs], fragments),
        specs,
        chunk_bytes=4096,
        embedding_pattern="*embed*",
    )
    model.load(dict(module.named_parameters()))
    model.publish_all()
    rounds = Rounds(RoundConfig(fragments=fragments, sync_every=fragments, quorum=2))
    return SyncerService(
        SyncerConfig(),
        model,
        rounds,
        state_dir=state_dir,
        incarnation="test",
        secret=None,
        meta={},
        clock=clock,
    )  # type: ignore[arg-type]


async def _merge_and_send_back(state_dir: Path) -> float | None:
    clock = _Clock()
    service = _service(clock, state_dir)
    rounds = service.rounds
    sessions = {learner: _HeldSession() for learner in ("a", "b")}
    peers = {}
    for learner, session in sessions.items():
        peer = _Peer(learner, session=session, joined=True)  # type: ignore[arg-type]
        peer.sent[0] = 0  # healed: it holds version 0
        service.peers[learner] = peers[learner] = peer
        rounds.join(learner, clock())
    raw_bytes = service.model.fragments[0].raw_bytes
    actions: list = []
    for learner in sessions:
        actions += rounds.step(learner, 10, 1.0, clock())
    (request,) = of(Request, actions)
    merges = []
    for learner in sessions:
        push = Push(learner, request.round_index, request.fragment, request.version, 1, 10)
        assert rounds.admit(push, clock()) is None
        service.pushes.hold(push, memoryview(bytearray(raw_bytes)), "fp32")
        merges += of(Merge, rounds.push_complete(push, OK, clock()))
    (merge,) = merges
    senders = [asyncio.create_task(service._send_updates(peer)) for peer in peers.values()]
    try:
        async with asyncio.timeout(SIGNAL_TIMEOUT_S):
            await service._merge(merge)  # at 100.0 on the fake clock, as it started
            for learner, delay in (("a", 2.0), ("b", 5.0)):
                session = sessions[learner]
                await session.sending.wait()
                peers[learner].healed.clear()  # set again once its queue is empty: after the ack
                clock.now = 100.0 + delay
                session.acknowledge.set()
                await peers[learner].healed.wait()
        return rounds.sync_time_s
    finally:
        for task in senders:
            task.cancel()
        await asyncio.gather(*senders, return_exceptions=True)
        service._executor.shutdown()
        service._screener.shutdown()


def test_the_services_sync_time_includes_sending_the_merge_back(tmp_path: Path) -> None:
    """The merge itself takes no time on the fake clock; the updates are acknowledged by a 2 s and
    b 5 s after it began. ξ_sync is 5 s (it was 0: merged() ended the sample)."""
    assert asyncio.run(_merge_and_send_back(tmp_path)) == pytest.approx(5.0)


class _WanSession:
    """A learner's session across a link with this round trip: sends complete when the test lets
    them, and it counts how many are under way at once."""

    def __init__(self, rtt_s: float | None) -> None:
        self.rtt_s = rtt_s
        self.under_way = 0
        self.most = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    def round_trip_s(self) -> float | None:
        return self.rtt_s

    async def send_fragment(self, header: object, buffer: object, *, checksums: object = None) -> int:
        self.under_way += 1
        self.most = max(self.most, self.under_way)
        self.started.set()
        try:
            await self.release.wait()
        finally:
            self.under_way -= 1
        return 1


async def _heal(state_dir: Path, rtt_s: float | None) -> tuple[int, int]:
    """A heal of 4 fragments: (the most updates under way at once, the window)."""
    service = _service(_Clock(), state_dir, fragments=4)
    session = _WanSession(rtt_s)
    peer = _Peer("a", session=session)  # type: ignore[arg-type]
    service.peers["a"] = peer
    peer.pending.update(dict.fromkeys(range(4)))
    sender = asyncio.create_task(service._send_updates(peer))
    try:
        async with asyncio.timeout(SIGNAL_TIMEOUT_S):
            # The sends the window allows were all started in the turn that started the first:
            # they ran before this waiter did.
            await session.started.wait()
            session.release.set()
            await peer.healed.wait()
        assert peer.sent == dict.fromkeys(range(4), 0)
        return session.most, service._update_window(peer)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        service._executor.shutdown()
        service._screener.shutdown()


def test_updates_go_one_at_a_time_on_a_short_round_trip_and_together_across_a_wan(tmp_path: Path) -> None:
    """Below 2 ms of round trip one update is under way at a time; at 100 ms the window covers
    5 Gbit/s x RTT of these 512-byte fragments (capped at 32), so all four are sent at once."""
    assert asyncio.run(_heal(tmp_path / "lan", 0.0005)) == (1, 1)
    assert asyncio.run(_heal(tmp_path / "none", None)) == (1, 1)
    assert asyncio.run(_heal(tmp_path / "wan", 0.100)) == (4, 32)
