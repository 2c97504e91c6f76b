"""Each learner's throughput as the syncer sees it: step reports counted over a recent window of
wall time, for `dilocod status` and the metrics.

The inverse of the mean reported step time is not a rate a person can check: a report times the
step alone, not the boundaries, saves and waits between steps, and read 4-5x above the learner's
own progress line. Pure, with injected time; the event loop owns it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: The window `dilocod status` reports steps/s over.
WINDOW_S = 60.0
#: Report times kept per learner; a faster learner's window is cut to its last MAX_KEPT steps.
MAX_KEPT = 8192


@dataclass(slots=True)
class _Reports:
    times: deque[float] = field(default_factory=deque)
    #: The newest report no longer in `times`, if any: the start of the steps that `times` counts.
    before: float | None = None


class StepRates:
    """Step reports per learner id over the last `window_s` of wall time."""

    def __init__(self, window_s: float = WINDOW_S, max_kept: int = MAX_KEPT) -> None:
        self.window_s = window_s
        self._max_kept = max_kept
        self._reports: dict[str, _Reports] = {}

    def record(self, learner: str, now: float) -> None:
        """One step report of `learner` arrived at `now`."""
        reports = self._reports.setdefault(learner, _Reports())
        reports.times.append(now)
        if len(reports.times) > self._max_kept:
            reports.before = reports.times.popleft()
        self._prune(reports, now)

    def forget(self, learner: str) -> None:
        """Drop what is kept of `learner` (the syncer's roster forgot it)."""
        self._reports.pop(learner, None)

    def rate(self, learner: str, now: float) -> float:
        """Steps per second over the last window_s (or since the learner's first report, when
        that is more recent): 0.0 for a learner without reports in the window."""
        reports = self._reports.get(learner)
        if reports is None:
            return 0.0
        self._prune(reports, now)
        steps = len(reports.times)
        if reports.before is not None:
            start = max(reports.before, now - self.window_s)
        elif steps:
            # The first report ever closes a step that began before anything was seen.
            start, steps = reports.times[0], steps - 1
        else:
            return 0.0
        elapsed = now - start
        return steps / elapsed if elapsed > 0 else 0.0

    def _prune(self, reports: _Reports, now: float) -> None:
        horizon = now - self.window_s
        while reports.times and reports.times[0] < horizon:
            reports.before = reports.times.popleft()
