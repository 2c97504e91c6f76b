"""The learner's side of a rejoin (SPEC §4.4): the versions its JOIN says it holds are those it
posted to the training side under the syncer's incarnation; back on that incarnation it heals (that
is, overwrites) only the fragments it holds nothing of, and what it posted before still reaches the
training side; another incarnation starts from nothing. A push the syncer found damaged on the
way is sent again, one refused for any other reason is not, and one whose session ended is posted
to the training side as lost."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from devkit.links import new_link
from dilocod.learner.bridge import Bridge, LostPush, Snapshot
from dilocod.learner.link import PUSH_ATTEMPTS, Link
from dilocod.transport.errors import SessionClosed, TransferFailed
from dilocod.transport.session import FragmentReceived
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.manifest import fragment_manifest
from dilocod.wire.messages import (
    FragmentRequest,
    Join,
    PartialUpdate,
    Plan,
    PushHeader,
    UpdateHeader,
    chunk_bitmap,
)
from dilocod.wire.stream import CutShort, Resumed

CHUNK = 1 << 20


def _link() -> tuple[Link, Bridge, Plan]:
    return new_link("inc-1", (4, 7))


def _receive(link: Link, plan: Plan, fragment: int, version: int) -> None:
    """An fp32 update of the fragment, as the session hands it over once it is whole."""
    shapes = {e.name: e.shape for e in plan.model}
    manifest, size = fragment_manifest(plan.fragments[fragment], shapes)
    header = UpdateHeader(manifest, size, "none", CHUNK, fragment=fragment, version=version)
    link._on_item(FragmentReceived(2, header, link._update_buffer(header)))


def test_a_rejoin_names_what_it_holds_and_heals_only_the_rest() -> None:
    link, bridge, plan = _link()
    assert link._held_versions() == ()  # a first JOIN holds nothing
    link._adopt_plan(plan, Join(plan.model))
    assert link._healing == {0, 1}
    _receive(link, plan, 0, 4)
    assert link._held_versions() == (4, None)

    # The session is lost; the syncer merged fragment 0 meanwhile. Fragment 0 is held (at an older
    # version): it arrives as a merge does; fragment 1 is not: it is healed.
    rejoin = Join(plan.model, link.incarnation, link.instance, link._held_versions())
    link._adopt_plan(dataclasses.replace(plan, versions=(5, 7)), rejoin)
    assert link._healing == {1}
    inbox = bridge.take()
    # Mutation caught: post_plan letting go of every waiting update (the JOIN said it holds v4).
    assert [(u.fragment, u.version, u.heal) for u in inbox.updates] == [(0, 4, True)]
    _receive(link, plan, 0, 5)
    _receive(link, plan, 1, 7)
    assert [(u.fragment, u.version, u.heal) for u in bridge.take().updates] == [(0, 5, False), (1, 7, True)]
    assert link._held_versions() == (5, 7)

    # Another incarnation (the syncer restarted): nothing held, everything healed, nothing waits.
    _receive(link, plan, 0, 6)
    link._adopt_plan(dataclasses.replace(plan, incarnation="inc-2"), rejoin)
    assert link._healing == {0, 1} and link._held_versions() == ()
    assert bridge.take().updates == []
    link._executor.shutdown()


class _Session:
    """A session whose syncer answers each push with the next verdict (None: acknowledged)."""

    def __init__(self, verdicts: list[Exception | None]) -> None:
        self.verdicts = verdicts
        self.sent: list[PushHeader] = []

    def round_trip_s(self) -> float:
        return 0.0

    async def send_fragment(self, header: PushHeader, data: object, **_: object) -> int:
        self.sent.append(header)
        verdict = self.verdicts.pop(0)
        if verdict is not None:
            raise verdict
        return len(self.sent)


DAMAGED = TransferFailed(ErrorCode.CHECKSUM_MISMATCH, "chunk 3: checksum of its raw bytes differs")
REFUSED = TransferFailed(ErrorCode.STALE_VERSION, "base version 4 is too old")
CUT = SessionClosed("control connection lost")


@pytest.mark.parametrize(
    ("verdicts", "sent", "pushed", "refused", "lost"),
    [
        pytest.param([None], 1, 1, 0, [], id="acknowledged"),
        pytest.param([DAMAGED, None], 2, 1, 0, [], id="damaged-once"),
        pytest.param([DAMAGED] * PUSH_ATTEMPTS, PUSH_ATTEMPTS, 0, 1, [], id="damaged-every-time"),
        pytest.param([REFUSED], 1, 0, 1, [], id="refused"),
        pytest.param([DAMAGED, CUT], 2, 0, 0, [], id="session-lost"),
    ],
)
def test_a_push_damaged_on_the_way_is_sent_again(
    verdicts: list[Exception | None], sent: int, pushed: int, refused: int, lost: list[LostPush]
) -> None:
    """And one whose session ends under it is kept for the syncer to ask for again (the next
    test); a refused one is let go (the syncer decided)."""

    async def scenario() -> None:
        link, bridge, plan = _link()
        link._adopt_plan(plan, Join(plan.model))
        size = fragment_manifest(plan.fragments[0], {e.name: e.shape for e in plan.model})[1]
        snapshot = Snapshot(0, 3, 4, 2, 64, bytearray(size), bytearray(size))
        session = _Session(list(verdicts))
        kept = await link._push_one(session, snapshot)  # type: ignore[arg-type]
        assert kept == (verdicts[-1] is CUT) == (0 in link._cut_pushes)
        assert len(session.sent) == sent
        assert {(h.fragment, h.round, h.base_version) for h in session.sent} == {(0, 3, 4)}
        assert (link.stats.pushes_sent, link.stats.pushes_refused) == (pushed, refused)
        assert link.stats.pushes_resent == sent - 1
        assert bridge.take().lost == lost
        link._executor.shutdown()

    asyncio.run(scenario())


class _Ended:
    """A session that has closed and whose decodes are over (Session.closed, decodes_idle)."""

    def __init__(self, *, closed: bool = True) -> None:
        self.closed, self.decodes_idle = asyncio.Event(), asyncio.Event()
        if closed:
            self.closed.set()
        self.decodes_idle.set()


def test_an_update_cut_short_is_offered_again_and_resumed_into_its_buffer() -> None:
    """SPEC §4.4 (JOIN.partial, UPDATE_HEADER.skip): what a lost session had received of an update
    is named in the next JOIN once that session's decodes are over, and the same version sent
    again skipping those chunks lands in the same buffer; a newer version lets it go."""

    async def scenario() -> None:
        link, bridge, plan = _link()
        link._adopt_plan(plan, Join(plan.model))
        shapes = {e.name: e.shape for e in plan.model}
        manifest, size = fragment_manifest(plan.fragments[1], shapes)
        header = UpdateHeader(manifest, size, "none", 64, fragment=1, version=7)
        assert header.chunks > 3
        buffer = link._update_buffer(header)
        assert isinstance(buffer, memoryview)
        held = {0: 11, 2: 13}

        # A transfer reset while its session goes on is let go, as before.
        link._update_failed(_Ended(closed=False), CutShort(header, buffer, held))  # type: ignore[arg-type]
        assert link._partials == {} and bridge.pool.id_of(buffer) is None  # never handed out again

        buffer = link._update_buffer(header)
        lost = _Ended()
        link._update_failed(lost, CutShort(header, buffer, held))  # type: ignore[arg-type]
        assert link._partial_updates() == ()  # not before the lost session's decodes are over
        await link._settle_partials(lost)  # type: ignore[arg-type]
        offered = link._partial_updates()
        assert offered == (PartialUpdate(1, 7, chunk_bitmap([0, 2], header.chunks)),)
        assert bridge.pool.id_of(buffer) is not None  # kept, for the resumed transfer

        rejoin = Join(plan.model, link.incarnation, link.instance, link._held_versions(), offered)
        link._adopt_plan(plan, rejoin)
        resumed = link._update_buffer(dataclasses.replace(header, skip=offered[0].have))
        assert isinstance(resumed, Resumed)
        assert resumed.buffer is buffer and resumed.checksums == held
        # Offered once: a second skip of the same chunks names nothing this learner holds.
        with pytest.raises(RemoteProtocolError) as refused:
            link._update_buffer(dataclasses.replace(header, skip=offered[0].have))
        assert refused.value.code is ErrorCode.UNKNOWN_TRANSFER

        # Cut short again; the fragment moves on before the rejoin: the syncer sends version 8
        # whole, so the partial is let go at the plan.
        link._update_failed(lost, CutShort(header, buffer, held))  # type: ignore[arg-type]
        await link._settle_partials(lost)  # type: ignore[arg-type]
        rejoin = Join(plan.model, link.incarnation, link.instance, (), link._partial_updates())
        link._adopt_plan(dataclasses.replace(plan, versions=(4, 8)), rejoin)
        assert link._partials == {} and bridge.pool.id_of(buffer) is None
        link._executor.shutdown()

    asyncio.run(scenario())


def test_a_push_cut_short_is_resumed_when_its_round_is_asked_for_again() -> None:
    """SPEC §4.4 (FRAGMENT_REQUEST.have, PUSH_HEADER.skip): a push its session lost is kept; the
    syncer asking for that round again gets the same bytes without the chunks it holds, and the
    training side is not asked for another snapshot. Asked for the fragment at another round, or
    planned by another incarnation, the kept push is lost (its steps counted again) instead."""

    async def scenario() -> None:
        link, bridge, plan = _link()
        link._adopt_plan(plan, Join(plan.model))
        bridge.take()
        size = fragment_manifest(plan.fragments[0], {e.name: e.shape for e in plan.model})[1]

        async def cut_push(round_: int) -> PushHeader:
            snapshot = Snapshot(0, round_, 4, 2, 64, bytearray(size), bytearray(size))
            lost = _Session([CUT])
            assert await link._push_one(lost, snapshot)  # type: ignore[arg-type]
            return lost.sent[0]

        first = await cut_push(3)
        assert first.chunks == 1 and bridge.take().lost == []
        again = _Session([None])
        link.session = again  # type: ignore[assignment]
        have = chunk_bitmap([0], first.chunks)
        link._on_item(FragmentRequest(0, 3, 4, have))
        await asyncio.gather(*link._pushes)
        (resent,) = again.sent
        assert resent == dataclasses.replace(first, skip=have) and resent.skipped_bytes == first.raw_bytes
        assert link._cut_pushes == {} and link.stats.pushes_sent == 1
        inbox = bridge.take()
        assert inbox.requests == [] and inbox.lost == []  # no new snapshot: the kept bytes went

        # Cut again; the syncer asks for the fragment's next round: lost, then asked as usual.
        await cut_push(5)
        link._on_item(FragmentRequest(0, 7, 4))
        inbox = bridge.take()
        assert inbox.lost == [LostPush(0, 5)] and [r.round for r in inbox.requests] == [7]

        # Cut again; another incarnation plans: lost.
        await cut_push(9)
        link._adopt_plan(dataclasses.replace(plan, incarnation="inc-2"), Join(plan.model))
        assert bridge.take().lost == [LostPush(0, 9)] and link._cut_pushes == {}
        link._executor.shutdown()

    asyncio.run(scenario())
