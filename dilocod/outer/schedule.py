"""When rounds open and which fragment each round syncs (docs/design.md §3.2), as pure functions.

The syncer's clock g is the step count of the K-th fastest live learner: it advances when that
learner completes a step, so K slow or dead learners never hold the others back and a single fast
one never runs the schedule ahead of the quorum. With P fragments and H steps between two syncs
of the same fragment, round r is due once g >= (r + 1) * H / P, and round r syncs fragment r mod P;
a round whose fragment still has an open round is skipped (that fragment waits for its next turn
rather than queueing a second request behind the first).

The syncer owns the state (the clock, the next round index, the open fragments) and passes it in.
Must not import networking, clocks or logging.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol


class Fragmented(Protocol):
    """A plan of fragments (dilocod.model.plan.FragmentPlan): the schedule needs their count only."""

    @property
    def num_fragments(self) -> int: ...


def _fragment_count(plan: Fragmented | int) -> int:
    count = plan if isinstance(plan, int) else plan.num_fragments
    if count < 1:
        raise ValueError(f"the number of fragments must be at least 1, got {count}")
    return count


def round_fragment(round_index: int, plan: Fragmented | int) -> int:
    """The fragment round round_index syncs: round_index mod P."""
    if round_index < 0:
        raise ValueError(f"round index must not be negative, got {round_index}")
    return round_index % _fragment_count(plan)


def quorum_clock(learner_steps: Iterable[int], quorum: int, previous: int = 0) -> int:
    """The syncer's clock: the step count of the quorum-th fastest live learner, never going back.

    learner_steps are the completed steps of the live learners. With fewer than quorum of them the
    clock stays at previous; a fast learner leaving may lower the K-th count, and the clock then
    also stays where it was, so rounds already opened are never due again.
    """
    if quorum < 1:
        raise ValueError(f"quorum must be at least 1, got {quorum}")
    steps = sorted(learner_steps, reverse=True)
    if len(steps) < quorum:
        return previous
    return max(previous, steps[quorum - 1])


def rounds_due(clock: int, sync_every: int, plan: Fragmented | int) -> int:
    """How many rounds are due by clock g: round r is due once g >= (r + 1) * H / P.

    Integer arithmetic, so H need not be a multiple of P: with H = 30 and P = 24 the rounds come at
    ticks 2, 3, 4, 5, 7, ... (every H / P = 1.25 ticks on average), never drifting.
    """
    if sync_every < 1:
        raise ValueError(f"sync_every (H) must be at least 1, got {sync_every}")
    if clock < 0:
        raise ValueError(f"clock must not be negative, got {clock}")
    return clock * _fragment_count(plan) // sync_every


def due_step(round_index: int, sync_every: int, plan: Fragmented | int) -> int:
    """The clock (a learner's step count) at which round round_index falls due: the smallest g
    with rounds_due(g) > round_index, i.e. ceil((round_index + 1) * H / P)."""
    if round_index < 0:
        raise ValueError(f"round index must not be negative, got {round_index}")
    if sync_every < 1:
        raise ValueError(f"sync_every (H) must be at least 1, got {sync_every}")
    return -(-(round_index + 1) * sync_every // _fragment_count(plan))


@dataclass(frozen=True, slots=True)
class RoundOpening:
    round_index: int
    fragment: int
    #: True when a round for this fragment was still open: nothing is requested for this round.
    skipped: bool


def open_rounds(
    clock: int,
    next_round: int,
    open_fragments: Collection[int],
    sync_every: int,
    plan: Fragmented | int,
) -> list[RoundOpening]:
    """The rounds from next_round that clock has made due, each opened or skipped.

    open_fragments are the fragments with a round in flight; a fragment opened earlier in the same
    call counts as open for the rest of it. The caller continues from the last round returned + 1.
    """
    if next_round < 0:
        raise ValueError(f"next_round must not be negative, got {next_round}")
    busy = set(open_fragments)
    openings: list[RoundOpening] = []
    for round_index in range(next_round, rounds_due(clock, sync_every, plan)):
        fragment = round_fragment(round_index, plan)
        skipped = fragment in busy
        busy.add(fragment)
        openings.append(RoundOpening(round_index, fragment, skipped))
    return openings
