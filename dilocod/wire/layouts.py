"""The manifest layout of a fragment's stream at each wire precision, and whether a manifest's
dtypes fit the precision its stream header states (protocol/SPEC.md §5.1): pure arithmetic on
(name, shape) lists, shared by the syncer, the learner and its network process (which imports no
torch at fp32: dilocod.learner.delta). The encoding and decoding themselves are
dilocod.model.precision's.

- fp32: one float32 tensor per piece; bf16: one bfloat16 tensor per piece;
- int8 / int4: per piece, block-scaled integer codes as `name` (int8 codes, or uint8 bytes of two
  4-bit codes) followed by its float32 scales as `name#scales`.

Must not import torch, networking or logging.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dilocod.wire.choices import PRECISIONS
from dilocod.wire.manifest import TensorEntry, pack_manifest

BLOCK_SIZE = 64
SCALES_SUFFIX = "#scales"
_BITS = {"int8": 8, "int4": 4}
_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def push_layout(
    shapes: Sequence[tuple[str, tuple[int, ...]]], precision: str
) -> tuple[tuple[TensorEntry, ...], int]:
    """The manifest and byte size of a push of these parameters at this precision."""
    tensors: list[tuple[str, str, Sequence[int]]] = []
    for name, shape in shapes:
        if precision == "fp32":
            tensors.append((name, "float32", shape))
        elif precision == "bf16":
            tensors.append((name, "bfloat16", shape))
        elif precision in _BITS:
            blocks = -(-math.prod(shape) // BLOCK_SIZE)
            codes = blocks * BLOCK_SIZE
            if precision == "int8":
                tensors.append((name, "int8", [codes]))
            else:
                tensors.append((name, "uint8", [-(-codes // 2)]))
            tensors.append((name + SCALES_SUFFIX, "float32", [blocks]))
        else:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    manifest, raw_bytes = pack_manifest(tensors)
    return tuple(manifest), raw_bytes


def layout_fault(manifest: Sequence[TensorEntry], precision: str) -> str | None:
    """What makes this manifest no stream at this precision, from its dtypes alone (None: it can
    be one): fp32 and bf16 list one float32 or bfloat16 tensor per piece; int8 and int4 one code
    tensor (int8, or uint8 of two 4-bit codes) followed by its float32 `#scales` per piece. Whether
    the names and shapes are the fragment's is for the receiver, which knows the plan."""
    if precision not in PRECISIONS:
        return f"precision {precision!r} is not one of {PRECISIONS}"
    if precision in _DTYPES:
        wrong = sorted({entry.dtype for entry in manifest} - {_DTYPES[precision]})
        return f"{wrong} tensors at {precision}" if wrong else None
    codes = "int8" if precision == "int8" else "uint8"
    if len(manifest) % 2:
        return f"{len(manifest)} tensors at {precision}: each piece is codes and scales"
    for entry, scales in zip(manifest[::2], manifest[1::2], strict=True):
        block_bytes = BLOCK_SIZE * _BITS[precision] // 8  # the code bytes of one block
        if (
            entry.dtype != codes
            or scales.dtype != "float32"
            or scales.name != entry.name + SCALES_SUFFIX
            or len(entry.shape) != 1
            or scales.shape != (entry.shape[0] // block_bytes,)
            or entry.shape[0] % block_bytes
        ):
            return f"{entry.name!r} is not {codes} codes followed by its float32 {SCALES_SUFFIX}"
    return None
