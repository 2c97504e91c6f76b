"""The syncer's push store (dilocod/syncer/pushes.py): carried pushes go to files and come back
byte for byte, and every buffer has one owner in every order of carry, take, drop and a write
that is still running or failed."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch

from dilocod.config import SyncerConfig
from dilocod.model.params import model_entries
from dilocod.model.plan import plan_fragments
from dilocod.syncer.buffers import BufferPool
from dilocod.syncer.model import GlobalModel
from dilocod.syncer.pushes import LATE_DIR, PushStore, Where
from dilocod.syncer.rounds import Action, Carry, Merge, Push, Request, RoundConfig, Rounds
from dilocod.syncer.service import SyncerService

SIZE = 1 << 16
#: A deadline for a signal, generous for a loaded machine.
SIGNAL_TIMEOUT_S = 30.0


def _push(learner: str = "a", index: int = 3) -> Push:
    return Push(learner, index, 0, 0, 4, 400)


def _filled(pool: BufferPool, seed: int) -> memoryview:
    buffer = memoryview(pool.take(SIZE))
    buffer[:] = bytes((seed + i) % 251 for i in range(SIZE))
    return buffer


def _files(store: PushStore) -> list[str]:
    return sorted(os.listdir(store.directory)) if store.directory.exists() else []


class _Gate:
    """Holds the store's writer thread until opened, so a write is under way while the test acts."""

    def __init__(self, store: PushStore) -> None:
        self.opened = threading.Event()
        self.waiting = threading.Event()
        store._writer.submit(self._hold)

    def _hold(self) -> None:
        self.waiting.set()
        self.opened.wait(SIGNAL_TIMEOUT_S)


def test_a_carried_push_is_written_out_and_read_back_byte_for_byte(tmp_path: Path) -> None:
    pool = BufferPool(max_idle=4)
    store = PushStore(pool, tmp_path)
    buffer = _filled(pool, 7)
    expected = bytes(buffer)
    store.hold(_push(), buffer, "fp32")
    assert asyncio.run(store.carry(("a", 3))) is None
    held = store.get(("a", 3))
    assert held is not None and held.where is Where.DISK and held.buffer is None
    assert len(_files(store)) == 1 and pool.idle == 1  # the buffer went back to the pool
    taken = store.take(("a", 3))
    assert taken is held and store.pending() == []
    (loaded,) = store.load_all([taken])
    assert bytes(loaded) == expected
    assert _files(store) == [] and store.written == store.read_back == 1
    store.close()


def test_a_push_taken_while_its_write_runs_is_merged_from_memory_and_its_file_removed(tmp_path: Path) -> None:
    pool = BufferPool(max_idle=4)
    store = PushStore(pool, tmp_path)
    buffer = _filled(pool, 1)
    store.hold(_push(), buffer, "fp32")

    async def scenario() -> None:
        gate = _Gate(store)
        carrying = asyncio.create_task(store.carry(("a", 3)))
        await asyncio.sleep(0)  # the write is queued behind the gate
        held = store.take(("a", 3))
        assert held is not None and held.buffer is buffer
        (loaded,) = store.load_all([held])
        assert loaded is buffer  # no read: the merge reads the buffer it already has
        gate.opened.set()
        async with asyncio.timeout(SIGNAL_TIMEOUT_S):
            assert await carrying is None

    asyncio.run(scenario())
    store.close()  # waits for the writer's removal of the file
    assert not store.directory.exists()
    assert pool.idle == 0  # the merge owns the buffer: the writer did not give it back


def test_a_push_dropped_while_its_write_runs_goes_back_to_the_pool_once(tmp_path: Path) -> None:
    pool = BufferPool(max_idle=4)
    store = PushStore(pool, tmp_path)
    buffer = _filled(pool, 2)
    store.hold(_push(), buffer, "fp32")

    async def scenario() -> None:
        gate = _Gate(store)
        carrying = asyncio.create_task(store.carry(("a", 3)))
        await asyncio.sleep(0)
        assert store.drop(("a", 3)) is not None
        assert pool.idle == 0  # not yet: the write still reads it
        gate.opened.set()
        async with asyncio.timeout(SIGNAL_TIMEOUT_S):
            assert await carrying is None

    asyncio.run(scenario())
    store.close()  # waits for the writer's removal of the file
    assert pool.idle == 1 and pool.take(SIZE) is buffer.obj


def test_a_push_dropped_on_disk_leaves_no_file(tmp_path: Path) -> None:
    pool = BufferPool(max_idle=4)
    store = PushStore(pool, tmp_path)
    store.hold(_push(), _filled(pool, 3), "fp32")
    asyncio.run(store.carry(("a", 3)))
    assert len(_files(store)) == 1
    store.drop(("a", 3))
    store.close()
    assert not store.directory.exists() and pool.idle == 1


def test_a_write_that_fails_keeps_the_push_in_memory(tmp_path: Path) -> None:
    """A full disk, or here a file where the directory should be: the push stays as it was."""
    pool = BufferPool(max_idle=4)
    store = PushStore(pool, tmp_path)
    store.directory.write_bytes(b"not a directory")
    buffer = _filled(pool, 4)
    expected = bytes(buffer)
    store.hold(_push(), buffer, "fp32")
    problem = asyncio.run(store.carry(("a", 3)))
    assert isinstance(problem, OSError)
    held = store.take(("a", 3))
    assert held is not None and held.buffer is buffer and bytes(store.load_all([held])[0]) == expected
    assert pool.idle == 0
    store._writer.shutdown(wait=True)


