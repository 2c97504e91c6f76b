"""Merging the outer gradients of one round: weighted radial-directional averaging (docs/design.md §3.4).

Per tensor, with weights w_m (learners with w_m = 0 take no part):
    n̄ = Σ w_m ‖δ_m‖ / Σ w_m,   u = Σ w_m δ_m / ‖δ_m‖ / Σ w_m,   Δ = n̄ · u / ‖u‖.
Outer gradients of different learners are nearly orthogonal, so a plain mean shrinks like 1/√M;
RDA keeps the typical norm. Tensors flagged as embeddings, tensors where some contribution is a
zero vector, and tensors whose directions cancel (‖u‖ ≤ U_NORM_EPS) use the weighted mean
Σ w_m δ_m / Σ w_m instead. A single contributor's delta is returned exactly.

How it runs (the merge is memory-bound; bench/outer_merge.py measures it): one blocked pass reads
every contribution for its norm; a second blocked pass forms u' = Σ (c_m / c_p) δ_m, the pivot p
being the largest coefficient so every ratio is at most 1, into the output and accumulates ‖u'‖²;
since u = c_p u', Δ = n̄ · u' / ‖u'‖ and a last in-place scale finishes it. dilocod.outer.step fuses
that scale into the Nesterov step. Norms and ‖u'‖ are float32 dot products per block summed in
float64, which keeps them within about 1e-7 of exact for any fragment size.

Deltas must be float32 (pseudo_gradient's output). Must not import networking, clocks or logging.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dilocod.outer._blocks import blocks, resolve_block_numel

#: u averages unit vectors, so 0 <= ‖u‖ <= 1; below this the direction is noise and the merge
#: falls back to the weighted mean. (M nearly orthogonal contributions give ‖u‖ near 1/√M.)
U_NORM_EPS = 1e-6
DEFAULT_EMBEDDING_PATTERN = "*embed*"

#: Which tensors are embeddings: a predicate on the tensor's index, a mask, or None (no tensor).
EmbeddingRule = Callable[[int], bool] | Sequence[bool] | None


def embedding_mask(names: Sequence[str], pattern: str = DEFAULT_EMBEDDING_PATTERN) -> list[bool]:
    """is_embedding for rda_merge from parameter names and a shell-style pattern (default *embed*)."""
    return [fnmatch.fnmatchcase(name, pattern) for name in names]


@dataclass(frozen=True, slots=True)
class TensorMerge:
    """How one tensor is merged: a linear combination of contributions, pivot first.

    The combination pass computes u' = Σ ratios[i] · δ[terms[i]]; the result is scale · u', where
    scale is known up front (mean, copy) or, for RDA (scale None), is mean_norm / ‖u'‖.
    """

    kind: str  # "copy", "mean" or "rda"
    terms: tuple[int, ...]
    ratios: tuple[float, ...]
    scale: float | None
    mean_norm: float = 0.0
    pivot_coef: float = 1.0


def check_contributions(
    deltas_per_learner: Sequence[Sequence[Tensor]], weights: Sequence[float]
) -> tuple[list[int], int]:
    """Validate the round's inputs; returns the contributing learners (w > 0) and the tensor count."""
    if len(deltas_per_learner) != len(weights):
        raise ValueError(f"{len(deltas_per_learner)} contributions for {len(weights)} weights")
    if not deltas_per_learner:
        raise ValueError("nothing to merge: no contributions")
    for m, w in enumerate(weights):
        if not (math.isfinite(w) and w >= 0.0):
            raise ValueError(f"weight of learner {m} must be finite and non-negative, got {w}")
    active = [m for m, w in enumerate(weights) if w > 0.0]
    if not active:
        raise ValueError("nothing to merge: every weight is zero")
    count = len(deltas_per_learner[active[0]])
    for m in active:
        deltas = deltas_per_learner[m]
        if len(deltas) != count:
            raise ValueError(f"learner {m} sent {len(deltas)} tensors, learner {active[0]} sent {count}")
        for t, (d, first) in enumerate(zip(deltas, deltas_per_learner[active[0]], strict=True)):
            if d.dtype != torch.float32:
                raise TypeError(f"learner {m} tensor {t}: outer gradients must be float32, not {d.dtype}")
            if d.shape != first.shape or d.device != first.device:
                raise ValueError(
                    f"learner {m} tensor {t}: shape {tuple(d.shape)} on {d.device} does not match "
                    f"{tuple(first.shape)} on {first.device}"
                )
    return active, count


