"""FragmentLayout.views: tensor views onto wire-layout buffers, kept for whole shared mappings (the
network process's reused buffers) and built afresh for anything else."""

from __future__ import annotations

import mmap
import struct

import pytest
import torch

from dilocod.learner.layout import FragmentLayout
from dilocod.wire.manifest import pack_manifest

SHAPES = (("w", (4, 3)), ("b", (4,)))


def _layout() -> FragmentLayout:
    manifest, raw_bytes = pack_manifest([(name, "float32", shape) for name, shape in SHAPES])
    params = tuple(torch.nn.Parameter(torch.zeros(shape)) for _, shape in SHAPES)
    return FragmentLayout(0, tuple(manifest), raw_bytes, params)


def _fill(buffer: mmap.mmap | bytearray | memoryview, start: float) -> list[float]:
    count = len(buffer) // 4
    values = [start + i for i in range(count)]
    buffer[: count * 4] = struct.pack(f"<{count}f", *values)
    return values


def _flat(views: list[torch.Tensor]) -> list[float]:
    return torch.cat([v.reshape(-1) for v in views]).tolist()


def _expected(layout: FragmentLayout, values: list[float]) -> list[float]:
    """What the views must read from a buffer filled with values (tensors sit at their offsets,
    with the manifest's alignment between them)."""
    out: list[float] = []
    for entry in layout.manifest:
        out += values[entry.offset // 4 : (entry.offset + entry.nbytes) // 4]
    return out


def test_views_of_a_whole_mapping_are_kept_and_follow_its_bytes() -> None:
    layout = _layout()
    mapping = mmap.mmap(-1, layout.raw_bytes)
    first = layout.views(memoryview(mapping)[: layout.raw_bytes])
    assert _flat(first) == [0.0] * 16
    # The other process writes the next update into the same buffer.
    values = _expected(layout, _fill(mapping, 1.0))
    again = layout.views(memoryview(mapping)[: layout.raw_bytes])
    assert again is first
    assert _flat(again) == values
    assert [tuple(v.shape) for v in again] == [shape for _, shape in SHAPES]


def test_each_mapping_has_its_own_views() -> None:
    layout = _layout()
    one, two = mmap.mmap(-1, layout.raw_bytes), mmap.mmap(-1, layout.raw_bytes)
    _fill(one, 1.0)
    values = _expected(layout, _fill(two, 100.0))
    assert layout.views(memoryview(one)) is not layout.views(memoryview(two))
    assert _flat(layout.views(memoryview(two))) == values


def test_views_of_other_buffers_are_built_each_time() -> None:
    layout = _layout()
    data = bytearray(layout.raw_bytes)
    values = _expected(layout, _fill(data, 5.0))
    first, second = layout.views(data), layout.views(data)
    assert first is not second
    assert _flat(first) == _flat(second) == values
    # Part of a larger mapping is not the whole of it: not kept, and still read from its start.
    larger = mmap.mmap(-1, layout.raw_bytes + 64)
    values = _expected(layout, _fill(larger, 9.0))
    part = memoryview(larger)[: layout.raw_bytes]
    assert layout.views(part) is not layout.views(part)
    assert _flat(layout.views(part)) == values


def test_a_buffer_of_another_size_is_refused() -> None:
    layout = _layout()
    with pytest.raises(ValueError, match=f"fragment 0: 60 bytes, the layout has {layout.raw_bytes}"):
        layout.views(bytearray(60))
