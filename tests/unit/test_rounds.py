"""The syncer's round state machine with scripted inputs and explicit `now` values: schedule,
quorum, the adaptive grace window, admission, late pushes, rejection, weights and versions. Time
only moves because a test passes a larger `now`; nothing sleeps."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.outer import merge_weights
from dilocod.outer.guard import ACCEPTED, NON_FINITE, Verdict
from dilocod.syncer.rounds import (
    LOCKSTEP_MIN_WAIT_S,
    MAX_GONE_LEARNERS,
    MAX_MERGES_BEHIND,
    MAX_TOTAL,
    Merge,
    Push,
    Refusal,
    Release,
    Request,
    RoundConfig,
    Rounds,
)
from dilocod.wire.messages import QUORUM_ALL

OK = Verdict(True, ACCEPTED, 1.0, None)
BAD = Verdict(False, NON_FINITE, math.nan, None)


def of(kind: type, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]


def push_for(
    request: Request, learner: str, *, steps: int = 4, tokens: int = 400, base: int | None = None
) -> Push:
    version = request.version if base is None else base
    return Push(learner, request.round_index, request.fragment, version, steps, tokens)


def started(config: RoundConfig, learners: tuple[str, ...], now: float = 0.0) -> Rounds:
    rounds = Rounds(config)
    for learner in learners:
        assert rounds.join(learner, now) == []
    return rounds


def first_round(rounds: Rounds, now: float = 0.0, step_time_s: float = 1.0) -> Request:
    """Every live learner steps once; exactly one round opens (asking all of them)."""
    actions = []
    for learner in rounds.live():
        actions += rounds.step(learner, 10, step_time_s, now)
    (request,) = of(Request, actions)
    return request


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="quorum"):
        RoundConfig(quorum=-1)
    assert RoundConfig(quorum=QUORUM_ALL).lockstep and not RoundConfig(quorum=1).lockstep
    with pytest.raises(ValueError, match="grace_factor"):
        RoundConfig(grace_factor=math.inf)
    with pytest.raises(ValueError, match="versions"):
        Rounds(RoundConfig(fragments=4), versions=[0, 0])


def test_one_round_per_step_cycles_through_the_fragments() -> None:
    """P = H: the K-th fastest learner's every step opens the next fragment's round."""
    rounds = started(RoundConfig(fragments=4, sync_every=4), ("a",))
    opened = []
    for step in range(6):
        requests = of(Request, rounds.step("a", 100, 1.0, now=float(step)))
        # Rounds whose fragment is still open are skipped: 0..3 open, then 4 (fragment 0) waits.
        opened += [(r.round_index, r.fragment, r.learners) for r in requests]
    assert opened == [(0, 0, ("a",)), (1, 1, ("a",)), (2, 2, ("a",)), (3, 3, ("a",))]
    assert rounds.next_round == 6


def test_rounds_every_h_over_p_steps() -> None:
    rounds = started(RoundConfig(fragments=2, sync_every=6), ("a",))
    due = [bool(of(Request, rounds.step("a", 1, 1.0, now=float(s)))) for s in range(9)]
    # Round r is due at clock 3 (r + 1): rounds 0 and 1 open at clock 3 and 6; round 2, due at
    # clock 9, syncs fragment 0, whose round 0 is still open, so it is skipped.
    assert due == [False, False, True, False, False, True, False, False, False]


def test_clock_is_the_kth_fastest_live_learner() -> None:
    rounds = started(RoundConfig(fragments=4, sync_every=4, quorum=2), ("fast", "slow"))
    for step in range(3):
        assert of(Request, rounds.step("fast", 1, 0.5, now=float(step))) == []
    assert rounds.clock == 0  # the second fastest has not stepped
    requests = of(Request, rounds.step("slow", 1, 2.0, now=3.0))
    assert [r.round_index for r in requests] == [0] and rounds.clock == 1
    # The fast one leaving lowers the K-th count, but the clock never goes back.
    rounds.leave("fast", now=4.0)
    assert rounds.clock == 1


def test_quorum_then_grace_then_merge_with_token_weights() -> None:
    """K = 1 of three learners: the first push reaches quorum, the grace window (from the running
    means) lets the others join until its deadline, then the round merges what it has."""
    config = RoundConfig(fragments=4, sync_every=4, quorum=1, overlap=2, grace_factor=0.5)
    rounds = started(config, ("a", "b", "c"))
    request = first_round(rounds, now=10.0)  # every learner reports a 1 s step
    assert request.learners == ("a", "b", "c")
    pa = push_for(request, "a", steps=2, tokens=200)
    pb = push_for(request, "b", steps=4, tokens=800)
    assert rounds.admit(pa, now=10.5) is None and rounds.admit(pb, now=10.5) is None
    assert of(Merge, rounds.push_complete(pa, OK, now=11.0)) == []  # quorum at 11.0
    # grace = clamp(0.5 * (2 * 1.0 - (quorum time 1.0 + sync time 0)), 0, 1.0) = 0.5 s
    assert rounds.next_deadline() == pytest.approx(11.5)
    assert of(Merge, rounds.push_complete(pb, OK, now=11.2)) == []  # c is still expected
    (merge,) = of(Merge, rounds.tick(now=11.5))
    assert merge.pushes == (pa, pb)
    assert merge.weights == pytest.approx(merge_weights([200, 800], [2, 4]))  # tokens * tokens/steps
    assert merge.grace_waited_s == pytest.approx(0.5)
    assert rounds.merged(merge.round_index, now=11.7) == 1
    assert rounds.versions[request.fragment] == 1
    assert rounds.quorum_sizes == {2: 1} and rounds.rounds_merged == 1
    assert rounds.learners["b"].contributions == 1 and rounds.learners["c"].contributions == 0


def test_merge_at_once_when_every_live_learner_has_pushed() -> None:
    rounds = started(RoundConfig(fragments=4, sync_every=4, quorum=1), ("a", "b"))
    request = first_round(rounds)
    pushes = [push_for(request, x) for x in ("a", "b")]
    for push in pushes:
        assert rounds.admit(push, now=0.1) is None
    assert of(Merge, rounds.push_complete(pushes[0], OK, now=0.2)) == []
    (merge,) = of(Merge, rounds.push_complete(pushes[1], OK, now=0.3))
    assert merge.pushes == tuple(pushes) and merge.grace_waited_s == pytest.approx(0.1)


def test_a_vanished_learner_is_simply_absent() -> None:
    rounds = started(RoundConfig(fragments=4, sync_every=4), ("a", "b"))
    request = first_round(rounds)
    pa, pb = push_for(request, "a"), push_for(request, "b")
    rounds.admit(pa, now=0.1)
    rounds.admit(pb, now=0.1)
    rounds.push_complete(pa, OK, now=0.2)
    (merge,) = of(Merge, rounds.leave("b", now=0.3))  # b's push will never come
    assert merge.pushes == (pa,)
    assert rounds.push_failed(pb, now=0.4) == []


def test_rounds_wait_without_quorum_and_a_joiner_is_asked() -> None:
    rounds = started(RoundConfig(fragments=4, sync_every=4, quorum=2), ("a", "b"))
    request = first_round(rounds)
    rounds.leave("b", now=1.0)
    pa = push_for(request, "a")
    rounds.admit(pa, now=1.0)
    assert of(Merge, rounds.push_complete(pa, OK, now=2.0)) == []  # one push, quorum two
    assert of(Merge, rounds.tick(now=100.0)) == []
    (ask,) = rounds.join("c", now=101.0)
    assert ask == Request(request.round_index, request.fragment, request.version, ("c",))
    pc = push_for(ask, "c")
    assert rounds.admit(pc, now=101.5) is None
    (merge,) = of(Merge, rounds.push_complete(pc, OK, now=102.0))
    assert {p.learner for p in merge.pushes} == {"a", "c"}


def test_admission_refuses_what_was_not_asked() -> None:
    rounds = started(RoundConfig(fragments=4, sync_every=4), ("a",))
    request = first_round(rounds)
    good = push_for(request, "a")
    assert rounds.admit(Push("a", 99, 0, 0, 1, 1), now=0.1) is Refusal.NOT_REQUESTED  # no such round
    assert rounds.admit(Push("a", request.round_index, 3, 0, 1, 1), now=0.1) is Refusal.NOT_REQUESTED
    assert rounds.admit(push_for(request, "stranger"), now=0.1) is Refusal.NOT_REQUESTED
    assert rounds.admit(push_for(request, "a", base=1), now=0.1) is Refusal.STALE_VERSION  # future
    assert rounds.admit(good, now=0.1) is None
    assert rounds.admit(good, now=0.2) is Refusal.NOT_REQUESTED  # a second push for the round
    assert rounds.rejected == {"not-requested": 4, "stale-version": 1}


def test_a_failed_transfer_may_be_pushed_again() -> None:
    rounds = started(RoundConfig(fragments=4, sync_every=4, quorum=1), ("a",))
    request = first_round(rounds)
    push = push_for(request, "a")
    assert rounds.admit(push, now=0.1) is None
    rounds.push_failed(push, now=0.2)
    assert rounds.admit(push, now=0.3) is None


def test_a_bad_gradient_is_counted_released_and_never_merged() -> None:
    rounds = started(RoundConfig(fragments=4, sync_every=4, quorum=1), ("a", "b"))
    request = first_round(rounds)
    pa, pb = push_for(request, "a"), push_for(request, "b")
    rounds.admit(pa, now=0.1)
    rounds.admit(pb, now=0.1)
    actions = rounds.push_complete(pa, BAD, now=0.2)
    assert of(Release, actions) == [Release(pa, NON_FINITE)] and of(Merge, actions) == []
    (merge,) = of(Merge, rounds.push_complete(pb, OK, now=0.3))
    assert merge.pushes == (pb,)
    assert rounds.rejected[NON_FINITE] == 1
    # A non-finite norm says nothing about the scale; the guard's history is kept per fragment.
    assert {f: [s.norm for s in h.samples()] for f, h in rounds.norm_history.items()} == {
        request.fragment: [1.0]
    }


def test_empty_pushes_never_shrink_the_guards_scale() -> None:
    """Zero-step pushes (δ = 0) are accepted but leave the norm history alone: counted, they pulled
    the median to zero and froze the fragment (found by tests/chaos)."""
    rounds = started(RoundConfig(fragments=4, sync_every=4, quorum=1), ("a", "b"))
    request = first_round(rounds)
    empty = Push("a", request.round_index, request.fragment, 0, 0, 0)
    real = push_for(request, "b")
    rounds.admit(empty, now=0.1)
    rounds.admit(real, now=0.1)
    zero = Verdict(True, ACCEPTED, 0.0, None)
    assert of(Release, rounds.push_complete(empty, zero, now=0.2)) == []
    rounds.push_complete(real, OK, now=0.3)
    assert {f: [s.norm for s in h.samples()] for f, h in rounds.norm_history.items()} == {
        request.fragment: [1.0]
    }


def test_late_push_joins_the_next_round_of_its_fragment() -> None:
    """A push that completes after its round began merging is carried, with its weight, into the
    next round of that fragment, unless it has grown more than one version stale."""
    config = RoundConfig(fragments=2, sync_every=2, quorum=1)
    rounds = started(config, ("a", "b"))
    r0 = first_round(rounds)
    pa, pb = push_for(r0, "a"), push_for(r0, "b", steps=3, tokens=300)
    rounds.admit(pa, now=0.1)
    rounds.admit(pb, now=0.1)
    rounds.push_complete(pa, OK, now=0.2)
    (m0,) = of(Merge, rounds.tick(now=5.0))  # grace over: b is late
    assert m0.pushes == (pa,)
    assert of(Merge, rounds.push_complete(pb, OK, now=5.1)) == []
    assert rounds.merged(m0.round_index, now=5.2) == 1
    # Two more clock ticks open round 1 (fragment 1), then round 2 (fragment 0, now at version 1).
    actions = []
    for t in (6.0, 7.0):
        actions += rounds.step("a", 10, 1.0, now=t) + rounds.step("b", 10, 1.0, now=t)
    (r2,) = [r for r in of(Request, actions) if r.fragment == 0]
    assert r2.version == 1 and r2.learners == ("a", "b")
    fresh = Push("a", r2.round_index, 0, 1, 2, 200)
    assert rounds.admit(fresh, now=7.1) is None
    # Quorum by a's own push; b is still expected (its carried push does not answer for it), so
    # the round waits out its grace for b's own push, then merges a's with b's carried one.
    assert of(Merge, rounds.push_complete(fresh, OK, now=7.2)) == []
    (m2,) = of(Merge, rounds.tick(now=30.0))
    assert {p.learner: p for p in m2.pushes} == {"a": fresh, "b": pb}
    assert m2.weights == pytest.approx(merge_weights([200, 300], [2, 3]))
    # Merged once only, even when that merge fails and the fragment's next round is at the same
    # version (so b's late push would not yet be too stale to count again).
    rounds.merge_failed(m2.round_index, now=30.1)
    actions = []
    for t in (31.0, 32.0):
        actions += rounds.step("a", 10, 1.0, now=t) + rounds.step("b", 10, 1.0, now=t)
    (r4,) = [r for r in of(Request, actions) if r.fragment == 0]
    assert r4.version == 1
    again = Push("a", r4.round_index, 0, 1, 2, 200)
    rounds.admit(again, now=32.1)
    rounds.push_complete(again, OK, now=32.2)
    (m4,) = of(Merge, rounds.tick(now=60.0))
    assert m4.pushes == (again,)


def with_a_carried_push(late_steps: int = 4, late_tokens: int = 400) -> tuple[Rounds, Push, Request]:
    """K = 1, P = H = 1, learners a and b: round 0 merges on a's push alone (version 1), b's push
    for it completes after that and is carried; then both step, which opens round 1."""
    rounds = started(RoundConfig(fragments=1, sync_every=1, quorum=1), ("a", "b"))
    r0 = first_round(rounds)
    pa, late = push_for(r0, "a"), push_for(r0, "b", steps=late_steps, tokens=late_tokens)
    rounds.admit(pa, now=0.1)
    rounds.admit(late, now=0.1)
    rounds.push_complete(pa, OK, now=0.2)
    (m0,) = of(Merge, rounds.tick(now=5.0))
    rounds.push_complete(late, OK, now=5.1)  # carried
    assert rounds.merged(m0.round_index, now=5.2) == 1
    actions = rounds.step("a", 10, 1.0, now=6.0) + rounds.step("b", 10, 1.0, now=6.0)
    (r1,) = of(Request, actions)
    assert of(Merge, actions) == []  # opened, not merged on b's carried push alone
    return rounds, late, r1


def test_a_carried_push_never_lets_a_round_merge_as_it_opens() -> None:
    """K = 1: a late push of b carried into the next round of its fragment must not be that
    round's quorum; the round waits for an own push (a's), then merges it with b's."""
    rounds, _, r1 = with_a_carried_push()
    own = Push("a", r1.round_index, 0, 1, 1, 100)
    rounds.admit(own, now=6.1)
    assert of(Merge, rounds.push_complete(own, OK, now=6.2)) == []  # b may still answer
    (m1,) = of(Merge, rounds.tick(now=60.0))
    assert {p.learner for p in m1.pushes} == {"a", "b"}


