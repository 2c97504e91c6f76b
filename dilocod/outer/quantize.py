"""Lossy wire precision for outer gradients: block-scaled integers, with error feedback.

quantize(x, bits, block_size) cuts the flattened tensor into blocks of block_size values and
stores each as symmetric integers q = round(x / s) in [-qmax, qmax], qmax = 2^(bits-1) - 1, with
one float32 scale s = max|x| / qmax per block. bits 16 and 8 use int16 and int8 codes; bits 4
packs two codes (q + 8) per byte. Documented error bound, per value, for finite normal floats:

    |x - dequantize(quantize(x))| ≤ s · (1/2 + qmax · 2⁻²¹)

(half a step, plus float32 rounding of the division and of the product). Bytes per parameter are
bits/8 + 4/block_size: 0.5625 for 4 bits in blocks of 64.

Error feedback (quantize_with_feedback_) adds the residual left by the previous quantization of the
same fragment to the next outer gradient before quantizing it, so quantization errors cancel over
rounds instead of accumulating: the sum of what was sent stays within one bound of the sum of the
true outer gradients. Must not import networking, clocks or logging.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

QUANT_BITS = (16, 8, 4)
DEFAULT_BLOCK_SIZE = 64
_CODE_DTYPES = {16: torch.int16, 8: torch.int8}
#: Relative slack of the error bound beyond half a step, in units of qmax (see the module text).
_ROUNDING_SLACK = 2.0**-21


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    bits: int
    block_size: int
    shape: tuple[int, ...]
    #: int16 or int8 codes, or for 4 bits uint8 bytes holding two codes (low nibble first).
    data: Tensor
    #: float32, one per block.
    scales: Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def payload_bytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4

    @property
    def bytes_per_parameter(self) -> float:
        return self.payload_bytes / self.numel if self.numel else 0.0

    def error_bounds(self) -> Tensor:
        """The documented bound on |x - x̂| for each block (float32, one per block)."""
        return self.scales * (0.5 + _qmax(self.bits) * _ROUNDING_SLACK)


def _check(bits: int, block_size: int) -> None:
    if bits not in QUANT_BITS:
        raise ValueError(f"bits must be one of {QUANT_BITS}, got {bits}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")


def quantize(delta: Tensor, bits: int, block_size: int = DEFAULT_BLOCK_SIZE) -> QuantizedTensor:
    """Block-scaled symmetric integer codes of delta (any shape; read as float32)."""
    _check(bits, block_size)
    x = delta.detach().reshape(-1).to(torch.float32)
    numel = x.numel()
    blocks_count = -(-numel // block_size)
    padded = x.new_zeros(blocks_count * block_size)
    padded[:numel] = x
    rows = padded.view(blocks_count, block_size)
    qmax = _qmax(bits)
    absmax = rows.abs().amax(dim=1) if numel else padded.new_zeros(0)
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError("cannot quantize non-finite values")
    scales = absmax / qmax
    # An all-zero block keeps scale 0 and codes 0; divide it by 1 rather than by 0.
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(rows / divisors[:, None]).clamp_(-qmax, qmax).reshape(-1)
    if bits in _CODE_DTYPES:
        data = codes.to(_CODE_DTYPES[bits])
    else:
        nibbles = (codes + 8).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
        pairs = nibbles.view(-1, 2)
        data = pairs[:, 0] | (pairs[:, 1] << 4)
    return QuantizedTensor(bits, block_size, tuple(delta.shape), data, scales)


def dequantize(q: QuantizedTensor, out: Tensor | None = None) -> Tensor:
    """float32 values of q in its original shape (written into out when given)."""
    _check(q.bits, q.block_size)
    blocks_count = q.scales.numel()
    if q.bits in _CODE_DTYPES:
        codes = q.data.to(torch.float32)
    else:
        low = (q.data & 0x0F).to(torch.int16)
        high = (q.data >> 4).to(torch.int16)
        codes = (torch.stack([low, high], dim=1).reshape(-1)[: blocks_count * q.block_size] - 8).to(
            torch.float32
        )
    values = (codes.view(blocks_count, q.block_size) * q.scales[:, None]).reshape(-1)[: q.numel]
    values = values.view(q.shape)
    if out is None:
        return values
    out.copy_(values)
    return out


def quantize_with_feedback_(
    delta: Sequence[Tensor], residual: Sequence[Tensor], bits: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> list[QuantizedTensor]:
    """Quantize delta + residual per tensor and leave the new residual (what was lost) in residual.

    residual holds one float32 tensor per delta tensor, zeros before the fragment's first round;
    keep it per fragment between rounds.
    """
    if len(delta) != len(residual):
        raise ValueError(f"{len(delta)} tensors for {len(residual)} residuals")
    result: list[QuantizedTensor] = []
    with torch.no_grad():
        for i, (d, r) in enumerate(zip(delta, residual, strict=True)):
            if r.dtype != torch.float32 or r.shape != d.shape:
                raise ValueError(f"residual {i} must be float32 of shape {tuple(d.shape)}")
            r.add_(d)
            q = quantize(r, bits, block_size)
            r.sub_(dequantize(q))
            result.append(q)
    return result


@dataclass(frozen=True, slots=True)
class QuantizationReport:
    max_abs_error: float
    rms_error: float
    #: ‖x - x̂‖ / ‖x‖ (0 for a zero tensor).
    relative_error: float
    bytes_per_parameter: float


def quantization_report(original: Tensor, q: QuantizedTensor) -> QuantizationReport:
    """Error of q against the tensor it was made from, and its size on the wire."""
    x = original.detach().reshape(-1).to(torch.float64)
    err = dequantize(q).reshape(-1).to(torch.float64) - x
    norm = float(x.norm())
    count = max(1, x.numel())
    return QuantizationReport(
        max_abs_error=float(err.abs().max()) if x.numel() else 0.0,
        rms_error=math.sqrt(float(err.square().sum()) / count),
        relative_error=float(err.norm()) / norm if norm > 0 else 0.0,
        bytes_per_parameter=q.bytes_per_parameter,
    )
