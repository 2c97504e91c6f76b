"""FragmentLayout.views: tensor views onto wire-layout buffers, kept for whole shared mappings (the
network process's reused buffers) and built afresh for anything else; layouts_for over row pieces:
its params are views of the live parameters' rows."""

from __future__ import annotations

import mmap
import struct

import pytest
import torch

from dilocod.learner.layout import FragmentLayout, layouts_for
from dilocod.model.params import model_entries
from dilocod.model.plan import plan_module
from dilocod.outer import apply_update_
from dilocod.wire.manifest import fragment_manifest, pack_manifest
from dilocod.wire.messages import Plan

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


# ------------------------------------------------------------------ layouts over row pieces


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(40, 6)
        self.body = torch.nn.Linear(6, 6)
        self.scale = torch.nn.Parameter(torch.tensor(2.0))  # 0-d: always one whole piece
        self.head = torch.nn.Linear(6, 40, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, one name


def _plan(model: torch.nn.Module, count: int) -> Plan:
    entries = model_entries(model)
    fragments = plan_module(model, count).fragments
    return Plan("inc", entries, tuple(f.pieces for f in fragments), (0,) * len(fragments), 4, 1, 1)


def test_layouts_over_row_slices_read_and_write_the_live_parameters() -> None:
    model = Tied()
    plan = _plan(model, 5)
    layouts = layouts_for(plan, model)
    pieces = [p for pieces in plan.fragments for p in pieces]
    assert [p for p in pieces if p[0] == "embed.weight"][1:], "the embedding is cut into row slices"
    assert ("scale", 0, 1) in pieces and not any(p[0] == "head.weight" for p in pieces)
    params = dict(model.named_parameters())
    for layout, fragment in zip(layouts, plan.fragments, strict=True):
        for view, entry, (name, start, stop) in zip(layout.params, layout.manifest, fragment, strict=True):
            whole = params[name]
            assert view.data_ptr() == (whole[start:stop] if whole.dim() else whole).data_ptr()
            assert tuple(view.shape) == entry.shape
    # An update applied in place to the layout's params (overwrite, as the runtime does) writes
    # the model, the tied head included; its other rows stay.
    target = next(layout for layout in layouts if layout.manifest[0].name.startswith("embed.weight["))
    name, start, stop = plan.fragments[target.index][0]
    before = params[name].detach().clone()
    new = [torch.full(v.shape, 3.0) for v in target.params]
    with torch.no_grad():
        apply_update_(list(target.params), new, "overwrite")
    assert torch.equal(model.embed.weight[start:stop], torch.full_like(before[start:stop], 3.0))
    assert torch.equal(model.head.weight[start:stop], torch.full_like(before[start:stop], 3.0))
    rest = torch.ones(before.shape[0], dtype=torch.bool)
    rest[start:stop] = False
    assert torch.equal(model.embed.weight[rest], before[rest])
    # Keep-local's copy of what was sent (runtime: param.detach().clone()) is a copy, not a view.
    sent = [p.detach().clone() for p in target.params]
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    assert torch.equal(sent[0], torch.full_like(sent[0], 3.0))
    # Training still works on the model whose rows the layouts view.
    model.zero_grad()
    model.head(model.embed(torch.tensor([1, 2]))).sum().backward()
    assert model.embed.weight.grad is not None


def test_the_manifest_names_a_slice_and_a_whole_tensor() -> None:
    shapes = {"w": (10, 4), "s": ()}
    manifest, raw_bytes = fragment_manifest([("w", 2, 5), ("s", 0, 1), ("w", 0, 10)], shapes)
    assert [(e.name, e.shape) for e in manifest] == [("w[2:5]", (3, 4)), ("s", ()), ("w", (10, 4))]
    assert raw_bytes == manifest[-1].offset + 160
