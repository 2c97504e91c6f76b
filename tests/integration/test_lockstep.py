"""Lock-step (`--quorum all`) with real processes: two learners, one three times slower than the
other, snapshot every fragment at exactly its due step and apply every merge exactly tau steps
later; the syncer merges both pushes in every round, with equal steps, and its status and the
learners' logs show 0 late snapshots and applies. The learners start their first step together
(a lock-step run is every learner from the first round: one that heals later joins at the rounds
then due). Every wait is on a log record, a file or a process exit, with a deadline."""

from __future__ import annotations

from pathlib import Path

import pytest

from devkit.daemons import (
    LEARNER_ENTRY,
    LEARNER_ENTRY_SOURCE,
    start_learner,
    start_syncer,
    syncer_status,
    write_learner_entry,
)
from dilocod.outer.schedule import due_step

DEADLINE_S = 180.0
FRAGMENTS = 2
SYNC_EVERY = 4
STEPS = 16
#: The fast learner's simulated step and the slow one's, three times longer.
FAST_STEP_S = 0.02
SLOW_STEP_S = 3 * FAST_STEP_S
#: The test entry's trainer, whose first step waits for the file named by LEARNER_TEST_GO_FILE.
GATED_SOURCE = """

def make_gated_trainer(ctx):
    trainer = make_trainer(ctx)
    go = os.environ.get("LEARNER_TEST_GO_FILE")
    inner = trainer.step

    def step(index):
        deadline = time.monotonic() + 120.0
        while index == 0 and go and not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.01)
        return inner(index)

    return dilocod.Trainer(
        trainer.model, trainer.optimizer, step, trainer.state_dict, trainer.load_state_dict
    )
"""
GATED_ENTRY = "learner_test_entry:make_gated_trainer"


# tau = 0; the held apply of tau >= 1 is checked step for step by the equivalence tests
# (test_equivalence.py, tau = 2 with one learner 3x slower).
@pytest.mark.parametrize("overlap", [0])
def test_lockstep_with_a_learner_three_times_slower_is_never_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: int
) -> None:
    entry_dir = write_learner_entry(tmp_path / "entry")
    (entry_dir / "learner_test_entry.py").write_text(LEARNER_ENTRY_SOURCE + GATED_SOURCE)
    go = tmp_path / "go"
    monkeypatch.setenv("LEARNER_TEST_GO_FILE", str(go))
    syncer = start_syncer(
        tmp_path,
        entry_dir,
        tmp_path / "syncer",
        "--fragments", str(FRAGMENTS), "--sync-every", str(SYNC_EVERY), "--overlap", str(overlap),
        "--quorum", "all", "--merge", "mean",
        entry=LEARNER_ENTRY,
    )  # fmt: skip
    learners = []
    try:
        for learner_id, step_s, seed in (("fast", FAST_STEP_S, "0"), ("slow", SLOW_STEP_S, "1")):
            monkeypatch.setenv("LEARNER_TEST_STEP_S", str(step_s))
            learners.append(
                start_learner(
                    tmp_path, entry_dir, syncer.port, learner_id, "--steps", str(STEPS), "--seed", seed,
                    "--entry", GATED_ENTRY,
                )
            )  # fmt: skip
        for learner in learners:
            learner.wait_for("healed", lambda record: True, DEADLINE_S)
        go.touch()
        for learner in learners:
            assert learner.process.wait(timeout=DEADLINE_S) == 0, learner.stderr()
        status = syncer_status(syncer.port)
    finally:
        for learner in learners:
            if learner.alive():
                learner.kill()
        assert syncer.stop() == 0, syncer.stderr()
    assert status["mode"] == "lock-step"
    for record in status["learners"]:
        assert record["snapshot_late_steps"]["max"] == 0, record
        assert record["apply_late_steps"]["max"] == 0, record
        assert record["pushes_wasted"] == 0 and record["passes"] == 0, record
    merged = syncer.log_events("round merged")
    rounds = sorted(record["round"] for record in merged)
    # Every round the 16 steps make due merged, in order, none skipped: the last is due at step 16.
    last = max(r for r in range(STEPS) if due_step(r, SYNC_EVERY, FRAGMENTS) <= STEPS)
    assert rounds[: last + 1] == list(range(last + 1)), rounds
    for record in merged:
        assert sorted(record["contributors"]) == ["fast", "slow"], record
        # Both learners pushed at the same step, so with the same steps and tokens: equal weights.
        assert record["weights"] == [0.5, 0.5] and len(set(record["steps"])) == 1, record
    for learner in learners:
        (holding,) = learner.log_events("holding fragments")
        assert holding["late_snapshots"] == 0 and holding["late_applies"] == 0, holding
        assert holding["snapshot_late_steps"]["max"] == 0, holding
        assert learner.log_events("round requests did not come: stepping on") == []
        assert learner.log_events("merged fragments did not come back: stepping on") == []