def is_embedding_at(rule: EmbeddingRule, index: int) -> bool:
    if rule is None:
        return False
    if callable(rule):
        return bool(rule(index))
    return bool(rule[index])


#: A norm is one streaming read with nothing to keep in cache: longer blocks mean fewer calls,
#: and float32 sums over 2^20 values are still within about 1e-6 before the float64 total.
NORM_BLOCK_NUMEL = 1 << 20


def squared_norm(t: Tensor, block_numel: int = NORM_BLOCK_NUMEL) -> float:
    """‖t‖² in float64, from float32 dot products over blocks (one DRAM pass, accurate sums)."""
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.view(-1)
    parts = [torch.dot(b, b) for (b,) in blocks([flat], max(block_numel, NORM_BLOCK_NUMEL))]
    return float(torch.stack(parts).to(torch.float64).sum())


def _combination(kind: str, active: Sequence[int], coefs: Sequence[float], **extra: float) -> TensorMerge:
    """Order the terms pivot first (the largest coefficient) and express the rest as ratios."""
    order = sorted(range(len(active)), key=lambda i: (-coefs[i], i))
    pivot = coefs[order[0]]
    terms = tuple(active[i] for i in order)
    ratios = tuple(coefs[i] / pivot for i in order)
    scale = pivot if kind == "mean" else None
    return TensorMerge(kind, terms, ratios, scale, pivot_coef=pivot, **extra)


def mean_combination(active: Sequence[int], weights: Sequence[float]) -> TensorMerge:
    if len(active) == 1:
        return TensorMerge("copy", (active[0],), (1.0,), 1.0)
    total = math.fsum(weights[m] for m in active)
    return _combination("mean", active, [weights[m] / total for m in active])


#: One tensor's contributions, by learner index (contributing learners only).
Contributions = dict[int, Tensor]


def plan_tensor(
    deltas: Contributions, active: Sequence[int], weights: Sequence[float], rda: bool, block_numel: int
) -> TensorMerge:
    """Decide how one tensor is merged; for RDA this reads every contribution once (its norm)."""
    if len(active) == 1 or not rda:
        return mean_combination(active, weights)
    norms = [math.sqrt(squared_norm(deltas[m], block_numel)) for m in active]
    if not all(n > 0.0 and math.isfinite(n) for n in norms):
        return mean_combination(active, weights)
    total = math.fsum(weights[m] for m in active)
    shares = [weights[m] / total for m in active]
    mean_norm = math.fsum(s * n for s, n in zip(shares, norms, strict=True))
    coefs = [s / n for s, n in zip(shares, norms, strict=True)]
    return _combination("rda", active, coefs, mean_norm=mean_norm)


def _combine_block(
    ratios: Sequence[float], want_norm: bool, o: Tensor, src: Sequence[Tensor]
) -> Tensor | None:
    if len(src) == 1:
        if o.data_ptr() != src[0].data_ptr():
            o.copy_(src[0])
    elif o.data_ptr() == src[0].data_ptr():  # out is the pivot itself (outer_step_ consume_deltas)
        o.add_(src[1], alpha=ratios[1])
    else:
        torch.add(src[0], src[1], alpha=ratios[1], out=o)
    for d, ratio in zip(src[2:], ratios[2:], strict=True):
        o.add_(d, alpha=ratio)
    if not want_norm:
        return None
    flat = o.view(-1)
    return torch.dot(flat, flat)


