"""The syncer's status as Prometheus metrics: every scrape renders the families from `status()`
(a collector over the status, prometheus_client's exposition), so the two can never disagree.
Names follow Prometheus conventions (units as suffixes, counters ending in _total)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: A family's samples: one value, or (label values, value) pairs.
Samples = float | Iterable[tuple[tuple[str, ...], float]]


def _family(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    help_text: str,
    samples: Samples,
    labels: tuple[str, ...] = (),
) -> Metric:
    family = kind(name, help_text, labels=list(labels))
    for values, value in [((), samples)] if isinstance(samples, int | float) else samples:
        family.add_metric(list(values), float(value))
    return family


def gauge(name: str, help_text: str, samples: Samples, labels: tuple[str, ...] = ()) -> Metric:
    return _family(GaugeMetricFamily, name, help_text, samples, labels)


def counter(name: str, help_text: str, samples: Samples, labels: tuple[str, ...] = ()) -> Metric:
    return _family(CounterMetricFamily, name, help_text, samples, labels)


def by(values: Mapping[str, float]) -> list[tuple[tuple[str, ...], float]]:
    """A count per label value ({reason: count}) as samples."""
    return [((key,), value) for key, value in values.items()]


def syncer_families(status: Mapping[str, Any]) -> Iterator[Metric]:
    learners = status["learners"]

    def per_learner(key: str, convert: Any = float) -> list[tuple[tuple[str, ...], float]]:
        return [((learner["id"],), convert(learner[key])) for learner in learners]

    yield gauge("dilocod_syncer_uptime_seconds", "Seconds since the syncer started.", status["uptime_s"])
    yield gauge(
        "dilocod_syncer_clock_steps", "The global clock (the K-th fastest live learner).", status["clock"]
    )
    yield gauge(
        "dilocod_fragment_version",
        "Merged version of each fragment.",
        [((str(f["index"]),), f["version"]) for f in status["fragments"]],
        ("fragment",),
    )
    yield gauge(
        "dilocod_learner_connected",
        "1 while the learner is connected.",
        per_learner("connected", lambda up: 1.0 if up else 0.0),
        ("learner",),
    )
    yield counter(
        "dilocod_learner_contributions_total",
        "Pushes merged into the global model.",
        per_learner("contributions"),
        ("learner",),
    )
    yield gauge(
        "dilocod_learner_weight_share",
        "Share of all merge weight so far.",
        per_learner("weight_share"),
        ("learner",),
    )
    yield gauge(
        "dilocod_learner_steps_per_second",
        "Running mean of the step rate.",
        per_learner("steps_per_s"),
        ("learner",),
    )
    yield gauge(
        "dilocod_learner_goodput_ratio",
        "Reported step time over wall time since the learner id first joined.",
        per_learner("goodput"),
        ("learner",),
    )
    yield counter("dilocod_rounds_merged_total", "Rounds merged.", status["rounds_merged"])
    yield counter(
        "dilocod_rounds_abandoned_total", "Rounds dropped without a merge.", status["rounds_abandoned"]
    )
    yield counter(
        "dilocod_rounds_skipped_total",
        "Rounds due but not opened, by reason.",
        by(status["rounds_skipped"]),
        ("reason",),
    )
    yield gauge(
        "dilocod_late_pushes_on_disk",
        "Late pushes waiting for their next round in files.",
        status["late_pushes_on_disk"],
    )
    yield counter(
        "dilocod_rounds_by_quorum_size_total",
        "Merged rounds by contributors.",
        by(status["quorum_sizes"]),
        ("size",),
    )
    yield counter(
        "dilocod_grace_waited_seconds_total", "Time spent waiting in grace windows.", status["grace_waited_s"]
    )
    yield counter("dilocod_received_bytes_total", "Outer-gradient bytes received.", status["bytes_in"])
    yield counter("dilocod_sent_bytes_total", "Update bytes sent.", status["bytes_out"])
    yield counter(
        "dilocod_chunks_asked_again_total",
        "Chunks of pushes that arrived damaged and were asked for again.",
        status["chunks_asked_again"],
    )
    yield counter(
        "dilocod_fragments_held_at_join_total",
        "Fragments a rejoining learner already held at their version: not sent again.",
        status["fragments_held_at_join"],
    )
    yield counter(
        "dilocod_chunks_resumed_total",
        "Chunks of updates and pushes cut short by a lost session that the receiver held: not sent again.",
        status["chunks_resumed"],
    )
    yield counter(
        "dilocod_rejected_pushes_total",
        "Pushes refused or screened out.",
        by(status["rejected_by_reason"]),
        ("reason",),
    )
    yield counter("dilocod_checkpoints_total", "Checkpoints written.", status["checkpoints_written"])
    yield gauge(
        "dilocod_checkpoints_failed",
        "Checkpoints failed in a row since the last one written.",
        status["checkpoints_failed"],
    )
    yield counter(
        "dilocod_session_handler_errors_total",
        "Sessions whose handler failed by a bug (logged).",
        status["handler_errors"],
    )
    lag = status["loop_lag_ms"]
    yield gauge(
        "dilocod_event_loop_lag_seconds",
        "Event-loop lag over the last minute.",
        [(("0.5",), lag["p50"] / 1e3), (("0.99",), lag["p99"] / 1e3), (("1",), lag["max"] / 1e3)],
        ("quantile",),
    )


class _StatusCollector(Collector):
    def __init__(self, status: Mapping[str, Any]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        return syncer_families(self._status)


def render_syncer_metrics(status: Mapping[str, Any]) -> str:
    """The exposition text (format 0.0.4) of the syncer's status."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(status))
    return generate_latest(registry).decode()
