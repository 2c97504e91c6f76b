"""The outer Nesterov step equals torch.optim.SGD(nesterov=True) bit for bit; the fused
merge-and-step equals the two calls one after the other: bit for bit for the weighted mean, to a
few float32 roundings for RDA (whose fused step is expanded into fewer ops, dilocod.outer.step)."""

from __future__ import annotations

import math

import pytest
import torch

from dilocod.outer import mean_merge, nesterov_step_, outer_step_, rda_merge

SHAPES = [(300, 7), (1000,), (5,), (4, 4, 4)]


def assert_within_roundings(expected: torch.Tensor, got: torch.Tensor) -> None:
    """Equal to within 1e-6 of the tensor's largest magnitude: about 8 float32 roundings (2^-23
    each) of the largest value, where the expanded RDA step measured at most 2.4e-7 over 60
    random rounds of M = 2, 4, 16; a wrong coefficient or a lost term would be off by far more."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0.0, atol=1e-6 * scale)


@pytest.mark.parametrize("block_numel", [1 << 17, 128, 7])
@pytest.mark.parametrize(("lr", "mu"), [(0.7, 0.9), (0.4, 0.95), (1.0, 0.5)])
def test_equals_torch_sgd_nesterov_over_50_steps(block_numel: int, lr: float, mu: float) -> None:
    gen = torch.Generator().manual_seed(11)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    sgd = torch.optim.SGD(reference, lr=lr, momentum=mu, nesterov=True)
    params = [t.clone() for t in start]
    momentum = [torch.zeros(s) for s in SHAPES]
    for step in range(50):
        delta = [torch.randn(s, generator=gen) * 10 ** (step % 3 - 2) for s in SHAPES]
        for p, d in zip(reference, delta, strict=True):
            p.grad = d.clone()
        sgd.step()
        nesterov_step_(params, delta, momentum, lr, mu, block_numel=block_numel)
        for p, ref in zip(params, reference, strict=True):
            assert torch.equal(p, ref.detach()), f"step {step} differs"
    for b, ref in zip(momentum, reference, strict=True):
        assert torch.equal(b, sgd.state[ref]["momentum_buffer"])


def test_works_on_parameters_that_require_grad_and_non_contiguous_views() -> None:
    gen = torch.Generator().manual_seed(12)
    base = torch.randn(40, 30, generator=gen)
    p = torch.nn.Parameter(base.clone())
    view = base.clone().t()  # non-contiguous
    b1, b2 = torch.zeros(40, 30), torch.zeros(30, 40)
    d = torch.randn(40, 30, generator=gen)
    nesterov_step_([p], [d], [b1], 0.7, 0.9, block_numel=64)
    nesterov_step_([view], [d.t()], [b2], 0.7, 0.9, block_numel=64)
    assert torch.equal(p.detach(), view.t())


def test_rejects_mismatched_state() -> None:
    with pytest.raises(ValueError):
        nesterov_step_([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(4)], 0.7, 0.9)
    with pytest.raises(TypeError):
        nesterov_step_([torch.zeros(3)], [torch.zeros(3, dtype=torch.float64)], [torch.zeros(3)], 0.7, 0.9)
    with pytest.raises(ValueError):
        nesterov_step_([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], 0.7, -0.1)


@pytest.mark.parametrize("merge", ["rda", "mean"])
@pytest.mark.parametrize("block_numel", [1 << 17, 100])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_fused_step_equals_merge_then_step(merge: str, block_numel: int, count: int) -> None:
    gen = torch.Generator().manual_seed(13 + count)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    momentum = [torch.randn(s, generator=gen) * 0.1 for s in SHAPES]
    fused_params, fused_momentum = [p.clone() for p in params], [b.clone() for b in momentum]
    scratch = [torch.empty(s) for s in SHAPES]
    is_embedding = [False, True, False, False]
    for _ in range(3):
        deltas = [[torch.randn(s, generator=gen) * (m + 1) for s in SHAPES] for m in range(count)]
        deltas[0][3].zero_()  # a zero contribution: RDA falls back to the mean on that tensor
        weights = [float(m + 1) for m in range(count)]
        if merge == "rda":
            merged = rda_merge(deltas, weights, is_embedding, block_numel=block_numel)
        else:
            merged = mean_merge(deltas, weights, block_numel=block_numel)
        nesterov_step_(params, merged, momentum, 0.7, 0.9, block_numel=block_numel)
        outer_step_(
            fused_params,
            fused_momentum,
            deltas,
            weights,
            0.7,
            0.9,
            merge=merge,
            is_embedding=is_embedding,
            scratch=scratch if count % 2 else None,
            block_numel=block_numel,
        )
        for a, b in zip(params + momentum, fused_params + fused_momentum, strict=True):
            if merge == "mean" or count == 1:
                assert torch.equal(a, b)
            else:
                assert_within_roundings(a, b)
    with pytest.raises(ValueError):
        outer_step_(params, momentum, deltas, weights, 0.7, 0.9, merge="median")


def _round(count: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    momentum = [torch.randn(s, generator=gen) * 0.1 for s in SHAPES]
    deltas = [[torch.randn(s, generator=gen) * (m + 1) for s in SHAPES] for m in range(count)]
    return params, momentum, deltas


def _clone(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("block_numel", [None, 100])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_consuming_the_deltas_gives_the_same_bits_and_only_touches_one_contribution(
    block_numel: int | None, count: int
) -> None:
    params, momentum, deltas = _round(count, 21 + count)
    deltas[0][3].zero_()  # RDA falls back to the mean on that tensor: nothing consumed there
    weights = [float(m + 1) for m in range(count)]
    is_embedding = [False, True, False, False]
    expected_p, expected_b = _clone(params), _clone(momentum)
    outer_step_(
        expected_p, expected_b, deltas, weights, 0.7, 0.9, is_embedding=is_embedding, block_numel=block_numel
    )
    mine = [_clone(d) for d in deltas]
    outer_step_(
        params,
        momentum,
        mine,
        weights,
        0.7,
        0.9,
        is_embedding=is_embedding,
        block_numel=block_numel,
        consume_deltas=True,
    )
    for a, b in zip(expected_p + expected_b, params + momentum, strict=True):
        assert torch.equal(a, b)
    for t in range(len(SHAPES)):
        changed = [m for m in range(count) if not torch.equal(mine[m][t], deltas[m][t])]
        # RDA tensors (0 and 2) with two or more contributions: u' went into one of them.
        assert len(changed) == (1 if t in (0, 2) and count > 1 else 0), (t, changed)


def test_consumed_fallback_to_the_mean_rebuilds_the_pivot() -> None:
    """Directions that cancel (‖u‖ ≈ 0) are found only after u' is formed in the pivot's buffer;
    the weighted mean then runs on the pivot rebuilt from u', equal to rounding."""
    params, momentum, _ = _round(2, 31)
    gen = torch.Generator().manual_seed(32)
    base = [torch.randn(s, generator=gen) for s in SHAPES]
    deltas = [[2.0 * d for d in base], [-d for d in base]]  # same norm share after RDA's weights
    weights = [1.0, 1.0]
    expected_p, expected_b = _clone(params), _clone(momentum)
    nesterov_step_(expected_p, mean_merge(deltas, weights), expected_b, 0.7, 0.9)
    outer_step_(params, momentum, [_clone(d) for d in deltas], weights, 0.7, 0.9, consume_deltas=True)
    for a, b in zip(expected_p + expected_b, params + momentum, strict=True):
        assert_within_roundings(a, b)


