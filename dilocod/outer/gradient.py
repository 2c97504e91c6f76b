"""The outer gradient (pseudo-gradient) a learner sends: anchor - local, in float32 (docs/design.md §3.3).

Float32 whatever the model dtype: the merge and the outer optimizer run in float32, and a bf16
difference of two nearby bf16 tensors would round away most of the step. Works on whatever device
the tensors live on. Must not import networking, clocks or logging.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def pseudo_gradient(
    anchor: Sequence[Tensor], local: Sequence[Tensor], out: Sequence[Tensor] | None = None
) -> list[Tensor]:
    """anchor - local per tensor, as float32; written into out (float32, same shapes) when given."""
    if len(anchor) != len(local):
        raise ValueError(f"{len(anchor)} anchor tensors for {len(local)} local tensors")
    if out is not None and len(out) != len(anchor):
        raise ValueError(f"{len(out)} output tensors for {len(anchor)} parameters")
    result: list[Tensor] = []
    with torch.no_grad():
        for i, (a, theta) in enumerate(zip(anchor, local, strict=True)):
            if a.shape != theta.shape:
                raise ValueError(f"tensor {i}: anchor shape {tuple(a.shape)} != local {tuple(theta.shape)}")
            dst = out[i] if out is not None else torch.empty(a.shape, dtype=torch.float32, device=a.device)
            if dst.dtype != torch.float32 or dst.shape != a.shape:
                raise ValueError(f"tensor {i}: output must be float32 of shape {tuple(a.shape)}")
            if torch.float64 in (a.dtype, theta.dtype):
                # Subtract at full precision, round once.
                dst.copy_(torch.sub(a.double(), theta.double()))
            elif a.dtype == theta.dtype == torch.float32:
                # One pass over the bytes (the learner's push: whole fragments in float32).
                torch.sub(a, theta, out=dst)
            else:
                # float32, bfloat16 and float16 values are exact in float32: one rounding, no temporary.
                dst.copy_(a)
                dst.sub_(theta)
            result.append(dst)
    return result
