"""One round's whole outer update, fused: merge the contributions and take the Nesterov step.

outer_step_(...) equals nesterov_step_(params, rda_merge(...), momentum, lr, mu) (or mean_merge)
bit for bit, while moving less memory: the merged Δ of a block goes straight from the cache into
the Nesterov step instead of being written out and read back. Per RDA tensor it reads every
contribution twice (norms, then u') and writes u' once into a scratch buffer, then streams u',
θ and b once: (2M + 6) x the tensor's bytes, against (2M + 8) for the two calls one after the
other. Mean-merged tensors (embeddings, `--merge mean`) and single contributions take one pass:
(M + 4) x. bench/outer_merge.py measures both against the memory bandwidth.

This is what the syncer calls once per round. Must not import networking, clocks or logging.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dilocod.outer._blocks import BLOCK_NUMEL, Scratch, block_capacity, blocks, check_block_numel
from dilocod.outer.merge import (
    Contributions,
    EmbeddingRule,
    TensorMerge,
    check_contributions,
    check_outputs,
    combine_,
    finish_scale,
    is_embedding_at,
    mean_combination,
    plan_tensor,
)
from dilocod.outer.nesterov import check_state, check_step, nesterov_block_

MERGES = ("rda", "mean")


def _single_pass_(
    p: Tensor,
    b: Tensor,
    deltas: Contributions,
    merge: TensorMerge,
    scale: float,
    lr: float,
    mu: float,
    delta_block: Scratch,
    grad_block: Scratch,
    block_numel: int,
) -> None:
    """Δ = scale · Σ ratios · δ formed block by block in cache and stepped at once."""
    if merge.kind == "copy":
        for pb, db, bb in blocks([p, deltas[merge.terms[0]], b], block_numel):
            nesterov_block_(pb, db, bb, grad_block.like(pb), lr, mu)
        return
    sources = [deltas[m] for m in merge.terms]
    for pb, bb, *src in blocks([p, b, *sources], block_numel):
        o = delta_block.like(pb)
        torch.add(src[0], src[1], alpha=merge.ratios[1], out=o)
        for d, ratio in zip(src[2:], merge.ratios[2:], strict=True):
            o.add_(d, alpha=ratio)
        o.mul_(scale)
        nesterov_block_(pb, o, bb, grad_block.like(pb), lr, mu)


def outer_step_(
    params: Sequence[Tensor],
    momentum: Sequence[Tensor],
    deltas_per_learner: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    lr: float,
    mu: float,
    *,
    merge: str = "rda",
    is_embedding: EmbeddingRule = None,
    scratch: Sequence[Tensor] | None = None,
    block_numel: int = BLOCK_NUMEL,
) -> None:
    """Merge (rda_merge or mean_merge) and apply nesterov_step_ in place, in fewer memory passes.

    params and momentum are the fragment's float32 global parameters and Nesterov buffers.
    scratch, contiguous float32 tensors shaped like the deltas, holds u' for RDA tensors; pass
    buffers kept across rounds (a fresh 100 MB allocation costs several copies' worth of page
    faults), or None to allocate them per call.
    """
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    check_block_numel(block_numel)
    check_step(lr, mu)
    active, count = check_contributions(deltas_per_learner, weights)
    reference = deltas_per_learner[active[0]]
    check_state(params, momentum, reference)
    if scratch is not None:
        check_outputs(scratch, reference, "scratch")
    capacity = block_capacity(params, block_numel)
    delta_block, grad_block = Scratch(capacity), Scratch(capacity)
    with torch.no_grad():
        for t in range(count):
            p, b = params[t], momentum[t]
            deltas = {m: deltas_per_learner[m][t] for m in active}
            use_rda = merge == "rda" and not is_embedding_at(is_embedding, t)
            plan = plan_tensor(deltas, active, weights, use_rda, block_numel)
            if plan.kind != "rda":
                scale = 1.0 if plan.scale is None else plan.scale
                _single_pass_(p, b, deltas, plan, scale, lr, mu, delta_block, grad_block, block_numel)
                continue
            if scratch is not None:
                u = scratch[t]
            else:
                u = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            rda_scale = finish_scale(plan, combine_(u, deltas, plan, block_numel, want_norm=True))
            if rda_scale is None:
                mean = mean_combination(active, weights)
                mean_scale = 1.0 if mean.scale is None else mean.scale
                _single_pass_(p, b, deltas, mean, mean_scale, lr, mu, delta_block, grad_block, block_numel)
                continue
            for pb, ub, bb in blocks([p, u, b], block_numel):
                o = delta_block.like(pb)
                torch.mul(ub, rda_scale, out=o)
                nesterov_block_(pb, o, bb, grad_block.like(pb), lr, mu)