def test_a_carried_push_too_stale_is_released() -> None:
    config = RoundConfig(fragments=1, sync_every=1, quorum=1, staleness=1)
    rounds = started(config, ("a", "b"))
    r0 = first_round(rounds)
    late = push_for(r0, "b")
    rounds.admit(push_for(r0, "a"), now=0.0)
    rounds.admit(late, now=0.0)
    rounds.push_complete(push_for(r0, "a"), OK, now=0.1)
    (m0,) = of(Merge, rounds.tick(now=9.0))
    rounds.merged(m0.round_index, now=9.1)  # version 1
    rounds.versions[0] = 2  # as if another round merged meanwhile: base 0 is now 2 behind
    actions = rounds.push_complete(late, OK, now=9.2)
    actions += rounds.step("a", 10, 1.0, now=10.0) + rounds.step("b", 10, 1.0, now=10.0)
    assert Release(late, "stale") in actions
    assert all(late not in m.pushes for m in of(Merge, actions))


def test_zero_step_pushes_carry_no_weight() -> None:
    rounds = started(RoundConfig(fragments=4, sync_every=4, quorum=1), ("a", "b"))
    request = first_round(rounds)
    idle, busy = push_for(request, "a", steps=0, tokens=0), push_for(request, "b")
    rounds.admit(idle, now=0.1)
    rounds.admit(busy, now=0.1)
    rounds.push_complete(idle, OK, now=0.2)
    actions = rounds.push_complete(busy, OK, now=0.3)
    assert Release(idle, "zero weight") in actions
    (merge,) = of(Merge, actions)
    assert merge.pushes == (busy,) and merge.weights == (1.0,)


