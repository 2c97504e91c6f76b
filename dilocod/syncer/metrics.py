"""The syncer's status as Prometheus metrics: a fresh registry rendered from `status()` at every
scrape, so the two can never disagree. Names follow Prometheus conventions (units as suffixes,
counters ending in _total)."""

from __future__ import annotations

from typing import Any

from dilocod.ops.metrics import Registry


def render_syncer_metrics(status: dict[str, Any]) -> str:
    registry = Registry()
    registry.gauge("dilocod_syncer_uptime_seconds", "Seconds since the syncer started.").set(
        status["uptime_s"]
    )
    registry.gauge("dilocod_syncer_clock_steps", "The global clock (the K-th fastest live learner).").set(
        status["clock"]
    )
    version = registry.gauge("dilocod_fragment_version", "Merged version of each fragment.", ("fragment",))
    for fragment in status["fragments"]:
        version.labels(fragment=str(fragment["index"])).set(fragment["version"])
    connected = registry.gauge("dilocod_learner_connected", "1 while the learner is connected.", ("learner",))
    contributions = registry.counter(
        "dilocod_learner_contributions_total", "Pushes merged into the global model.", ("learner",)
    )
    share = registry.gauge("dilocod_learner_weight_share", "Share of all merge weight so far.", ("learner",))
    rate = registry.gauge("dilocod_learner_steps_per_second", "Running mean of the step rate.", ("learner",))
    goodput = registry.gauge(
        "dilocod_learner_goodput_ratio",
        "Reported step time over wall time since the learner id first joined.",
        ("learner",),
    )
    for learner in status["learners"]:
        name = learner["id"]
        connected.labels(learner=name).set(1.0 if learner["connected"] else 0.0)
        contributions.labels(learner=name).inc(learner["contributions"])
        share.labels(learner=name).set(learner["weight_share"])
        rate.labels(learner=name).set(learner["steps_per_s"])
        goodput.labels(learner=name).set(learner["goodput"])
    registry.counter("dilocod_rounds_merged_total", "Rounds merged.").inc(status["rounds_merged"])
    registry.counter("dilocod_rounds_abandoned_total", "Rounds dropped without a merge.").inc(
        status["rounds_abandoned"]
    )
    skipped = registry.counter(
        "dilocod_rounds_skipped_total", "Rounds due but not opened, by reason.", ("reason",)
    )
    for reason, count in status["rounds_skipped"].items():
        skipped.labels(reason=reason).inc(count)
    registry.gauge("dilocod_late_pushes_on_disk", "Late pushes waiting for their next round in files.").set(
        status["late_pushes_on_disk"]
    )
    quorum = registry.counter(
        "dilocod_rounds_by_quorum_size_total", "Merged rounds by contributors.", ("size",)
    )
    for size, count in status["quorum_sizes"].items():
        quorum.labels(size=size).inc(count)
    registry.counter("dilocod_grace_waited_seconds_total", "Time spent waiting in grace windows.").inc(
        status["grace_waited_s"]
    )
    registry.counter("dilocod_received_bytes_total", "Outer-gradient bytes received.").inc(status["bytes_in"])
    registry.counter("dilocod_sent_bytes_total", "Update bytes sent.").inc(status["bytes_out"])
    registry.counter(
        "dilocod_chunks_asked_again_total", "Chunks of pushes that arrived damaged and were asked for again."
    ).inc(status["chunks_asked_again"])
    registry.counter(
        "dilocod_fragments_held_at_join_total",
        "Fragments a rejoining learner already held at their version: not sent again.",
    ).inc(status["fragments_held_at_join"])
    registry.counter(
        "dilocod_chunks_resumed_total",
        "Chunks of updates and pushes cut short by a lost session that the receiver held: not sent again.",
    ).inc(status["chunks_resumed"])
    rejected = registry.counter(
        "dilocod_rejected_pushes_total", "Pushes refused or screened out.", ("reason",)
    )
    for reason, count in status["rejected_by_reason"].items():
        rejected.labels(reason=reason).inc(count)
    registry.counter("dilocod_checkpoints_total", "Checkpoints written.").inc(status["checkpoints_written"])
    registry.gauge(
        "dilocod_checkpoints_failed", "Checkpoints failed in a row since the last one written."
    ).set(status["checkpoints_failed"])
    registry.counter(
        "dilocod_session_handler_errors_total", "Sessions whose handler failed by a bug (logged)."
    ).inc(status["handler_errors"])
    lag = registry.gauge(
        "dilocod_event_loop_lag_seconds", "Event-loop lag over the last minute.", ("quantile",)
    )
    for quantile, key in (("0.5", "p50"), ("0.99", "p99"), ("1", "max")):
        lag.labels(quantile=quantile).set(status["loop_lag_ms"][key] / 1e3)
    return registry.render()
