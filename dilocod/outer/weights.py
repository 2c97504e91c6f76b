"""Merge weights of the learners in a round (docs/design.md §3.4 step 2).

w_m = c_tokens_m * (c_tokens_m / c_steps_m): the tokens a learner processed since its anchor times
its tokens per step, so a learner that trained more, on larger batches, counts more. Normalised to
sum to one; a learner with zero steps (nothing trained) gets weight 0. Plain Python floats (float64).
Must not import networking, clocks or logging.
"""

from __future__ import annotations

from collections.abc import Sequence


def merge_weights(c_tokens: Sequence[int | float], c_steps: Sequence[int | float]) -> list[float]:
    """Normalised weights tokens * (tokens / steps); ValueError when no learner carries weight."""
    if len(c_tokens) != len(c_steps):
        raise ValueError(f"{len(c_tokens)} token counts for {len(c_steps)} step counts")
    raw: list[float] = []
    for m, (tokens, steps) in enumerate(zip(c_tokens, c_steps, strict=True)):
        if tokens < 0 or steps < 0:
            raise ValueError(f"learner {m}: negative counts (tokens {tokens}, steps {steps})")
        raw.append(0.0 if steps == 0 else float(tokens) * (float(tokens) / float(steps)))
    total = sum(raw)
    if not total > 0.0:
        raise ValueError("no contribution carries weight: every learner has zero tokens or zero steps")
    return [w / total for w in raw]
