"""Merge weights, the pseudo-gradient, apply modes and the outer-gradient guard."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.outer import APPLY_MODES, apply_update_, check_outer_gradient, merge_weights, pseudo_gradient
from dilocod.outer.guard import (
    ACCEPTED,
    DEFAULT_MAX_FRAGMENT_RATIO,
    FRAGMENT_NORM_TOO_LARGE,
    FRAGMENT_RMS_FLOOR,
    NON_FINITE,
    NORM_TOO_LARGE,
    NormSample,
    fragment_limit,
    l2_norm,
)

# --- merge_weights ------------------------------------------------------------------------------


def reference_weights(tokens: list[int], steps: list[int]) -> list[float]:
    raw = [0.0 if s == 0 else t * t / s for t, s in zip(tokens, steps, strict=True)]
    return [w / sum(raw) for w in raw]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 10**5)), min_size=1, max_size=16).filter(
        lambda pairs: any(t > 0 and s > 0 for t, s in pairs)
    )
)
def test_weights_match_reference(pairs: list[tuple[int, int]]) -> None:
    tokens, steps = [t for t, _ in pairs], [s for _, s in pairs]
    weights = merge_weights(tokens, steps)
    assert weights == pytest.approx(reference_weights(tokens, steps), rel=1e-12, abs=1e-300)
    assert math.fsum(weights) == pytest.approx(1.0, rel=1e-12)
    assert all(w == 0.0 for w, s in zip(weights, steps, strict=True) if s == 0)


def test_weights_favour_tokens_and_tokens_per_step() -> None:
    # Same steps, twice the tokens: four times the weight (tokens times tokens per step).
    assert merge_weights([200, 100], [10, 10]) == pytest.approx([0.8, 0.2])
    # Same tokens in half the steps (twice the batch): twice the weight.
    assert merge_weights([100, 100], [5, 10]) == pytest.approx([2 / 3, 1 / 3])
    assert merge_weights([100, 50], [0, 5]) == [0.0, 1.0]


@pytest.mark.parametrize(("tokens", "steps"), [([0, 0], [1, 1]), ([5], [0]), ([1], [1, 2]), ([-1], [1])])
def test_weights_reject_weightless_or_bad_counts(tokens: list[int], steps: list[int]) -> None:
    with pytest.raises(ValueError):
        merge_weights(tokens, steps)


# --- pseudo_gradient ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_pseudo_gradient_is_float32_anchor_minus_local(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    anchor = [torch.randn(33, 7, generator=gen).to(dtype), torch.randn(5, generator=gen).to(dtype)]
    local = [a + (1e-3 * torch.randn(a.shape, generator=gen)).to(dtype) for a in anchor]
    delta = pseudo_gradient(anchor, local)
    for d, a, theta in zip(delta, anchor, local, strict=True):
        assert d.dtype == torch.float32 and d.shape == a.shape
        exact = a.double() - theta.double()
        # One rounding to float32 of the exact difference.
        assert torch.equal(d, exact.float())
    out = [torch.empty(33, 7), torch.empty(5)]
    assert pseudo_gradient(anchor, local, out=out)[0] is out[0]
    assert torch.equal(out[1], delta[1])


def test_pseudo_gradient_rejects_mismatches() -> None:
    with pytest.raises(ValueError):
        pseudo_gradient([torch.zeros(3)], [torch.zeros(4)])
    with pytest.raises(ValueError):
        pseudo_gradient([torch.zeros(3)], [torch.zeros(3)], out=[torch.zeros(3, dtype=torch.float64)])


# --- apply_update_ ------------------------------------------------------------------------------


def test_apply_modes() -> None:
    gen = torch.Generator().manual_seed(2)
    theta_now = [torch.randn(10, generator=gen), torch.randn(2, 3, generator=gen)]
    theta_sent = [t - 0.01 * torch.randn(t.shape, generator=gen) for t in theta_now]
    new = [torch.randn(t.shape, generator=gen) for t in theta_now]

    local = [t.clone() for t in theta_now]
    apply_update_(local, new, "overwrite")
    assert all(torch.equal(a, b) for a, b in zip(local, new, strict=True))

    local = [t.clone() for t in theta_now]
    apply_update_(local, new, "mix", alpha=0.25)
    for got, t, n in zip(local, theta_now, new, strict=True):
        torch.testing.assert_close(got.double(), 0.25 * t.double() + 0.75 * n.double(), rtol=0, atol=1e-6)

    local = [t.clone() for t in theta_now]
    apply_update_(local, new, "keep-local", sent=theta_sent)
    for got, t, s, n in zip(local, theta_now, theta_sent, new, strict=True):
        torch.testing.assert_close(got.double(), n.double() + (t.double() - s.double()), rtol=0, atol=1e-6)
    assert APPLY_MODES == ("overwrite", "mix", "keep-local")


def test_apply_bf16_model_computes_in_float32() -> None:
    theta = [torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)]
    new = [torch.tensor([1.5, 2.5, 3.5])]
    apply_update_(theta, new, "mix", alpha=0.5)
    assert torch.equal(theta[0], torch.tensor([1.25, 2.25, 3.25], dtype=torch.bfloat16))
    sent = [torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)]
    theta = [torch.tensor([1.125, 2.0, 2.875], dtype=torch.bfloat16)]
    apply_update_(theta, new, "keep-local", sent=sent)
    assert torch.equal(theta[0], torch.tensor([1.625, 2.5, 3.375], dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("mode", "kwargs"), [("average", {}), ("mix", {"alpha": 1.5}), ("keep-local", {"sent": None})]
)
def test_apply_rejects_bad_arguments(mode: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        apply_update_([torch.zeros(2)], [torch.ones(2)], mode, **kwargs)  # type: ignore[arg-type]


# --- check_outer_gradient -----------------------------------------------------------------------


def norms(*values: float) -> list[NormSample]:
    """A history of one-step pushes with these norms (so norms and norms per step agree)."""
    return [NormSample(v, 1) for v in values]


def test_guard_accepts_plausible_and_rejects_large_or_non_finite() -> None:
    delta = [torch.full((4,), 0.5), torch.full((3, 4), 0.5)]  # norm sqrt(16 * 0.25) = 2
    history = norms(1.0, 1.5, 0.9, 3.0)  # median 1.25
    verdict = check_outer_gradient(delta, history, steps=1, fragment_norm=None)
    assert (verdict.accepted, verdict.reason) == (True, ACCEPTED)
    assert verdict.norm == pytest.approx(2.0)
    assert verdict.limit == pytest.approx(12.5)

    big = [t * 10 for t in delta]  # norm 20 > 10 x 1.25
    verdict = check_outer_gradient(big, history, steps=1, fragment_norm=None)
    assert (verdict.accepted, verdict.reason) == (False, NORM_TOO_LARGE)
    assert check_outer_gradient(big, history, steps=1, fragment_norm=None, max_norm_ratio=20.0).accepted

    for bad in (math.nan, math.inf, -math.inf):
        poisoned = [delta[0].clone(), delta[1].clone()]
        poisoned[1][2, 3] = bad
        verdict = check_outer_gradient(poisoned, history, steps=1, fragment_norm=None)
        assert (verdict.accepted, verdict.reason) == (False, NON_FINITE)


def test_guard_without_enough_history_or_fragment_norm_only_checks_finiteness() -> None:
    huge = [torch.full((10,), 1e30)]  # squares overflow float32; the norm is still finite
    verdict = check_outer_gradient(huge, norms(1.0, 1.0), steps=1, fragment_norm=None)
    assert verdict.accepted and verdict.limit is None
    assert verdict.norm == pytest.approx(math.sqrt(10) * 1e30)
    assert not check_outer_gradient(huge, norms(1.0, 1.0, 1.0), steps=1, fragment_norm=None).accepted
    assert check_outer_gradient(
        huge, norms(0.0, 0.0, 0.0), steps=1, fragment_norm=None
    ).accepted  # zero norms are not samples: no scale yet


def test_guard_bounds_the_very_first_push_by_its_fragment() -> None:
    """The attack measured on a fresh syncer: one push of finite values near float32's largest,
    before any norm is in the history. Its norm is finite (in float64) and far above the fragment's."""
    huge = [torch.full((128, 128), 3e38)]
    fragment_norm = 128 * 0.02  # 16,384 values of RMS 0.02
    verdict = check_outer_gradient(huge, [], steps=1, fragment_norm=fragment_norm)
    assert (verdict.accepted, verdict.reason) == (False, FRAGMENT_NORM_TOO_LARGE)
    assert verdict.norm == pytest.approx(128 * 3e38)
    # The floor (RMS 1 per value) is the scale here: the fragment's own norm is below it.
    assert verdict.limit == pytest.approx(DEFAULT_MAX_FRAGMENT_RATIO * FRAGMENT_RMS_FLOOR * 128)


