"""What `dilocod demo` and `dilocod status` print at the end of a run, in words a newcomer reads:
the eval loss with its unit, its starting point and its meaning; quorum sizes as a sentence."""

from __future__ import annotations

import math

from dilocod.demo import Scored
from dilocod.examples.charlm import trainer as charlm_trainer
from dilocod.ops.status import describe_quorum_sizes, format_status


def test_the_eval_loss_comes_with_its_unit_start_and_meaning() -> None:
    scored = Scored(
        final=2.1234,
        initial=5.5512,
        unit=charlm_trainer.EVAL_LOSS_UNIT,
        meaning=charlm_trainer.EVAL_LOSS_MEANING,
    )
    first, meaning = scored.summary(3.0).splitlines()
    assert first == (
        "eval loss: 2.123 nats per byte (the syncer's global model on held-out data after 3 min; "
        "5.551 before training)"
    )
    assert f"{math.log(256):.3f}" in meaning and "bits per byte" in meaning


def test_an_entry_without_a_unit_still_reads_cleanly() -> None:
    assert Scored(final=0.01, initial=0.83).summary(0.5) == (
        "eval loss: 0.01 (the syncer's global model on held-out data after 0.5 min; 0.83 before training)"
    )


def test_quorum_sizes_read_as_a_sentence() -> None:
    assert describe_quorum_sizes({"1": 40, "2": 12}) == "40 rounds with 1 learner, 12 with 2"
    assert describe_quorum_sizes({"3": 5, "2": 5}) == "5 rounds with 2 learners, 5 with 3"
    assert describe_quorum_sizes({"2": 1}) == "1 round with 2 learners"
    assert describe_quorum_sizes({}) == "no round merged yet"


def test_status_shows_the_quorum_sentence() -> None:
    status = {
        "role": "syncer",
        "incarnation": "abc",
        "uptime_s": 60.0,
        "clock": 10,
        "next_round": 11,
        "rounds_merged": 52,
        "rounds_abandoned": 0,
        "quorum_sizes": {"1": 40, "2": 12},
        "grace_waited_s": 0.5,
        "bytes_in": 0,
        "bytes_out": 0,
        "rejected_pushes": 0,
        "checkpoints_written": 1,
        "fragments": [{"index": 0, "version": 52}],
        "learners": [],
    }
    assert "quorum: 40 rounds with 1 learner, 12 with 2" in format_status(status)
