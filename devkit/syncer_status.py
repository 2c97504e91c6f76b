"""A syncer's status as `dilocod.syncer` reports it (the dict behind `dilocod status --json` and the
/metrics page), with every field at a plain value: what the metrics tests render and serve."""

from __future__ import annotations

from typing import Any


def status_of(**changes: Any) -> dict[str, Any]:
    """A syncer status as status() returns it, with `changes`."""
    status: dict[str, Any] = {
        "uptime_s": 12.5,
        "clock": 40,
        "fragments": [{"index": 0, "version": 3}],
        "learners": [],
        "rounds_merged": 3,
        "rounds_abandoned": 0,
        "rounds_skipped": {},
        "late_pushes_on_disk": 0,
        "quorum_sizes": {},
        "grace_waited_s": 0.0,
        "bytes_in": 0,
        "bytes_out": 0,
        "chunks_asked_again": 0,
        "fragments_held_at_join": 0,
        "chunks_resumed": 0,
        "rejected_by_reason": {},
        "checkpoints_written": 1,
        "checkpoints_failed": 0,
        "handler_errors": 0,
        "loop_lag_ms": {"p50": 0.1, "p99": 0.5, "max": 1.0},
    }
    return {**status, **changes}
