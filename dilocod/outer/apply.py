"""How a learner adopts a merged fragment (docs/design.md §3.3): overwrite, mix or keep-local.

- overwrite (the paper's default): θ ← Θ_new;
- mix (Streaming DiLoCo): θ ← alpha·θ + (1 - alpha)·Θ_new;
- keep-local (ours, to evaluate): θ ← Θ_new + (θ_now - θ_sent), so the inner steps taken while the
  fragment was on the wire are kept rather than overwritten.
In place on the learner's parameters, whatever their dtype: where the model is not float32 the
arithmetic runs in float32 and rounds once into the parameter. Setting the anchor to Θ_new and
resetting the counters is the caller's job. Must not import networking, clocks or logging.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

APPLY_MODES = ("overwrite", "mix", "keep-local")


def apply_update_(
    local: Sequence[Tensor],
    new_global: Sequence[Tensor],
    mode: str,
    alpha: float = 0.5,
    sent: Sequence[Tensor] | None = None,
) -> None:
    """Apply Θ_new to the local parameters in place; sent is θ at the time the delta was sent."""
    if mode not in APPLY_MODES:
        raise ValueError(f"apply mode must be one of {APPLY_MODES}, got {mode!r}")
    if mode == "mix" and not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"mix alpha must lie in [0, 1], got {alpha}")
    if mode == "keep-local" and sent is None:
        raise ValueError("keep-local needs the parameters as they were when the delta was sent")
    if len(local) != len(new_global) or (sent is not None and len(sent) != len(local)):
        raise ValueError("local, new_global and sent must hold the same number of tensors")
    for i, (theta, new) in enumerate(zip(local, new_global, strict=True)):
        if theta.shape != new.shape or (sent is not None and sent[i].shape != theta.shape):
            raise ValueError(f"tensor {i}: shapes differ ({tuple(theta.shape)} vs {tuple(new.shape)})")
    with torch.no_grad():
        for i, (theta, new) in enumerate(zip(local, new_global, strict=True)):
            if mode == "overwrite":
                theta.copy_(new)
            elif mode == "mix":
                _mix_(theta, new, alpha)
            elif sent is not None:  # keep-local, whose sent was checked above
                _keep_local_(theta, new, sent[i])


def _mix_(theta: Tensor, new: Tensor, alpha: float) -> None:
    # lerp_(end, w) = θ + w·(end - θ); with w = 1 - alpha that is alpha·θ + (1 - alpha)·Θ_new in one pass.
    if theta.dtype == new.dtype:
        theta.lerp_(new, 1.0 - alpha)
    else:
        theta.copy_(theta.to(torch.float32).lerp_(new.to(torch.float32), 1.0 - alpha))


def _keep_local_(theta: Tensor, new: Tensor, sent: Tensor) -> None:
    if theta.dtype == new.dtype == sent.dtype:
        theta.sub_(sent).add_(new)
    else:
        progress = theta.to(torch.float32) - sent.to(torch.float32)
        theta.copy_(progress.add_(new.to(torch.float32)))
