"""The outer Nesterov step (docs/design.md §3.4 step 4), in place and block by block.

    b ← μ·b + Δ;   θ ← θ - η·(Δ + μ·b)

with the very op sequence torch.optim.SGD(lr=η, momentum=μ, nesterov=True) runs for grad = Δ
(buf.mul_(μ).add_(Δ); g = Δ.add(buf, alpha=μ); θ.add_(g, alpha=-η)), so the result is the same
bit for bit in float32. The only difference: SGD clones the first gradient into a fresh buffer
where this step starts from a zero buffer, which changes nothing but the sign of a -0.0 delta in
the buffer. Cut into cache-sized blocks so the chain of four ops reads and writes DRAM once.

Must not import networking, clocks or logging.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from dilocod.outer._blocks import Scratch, block_capacity, blocks, resolve_block_numel


def check_step(lr: float, mu: float) -> None:
    if not math.isfinite(lr):
        raise ValueError(f"outer learning rate must be finite, got {lr}")
    if not (math.isfinite(mu) and mu >= 0.0):
        raise ValueError(f"outer momentum must be finite and non-negative, got {mu}")


def check_state(params: Sequence[Tensor], momentum: Sequence[Tensor], like: Sequence[Tensor]) -> None:
    if not len(params) == len(momentum) == len(like):
        raise ValueError(f"{len(params)} parameters, {len(momentum)} momentum buffers and {len(like)} deltas")
    for t, (p, b, d) in enumerate(zip(params, momentum, like, strict=True)):
        if not (p.shape == b.shape == d.shape):
            raise ValueError(
                f"tensor {t}: parameter {tuple(p.shape)}, momentum {tuple(b.shape)} and delta "
                f"{tuple(d.shape)} differ in shape"
            )
        if not (p.dtype == b.dtype == d.dtype):
            raise TypeError(f"tensor {t}: parameter {p.dtype}, momentum {b.dtype}, delta {d.dtype}")


def nesterov_block_(
    p: Tensor,
    d: Tensor,
    b: Tensor,
    g: Tensor,
    lr: float,
    mu: float,
    p_out: Tensor | None = None,
    b_out: Tensor | None = None,
) -> None:
    """One block of the step; g is scratch of the block's shape (SGD's temporary gradient). The
    new θ and b go to p_out and b_out when given (p and b are then only read), else in place: the
    same ops either way, so the same bits."""
    p_out = p if p_out is None else p_out
    b_out = b if b_out is None else b_out
    torch.mul(b, mu, out=b_out).add_(d)
    torch.add(d, b_out, alpha=mu, out=g)
    torch.add(p, g, alpha=-lr, out=p_out)


def nesterov_step_(
    params: Sequence[Tensor],
    delta: Sequence[Tensor],
    momentum: Sequence[Tensor],
    lr: float,
    mu: float,
    *,
    block_numel: int | None = None,
) -> None:
    """θ ← θ - lr·(Δ + μ·b) after b ← μ·b + Δ, in place; momentum starts as zeros."""
    check_step(lr, mu)
    block_numel = resolve_block_numel(block_numel)
    check_state(params, momentum, delta)
    if not params:
        return
    with torch.no_grad():
        scratch = Scratch(block_capacity(params, block_numel))
        for p, d, b in zip(params, delta, momentum, strict=True):
            for pb, db, bb in blocks([p, d, b], block_numel):
                nesterov_block_(pb, db, bb, scratch.like(pb), lr, mu)
