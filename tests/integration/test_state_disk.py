"""What a full disk does to real daemons: a learner trains on while its saves fail, keeping the last
good local state, and saves again once there is room; a syncer serves on while its checkpoints
fail, and when its final checkpoint fails too it still says goodbye to its learners, leaves the
previous checkpoint the newest, and exits with EX_STATE_NOT_SAVED (74).

The disk is a small tmpfs, filled with one file (devkit/mounts.py; needs root). Every
wait is on a log record, a status answer or a process exit, with a deadline.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from devkit.daemons import (
    LEARNER_ENTRY,
    start_learner,
    start_syncer,
    syncer_status,
    write_learner_entry,
)
from devkit.mounts import FILLER, fill, small_tmpfs
from dilocod.learner.state import INSTANCE_FILE, LOCK_FILE, STATE_FILE, load_local_state
from dilocod.ops.statedir import EX_STATE_NOT_SAVED
from dilocod.syncer.checkpoint import CHECKPOINTS_DIR, load_latest_checkpoint

DEADLINE_S = 120.0
#: Room for a few saves of the tests' tiny models (kilobytes each), filled up by the test.
DISK_BYTES = 1024 * 1024


@pytest.fixture
def entry_dir(tmp_path: Path) -> Path:
    return write_learner_entry(tmp_path / "entry")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _after(step: int) -> Any:
    return lambda record: record["step"] > step


def test_a_learner_trains_on_while_its_disk_is_full(tmp_path: Path, entry_dir: Path) -> None:
    """No syncer is needed: a learner trains on while its syncer is away."""
    with small_tmpfs(tmp_path / "disk", DISK_BYTES) as disk:
        learner = start_learner(
            tmp_path,
            entry_dir,
            _free_port(),
            "d",
            "--state-dir",
            str(disk),
            "--save-every-s",
            "0.2",
            "--join-timeout-s",
            "1",
        )
        try:
            learner.wait_for("saved local state", lambda record: True, DEADLINE_S)
            filler = fill(disk)
            failed = learner.wait_for("local state not saved", lambda record: True, DEADLINE_S)
            assert "No space left on device" in failed["error"], failed
            fill(disk)  # what a save that completed meanwhile freed (it replaced the older file)
            later = learner.wait_for("local state not saved", _after(failed["step"]), DEADLINE_S)
            assert learner.alive() and later["failed"] >= 2  # trained on, and tried again
            # The last good save is whole, and no partial file is left.
            saved = max(record["step"] for record in learner.log_events("saved local state"))
            state = load_local_state(disk)
            assert state is not None and state["step"] == saved < later["step"]
            assert sorted(p.name for p in disk.iterdir()) == sorted(
                [FILLER, INSTANCE_FILE, LOCK_FILE, STATE_FILE]
            )

            filler.unlink()  # room again: the next save succeeds
            learner.wait_for("saved local state", _after(later["step"]), DEADLINE_S)

            fill(disk)  # full again when it stops: the save on the way out fails
            stuck = learner.wait_for("local state not saved", _after(later["step"]), DEADLINE_S)
            fill(disk)
            assert learner.stop() == EX_STATE_NOT_SAVED, learner.stderr()
            assert "was not saved" in learner.stderr() and "the previous file is kept" in learner.stderr()
            state = load_local_state(disk)
            last = max(record["step"] for record in learner.log_events("saved local state"))
            assert state is not None and state["step"] == last < stuck["step"]
        finally:
            if learner.alive():
                learner.kill()


SYNCER_ARGS = ("--fragments", "3", "--sync-every", "6", "--quorum", "1", "--checkpoint-every-s", "0.3")


def test_a_syncer_whose_final_checkpoint_fails_says_goodbye_and_exits_74(
    tmp_path: Path, entry_dir: Path
) -> None:
    with small_tmpfs(tmp_path / "disk", DISK_BYTES) as disk:
        state_dir = disk / "syncer"
        syncer = start_syncer(tmp_path, entry_dir, state_dir, *SYNCER_ARGS, entry=LEARNER_ENTRY)
        learner = start_learner(
            tmp_path,
            entry_dir,
            syncer.port,
            "m",
            "--state-dir",
            str(tmp_path / "m"),
            "--join-timeout-s",
            "60",
        )
        try:
            learner.wait_for("joined", lambda record: True, DEADLINE_S)
            syncer.wait_for("checkpoint", lambda record: True, DEADLINE_S)
            fill(disk)
            failed = syncer.wait_for("checkpoint failed", lambda record: True, DEADLINE_S)
            assert "No space left on device" in failed["error"], failed
            fill(disk)  # what a checkpoint that completed meanwhile freed (it pruned an older one)
            syncer.wait_for(
                "checkpoint failed", lambda _: len(syncer.log_events("checkpoint failed")) >= 2, DEADLINE_S
            )
            # Periodic failures are survived, and the status says so.
            status = syncer_status(syncer.port)
            assert status["checkpoints_failed"] >= 2
            assert "No space left on device" in status["checkpoint_problem"]
            newest = syncer.log_events("checkpoint")[-1]["path"]

            assert syncer.stop() == EX_STATE_NOT_SAVED, syncer.stderr()
            assert "the final checkpoint was not written" in syncer.stderr()
            assert f"the newest checkpoint is {newest}" in syncer.stderr()
            # The learner was told, as on a clean stop.
            learner.wait_for(
                "syncer unreachable", lambda record: "syncer shutting down" in record["error"], DEADLINE_S
            )
            loaded = load_latest_checkpoint(state_dir)
            assert loaded is not None and str(loaded.path) == newest and loaded.skipped == ()
            assert not [p for p in (state_dir / CHECKPOINTS_DIR).iterdir() if p.name.startswith(".")]
        finally:
            for process in (learner, syncer):
                if process.alive():
                    process.kill()
