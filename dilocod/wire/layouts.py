"""The manifest layout of a fragment's stream at each wire precision, and which precision a
manifest is: pure arithmetic on (name, shape) lists, shared by the syncer, the learner and its
network process (which imports no torch at fp32: dilocod.learner.delta). The encoding and decoding
themselves are dilocod.precision's.

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


def precision_of(
    manifest: Sequence[TensorEntry], shapes: Sequence[tuple[str, tuple[int, ...]]]
) -> str | None:
    """Which precision's layout this manifest is (None: none of them)."""
    for precision in PRECISIONS:
        if tuple(manifest) == push_layout(shapes, precision)[0]:
            return precision
    return None
