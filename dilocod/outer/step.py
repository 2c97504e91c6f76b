"""One round's whole outer update, fused: merge the contributions and take the Nesterov step.

outer_step_(...) equals nesterov_step_(params, rda_merge(...), momentum, lr, mu) (or mean_merge)
while moving less memory: the merged Δ of a block goes straight from the cache into the Nesterov
step instead of being written out and read back. Mean-merged tensors (embeddings, `--merge mean`)
and single contributions take one pass, (M + 4)F for M contributions of F bytes, and equal the two
calls bit for bit. Per RDA tensor, three passes: every contribution read for its norm; every
contribution read again to form u' (the RDA direction up to a factor) and ‖u'‖²; u', θ and b read
and θ, b written by the scaled Nesterov step, in four ops instead of five, which equals the two
calls to a few float32 roundings, not bit for bit (_scaled_step_). Where u' goes decides
the bytes:

- into `scratch` (or a fresh buffer): u' is written to memory that is not in any cache, which
  costs a read for ownership too: (2M + 7)F;
- with consume_deltas=True, into the pivot contribution's own buffer (the one with the largest
  coefficient), which the second pass reads anyway: (2M + 6)F. That destroys the pivot's values
  (the caller must own the contributions and not need them after the merge).

The minimum for RDA + Nesterov is (2M + 4)F (bench/outer_merge.py measures against it): u' need
not exist if ‖u‖ came from the Gram matrix of the contributions in the first pass, which measured
slower here (M(M+1)/2 dot products per block). On these machines a core reads memory at about
15 GB/s whatever the access pattern while its writes mostly overlap, and every torch op over a
cached block still costs an L2 round trip, so time follows reads and op count more than bytes
(bench/RESULTS.md §3). Threads are torch's own: each op of a block is split across
torch.get_num_threads() cores (a pool of Python threads, each with whole blocks, measured slower).

This is what the syncer calls once per round. Must not import networking, clocks or logging.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dilocod.outer._blocks import Scratch, block_capacity, blocks, resolve_block_numel
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
    scratch: Scratch,
    block_numel: int,
) -> None:
    """Δ = scale · Σ ratios · δ formed block by block in cache and stepped at once."""
    if merge.kind == "copy":
        for pb, db, bb in blocks([p, deltas[merge.terms[0]], b], block_numel):
            nesterov_block_(pb, db, bb, scratch.like(pb), lr, mu)
        return
    sources = [deltas[m] for m in merge.terms]
    for pb, bb, *src in blocks([p, b, *sources], block_numel):
        o = scratch.like(pb)
        torch.add(src[0], src[1], alpha=merge.ratios[1], out=o)
        for d, ratio in zip(src[2:], merge.ratios[2:], strict=True):
            o.add_(d, alpha=ratio)
        o.mul_(scale)
        nesterov_block_(pb, o, bb, scratch.like(pb, 1), lr, mu)


def _scaled_step_(
    p: Tensor, u: Tensor, b: Tensor, scale: float, lr: float, mu: float, block_numel: int
) -> None:
    """nesterov_step_ with Δ = scale · u, u left as it is (so it is not written back to memory).

    SGD's step with Δ never formed: b ← μ·b + s·u;  θ ← θ - η·μ·b - η·s·u  (s = scale). Four ops
    per block against the five of scale + nesterov_block_ (two fewer scratch writes; 2-3 % of the
    merge's time), equal to them within a few float32 roundings but not bit for bit (the fused
    add rounds s·u and μ·b + s·u once where the two calls round each; tests/unit/outer).
    """
    for pb, ub, bb in blocks([p, u, b], block_numel):
        bb.mul_(mu).add_(ub, alpha=scale)
        pb.add_(bb, alpha=-lr * mu)
        pb.add_(ub, alpha=-lr * scale)


def _consumable(pivot: Tensor, deltas: Contributions, merge: TensorMerge) -> bool:
    """The pivot may hold u' if no other term reads the same memory."""
    start = pivot.data_ptr()
    stop = start + pivot.numel() * pivot.element_size()
    for m in merge.terms[1:]:
        d = deltas[m]
        d_start = d.data_ptr()
        if d_start < stop and start < d_start + d.numel() * d.element_size():
            return False
    return True


def _rebuild_pivot_(u: Tensor, deltas: Contributions, merge: TensorMerge, block_numel: int) -> None:
    """Undo the combination in the pivot's buffer: δ_p = u' - Σ_{i>0} ratios[i] · δ_i (to rounding)."""
    sources = [deltas[m] for m in merge.terms[1:]]
    for ub, *src in blocks([u, *sources], block_numel):
        for d, ratio in zip(reversed(src), reversed(merge.ratios[1:]), strict=True):
            ub.sub_(d, alpha=ratio)


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
    block_numel: int | None = None,
    consume_deltas: bool = False,
) -> None:
    """Merge (rda_merge or mean_merge) and apply nesterov_step_ in place, in fewer memory passes.

    params and momentum are the fragment's float32 global parameters and Nesterov buffers.
    scratch, contiguous float32 tensors shaped like the deltas, holds u' for RDA tensors; pass
    buffers kept across rounds (a fresh 100 MB allocation costs several copies' worth of page
    faults), or None to allocate them per call. consume_deltas=True lets the merge write u' into
    one contribution of each RDA tensor instead (faster, no scratch needed; the contributions'
    values are undefined afterwards). In the rare fallback from RDA to the weighted mean (‖u‖ ≈ 0)
    the consumed contribution is rebuilt from u' first, so that tensor's result then equals the
    unconsumed one to rounding instead of bit for bit.
    """
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    block_numel = resolve_block_numel(block_numel)
    check_step(lr, mu)
    active, count = check_contributions(deltas_per_learner, weights)
    reference = deltas_per_learner[active[0]]
    check_state(params, momentum, reference)
    if scratch is not None:
        check_outputs(scratch, reference, "scratch")
    block_scratch = Scratch(block_capacity(params, block_numel))
    with torch.no_grad():
        for t in range(count):
            p, b = params[t], momentum[t]
            deltas = {m: deltas_per_learner[m][t] for m in active}
            use_rda = merge == "rda" and not is_embedding_at(is_embedding, t)
            plan = plan_tensor(deltas, active, weights, use_rda, block_numel)
            if plan.kind != "rda":
                scale = 1.0 if plan.scale is None else plan.scale
                _single_pass_(p, b, deltas, plan, scale, lr, mu, block_scratch, block_numel)
                continue
            pivot = deltas[plan.terms[0]]
            consumed = consume_deltas and _consumable(pivot, deltas, plan)
            if consumed:
                u = pivot
            elif scratch is not None:
                u = scratch[t]
            else:
                u = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            norm_sq = combine_(u, deltas, plan, block_numel, want_norm=True)
            rda_scale = finish_scale(plan, norm_sq)
            if rda_scale is None:
                if consumed:
                    _rebuild_pivot_(u, deltas, plan, block_numel)
                mean = mean_combination(active, weights)
                mean_scale = 1.0 if mean.scale is None else mean.scale
                _single_pass_(p, b, deltas, mean, mean_scale, lr, mu, block_scratch, block_numel)
                continue
            _scaled_step_(p, u, b, rda_scale, lr, mu, block_numel)
