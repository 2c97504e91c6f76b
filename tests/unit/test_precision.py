"""Wire precisions of outer gradients: layouts whose dtypes fit only the precision they state,
exact fp32, bounded lossy encodings, and error feedback that keeps the sum of what was sent next
to the sum of the truth."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dilocod.model.precision import decode, encode
from dilocod.outer import nesterov_step_, rda_merge
from dilocod.wire.choices import PRECISIONS
from dilocod.wire.layouts import layout_fault, push_layout

SHAPES = [("embed.weight", (50, 8)), ("out.bias", (7,)), ("block.w", (3, 5, 9))]


def deltas(seed: int, scale: float = 1e-3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * scale for _, shape in SHAPES]


def test_every_precision_has_its_own_layout_whose_dtypes_fit_only_it() -> None:
    layouts = {p: push_layout(SHAPES, p) for p in PRECISIONS}
    for precision, (manifest, _) in layouts.items():
        assert layout_fault(manifest, precision) is None
        for other in set(PRECISIONS) - {precision}:
            assert layout_fault(manifest, other) is not None, (precision, other)
    codes, scales = layouts["int8"][0][:2]
    assert "codes and scales" in str(layout_fault((codes,), "int8"))
    assert "followed by its float32 #scales" in str(layout_fault((codes, codes), "int8"))
    short = dataclasses.replace(scales, shape=(scales.shape[0] + 1,))
    assert "followed by its float32 #scales" in str(layout_fault((codes, short), "int8"))
    assert "not one of" in str(layout_fault(layouts["fp32"][0], "fp16"))
    sizes = {p: raw for p, (_, raw) in layouts.items()}
    assert sizes["fp32"] > sizes["bf16"] > sizes["int8"] > sizes["int4"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_round_trip(precision: str) -> None:
    names = [n for n, _ in SHAPES]
    values = deltas(1)
    manifest, data = encode(values, names, precision)
    assert manifest == push_layout(SHAPES, precision)[0]
    out = [torch.empty(shape) for _, shape in SHAPES]
    decode(data, SHAPES, precision, out)
    for got, want in zip(out, values, strict=True):
        if precision == "fp32":
            assert torch.equal(got, want)
        else:
            # bf16 rounds to 8 significant bits (unit roundoff 2^-8); int8 and int4 to half a step
            # of max|x| / qmax per block.
            step = {"bf16": 2**-7, "int8": 1 / 127, "int4": 1 / 7}[precision]
            assert float((got - want).abs().max()) <= want.abs().max() * step * 0.51 + 1e-12


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_error_feedback_keeps_the_sum_close(precision: str) -> None:
    """Over 40 rounds of a constant outer gradient, what arrived sums to within one round's error
    of the truth with feedback, and drifts far further without it."""
    names = [n for n, _ in SHAPES]
    truth = deltas(2)
    residual = [torch.zeros_like(t) for t in truth]
    with_feedback = [torch.zeros_like(t) for t in truth]
    without = [torch.zeros_like(t) for t in truth]
    out = [torch.empty_like(t) for t in truth]
    for _ in range(40):
        decode(encode(truth, names, precision, residual)[1], SHAPES, precision, out)
        for acc, o in zip(with_feedback, out, strict=True):
            acc.add_(o)
        decode(encode(truth, names, precision)[1], SHAPES, precision, out)
        for acc, o in zip(without, out, strict=True):
            acc.add_(o)
    err_feedback = max(float((a - 40 * t).abs().max()) for a, t in zip(with_feedback, truth, strict=True))
    err_plain = max(float((a - 40 * t).abs().max()) for a, t in zip(without, truth, strict=True))
    one_round = (
        max(float(t.abs().max()) for t in truth) * {"bf16": 2**-7, "int8": 1 / 127, "int4": 1 / 7}[precision]
    )
    assert err_feedback <= one_round
    assert err_plain > 5 * err_feedback


def test_a_push_of_the_wrong_size_is_refused() -> None:
    out = [torch.empty(shape) for _, shape in SHAPES]
    with pytest.raises(ValueError, match="holds"):
        decode(bytearray(10), SHAPES, "int4", out)


def _lockstep_dilocod(precision: str, rounds: int = 25, inner_steps: int = 10) -> float:
    """Lock-step DiLoCo (M = 2, RDA, outer Nesterov 0.7/0.9) on a tiny regression, every outer
    gradient sent at `precision` with error feedback; the global model's eval loss."""

    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))

    def batch(generator: torch.Generator, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(size, 16, generator=generator)
        return x, torch.tanh(x @ teacher)

    torch.manual_seed(1234)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))  # noqa: E731
    global_model = make()
    names = [n for n, _ in global_model.named_parameters()]
    learners = [make() for _ in range(2)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in learners]
    generators = [torch.Generator().manual_seed(10 + i) for i in range(2)]
    residuals = [[torch.zeros_like(p) for p in global_model.parameters()] for _ in range(2)]
    momentum = [torch.zeros_like(p) for p in global_model.parameters()]
    shapes = [(n, tuple(p.shape)) for n, p in global_model.named_parameters()]
    for _ in range(rounds):
        received = []
        for learner, optimizer, generator, residual in zip(
            learners, optimizers, generators, residuals, strict=True
        ):
            learner.load_state_dict(global_model.state_dict())
            for _ in range(inner_steps):
                x, y = batch(generator)
                loss = torch.nn.functional.mse_loss(learner(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                delta = [g - p for g, p in zip(global_model.parameters(), learner.parameters(), strict=True)]
            _, data = encode(delta, names, precision, residual if precision != "fp32" else None)
            out = [torch.empty(shape) for _, shape in shapes]
            decode(data, shapes, precision, out)
            received.append(out)
        merged = rda_merge(received, [0.5, 0.5])
        with torch.no_grad():
            nesterov_step_(list(global_model.parameters()), merged, momentum, lr=0.7, mu=0.9)
    x, y = batch(torch.Generator().manual_seed(999), size=4096)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(global_model(x), y))


def test_int8_and_int4_train_within_a_few_percent_of_fp32() -> None:
    """The same lock-step training run three times, only the wire precision differs."""
    fp32 = _lockstep_dilocod("fp32")
    initial_scale = 0.83  # the untrained model's eval loss on this task, for scale
    assert fp32 < 0.1 * initial_scale
    for precision, tolerance in (("int8", 0.02), ("int4", 0.05)):
        loss = _lockstep_dilocod(precision)
        assert abs(loss - fp32) <= tolerance * fp32 + 1e-4, (precision, loss, fp32)