def test_a_pivot_shared_with_another_contribution_is_not_consumed() -> None:
    params, momentum, deltas = _round(2, 41)
    deltas[1] = list(deltas[0])  # the same tensors twice: u' must not overwrite what is still read
    expected_p, expected_b = _clone(params), _clone(momentum)
    outer_step_(expected_p, expected_b, [_clone(d) for d in deltas], [1.0, 3.0], 0.7, 0.9)
    outer_step_(params, momentum, deltas, [1.0, 3.0], 0.7, 0.9, consume_deltas=True)
    for a, b in zip(expected_p + expected_b, params + momentum, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("block_numel", [None, 100])
@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("merge", ["rda", "mean"])
def test_a_step_into_new_buffers_gives_the_same_bits_and_leaves_the_state_as_it_was(
    block_numel: int | None, count: int, merge: str
) -> None:
    """out=(θ', b'): the syncer steps into pool buffers and commits them only if finite, with no
    copy of Θ_p or backup of b_p. Every path (copy, mean, RDA, the RDA fallback on tensor 3, an
    embedding on tensor 1) equals the in-place step bit for bit, and θ, b are not written."""
    params, momentum, deltas = _round(count, 51 + count)
    deltas[0][3].zero_()
    weights = [float(m + 1) for m in range(count)]
    is_embedding = [False, True, False, False]
    expected_p, expected_b = _clone(params), _clone(momentum)
    outer_step_(
        expected_p,
        expected_b,
        [_clone(d) for d in deltas],
        weights,
        0.7,
        0.9,
        merge=merge,
        is_embedding=is_embedding,
        block_numel=block_numel,
        consume_deltas=True,
    )
    before_p, before_b = _clone(params), _clone(momentum)
    new_p, new_b = [torch.full(s, math.nan) for s in SHAPES], [torch.full(s, math.nan) for s in SHAPES]
    norms = outer_step_(
        params,
        momentum,
        [_clone(d) for d in deltas],
        weights,
        0.7,
        0.9,
        merge=merge,
        is_embedding=is_embedding,
        block_numel=block_numel,
        consume_deltas=True,
        out=(new_p, new_b),
        want_norms=True,
    )
    for a, b in zip(expected_p + expected_b, new_p + new_b, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(before_p + before_b, params + momentum, strict=True):
        assert torch.equal(a, b)
    assert norms is not None
    exact_p = sum(float(t.double().square().sum()) for t in expected_p)
    exact_b = sum(float(t.double().square().sum()) for t in expected_b)
    assert norms == (pytest.approx(exact_p, rel=1e-6), pytest.approx(exact_b, rel=1e-6))


def test_the_norms_of_an_in_place_step_are_those_of_its_result() -> None:
    params, momentum, deltas = _round(2, 61)
    assert outer_step_(_clone(params), _clone(momentum), deltas, [1.0, 2.0], 0.7, 0.9) is None
    norms = outer_step_(params, momentum, deltas, [1.0, 2.0], 0.7, 0.9, want_norms=True)
    exact = [sum(float(t.double().square().sum()) for t in ts) for ts in (params, momentum)]
    assert norms == (pytest.approx(exact[0], rel=1e-6), pytest.approx(exact[1], rel=1e-6))


def test_out_buffers_of_the_wrong_shape_are_refused() -> None:
    params, momentum, deltas = _round(2, 71)
    wrong = [torch.zeros(s) for s in SHAPES[:-1]] + [torch.zeros(3)]
    with pytest.raises(ValueError, match="out parameter"):
        outer_step_(params, momentum, deltas, [1.0, 1.0], 0.7, 0.9, out=(wrong, _clone(momentum)))
