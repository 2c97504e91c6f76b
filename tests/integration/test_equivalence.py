"""Lock-step dilocod equals its ancestors: real `dilocod syncer` and `dilocod learner` processes on
loopback, two learners of unequal speed (one 3x slower), a small deterministic MLP trained by plain
torch SGD, against references written in plain torch (devkit/diloco_reference.py):

- DiLoCo (P = 1, tau = 0) and Streaming DiLoCo (P = 4, tau = 0 and tau = 2, overwrite and mix),
  each with `--merge mean` and with RDA, the syncer in lock-step (`--quorum all`); and tau = H/P,
  where a merge is applied at the boundary that snapshots the next round;
- the syncer's global model, exported after SIGTERM, equals the reference's at the versions the
  syncer merged, to float32 rounding: at most 1e-5 relative (‖got - want‖ / ‖want‖) on every
  tensor; so does every learner's own model as it stopped (its saved local state);
- every round merged both learners' pushes for the due round, with equal weights.

The learners wait at their first step until the syncer counts both live, so that no round opens
before both have healed (a round can only hold the learners that were live when it opened).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from devkit import equivalence_entry as problem
from devkit.daemons import DaemonProcess, start_learner, start_syncer, syncer_status
from devkit.diloco_reference import (
    MERGES,
    Flags,
    Run,
    TorchLearner,
    due_step,
    reference_diloco,
    reference_streaming,
    relative_error,
)
from dilocod.syncer.checkpoint import export_newest

#: Float32 rounding, accumulated over a few rounds: the bound on every tensor's relative error.
TOLERANCE = 1e-5
DEADLINE_S = 120.0
#: The learner's --join-timeout-s: how long it waits for a heal or, in lock-step, for a round; a
#: round that never comes then shows as a failed comparison within the test's deadline.
LEARNER_WAIT_S = 30.0
ENTRY = "equivalence_entry:make_trainer"
FAST_STEP_S = 0.015
#: (learner id, seed, seconds per step): the second is three times slower than the first.
LEARNERS = (("fast", 1, FAST_STEP_S), ("slow", 2, 3 * FAST_STEP_S))
#: A run that moved the global model less than this (relative) would make the comparison empty.
MIN_MOVED = 1e-2


@dataclass(frozen=True)
class Case:
    flags: Flags
    rounds: int  # rounds due by the last step
    #: Every learner's --steps; by default one past the boundary where the last round is applied,
    #: so the run ends with every round merged and applied and none in flight.
    stop_at: int | None = None
    #: The learners' --network: the slow cases run the network side as a thread, which covers
    #: that path and starts two torch processes fewer.
    network: str = "process"

    @property
    def steps(self) -> int:
        if self.stop_at is not None:
            return self.stop_at
        flags = self.flags
        return due_step(self.rounds - 1, flags.sync_every, flags.fragments) + flags.overlap + 1

    def in_flight_at_the_end(self, round_index: int) -> bool:
        """Whether the learners stop before the round's apply step: its pushes race their exit."""
        flags = self.flags
        return due_step(round_index, flags.sync_every, flags.fragments) + flags.overlap > self.steps


DILOCO = Flags(fragments=1, sync_every=4)
STREAMING = Flags(fragments=4, sync_every=8)
OVERLAPPED = Flags(fragments=4, sync_every=16, overlap=2)  # tau < H/P: one round in flight
#: tau = H/P: each merge is applied at the boundary that snapshots the next round (applies first),
#: and a round is always in flight, at the end too.
CROWDED = Flags(fragments=4, sync_every=8, overlap=2)
#: Each case costs about 20 s of processes starting and stopping on a loaded 2-core machine:
#: `make test` runs DiLoCo with the mean (the default network process) and Streaming DiLoCo with
#: overlap and RDA; the rest is `make test-slow`. All but the first run the network side as a thread.
SLOW = pytest.mark.slow
CASES = [
    pytest.param(Case(DILOCO, rounds=4), id="diloco-mean"),
    pytest.param(Case(replace(DILOCO, merge="rda"), rounds=4, network="thread"), id="diloco-rda", marks=SLOW),
    pytest.param(Case(STREAMING, rounds=8, network="thread"), id="streaming-tau0-mean", marks=SLOW),
    pytest.param(
        Case(replace(STREAMING, merge="rda"), rounds=8, network="thread"), id="streaming-tau0-rda", marks=SLOW
    ),
    pytest.param(Case(OVERLAPPED, rounds=8, network="thread"), id="streaming-tau2-mean", marks=SLOW),
    pytest.param(Case(replace(OVERLAPPED, merge="rda"), rounds=8, network="thread"), id="streaming-tau2-rda"),
    pytest.param(
        Case(replace(OVERLAPPED, apply="mix"), rounds=8, network="thread"),
        id="streaming-tau2-mix",
        marks=SLOW,
    ),
    pytest.param(
        Case(CROWDED, rounds=8, stop_at=17, network="thread"), id="streaming-tau2-crowded", marks=SLOW
    ),
]


