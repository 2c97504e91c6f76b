"""Block-scaled quantization: the documented error bound, sizes, and error feedback."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.outer import (
    QuantizedTensor,
    dequantize,
    quantization_report,
    quantize,
    quantize_with_feedback_,
)


def per_value_bound(q: QuantizedTensor) -> torch.Tensor:
    return q.error_bounds().repeat_interleave(q.block_size)[: q.numel].view(q.shape)


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("block_size", [1, 7, 64, 256])
def test_error_within_documented_bound(bits: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + block_size)
    # Gradient-like values, with a few outliers and some all-zero stretches.
    x = torch.randn(3, 1001, generator=gen) * 1e-3
    x[0, 5] = 0.5
    x[2, 100:400] = 0.0
    q = quantize(x, bits, block_size)
    back = dequantize(q)
    assert back.shape == x.shape and back.dtype == torch.float32
    err = (back.double() - x.double()).abs()
    bound = per_value_bound(q).double()
    assert bool((err <= bound).all()), float((err - bound).max())
    # Round to nearest really uses the whole half step (a bound twice too loose would pass
    # otherwise): some value in a non-trivial block errs by more than a third of a step.
    if block_size > 1:
        assert float((err / bound.clamp_min(1e-30)).max()) > 0.3
    assert torch.equal(back[2, 100:400], torch.zeros(300))  # a zero is always sent exactly


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False, width=32).map(
            lambda v: v if abs(v) > 1e-30 else 0.0
        ),
        min_size=1,
        max_size=300,
    ),
    st.sampled_from([16, 8, 4]),
    st.integers(1, 80),
)
def test_bound_holds_for_arbitrary_values(values: list[float], bits: int, block_size: int) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    q = quantize(x, bits, block_size)
    err = (dequantize(q).double() - x.double()).abs()
    assert bool((err <= per_value_bound(q).double()).all())


@pytest.mark.parametrize(
    ("bits", "block_size", "expected"), [(16, 64, 2.0625), (8, 32, 1.125), (4, 64, 0.5625)]
)
def test_bytes_per_parameter(bits: int, block_size: int, expected: float) -> None:
    x = torch.randn(64 * 1024)
    q = quantize(x, bits, block_size)
    assert q.bytes_per_parameter == pytest.approx(expected)
    report = quantization_report(x, q)
    assert report.bytes_per_parameter == q.bytes_per_parameter
    assert 0 < report.rms_error <= report.max_abs_error
    # Gaussian data: more bits, far smaller error (4 bits is about 10 % relative error).
    limit = {16: 1e-4, 8: 2e-2, 4: 0.2}[bits]
    assert report.relative_error < limit


def test_odd_length_four_bit_round_trip_and_out() -> None:
    x = torch.tensor([0.7, -0.7, 0.1, 0.0, -0.35])
    q = quantize(x, 4, block_size=5)
    assert q.data.dtype == torch.uint8 and q.data.numel() == 3
    out = torch.empty(5)
    assert dequantize(q, out=out) is out
    # Scale 0.1: codes 7, -7, 1, 0, -4 (round half to even of -3.5).
    torch.testing.assert_close(out, torch.tensor([0.7, -0.7, 0.1, 0.0, -0.4]))


@pytest.mark.parametrize(("bits", "block_size"), [(2, 64), (3, 64), (8, 0)])
def test_rejects_bad_settings(bits: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        quantize(torch.zeros(4), bits, block_size)


def test_rejects_non_finite() -> None:
    with pytest.raises(ValueError):
        quantize(torch.tensor([1.0, float("nan")]), 8)


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_cancels_accumulated_error(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    signal = [torch.randn(4096, generator=gen) * 1e-3, torch.randn(10, 10, generator=gen)]
    residual = [torch.zeros_like(s) for s in signal]
    sent_sum = [torch.zeros_like(s, dtype=torch.float64) for s in signal]
    plain_sum = [torch.zeros_like(s, dtype=torch.float64) for s in signal]
    rounds = 200
    for _ in range(rounds):
        for i, q in enumerate(quantize_with_feedback_(signal, residual, bits, block_size=64)):
            sent_sum[i] += dequantize(q).double()
            plain_sum[i] += dequantize(quantize(signal[i], bits, block_size=64)).double()
    for s, sent, plain, r in zip(signal, sent_sum, plain_sum, residual, strict=True):
        truth = rounds * s.double()
        with_feedback = float((sent - truth).norm() / truth.norm())
        without = float((plain - truth).norm() / truth.norm())
        # Without feedback the same rounding error repeats every round: the relative error of the sum
        # stays at the one-shot error. With it, the sum is off by only the last residual.
        assert with_feedback < without / 50
        assert with_feedback < 2.0 / rounds
        # Up to float32 rounding of the residual arithmetic over the rounds.
        torch.testing.assert_close(sent, truth - r.double(), rtol=0, atol=1e-6 * float(truth.abs().max()))
