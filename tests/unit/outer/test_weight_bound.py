"""outer.weights.bounded_merge_weights: a learner's reported counts can bias a merge but not own it.

Checked against float64 references written here: the bound R / (R + n // 2) on any learner's share
with n learners carrying weight, whatever one of them reports within the wire's ranges, and exact
token weighting for learners within R of the round's lower median.
"""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.outer.weights import MAX_WEIGHT_RATIO, bounded_merge_weights, merge_weights
from dilocod.wire.limits import DEFAULT_LIMITS

R = MAX_WEIGHT_RATIO
#: (tokens, steps) of an honest push: batches of 1 to 2**16 tokens, up to 10**4 steps.
honest_push = st.integers(1, 10**4).flatmap(lambda s: st.tuples(st.integers(0, s * 2**16), st.just(s)))
#: Anything a learner may report within the wire's ranges.
any_push = st.tuples(
    st.integers(0, DEFAULT_LIMITS.max_push_tokens), st.integers(0, DEFAULT_LIMITS.max_reported_steps)
)


def share_bound(n: int) -> float:
    return R / (R + n // 2)


@settings(max_examples=300, deadline=None)
@given(honest=st.lists(honest_push, min_size=1, max_size=8), rogue=st.lists(any_push, min_size=1, max_size=2))
def test_no_learner_owns_the_merge(honest: list[tuple[int, int]], rogue: list[tuple[int, int]]) -> None:
    """One learner (with up to two pushes in the round) reporting anything: with n >= 2 learners
    carrying weight, nobody's share exceeds R / (R + n // 2)."""
    pushes = [*honest, *rogue]
    owners = [f"h{i}" for i in range(len(honest))] + ["rogue"] * len(rogue)
    tokens, steps = [t for t, _ in pushes], [s for _, s in pushes]
    if not any(t > 0 and s > 0 for t, s in pushes):
        with pytest.raises(ValueError):
            bounded_merge_weights(tokens, steps, owners)
        return
    weights = bounded_merge_weights(tokens, steps, owners)
    assert math.fsum(weights) == pytest.approx(1.0, rel=1e-12)
    shares: dict[str, float] = {}
    for owner, weight in zip(owners, weights, strict=True):
        shares[owner] = shares.get(owner, 0.0) + weight
    carrying = sum(1 for share in shares.values() if share > 0)
    if carrying >= 2:
        assert max(shares.values()) <= share_bound(carrying) * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(honest_push, min_size=1, max_size=8))
def test_learners_within_the_ratio_keep_their_exact_weights(pushes: list[tuple[int, int]]) -> None:
    raw = [t * t / s for t, s in pushes]
    positive = [w for w in raw if w > 0]
    tokens, steps = [t for t, _ in pushes], [s for _, s in pushes]
    if not positive:
        return
    got = bounded_merge_weights(tokens, steps, list(range(len(pushes))))
    if max(positive) <= R * statistics.median_low(positive):
        assert got == pytest.approx(merge_weights(tokens, steps), rel=1e-12, abs=1e-300)
    else:  # the largest are clipped to R times the lower median, the rest keep their proportions
        cap = R * statistics.median_low(positive)
        want = [min(w, cap) for w in raw]
        assert got == pytest.approx([w / math.fsum(want) for w in want], rel=1e-12, abs=1e-300)


def test_batches_four_times_apart_keep_token_weighting() -> None:
    assert bounded_merge_weights([4 * 2400, 2400], [24, 24], ["a", "b"]) == pytest.approx([16 / 17, 1 / 17])
    # Three learners, one 4x the others' batches: 16 / 18 for it, exactly tokens x tokens per step.
    assert bounded_merge_weights([9600, 2400, 2400], [24] * 3, ["a", "b", "c"]) == pytest.approx(
        merge_weights([9600, 2400, 2400], [24] * 3)
    )


def test_a_rogue_token_count_is_clipped() -> None:
    """2**62 tokens took 100 % of every round; within the wire's range (2**50) the rogue takes
    at most 16/17 beside one honest learner, 16/19 beside three (the bound: 16/18)."""
    assert merge_weights([2**50, 24 * 4096], [1, 24])[0] == pytest.approx(1.0)
    assert bounded_merge_weights([2**50, 24 * 4096], [1, 24], ["r", "h"])[0] == pytest.approx(16 / 17)
    three = bounded_merge_weights([2**50, *[24 * 4096] * 3], [1, 24, 24, 24], ["r", "a", "b", "c"])
    assert three[0] == pytest.approx(16 / 19) and three[0] <= share_bound(4)


def test_two_pushes_of_one_learner_are_one_learner() -> None:
    """A late push merged beside its learner's own answer: clipped together, proportions kept."""
    weights = bounded_merge_weights([2**40, 2**40, 100], [1, 1, 1], ["r", "r", "h"])
    assert weights[0] == pytest.approx(weights[1]) and weights[0] + weights[1] == pytest.approx(16 / 17)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="owners"):
        bounded_merge_weights([1, 2], [1, 1], ["a"])
    with pytest.raises(ValueError, match="max_ratio"):
        bounded_merge_weights([1], [1], ["a"], max_ratio=0.5)
    with pytest.raises(ValueError, match="no contribution"):
        bounded_merge_weights([0, 5], [1, 0], ["a", "b"])
