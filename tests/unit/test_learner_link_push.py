"""The outer gradient a learner pushes is dilocod.outer's pseudo_gradient, the one implementation
tests/unit/outer checks against a float64 reference: the push worker computes it over the
snapshot's buffers (with numpy, dilocod.learner.delta: the same bits, tests/unit/test_learner_delta.py),
writing straight into the bytes that go on the wire, and the result is the exact difference
rounded once to float32."""

from __future__ import annotations

import torch

from dilocod.learner import link
from dilocod.learner.bridge import Snapshot
from dilocod.outer import pseudo_gradient
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.manifest import pack_manifest

CHUNK_BYTES = 4096


def _snapshot(anchor: torch.Tensor, theta: torch.Tensor) -> Snapshot:
    return Snapshot(0, 1, 0, 3, 300, bytearray(theta.numpy().tobytes()), bytearray(anchor.numpy().tobytes()))


def _fragment(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 fragments a few steps apart, with magnitudes over many binades (so that a
    difference computed at a lower precision, or rounded twice, would show)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 20, (3001,), generator=gen).float())
    anchor = torch.randn(3001, generator=gen) * scale
    theta = anchor + 1e-3 * torch.randn(3001, generator=gen) * scale
    return anchor, theta


def test_push_is_the_float64_reference_rounded_once() -> None:
    anchor, theta = _fragment(0)
    manifest = tuple(pack_manifest([("w", "float32", (3001,))])[0])
    _, data, checksums = link.compute_push(_snapshot(anchor, theta), manifest, CHUNK_BYTES)
    exact = (anchor.double() - theta.double()).float()
    assert bytes(data) == exact.numpy().tobytes()
    assert checksums == chunk_checksums(data, CHUNK_BYTES)


def test_push_is_the_outer_pseudo_gradient_in_place() -> None:
    anchor, theta = _fragment(1)
    manifest = tuple(pack_manifest([("w", "float32", (3001,))])[0])
    snapshot = _snapshot(anchor, theta)
    _, data, _ = link.compute_push(snapshot, manifest, CHUNK_BYTES, in_place=True)
    assert data is snapshot.theta  # written over θ: that buffer goes on the wire
    assert bytes(data) == pseudo_gradient([anchor], [theta])[0].numpy().tobytes()