def test_nothing_trained_abandons_the_round_and_keeps_the_version() -> None:
    rounds = started(RoundConfig(fragments=4, sync_every=4, quorum=1), ("a",))
    request = first_round(rounds)
    idle = push_for(request, "a", steps=0, tokens=0)
    rounds.admit(idle, now=0.1)
    actions = rounds.push_complete(idle, OK, now=0.2)
    assert of(Merge, actions) == [] and Release(idle, "no steps to merge") in actions
    assert rounds.versions == [0, 0, 0, 0] and rounds.rounds_abandoned == 1


def test_merge_failure_keeps_the_version() -> None:
    rounds = started(RoundConfig(fragments=4, sync_every=4, quorum=1), ("a",))
    request = first_round(rounds)
    push = push_for(request, "a")
    rounds.admit(push, now=0.1)
    (merge,) = of(Merge, rounds.push_complete(push, OK, now=0.2))
    rounds.merge_failed(merge.round_index, now=0.3)
    assert rounds.versions[request.fragment] == 0
    with pytest.raises(RuntimeError):
        rounds.merged(merge.round_index, now=0.4)


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(
            ["step", "join", "leave", "push", "complete", "fail", "tick", "merged", "merge-failed"]
        ),
        st.sampled_from(["a", "b", "c"]),
        st.booleans(),
    ),
    max_size=120,
)


