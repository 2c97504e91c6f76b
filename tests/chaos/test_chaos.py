"""Chaos on real processes: a syncer and three learners training the embedded model (charlm) on
loopback for 100 s under a schedule of more than a hundred faults, against a fault-free run of the
same length (devkit/chaos/harness.py runs both; devkit/chaos/proxy.py is the network seam).

The faults: corrupt chunk payloads both ways, frames truncated on data and control connections,
learners killed with -9 half way through a push and half way through an update (each restarted on
its state directory), SIGSTOP for 3 s and for 40 s (past the 30 s idle timeout of the transport,
so the syncer drops the session and the learner reconnects and heals on SIGCONT), a 20 s partition
(two thirds of the idle timeout: the session survives it, at full scale, nothing is scaled down),
a learner severed for 3 s, and the syncer killed with -9 and restarted on its checkpoints.

What must hold, from `dilocod status --json` (sampled every second), the daemons' JSON logs, their
state directories and the proxy's ledger of what the syncer acknowledged: no daemon crashes (exit
codes; no internal error in any log) and the syncer logs bad input as the learner's fault; a
corrupt chunk is asked for again (CHUNK_RESEND) both ways, not its transfer reset; no push
acknowledged by the syncer is lost or merged twice; versions never fall, not even below the last
checkpoint across the syncer's kill; while one learner (K = 1) is live and unimpaired, versions
rise within every 6 s; learners never stop stepping unless stopped; after the faults every learner
holds the syncer's fragments byte for byte; resident memory does not grow; goodput is reported.

Two things are held here to looser bounds than their targets (bench/chaos.py measures them
over repeated pairs of runs and bench/RESULTS.md §8 records them):
- eval loss: compared at equal steps (both runs keep every checkpoint with the steps trained by
  then; the mean loss of the chaos run's last TAIL_CHECKPOINTS against the fault-free run's loss
  interpolated at each of their steps), since runs of equal wall time on two shared cores do
  unequal work when something else runs (a pair of the
  benchmark differed by 10.6 % at equal wall time, its chaos run stepping 30 % less); within 5 %
  (EQUAL_STEPS_BOUND) here against a target of 3 %: the global model's loss moves by up to 2.6 %
  between two checkpoints, so one final checkpoint gave -1.7 % to +4.0 % in six pairs of the
  benchmark, and the mean of the last six gave -1.3 % to -0.6 % in four pairs (bench/RESULTS.md
  §8); one pair is still not enough to tell 3 % from its spread, while a broken merge or an
  accepted corrupt fragment costs far more than that;
- goodput of the survivor (learner c: network faults and the syncer's restart, never killed or
  stopped): at least 75 % here, against a target of 85 %; without faults at least 90 %, and the
  learners the schedule kills and stops must show the time they lost.

Asserted since the syncer's two round bugs that chaos runs found were fixed: no fragment's version
stands still for FRAGMENT_STALL_S while learners are live (the norm screen once shut a fragment out
for good after zero-step pushes had pulled its median to zero; carried late pushes once answered for
their learners, so rounds merged before the learners' own pushes, which then came with no steps).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from devkit.chaos.harness import LEARNERS, SURVIVOR, TAIL_CHECKPOINTS, ChaosPlan, ChaosReport, ChaosRun

#: 100 s (the harness's schedule is in fractions of it; the bench runs 150 s), with a network fault
#: every 0.8 s on average (the bench's: 1 s): about 125 network faults, and the suite inside its time.
DURATION_S = 100.0
NETWORK_EVERY_S = 0.8
#: Both runs happen in the first test that needs them: far above their ~2 min each.
TIMEOUT_S = 900
MIN_FAULTS = 100
#: The chaos run's eval loss against the fault-free run's at equal steps, mean of the last
#: TAIL_CHECKPOINTS against mean (target 1.03; see the module docstring).
EQUAL_STEPS_BOUND = 1.05
MiB = 2**20

# Two runs of 100 s each: `make test-slow`.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S)]


def _say(report: ChaosReport, what: str) -> None:
    print(f"\n{what}: " + json.dumps(report.summary(), default=str))


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> ChaosReport:
    work = tmp_path_factory.mktemp("chaos")
    plan = ChaosPlan(work=work, duration_s=DURATION_S, network_every_s=NETWORK_EVERY_S, keep_curve=True)
    report = ChaosRun(plan).run()
    _say(report, "chaos run")
    return report


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> ChaosReport:
    work = tmp_path_factory.mktemp("fault-free")
    report = ChaosRun(ChaosPlan(work=work, duration_s=DURATION_S, faults=False, keep_curve=True)).run()
    _say(report, "fault-free run")
    return report


def _where(report: ChaosReport) -> Path:
    return report.plan.work / "report.json"


def test_over_a_hundred_faults_and_no_daemon_crashes(chaos: ChaosReport) -> None:
    print(f"\ninjected faults: {chaos.injected} {chaos.faults}")
    assert chaos.injected >= MIN_FAULTS, chaos.faults
    kinds = " | ".join(chaos.faults)
    for needed in (
        "kill -9 learner mid-push",
        "kill -9 learner mid-update",
        "short stop",
        "long stop",
        "kill -9 syncer",
        "partition",
        "sever",
        "flip a push chunk",
        "flip an update chunk",
        "truncate a push chunk",
        "truncate an update chunk",
        "truncate a control frame",
    ):
        assert needed in kinds, f"no {needed!r} among {chaos.faults}"
    assert chaos.crashes == [], _where(chaos)
    assert len(chaos.exits) == len(LEARNERS) + 1 + chaos.faults.get("kill -9 syncer and restart", 0) + sum(
        n for kind, n in chaos.faults.items() if kind.startswith("kill -9 learner")
    )
    # Bad input is the peer's fault: the syncer said so for corrupt pushes and truncated frames.
    assert chaos.bad_input_logged["CHECKSUM_MISMATCH"] + chaos.bad_input_logged["LENGTH_MISMATCH"] >= 1
    assert chaos.bad_input_logged["TRUNCATED"] >= 1
    # A corrupt chunk is asked for again (CHUNK_RESEND), by the syncer for a push and by a learner
    # for an update: not its whole transfer reset.
    asked = {
        way: sum(chaos.frames.get(f"{learner} {way} CHUNK_RESEND", 0) for learner in LEARNERS)
        for way in ("UP", "DOWN")
    }
    assert asked["DOWN"] >= 1 and asked["UP"] >= 1, asked


def test_no_push_is_lost_or_applied_twice(chaos: ChaosReport) -> None:
    print(f"\npushes: {dict(chaos.pushes)}")
    assert chaos.lost == [], _where(chaos)
    assert chaos.double_applied == [], _where(chaos)
    assert chaos.pushes["acked"] > 500 and chaos.pushes["merged"] > 300


def test_versions_never_fall_and_training_never_stops(chaos: ChaosReport) -> None:
    assert chaos.version_drops == []
    (restart,) = chaos.checkpoint_checks
    assert restart["checkpoint_versions"] is not None
    assert restart["resumed_versions"] == restart["checkpoint_versions"]
    assert chaos.stalls == [], _where(chaos)
    assert chaos.progress_windows >= 0.5 * DURATION_S / 6
    assert chaos.learner_stalls == [], _where(chaos)
    assert chaos.learner_progress_lines >= len(LEARNERS) * DURATION_S / 4
    assert chaos.fragment_stalls == [], _where(chaos)


def test_every_learner_ends_on_the_syncers_fragments(chaos: ChaosReport) -> None:
    assert chaos.not_holding == [], chaos.holding
    assert set(chaos.holding) == set(LEARNERS)


def test_resident_memory_stays_bounded(chaos: ChaosReport) -> None:
    """No process grows once warm (after the heal and the first steps and pushes) to the end of
    its life: the survivor learner and its network process live the whole run, and so does the
    syncer's first incarnation until its kill."""
    measured = {name: m for name, m in chaos.memory.items() if "end_mib" in m}
    assert any(name.startswith("syncer") for name in measured), chaos.memory
    assert {f"learner-{SURVIVOR}-0", f"learner-{SURVIVOR}-0 child"} <= set(measured), chaos.memory
    for name, memory in measured.items():
        grown = memory["end_mib"] - memory["warm_mib"]
        assert grown <= max(32.0, 0.1 * memory["warm_mib"]), (name, memory)
    for name, memory in chaos.memory.items():
        assert memory["peak_mib"] < (1024 if name.startswith("syncer") else 2048), (name, memory)


