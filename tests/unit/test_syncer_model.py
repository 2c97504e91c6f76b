"""The syncer's global model store: packed fragments, snapshots lent to sends and reused, the merge
against dilocod.outer applied to plain tensors, model mismatches named, and a model that stays
finite: pushes screened against their fragment's norm, merges committed only when finite."""

from __future__ import annotations

import asyncio
import math
import mmap
import threading
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from dilocod.config import SyncerConfig
from dilocod.model.params import model_entries
from dilocod.model.plan import plan_fragments
from dilocod.outer import mean_merge, nesterov_step_, rda_merge
from dilocod.outer.guard import FRAGMENT_NORM_TOO_LARGE, NON_FINITE_RESULT, l2_norm
from dilocod.syncer.buffers import BufferPool
from dilocod.syncer.model import GlobalModel, MergeRejected, ModelMismatch
from dilocod.syncer.rounds import Merge, Push, Request, RoundConfig, Rounds
from dilocod.syncer.service import SyncerService
from dilocod.wire.codecs import checksum, chunk_checksums

CHUNK = 4096


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 50, bias=False)
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, one name


def build(fragments: int = 3) -> tuple[GlobalModel, Tiny]:
    torch.manual_seed(0)
    module = Tiny()
    specs = model_entries(module)
    plan = plan_fragments([(s.name, s.shape) for s in specs], fragments)
    model = GlobalModel(plan, specs, chunk_bytes=CHUNK, embedding_pattern="*embed*")
    model.load(dict(module.named_parameters()))
    return model, module


def test_tied_parameters_are_one_tensor() -> None:
    names = [s.name for s in model_entries(Tiny())]
    assert names.count("embed.weight") == 1 and "head.weight" not in names


def test_load_and_state_round_trip() -> None:
    model, module = build()
    params, momentum = model.state()
    for name, tensor in module.named_parameters():
        assert torch.equal(torch.cat(params[name]), tensor.detach())
        assert all(torch.count_nonzero(part) == 0 for part in momentum[name])


def test_a_parameter_cut_across_fragments_loads_into_its_pieces_and_comes_back_whole() -> None:
    model, module = build(fragments=3)
    cut = [name for name, parts in model.state()[0].items() if len(parts) > 1]
    assert cut, "the plan of 3 fragments cuts a parameter of Tiny"
    name = cut[0]
    store = next(s for s in model.fragments if any(p[0] == name and p[1] > 0 for p in s.pieces))
    i, (_, start, stop) = next((i, p) for i, p in enumerate(store.pieces) if p[0] == name)
    # The store's tensor is the parameter's rows, on the wire under `name[start:stop]`.
    assert store.manifest[i].name == f"{name}[{start}:{stop}]"
    whole = dict(module.named_parameters())[name].detach()
    assert torch.equal(store.params[i], whole[start:stop])
    # state() gives views of the live buffers: a write to the store shows in the pieces.
    store.params[i].fill_(7.0)
    store.momentum_views[i].fill_(-1.0)
    params, momentum = model.state()
    assert torch.equal(torch.cat(params[name])[start:stop], torch.full_like(whole[start:stop], 7.0))
    assert torch.equal(torch.cat(params[name])[:start], whole[:start])
    assert float(torch.cat(momentum[name])[start:stop].sum()) == -whole[start:stop].numel()
    # load() with momentum copies each parameter's rows into its pieces.
    new = {n: torch.randn(p.shape) for n, p in module.named_parameters()}
    moment = {n: torch.randn(p.shape) for n, p in module.named_parameters()}
    model.load(new, moment, versions=[1, 2, 3])
    params, momentum = model.state()
    for n, value in new.items():
        assert torch.equal(torch.cat(params[n]), value) and torch.equal(torch.cat(momentum[n]), moment[n])
    assert model.versions == [1, 2, 3]


def test_every_piece_of_an_embedding_is_merged_as_one() -> None:
    model, _ = build(fragments=6)
    embed = [(s.index, i) for s in model.fragments for i, p in enumerate(s.pieces) if p[0] == "embed.weight"]
    assert len(embed) > 1  # the embedding is cut
    for store in model.fragments:
        assert store.is_embedding == [p[0] == "embed.weight" for p in store.pieces]


