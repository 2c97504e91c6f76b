"""The round state machine feeds the guard every screened push, rejected ones too, so a lasting
change in the learners' outer-gradient scale cannot lock a fragment out. Pure: Rounds and the real
guard, scripted pushes, explicit `now` values."""

from __future__ import annotations

import torch

from dilocod.outer.guard import NORM_TOO_LARGE, check_outer_gradient
from dilocod.syncer.rounds import Merge, Push, Request, RoundConfig, Rounds

STEPS = 4
LEARNERS = ("a", "b")


def of(kind: type, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]


def one_round(rounds: Rounds, scale: float, now: float) -> tuple[int, tuple[str, ...]]:
    """Every learner trains a cycle and pushes an outer gradient of norm `scale` (its push screened
    against the fragment's history, as the service does); returns the pushes rejected by the
    median check and the learners merged."""
    actions = []
    for _ in range(STEPS):
        for learner in LEARNERS:
            actions += rounds.step(learner, 100, 0.01, now)
    (request,) = of(Request, actions)
    merges = []
    for learner in LEARNERS:
        push = Push(learner, request.round_index, request.fragment, request.version, STEPS, 100 * STEPS)
        assert rounds.admit(push, now) is None
        verdict = check_outer_gradient(
            [torch.tensor([scale])],
            rounds.norm_history[push.fragment].samples(),
            steps=push.c_steps,
            fragment_norm=None,
        )
        merges += of(Merge, rounds.push_complete(push, verdict, now))
    for merge in merges:
        rounds.merged(merge.round_index, now)
        for learner in LEARNERS:
            rounds.update_done(learner, merge.fragment, merge.version + 1, now)
    return rounds.rejected[NORM_TOO_LARGE], tuple(p.learner for m in merges for p in m.pushes)


def test_a_lasting_jump_in_scale_cannot_lock_the_fragment_out() -> None:
    """Measured on main: after a lasting jump of the outer-gradient scale above --max-norm-ratio,
    only accepted norms fed the median and every later push of the fragment was rejected (38
    honest pushes in 3 s) until the syncer restarted. Now the rejected ones teach the guard the
    new scale: two rounds are rejected, and every later round merges both learners again."""
    rounds = Rounds(RoundConfig(fragments=1, sync_every=STEPS, quorum=len(LEARNERS)))
    for learner in LEARNERS:
        rounds.join(learner, 0.0)
    now = 0.0
    for _ in range(6):
        now += 1.0
        rejected, merged = one_round(rounds, 1.0, now)
        assert (rejected, merged) == (0, LEARNERS)
    merged_after = []
    for _ in range(20):
        now += 1.0
        rejected, merged = one_round(rounds, 20.0, now)
        merged_after.append(merged)
    assert rejected <= 2 * len(LEARNERS)
    assert merged_after[2:] == [LEARNERS] * 18
    # The rejected pushes are in the history the next screens compare against.
    assert [s.norm for s in rounds.norm_history[0].samples()][-2:] == [20.0, 20.0]
