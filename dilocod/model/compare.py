"""Whether two sides hold the same model: the same parameter names with the same shapes, or a
sentence naming the first difference. Dtypes may differ (the syncer keeps float32; a learner may
train in bf16). The syncer asks it of every JOIN, the learner of every PLAN, before anything is
trained or pushed: one comparison, worded from the side that asks.

Works on the wire's model entries only: must not import torch (the learner's network process
imports it without) or networking.
"""

from __future__ import annotations

from collections.abc import Sequence

from dilocod.wire.manifest import ModelEntry


class PlanMismatch(ValueError):
    """The other side's model is not this one; the message names the first difference."""


def first_difference(
    ours: Sequence[ModelEntry], theirs: Sequence[ModelEntry], ours_at: str, theirs_at: str
) -> str | None:
    """The first difference in names or shapes between `ours` (held at `ours_at`: "this learner",
    "the learner") and `theirs` (at `theirs_at`: "the syncer"), as a sentence; None if none."""
    other = {entry.name: entry for entry in theirs}
    for entry in ours:
        peer = other.get(entry.name)
        if peer is None:
            return f"parameter {entry.name!r} of {ours_at} is not in {_owner(theirs_at)} model"
        if peer.shape != entry.shape:
            here, there = list(entry.shape), list(peer.shape)
            return f"parameter {entry.name!r} has shape {here} at {ours_at}, {there} at {theirs_at}"
    mine = {entry.name for entry in ours}
    for entry in theirs:
        if entry.name not in mine:
            return f"parameter {entry.name!r} of {theirs_at} is not in {_owner(ours_at)} model"
    return None


def _owner(side: str) -> str:
    """ "the syncer" -> "the syncer's", "this learner" -> "this learner's"."""
    return f"{side}'s"