def test_guard_fragment_limit_is_the_fragment_norm_or_the_floor() -> None:
    delta = [torch.full((4,), 1.0), torch.full((3, 4), 1.0)]  # 16 values, norm 4
    # A large fragment: its own norm is the scale.
    assert check_outer_gradient(delta, [], steps=1, fragment_norm=0.4, max_fragment_ratio=10.0).accepted
    verdict = check_outer_gradient(delta, [], steps=1, fragment_norm=100.0, max_fragment_ratio=0.03)
    assert (verdict.reason, verdict.limit) == (FRAGMENT_NORM_TOO_LARGE, pytest.approx(3.0))
    # A fragment of zeros (or with a norm that gives no scale) still accepts updates up to the floor.
    for no_scale in (0.0, math.inf, math.nan):
        assert fragment_limit(no_scale, 16, 10.0) == pytest.approx(10.0 * FRAGMENT_RMS_FLOOR * 4)
        assert check_outer_gradient(
            delta, [], steps=1, fragment_norm=no_scale, max_fragment_ratio=1.0
        ).accepted
        verdict = check_outer_gradient(delta, [], steps=1, fragment_norm=no_scale, max_fragment_ratio=0.5)
        assert (verdict.accepted, verdict.reason) == (False, FRAGMENT_NORM_TOO_LARGE)