def test_loading_a_different_model_names_the_difference() -> None:
    model, module = build()
    state = dict(module.named_parameters())
    state["hidden.weight"] = torch.zeros(3, 3)
    with pytest.raises(ModelMismatch, match=r"'hidden\.weight' has shape"):
        model.load(state)
    del state["hidden.weight"]
    with pytest.raises(ModelMismatch, match=r"'hidden\.weight' is missing"):
        model.load(state)


def test_publishing_sends_the_master_itself() -> None:
    """No copy of the model is made to serve it: the published snapshot is the master."""
    model, _ = build()
    model.publish_all()
    for index, store in enumerate(model.fragments):
        snapshot = model.acquire(index)
        assert snapshot.buffer is store.master
        assert snapshot.checksums == chunk_checksums(store.master, CHUNK)
        assert snapshot.digest == checksum(store.master)
        model.release(index, snapshot)
    assert model.buffers.created == 0


def test_a_snapshot_buffer_is_never_reused_while_a_send_holds_it() -> None:
    """A send of version 0 keeps reading the same bytes through three merges of its fragment (the
    merges write elsewhere, and nothing is handed that buffer); released, it goes back to the pool."""
    model, _ = build()
    model.publish_all()
    held = model.acquire(1)
    sent = bytes(held.buffer)
    for version in (1, 2, 3):
        snapshot = model.merge(1, [_push(model, 1, 0.5)], [1.0], lr=0.7, mu=0.9, merge="rda", version=version)
        assert snapshot.buffer is not held.buffer
        model.publish(1, snapshot)
        assert model.acquire(1) is snapshot and model.fragments[1].master is snapshot.buffer
        model.release(1, snapshot)
        assert bytes(held.buffer) == sent and held.checksums == chunk_checksums(held.buffer, CHUNK)
        # Whatever the pool hands out now is not the buffer being sent.
        taken = [model.buffers.take(model.fragments[1].raw_bytes) for _ in range(model.buffers.idle + 1)]
        assert all(buffer is not held.buffer for buffer in taken)
        for buffer in taken:
            model.buffers.give(buffer)
    model.release(1, held)
    model.buffers.max_idle = 100
    size = model.fragments[1].raw_bytes
    taken = [model.buffers.take(size) for _ in range(model.buffers.idle)]
    assert any(buffer is held.buffer for buffer in taken)
    with pytest.raises(RuntimeError, match="released more often"):
        model.release(1, held)


def _equal_fragments(fragments: int = 4) -> GlobalModel:
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(fragments)])
    specs = model_entries(module)
    plan = plan_fragments([(s.name, s.shape) for s in specs], fragments)
    model = GlobalModel(plan, specs, chunk_bytes=CHUNK, embedding_pattern="-")
    model.load(dict(module.named_parameters()))
    return model


@pytest.mark.parametrize("learners", [1, 2, 3])
def test_the_number_of_fragment_buffers_is_bounded(learners: int) -> None:
    """Rounds over every fragment, each merging a push per learner (from the pool, as the service
    takes them) and sent to every learner: beyond Θ and b, the syncer creates M + 2 buffers once
    and reuses them for ever (a push per learner, the merge's two outputs: Θ_p and b_p)."""
    model = _equal_fragments()
    model.buffers.max_idle = learners + 2  # as the service sizes it
    model.publish_all()
    size = model.fragments[0].raw_bytes
    for round_index in range(5 * len(model.fragments)):
        index = round_index % len(model.fragments)
        pushes = [model.buffers.take(size) for _ in range(learners)]
        for push in pushes:
            for view in model.deltas(index, push):
                view.fill_(1e-3)
        version = model.versions[index] + 1
        snapshot = model.merge(index, pushes, [1.0] * learners, lr=0.7, mu=0.9, merge="rda", version=version)
        model.publish(index, snapshot)
        for push in pushes:
            model.buffers.give(push)
        sends = [model.acquire(index) for _ in range(learners)]
        for send in sends:
            model.release(index, send)
        assert model.buffers.created <= learners + 2
        assert model.buffers.idle <= learners + 2
    assert model.versions == [5] * len(model.fragments)