@given(events=EVENTS, quorum=st.integers(1, 3), fragments=st.integers(1, 4))
@settings(max_examples=150, deadline=None)
def test_invariants_under_any_event_order(
    events: list[tuple[str, str, bool]], quorum: int, fragments: int
) -> None:
    """Versions never fall, a push is merged at most once, every merge's weights sum to one and
    hold only admitted pushes, and the clock never goes back."""
    rounds = Rounds(RoundConfig(fragments=fragments, sync_every=fragments, quorum=quorum))
    now = 0.0
    asked: list[Request] = []
    admitted: list[Push] = []
    merging: list[Merge] = []
    merged_pushes: list[Push] = []
    for kind, learner, flag in events:
        now += 0.25
        versions, clock = list(rounds.versions), rounds.clock
        actions: list = []
        if kind == "step":
            actions = rounds.step(learner, 10 if flag else 0, 1.0, now)
        elif kind == "join":
            actions = rounds.join(learner, now)
        elif kind == "leave":
            actions = rounds.leave(learner, now)
        elif kind == "push" and asked:
            request = asked[-1 if flag else 0]
            push = Push(learner, request.round_index, request.fragment, request.version, 1, 10)
            if rounds.admit(push, now) is None:
                admitted.append(push)
        elif kind in ("complete", "fail") and admitted:
            push = admitted.pop(0 if flag else -1)
            if kind == "complete":
                actions = rounds.push_complete(push, OK if flag or learner != "c" else BAD, now)
            else:
                actions = rounds.push_failed(push, now)
        elif kind == "merged" and merging:
            rounds.merged(merging.pop(0).round_index, now)
        elif kind == "merge-failed" and merging:
            # The merge's pushes were consumed: a failed merge must not bring them back.
            rounds.merge_failed(merging.pop(0).round_index, now)
        else:
            actions = rounds.tick(now)
        asked += of(Request, actions)
        for merge in of(Merge, actions):
            assert math.isclose(sum(merge.weights), 1.0)
            assert all(w > 0 for w in merge.weights)
            assert len(merge.pushes) >= quorum
            for push in merge.pushes:
                assert push not in merged_pushes, "a push merged twice"
                merged_pushes.append(push)
            merging.append(merge)
        assert all(a >= b for a, b in zip(rounds.versions, versions, strict=True))
        assert rounds.clock >= clock


def test_a_round_nobody_can_merge_frees_its_fragment() -> None:
    """K = 1 and the only push is screened out: the round is abandoned, so the fragment's next turn
    opens a new round instead of being skipped while this one waits for nobody."""
    rounds = started(RoundConfig(fragments=2, sync_every=2, quorum=1), ("a",))
    request = first_round(rounds)
    bad = push_for(request, "a")
    rounds.admit(bad, now=0.1)
    rounds.push_complete(bad, BAD, now=0.2)
    assert rounds.rounds_abandoned == 1 and rounds.versions == [0, 0]
    opened = []
    for t in range(1, 4):
        opened += [r.fragment for r in of(Request, rounds.step("a", 10, 1.0, now=float(t)))]
    assert opened.count(request.fragment) >= 1, opened  # fragment 0 asked again at its next turn


def test_a_round_with_pushes_below_quorum_waits_for_the_learners_to_return() -> None:
    rounds = started(RoundConfig(fragments=2, sync_every=2, quorum=2), ("a", "b"))
    request = first_round(rounds)
    pa = push_for(request, "a")
    rounds.admit(pa, now=0.1)
    rounds.push_complete(pa, OK, now=0.2)
    rounds.leave("b", now=0.3)
    assert rounds.rounds_abandoned == 0  # a's push is work: kept until K learners are back
    (ask,) = rounds.join("c", now=1.0)
    assert ask.round_index == request.round_index


def test_goodput_is_reported_step_time_over_wall_time_since_the_first_join() -> None:
    """The terms outlive a leave and a rejoin (a restarted learner keeps its id); steps reported
    while not joined count for nothing; a restored learner (syncer restart) keeps its terms."""
    rounds = Rounds(RoundConfig(fragments=2, sync_every=2))
    rounds.join("a", 10.0)
    rounds.step("a", 10, 0.5, 11.0)
    rounds.step("a", 10, 0.5, 12.0)
    record = rounds.learners["a"]
    assert record.useful_s == 1.0 and record.tracked_s(12.0) == 2.0 and record.goodput(12.0) == 0.5
    rounds.leave("a", 12.0)
    rounds.step("a", 10, 5.0, 15.0)  # not live: ignored
    rounds.join("a", 20.0)  # restarted: the first join still counts
    rounds.step("a", 10, 1.0, 21.0)
    assert record.first_joined == 10.0 and record.useful_s == 2.0
    assert record.goodput(21.0) == pytest.approx(2.0 / 11.0)
    rounds.step("a", 10, math.nan, 22.0)  # an unusable step time adds nothing
    assert record.useful_s == 2.0

    restarted = Rounds(RoundConfig(fragments=2, sync_every=2))
    restarted.restore_learner("a", tracked_s=100.0, useful_s=80.0, now=5.0)
    assert restarted.live() == [] and restarted.learners["a"].goodput(5.0) == pytest.approx(0.8)
    restarted.join("a", 6.0)
    assert restarted.learners["a"].first_joined == -95.0
    restarted.restore_learner("a", tracked_s=1.0, useful_s=1.0, now=7.0)  # known already: kept
    assert restarted.learners["a"].useful_s == 80.0


def test_the_learners_own_step_is_kept_and_outlives_a_restart_of_the_syncer() -> None:
    """`steps` counts the reports this syncer received; `local_step` is the learner's counter as it
    last reported it, which goes back when the learner restarts from an older save and is carried
    over a restart of the syncer (the chaos benchmark's step axis)."""
    rounds = Rounds(RoundConfig(fragments=2, sync_every=2))
    rounds.join("a", 0.0)
    rounds.step("a", 10, 0.5, 1.0, local_step=41)
    rounds.step("a", 10, 0.5, 2.0, local_step=42)
    rounds.step("a", 10, 0.5, 3.0)  # a report without a step leaves the last one
    assert (rounds.learners["a"].steps, rounds.learners["a"].local_step) == (3, 42)
    rounds.leave("a", 4.0)
    rounds.join("a", 5.0)
    rounds.step("a", 10, 0.5, 6.0, local_step=30)  # restarted from a save 12 steps older
    assert rounds.learners["a"].local_step == 30

    restarted = Rounds(RoundConfig(fragments=2, sync_every=2))
    restarted.restore_learner("a", tracked_s=10.0, useful_s=5.0, now=5.0, local_step=30)
    assert restarted.learners["a"].local_step == 30 and restarted.learners["a"].steps == 0


