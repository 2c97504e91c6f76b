"""The syncer service's checkpoints (SyncerService.checkpoint): a failure is counted, named in the
status with its reason and raised, and leaves nothing on disk, so the previous checkpoint stays
the newest; old checkpoints that cannot be removed do not make a written checkpoint a failure.
The real-process side (a full disk, the goodbyes, exit 74) is tests/integration/test_state_disk.py.
A checkpoint holds up no merge: merges run while a fragment is lent to it, and each fragment's Θ,
b and version in it agree."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dilocod.config import SyncerConfig
from dilocod.model.params import model_entries
from dilocod.model.plan import plan_fragments
from dilocod.syncer import checkpoint
from dilocod.syncer.checkpoint import Lent, load_latest_checkpoint
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
    made._checkpointer.shutdown(wait=True)
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


def test_a_merge_runs_during_a_checkpoint_and_each_fragment_is_consistent(tmp_path: Path) -> None:
    """While fragment 0 is lent to the checkpoint, two merges of each fragment run in the merge
    worker (the second would reuse what the first retired, if the pool had it back); then fragment
    1 is lent. The checkpoint holds fragment 0 as it was before the merges and fragment 1 as it was
    after, each with its own version, and the lent buffers return to the pool only afterwards."""
    module = torch.nn.Linear(4, 2)
    specs = model_entries(module)
    plan = plan_fragments([(s.name, s.shape) for s in specs], 2)
    model = GlobalModel(plan, specs, chunk_bytes=4096, embedding_pattern="*embed*")
    params = dict(module.named_parameters())
    model.load(params, {name: torch.randn(p.shape) for name, p in params.items()})
    model.publish_all()
    service = SyncerService(
        SyncerConfig(), model, Rounds(RoundConfig(fragments=2, sync_every=1_000_000)),
        state_dir=tmp_path, incarnation="test", secret=None, meta={},
    )  # fmt: skip
    lent_0, merged = threading.Event(), threading.Event()
    real_lend = model.lend

    @contextlib.contextmanager
    def lend(index: int) -> Iterator[Lent]:
        with real_lend(index) as lent:
            if index == 0:  # the merges below run while fragment 0 is lent
                lent_0.set()
                assert merged.wait(30)
            yield lent

    model.lend = lend  # type: ignore[method-assign]  # the real lend, observed

    def merge_both_twice() -> list[tuple[bytes, bytes, int]]:
        after = []
        for store in model.fragments:
            for _ in range(2):
                push = bytearray(torch.full((store.raw_bytes // 4,), 0.25).numpy().tobytes())
                model.merge(
                    store.index, [push], [1.0], lr=0.7, mu=0.9, merge="mean", version=store.version + 1,
                )  # fmt: skip
            after.append((bytes(store.master), bytes(store.momentum), store.version))
        return after

    before = [(bytes(s.master), bytes(s.momentum), s.version) for s in model.fragments]

    async def scenario() -> tuple[Path, list[tuple[bytes, bytes, int]]]:
        written = asyncio.create_task(service.checkpoint())
        assert await asyncio.to_thread(lent_0.wait, 30)
        after = await asyncio.get_running_loop().run_in_executor(service._executor, merge_both_twice)
        merged.set()
        return await written, after

    try:
        path, after = asyncio.run(scenario())
    finally:
        service._checkpointer.shutdown(wait=True)
        service._executor.shutdown(wait=True)
        service._screener.shutdown(wait=True)
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.path == path
    assert loaded.state.versions == [before[0][2], after[1][2]] == [0, 2]
    assert model._lent == {} and model._retired == {}  # fragment 0's old buffers went back
    for store, (master, momentum, _) in zip(model.fragments, [before[0], after[1]], strict=True):
        assert before[store.index][:2] != after[store.index][:2]  # the merge changed both fragments
        for (name, start, stop), entry in zip(store.pieces, store.manifest, strict=True):
            span = slice(entry.offset, entry.offset + entry.nbytes)
            for saved, held in ((loaded.state.params, master), (loaded.state.momentum, momentum)):
                tensor = saved[name]  # the fragment holds rows [start, stop) of it
                piece = tensor[start:stop] if tensor.dim() else tensor
                assert piece.numpy().tobytes() == held[span]
