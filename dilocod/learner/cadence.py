"""When a learner serves a round and applies its merge, in its own step count (docs/design.md §3.3),
as pure decisions: the training loop asks, and does the waiting and the tensor work itself.

Round r syncs fragment r mod P and falls due at step s_r = ceil((r + 1) * H / P)
(dilocod.outer.schedule.due_step). In lock-step (PLAN quorum 0) the learner snapshots fragment p at
exactly s_r, waiting there for the round's request, and applies the merge at exactly s_r + tau,
waiting there for it (with tau = 0, before its next step). Decoupled (K < M), it never waits: a
request is answered at the first boundary after it came (`--answer arrival`, the default), or
with `--answer due` at s_r if it came by then, else at the first boundary after it came; a
merge is applied at the first boundary after it came. How many steps late each snapshot and apply was
is measured against s_r and s_r + tau.

Must not import torch, networking, clocks or logging.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dilocod.ops.figures import quantiles
from dilocod.outer.schedule import due_step, round_fragment, rounds_due
from dilocod.wire.messages import Plan

#: When a decoupled learner answers a request (`--answer`): on arrival, or at its due step.
ANSWERS = ("arrival", "due")
#: Lateness samples kept by the learner for its progress line's median and p99.
LATE_SAMPLES = 1024


@dataclass(frozen=True, slots=True)
class Cadence:
    """The schedule a PLAN fixes (P, H, tau, lock-step, the first round the syncer may ask), and
    the learner's own choice of when a decoupled request is answered (`--answer`)."""

    fragments: int
    sync_every: int
    overlap: int
    lockstep: bool
    first_round: int = 0
    #: Decoupled only: answer a request at the first boundary after it came, even before its due
    #: step (`--answer arrival`); no default here, the learner's setting has it.
    on_arrival: bool = field(kw_only=True)

    @classmethod
    def of(cls, plan: Plan, answer: str) -> Cadence:
        if answer not in ANSWERS:
            raise ValueError(f"answer must be one of {', '.join(ANSWERS)}, not {answer!r}")
        return cls(
            len(plan.fragments),
            plan.sync_every,
            plan.overlap,
            plan.lockstep,
            plan.next_round,
            on_arrival=answer == "arrival",
        )

    def due(self, round_index: int) -> int:
        """s_r: the step at whose boundary round round_index is served."""
        return due_step(round_index, self.sync_every, self.fragments)

    def fragment(self, round_index: int) -> int:
        return round_fragment(round_index, self.fragments)

    def rounds_due_by(self, step: int, after: int) -> range:
        """Rounds from `after` (and first_round) on that are due by `step`."""
        return range(max(after, self.first_round), rounds_due(step, self.sync_every, self.fragments))

    def answer_now(self, round_index: int, step: int) -> bool:
        """Whether a request for round_index held at this step's boundary is answered now: at its
        due step or later. Decoupled, also any request when answering on arrival, and a request
        whose due step is more than a cycle ahead: the syncer's clock and this learner's count
        then disagree (it joined later, or restored an older state), and holding the request a
        cycle would only keep its push out of every round."""
        due = self.due(round_index)
        if due <= step:
            return True
        return not self.lockstep and (self.on_arrival or due - step > self.sync_every)

    def late(self, round_index: int, step: int) -> int:
        """Steps between round_index's due step and a snapshot at `step` (0 when not after it)."""
        return max(0, step - self.due(round_index))


@dataclass(frozen=True, slots=True)
class InFlight:
    """A fragment pushed and not yet applied back: its round, the step of the snapshot, and the
    version its anchor held; and the fragment's counters (steps, tokens at its last send) before
    and after this push, to count its steps again if the push is lost."""

    round: int
    step: int
    base_version: int
    counted_from: tuple[int, int] | None = None
    counted_to: tuple[int, int] | None = None


@dataclass(slots=True)
class Lateness:
    """Steps late of the learner's snapshots and applies, the newest LATE_SAMPLES of each."""

    snapshots: deque[int] = field(default_factory=lambda: deque(maxlen=LATE_SAMPLES))
    applies: deque[int] = field(default_factory=lambda: deque(maxlen=LATE_SAMPLES))
    late_snapshots: int = 0
    late_applies: int = 0

    def snapshot(self, steps: int) -> None:
        self.snapshots.append(steps)
        self.late_snapshots += steps > 0

    def apply(self, steps: int) -> None:
        self.applies.append(steps)
        self.late_applies += steps > 0

    def summary(self) -> dict[str, object]:
        return {
            "late_snapshots": self.late_snapshots,
            "snapshot_late_steps": quantiles(self.snapshots),
            "late_applies": self.late_applies,
            "apply_late_steps": quantiles(self.applies),
        }
