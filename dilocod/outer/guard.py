"""Screening an outer gradient before it is merged, and the merged result before it is committed
(docs/design.md §3.4, late pushes and guards).

An outer gradient is rejected when it holds non-finite values; when its norm is above
max_fragment_ratio times the fragment's own norm, or times FRAGMENT_RMS_FLOOR · √n when that is
larger (n values; the floor lets a fragment of zeros take its first updates), from the very first
push: the absolute backstop, which nothing a learner says moves; and when its norm is above what
the recent pushes of the fragment make plausible, once min_history of them are known:

    ‖δ‖ > max_norm_ratio · q · clamp(s, S / STEP_SPAN, STEP_SPAN · S)

s the steps the push carries, q the median norm per step (‖δ‖ / s) and S the median steps of the
pushes in the fragment's NormHistory. Normalised by its steps, a push that carries more of them
(a learner that missed rounds, or steps faster than the others) is not an outlier for that; the
steps count only within STEP_SPAN of the median both ways, so a learner claiming a huge count
gains at most that factor.

The history holds the pushes of the fragment's last NORM_WINDOW_ROUNDS rounds, one per learner and
round, rejected ones too: a lasting change in scale (a learning-rate warm-up, a new phase of
training) is re-learned once it holds half the window, while a one-off outlier is not. Fed only
accepted norms, a lasting jump above the ratio rejected every later push of the fragment until the
syncer restarted. What one learner can do to the median: while more than half of the window's
samples are other learners', neither median leaves the range of theirs (rank statistics), so a
lone rogue among several honest learners never teaches the guard its scale: its pushes pass only
up to max_norm_ratio · STEP_SPAN · q · S, q and S within the honest samples' range, and under the
backstop. (A learner joining under several ids counts once per id.)

The answer is a Verdict value for the syncer to log and count, never an exception. A merge is
checked once more on its result: `l2_norm` of the new parameters and momentum is finite exactly
when every value is, and the caller commits the merge only then (NON_FINITE_RESULT).
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
#: Below this many samples in the history the median means little; it is not checked.
DEFAULT_MIN_HISTORY = 3
#: Rounds of a fragment whose pushes the median is taken over. Short, so a lasting change in scale
#: is re-learned in a few rounds (it holds half the window after NORM_WINDOW_ROUNDS / 2 of them) and
#: a scale doubling every round stays within 16/3 of the median (a warm-up is never rejected); with
#: one learner, a one-off outlier is a quarter of the window and never the median.
NORM_WINDOW_ROUNDS = 4
#: A push's steps are counted within this factor of the history's median steps, both ways: honest
#: outer gradients grow between √s (noise) and s (drift) in their steps s, so a push at the others'
#: norm per step passes with up to max_norm_ratio · STEP_SPAN times the median steps, and with any
#: fewer; a learner claiming more steps than it trained gains at most this factor.
STEP_SPAN = 4.0
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


@dataclass(frozen=True, slots=True)
class NormSample:
    """One screened push as the median sees it: its norm and the steps it carries."""

    norm: float
    steps: int

    @property
    def usable(self) -> bool:
        """Whether it says anything about the scale: a finite, positive norm over at least a step
        (an empty push, δ = 0, would pull the median to zero)."""
        return math.isfinite(self.norm) and self.norm > 0.0 and self.steps >= 1

    @property
    def per_step(self) -> float:
        return self.norm / self.steps


class NormHistory:
    """The samples one fragment's screen compares against: the pushes screened in the fragment's
    last `rounds` rounds (by round index), accepted or not, one per learner and round (a later push
    of the same learner for the same round replaces its sample). Samples that are not usable are
    not kept. The caller keeps one per fragment: norms of fragments of different sizes are not
    comparable."""

    def __init__(self, rounds: int = NORM_WINDOW_ROUNDS) -> None:
        if rounds < 1:
            raise ValueError(f"a norm history needs at least one round, got {rounds}")
        self._rounds = rounds
        self._by_round: dict[int, dict[str, NormSample]] = {}

    def record(self, round_index: int, learner: str, norm: float, steps: int) -> None:
        sample = NormSample(norm, steps)
        if not sample.usable:
            return
        self._by_round.setdefault(round_index, {})[learner] = sample
        while len(self._by_round) > self._rounds:
            del self._by_round[min(self._by_round)]

    def samples(self) -> list[NormSample]:
        """A copy, oldest round first (safe to hand to another thread)."""
        return [s for _, by_learner in sorted(self._by_round.items()) for s in by_learner.values()]

    def __len__(self) -> int:
        return sum(len(by_learner) for by_learner in self._by_round.values())


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


def history_limit(
    history: Sequence[NormSample], steps: int, max_norm_ratio: float, min_history: int = DEFAULT_MIN_HISTORY
) -> float | None:
    """The largest norm the history makes plausible for a push of `steps` steps (see the module
    docstring), or None while it holds fewer than min_history usable samples."""
    usable = [s for s in history if s.usable]
    if len(usable) < max(1, min_history):
        return None
    per_step = statistics.median(s.per_step for s in usable)
    median_steps = statistics.median(s.steps for s in usable)
    counted = min(max(float(steps), median_steps / STEP_SPAN), median_steps * STEP_SPAN)
    return max_norm_ratio * per_step * counted


def _check_ratio(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be finite and positive, got {value}")


def check_outer_gradient(
    delta: Sequence[Tensor],
    history: Sequence[NormSample],
    *,
    steps: int,
    fragment_norm: float | None,
    max_fragment_ratio: float = DEFAULT_MAX_FRAGMENT_RATIO,
    max_norm_ratio: float = DEFAULT_MAX_NORM_RATIO,
    min_history: int = DEFAULT_MIN_HISTORY,
) -> Verdict:
    """Accept or reject one outer gradient (a fragment's tensors, carrying `steps` inner steps)
    against the fragment's norm (‖Θ_p‖ of the tensors it updates; None skips that bound) and the
    fragment's history."""
    _check_ratio("max_fragment_ratio", max_fragment_ratio)
    _check_ratio("max_norm_ratio", max_norm_ratio)
    norm = l2_norm(delta)
    if not math.isfinite(norm):
        return Verdict(False, NON_FINITE, norm, None)
    limits: list[tuple[float, str]] = []
    if fragment_norm is not None:
        numel = sum(t.numel() for t in delta)
        limits.append((fragment_limit(fragment_norm, numel, max_fragment_ratio), FRAGMENT_NORM_TOO_LARGE))
    plausible = history_limit(history, steps, max_norm_ratio, min_history)
    if plausible is not None:
        limits.append((plausible, NORM_TOO_LARGE))
    for limit, reason in limits:
        if norm > limit:
            return Verdict(False, reason, norm, limit)
    return Verdict(True, ACCEPTED, norm, min((limit for limit, _ in limits), default=None))
