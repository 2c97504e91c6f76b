"""The one comparison of two sides' models (dilocod.model.compare): names and shapes, in both
directions, worded from the side that asks; dtypes may differ."""

from __future__ import annotations

from dilocod.model.compare import first_difference
from dilocod.wire.manifest import ModelEntry

LEARNER = [ModelEntry("a", "bfloat16", (2, 3)), ModelEntry("b", "bfloat16", (4,))]
SYNCER = [ModelEntry("b", "float32", (4,)), ModelEntry("a", "float32", (2, 3))]


def differ(learner: list[ModelEntry], syncer: list[ModelEntry]) -> str | None:
    return first_difference(learner, syncer, "the learner", "the syncer")


def test_the_same_names_and_shapes_in_any_order_and_dtype_are_the_same_model() -> None:
    assert differ(LEARNER, SYNCER) is None


def test_the_first_difference_is_named_from_the_side_that_asks() -> None:
    reshaped = [ModelEntry("a", "float32", (3, 2)), SYNCER[0]]
    assert differ(LEARNER, reshaped) == "parameter 'a' has shape [2, 3] at the learner, [3, 2] at the syncer"
    assert differ(LEARNER, SYNCER[:1]) == "parameter 'a' of the learner is not in the syncer's model"
    extra = [*SYNCER, ModelEntry("c", "float32", (1,))]
    assert differ(LEARNER, extra) == "parameter 'c' of the syncer is not in the learner's model"
    asked_by_learner = first_difference(LEARNER, extra, "this learner", "the syncer")
    assert asked_by_learner == "parameter 'c' of the syncer is not in this learner's model"
