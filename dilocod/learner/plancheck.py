"""Whether the syncer's plan is about this learner's model: the same parameter names with the same
shapes, or a PlanMismatch naming the first difference, before anything is trained or pushed.

Checked by the learner's network side at every JOIN and by the training side when it lays the plan
out (dilocod.learner.layout). Works on the wire's model entries only: must not import torch (the
network process imports it without) or networking.
"""

from __future__ import annotations

from collections.abc import Sequence

from dilocod.wire.manifest import ModelEntry
from dilocod.wire.messages import Plan


class PlanMismatch(ValueError):
    """The syncer's model is not this learner's model; the message names the first difference."""


def check_plan(plan: Plan, ours: Sequence[ModelEntry]) -> None:
    theirs = {e.name: e for e in plan.model}
    for entry in ours:
        other = theirs.get(entry.name)
        if other is None:
            raise PlanMismatch(f"parameter {entry.name!r} of this learner is not in the syncer's model")
        if other.shape != entry.shape:
            here, there = list(entry.shape), list(other.shape)
            raise PlanMismatch(
                f"parameter {entry.name!r} has shape {here} at this learner, {there} at the syncer"
            )
    mine = {e.name for e in ours}
    for entry in plan.model:
        if entry.name not in mine:
            raise PlanMismatch(f"the syncer's parameter {entry.name!r} is missing from this learner's model")
