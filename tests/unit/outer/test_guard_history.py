"""The guard's median over recent pushes (outer/guard.py): it re-learns a lasting change in scale
within a few rounds, keeps rejecting one-off outliers, never rejects a warm-up, judges a push by
its norm per step, and a lone rogue among several honest learners cannot teach it its scale.

Each test screens scripted pushes round by round, as the syncer does: a push is screened against
the samples recorded so far, then recorded whatever the verdict."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.outer.guard import (
    DEFAULT_MAX_NORM_RATIO,
    NORM_TOO_LARGE,
    NORM_WINDOW_ROUNDS,
    STEP_SPAN,
    NormHistory,
    NormSample,
    Verdict,
    check_outer_gradient,
    history_limit,
)

#: Steps per push of an ordinary round (H / P of a run): what the history's median steps settle at.
STEPS = 24
#: Honest pushes of one scale vary by this factor either way from push to push.
JITTER = 1.25


def screen(history: NormHistory, round_index: int, learner: str, norm: float, steps: int = STEPS) -> Verdict:
    """Screen one push of this norm (no fragment bound), then record it, as Rounds.push_complete does."""
    verdict = check_outer_gradient(
        [torch.tensor([norm], dtype=torch.float64)], history.samples(), steps=steps, fragment_norm=None
    )
    history.record(round_index, learner, verdict.norm, steps)
    return verdict


def run_rounds(
    history: NormHistory, start: int, scales: Sequence[float], learners: Sequence[str], rng: random.Random
) -> list[list[bool]]:
    """Every learner pushes once a round at that round's scale (jittered, in a shuffled order);
    per round, whether each push was accepted."""
    accepted = []
    for offset, scale in enumerate(scales):
        order = list(learners)
        rng.shuffle(order)
        verdicts = [
            screen(history, start + offset, learner, scale * rng.uniform(1 / JITTER, JITTER))
            for learner in order
        ]
        accepted.append([v.accepted for v in verdicts])
    return accepted


LEARNERS = st.integers(1, 4).map(lambda n: [f"learner-{i}" for i in range(n)])


def test_a_20x_lasting_change_is_accepted_again_within_a_few_rounds() -> None:
    """The lock-out measured on main: a lasting 20x jump rejected every later push of the fragment
    until a restart (38 honest pushes in 3 s). Now the jump fills half the window in two rounds."""
    history = NormHistory()
    rng = random.Random(0)
    before = run_rounds(history, 0, [1.0] * 8, ["a"], rng)
    after = run_rounds(history, 8, [20.0] * 12, ["a"], rng)
    assert all(all(r) for r in before)
    first_accepted = next(i for i, r in enumerate(after) if all(r))
    assert first_accepted <= 2  # the third round after the jump (well within ten)
    assert all(all(r) for r in after[first_accepted:])


@settings(max_examples=100, deadline=None)
@given(
    factor=st.floats(DEFAULT_MAX_NORM_RATIO * 1.01, 1e6),
    up=st.booleans(),
    rounds_before=st.integers(1, 12),
    learners=LEARNERS,
    seed=st.integers(0, 2**32 - 1),
)
def test_any_lasting_change_of_scale_is_relearned_in_two_rounds(
    factor: float, up: bool, rounds_before: int, learners: list[str], seed: int
) -> None:
    """Up or down by any factor, for every learner: at most the next two rounds are rejected, and
    every push from then on is accepted."""
    history = NormHistory()
    rng = random.Random(seed)
    run_rounds(history, 0, [1.0] * rounds_before, learners, rng)
    scale = factor if up else 1 / factor
    after = run_rounds(history, rounds_before, [scale] * 10, learners, rng)
    assert all(all(r) for r in after[2:])


@settings(max_examples=100, deadline=None)
@given(
    rounds_before=st.integers(3, 12),  # a history of at least DEFAULT_MIN_HISTORY samples
    learners=LEARNERS,
    position=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_one_off_100x_push_is_still_rejected(
    rounds_before: int, learners: list[str], position: int, seed: int
) -> None:
    history = NormHistory()
    rng = random.Random(seed)
    run_rounds(history, 0, [1.0] * rounds_before, learners, rng)
    outlier = learners[position % len(learners)]
    verdict = screen(history, rounds_before, outlier, 100.0)
    assert (verdict.accepted, verdict.reason) == (False, NORM_TOO_LARGE)
    # The others' pushes of that round, and everyone's after it, are accepted.
    for learner in learners:
        if learner != outlier:
            assert screen(history, rounds_before, learner, 1.0).accepted
    assert all(all(r) for r in run_rounds(history, rounds_before + 1, [1.0] * 6, learners, rng))


@settings(max_examples=100, deadline=None)
@given(rounds_before=st.integers(0, 12), learners=LEARNERS, seed=st.integers(0, 2**32 - 1))
def test_a_warm_up_doubling_every_round_is_never_rejected(
    rounds_before: int, learners: list[str], seed: int
) -> None:
    """A learning-rate warm-up: the scale doubles every round for 5 rounds (32x), then stays, from
    the first round of training or after a steady start."""
    history = NormHistory()
    rng = random.Random(seed)
    scales = [1.0] * rounds_before + [2.0**k for k in range(1, 6)] + [32.0] * 6
    assert all(all(r) for r in run_rounds(history, 0, scales, learners, rng))


def test_a_push_is_judged_by_its_norm_per_step() -> None:
    """Outer gradients grow with the steps they carry (at most linearly, when every step moves the
    same way): a learner that missed rounds, or steps faster, pushes more steps and a larger norm,
    and is not an outlier for that; an outlier at the usual step count still is."""
    history = NormHistory()
    for index in range(NORM_WINDOW_ROUNDS):
        screen(history, index, "a", 1.0)
        screen(history, index, "b", 1.0)
    samples = history.samples()
    for multiple in (2, 5, 10, 40):  # norm proportional to steps: up to ratio x STEP_SPAN x the median
        steps = multiple * STEPS
        limit = history_limit(samples, steps, DEFAULT_MAX_NORM_RATIO)
        assert limit is not None and float(multiple) <= limit
        assert check_outer_gradient(
            [torch.tensor([float(multiple)])], samples, steps=steps, fragment_norm=None
        ).accepted
    # Fewer steps than usual never make a push less plausible (noise grows as their square root).
    for steps in (1, 3, STEPS // 2):
        assert check_outer_gradient(
            [torch.tensor([math.sqrt(steps / STEPS)])], samples, steps=steps, fragment_norm=None
        ).accepted
    # Without more steps, 20x is an outlier; with 20x the steps, it is not.
    assert not check_outer_gradient([torch.tensor([20.0])], samples, steps=STEPS, fragment_norm=None).accepted
    assert check_outer_gradient(
        [torch.tensor([20.0])], samples, steps=20 * STEPS, fragment_norm=None
    ).accepted


@settings(max_examples=200, deadline=None)
@given(claimed=st.integers(1, 2**40), median_steps=st.integers(1, 10_000))
def test_claiming_steps_buys_at_most_the_step_span(claimed: int, median_steps: int) -> None:
    """The steps are the learner's own word: whatever it claims, the history allows it at most
    ratio x STEP_SPAN times the median norm per step times the median steps."""
    samples = [NormSample(2.0, median_steps)] * 3
    limit = history_limit(samples, claimed, DEFAULT_MAX_NORM_RATIO)
    per_push = 2.0  # the median norm per step times the median steps
    assert limit is not None
    assert per_push * DEFAULT_MAX_NORM_RATIO / STEP_SPAN <= limit * (1 + 1e-12)
    assert limit <= per_push * DEFAULT_MAX_NORM_RATIO * STEP_SPAN * (1 + 1e-12)


@settings(max_examples=100, deadline=None)
@given(
    honest=st.integers(2, 5),
    factor=st.one_of(
        st.floats(1.1 * DEFAULT_MAX_NORM_RATIO * STEP_SPAN * JITTER, 1e12), st.floats(1e-12, 1e-2)
    ),
    claimed=st.integers(1, 2**40),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_lone_rogue_among_honest_learners_never_teaches_the_guard_its_scale(
    honest: int, factor: float, claimed: int, seed: int
) -> None:
    """A rogue pushing every round, far above or far below the honest scale, with any step count it
    likes: among two or more honest learners it is always a minority of the window, so the medians
    stay within the honest samples' range. Its large pushes are never accepted, and no honest push
    is ever rejected, however long it keeps at it."""
    history = NormHistory()
    rng = random.Random(seed)
    learners = [f"honest-{i}" for i in range(honest)]
    run_rounds(history, 0, [1.0] * 2, learners, rng)  # it joins a running fragment
    for index in range(2, 2 + 5 * NORM_WINDOW_ROUNDS):
        order = [*learners, "rogue"]
        rng.shuffle(order)
        for learner in order:
            if learner == "rogue":
                verdict = screen(history, index, "rogue", factor, steps=claimed)
                assert factor < 1 or not verdict.accepted
            else:
                assert screen(history, index, learner, rng.uniform(1 / JITTER, JITTER)).accepted


def test_the_history_keeps_one_sample_per_learner_and_round_for_its_last_rounds() -> None:
    history = NormHistory(rounds=2)
    history.record(0, "a", 1.0, 4)
    history.record(0, "a", 3.0, 4)  # the same learner again for the same round (a rejoin): replaced
    history.record(0, "b", 2.0, 4)
    assert history.samples() == [NormSample(3.0, 4), NormSample(2.0, 4)]
    for unusable in ((0.0, 4), (math.inf, 4), (math.nan, 4), (1.0, 0)):
        history.record(1, "a", *unusable)
    assert len(history) == 2
    history.record(5, "a", 5.0, 4)
    history.record(9, "a", 9.0, 4)  # a third round: the oldest goes
    assert history.samples() == [NormSample(5.0, 4), NormSample(9.0, 4)]
    history.record(1, "b", 1.0, 4)  # a late push of a round older than the window: not kept
    assert history.samples() == [NormSample(5.0, 4), NormSample(9.0, 4)]
    with pytest.raises(ValueError, match="at least one round"):
        NormHistory(rounds=0)