def combine_(
    out: Tensor, deltas: Contributions, merge: TensorMerge, block_numel: int, want_norm: bool
) -> float:
    """out = Σ ratios[i] · δ[terms[i]], block by block; returns ‖out‖² (float64) when asked, else 0.

    The pivot's ratio is 1, so the first op adds the second term onto it without a multiply (the
    same op, and the same bits, whether out is a separate buffer or the pivot's own).
    """
    sources = [deltas[m] for m in merge.terms]
    pairs = blocks([out, *sources], block_numel)
    parts = [_combine_block(merge.ratios, want_norm, o, src) for o, *src in pairs]
    if not want_norm:
        return 0.0
    return float(torch.stack(parts).to(torch.float64).sum())


def finish_scale(merge: TensorMerge, combined_sq_norm: float) -> float | None:
    """The factor that turns u' into Δ; None when RDA must fall back to the weighted mean."""
    if merge.scale is not None:
        return merge.scale
    norm = math.sqrt(combined_sq_norm)
    # ‖u‖ = pivot_coef · ‖u'‖ (u' is u divided by the pivot's coefficient).
    if not (math.isfinite(norm) and merge.pivot_coef * norm > U_NORM_EPS):
        return None
    return merge.mean_norm / norm


def check_outputs(out: Sequence[Tensor], like: Sequence[Tensor], what: str) -> None:
    if len(out) != len(like):
        raise ValueError(f"{len(out)} {what} tensors for {len(like)} merged tensors")
    for t, (o, d) in enumerate(zip(out, like, strict=True)):
        if o.dtype != torch.float32 or o.shape != d.shape or o.device != d.device or not o.is_contiguous():
            raise ValueError(f"{what} tensor {t} must be contiguous float32 of shape {tuple(d.shape)}")


def _merge(
    deltas_per_learner: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    is_embedding: EmbeddingRule,
    rda: bool,
    out: Sequence[Tensor] | None,
    block_numel: int | None,
) -> list[Tensor]:
    block_numel = resolve_block_numel(block_numel)
    active, count = check_contributions(deltas_per_learner, weights)
    reference = deltas_per_learner[active[0]]
    if out is None:
        out = [torch.empty(d.shape, dtype=torch.float32, device=d.device) for d in reference]
    else:
        check_outputs(out, reference, "out")
    result = list(out)
    with torch.no_grad():
        for t in range(count):
            deltas = {m: deltas_per_learner[m][t] for m in active}
            use_rda = rda and not is_embedding_at(is_embedding, t)
            merge = plan_tensor(deltas, active, weights, use_rda, block_numel)
            norm_sq = combine_(result[t], deltas, merge, block_numel, want_norm=merge.kind == "rda")
            scale = finish_scale(merge, norm_sq)
            if scale is None:
                merge = mean_combination(active, weights)
                combine_(result[t], deltas, merge, block_numel, want_norm=False)
                scale = merge.scale
            if scale != 1.0:
                result[t].mul_(scale)
    return result


def rda_merge(
    deltas_per_learner: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    is_embedding: EmbeddingRule = None,
    *,
    out: Sequence[Tensor] | None = None,
    block_numel: int | None = None,
) -> list[Tensor]:
    """Weighted radial-directional average per tensor (weighted mean for embeddings and fallbacks).

    deltas_per_learner[m][t] is learner m's float32 outer gradient of tensor t; weights need not be
    normalised. is_embedding flags tensors by index (a predicate or a mask; see embedding_mask).
    Writes into out (contiguous float32, reusable across rounds) when given; returns the merged list.
    """
    return _merge(deltas_per_learner, weights, is_embedding, True, out, block_numel)


def mean_merge(
    deltas_per_learner: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    *,
    out: Sequence[Tensor] | None = None,
    block_numel: int | None = None,
) -> list[Tensor]:
    """Weighted mean Σ w_m δ_m / Σ w_m per tensor (`--merge mean`)."""
    return _merge(deltas_per_learner, weights, None, False, out, block_numel)