@pytest.fixture
def entry_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "entry"
    directory.mkdir()
    shutil.copy(Path(problem.__file__), directory / "equivalence_entry.py")
    return directory


@pytest.fixture
def go_fifos(tmp_path: Path) -> Iterator[dict[str, int]]:
    """A FIFO per learner, held open read-write by the test: the learner's first step blocks
    reading it until the test writes a byte (or exits, closing it)."""
    held: dict[str, int] = {}
    try:
        for name, _, _ in LEARNERS:
            path = tmp_path / f"go-{name}"
            os.mkfifo(path)
            held[name] = os.open(path, os.O_RDWR)  # never blocks on Linux, unlike O_WRONLY
        yield held
    finally:
        for fd in held.values():
            os.close(fd)


def _syncer_args(flags: Flags) -> tuple[str, ...]:
    return (
        *("--fragments", str(flags.fragments), "--sync-every", str(flags.sync_every)),
        *("--overlap", str(flags.overlap), "--quorum", "all", "--merge", flags.merge),
        *("--outer-lr", str(flags.outer_lr), "--outer-momentum", str(flags.outer_momentum)),
    )


def _start_learners(
    tmp_path: Path, entry_dir: Path, port: int, case: Case, env: pytest.MonkeyPatch
) -> list[DaemonProcess]:
    """Each learner inherits its own step time and go-FIFO through the environment."""
    learners = []
    for name, seed, step_s in LEARNERS:
        env.setenv(problem.STEP_S_ENV, str(step_s))
        env.setenv(problem.GO_FIFO_ENV, str(tmp_path / f"go-{name}"))
        learners.append(
            start_learner(
                *(tmp_path, entry_dir, port, name),
                *("--entry", ENTRY, "--seed", str(seed), "--steps", str(case.steps)),
                *("--apply", case.flags.apply, "--mix-alpha", str(case.flags.mix_alpha)),
                *("--network", case.network),
                *("--state-dir", str(tmp_path / name), "--join-timeout-s", str(LEARNER_WAIT_S)),
            )
        )
    return learners


def _release_when_both_live(
    syncer: DaemonProcess, learners: list[DaemonProcess], fifos: dict[str, int]
) -> None:
    for learner in learners:
        learner.wait_for("healed", lambda record: True, DEADLINE_S)
    names = {name for name, _, _ in LEARNERS}
    # Each `dilocod status` is a request answered by the syncer: no timer, one question at a time.
    for _ in range(100):
        live = {entry["id"] for entry in syncer_status(syncer.port)["learners"] if entry.get("live")}
        if names <= live:
            break
    else:
        raise AssertionError(f"the syncer never counted both learners live: {syncer.stderr()}")
    for fd in fifos.values():
        os.write(fd, b"g")


def _reference(case: Case, contributors: dict[int, list[int]]) -> Run:
    """The reference run of the case: Streaming DiLoCo, which for P = 1 and tau = 0 must also be
    DiLoCo as its paper writes it (checked here too, exactly). A round the syncer merged from
    fewer learners (one in flight at the end) is merged from those in the reference too."""
    model = problem.make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}

    def learners() -> list[TorchLearner]:
        return [TorchLearner(model, problem.batch, seed, problem.INNER_LR) for _, seed, _ in LEARNERS]

    flags = case.flags
    everyone = list(range(len(LEARNERS)))
    run = reference_streaming(initial, learners(), flags, case.steps, lambda r: contributors.get(r, everyone))
    assert len(run.rounds) == case.rounds
    if flags.fragments == 1 and flags.overlap == 0:
        diloco = reference_diloco(
            initial,
            learners(),
            flags.sync_every,
            case.rounds,
            MERGES[flags.merge],
            flags.outer_lr,
            flags.outer_momentum,
        )
        final = run.global_at([case.rounds])
        assert all(torch.equal(final[n], diloco[n]) for n in diloco), "Streaming DiLoCo with P = 1 is DiLoCo"
    return run


