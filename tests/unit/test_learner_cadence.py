"""When a learner answers a request (dilocod.learner.cadence.Cadence.answer_now), as a pure decision
over every round, step and schedule: lock-step at the due step whatever `--answer` says, decoupled
at the due step or on arrival."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dilocod.learner.cadence import ANSWERS, Cadence
from dilocod.outer.schedule import due_step
from dilocod.wire.manifest import ModelEntry
from dilocod.wire.messages import Plan

MODEL = (ModelEntry("a", "float32", (2,)), ModelEntry("b", "float32", (3,)))


def plan(quorum: int) -> Plan:
    return Plan("inc", MODEL, ((("a", 0, 2),), (("b", 0, 3),)), (0, 0), 4, 1, quorum)


schedules = st.tuples(st.integers(1, 64), st.integers(1, 256))  # P, H


@given(schedules, st.integers(0, 10_000), st.integers(0, 10_000), st.sampled_from(ANSWERS))
def test_lockstep_answers_exactly_from_the_due_step_on(
    schedule: tuple[int, int], round_index: int, step: int, answer: str
) -> None:
    fragments, sync_every = schedule
    cadence = Cadence(fragments, sync_every, 2, lockstep=True, on_arrival=answer == "arrival")
    assert cadence.answer_now(round_index, step) == (due_step(round_index, sync_every, fragments) <= step)


@given(schedules, st.integers(0, 10_000), st.integers(0, 10_000))
def test_decoupled_on_arrival_answers_every_request_at_once(
    schedule: tuple[int, int], round_index: int, step: int
) -> None:
    cadence = Cadence(*schedule, 2, lockstep=False, on_arrival=True)
    assert cadence.answer_now(round_index, step)


@given(schedules, st.integers(0, 10_000), st.integers(0, 10_000))
def test_decoupled_at_the_due_step_holds_an_early_request_at_most_a_cycle(
    schedule: tuple[int, int], round_index: int, step: int
) -> None:
    fragments, sync_every = schedule
    cadence = Cadence(fragments, sync_every, 2, lockstep=False, on_arrival=False)
    due = due_step(round_index, sync_every, fragments)
    assert cadence.answer_now(round_index, step) == (due <= step or due - step > sync_every)


def test_the_plan_fixes_the_schedule_and_the_learner_its_answer() -> None:
    assert Cadence.of(plan(quorum=1), "arrival") == Cadence(2, 4, 1, lockstep=False, on_arrival=True)
    assert Cadence.of(plan(quorum=0), "due") == Cadence(2, 4, 1, lockstep=True, on_arrival=False)
    with pytest.raises(ValueError, match="answer must be one of arrival, due, not 'soon'"):
        Cadence.of(plan(quorum=1), "soon")
