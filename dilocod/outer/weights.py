"""Merge weights of the learners in a round (docs/design.md §3.4 step 2).

w_m = c_tokens_m * (c_tokens_m / c_steps_m): the tokens a learner processed since its anchor times
its tokens per step, so a learner that trained more, on larger batches, counts more. Normalised to
sum to one; a learner with zero steps (nothing trained) gets weight 0. Plain Python floats (float64).

The counts are the learners' own word. `bounded_merge_weights` keeps any one learner from owning a
merge with them: each learner's weight is clipped at MAX_WEIGHT_RATIO times the lower median of the
learners' weights in the round. With n >= 2 learners carrying weight, no learner's share exceeds
R / (R + n // 2) (R = MAX_WEIGHT_RATIO): 16/17 with 2 or 3 learners, 16/18 with 4 or 5. Learners
within R of that median (batch sizes up to 4x apart at equal step counts) keep their exact weights.
Must not import networking, clocks or logging.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence

#: A learner weighs at most this many times the lower median of the weights in its round.
MAX_WEIGHT_RATIO = 16.0


def merge_weights(c_tokens: Sequence[int | float], c_steps: Sequence[int | float]) -> list[float]:
    """Normalised weights tokens * (tokens / steps); ValueError when no learner carries weight."""
    return _normalised(_raw_weights(c_tokens, c_steps))


def bounded_merge_weights(
    c_tokens: Sequence[int | float],
    c_steps: Sequence[int | float],
    owners: Sequence[Hashable],
    max_ratio: float = MAX_WEIGHT_RATIO,
) -> list[float]:
    """merge_weights, with each owner's summed weight (a learner may hold two pushes in a round)
    clipped at max_ratio times the lower median of the owners' positive sums; the pushes of a
    clipped owner keep their proportions. ValueError when no learner carries weight."""
    if len(owners) != len(c_tokens):
        raise ValueError(f"{len(owners)} owners for {len(c_tokens)} token counts")
    if not max_ratio >= 1.0:
        raise ValueError(f"max_ratio must be at least 1, got {max_ratio}")
    raw = _raw_weights(c_tokens, c_steps)
    per_owner: dict[Hashable, float] = {}
    for owner, weight in zip(owners, raw, strict=True):
        per_owner[owner] = per_owner.get(owner, 0.0) + weight
    positive = [w for w in per_owner.values() if w > 0.0]
    if positive:
        cap = max_ratio * statistics.median_low(positive)
        scale = {owner: cap / w if w > cap else 1.0 for owner, w in per_owner.items()}
        raw = [w * scale[owner] for owner, w in zip(owners, raw, strict=True)]
    return _normalised(raw)


def _raw_weights(c_tokens: Sequence[int | float], c_steps: Sequence[int | float]) -> list[float]:
    if len(c_tokens) != len(c_steps):
        raise ValueError(f"{len(c_tokens)} token counts for {len(c_steps)} step counts")
    raw: list[float] = []
    for m, (tokens, steps) in enumerate(zip(c_tokens, c_steps, strict=True)):
        if tokens < 0 or steps < 0:
            raise ValueError(f"learner {m}: negative counts (tokens {tokens}, steps {steps})")
        raw.append(0.0 if steps == 0 else float(tokens) * (float(tokens) / float(steps)))
    return raw


def _normalised(raw: list[float]) -> list[float]:
    total = sum(raw)
    if not total > 0.0:
        raise ValueError("no contribution carries weight: every learner has zero tokens or zero steps")
    return [w / total for w in raw]
