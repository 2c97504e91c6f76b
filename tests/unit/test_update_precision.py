"""Updates at bf16 (`dilocod syncer --update-precision bf16`): the encoding rounds to nearest even
as torch does and zeroes the padding, the decoding is exact; the syncer makes a version's encoding
once in the merge and gives it back when no send needs it; a learner decodes a bf16 update into a
float32 anchor off the event loop and refuses an update that is not the plan's layout."""

from __future__ import annotations

import asyncio

import pytest
import torch
from structlog.testing import capture_logs

from devkit.links import new_link
from dilocod.learner.bridge import Bridge
from dilocod.learner.link import Link
from dilocod.learner.plancheck import UpdateRefused, check_update
from dilocod.model.params import model_entries
from dilocod.model.plan import plan_fragments
from dilocod.model.precision import recast, tensor_views
from dilocod.syncer.model import GlobalModel
from dilocod.transport.session import FragmentReceived
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.layouts import push_layout
from dilocod.wire.manifest import fragment_manifest
from dilocod.wire.messages import Join, Plan, UpdateHeader

SHAPES = [("embed.weight", (50, 8)), ("out.bias", (7,)), ("block.w", (3, 5, 9))]
CHUNK = 4096


def _fp32(seed: int) -> tuple[tuple, bytearray, list[torch.Tensor]]:
    manifest, raw_bytes = push_layout(SHAPES, "fp32")
    buffer = bytearray(raw_bytes)
    generator = torch.Generator().manual_seed(seed)
    values = [torch.randn(shape, generator=generator) * 3 for _, shape in SHAPES]
    for view, value in zip(tensor_views(buffer, manifest), values, strict=True):
        view.copy_(value)
    return manifest, buffer, values


def test_the_encoding_rounds_as_torch_and_the_decoding_is_exact() -> None:
    manifest, source, values = _fp32(0)
    narrow, narrow_bytes = push_layout(SHAPES, "bf16")
    # Garbage in the padding of a reused buffer must not reach the wire.
    encoded = bytearray(b"\xff" * narrow_bytes)
    recast(source, manifest, encoded, narrow)
    for view, value in zip(tensor_views(encoded, narrow), values, strict=True):
        assert view.dtype == torch.bfloat16 and torch.equal(view, value.to(torch.bfloat16))
    padding = set(range(narrow_bytes)) - {i for e in narrow for i in range(e.offset, e.offset + e.nbytes)}
    assert padding and all(encoded[i] == 0 for i in padding)
    decoded = bytearray(b"\xff" * len(source))
    recast(encoded, narrow, decoded, manifest)
    for view, value in zip(tensor_views(decoded, manifest), values, strict=True):
        assert torch.equal(view, value.to(torch.bfloat16).to(torch.float32))
    again = bytearray(len(source))
    recast(encoded, narrow, again, manifest)
    assert again == decoded  # equal values, equal bytes: the digests a learner logs agree
    with pytest.raises(ValueError, match="different tensors"):
        recast(source, manifest, encoded, push_layout(SHAPES[:2], "bf16")[0])


def _model() -> GlobalModel:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Linear(40, 7))
    specs = model_entries(module)
    plan = plan_fragments([(s.name, s.shape) for s in specs], 2)
    model = GlobalModel(plan, specs, chunk_bytes=CHUNK, embedding_pattern="-", update_precision="bf16")
    model.load(dict(module.named_parameters()))
    return model


def _push(model: GlobalModel, index: int) -> bytearray:
    store = model.fragments[index]
    buffer = bytearray(store.raw_bytes)
    for view in model.deltas(index, buffer):
        view.fill_(0.01)
    return buffer


def _expected(model: GlobalModel, index: int) -> bytearray:
    store = model.fragments[index]
    out = bytearray(store.update_bytes)
    for view, value in zip(tensor_views(out, store.update_manifest), store.params, strict=True):
        view.copy_(value.to(torch.bfloat16))
    return out


def test_a_merge_encodes_its_version_once_and_the_sends_give_it_back() -> None:
    model = _model()
    model.publish_all()
    store = model.fragments[0]
    assert store.update_bytes < 0.55 * store.raw_bytes
    assert [e.dtype for e in store.update_manifest] == ["bfloat16"] * len(store.manifest)
    assert [(e.name, e.shape) for e in store.update_manifest] == [(e.name, e.shape) for e in store.manifest]
    assert all(s.current is not None and s.current.encoding is None for s in model.fragments)
    snapshot = model.merge(0, [_push(model, 0)], [1.0], lr=0.7, mu=0.9, merge="rda", version=1)
    model.publish(0, snapshot)
    encoding = snapshot.encoding
    assert encoding is not None and bytes(encoding.buffer) == bytes(_expected(model, 0))
    assert encoding.checksums == chunk_checksums(encoding.buffer, CHUNK)
    idle = model.buffers.idle
    # Two sends share it; it stays while another learner waits, and goes when none does.
    first, second = model.acquire(0), model.acquire(0)
    assert first.encoding is second.encoding is encoding
    model.release(0, first, keep_encoding=False)  # the other send still reads it
    assert snapshot.encoding is encoding
    model.release(0, second, keep_encoding=True)
    assert snapshot.encoding is encoding
    third = model.acquire(0)
    model.release(0, third, keep_encoding=False)
    assert snapshot.encoding is None and model.buffers.idle == idle + 1
    # A heal encodes on demand (the worker's call); a second encoding made meanwhile goes back.
    heal = model.acquire(0)
    made, twin = model.encode(0, heal.buffer), model.encode(0, heal.buffer)
    assert bytes(made.buffer) == bytes(_expected(model, 0))
    assert model.attach_encoding(heal, made) is made and model.attach_encoding(heal, twin) is made
    # A newer version retires it: master and encoding go back once the last send is done.
    newer = model.merge(0, [_push(model, 0)], [1.0], lr=0.7, mu=0.9, merge="rda", version=2)
    model.publish(0, newer)
    idle = model.buffers.idle
    model.release(0, heal)
    assert heal.encoding is None and model.buffers.idle == idle + 2


