"""The bytes of a push, as the push worker makes them: δ = anchor - θ over a fragment's whole
float32 wire buffer (padding included), and the lossy wire precisions' encoding of it.

δ is float32 subtraction, element by element (IEEE 754: one rounding, so the same bits whoever
computes it, infinities, signed zeros and subnormals included): numpy does it in place on the
buffers themselves, without the GIL and without torch. That keeps torch out of the learner's
network process (`--network process`) when its pushes travel as fp32, the default: importing it
there would cost about 170 MiB of memory that nothing shares with the training process. The values
are dilocod.outer.pseudo_gradient's, which stays the one implementation over tensors of any dtype
(tests/unit/test_learner_delta.py holds the two equal, bit for bit). One case IEEE 754 leaves open
differs: where both operands are NaN, numpy (x86: the anchor's NaN, sign and payload) and torch's
FMA kernel (θ's) keep different ones; a NaN either way, and the syncer's guard refuses the push.

The lossy precisions (bf16, int8, int4: dilocod.model.precision, with error feedback) work on tensors:
they import torch here, so only a learner configured for them pays for it; the network process
imports it at its start (import_encoder), as importing torch takes seconds that its first push
must not wait.

Must not import torch at module level, networking, clocks or logging.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

    from dilocod.wire.manifest import TensorEntry

Buffer = bytearray | memoryview


def fragment_delta_(anchor: Buffer, theta: Buffer, out: Buffer) -> None:
    """out = anchor - θ, float32 element by element over whole buffers of the same size; out may
    be θ itself (the push writes δ over its snapshot)."""
    if not len(anchor) == len(theta) == len(out):
        raise ValueError(f"buffers of {len(anchor)}, {len(theta)} and {len(out)} bytes: one size, please")
    if len(out) % 4:
        raise ValueError(f"{len(out)} bytes are not whole float32 values")
    if not len(out):
        return
    # A diverged learner's NaN or overflow travels as values, as torch lets it (the syncer's guard
    # judges it), not as a warning per push; errstate is this thread's own.
    with np.errstate(all="ignore"):
        np.subtract(
            np.frombuffer(anchor, dtype=np.float32),
            np.frombuffer(theta, dtype=np.float32),
            out=np.frombuffer(out, dtype=np.float32),
        )


def import_encoder(precision: str) -> None:
    """Import what encode_lossy needs at this wire precision (torch for the lossy ones) now."""
    if precision != "fp32":
        importlib.import_module("dilocod.model.precision")


def zero_residual(manifest: tuple[TensorEntry, ...]) -> list[Tensor]:
    """A fragment's error-feedback residual before its first lossy push: float32 zeros per tensor."""
    # Lossy precisions only: see the module docstring.
    import torch  # noqa: PLC0415

    return [torch.zeros(e.shape, dtype=torch.float32) for e in manifest]


def encode_lossy(
    delta: Buffer, manifest: tuple[TensorEntry, ...], precision: str, residual: list[Any] | None
) -> tuple[tuple[TensorEntry, ...], bytearray]:
    """δ (float32, in the fragment's wire layout `manifest`) laid out at a lossy precision, with
    error feedback through residual (zero_residual's, updated in place)."""
    # Imports torch (lossy precisions only).
    from dilocod.model.precision import encode, tensor_views  # noqa: PLC0415

    return encode(tensor_views(delta, manifest), [e.name for e in manifest], precision, residual)


def decode_update(
    received: Buffer, manifest: tuple[TensorEntry, ...], target: Buffer, layout: tuple[TensorEntry, ...]
) -> None:
    """An update received at bf16 (`manifest`) upcast, exactly, into a float32 buffer of the
    fragment's layout: the anchor the learner then holds. Imports torch (bf16 updates only, the
    syncer's --update-precision): the first such update pays for the import."""
    from dilocod.model.precision import recast  # noqa: PLC0415

    recast(received, manifest, target, layout)
