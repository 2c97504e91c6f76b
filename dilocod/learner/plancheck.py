"""Whether the syncer's plan is about this learner's model: the same parameter names with the same
shapes, or a PlanMismatch naming the first difference, before anything is trained or pushed; and
whether an update is the plan's layout of its fragment at a precision updates travel at
(UpdateRefused otherwise).

Checked by the learner's network side at every JOIN and by the training side when it lays the plan
out (dilocod.learner.layout). Works on the wire's model entries only: must not import torch (the
network process imports it without) or networking.
"""

from __future__ import annotations

from collections.abc import Sequence

from dilocod.wire.layouts import push_layout
from dilocod.wire.manifest import ModelEntry, TensorEntry
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


class UpdateRefused(ValueError):
    """An update whose manifest is not its fragment's layout at fp32 or bf16: the syncer's bug."""


#: The precisions a learner accepts updates at (a syncer's --update-precision).
UPDATE_PRECISIONS = ("fp32", "bf16")


def update_precision(
    fragment: int, layout: Sequence[TensorEntry], manifest: Sequence[TensorEntry], raw_bytes: int
) -> str:
    """Which precision an update of a fragment travels at: its manifest and size must be the
    plan's layout of that fragment (`layout`, fp32: same names and shapes, in order) at fp32 or
    bf16; else UpdateRefused says how it differs."""
    shapes = [(entry.name, entry.shape) for entry in layout]
    for precision in UPDATE_PRECISIONS:
        expected, size = push_layout(shapes, precision)
        if tuple(manifest) == expected and raw_bytes == size:
            return precision
    dtypes = sorted({entry.dtype for entry in manifest})
    theirs = [(entry.name, entry.shape) for entry in manifest]
    why = (
        f"its tensors differ from the plan's ({len(theirs)} listed, the plan has {len(shapes)})"
        if theirs != shapes
        else f"its dtypes are {dtypes} and its {raw_bytes} bytes are laid out otherwise"
    )
    raise UpdateRefused(f"an update of fragment {fragment} is not the plan's layout at fp32 or bf16: {why}")