def test_fp32_updates_make_no_encoding() -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 4)
    specs = model_entries(module)
    model = GlobalModel(
        plan_fragments([(s.name, s.shape) for s in specs], 1), specs, chunk_bytes=CHUNK, embedding_pattern="-"
    )
    model.load(dict(module.named_parameters()))
    model.publish_all()
    snapshot = model.merge(0, [_push(model, 0)], [1.0], lr=0.7, mu=0.9, merge="rda", version=1)
    store = model.fragments[0]
    assert snapshot.encoding is None
    assert (store.update_manifest, store.update_bytes) == (store.manifest, store.raw_bytes)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        GlobalModel(model.plan, specs, chunk_bytes=CHUNK, embedding_pattern="-", update_precision="int8")


def test_a_learner_accepts_the_plan_layout_at_the_stated_precision_fp32_or_bf16_only() -> None:
    layout, raw_bytes = fragment_manifest([(n, 0, s[0]) for n, s in SHAPES], dict(SHAPES))
    check_update(3, layout, "fp32", layout, raw_bytes)
    narrow, narrow_bytes = push_layout(SHAPES, "bf16")
    check_update(3, layout, "bf16", narrow, narrow_bytes)
    with pytest.raises(UpdateRefused, match="fragment 3 at int8: updates travel at fp32 or bf16"):
        check_update(3, layout, "int8", *push_layout(SHAPES, "int8"))
    for precision, manifest, size in (
        ("bf16", *push_layout(SHAPES[:2], "bf16")),
        ("fp32", *push_layout([(n, (s[0] + 1, *s[1:])) for n, s in SHAPES], "fp32")),
        ("bf16", narrow, narrow_bytes + 64),
        # The layout of the other precision: never taken for it, the header's word decides.
        ("fp32", narrow, narrow_bytes),
        ("bf16", layout, raw_bytes),
    ):
        with pytest.raises(UpdateRefused, match=f"fragment 3 is not the plan's layout at {precision}"):
            check_update(3, layout, precision, manifest, size)


def _link() -> tuple[Link, Bridge, Plan]:
    link, bridge, message = new_link()
    link._adopt_plan(message, Join(message.model))
    bridge.take()  # the plan
    return link, bridge, message


async def _received(link: Link, bridge: Bridge, header: UpdateHeader, fill: torch.Tensor) -> memoryview:
    buffer = link._update_buffer(header)
    assert len(buffer) == header.raw_bytes
    for view, value in zip(tensor_views(buffer, header.manifest), fill, strict=False):
        view.copy_(value)
    link._on_item(FragmentReceived(1, header, buffer))
    while link._decodes:
        await asyncio.wait(set(link._decodes))
    return buffer


def test_a_bf16_update_becomes_the_upcast_fp32_anchor_and_its_buffer_goes_back() -> None:
    async def scenario() -> None:
        link, bridge, _ = _link()
        layout = link._manifests[1]
        shapes = [(e.name, e.shape) for e in layout]
        narrow, narrow_bytes = push_layout(shapes, "bf16")
        values = [torch.randn(shape) for _, shape in shapes]
        header = UpdateHeader(narrow, narrow_bytes, "none", CHUNK, fragment=1, version=5, precision="bf16")
        received = await _received(link, bridge, header, values)
        (adopt,) = bridge.take().updates
        assert (adopt.fragment, adopt.version, adopt.heal) == (1, 5, True)
        assert len(adopt.buffer) == push_layout(shapes, "fp32")[1]
        for view, value in zip(tensor_views(adopt.buffer, layout), values, strict=True):
            assert view.dtype == torch.float32 and torch.equal(view, value.to(torch.bfloat16).float())
        # The bf16 buffer is free again, the anchor is held (by the training side).
        assert bridge.pool.holders(bridge.pool.id_of(received)) == 0
        assert bridge.pool.holders(bridge.pool.id_of(adopt.buffer)) == 1
        link._executor.shutdown()

    asyncio.run(scenario())


def test_an_update_off_the_plan_layout_is_refused_and_its_buffer_goes_back() -> None:
    async def scenario() -> None:
        link, bridge, _ = _link()
        shapes = [(e.name, e.shape) for e in link._manifests[0]]
        wrong, wrong_bytes = push_layout(shapes[:1], "bf16")
        header = UpdateHeader(wrong, wrong_bytes, "none", CHUNK, fragment=0, version=1, precision="bf16")
        with capture_logs() as logs:
            received = await _received(link, bridge, header, [])
        assert bridge.take().updates == []
        assert bridge.pool.holders(bridge.pool.id_of(received)) == 0
        (refused,) = [r for r in logs if r["event"] == "update refused"]
        assert "not the plan's layout at bf16" in refused["reason"]
        # A precision updates do not travel at is refused from the header, before any buffer is lent.
        coded, coded_bytes = push_layout(shapes, "int8")
        with (
            capture_logs() as logs,
            pytest.raises(Exception, match="at int8: updates travel at fp32 or bf16"),
        ):
            link._update_buffer(
                UpdateHeader(coded, coded_bytes, "none", CHUNK, fragment=0, version=1, precision="int8")
            )
        assert [r["event"] for r in logs] == ["update refused"]
        link._executor.shutdown()

    asyncio.run(scenario())