def test_a_learner_refused_as_stale_is_no_longer_waited_for() -> None:
    """A push refused at its header for a stale base is the last this round hears from its
    learner: the round merges the others' pushes without waiting out its grace for it, and a
    carried push of its own still joins (it alone cannot make quorum while others are expected)."""
    config = RoundConfig(fragments=1, sync_every=1, quorum=1)
    rounds = Rounds(config, versions=[2])
    for learner in ("a", "b"):
        rounds.join(learner, 0.0)
    request = first_round(rounds)
    assert request.version == 2
    assert rounds.admit(push_for(request, "b", base=0), now=0.1) is Refusal.STALE_VERSION
    fresh = push_for(request, "a")
    assert rounds.admit(fresh, now=0.1) is None
    (merge,) = of(Merge, rounds.push_complete(fresh, OK, now=0.2))  # not at the grace deadline
    assert merge.pushes == (fresh,) and merge.grace_waited_s == 0.0


def test_a_failed_push_is_not_waited_for_unless_its_learner_is_asked_again() -> None:
    """A learner whose push failed (a corrupt chunk: the syncer reset the transfer) does not push
    that round again: the round merges the others' without waiting out its grace. Asked again on
    a rejoin, it is waited for again."""
    config = RoundConfig(fragments=1, sync_every=1, quorum=1)
    rounds = started(config, ("a", "b"))
    request = first_round(rounds)
    failed = push_for(request, "b")
    assert rounds.admit(failed, now=0.1) is None
    rounds.push_failed(failed, now=0.2)
    fresh = push_for(request, "a")
    rounds.admit(fresh, now=0.3)
    (merge,) = of(Merge, rounds.push_complete(fresh, OK, now=0.4))
    assert merge.pushes == (fresh,) and merge.grace_waited_s == 0.0
    # The next round: b's push fails, then b rejoins and is asked again: now it is waited for.
    rounds.merged(merge.round_index, now=0.5)
    (following,) = of(Request, rounds.step("a", 10, 1.0, now=1.0) + rounds.step("b", 10, 1.0, now=1.0))
    again = push_for(following, "b")
    rounds.admit(again, now=1.1)
    rounds.push_failed(again, now=1.2)
    rounds.leave("b", now=1.3)
    (ask,) = rounds.join("b", now=1.4)
    assert ask.round_index == following.round_index
    own = push_for(following, "a")
    rounds.admit(own, now=1.5)
    assert of(Merge, rounds.push_complete(own, OK, now=1.6)) == []  # grace: b may answer now


def test_a_round_stops_waiting_after_a_whole_cycle() -> None:
    """Pushes held up in flight (a learner stopped mid-transfer keeps its session until the idle
    timeout) must not hold a fragment for that long: a round with no push after one cycle of the
    schedule (H mean steps) is abandoned, so its fragment opens again at its next turn, and a push
    that completes later is carried there."""
    config = RoundConfig(fragments=4, sync_every=4, quorum=1)
    rounds = started(config, ("a", "b"))
    request = first_round(rounds, now=0.0, step_time_s=0.5)  # opens at 0; a cycle: 4 x 0.5 s
    held = [push_for(request, name) for name in ("a", "b")]
    for push in held:
        assert rounds.admit(push, now=0.1) is None
    expires = rounds.next_deadline()
    assert expires == pytest.approx(2.0)
    assert rounds.tick(now=expires - 0.01) == [] and rounds.rounds_abandoned == 0
    rounds.tick(now=expires)
    assert rounds.rounds_abandoned == 1 and rounds.versions == [0, 0, 0, 0]
    # The held push arrives at last: its round ended, so it waits for the fragment's next round.
    assert of(Merge, rounds.push_complete(held[0], OK, now=expires + 1.0)) == []
    again, again_at, now = None, 0.0, expires + 2.0
    while again is None:  # the fragment's next turn, a cycle later at most
        assert now < expires + 10.0
        for learner in ("a", "b"):
            for asked in of(Request, rounds.step(learner, 10, 0.5, now=now)):
                if asked.fragment == request.fragment:
                    again, again_at = asked, now
        now += 0.5
    fresh = push_for(again, "b")
    rounds.admit(fresh, now=again_at + 0.1)
    done = rounds.push_complete(fresh, OK, now=again_at + 0.2) + rounds.tick(now=again_at + 10.0)
    (merge,) = of(Merge, done)
    assert {p.learner for p in merge.pushes} == {"a", "b"}  # a's carried push joined b's own


def test_a_round_below_quorum_that_waited_a_cycle_leaves_the_deadlines() -> None:
    """K = 2 and only a answers: after a cycle the round stops waiting for b but keeps a's push
    (work, until K learners are back), and its past moment is no longer a deadline the ticker would
    wake for again and again."""
    config = RoundConfig(fragments=4, sync_every=4, quorum=2)
    rounds = started(config, ("a", "b"))
    request = first_round(rounds, step_time_s=0.5)
    own = push_for(request, "a")
    rounds.admit(own, now=0.1)
    rounds.push_complete(own, OK, now=0.2)
    expires = rounds.next_deadline()
    assert expires is not None
    assert of(Merge, rounds.tick(now=expires + 0.1)) == []
    assert rounds.rounds_abandoned == 0 and rounds.next_deadline() is None
    late = push_for(request, "b")  # b answers after all: quorum, merged at once
    rounds.admit(late, now=expires + 0.2)
    (merge,) = of(Merge, rounds.push_complete(late, OK, now=expires + 0.3))
    assert {p.learner for p in merge.pushes} == {"a", "b"}


