"""A learner stopped the routine way (SIGTERM, as systemd stops it) while it trains with a syncer:
it exits 0 and logs nothing at level error, from either of its processes (the network process
shares its stderr). Only real faults log at error: an operator's alert on them must not fire at
every stop. Every wait is on a log record or the process's exit, with a deadline."""

from __future__ import annotations

from pathlib import Path

from devkit.daemons import LEARNER_ENTRY, start_learner, start_syncer, write_learner_entry

DEADLINE_S = 180.0
SYNCER_ARGS = ("--fragments", "3", "--sync-every", "6", "--quorum", "1")
ROUNDS_BEFORE_STOP = 5


def test_a_sigterm_while_syncing_logs_no_error(tmp_path: Path) -> None:
    entry_dir = write_learner_entry(tmp_path / "entry")
    syncer = start_syncer(tmp_path, entry_dir, tmp_path / "syncer", *SYNCER_ARGS, entry=LEARNER_ENTRY)
    learner = start_learner(tmp_path, entry_dir, syncer.port, "routine", "--state-dir", str(tmp_path / "m"))
    try:
        # Fragments requested, pushed and merged back all the while: the network process has
        # messages in flight to the training side when it stops.
        syncer.wait_for(
            "round merged",
            lambda r: r["round"] >= ROUNDS_BEFORE_STOP and "routine" in r["contributors"],
            DEADLINE_S,
        )
        assert learner.stop() == 0, learner.stderr()
    finally:
        if learner.alive():
            learner.kill()
        assert syncer.stop() == 0, syncer.stderr()
    assert learner.log_events("learner stopped"), learner.stderr()
    errors = [line for line in learner.lines if '"level": "error"' in line]
    # Mutation caught: the network process taking the training side's close with its inbox unread
    # (ECONNRESET) for a fault ("the training process's messages cannot be read").
    assert errors == [], errors
