"""Screening an outer gradient before it is merged, and the merged result before it is committed
(docs/design.md §3.4, late pushes and guards).

An outer gradient is rejected when it holds non-finite values; when its norm is above
max_fragment_ratio times the fragment's own norm, or times FRAGMENT_RMS_FLOOR · √n when that is
larger (n values; the floor lets a fragment of zeros take its first updates), from the very first
push; and when its norm is above max_norm_ratio times the running median of recently accepted
norms, once there are min_history of them. One diverged, buggy or hostile learner must not move the
global model far, nor make it non-finite. The answer is a Verdict value for the syncer to log and
count, never an exception. The history (the norms of recently accepted outer gradients, e.g. a
deque with a maxlen) and the fragment's norm belong to the caller.

A merge is checked once more on its result: `l2_norm` of the new parameters and momentum is finite
exactly when every value is, and the caller commits the merge only then (NON_FINITE_RESULT).
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
FRAGMENT_NORM_TOO_LARGE = "norm-above-fragment"
#: Not a push's verdict: a merge whose new parameters or momentum hold non-finite values.
NON_FINITE_RESULT = "non-finite-result"

DEFAULT_MAX_NORM_RATIO = 10.0
#: Below this many accepted norms the median means little; it is not checked.
DEFAULT_MIN_HISTORY = 3
#: ‖δ‖ ≤ ratio · max(‖Θ_p‖, FRAGMENT_RMS_FLOOR · √n). Honest outer gradients stay far below: a
#: charlm learner at 5 times its default lr for 200 inner steps from the initial weights (the largest
#: moves of a run) reached 0.17 of the bound's max(...) term, i.e. 1/58 of this default.
DEFAULT_MAX_FRAGMENT_RATIO = 10.0
#: Per value: the scale a fragment is given when its own is smaller (all-zero biases, small inits),
#: so a zero fragment accepts outer gradients of RMS up to the ratio. Far above the RMS of honest
#: outer gradients (0.01 to 0.2 in the run above), far below float32's range.
FRAGMENT_RMS_FLOOR = 1.0


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted: bool
    #: ACCEPTED, NON_FINITE, FRAGMENT_NORM_TOO_LARGE or NORM_TOO_LARGE.
    reason: str
    #: L2 norm of the whole outer gradient (inf or nan when it holds non-finite values).
    norm: float
    #: The norm limit applied (the tighter of the two when both are), or None when none was (a
    #: non-finite push, or no fragment norm given while the history is too short).
    limit: float | None


def l2_norm(tensors: Sequence[Tensor]) -> float:
    """The L2 norm of all the tensors' values together: finite exactly when every value is finite
    (float32 squares that overflow are redone in float64, which holds any float32 value's square)."""
    total = 0.0
    for t in tensors:
        if t.numel() == 0:
            continue
        sq = squared_norm(t.detach().to(torch.float32))
        if not math.isfinite(sq) and bool(torch.isfinite(t).all()):
            # float32 squares overflowed (|x| above about 1e19): redo this tensor in float64.
            sq = float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64)) ** 2
        total += sq
    return math.sqrt(total)


def fragment_limit(fragment_norm: float, numel: int, max_fragment_ratio: float) -> float:
    """The largest outer-gradient norm a fragment of numel values and norm fragment_norm accepts."""
    floor = FRAGMENT_RMS_FLOOR * math.sqrt(numel)
    # A fragment norm that is not finite gives no scale: the floor alone applies.
    scale = fragment_norm if math.isfinite(fragment_norm) and fragment_norm > floor else floor
    return max_fragment_ratio * scale


def _check_ratio(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be finite and positive, got {value}")


def check_outer_gradient(
    delta: Sequence[Tensor],
    history: Sequence[float],
    *,
    fragment_norm: float | None,
    max_fragment_ratio: float = DEFAULT_MAX_FRAGMENT_RATIO,
    max_norm_ratio: float = DEFAULT_MAX_NORM_RATIO,
    min_history: int = DEFAULT_MIN_HISTORY,
) -> Verdict:
    """Accept or reject one outer gradient (a fragment's tensors) against the fragment's norm
    (‖Θ_p‖ of the tensors it updates; None skips that bound) and the accepted history."""
    _check_ratio("max_fragment_ratio", max_fragment_ratio)
    _check_ratio("max_norm_ratio", max_norm_ratio)
    norm = l2_norm(delta)
    if not math.isfinite(norm):
        return Verdict(False, NON_FINITE, norm, None)
    limits: list[tuple[float, str]] = []
    if fragment_norm is not None:
        numel = sum(t.numel() for t in delta)
        limits.append((fragment_limit(fragment_norm, numel, max_fragment_ratio), FRAGMENT_NORM_TOO_LARGE))
    if len(history) >= max(1, min_history):
        median = statistics.median(history)
        # A median of zero (only empty updates so far) gives no scale to compare against.
        if median > 0.0:
            limits.append((max_norm_ratio * median, NORM_TOO_LARGE))
    for limit, reason in limits:
        if norm > limit:
            return Verdict(False, reason, norm, limit)
    return Verdict(True, ACCEPTED, norm, min((limit for limit, _ in limits), default=None))
