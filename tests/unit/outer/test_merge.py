"""RDA and mean merges against a float64 reference written here, and their invariants."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.outer import embedding_mask, mean_merge, merge_weights, rda_merge
from dilocod.outer.merge import U_NORM_EPS

SHAPES = [(37, 5), (1000,), (3,), (2, 2, 2)]


def reference_rda(deltas: list[torch.Tensor], weights: list[float], embedding: bool = False) -> torch.Tensor:
    """docs/design.md §3.4 step 3 in float64, straight from the equations."""
    pairs = [(w, d.double()) for w, d in zip(weights, deltas, strict=True) if w > 0]
    total = sum(w for w, _ in pairs)
    mean = sum(w * d for w, d in pairs) / total
    if len(pairs) == 1 or embedding or any(float(d.norm()) == 0.0 for _, d in pairs):
        return mean
    mean_norm = sum(w * d.norm() for w, d in pairs) / total
    u = sum(w * d / d.norm() for w, d in pairs) / total
    if float(u.norm()) <= U_NORM_EPS:
        return mean
    return mean_norm * u / u.norm()


#: Float32 math against a float64 reference: a few float32 ulps of the largest value, whatever the
#: order of the sums (contributors, blocks, SIMD width) that the machine's kernels pick.
F32_RTOL = 2e-6


def assert_matches_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=F32_RTOL, atol=F32_RTOL * float(want.abs().max()))


def contributions(count: int, seed: int, shapes: list[tuple[int, ...]] = SHAPES) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    # Different scales per learner, as real outer gradients have.
    return [[torch.randn(s, generator=gen) * (0.5 + m) for s in shapes] for m in range(count)]


@pytest.mark.parametrize("count", range(1, 17))
@pytest.mark.parametrize("block_numel", [64, 1 << 17])
def test_rda_matches_float64_reference(count: int, block_numel: int) -> None:
    deltas = contributions(count, seed=count)
    weights = merge_weights([1000 * (m + 1) for m in range(count)], [10 + m for m in range(count)])
    merged = rda_merge(deltas, weights, block_numel=block_numel)
    for t, got in enumerate(merged):
        want = reference_rda([d[t] for d in deltas], weights)
        assert_matches_reference(got, want)


def test_rda_keeps_the_norm_where_the_mean_shrinks() -> None:
    count = 16
    gen = torch.Generator().manual_seed(3)
    deltas = []
    for _ in range(count):
        d = torch.randn(4096, generator=gen)
        deltas.append([d * (2.5 / d.norm())])  # equal norms, nearly orthogonal directions
    weights = [1.0 / count] * count
    (rda,) = rda_merge(deltas, weights)
    (mean,) = mean_merge(deltas, weights)
    assert float(rda.norm()) == pytest.approx(2.5, rel=1e-6)
    assert float(mean.norm()) < 2.5 / math.sqrt(count) * 1.2  # shrinks like 1/sqrt(M)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**31), st.permutations(range(8)))
def test_rda_is_permutation_invariant(count: int, seed: int, order: list[int]) -> None:
    deltas = contributions(count, seed, shapes=[(257,), (4, 3)])
    gen = torch.Generator().manual_seed(seed)
    weights = [float(x) for x in torch.rand(count, generator=gen) + 0.1]
    merged = rda_merge(deltas, weights, block_numel=64)
    perm = [i for i in order if i < count]
    shuffled = rda_merge([deltas[i] for i in perm], [weights[i] for i in perm], block_numel=64)
    for a, b in zip(merged, shuffled, strict=True):
        torch.testing.assert_close(a, b, rtol=F32_RTOL, atol=F32_RTOL * float(b.abs().max()))


def test_one_learner_gets_its_delta_back_exactly() -> None:
    deltas = contributions(3, seed=4)
    for weights in ([1.0, 0.0, 0.0], [0.0, 0.3, 0.0]):
        learner = weights.index(max(weights))
        for merge in (rda_merge, mean_merge):
            merged = merge(deltas, weights)
            assert all(torch.equal(a, b) for a, b in zip(merged, deltas[learner], strict=True))
            assert all(a.data_ptr() != b.data_ptr() for a, b in zip(merged, deltas[learner], strict=True))


def test_zero_vector_and_cancelling_directions_fall_back_to_the_mean() -> None:
    gen = torch.Generator().manual_seed(5)
    d = torch.randn(100, generator=gen)
    # A zero contribution: the weighted mean, not a division by zero.
    deltas = [[d], [torch.zeros(100)]]
    (got,) = rda_merge(deltas, [0.75, 0.25])
    torch.testing.assert_close(got, 0.75 * d)
    # Opposite directions with equal weights: u = 0, so the mean (zero, up to rounding).
    deltas = [[d], [-2 * d]]
    (got,) = rda_merge(deltas, [0.5, 0.5])
    torch.testing.assert_close(got, -0.5 * d)
    assert torch.isfinite(got).all()


def test_embeddings_use_the_weighted_mean() -> None:
    deltas = contributions(4, seed=6, shapes=[(10, 4), (10, 4)])
    weights = [0.1, 0.2, 0.3, 0.4]
    mask = embedding_mask(["tokens.embed.weight", "block.0.mlp.weight"])
    assert mask == [True, False]
    merged = rda_merge(deltas, weights, is_embedding=mask)
    by_index = rda_merge(deltas, weights, is_embedding=lambda t: t == 0)
    mean = mean_merge(deltas, weights)
    torch.testing.assert_close(merged[0], mean[0])
    assert_matches_reference(merged[1], reference_rda([d[1] for d in deltas], weights))
    assert not torch.allclose(merged[1], mean[1])
    assert all(torch.equal(a, b) for a, b in zip(merged, by_index, strict=True))


@pytest.mark.parametrize("block_numel", [1, 7, 64, 1 << 17])
def test_any_order_of_the_sums_matches_the_reference(block_numel: int) -> None:
    """Contributors in every order and blocks of every size round differently in float32 (as
    another machine's kernels do); each result is within float32 tolerance of the reference."""
    deltas = contributions(4, seed=6, shapes=[(10, 4), (10, 4)])
    weights = [0.1, 0.2, 0.3, 0.4]
    mask = [True, False]
    want = [
        reference_rda([d[0] for d in deltas], weights, embedding=True),
        reference_rda([d[1] for d in deltas], weights),
    ]
    for order in itertools.permutations(range(4)):
        ordered = [deltas[m] for m in order]
        merged = rda_merge(ordered, [weights[m] for m in order], is_embedding=mask, block_numel=block_numel)
        for got, expected in zip(merged, want, strict=True):
            assert_matches_reference(got, expected)


@pytest.mark.parametrize("count", [2, 5, 16])
def test_mean_matches_float64_reference(count: int) -> None:
    deltas = contributions(count, seed=7 + count)
    weights = [float(m % 3) for m in range(count)]  # some zero weights
    merged = mean_merge(deltas, weights, block_numel=100)
    for t, got in enumerate(merged):
        want = reference_rda([d[t] for d in deltas], weights, embedding=True)
        assert_matches_reference(got, want)


def test_out_buffers_are_reused_and_inputs_left_alone() -> None:
    deltas = contributions(3, seed=8)
    before = [[t.clone() for t in d] for d in deltas]
    out = [torch.full(s, math.nan) for s in SHAPES]
    merged = rda_merge(deltas, [1.0, 2.0, 3.0], out=out)
    assert all(a is b for a, b in zip(merged, out, strict=True))
    fresh = rda_merge(deltas, [1.0, 2.0, 3.0])
    assert all(torch.equal(a, b) for a, b in zip(out, fresh, strict=True))
    for now, then in zip(deltas, before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(now, then, strict=True))


def test_non_contiguous_contributions() -> None:
    deltas = [[torch.randn(20, 30).t()] for _ in range(3)]
    assert not deltas[0][0].is_contiguous()
    (got,) = rda_merge(deltas, [1.0, 1.0, 1.0], block_numel=16)
    want = reference_rda([d[0] for d in deltas], [1.0, 1.0, 1.0])
    assert_matches_reference(got, want)


@pytest.mark.parametrize(
    ("deltas", "weights", "error"),
    [
        ([[torch.zeros(3)]], [0.0], ValueError),
        ([[torch.zeros(3)]], [1.0, 1.0], ValueError),
        ([[torch.zeros(3)], [torch.zeros(4)]], [1.0, 1.0], ValueError),
        ([[torch.zeros(3)], [torch.zeros(3), torch.zeros(1)]], [1.0, 1.0], ValueError),
        ([[torch.zeros(3, dtype=torch.bfloat16)]], [1.0], TypeError),
        ([[torch.zeros(3)]], [math.nan], ValueError),
        ([], [], ValueError),
    ],
)
def test_bad_rounds_raise(deltas: list[list[torch.Tensor]], weights: list[float], error: type) -> None:
    with pytest.raises(error):
        rda_merge(deltas, weights)