def test_a_late_push_joins_beside_its_learners_answer_from_a_newer_version() -> None:
    """b's push misses its round (merged on a's alone), b adopts that merge, and its answer to the
    fragment's next round starts from the new version: the two hold different steps, so the late
    one joins that round beside it (left waiting, it went stale a round later: its upload wasted)."""
    rounds, late, r1 = with_a_carried_push(late_steps=3, late_tokens=300)
    own_a, own_b = push_for(r1, "a", steps=2, tokens=200), push_for(r1, "b", steps=1, tokens=100)
    for push in (own_a, own_b):
        assert rounds.admit(push, now=6.1) is None
    assert of(Merge, rounds.push_complete(own_a, OK, now=6.2)) == []
    (m1,) = of(Merge, rounds.push_complete(own_b, OK, now=6.3))  # nobody left to wait for
    assert set(m1.pushes) == {own_a, own_b, late}
    weights = dict(zip(m1.pushes, m1.weights, strict=True))
    want = merge_weights([200, 100, 300], [2, 1, 3])
    assert [weights[own_a], weights[own_b], weights[late]] == pytest.approx(want)
    assert rounds.quorum_sizes == {1: 1, 2: 1}  # learners, not pushes
    assert rounds.learners["b"].contributions == 1
    assert (rounds.learners["b"].pushes, rounds.learners["b"].pushes_wasted) == (2, 0)


def test_a_late_push_from_the_same_version_as_its_learners_answer_goes() -> None:
    """The answer from the same version holds every step of the late push: merging both would
    count them twice, so the late one is released (and counted as wasted)."""
    rounds, late, r1 = with_a_carried_push()
    own_a, own_b = push_for(r1, "a"), push_for(r1, "b", base=0)  # b had not adopted version 1
    rounds.admit(own_a, now=6.1)
    rounds.admit(own_b, now=6.1)
    rounds.push_complete(own_a, OK, now=6.2)
    actions = rounds.push_complete(own_b, OK, now=6.3)
    assert Release(late, "superseded by a later push") in actions
    (m1,) = of(Merge, actions)
    assert set(m1.pushes) == {own_a, own_b}
    assert (rounds.learners["b"].pushes, rounds.learners["b"].pushes_wasted) == (2, 1)


def test_refused_and_released_pushes_count_as_wasted() -> None:
    rounds = started(RoundConfig(fragments=2, sync_every=2, quorum=1), ("a", "b"))
    request = first_round(rounds)
    stale = push_for(request, "a", base=request.version + 5)
    assert rounds.admit(stale, now=0.1) is Refusal.STALE_VERSION
    bad = push_for(request, "b")
    rounds.admit(bad, now=0.1)
    rounds.push_complete(bad, BAD, now=0.2)
    assert {name: (r.pushes, r.pushes_wasted) for name, r in rounds.learners.items()} == {
        "a": (1, 1),
        "b": (1, 1),
    }


# --- one learner's reported numbers ---------------------------------------------------------------

ROGUE = "rogue"


@settings(max_examples=200, deadline=None)
@given(
    honest=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=4),
    reported=st.floats(0.0, 86_400.0),
)
def test_one_learners_step_time_does_not_stall_the_round(honest: list[float], reported: float) -> None:
    """A learner reporting a slow step (up to the one-day bound) and never pushing: the others'
    round merges at most one of their own step times after its quorum. The mean of the asked
    learners' step times made one report of 3600 s hold every round half an hour (and 1e308, with
    the running mean of every report, for good)."""
    names = [f"h{i}" for i in range(len(honest))]
    rounds = started(RoundConfig(fragments=4, sync_every=4, quorum=1), (*names, ROGUE))
    requests = []
    for name, step_s in zip(names, honest, strict=True):
        requests += of(Request, rounds.step(name, 10, step_s, now=0.0))
    rounds.step(ROGUE, 10, reported, now=0.0)
    (request,) = requests
    assert ROGUE in request.learners
    merges = []
    for name in names:
        push = push_for(request, name)
        assert rounds.admit(push, now=1.0) is None
        merges += of(Merge, rounds.push_complete(push, OK, now=1.0))  # quorum at 1.0
    if not merges:
        deadline = rounds.next_deadline()
        assert deadline is not None and deadline <= 1.0 + max(honest) + 1e-9
        merges = of(Merge, rounds.tick(now=deadline))
    (merge,) = merges
    assert merge.pushes and {p.learner for p in merge.pushes} <= set(names)


@settings(max_examples=100, deadline=None)
@given(honest_s=st.floats(0.3, 10.0), reported=st.floats(1e-9, 1e-3))
def test_one_learner_reporting_tiny_steps_does_not_cut_the_wait_short(
    honest_s: float, reported: float
) -> None:
    """The other direction: a learner reporting near-zero step times must not make rounds stop
    waiting before an honest learner has had a step to answer (they would all be abandoned)."""
    rounds = started(RoundConfig(fragments=4, sync_every=4, quorum=1), ("h", ROGUE))
    (request,) = of(Request, rounds.step("h", 10, honest_s, now=0.0))
    rounds.step(ROGUE, 10, reported, now=0.0)
    push = push_for(request, "h")
    assert rounds.tick(now=honest_s) == [] and rounds.rounds_abandoned == 0
    assert rounds.admit(push, now=honest_s) is None
    assert of(Merge, rounds.push_complete(push, OK, now=honest_s))


def test_a_fragment_is_not_held_past_its_next_turn_by_a_learners_slow_steps() -> None:
    """A round with nothing to merge (the honest push failed) waits only for a learner reporting
    day-long steps: it stops waiting once the clock (the honest learner's steps) has gone a whole
    cycle past its opening, so the fragment comes round again, not H days later."""
    rounds = started(RoundConfig(fragments=2, sync_every=2, quorum=1), ("h", ROGUE))
    (request,) = of(Request, rounds.step("h", 10, 0.1, now=0.0))
    rounds.step(ROGUE, 10, 86_400.0, now=0.0)
    failed = push_for(request, "h")
    rounds.admit(failed, now=0.05)
    rounds.push_failed(failed, now=0.06)
    now, again = 0.1, []
    while not again:
        assert now < 2.0, "the fragment never came round again"
        asked = of(Request, rounds.step("h", 10, 0.1, now=now))
        again = [r for r in asked if r.fragment == request.fragment]
        now += 0.1
    assert rounds.rounds_abandoned >= 1


