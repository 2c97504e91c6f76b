"""The push worker's δ without torch (dilocod.learner.delta): numpy's float32 subtraction over the
whole buffers gives dilocod.outer.pseudo_gradient's bits exactly, NaN payloads, infinities,
signed zeros and subnormals included (where both operands are NaN, a NaN: IEEE 754 leaves its
payload open, and the two libraries' kernels pick different ones), in place over θ or into
another buffer; the lossy
precisions encode that δ as dilocod.model.precision always did (same bytes, same residuals); and the
modules the learner's network process imports pull in no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from dilocod.learner import link
from dilocod.learner.bridge import Snapshot
from dilocod.learner.delta import fragment_delta_, zero_residual
from dilocod.model.precision import encode, tensor_views
from dilocod.outer import pseudo_gradient
from dilocod.wire.manifest import pack_manifest

SPECIALS = np.array(
    [
        0x7FC00000,  # quiet NaN
        0xFFC00000,  # negative quiet NaN (what inf - inf makes on x86)
        0x7FC12345,  # quiet NaN with a payload
        0xFFA00001,  # signalling NaN, negative, with a payload
        0x7F800001,  # signalling NaN
        0x7F800000,  # +inf
        0xFF800000,  # -inf
        0x00000000,  # +0
        0x80000000,  # -0
        0x00000001,  # smallest subnormal
        0x807FFFFF,  # largest negative subnormal
        0x00400000,  # a subnormal
        0x00800000,  # smallest normal
        0x7F7FFFFF,  # largest finite
        0xFF7FFFFF,  # most negative finite
    ],
    dtype=np.uint32,
)


def _floats(seed: int, n: int) -> bytearray:
    """n float32 values as bytes: random bit patterns (every exponent, ~0.4 % NaNs of random
    payloads), the specials at random places, and runs of small normals near subnormal results."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n, dtype=np.uint32)
    places = rng.choice(n, n // 4, replace=False)
    bits[places] = rng.choice(SPECIALS, len(places))
    near = rng.choice(n, n // 8, replace=False)
    bits[near] = rng.integers(0x00000001, 0x01000000, len(near), dtype=np.uint32) | (
        rng.integers(0, 2, len(near), dtype=np.uint32) << 31
    )
    return bytearray(bits.tobytes())


def _assert_same_bits(got: bytes, expected: bytes, anchor: bytes, theta: bytes) -> None:
    """Bit for bit, but where both operands are NaN (then: NaN)."""
    g, e = np.frombuffer(got, dtype=np.uint32), np.frombuffer(expected, dtype=np.uint32)
    a, t = np.frombuffer(anchor, dtype=np.float32), np.frombuffer(theta, dtype=np.float32)
    both = np.isnan(a) & np.isnan(t)
    assert both.any() or len(g) < 100  # the case is exercised
    mismatched = np.nonzero((g != e) & ~both)[0]
    assert not len(mismatched), [(hex(g[i]), hex(e[i])) for i in mismatched[:5]]
    assert np.isnan(np.frombuffer(got, dtype=np.float32)[both]).all()


def _torch_delta(anchor: bytes, theta: bytes) -> bytes:
    a = torch.frombuffer(bytearray(anchor), dtype=torch.float32)
    t = torch.frombuffer(bytearray(theta), dtype=torch.float32)
    return pseudo_gradient([a], [t])[0].numpy().tobytes()


# Lengths around the vector widths (16 and 8 floats): the vectorised body and the scalar tail.
@pytest.mark.parametrize("n", [1, 7, 17, 1023, 100_003])
@pytest.mark.parametrize("seed", [0, 1])
def test_numpy_delta_is_pseudo_gradient_bit_for_bit(n: int, seed: int) -> None:
    anchor, theta = _floats(2 * seed, n), _floats(2 * seed + 1, n)
    # Equal operands too: x - x is +0, except NaN and inf - inf.
    theta[: 4 * (n // 3)] = anchor[: 4 * (n // 3)]
    expected = _torch_delta(anchor, theta)
    out = bytearray(len(theta))
    fragment_delta_(anchor, theta, out)
    _assert_same_bits(out, expected, anchor, theta)
    in_place = memoryview(bytearray(theta))
    fragment_delta_(memoryview(anchor), in_place, in_place)  # over θ, as the push writes it
    assert bytes(in_place) == bytes(out)


def test_fragment_delta_refuses_buffers_that_do_not_match() -> None:
    with pytest.raises(ValueError, match="one size"):
        fragment_delta_(bytearray(8), bytearray(4), bytearray(8))
    with pytest.raises(ValueError, match="whole float32"):
        fragment_delta_(bytearray(6), bytearray(6), bytearray(6))
    fragment_delta_(bytearray(), bytearray(), bytearray())  # an empty fragment: nothing to do


def _snapshot(anchor: bytearray, theta: bytearray) -> Snapshot:
    return Snapshot(0, 1, 0, 3, 300, theta, anchor)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_a_push_is_what_the_torch_path_made(precision: str) -> None:
    """compute_push at every precision, over three rounds of error feedback, against δ from
    pseudo_gradient encoded by dilocod.model.precision: the same manifest, bytes and residuals."""
    shapes = [("w", (37, 64)), ("b", (129,))]
    manifest = tuple(pack_manifest([(name, "float32", shape) for name, shape in shapes])[0])
    size = manifest[-1].offset + manifest[-1].nbytes
    gen = torch.Generator().manual_seed(3)
    residual = zero_residual(manifest) if precision != "fp32" else None
    reference = [torch.zeros(shape) for _, shape in shapes] if precision != "fp32" else None
    for _ in range(3):
        anchor = torch.randn(size // 4, generator=gen)
        theta = anchor + 1e-3 * torch.randn(size // 4, generator=gen)
        raw_anchor, raw_theta = bytearray(anchor.numpy().tobytes()), bytearray(theta.numpy().tobytes())
        delta = bytearray(_torch_delta(raw_anchor, raw_theta))
        want_manifest, want = encode(
            tensor_views(delta, manifest), [n for n, _ in shapes], precision, reference
        )
        got_manifest, got, _ = link.compute_push(
            _snapshot(raw_anchor, raw_theta), manifest, 4096, precision, residual, in_place=True
        )
        assert got_manifest == want_manifest and bytes(got) == bytes(want)
        if residual is not None and reference is not None:
            assert all(torch.equal(r, e) for r, e in zip(residual, reference, strict=True))


def test_the_network_process_imports_no_torch() -> None:
    """What the child imports to run a Link at fp32 (netchild's entry and its lazy imports, the Link,
    the push worker's δ, the codec timing): a fresh interpreter, then sys.modules."""
    code = (
        "import sys\n"
        "import dilocod.learner.netchild\n"
        "from dilocod.learner.netchild import decode_config, _child_main\n"
        "from dilocod.learner.link import Link, LinkConfig, compute_push, codec_figures\n"
        "from dilocod.transport.credentials import client_context\n"
        "from dilocod.tuning.advice import advice_from_json\n"
        "from dilocod.transport.loop import run\n"
        "from dilocod.ops.logging import configure_logging\n"
        "from dilocod.learner.bridge import Snapshot\n"
        "from dilocod.wire.manifest import pack_manifest\n"
        "manifest = tuple(pack_manifest([('w', 'float32', (1 << 18,))])[0])\n"
        "theta, anchor = bytearray(1 << 20), bytearray(1 << 20)\n"
        "compute_push(Snapshot(0, 1, 0, 1, 1, theta, anchor), manifest, 1 << 16, in_place=True)\n"
        "codec_figures(theta, 1 << 16)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
