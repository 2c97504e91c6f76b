"""`dilocod status`: a learner's steps/s is its throughput (step reports over a recent window of
wall time), the same figure as the learner's own progress line, not 1 / the mean reported step
time (which leaves out everything between steps and read 4-5x too high); and a refused
authentication is told apart from a network that cannot be reached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dilocod.config import SyncerConfig
from dilocod.model.params import model_entries
from dilocod.model.plan import plan_fragments
from dilocod.ops.status import format_status
from dilocod.syncer.model import GlobalModel
from dilocod.syncer.rounds import RoundConfig, Rounds
from dilocod.syncer.service import SyncerService, _Peer
from dilocod.wire.messages import StepReport


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _service(clock: _Clock, state_dir: Path) -> SyncerService:
    module = torch.nn.Linear(4, 2)
    specs = model_entries(module)
    model = GlobalModel(
        plan_fragments([(s.name, s.shape) for s in specs], 1),
        specs,
        chunk_bytes=4096,
        embedding_pattern="*embed*",
    )
    model.load(dict(module.named_parameters()))
    rounds = Rounds(RoundConfig(fragments=1, sync_every=1_000_000))
    return SyncerService(
        SyncerConfig(),
        model,
        rounds,
        state_dir=state_dir,
        incarnation="test",
        secret=None,
        meta={},
        clock=clock,
    )  # type: ignore[arg-type]


def _report_steps(service: SyncerService, clock: _Clock, learner: str, *, steps: int, every_s: float) -> None:
    """A learner whose steps take 1/109 s of compute each but complete every `every_s` of wall time."""
    service.rounds.join(learner, clock())
    peer = _Peer(learner, session=None, joined=True)  # type: ignore[arg-type]
    for step in range(steps):
        clock.now += every_s
        service._on_message(peer, StepReport(step, 128, 1 / 109))


def _learner(status: dict[str, Any], learner: str) -> dict[str, Any]:
    return next(entry for entry in status["learners"] if entry["id"] == learner)


def test_steps_per_s_is_the_wall_clock_throughput(tmp_path: Path) -> None:
    clock = _Clock()
    service = _service(clock, tmp_path)
    _report_steps(service, clock, "site-a", steps=3000, every_s=1 / 29.5)

    entry = _learner(service.status(), "site-a")

    assert entry["steps_per_s"] == pytest.approx(29.5, rel=0.02)
    assert entry["step_time_s"] == pytest.approx(1 / 109, rel=0.01)  # what it used to invert


def test_steps_per_s_follows_a_learner_that_stopped(tmp_path: Path) -> None:
    clock = _Clock()
    service = _service(clock, tmp_path)
    _report_steps(service, clock, "site-a", steps=600, every_s=0.1)
    clock.now += 30.0  # half the window without a step
    assert _learner(service.status(), "site-a")["steps_per_s"] == pytest.approx(5.0, rel=0.05)
    clock.now += 600.0
    assert _learner(service.status(), "site-a")["steps_per_s"] == 0.0


def test_the_table_labels_the_window(tmp_path: Path) -> None:
    clock = _Clock()
    service = _service(clock, tmp_path)
    _report_steps(service, clock, "site-a", steps=100, every_s=0.5)
    status = service.status()
    table = format_status(status)
    assert status["steps_per_s_window_s"] == 60
    assert "steps/s (last 60 s)" in table
    assert "2.00" in next(line for line in table.splitlines() if line.startswith("site-a"))


def test_the_table_says_how_many_rounds_were_skipped_and_why(tmp_path: Path) -> None:
    service = _service(_Clock(), tmp_path)
    service.rounds.rounds_skipped.update({"merges-behind": 3, "busy": 1})
    table = format_status(service.status())
    assert "skipped 4 (busy 1, merges-behind 3)" in table
    assert "skipped 0 " in format_status({**service.status(), "rounds_skipped": {}})


def test_the_table_shows_a_damaging_path_and_what_rejoins_saved(tmp_path: Path) -> None:
    service = _service(_Clock(), tmp_path)
    service.fragments_held_at_join, service.chunks_resumed = 23, 41
    status = service.status()
    figures = ("chunks_asked_again", "fragments_held_at_join", "chunks_resumed")
    assert tuple(status[k] for k in figures) == (0, 23, 41)
    assert "chunks asked again 0  fragments held at rejoins 23  chunks resumed 41" in format_status(status)
    older = {k: v for k, v in status.items() if k not in figures}
    assert "chunks asked again 0  fragments held at rejoins 0  chunks resumed 0" in format_status(older)
