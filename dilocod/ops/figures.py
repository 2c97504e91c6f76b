"""Summary figures of samples for status and progress lines: p50, p99 and max.

Pure: imports nothing of dilocod, so any layer (the learner's cadence, the syncer's status, the
event-loop lag) may summarise its samples the same way.
"""

from __future__ import annotations

from collections.abc import Collection


def quantiles(samples: Collection[float]) -> dict[str, float]:
    """p50, p99 and max of samples (zeros when there are none), rounded to 3 decimals (integer
    samples stay integers)."""
    if not samples:
        return {"p50": 0, "p99": 0, "max": 0}
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(pick(0.5), 3), "p99": round(pick(0.99), 3), "max": round(ordered[-1], 3)}
