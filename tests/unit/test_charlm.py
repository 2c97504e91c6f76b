"""charlm, the embedded default model: the stdlib corpus and its split, the resumable batch stream,
the model's stable names and initial weights, real training on the CPU, evaluation, and the entry
as dilocod loads it for both roles."""

from __future__ import annotations

import io
import math
import random

import pytest
import torch

from dilocod import LearnerContext, StepResult
from dilocod.examples import charlm
from dilocod.examples.charlm import data
from dilocod.model.entry import load_trainer

ENTRY = "dilocod.examples.charlm:make_trainer"


def ctx(role: str = "learner", seed: int = 0, rank: int = 0) -> LearnerContext:
    return LearnerContext(f"{role}-{seed}", role, "cpu", rank, 1, None, seed)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sources() -> tuple[data.SourceFile, ...]:
    return data.list_sources()


def roundtrip(state: object) -> object:
    """Through torch.save and torch.load(weights_only=True), as the learner's local state goes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ---------------------------------------------------------------------------- corpus and split


def test_sources_are_the_stdlib_sorted_and_without_site_packages(
    sources: tuple[data.SourceFile, ...],
) -> None:
    paths = [f.relpath for f in sources]
    assert paths == sorted(paths)
    assert "os.py" in paths and "json/decoder.py" in paths
    assert not any(part in {"site-packages", "dist-packages"} for p in paths for part in p.split("/"))
    assert data.list_sources() == sources
    assert sum(f.size for f in sources) > 1_000_000


def test_site_packages_and_caches_are_pruned(tmp_path) -> None:
    for relpath in ("b.py", "a/x.py", "a/notes.txt", "site-packages/pkg/y.py", "a/__pycache__/z.py"):
        (tmp_path / relpath).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relpath).write_bytes(b"print(1)\n")
    assert [f.relpath for f in data.list_sources(tmp_path)] == ["a/x.py", "b.py"]


def test_split_is_deterministic_disjoint_covering_and_balanced(sources: tuple[data.SourceFile, ...]) -> None:
    split = data.split_sources(sources, 4)
    shuffled = list(sources)
    random.Random(1).shuffle(shuffled)
    assert data.split_sources(shuffled, 4) == split  # order of discovery does not matter

    held_out = {f.relpath for f in split.held_out}
    shards = [{f.relpath for f in shard} for shard in split.shards]
    assert 0.02 < len(held_out) / len(sources) < 0.10
    for i, shard in enumerate(shards):
        assert shard and not shard & held_out
        for other in shards[i + 1 :]:
            assert not shard & other
    assert held_out.union(*shards) == {f.relpath for f in sources}
    sizes = [split.shard_bytes(i) for i in range(4)]
    assert max(sizes) / min(sizes) < 1.05
    # Every shard mixes the packages (near-IID), not one alphabetical slice each.
    for shard in shards:
        assert any(p.startswith("test/") for p in shard) and any("/" not in p for p in shard)

    # The held-out part does not depend on the shard count; one shard is the whole training part.
    whole = data.split_sources(sources, 1)
    assert whole.held_out == split.held_out
    assert {f.relpath for f in whole.shards[0]} == set().union(*shards)


def test_shards_read_their_own_files() -> None:
    split = data.split_sources(data.list_sources(), 4)
    shard = data.load_shard(2, 4)
    assert shard.dtype == torch.uint8 and shard.numel() == split.shard_bytes(2)
    first = split.shards[2][0]
    assert bytes(shard[: first.size].tolist()) == (data.stdlib_root() / first.relpath).read_bytes()
    assert data.load_held_out().numel() == split.held_out_bytes
    with pytest.raises(ValueError, match="shard 4"):
        data.load_shard(4, 4)


# ---------------------------------------------------------------------------- the batch stream


def test_batches_are_contiguous_windows_reproducible_from_the_cursor() -> None:
    shard = torch.arange(10_000, dtype=torch.int64).remainder(251).to(torch.uint8)
    stream = data.BatchStream(shard, context=32, batch_size=4, seed=5)
    batches = [stream.next_batch() for _ in range(5)]
    assert stream.cursor == 5
    for inputs, targets in batches:
        assert inputs.shape == targets.shape == (4, 32) and inputs.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next bytes
        assert torch.equal(targets[:, -1], (inputs[:, -1] + 1) % 251)  # a contiguous window
    assert not torch.equal(batches[0][0], batches[1][0])

    # Batch number c is a pure function of (seed, rank, c).
    jumped = data.BatchStream(shard, context=32, batch_size=4, seed=5, cursor=3)
    assert all(torch.equal(a, b) for a, b in zip(jumped.next_batch(), batches[3], strict=True))
    for other in (
        data.BatchStream(shard, context=32, batch_size=4, seed=6),
        data.BatchStream(shard, context=32, batch_size=4, seed=5, rank=1),
    ):
        assert not torch.equal(other.next_batch()[0], batches[0][0])


def test_restoring_the_cursor_continues_the_same_stream() -> None:
    shard = data.load_shard(0, 4)
    stream = data.BatchStream(shard, context=128, batch_size=16, seed=3)
    for _ in range(7):
        stream.next_batch()
    state = roundtrip(stream.state_dict())
    expected = [stream.next_batch() for _ in range(3)]

    resumed = data.BatchStream(shard, context=128, batch_size=16, seed=3)
    resumed.load_state_dict(state)  # type: ignore[arg-type]
    for (inputs, targets), (want_inputs, want_targets) in zip(
        (resumed.next_batch() for _ in range(3)), expected, strict=True
    ):
        assert torch.equal(inputs, want_inputs) and torch.equal(targets, want_targets)
    with pytest.raises(ValueError, match="cursor"):
        resumed.load_state_dict({"cursor": -1})


# ---------------------------------------------------------------------------- the model


def test_model_names_and_initial_weights_are_the_same_everywhere() -> None:
    rng_before = torch.get_rng_state()
    first, second = charlm.CharLM(), charlm.CharLM()
    assert torch.equal(torch.get_rng_state(), rng_before)  # building a model leaves the global RNG alone

    names = [name for name, _ in first.named_parameters()]
    assert names == [name for name, _ in second.named_parameters()]
    assert names[:2] == ["token_embed.weight", "pos_embed.weight"] and names[-1] == "final_norm.weight"
    assert "blocks.3.attn.qkv.weight" in names
    # The head is tied: one tensor under one name, merged once.
    assert [n for n, _ in first.named_parameters(remove_duplicate=False)] == names
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert sum(p.numel() for p in first.parameters()) == charlm.CharLMConfig().num_parameters == 221_760

    other_seed = charlm.CharLM(charlm.CharLMConfig(init_seed=1))
    assert not torch.equal(other_seed.token_embed.weight, first.token_embed.weight)
    with pytest.raises(ValueError, match="divisible"):
        charlm.CharLMConfig(width=30, heads=4)


def test_model_is_causal() -> None:
    model = charlm.CharLM(charlm.CharLMConfig(width=32, layers=2, heads=2, context=16))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.equal(model(tokens)[:, :10], model(changed)[:, :10])
        assert not torch.equal(model(tokens)[:, 10:], model(changed)[:, 10:])


# ---------------------------------------------------------------------------- the entry, training, evaluation


def test_entry_for_the_syncer_builds_the_model_only() -> None:
    syncer = load_trainer(ENTRY, ctx("syncer"))
    learner = load_trainer(ENTRY, ctx("learner", seed=2))
    assert syncer.optimizer is None and syncer.state_dict is None
    assert syncer.step(0) == StepResult(0)
    # The syncer's initial global model is the learners' initial model, name for name.
    learner_params = dict(learner.model.named_parameters())
    for name, parameter in syncer.model.named_parameters():
        assert torch.equal(parameter, learner_params[name]), name
    assert list(learner_params) == [n for n, _ in syncer.model.named_parameters()]


def test_learner_trains_and_resumes_from_its_state() -> None:
    h = charlm.load_held_out()
    trainer = load_trainer(ENTRY, ctx("learner", seed=1))
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    initial_eval = charlm.evaluate(trainer.model, held_out=h)
    assert abs(initial_eval - math.log(256)) < 0.3  # an untrained model is near uniform

    losses = []
    for index in range(30):
        result = trainer.step(index)
        assert result.tokens == 16 * 128 and isinstance(result.loss, float)
        losses.append(result.loss)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert charlm.evaluate(trainer.model, held_out=h) < initial_eval - 1.0

    # Model, optimizer and data cursor saved as the learner saves them, loaded into a fresh trainer:
    # the next steps see the same batches and compute the same losses.
    state = roundtrip(
        {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "user": dict(trainer.state_dict()),  # type: ignore[misc]
        }
    )
    assert state["user"] == {"cursor": 30, "seed": 1, "rank": 0}  # type: ignore[index]
    resumed = load_trainer(ENTRY, ctx("learner", seed=1))
    resumed.model.load_state_dict(state["model"])  # type: ignore[index]
    resumed.optimizer.load_state_dict(state["optimizer"])  # type: ignore[index, union-attr]
    resumed.load_state_dict(state["user"])  # type: ignore[index, misc]
    for index in range(30, 32):
        assert resumed.step(index).loss == pytest.approx(trainer.step(index).loss, rel=1e-5)


def test_evaluate_is_deterministic_and_leaves_the_model_as_it_was() -> None:
    model = charlm.CharLM()
    model.train()
    first = charlm.evaluate(model)
    assert charlm.evaluate(model) == first
    assert charlm.evaluate(model, held_out=charlm.load_held_out()) == first
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    assert charlm.evaluate(model, batches=2, batch_size=4) != first  # other windows, other number
