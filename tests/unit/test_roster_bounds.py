"""Whatever one learner reports, the syncer's roster stays finite, JSON-safe and bounded: checkpoints
keep being written, `dilocod status` keeps answering everyone within its frame limit, learners gone
past the retention leave the roster, and a checkpoint's roster is range-checked when restored."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import torch

from dilocod.config import SyncerConfig
from dilocod.model.params import model_entries
from dilocod.model.plan import plan_fragments
from dilocod.ops.status import format_status
from dilocod.syncer.checkpoint import load_latest_checkpoint
from dilocod.syncer.daemon import _restore_roster
from dilocod.syncer.model import GlobalModel
from dilocod.syncer.rounds import MAX_GONE_LEARNERS, RoundConfig, Rounds
from dilocod.syncer.service import STATUS_MAX_LEARNERS, SyncerService, _Peer
from dilocod.wire.limits import DEFAULT_LIMITS
from dilocod.wire.messages import StatusResponse, StepReport, encode_body

RETENTION_S = 3600.0


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
    config = SyncerConfig(roster_retention_s=RETENTION_S)
    return SyncerService(
        config, model, rounds, state_dir=state_dir, incarnation="test", secret=None, meta={}, clock=clock
    )  # type: ignore[arg-type]


def _status_bytes(service: SyncerService) -> int:
    return len(encode_body(StatusResponse(service.status())))


def test_a_learners_numbers_never_stop_checkpoints_or_status(tmp_path: Path) -> None:
    """Two step times of 1e308 made every checkpoint fail (`meta is not JSON-serialisable`) until a
    restart, and token counts of 2**64 - 1 broke the status for everyone. Past the wire's range
    checks, the roster itself stays finite and within JSON's and msgpack's integers."""
    clock = _Clock()
    service = _service(clock, tmp_path)
    service.rounds.join("rogue", clock())
    rogue = _Peer("rogue", session=None, joined=True)  # type: ignore[arg-type]
    for _ in range(2):
        clock.now += 1.0
        service._on_message(rogue, StepReport(2**64 - 1, 2**64 - 1, 1e308))
    service.rounds.learners["rogue"].useful_s = math.inf  # as if summed elsewhere: still no NaN out
    asyncio.run(service.checkpoint())
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    entry = loaded.state.meta["roster"]["rogue"]
    assert entry["useful_s"] == 0.0 and entry["tokens"] < 2**53
    status = service.status()
    json.dumps(status, allow_nan=False)
    assert _status_bytes(service) < DEFAULT_LIMITS.max_control_body_bytes
    assert "rogue" in format_status(status)


def test_the_status_stays_inside_its_frame_with_20000_learner_ids(tmp_path: Path) -> None:
    """About 265 bytes of status per id ever seen: near 15,800 ids it outgrew its frame limit. It
    lists at most STATUS_MAX_LEARNERS (connected and live first) and says how many more there are;
    the roster keeps at most MAX_GONE_LEARNERS of those that left."""
    clock = _Clock()
    service = _service(clock, tmp_path / "a")
    rounds = service.rounds
    names = [f"learner-{i:05d}-" + "x" * 100 for i in range(20_000)]
    for name in names:
        rounds.join(name, clock())
    assert _status_bytes(service) < DEFAULT_LIMITS.max_control_body_bytes
    status = service.status()
    assert len(status["learners"]) == STATUS_MAX_LEARNERS and status["learners_total"] == 20_000
    assert f"({20_000 - STATUS_MAX_LEARNERS} more learners not listed" in format_status(status)

    # 20,000 ids that left, one second apart (as restored from a checkpoint).
    gone = _service(clock, tmp_path / "b")
    for i, name in enumerate(names):
        gone.rounds.restore_learner(name, tracked_s=1.0, useful_s=0.5, now=clock(), idle_s=20_000.0 - i)
    status = gone.status()
    assert status["learners_total"] == MAX_GONE_LEARNERS
    assert {entry["id"] for entry in status["learners"]} == set(names[-MAX_GONE_LEARNERS:])
    assert _status_bytes(gone) < DEFAULT_LIMITS.max_control_body_bytes


def test_learners_gone_past_the_retention_leave_status_checkpoint_and_step_rates(tmp_path: Path) -> None:
    clock = _Clock()
    service = _service(clock, tmp_path)
    for learner in ("stays", "goes"):
        service.rounds.join(learner, clock())
        service._on_message(_Peer(learner, session=None, joined=True), StepReport(1, 10, 0.1))  # type: ignore[arg-type]
    service.rounds.leave("goes", clock())
    clock.now += RETENTION_S - 1.0
    assert {e["id"] for e in service.status()["learners"]} == {"stays", "goes"}
    clock.now += 2.0
    assert {e["id"] for e in service.status()["learners"]} == {"stays"}
    assert service.step_rates.rate("goes", clock()) == 0.0 and "goes" not in service.step_rates._reports
    asyncio.run(service.checkpoint())
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and set(loaded.state.meta["roster"]) == {"stays"}


def test_a_restored_roster_is_range_checked_and_keeps_the_time_since_each_learner_left() -> None:
    good = {"tracked_s": 100.0, "useful_s": 50.0, "local_step": 7, "idle_s": 10.0}
    roster = {
        "ok": good,
        "earlier-version": {"tracked_s": 100.0, "useful_s": 50.0},  # no idle_s, no local_step
        "inf": {**good, "useful_s": math.inf},
        "nan": {**good, "tracked_s": math.nan},
        "negative": {**good, "idle_s": -1.0},
        "bool": {**good, "useful_s": True},
        "huge-step": {**good, "local_step": 2**64},
        "x" * (DEFAULT_LIMITS.max_peer_id_bytes + 1): good,
        "not-a-map": [1, 2],
    }
    rounds = Rounds(RoundConfig(fragments=1, sync_every=1))
    _restore_roster(rounds, roster, down_s=5.0, now=0.0)
    assert set(rounds.learners) == {"ok", "earlier-version"}
    record = rounds.learners["ok"]
    assert (record.local_step, record.useful_s, record.tracked_s(0.0), record.idle_s(0.0)) == (
        7,
        50.0,
        105.0,
        15.0,
    )
    assert rounds.learners["earlier-version"].idle_s(0.0) == 5.0  # gone since the syncer went down
    assert rounds.forget_gone(0.0, retention_s=10.0) == ["ok"]


def test_the_table_survives_odd_figures() -> None:
    """`dilocod status` formats whatever a syncer sent: a figure that is not a finite number of the
    expected kind prints as "?" instead of stopping the table for everyone."""
    status = {
        "role": "syncer",
        "incarnation": "x",
        "uptime_s": 1.0,
        "clock": 0,
        "next_round": 0,
        "rounds_merged": 0,
        "rounds_abandoned": 0,
        "quorum_sizes": {},
        "grace_waited_s": 0.0,
        "bytes_in": 0,
        "bytes_out": 0,
        "rejected_pushes": 0,
        "checkpoints_written": 0,
        "fragments": [],
        "learners": [
            {
                "id": None,
                "connected": True,
                "steps_per_s": "fast",
                "contributions": 1.5,
                "weight_share": math.inf,
            },
            {"id": "b", "pushes": 2, "pushes_wasted": "all", "goodput": math.nan, "steps": True},
        ],
    }
    table = format_status(status)
    assert "?" in next(line for line in table.splitlines() if line.startswith("None"))
    assert next(line for line in table.splitlines() if line.startswith("b "))
