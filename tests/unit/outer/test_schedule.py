"""Round schedule: the quorum clock, when rounds are due, which fragment, and skipped rounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.model.plan import plan_fragments
from dilocod.outer import RoundOpening, open_rounds, quorum_clock, round_fragment, rounds_due


def test_round_fragment_cycles_through_the_plan() -> None:
    plan = plan_fragments([(f"p{i}", 10 + i) for i in range(5)], 3)
    assert [round_fragment(r, plan) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert round_fragment(49, 24) == 1
    with pytest.raises(ValueError):
        round_fragment(-1, 3)


def test_quorum_clock_is_the_kth_fastest_and_never_goes_back() -> None:
    assert quorum_clock([10, 3, 7], quorum=1) == 10
    assert quorum_clock([10, 3, 7], quorum=2) == 7
    assert quorum_clock([10, 3, 7], quorum=3) == 3
    # Fewer live learners than the quorum: the clock holds.
    assert quorum_clock([10], quorum=2, previous=4) == 4
    # The fast learner left: the 2nd fastest is now behind the clock, which stays.
    assert quorum_clock([3, 2], quorum=2, previous=7) == 7
    with pytest.raises(ValueError):
        quorum_clock([1], quorum=0)


def test_defaults_open_one_round_per_step() -> None:
    # P = H = 24: round r is due at tick r + 1.
    assert [rounds_due(g, 24, 24) for g in range(5)] == [0, 1, 2, 3, 4]
    # H = 24, P = 8: a round every 3 ticks.
    assert [rounds_due(g, 24, 8) for g in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 32), st.integers(0, 500))
def test_each_fragment_is_due_every_h_ticks(sync_every: int, fragments: int, clock: int) -> None:
    due = rounds_due(clock, sync_every, fragments)
    # Round r is due exactly when clock >= (r + 1) * H / P.
    assert due * sync_every <= clock * fragments < (due + 1) * sync_every
    # Over H ticks every fragment comes up exactly once more.
    assert rounds_due(clock + sync_every, sync_every, fragments) - due == fragments


def test_open_rounds_skips_fragments_still_in_flight() -> None:
    openings = open_rounds(clock=5, next_round=2, open_fragments={3}, sync_every=4, plan=4)
    # Rounds 2..4 are due at clock 5 (5 * 4 // 4 = 5 rounds); fragment 3 still has a round open.
    assert openings == [
        RoundOpening(2, 2, skipped=False),
        RoundOpening(3, 3, skipped=True),
        RoundOpening(4, 0, skipped=False),
    ]
    # Two rounds of one fragment due in one call: the second is skipped.
    assert open_rounds(4, 0, set(), 2, 2) == [
        RoundOpening(0, 0, False),
        RoundOpening(1, 1, False),
        RoundOpening(2, 0, True),
        RoundOpening(3, 1, True),
    ]
    assert open_rounds(clock=1, next_round=5, open_fragments=(), sync_every=24, plan=24) == []