def test_guard_applies_both_bounds_and_reports_the_tighter() -> None:
    delta = [torch.full((16,), 0.5)]  # norm 2
    history = norms(1.0, 1.0, 1.0)  # median limit 10
    verdict = check_outer_gradient(
        delta, history, steps=1, fragment_norm=1.0
    )  # fragment limit 10 x max(1, 4)
    assert verdict.accepted and verdict.limit == pytest.approx(10.0)
    verdict = check_outer_gradient(delta, norms(0.1, 0.1, 0.1), steps=1, fragment_norm=1.0)
    assert (verdict.reason, verdict.limit) == (NORM_TOO_LARGE, pytest.approx(1.0))
    assert check_outer_gradient(delta, history, steps=1, fragment_norm=None).limit == pytest.approx(10.0)
    assert check_outer_gradient(delta, [], steps=1, fragment_norm=None).limit is None


@pytest.mark.parametrize("ratio", [0.0, -1.0, math.inf, math.nan])
def test_guard_refuses_a_meaningless_fragment_ratio(ratio: float) -> None:
    with pytest.raises(ValueError, match="max_fragment_ratio"):
        check_outer_gradient([torch.ones(2)], [], steps=1, fragment_norm=1.0, max_fragment_ratio=ratio)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=40),
    st.integers(1, 3),
)
def test_l2_norm_is_finite_exactly_when_every_value_is(values: list[float], pieces: int) -> None:
    """What the syncer's commit relies on: one pass says whether a merged fragment is finite."""
    flat = torch.tensor(values, dtype=torch.float32)
    tensors = list(flat.tensor_split(pieces))
    assert math.isfinite(l2_norm(tensors)) == bool(torch.isfinite(flat).all())
    reference = math.sqrt(math.fsum(v * v for v in values)) if all(map(math.isfinite, values)) else None
    if reference is not None:
        assert l2_norm(tensors) == pytest.approx(reference, rel=1e-6)