def test_a_buffer_pool_keeps_a_bounded_count_across_sizes() -> None:
    pool = BufferPool(max_idle=2)
    small, large, other = pool.take(10), pool.take(20), pool.take(20)
    assert (len(small), len(large), pool.created) == (10, 20, 3)
    for buffer in (small, large, other):
        pool.give(buffer)
    # Three given back, two kept: the other size went first.
    assert pool.idle == 2 and pool.freed == 1
    assert pool.take(20) is large and pool.take(20) is other and pool.take(10) is not small
    with pytest.raises(RuntimeError, match="twice"):
        pool.give(large)
        pool.give(large)


def test_merge_equals_the_outer_functions_on_plain_tensors() -> None:
    """RDA for non-embedding tensors and the weighted mean for embeddings, then SGD-Nesterov, on
    copies of the same values: the packed store must give the very same numbers."""
    model, _ = build(fragments=2)
    model.publish_all()
    (index,) = [i for i, f in enumerate(model.fragments) if any(f.is_embedding) and not all(f.is_embedding)]
    store = model.fragments[index]
    generator = torch.Generator().manual_seed(1)
    pushes = []
    for _ in range(3):
        push = bytearray(store.raw_bytes)
        for view in model.deltas(index, push):
            view.copy_(torch.randn(view.shape, generator=generator) * 1e-2)
        pushes.append(push)
    weights = [0.5, 0.3, 0.2]
    params = [p.clone() for p in store.params]
    momentum = [b.clone() for b in store.momentum_views]
    deltas = [[d.clone() for d in model.deltas(index, push)] for push in pushes]
    merged = rda_merge(deltas, weights, is_embedding=store.is_embedding)
    mean = mean_merge(deltas, weights)
    for t, is_embedding in enumerate(store.is_embedding):
        if is_embedding:  # embeddings take the weighted mean, the rest RDA
            torch.testing.assert_close(merged[t], mean[t])
    nesterov_step_(params, merged, momentum, lr=0.7, mu=0.9)
    snapshot = model.merge(index, pushes, weights, lr=0.7, mu=0.9, merge="rda", version=1)
    for t in range(len(params)):
        torch.testing.assert_close(store.params[t], params[t], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(store.momentum_views[t], momentum[t], rtol=1e-6, atol=1e-7)
    assert bytes(snapshot.buffer) == bytes(store.master)
    assert snapshot.version == 1 and model.versions[index] == 1
    assert snapshot.checksums == chunk_checksums(store.master, CHUNK)


def _push(model: GlobalModel, index: int, value: float) -> bytearray:
    push = bytearray(model.fragments[index].raw_bytes)
    for view in model.deltas(index, push):
        view.fill_(value)
    return push


def _state(model: GlobalModel, index: int) -> tuple[bytes, bytes, int]:
    store = model.fragments[index]
    return bytes(store.master), bytes(store.momentum), store.version


def _finite(model: GlobalModel, index: int) -> bool:
    store = model.fragments[index]
    return all(bool(torch.isfinite(t).all()) for t in [*store.params, *store.momentum_views])


def test_one_push_of_huge_finite_values_is_refused_by_a_fresh_fragment() -> None:
    """The attack measured on a fresh syncer (--fragments 4): one push of finite 3e38 values, from a
    learner holding the key, before the fragment had any accepted norm. It used to be accepted
    (finiteness was all the guard checked) and its merge served the whole fragment non-finite."""
    model, _ = build(fragments=4)
    model.publish_all()
    before = _state(model, 0)
    push = _push(model, 0, 3e38)
    verdict = model.screen(0, push, history=[], max_norm_ratio=10.0, steps=1)
    assert (verdict.accepted, verdict.reason) == (False, FRAGMENT_NORM_TOO_LARGE)
    assert math.isfinite(verdict.norm) and verdict.limit is not None and verdict.norm > verdict.limit
    assert _state(model, 0) == before and _finite(model, 0)
    # Had the screen let it through, the merge would not commit it either.
    with pytest.raises(MergeRejected, match="non-finite"):
        model.merge(0, [push], [1.0], lr=0.7, mu=0.9, merge="rda", version=1)
    assert _state(model, 0) == before and _finite(model, 0)


def test_screen_scales_by_the_fragment_as_of_its_last_merge() -> None:
    model, _ = build(fragments=2)
    model.publish_all()
    store = model.fragments[1]
    assert store.norm == pytest.approx(l2_norm(store.params))
    model.merge(1, [_push(model, 1, 0.5)], [1.0], lr=0.7, mu=0.9, merge="rda", version=1)
    assert store.norm == pytest.approx(l2_norm(store.params)) and store.norm > 0.5


@pytest.mark.parametrize("published", [True, False])
def test_a_merge_whose_result_is_not_finite_is_not_committed(published: bool) -> None:
    """Inputs the screen accepts, a result that overflows: Θ near float32's largest, an outer
    gradient as large as Θ (within the fragment bound). Θ, b and the version stay as they were,
    published or not, and the fragment merges normally afterwards. The rollback needs no copy
    kept between merges: with a pool that keeps nothing idle, the master, b and the published
    snapshot (the master itself) are all the fragment holds, before and after."""
    model, module = build(fragments=2)
    index = 1
    store = model.fragments[index]
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    for name, start, stop in store.pieces:
        params[name][start:stop].fill_(3e38)
    momentum = {n: torch.full_like(p, 1e-3) for n, p in params.items()}
    model.load(params, momentum)
    if published:
        model.publish_all()
    model.buffers.max_idle = 0
    before = _state(model, index)
    master = store.master
    push = _push(model, index, -3e38)
    assert model.screen(index, push, history=[], max_norm_ratio=10.0, steps=1).accepted
    with pytest.raises(MergeRejected, match=r"fragment 1: .*non-finite.* version 0") as raised:
        model.merge(index, [push], [1.0], lr=0.7, mu=0.9, merge="rda", version=1)
    assert raised.value.reason == NON_FINITE_RESULT
    assert _state(model, index) == before and _finite(model, index)
    assert store.master is master and model.buffers.idle == 0
    if published:
        snapshot = model.acquire(index)
        assert snapshot.version == 0 and snapshot.buffer is master
        model.release(index, snapshot)

    # The rolled-back b is the old one: the next merge equals SGD-Nesterov from the old state.
    small = _push(model, index, -1e37)
    expected_params = [p.clone() for p in store.params]
    expected_momentum = [b.clone() for b in store.momentum_views]
    nesterov_step_(expected_params, model.deltas(index, bytearray(small)), expected_momentum, lr=0.7, mu=0.9)
    snapshot = model.merge(index, [small], [1.0], lr=0.7, mu=0.9, merge="rda", version=1)
    assert snapshot.version == 1 and model.versions[index] == 1 and _finite(model, index)
    for t in range(len(expected_params)):
        torch.testing.assert_close(store.params[t], expected_params[t], rtol=1e-6, atol=0.0)
        torch.testing.assert_close(store.momentum_views[t], expected_momentum[t], rtol=1e-6, atol=0.0)


def test_a_merge_of_a_momentum_that_overflows_is_not_committed() -> None:
    """Θ far from overflow, b near float32's largest: b ← μ·b + Δ overflows (0.9 · 3e38 + 1e38), Θ with it."""
    model, module = build(fragments=2)
    index = 0
    store = model.fragments[index]
    momentum = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    for name, start, stop in store.pieces:
        momentum[name][start:stop].fill_(3e38)
    model.load({n: p.detach() for n, p in module.named_parameters()}, momentum)
    model.publish_all()
    before = _state(model, index)
    with pytest.raises(MergeRejected):
        model.merge(
            index,
            [_push(model, index, 1e38)],
            [1.0],
            lr=0.7,
            mu=0.9,
            merge="mean",
            version=1,
        )
    assert _state(model, index) == before


def test_load_after_publishing_is_refused() -> None:
    """A merge rolls Θ back to the current snapshot: loading another model under it would break that."""
    model, module = build()
    model.publish_all()
    with pytest.raises(RuntimeError, match="publish_all"):
        model.load(dict(module.named_parameters()))


def test_the_service_counts_a_rejected_merge_and_publishes_nothing(tmp_path: Path) -> None:
    """The round whose merge is not committed is dropped (abandoned), its pushes counted under
    non-finite-result, its fragment left at its version with its snapshot as it was."""
    module = torch.nn.Linear(4, 2)
    specs = model_entries(module)
    model = GlobalModel(
        plan_fragments([(s.name, s.shape) for s in specs], 1), specs, chunk_bytes=CHUNK, embedding_pattern="-"
    )
    model.load({n: torch.full_like(p, 3e38) for n, p in module.named_parameters()})
    rounds = Rounds(RoundConfig(fragments=1, sync_every=1))
    service = SyncerService(
        SyncerConfig(),
        model,
        rounds,
        state_dir=tmp_path,
        incarnation="test",
        secret=None,
        meta={},
        clock=lambda: 0.0,
    )  # type: ignore[arg-type]
    model.publish_all()
    before = _state(model, 0)
    try:
        rounds.join("a", 0.0)
        (request,) = [a for a in rounds.step("a", 1, 1.0, 0.0) if isinstance(a, Request)]
        push = Push("a", request.round_index, 0, request.version, 4, 400)
        assert rounds.admit(push, 0.0) is None
        buffer = _push(model, 0, -3e38)
        verdict = model.screen(0, buffer, [], max_norm_ratio=10.0, steps=1)
        assert verdict.accepted
        (merge,) = [a for a in rounds.push_complete(push, verdict, 0.0) if isinstance(a, Merge)]
        service.pushes.hold(push, memoryview(buffer), "fp32")
        with capture_logs() as logs:
            asyncio.run(service._merge(merge))
    finally:
        service._executor.shutdown()
        service._screener.shutdown()
    assert [entry["reason"] for entry in logs if entry["event"] == "merge rejected"] == [NON_FINITE_RESULT]
    assert rounds.rejected[NON_FINITE_RESULT] == 1 and rounds.rounds_abandoned == 1
    assert _state(model, 0) == before and model.acquire(0).version == 0
    assert service.status()["rejected_by_reason"] == {NON_FINITE_RESULT: 1}


def test_a_push_that_cannot_be_screened_fails_and_frees_its_buffer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Screening raising (a bug, or bytes no decoder expected) used to end in an "internal error"
    that kept the push's buffer held for good and its round waiting: now the push failed, its
    buffer goes back to the pool, and its round stops waiting for it."""
    module = torch.nn.Linear(4, 2)
    specs = model_entries(module)
    model = GlobalModel(
        plan_fragments([(s.name, s.shape) for s in specs], 1), specs, chunk_bytes=CHUNK, embedding_pattern="-"
    )
    rounds = Rounds(RoundConfig(fragments=1, sync_every=1))
    service = SyncerService(
        SyncerConfig(),
        model,
        rounds,
        state_dir=tmp_path,
        incarnation="test",
        secret=None,
        meta={},
        clock=lambda: 0.0,
    )  # type: ignore[arg-type]
    model.publish_all()

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("no decoder expected these bytes")

    monkeypatch.setattr(model, "screen", broken)
    try:
        rounds.join("a", 0.0)
        (request,) = [a for a in rounds.step("a", 1, 1.0, 0.0) if isinstance(a, Request)]
        push = Push("a", request.round_index, 0, request.version, 4, 400)
        assert rounds.admit(push, 0.0) is None
        buffer = _push(model, 0, 0.5)
        service.pushes.hold(push, memoryview(buffer), "fp32")
        with capture_logs() as logs:
            asyncio.run(service._screen(push, memoryview(buffer), "fp32"))
    finally:
        service._executor.shutdown()
        service._screener.shutdown()
    assert [entry["error"] for entry in logs if entry["event"] == "push not screened"] == [
        "ValueError('no decoder expected these bytes')"
    ]
    assert service.pushes.pending() == []
    assert model.buffers.idle == 1 and model.buffers.take(len(buffer)) is buffer
    # Its only learner's push failed: the round waits for nobody and ends without a merge.
    assert request.round_index not in rounds._open and rounds.rounds_abandoned == 1


def test_a_freed_buffer_is_unmapped_off_the_thread_that_gave_it_back() -> None:
    """Unmapping a written map of a 1B model's fragment costs the kernel about 20 ms: the pool hands
    it to a thread of its own, so the event loop that gave it back never waits for that."""
    pool = BufferPool(max_idle=0)
    buffer = pool.take(1 << 20)
    assert isinstance(buffer, mmap.mmap)
    buffer[:] = b"\x01" * (1 << 20)
    closed_by: list[str] = []
    closed = threading.Event()
    real_close = mmap.mmap.close

    class Watched(mmap.mmap):
        def close(self) -> None:
            closed_by.append(threading.current_thread().name)
            real_close(self)
            closed.set()

    watched = Watched(-1, 1 << 20)
    pool.give(watched)
    assert closed.wait(30)
    assert watched.closed and closed_by == ["dilocod-unmap"] and pool.freed == 1
    pool.give(buffer)