def test_a_learners_token_count_cannot_take_the_merge() -> None:
    """2**62 tokens won a learner the whole weight of every round it joined. Its weight is clipped
    at 16 times the round's lower median (outer.weights.bounded_merge_weights): with one honest
    learner, at most 16/17 of the merge."""
    rounds = started(RoundConfig(fragments=1, sync_every=1, quorum=2), ("h", ROGUE))
    request = first_round(rounds)
    honest, rogue = (
        push_for(request, "h", steps=24, tokens=24 * 4096),
        push_for(request, ROGUE, steps=1, tokens=2**50),
    )
    for push in (honest, rogue):
        rounds.admit(push, now=0.1)
    (merge,) = of(Merge, rounds.push_complete(honest, OK, now=0.2) + rounds.push_complete(rogue, OK, now=0.3))
    weights = dict(zip((p.learner for p in merge.pushes), merge.weights, strict=True))
    assert weights[ROGUE] == pytest.approx(16 / 17) and weights["h"] == pytest.approx(1 / 17)


def test_token_totals_saturate_and_step_times_stay_finite() -> None:
    """Totals go to the checkpoint's JSON and to the msgpack status: they stay exact integers below
    2**53, and a sum of step times stays finite, whatever a learner reports."""
    rounds = started(RoundConfig(fragments=1, sync_every=1_000_000), ("a",))
    for _ in range(3):
        rounds.step("a", 2**64 - 1, 1e308, now=1.0)
    record = rounds.learners["a"]
    assert record.tokens == MAX_TOTAL
    assert math.isfinite(record.useful_s) and math.isfinite(record.goodput(2.0))


def test_the_roster_forgets_learners_gone_longer_than_the_retention() -> None:
    """20,000 ids seen once: the roster keeps the live ones, those that left within the retention,
    at most MAX_GONE_LEARNERS of those (the most recent), and anyone whose push is still held."""
    rounds = started(RoundConfig(fragments=1, sync_every=1, quorum=1), ("live", "holder"))
    request = first_round(rounds)
    held = push_for(request, "holder")
    rounds.admit(held, now=0.1)
    rounds.push_complete(held, OK, now=0.1)
    rounds.leave("holder", now=0.2)
    (merge,) = of(Merge, rounds.tick(now=10.0))  # merging: the push is held until it is merged
    for i in range(20_000):
        rounds.join(f"id-{i}", now=float(i))
        rounds.leave(f"id-{i}", now=float(i))
    now = 20_000.0
    dropped = rounds.forget_gone(now, retention_s=1e9)
    assert len(dropped) == 20_000 - MAX_GONE_LEARNERS and "holder" not in dropped
    kept = set(rounds.learners)
    assert kept == {"live", "holder", *(f"id-{i}" for i in range(20_000 - MAX_GONE_LEARNERS, 20_000))}
    assert rounds.forget_gone(now, retention_s=10.5) == [f"id-{i}" for i in range(19_989, 18_975, -1)]
    assert set(rounds.learners) == {"live", "holder", *(f"id-{i}" for i in range(19_990, 20_000))}
    assert merge.pushes == (held,) and rounds.learners["holder"].contributions == 1
    rounds.merged(merge.round_index, now=now)
    assert "holder" in rounds.forget_gone(now + 1, retention_s=0.0)
    assert "live" in rounds.learners


def test_a_restored_learner_keeps_the_time_since_it_left() -> None:
    rounds = Rounds(RoundConfig(fragments=1, sync_every=1))
    rounds.restore_learner("a", tracked_s=100.0, useful_s=50.0, now=1000.0, idle_s=300.0)
    assert rounds.learners["a"].idle_s(1000.0) == 300.0
    assert rounds.forget_gone(1000.0, retention_s=301.0) == []
    assert rounds.forget_gone(1002.0, retention_s=301.0) == ["a"]


# ---------------------------------------------------------------------------- lock-step (QUORUM_ALL)


def lockstep_step(rounds: Rounds, learner: str, now: float, step_time_s: float = 0.05) -> list:
    """One step report of `learner` with its own step counter, as the service passes it."""
    record = rounds.learners[learner]
    return rounds.step(learner, 10, step_time_s, now, local_step=record.local_step + 1)


def test_lockstep_opens_a_round_when_the_slowest_learner_reaches_its_due_step() -> None:
    config = RoundConfig(fragments=2, sync_every=4, quorum=QUORUM_ALL, overlap=0)
    rounds = started(config, ("fast", "slow"))
    # Round 0 is due at step ceil(1 * 4 / 2) = 2; the fast learner there alone opens nothing.
    for step in range(3):
        assert of(Request, lockstep_step(rounds, "fast", now=0.1 * step)) == []
    assert of(Request, lockstep_step(rounds, "slow", now=1.0)) == []
    (request,) = of(Request, lockstep_step(rounds, "slow", now=2.0))
    assert (request.round_index, request.fragment, request.learners) == (0, 0, ("fast", "slow"))


def test_lockstep_merges_only_once_every_asked_learner_answered_and_with_no_grace() -> None:
    config = RoundConfig(fragments=1, sync_every=2, quorum=QUORUM_ALL, overlap=0)
    rounds = started(config, ("a", "b", "c"))
    for learner in ("a", "b", "c"):
        for _ in range(2):
            actions = lockstep_step(rounds, learner, now=0.0)
    (request,) = of(Request, actions)
    for learner in ("a", "b"):
        assert rounds.admit(push_for(request, learner), now=1.0) is None
        assert of(Merge, rounds.push_complete(push_for(request, learner), OK, now=1.0)) == []
    # Long after the decoupled grace window and cycle (H = 2 steps of 0.05 s), still waiting for c.
    assert of(Merge, rounds.tick(now=20.0)) == []
    # c has nothing new: NOTHING_TO_PUSH answers for it, and the round merges a and b at once.
    (merge,) = of(Merge, rounds.nothing_to_push("c", request.round_index, request.fragment, 2, now=20.5))
    assert [p.learner for p in merge.pushes] == ["a", "b"] and merge.weights == (0.5, 0.5)
    assert merge.grace_waited_s == 0.0
    record = rounds.learners["c"]
    assert (record.passes, record.pushes, record.pushes_wasted) == (1, 0, 0)
    assert "c" not in {p.learner for p in merge.pushes} and sum(rounds.rejected.values()) == 0


