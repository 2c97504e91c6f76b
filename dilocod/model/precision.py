"""How an outer gradient travels at each wire precision: its manifest layout, and encoding (with
error feedback) and decoding. Shared by the learner (encodes) and the syncer (decodes); both derive
the layout from the same (name, shape) list, the fragment's pieces as wire.manifest.fragment_shapes
names them (`name` or `name[start:stop]`), so a push's manifest tells the syncer its precision; the
fp32 layout is exactly wire.manifest.fragment_manifest's.

- fp32: one float32 tensor per piece (lossless; what the merge works in).
- bf16: one bfloat16 tensor per piece (half the bytes).
- int8 / int4: per piece, block-scaled symmetric integer codes (dilocod.outer.quantize, blocks
  of BLOCK_SIZE values) as `name` (int8 codes, or uint8 bytes of two 4-bit codes) followed by its
  float32 scales as `name#scales`: 1.0625 and 0.5625 bytes per parameter.
Lossy precisions carry error feedback: what one round lost is added to the next outer gradient of
the same fragment, so the errors cancel over rounds instead of accumulating.

Updates (the syncer's merged fragments) travel at fp32 or bf16 in the same layouts, without error
feedback: `recast` copies a fragment from one layout into another (float32 to bfloat16 rounds to
nearest even, bfloat16 to float32 is exact), so the syncer encodes an update and a learner decodes
it with it, each into a buffer it owns.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch
from torch import Tensor

from dilocod.outer.quantize import QuantizedTensor, dequantize, quantize_with_feedback_
from dilocod.wire.layouts import _BITS, BLOCK_SIZE, push_layout
from dilocod.wire.manifest import TensorEntry

#: Memory a fragment's bytes may live in (the syncer's pool lends anonymous maps).
Buffer = bytearray | memoryview | mmap.mmap

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


def tensor_views(buffer: Buffer, manifest: Sequence[TensorEntry]) -> list[Tensor]:
    """The manifest's tensors as views onto a wire-layout buffer, sharing its memory (no copy).
    Every part of dilocod that reads or writes fragment bytes in place goes through this."""
    raw = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    return byte_views(raw, manifest)


def byte_views(raw: Tensor, manifest: Sequence[TensorEntry]) -> list[Tensor]:
    """The manifest's tensors as views onto a flat uint8 tensor of the wire layout, on any device
    (a fragment staged in device memory is laid out as its wire buffer)."""
    return [raw[e.offset : e.offset + e.nbytes].view(_TORCH_DTYPES[e.dtype]).view(e.shape) for e in manifest]


def encode(
    deltas: Sequence[Tensor],
    names: Sequence[str],
    precision: str,
    residual: Sequence[Tensor] | None = None,
) -> tuple[tuple[TensorEntry, ...], bytearray]:
    """deltas (float32, one per parameter) laid out at precision. residual (float32 tensors like
    the deltas, zeros at first) is used and updated for the lossy precisions."""
    shapes = [(n, tuple(d.shape)) for n, d in zip(names, deltas, strict=True)]
    manifest, raw_bytes = push_layout(shapes, precision)
    out = bytearray(raw_bytes)
    views = tensor_views(out, manifest)
    with torch.no_grad():
        if precision == "fp32":
            for view, delta in zip(views, deltas, strict=True):
                view.copy_(delta)
        elif precision == "bf16":
            for i, (view, delta) in enumerate(zip(views, deltas, strict=True)):
                if residual is None:
                    view.copy_(delta)
                    continue
                residual[i].add_(delta)
                view.copy_(residual[i])
                residual[i].sub_(view.to(torch.float32))
        else:
            if residual is None:
                residual = [torch.zeros_like(d, dtype=torch.float32) for d in deltas]
            for i, q in enumerate(quantize_with_feedback_(deltas, residual, _BITS[precision], BLOCK_SIZE)):
                views[2 * i].copy_(q.data.reshape(-1))
                views[2 * i + 1].copy_(q.scales)
    return manifest, out


def decode(
    buffer: bytearray | memoryview,
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    precision: str,
    out: Sequence[Tensor],
) -> None:
    """A push at precision into float32 tensors `out` (one per parameter, of its shape)."""
    manifest, raw_bytes = push_layout(shapes, precision)
    if len(buffer) != raw_bytes:
        raise ValueError(f"a {precision} push of these parameters holds {raw_bytes} bytes, not {len(buffer)}")
    views = tensor_views(buffer, manifest)
    with torch.no_grad():
        if precision in ("fp32", "bf16"):
            for target, view in zip(out, views, strict=True):
                target.copy_(view)
            return
        bits = _BITS[precision]
        for i, ((_, shape), target) in enumerate(zip(shapes, out, strict=True)):
            q = QuantizedTensor(bits, BLOCK_SIZE, shape, views[2 * i], views[2 * i + 1])
            dequantize(q, out=target)


def recast(
    source: Buffer,
    source_manifest: Sequence[TensorEntry],
    target: Buffer,
    target_manifest: Sequence[TensorEntry],
) -> None:
    """Copy each tensor of a wire-layout buffer into the same tensor of another layout (same names
    and shapes, any float dtypes: torch's conversion, round to nearest even when narrowing), and
    zero the target's padding, so that equal tensors make equal bytes and equal checksums."""
    if [(e.name, e.shape) for e in source_manifest] != [(e.name, e.shape) for e in target_manifest]:
        raise ValueError("recast between layouts of different tensors")
    view = memoryview(target).cast("B")
    end = 0
    for entry in target_manifest:
        view[end : entry.offset] = bytes(entry.offset - end)
        end = entry.offset + entry.nbytes
    view[end:] = bytes(len(view) - end)
    with torch.no_grad():
        for out, value in zip(
            tensor_views(target, target_manifest), tensor_views(source, source_manifest), strict=True
        ):
            out.copy_(value)