def test_a_file_that_lost_bytes_fails_the_load_and_nothing_is_left_behind(tmp_path: Path) -> None:
    pool = BufferPool(max_idle=4)
    store = PushStore(pool, tmp_path)
    for learner in ("a", "b"):
        store.hold(_push(learner), _filled(pool, 5), "fp32")
        asyncio.run(store.carry((learner, 3)))
    first, second = store.take(("a", 3)), store.take(("b", 3))
    assert first is not None and second is not None and first.path is not None
    with open(first.path, "r+b") as file:
        file.truncate(SIZE - 1)
    idle = pool.idle
    with pytest.raises(OSError, match="does not hold 65536 bytes"):
        store.load_all([first, second])
    assert _files(store) == [] and pool.idle == idle  # the read-back buffer went back too
    store.close()


def test_a_new_store_empties_what_an_earlier_process_left(tmp_path: Path) -> None:
    (tmp_path / LATE_DIR).mkdir()
    (tmp_path / LATE_DIR / "61-3.fp32").write_bytes(b"x" * 10)
    store = PushStore(BufferPool(), tmp_path)
    assert not store.directory.exists()
    store.close()


def test_holding_a_push_twice_is_a_bug_said_at_once(tmp_path: Path) -> None:
    pool = BufferPool()
    store = PushStore(pool, tmp_path)
    store.hold(_push(), _filled(pool, 6), "fp32")
    with pytest.raises(KeyError, match="already held"):
        store.hold(_push(), _filled(pool, 6), "fp32")
    store.close()


def _model() -> GlobalModel:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    specs = model_entries(module)
    model = GlobalModel(
        plan_fragments([(s.name, s.shape) for s in specs], 1), specs, chunk_bytes=4096, embedding_pattern="-"
    )
    model.load(dict(module.named_parameters()))
    model.publish_all()
    return model


def _delta(model: GlobalModel, seed: int) -> bytearray:
    buffer = bytearray(model.fragments[0].raw_bytes)
    generator = torch.Generator().manual_seed(seed)
    for view in model.deltas(0, buffer):
        view.copy_(torch.randn(view.shape, generator=generator) * 1e-2)
    return buffer


def test_the_service_merges_a_late_push_read_back_from_disk_as_if_it_had_stayed(tmp_path: Path) -> None:
    """Learner b's push completes after its round merged: the rounds say Carry, the service writes
    it out, and the fragment's next round merges it, read back, with a's fresh push. The result is
    bit for bit the merge of the same pushes held in memory (a twin model)."""
    model, twin = _model(), _model()
    rounds = Rounds(RoundConfig(fragments=1, sync_every=1))
    clock = [0.0]
    service = SyncerService(
        SyncerConfig(),
        model,
        rounds,
        state_dir=tmp_path,
        incarnation="test",
        secret=None,
        meta={},
        clock=lambda: clock[0],
    )  # type: ignore[arg-type]

    def arrive(push: Push, seed: int) -> list[Action]:
        assert rounds.admit(push, clock[0]) is None
        service.pushes.hold(push, memoryview(model.buffers.take(model.fragments[0].raw_bytes)), "fp32")
        held = service.pushes.get((push.learner, push.round_index))
        assert held is not None and held.buffer is not None
        held.buffer[:] = _delta(model, seed)
        verdict = model.screen(0, held.buffer, [], max_norm_ratio=10.0, steps=push.c_steps)
        return rounds.push_complete(push, verdict, clock[0])

    def merge_of(actions: list[Action]) -> Merge:
        if not (merges := [a for a in actions if isinstance(a, Merge)]):
            clock[0] += 100.0  # past every grace window
            merges = [a for a in rounds.tick(clock[0]) if isinstance(a, Merge)]
        (merge,) = merges
        return merge

    try:
        for learner in ("a", "b"):
            rounds.join(learner, clock[0])
        requests = [a for learner in ("a", "b") for a in rounds.step(learner, 1, 1.0, clock[0])]
        (first,) = {a.round_index for a in requests if isinstance(a, Request)}
        merge = merge_of(arrive(Push("a", first, 0, 0, 4, 400), seed=1))
        asyncio.run(service._merge(merge))
        late = arrive(Push("b", first, 0, 0, 4, 400), seed=2)
        assert [a for a in late if isinstance(a, Carry)] == [Carry(Push("b", first, 0, 0, 4, 400))]
        asyncio.run(service._carry(Push("b", first, 0, 0, 4, 400)))
        assert service.pushes.on_disk() == 1 and len(os.listdir(service.pushes.directory)) == 1

        requests = [a for learner in ("a", "b") for a in rounds.step(learner, 2, 1.0, clock[0])]
        (second,) = {a.round_index for a in requests if isinstance(a, Request)}
        actions = arrive(Push("a", second, 0, 1, 4, 400), seed=3)
        actions += arrive(Push("b", second, 0, 1, 4, 400), seed=4)
        merge = merge_of(actions)
        assert {(p.learner, p.round_index) for p in merge.pushes} == {
            ("a", second),
            ("b", first),
            ("b", second),
        }
        asyncio.run(service._merge(merge))
    finally:
        service._executor.shutdown()
        service._screener.shutdown()
        service.pushes.close()
    assert service.pushes.read_back == 1 and model.fragments[0].version == 2

    seeds = {("a", first): 1, ("b", first): 2, ("a", second): 3, ("b", second): 4}
    twin.merge(0, [_delta(twin, 1)], [1.0], lr=0.7, mu=0.9, merge="rda", version=1)
    pushes = [_delta(twin, seeds[(p.learner, p.round_index)]) for p in merge.pushes]
    twin.merge(0, pushes, list(merge.weights), lr=0.7, mu=0.9, merge="rda", version=2)
    assert bytes(model.fragments[0].master) == bytes(twin.fragments[0].master)
    assert bytes(model.fragments[0].momentum) == bytes(twin.fragments[0].momentum)
