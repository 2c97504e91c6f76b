"""The syncer's global model store: packed fragments, snapshots lent to sends and reused, the merge
against dilocod.outer applied to plain tensors, and model mismatches named."""

from __future__ import annotations

import pytest
import torch

from dilocod.learner.layout import model_entries
from dilocod.outer import mean_merge, nesterov_step_, plan_fragments, rda_merge
from dilocod.syncer.model import GlobalModel, ModelMismatch, Snapshot, first_mismatch
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.manifest import ModelEntry

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
        assert torch.equal(params[name], tensor.detach())
        assert torch.count_nonzero(momentum[name]) == 0


def test_loading_a_different_model_names_the_difference() -> None:
    model, module = build()
    state = dict(module.named_parameters())
    state["hidden.weight"] = torch.zeros(3, 3)
    with pytest.raises(ModelMismatch, match=r"'hidden\.weight' has shape"):
        model.load(state)
    del state["hidden.weight"]
    with pytest.raises(ModelMismatch, match=r"'hidden\.weight' is missing"):
        model.load(state)


def test_first_mismatch() -> None:
    ours = [ModelEntry("a", "float32", (2, 3)), ModelEntry("b", "float32", (4,))]
    assert (
        first_mismatch(ours, [ModelEntry("b", "bfloat16", (4,)), ModelEntry("a", "float32", (2, 3))]) is None
    )
    assert "'a' has shape [3, 2]" in str(first_mismatch(ours, [ModelEntry("a", "float32", (3, 2)), ours[1]]))
    assert "'b' is missing" in str(first_mismatch(ours, ours[:1]))
    assert "'c' is not in the syncer" in str(first_mismatch(ours, [*ours, ModelEntry("c", "float32", (1,))]))


def test_snapshots_are_lent_then_reused() -> None:
    model, _ = build()
    model.publish_all()
    first = model.acquire(1)
    assert first.checksums == chunk_checksums(first.buffer, CHUNK)
    target = model.spare_buffer(1)
    assert target is not first.buffer
    model.publish(1, Snapshot(1, target, chunk_checksums(target, CHUNK)))
    assert model.acquire(1).version == 1
    # The old snapshot is still lent: its buffer must not be handed out for writing.
    assert model.spare_buffer(1) is not first.buffer
    model.release(1, first)
    assert model.spare_buffer(1) is first.buffer


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
    snapshot = model.merge(
        index, pushes, weights, lr=0.7, mu=0.9, merge="rda", target=model.spare_buffer(index), version=1
    )
    for t in range(len(params)):
        torch.testing.assert_close(store.params[t], params[t], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(store.momentum_views[t], momentum[t], rtol=1e-6, atol=1e-7)
    assert bytes(snapshot.buffer) == bytes(store.master)
    assert snapshot.version == 1 and model.versions[index] == 1
    assert snapshot.checksums == chunk_checksums(store.master, CHUNK)