def test_goodput_is_reported_and_sees_lost_time(chaos: ChaosReport, fault_free: ChaosReport) -> None:
    print(f"\ngoodput: chaos {chaos.goodput}, fault-free {fault_free.goodput}")
    assert set(fault_free.goodput) == set(chaos.goodput) == set(LEARNERS)
    # Nothing goes wrong: nearly all the wall time since joining is spent in steps.
    assert min(fault_free.goodput.values()) >= 0.9, fault_free.goodput
    # The learners killed and stopped lost time the measure must see.
    for name in LEARNERS:
        assert 0.0 < chaos.goodput[name] <= 1.0
        if name != SURVIVOR:
            assert chaos.goodput[name] < min(fault_free.goodput.values()) - 0.05, chaos.goodput
    assert chaos.goodput[SURVIVOR] >= 0.75, chaos.goodput
    assert "goodput" in chaos.status_table


def test_eval_loss_stays_close_to_the_fault_free_run(chaos: ChaosReport, fault_free: ChaosReport) -> None:
    """At equal steps: the chaos run's last TAIL_CHECKPOINTS checkpoints against the fault-free
    run's loss when its learners had trained as many steps as each of them (interpolated between
    its checkpoints), mean against mean, so what is compared is the faults' cost, not how much of
    the shared host each run happened to get nor where one checkpoint happened to land."""
    tail_chaos, tail_reference = chaos.compare_tail(fault_free, TAIL_CHECKPOINTS)
    final_reference, how = fault_free.loss_at_steps(chaos.steps)
    print(
        f"\neval loss: last {TAIL_CHECKPOINTS} checkpoints {tail_chaos:.4f} under chaos, "
        f"{tail_reference:.4f} fault-free at equal steps ({chaos.tail(TAIL_CHECKPOINTS)}); final "
        f"{chaos.eval_loss:.4f} after {chaos.steps} steps against {final_reference:.4f} ({how})"
    )
    assert fault_free.eval_loss < 0.5 * math.log(256)  # training happened: the initial model is ~ln 256
    assert len(fault_free.curve) >= 10 and len(chaos.curve) >= 10  # a checkpoint every 5 s, each one kept
    # The chaos run's steps carry over the syncer's restart: its tail is the end of the run.
    assert min(steps for steps, _ in chaos.tail(TAIL_CHECKPOINTS)) > 0.7 * chaos.steps
    assert tail_chaos <= EQUAL_STEPS_BOUND * tail_reference


def test_the_fault_free_run_is_clean(fault_free: ChaosReport) -> None:
    assert fault_free.injected == 0
    assert fault_free.crashes == [] and fault_free.lost == [] and fault_free.double_applied == []
    assert fault_free.version_drops == [] and fault_free.stalls == [] and fault_free.learner_stalls == []
    assert fault_free.fragment_stalls == []
    assert fault_free.not_holding == [], fault_free.holding
