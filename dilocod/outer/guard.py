"""Screening an outer gradient before it is merged (docs/design.md §3.4, late pushes and guards).

Non-finite values, and norms above max_norm_ratio times the running median of recently accepted
norms, are rejected: one diverged or buggy learner must not move the global model. The answer is
a Verdict value for the syncer to log and count, never an exception. The history (the norms of
recently accepted outer gradients, e.g. a deque with a maxlen) belongs to the caller.
Must not import networking, clocks or logging.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dilocod.outer.merge import squared_norm

ACCEPTED = "accepted"
NON_FINITE = "non-finite"
NORM_TOO_LARGE = "norm-above-median"

DEFAULT_MAX_NORM_RATIO = 10.0
#: Below this many accepted norms the median means little; only finiteness is checked.
DEFAULT_MIN_HISTORY = 3


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted: bool
    #: ACCEPTED, NON_FINITE or NORM_TOO_LARGE.
    reason: str
    #: L2 norm of the whole outer gradient (inf or nan when it holds non-finite values).
    norm: float
    #: The norm limit applied, or None while the history is too short (or its median is zero).
    limit: float | None


def _norm(delta: Sequence[Tensor]) -> float:
    total = 0.0
    for t in delta:
        if t.numel() == 0:
            continue
        sq = squared_norm(t.detach().to(torch.float32))
        if not math.isfinite(sq) and bool(torch.isfinite(t).all()):
            # float32 squares overflowed (|x| above about 1e19): redo this tensor in float64.
            sq = float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64)) ** 2
        total += sq
    return math.sqrt(total)


def check_outer_gradient(
    delta: Sequence[Tensor],
    history: Sequence[float],
    *,
    max_norm_ratio: float = DEFAULT_MAX_NORM_RATIO,
    min_history: int = DEFAULT_MIN_HISTORY,
) -> Verdict:
    """Accept or reject one outer gradient (a fragment's tensors) against the accepted history."""
    if not (math.isfinite(max_norm_ratio) and max_norm_ratio > 0.0):
        raise ValueError(f"max_norm_ratio must be finite and positive, got {max_norm_ratio}")
    norm = _norm(delta)
    if not math.isfinite(norm):
        return Verdict(False, NON_FINITE, norm, None)
    limit: float | None = None
    if len(history) >= max(1, min_history):
        median = statistics.median(history)
        # A median of zero (only empty updates so far) gives no scale to compare against.
        if median > 0.0:
            limit = max_norm_ratio * median
    if limit is not None and norm > limit:
        return Verdict(False, NORM_TOO_LARGE, norm, limit)
    return Verdict(True, ACCEPTED, norm, limit)
