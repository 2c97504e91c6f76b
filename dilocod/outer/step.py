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


#: Per-block squared norms of the new θ and b, while the blocks are in cache (None: not asked).
_Sums = tuple[list[Tensor], list[Tensor]] | None


def _accumulate(sums: _Sums, p_block: Tensor, b_block: Tensor) -> None:
    if sums is not None:
        p_flat, b_flat = p_block.reshape(-1), b_block.reshape(-1)
        sums[0].append(torch.dot(p_flat, p_flat))
        sums[1].append(torch.dot(b_flat, b_flat))


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
    p_out: Tensor,
    b_out: Tensor,
    sums: _Sums,
) -> None:
    """Δ = scale · Σ ratios · δ formed block by block in cache and stepped at once."""
    if merge.kind == "copy":
        for pb, db, bb, pob, bob in blocks([p, deltas[merge.terms[0]], b, p_out, b_out], block_numel):
            nesterov_block_(pb, db, bb, scratch.like(pb), lr, mu, pob, bob)
            _accumulate(sums, pob, bob)
        return
    sources = [deltas[m] for m in merge.terms]
    for pb, bb, pob, bob, *src in blocks([p, b, p_out, b_out, *sources], block_numel):
        o = scratch.like(pb)
        torch.add(src[0], src[1], alpha=merge.ratios[1], out=o)
        for d, ratio in zip(src[2:], merge.ratios[2:], strict=True):
            o.add_(d, alpha=ratio)
        o.mul_(scale)
        nesterov_block_(pb, o, bb, scratch.like(pb, 1), lr, mu, pob, bob)
        _accumulate(sums, pob, bob)


def _scaled_step_(
    p: Tensor,
    u: Tensor,
    b: Tensor,
    scale: float,
    lr: float,
    mu: float,
    block_numel: int,
    p_out: Tensor,
    b_out: Tensor,
    sums: _Sums,
) -> None:
    """nesterov_step_ with Δ = scale · u, u left as it is (so it is not written back to memory).

    SGD's step with Δ never formed: b ← μ·b + s·u;  θ ← θ - η·μ·b - η·s·u  (s = scale). Four ops
    per block against the five of scale + nesterov_block_ (two fewer scratch writes; 2-3 % of the
    merge's time), equal to them within a few float32 roundings but not bit for bit (the fused
    add rounds s·u and μ·b + s·u once where the two calls round each; tests/unit/outer).
    """
    for pb, ub, bb, pob, bob in blocks([p, u, b, p_out, b_out], block_numel):
        torch.mul(bb, mu, out=bob).add_(ub, alpha=scale)
        torch.add(pb, bob, alpha=-lr * mu, out=pob)
        pob.add_(ub, alpha=-lr * scale)
        _accumulate(sums, pob, bob)


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
    out: tuple[Sequence[Tensor], Sequence[Tensor]] | None = None,
    want_norms: bool = False,
) -> tuple[float, float] | None:
    """Merge (rda_merge or mean_merge) and apply nesterov_step_, in fewer memory passes.

    params and momentum are the fragment's float32 global parameters and Nesterov buffers.
    scratch, contiguous float32 tensors shaped like the deltas, holds u' for RDA tensors; pass
    buffers kept across rounds (a fresh 100 MB allocation costs several copies' worth of page
    faults), or None to allocate them per call. consume_deltas=True lets the merge write u' into
    one contribution of each RDA tensor instead (faster, no scratch needed; the contributions'
    values are undefined afterwards). In the rare fallback from RDA to the weighted mean (‖u‖ ≈ 0)
    the consumed contribution is rebuilt from u' first, so that tensor's result then equals the
    unconsumed one to rounding instead of bit for bit.

    out=(new_params, new_momentum), contiguous float32 tensors shaped like params: the results go
    there and params and momentum are only read (a caller that commits a step only once it is known
    good keeps the old state with no copy of it); the same ops, so the same bits as in place.
    want_norms=True returns (‖θ'‖², ‖b'‖²) of the result, from float32 dot products of each block
    while it is in cache, summed in float64: no pass over memory of their own. A block whose squares
    overflow float32 (values above about 1e19) makes its sum infinite though every value is finite;
    a caller that must tell those apart checks again (outer.guard.l2_norm).
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
    if out is None:
        params_out, momentum_out = params, momentum
    else:
        params_out, momentum_out = out
        check_outputs(params_out, reference, "out parameter")
        check_outputs(momentum_out, reference, "out momentum")
    sums: _Sums = ([], []) if want_norms else None
    block_scratch = Scratch(block_capacity(params, block_numel))
    with torch.no_grad():
        for t in range(count):
            p, b = params[t], momentum[t]
            p_out, b_out = params_out[t], momentum_out[t]
            deltas = {m: deltas_per_learner[m][t] for m in active}
            use_rda = merge == "rda" and not is_embedding_at(is_embedding, t)
            plan = plan_tensor(deltas, active, weights, use_rda, block_numel)
            if plan.kind != "rda":
                scale = 1.0 if plan.scale is None else plan.scale
                _single_pass_(
                    p, b, deltas, plan, scale, lr, mu, block_scratch, block_numel, p_out, b_out, sums
                )
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
                _single_pass_(
                    p, b, deltas, mean, mean_scale, lr, mu, block_scratch, block_numel, p_out, b_out, sums
                )
                continue
            _scaled_step_(p, u, b, rda_scale, lr, mu, block_numel, p_out, b_out, sums)
    if sums is None:
        return None
    return _total(sums[0]), _total(sums[1])


def _total(parts: list[Tensor]) -> float:
    return float(torch.stack(parts).to(torch.float64).sum()) if parts else 0.0