def test_lockstep_gives_a_silent_learner_up_after_the_lockstep_wait() -> None:
    config = RoundConfig(fragments=1, sync_every=2, quorum=QUORUM_ALL, overlap=0)
    rounds = started(config, ("a", "b"))
    for learner in ("a", "b"):
        for _ in range(2):
            actions = lockstep_step(rounds, learner, now=0.0)
    (request,) = of(Request, actions)
    rounds.admit(push_for(request, "a"), now=0.0)
    assert of(Merge, rounds.push_complete(push_for(request, "a"), OK, now=0.0)) == []
    assert rounds.next_deadline() == LOCKSTEP_MIN_WAIT_S
    (merge,) = of(Merge, rounds.tick(now=LOCKSTEP_MIN_WAIT_S))
    assert [p.learner for p in merge.pushes] == ["a"]


def test_lockstep_never_skips_a_round_of_a_busy_fragment() -> None:
    """Decoupled skips a round whose fragment still has one open; lock-step opens it once the
    earlier one has ended, so every learner's round r is the syncer's round r."""
    config = RoundConfig(fragments=1, sync_every=1, quorum=QUORUM_ALL, overlap=1)
    rounds = started(config, ("a",))
    (first,) = of(Request, lockstep_step(rounds, "a", now=0.0))
    assert of(Request, lockstep_step(rounds, "a", now=0.1)) == []  # round 1 due, fragment 0 busy
    assert rounds.next_round == 1
    rounds.admit(push_for(first, "a"), now=0.2)
    (merge,) = of(Merge, rounds.push_complete(push_for(first, "a"), OK, now=0.2))
    rounds.merged(merge.round_index, now=0.3)
    (second,) = of(Request, rounds.tick(now=0.3))
    assert (second.round_index, second.version) == (1, 1)


def test_lateness_of_snapshots_and_applies_is_kept_per_learner() -> None:
    config = RoundConfig(fragments=2, sync_every=4, quorum=1)
    rounds = started(config, ("a",))
    rounds.step("a", 10, 1.0, now=0.0)
    (request,) = of(Request, rounds.step("a", 10, 1.0, now=1.0))  # round 0, due at step 2
    push = Push("a", 0, 0, request.version, 2, 20, step=5, apply_late=1)
    assert rounds.admit(push, now=2.0) is None
    record = rounds.learners["a"]
    assert list(record.snapshot_late) == [3] and list(record.apply_late) == [1]
    # A pass for a round that did not ask it changes nothing (and counts nothing).
    assert rounds.nothing_to_push("a", 7, 1, 9, now=3.0) == [] and record.passes == 0


def test_lockstep_opens_no_round_while_a_learner_heals() -> None:
    """A learner sent its PLAN (next_round N) is asked for every round from N on: none opens
    and merges without it while it heals (it would wait at that round's due step for nothing)."""
    config = RoundConfig(fragments=1, sync_every=2, quorum=QUORUM_ALL, overlap=0)
    rounds = started(config, ("a",))
    assert rounds.begin_join("b") == 0
    for step in range(2):
        assert of(Request, lockstep_step(rounds, "a", now=0.1 * step)) == []
    (request,) = of(Request, rounds.join("b", now=1.0))  # b healed: round 0 opens, asking both
    assert (request.round_index, request.learners) == (0, ("a", "b"))
    # A session that ends before its learner healed lets the rounds go on.
    rounds.begin_join("c")
    for _ in range(2):
        lockstep_step(rounds, "a", now=2.0)  # a at step 4, round 1's due step
    for _ in range(4):
        lockstep_step(rounds, "b", now=2.0)  # b from 0 to 4
    assert rounds.admit(push_for(request, "a"), now=2.0) is None
    rounds.push_complete(push_for(request, "a"), OK, now=2.0)
    (merge,) = of(Merge, rounds.nothing_to_push("b", 0, 0, 2, now=2.0))
    rounds.merged(merge.round_index, now=2.1)
    assert of(Request, rounds.tick(now=2.2)) == []
    (second,) = of(Request, rounds.end_join("c", now=2.3))
    assert second.round_index == 1


def test_rounds_that_fall_due_while_merges_are_behind_are_skipped_until_they_catch_up() -> None:
    """A syncer whose merge worker cannot keep up (too few cores) must not queue round after round,
    each holding M pushes: with MAX_MERGES_BEHIND rounds merging, the next due rounds are skipped
    (their fragments wait for their next turn) until a merge finishes."""
    rounds = started(RoundConfig(fragments=8, sync_every=8), ("a",))
    merging = []
    step = 0
    while len(merging) < MAX_MERGES_BEHIND:
        step += 1
        (request,) = of(Request, rounds.step("a", step, 1.0, now=float(step)))
        push = push_for(request, "a")
        assert rounds.admit(push, now=step + 0.1) is None
        (merge,) = of(Merge, rounds.push_complete(push, OK, now=step + 0.2))  # the only learner
        merging.append(merge)
    for later in range(step + 1, step + 4):
        assert of(Request, rounds.step("a", later, 1.0, now=float(later))) == []
    assert rounds.rounds_skipped == {"merges-behind": 3}
    rounds.merged(merging[0].round_index, now=step + 4.0)
    (request,) = of(Request, rounds.step("a", step + 4, 1.0, now=step + 4.5))
    assert request.round_index == step + 3  # the rounds due meanwhile were skipped, not queued


def test_lock_step_skips_no_round_for_merges_behind() -> None:
    rounds = started(RoundConfig(fragments=8, sync_every=8, quorum=QUORUM_ALL), ("a",))
    for step in range(1, MAX_MERGES_BEHIND + 3):
        (request,) = of(Request, lockstep_step(rounds, "a", now=float(step)))
        push = push_for(request, "a")
        assert rounds.admit(push, now=step + 0.1) is None
        assert len(of(Merge, rounds.push_complete(push, OK, now=step + 0.2))) == 1
    assert rounds.rounds_skipped == {}
