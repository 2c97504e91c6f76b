"""The syncer service's checkpoints (SyncerService.checkpoint): a failure is counted, named in the
status with its reason and raised, and leaves nothing on disk, so the previous checkpoint stays
the newest; old checkpoints that cannot be removed do not make a written checkpoint a failure.
The real-process side (a full disk, the goodbyes, exit 74) is tests/integration/test_state_disk.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dilocod.config import SyncerConfig
from dilocod.learner.layout import model_entries
from dilocod.outer import plan_fragments
from dilocod.syncer import checkpoint
from dilocod.syncer.checkpoint import load_latest_checkpoint
from dilocod.syncer.model import GlobalModel
from dilocod.syncer.rounds import RoundConfig, Rounds
from dilocod.syncer.service import SyncerService


@pytest.fixture
def service(tmp_path: Path) -> Iterator[SyncerService]:
    module = torch.nn.Linear(4, 2)
    specs = model_entries(module)
    plan = plan_fragments([(s.name, s.shape) for s in specs], 1)
    model = GlobalModel(plan, specs, chunk_bytes=4096, embedding_pattern="*embed*")
    model.load(dict(module.named_parameters()))
    rounds = Rounds(RoundConfig(fragments=1, sync_every=1_000_000))
    made = SyncerService(
        SyncerConfig(), model, rounds, state_dir=tmp_path, incarnation="test", secret=None, meta={}
    )
    yield made
    made._executor.shutdown(wait=True)
    made._screener.shutdown(wait=True)


def test_a_failed_checkpoint_is_counted_named_and_leaves_the_previous_newest(
    service: SyncerService, tmp_path: Path
) -> None:
    first = asyncio.run(service.checkpoint())
    service.meta["unserialisable"] = {1, 2}  # a set: JSON has none
    for attempt in (1, 2):
        with pytest.raises(ValueError, match="JSON"):
            asyncio.run(service.checkpoint())
        status = service.status()
        assert status["checkpoints_failed"] == attempt
        assert status["checkpoint_problem"].startswith("ValueError: meta is not JSON-serialisable")
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.path == first == service.last_checkpoint
    del service.meta["unserialisable"]
    second = asyncio.run(service.checkpoint())
    status = service.status()
    assert (status["checkpoints_failed"], status["checkpoint_problem"]) == (0, None)
    assert status["checkpoints_written"] == 2 and status["last_checkpoint"] == str(second)


def test_a_checkpoint_whose_clean_up_failed_is_written(
    service: SyncerService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_prune(state_dir: Path, *, keep: int) -> list[Path]:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(checkpoint, "prune_checkpoints", failing_prune)
    path = asyncio.run(service.checkpoint())
    assert service.checkpoints_written == 1 and service.last_checkpoint == path
    assert service.status()["checkpoints_failed"] == 0
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.path == path