def _errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return {name: relative_error(got[name], want[name].detach()) for name in want}


def _check_rounds(merged: list[dict], case: Case) -> tuple[list[int], dict[int, list[int]]]:
    """Each merged round is the due one, merging both learners' pushes for it with equal weights
    (a round still in flight when the learners stopped: those that arrived); returns the version
    every fragment reached and the learners (by index) each round merged."""
    fragments = case.flags.fragments
    names = [name for name, _, _ in LEARNERS]
    versions = [0] * fragments
    contributors: dict[int, list[int]] = {}
    for record in merged:
        r = record["round"]
        assert record["fragment"] == r % fragments, record
        contributors[r] = sorted(names.index(name) for name in record["contributors"])
        if not case.in_flight_at_the_end(r):
            assert contributors[r] == list(range(len(names))), record
        assert record["push_rounds"] == [r] * len(contributors[r]), record
        assert record["weights"] == [round(1 / len(contributors[r]), 4)] * len(contributors[r]), record
        versions[r % fragments] += 1
        assert record["version"] == versions[r % fragments], record
    return versions, contributors


@pytest.mark.parametrize("case", CASES)
def test_lockstep_equals_the_reference(
    tmp_path: Path, entry_dir: Path, go_fifos: dict[str, int], monkeypatch: pytest.MonkeyPatch, case: Case
) -> None:
    state = tmp_path / "syncer"
    syncer = start_syncer(tmp_path, entry_dir, state, *_syncer_args(case.flags), entry=ENTRY)
    learners: list[DaemonProcess] = []
    try:
        learners = _start_learners(tmp_path, entry_dir, syncer.port, case, monkeypatch)
        _release_when_both_live(syncer, learners, go_fifos)
        for learner in learners:
            assert learner.process.wait(timeout=DEADLINE_S) == 0, learner.stderr()
    finally:
        for learner in learners:
            if learner.alive():
                learner.kill()
        assert syncer.stop() == 0, syncer.stderr()

    merged = syncer.log_events("round merged")
    versions, contributors = _check_rounds(merged, case)
    # What `dilocod export` writes, with the version of every fragment it holds.
    exported = export_newest(state, tmp_path / "global.safetensors")
    assert list(exported.versions) == versions, (exported.versions, versions)
    got = load_file(str(exported.path))

    # The global model first, at the versions the syncer merged, then that it merged every round.
    run = _reference(case, contributors)
    initial = {n: p.detach() for n, p in problem.make_model().named_parameters()}
    moved = relative_error(
        torch.cat([got[n].flatten() for n in initial]), torch.cat([initial[n].flatten() for n in initial])
    )
    assert moved > MIN_MOVED, f"the global model hardly moved ({moved:.2e}): nothing was compared"
    errors = _errors(got, run.global_at(versions))
    steps = [(record["round"], record["steps"]) for record in merged]
    assert max(errors.values()) <= TOLERANCE, (
        f"global model at versions {versions}, relative error per tensor: {json.dumps(errors)}; "
        f"rounds merged (round, steps per push): {steps}"
    )
    # Every round merged in order, all but those still in flight at the end for certain.
    done = [r for r in range(case.rounds) if not case.in_flight_at_the_end(r)]
    assert [record["round"] for record in merged] == list(range(len(merged))), steps
    assert len(done) <= len(merged) <= case.rounds, steps
    for (name, _, _), learner in zip(LEARNERS, run.learners, strict=True):
        saved = torch.load(tmp_path / name / "learner-state.pt", weights_only=True)
        assert saved["step"] == case.steps
        errors = _errors(saved["model"], learner.params)
        assert max(errors.values()) <= TOLERANCE, f"learner {name}, relative error per tensor: {errors}"
