"""Whether the syncer's plan is about this learner's model: the same parameter names with the same
shapes, or a PlanMismatch naming the first difference, before anything is trained or pushed; and
whether an update is the plan's layout of its fragment at the precision its header states, one
updates travel at (UpdateRefused otherwise).

Checked by the learner's network side at every JOIN and by the training side when it lays the plan
out (dilocod.learner.layout). Works on the wire's model entries only: must not import torch (the
network process imports it without) or networking.
"""

from __future__ import annotations

from collections.abc import Sequence

from dilocod.model.compare import PlanMismatch, first_difference
from dilocod.wire.choices import UPDATE_PRECISIONS
from dilocod.wire.layouts import push_layout
from dilocod.wire.manifest import ModelEntry, TensorEntry
from dilocod.wire.messages import Plan


def check_plan(plan: Plan, ours: Sequence[ModelEntry]) -> None:
    """PlanMismatch naming the first difference if the plan's model is not this learner's."""
    why = first_difference(ours, plan.model, "this learner", "the syncer")
    if why is not None:
        raise PlanMismatch(why)


class UpdateRefused(ValueError):
    """An update at a precision updates do not travel at, or whose manifest is not its fragment's
    layout at the precision it states: the syncer's bug."""


def check_update(
    fragment: int,
    layout: Sequence[TensorEntry],
    precision: str,
    manifest: Sequence[TensorEntry],
    raw_bytes: int,
) -> None:
    """An update of a fragment at the precision its header states: its manifest and size must be
    the plan's layout of that fragment (`layout`, fp32: same names and shapes, in order) at that
    precision, one of UPDATE_PRECISIONS; else UpdateRefused says how it differs."""
    if precision not in UPDATE_PRECISIONS:
        accepted = " or ".join(UPDATE_PRECISIONS)
        raise UpdateRefused(f"an update of fragment {fragment} at {precision}: updates travel at {accepted}")
    shapes = [(entry.name, entry.shape) for entry in layout]
    expected, size = push_layout(shapes, precision)
    if tuple(manifest) == expected and raw_bytes == size:
        return
    theirs = [(entry.name, entry.shape) for entry in manifest]
    why = (
        f"its tensors differ from the plan's ({len(theirs)} listed, the plan has {len(shapes)})"
        if theirs != shapes
        else f"its {raw_bytes} bytes are laid out otherwise (the plan's layout has {size})"
    )
    raise UpdateRefused(f"an update of fragment {fragment} is not the plan's layout at {precision}: {why}")
