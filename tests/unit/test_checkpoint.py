"""The syncer's checkpoint store: bit-exact round trips, retention, leftovers of interrupted saves,
damaged checkpoints (falling back to the previous one and saying why), validation on save and
load, and the model export. Files are damaged by hand the way disks and people damage them.

Runs in-process on tmp_path; tests/integration/test_checkpoint_files.py covers a real crash and
reading the files without dilocod.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file

from dilocod.syncer import checkpoint
from dilocod.syncer.checkpoint import (
    CHECKPOINTS_DIR,
    MODEL_FILE,
    MOMENTUM_FILE,
    STATE_FILE,
    CheckpointError,
    DamagedCheckpointsError,
    FragmentedModel,
    Lent,
    NoCheckpointError,
    SyncerState,
    TensorPiece,
    export_model,
    load_latest_checkpoint,
    save_checkpoint,
    save_fragments,
)


def make_state(seed: int = 0, versions: list[int] | None = None) -> SyncerState:
    """A small model with every awkward case: bf16 and f16 params, special float values, a
    transposed (non-contiguous) param, two params sharing one storage, a scalar, an empty tensor,
    and names in an order that is not sorted."""
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40, 3.0])
    tied = torch.randn(6, 4, generator=g)
    params = {
        "layers.1.attn.weight": torch.randn(8, 5, generator=g).to(torch.bfloat16),
        "layers.0.attn.weight": torch.cat([special, torch.randn(10, generator=g)]).to(torch.bfloat16),
        "embed.weight": torch.cat([special, torch.randn(30, generator=g)]),
        "head.weight": torch.randn(4, 7, generator=g).t(),  # non-contiguous
        "tied.a": tied[:3],  # shares memory with tied.b
        "tied.b": tied[3:],  # shares memory with tied.a, storage offset > 0
        "norm.scale": torch.randn(9, generator=g).to(torch.float16),
        "step.scale": torch.tensor(0.5 + seed),
        "empty": torch.empty(0, 3),
    }
    momentum = {name: torch.randn(p.shape, generator=g) for name, p in reversed(params.items())}
    meta = {"rounds_merged": 10 + seed, "roster": ["learner-1", "learner-2"], "incarnation": f"inc-{seed}"}
    return SyncerState(params, momentum, versions if versions is not None else [seed, 2 * seed, 0], meta)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal bits means equal, NaN and -0.0 included."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(bits(got[name]), bits(tensor)), name


def assert_same_state(got: SyncerState, want: SyncerState) -> None:
    assert_same_tensors(got.params, want.params)
    assert_same_tensors(got.momentum, {name: want.momentum[name] for name in want.params})
    assert got.versions == want.versions
    assert got.meta == want.meta


def checkpoint_names(state_dir: Path) -> list[str]:
    return sorted(p.name for p in (state_dir / CHECKPOINTS_DIR).iterdir())


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 3)


def flip_bit(path: Path) -> None:
    """Flip one bit in the last byte (tensor data), keeping the size."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10
    path.write_bytes(bytes(data))


def rerecord(checkpoint: Path, edit: Callable[[dict], None] = lambda doc: None) -> None:
    """Edit state.json and record the tensor files' current sizes and digests, so that the
    checkpoint passes the integrity check and only the content checks can reject it."""
    doc = json.loads((checkpoint / STATE_FILE).read_text())
    edit(doc)
    for name in (MODEL_FILE, MOMENTUM_FILE):
        data = (checkpoint / name).read_bytes()
        doc["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / STATE_FILE).write_text(json.dumps(doc))


# --- round trip and layout ----------------------------------------------------------------------


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    state = make_state(1)
    path = save_checkpoint(tmp_path, state)
    assert path == tmp_path / CHECKPOINTS_DIR / "ckpt-000000000001"
    assert sorted(p.name for p in path.iterdir()) == [MODEL_FILE, MOMENTUM_FILE, STATE_FILE]

    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    assert (loaded.path, loaded.sequence, loaded.skipped) == (path, 1, ())
    assert_same_state(loaded.state, state)
    assert loaded.state.params["layers.1.attn.weight"].dtype == torch.bfloat16
    doc = json.loads((path / STATE_FILE).read_text())
    assert loaded.saved_at_unix_s == doc["saved_at_unix_s"] > 0
    # Saving copied nothing into the caller's tensors: the view is still a view.
    assert not state.params["head.weight"].is_contiguous()


def test_loaded_tensors_are_independent_of_the_files(tmp_path: Path) -> None:
    """The daemon updates the loaded model in place; that must not touch the checkpoint."""
    state = make_state(2)
    save_checkpoint(tmp_path, state)
    first = load_latest_checkpoint(tmp_path)
    assert first is not None
    for tensor in [*first.state.params.values(), *first.state.momentum.values()]:
        tensor.add_(1)
    again = load_latest_checkpoint(tmp_path)
    assert again is not None and again.skipped == ()
    assert_same_state(again.state, state)


def test_tensor_files_are_what_safetensors_itself_writes(tmp_path: Path) -> None:
    """Byte for byte the file safetensors' own serializer makes from the same tensors."""
    spec = getattr(safetensors, "TensorSpec", None)
    if spec is None:
        pytest.skip("this safetensors has no pointer-based serialize to compare with")
    state = make_state(3)
    path = save_checkpoint(tmp_path, state)
    packed = {name: p.contiguous() for name, p in state.params.items()}
    specs = {
        name: spec(
            dtype=str(t.dtype).removeprefix("torch."),
            shape=list(t.shape),
            data_ptr=t.data_ptr(),
            data_len=t.numel() * t.element_size(),
        )
        for name, t in packed.items()
    }
    expected = bytes(safetensors.serialize(specs, metadata={"format": "pt"}))
    assert (path / MODEL_FILE).read_bytes() == expected


def float32_model(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"b.weight": (6, 3), "a.weight": (5,), "c.scale": (), "d.empty": (0, 4), "e.rows": (7, 2)}
    params = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    momentum = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    return params, momentum


def row_split_fragments(
    params: dict[str, torch.Tensor],
) -> tuple[FragmentedModel, list[tuple[bytearray, bytearray]]]:
    """Three fragments, two tensors split across two of them as row ranges (the pieces a fragment
    plan that slices large tensors makes), each fragment packed back to back in its own buffers
    (with a gap, as manifests align): the fragments' buffers, and their bytes."""
    layout = [
        [("b.weight", 0, 4), ("a.weight", 0, 5)],
        [("b.weight", 4, 6), ("e.rows", 0, 3), ("c.scale", 0, 1)],
        [("e.rows", 3, 7), ("d.empty", 0, 0)],
    ]
    pieces, sizes = [], []
    for fragment in layout:
        offset, made = 0, []
        for name, start, stop in fragment:
            shape = params[name].shape
            row_bytes = math.prod(shape[1:]) * 4 if shape else 4
            made.append(TensorPiece(name, start * row_bytes, offset, (stop - start) * row_bytes))
            offset += (stop - start) * row_bytes + 12  # a gap, never written to the file
        pieces.append(tuple(made))
        sizes.append(offset)
    model = FragmentedModel({name: tuple(t.shape) for name, t in params.items()}, tuple(sizes), tuple(pieces))
    return model, [(bytearray(size), bytearray(size)) for size in sizes]


def fill(
    buffers: tuple[bytearray, bytearray],
    pieces: tuple[TensorPiece, ...],
    tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    for buffer, source in zip(buffers, tensors, strict=True):
        for piece in pieces:
            flat = source[piece.name].reshape(-1).view(torch.uint8)
            buffer[piece.source_offset : piece.source_offset + piece.nbytes] = bytes(
                flat[piece.tensor_offset : piece.tensor_offset + piece.nbytes]
            )


def test_fragment_by_fragment_writes_the_same_files_as_a_whole_state(tmp_path: Path) -> None:
    """Row pieces written at their offsets, fragment by fragment, make byte for byte the files of
    save_checkpoint of the whole tensors, with each fragment's version as it was lent."""
    params, momentum = float32_model(1)
    model, buffers = row_split_fragments(params)
    for buffers_p, pieces in zip(buffers, model.pieces, strict=True):
        fill(buffers_p, pieces, (params, momentum))
    lent: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def lend(index: int) -> Iterator[Lent]:
        lent.append(("lent", index))
        yield Lent(memoryview(buffers[index][0]), memoryview(buffers[index][1]), 10 + index)
        lent.append(("back", index))

    meta = {"next_round": 4}
    split = save_fragments(tmp_path / "split", model, lend, meta)
    whole = save_checkpoint(tmp_path / "whole", SyncerState(params, momentum, [10, 11, 12], meta))
    assert lent == [(event, i) for i in range(3) for event in ("lent", "back")]  # one at a time
    for name in (MODEL_FILE, MOMENTUM_FILE):
        assert (split / name).read_bytes() == (whole / name).read_bytes()
    loaded = load_latest_checkpoint(tmp_path / "split")
    assert loaded is not None
    assert_same_state(loaded.state, SyncerState(params, momentum, [10, 11, 12], meta))


def _shifted(p: tuple) -> tuple:
    return (p[0], (p[1][0]._replace(tensor_offset=p[1][0].tensor_offset + 4), *p[1][1:]), *p[2:])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_shifted, "cover"),  # a gap and an overlap
        (lambda p: (p[0] + p[1][:1], *p[1:]), "cover"),  # a piece twice
        (lambda p: (p[0][:1], *p[1:]), "cover"),  # a tensor missing
        (lambda p: ((p[0][0]._replace(source_offset=10**6), *p[0][1:]), *p[1:]), "outside"),
        (lambda p: ((p[0][0]._replace(name="nope"), *p[0][1:]), *p[1:]), "not in the model"),
    ],
)
def test_pieces_that_do_not_cover_every_byte_once_are_refused_before_anything_is_written(
    tmp_path: Path, edit: Callable, message: str
) -> None:
    params, _ = float32_model(2)
    model, _ = row_split_fragments(params)
    bad = FragmentedModel(model.shapes, model.fragment_bytes, edit(model.pieces))
    with pytest.raises(ValueError, match=message):
        save_fragments(tmp_path, bad, lambda *_: pytest.fail("lent"), {})
    assert not (tmp_path / CHECKPOINTS_DIR).exists()


@pytest.mark.parametrize(
    ("fault", "error", "message"),
    [
        ("raises", RuntimeError, "the model is gone"),
        ("wrong size", ValueError, "bytes; it has"),
        ("bad version", ValueError, "at the version -1"),
    ],
)
def test_a_failing_lend_leaves_no_trace(tmp_path: Path, fault: str, error: type, message: str) -> None:
    params, momentum = float32_model(3)
    model, buffers = row_split_fragments(params)
    first = save_checkpoint(tmp_path, SyncerState(params, momentum, [0, 0, 0], {}))

    @contextlib.contextmanager
    def lend(index: int) -> Iterator[Lent]:
        held = [memoryview(b) for b in buffers[index]]
        if index == 2 and fault == "raises":
            raise RuntimeError("the model is gone")
        if index == 2 and fault == "wrong size":
            held[1] = held[1][:-4]
        yield Lent(held[0], held[1], -1 if index == 2 and fault == "bad version" else 1)

    with pytest.raises(error, match=message):
        save_fragments(tmp_path, model, lend, {})
    assert checkpoint_names(tmp_path) == [first.name]


# --- retention and leftovers -------------------------------------------------------------------


@pytest.mark.parametrize(("keep", "saves"), [(3, 5), (1, 3), (3, 2)])
def test_keeps_exactly_the_newest(tmp_path: Path, keep: int, saves: int) -> None:
    for i in range(1, saves + 1):
        save_checkpoint(tmp_path, make_state(0, versions=[i]), keep=keep)
    kept = range(max(1, saves - keep + 1), saves + 1)
    assert checkpoint_names(tmp_path) == [f"ckpt-{i:012d}" for i in kept]
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    assert (loaded.sequence, loaded.state.versions) == (saves, [saves])


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, make_state(), keep=0)
    assert not (tmp_path / CHECKPOINTS_DIR).exists()


def test_leftover_temporary_directories_are_ignored_then_cleaned(tmp_path: Path) -> None:
    first = save_checkpoint(tmp_path, make_state(0, versions=[1]))
    root = tmp_path / CHECKPOINTS_DIR
    # A save that crashed after writing everything but before the rename: content complete and
    # consistent, sequence higher, but it never got its final name, so it must not be loaded.
    crashed = root / ".tmp-ckpt-000000000009-0badf00d"
    shutil.copytree(first, crashed)
    rerecord(crashed, lambda doc: doc.update(sequence=9, versions=[99]))
    # One that crashed early: a partial model file and nothing else.
    early = root / ".tmp-ckpt-000000000002-deadbeef"
    early.mkdir()
    (early / MODEL_FILE).write_bytes((first / MODEL_FILE).read_bytes()[:100])

    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    assert (loaded.path, loaded.state.versions, loaded.skipped) == (first, [1], ())

    second = save_checkpoint(tmp_path, make_state(0, versions=[2]))
    assert second.name == "ckpt-000000000002"
    assert checkpoint_names(tmp_path) == ["ckpt-000000000001", "ckpt-000000000002"]


def test_a_failed_save_leaves_no_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = save_checkpoint(tmp_path, make_state(0, versions=[1]))
    real_fsync = os.fsync
    calls = []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the model file is written, the momentum file is being synced
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(tmp_path, make_state(0, versions=[2]))
    monkeypatch.undo()
    assert len(calls) == 2
    assert checkpoint_names(tmp_path) == [first.name]
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.state.versions == [1]


# --- damage -----------------------------------------------------------------------------------


@pytest.mark.parametrize("file_name", [MODEL_FILE, MOMENTUM_FILE])
@pytest.mark.parametrize(("damage", "reason"), [(truncate, "bytes"), (flip_bit, "sha256")])
def test_damaged_newest_falls_back_to_previous(
    tmp_path: Path, file_name: str, damage: Callable[[Path], None], reason: str
) -> None:
    previous_state = make_state(1, versions=[1])
    previous = save_checkpoint(tmp_path, previous_state)
    newest = save_checkpoint(tmp_path, make_state(2, versions=[2]))
    damage(newest / file_name)

    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    assert loaded.path == previous
    assert_same_state(loaded.state, previous_state)
    [skipped] = loaded.skipped
    assert skipped.path == newest
    assert file_name in skipped.reason and reason in skipped.reason


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: (p / STATE_FILE).unlink(), "missing"),
        (lambda p: (p / STATE_FILE).write_bytes(b'{"format": "dilocod-syn'), "does not parse"),
        (lambda p: (p / STATE_FILE).write_bytes(b"\xff\xfe"), "does not parse"),
        (lambda p: (p / STATE_FILE).write_text("[]"), "not a"),
        (lambda p: (p / MODEL_FILE).unlink(), MODEL_FILE),
    ],
)
def test_incomplete_newest_falls_back_to_previous(
    tmp_path: Path, damage: Callable[[Path], None], reason: str
) -> None:
    previous = save_checkpoint(tmp_path, make_state(1, versions=[1]))
    newest = save_checkpoint(tmp_path, make_state(2, versions=[2]))
    damage(newest)
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    assert (loaded.path, loaded.state.versions) == (previous, [1])
    assert [s.path for s in loaded.skipped] == [newest]
    assert reason in loaded.skipped[0].reason


def _other_momentum_keys(checkpoint: Path, tmp_path: Path) -> None:
    other = make_state(0)
    other.momentum["stray"] = torch.zeros(1)
    other.params["stray"] = torch.zeros(1)
    donor = save_checkpoint(tmp_path / "donor", other)
    shutil.copyfile(donor / MOMENTUM_FILE, checkpoint / MOMENTUM_FILE)
    rerecord(checkpoint)


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (_other_momentum_keys, "stray"),
        (lambda c, _: rerecord(c, lambda d: d.update(versions=[3, -1])), "non-negative"),
        (lambda c, _: rerecord(c, lambda d: d.update(versions=[True])), "non-negative"),
        (lambda c, _: rerecord(c, lambda d: d.update(versions=[1.5])), "non-negative"),
        (lambda c, _: rerecord(c, lambda d: d.update(versions="7")), "list"),
        (lambda c, _: rerecord(c, lambda d: d["param_names"].pop()), "other tensors"),
        (lambda c, _: rerecord(c, lambda d: d.update(sequence=7)), "sequence"),
        (lambda c, _: rerecord(c, lambda d: d.update(format_version=99)), "format_version"),
        (lambda c, _: rerecord(c, lambda d: d.update(meta=None)), "meta"),
    ],
)
def test_consistent_but_invalid_content_is_rejected(
    tmp_path: Path, edit: Callable[[Path, Path], None], reason: str
) -> None:
    """Sizes and digests match, so only the content checks stand between it and the daemon."""
    state_dir = tmp_path / "state"
    previous = save_checkpoint(state_dir, make_state(1, versions=[1]))
    newest = save_checkpoint(state_dir, make_state(2, versions=[2]))
    edit(newest, tmp_path)
    loaded = load_latest_checkpoint(state_dir)
    assert loaded is not None
    assert (loaded.path, loaded.state.versions) == (previous, [1])
    assert [s.path for s in loaded.skipped] == [newest]
    assert reason in loaded.skipped[0].reason


def test_only_damaged_checkpoints_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    newest = save_checkpoint(tmp_path, make_state(1))
    flip_bit(newest / MODEL_FILE)
    with pytest.raises(DamagedCheckpointsError, match=str(tmp_path)) as raised:
        load_latest_checkpoint(tmp_path)
    assert [s.path for s in raised.value.skipped] == [newest]
    assert "sha256" in str(raised.value)


def test_no_checkpoint_is_none(tmp_path: Path) -> None:
    assert load_latest_checkpoint(tmp_path / "never-created") is None
    (tmp_path / CHECKPOINTS_DIR).mkdir()
    (tmp_path / CHECKPOINTS_DIR / "README").write_text("not a checkpoint\n")
    assert load_latest_checkpoint(tmp_path) is None


def _in_place_of(path: Path, kind: str) -> None:
    """Put a FIFO or a directory where a checkpoint's file was (what a disk or a person can do)."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()


# A plain open of a FIFO waits for a writer: without the non-blocking open these tests hang, and
# the timeout turns that into a failure.
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("file_name", [STATE_FILE, MODEL_FILE, MOMENTUM_FILE])
def test_a_file_that_is_not_a_regular_file_is_damage_and_never_blocks(
    tmp_path: Path, file_name: str, kind: str
) -> None:
    previous = save_checkpoint(tmp_path, make_state(1, versions=[1]))
    newest = save_checkpoint(tmp_path, make_state(2, versions=[2]))
    _in_place_of(newest / file_name, kind)
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and (loaded.path, loaded.state.versions) == (previous, [1])
    [skipped] = loaded.skipped
    assert f"{file_name} is a {'FIFO' if kind == 'fifo' else 'directory'}, not a file" in skipped.reason
    if file_name != MOMENTUM_FILE:  # the export reads state.json and the model file
        export_model(tmp_path, tmp_path / "out.safetensors")
        assert set(load_file(str(tmp_path / "out.safetensors"))) == set(make_state(1).params)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        # json.loads raises RecursionError, not a JSONDecodeError, on deep nesting.
        (b"[" * 1_000_000, "does not parse: RecursionError"),
        (b'{"a": ' * 200_000 + b"1" + b"}" * 200_000, "does not parse: RecursionError"),
        (b"\x00" * 100, "does not parse"),
    ],
)
def test_any_state_json_that_does_not_parse_is_damage(tmp_path: Path, content: bytes, reason: str) -> None:
    previous = save_checkpoint(tmp_path, make_state(1, versions=[1]))
    newest = save_checkpoint(tmp_path, make_state(2, versions=[2]))
    (newest / STATE_FILE).write_bytes(content)
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and (loaded.path, loaded.state.versions) == (previous, [1])
    assert reason in loaded.skipped[0].reason
    # Pruning reads state.json too: the damaged one goes, the good one stays.
    save_checkpoint(tmp_path, make_state(3, versions=[3]), keep=2)
    assert checkpoint_names(tmp_path) == [previous.name, "ckpt-000000000003"]


def test_a_state_json_over_the_bound_is_damage_and_never_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    previous = save_checkpoint(tmp_path, make_state(1, versions=[1]))
    newest = save_checkpoint(tmp_path, make_state(2, versions=[2]))
    bound = (previous / STATE_FILE).stat().st_size + 100
    monkeypatch.setattr(checkpoint, "MAX_STATE_FILE_BYTES", bound)
    (newest / STATE_FILE).write_bytes(b" " * (bound + 1))
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.path == previous
    assert f"larger than {bound} bytes" in loaded.skipped[0].reason
    # A save whose state.json would be over the bound writes nothing (a load would refuse it).
    big = make_state(3, versions=[3])
    big.meta["roster"] = ["learner"] * 100
    with pytest.raises(CheckpointError, match=f"more than the {bound}"):
        save_checkpoint(tmp_path, big)
    assert checkpoint_names(tmp_path) == [previous.name, newest.name]


def test_a_checkpoints_path_that_is_not_a_directory_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    (tmp_path / CHECKPOINTS_DIR).write_text("")
    with pytest.raises(CheckpointError, match=f"cannot list {tmp_path / CHECKPOINTS_DIR}: Not a directory"):
        load_latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="Not a directory"):
        save_checkpoint(tmp_path, make_state(1))


# --- validation on save ------------------------------------------------------------------------


def _drop_momentum(s: SyncerState) -> None:
    del s.momentum["embed.weight"]


def _bf16_momentum(s: SyncerState) -> None:
    s.momentum["embed.weight"] = s.momentum["embed.weight"].to(torch.bfloat16)


def _reshaped_momentum(s: SyncerState) -> None:
    s.momentum["norm.scale"] = torch.zeros(3, 3)


def _complex_param(s: SyncerState) -> None:
    s.params["empty"] = torch.zeros(2, dtype=torch.complex64)
    s.momentum["empty"] = torch.zeros(2)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_drop_momentum, "same names"),
        (_bf16_momentum, "float32"),
        (_reshaped_momentum, "shape"),
        (_complex_param, "dtype"),
        (lambda s: setattr(s, "versions", [0, -1]), "non-negative"),
        (lambda s: setattr(s, "versions", [0, True]), "non-negative"),
        (lambda s: s.meta.update(bad={1, 2}), "JSON"),
        (lambda s: s.meta.update(bad=float("nan")), "JSON"),
    ],
)
def test_save_rejects_an_inconsistent_state_and_writes_nothing(
    tmp_path: Path, mutate: Callable[[SyncerState], None], match: str
) -> None:
    save_checkpoint(tmp_path, make_state(0))
    state = make_state(1)
    mutate(state)
    with pytest.raises(ValueError, match=match):
        save_checkpoint(tmp_path, state)
    assert checkpoint_names(tmp_path) == ["ckpt-000000000001"]


# --- export -----------------------------------------------------------------------------------


def test_export_writes_the_newest_model_keyed_by_name(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "state", make_state(1))
    newest = make_state(2)
    save_checkpoint(tmp_path / "state", newest)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    out.write_bytes(b"an older export")

    assert export_model(tmp_path / "state", out) == out
    exported = load_file(str(out))
    assert set(exported) == set(newest.params)
    assert_same_tensors({name: exported[name] for name in newest.params}, newest.params)
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]  # no temporary left


def test_export_passes_over_a_damaged_newest(tmp_path: Path) -> None:
    previous = make_state(1)
    save_checkpoint(tmp_path, previous)
    flip_bit(save_checkpoint(tmp_path, make_state(2)) / MODEL_FILE)
    out = tmp_path / "model.safetensors"
    export_model(tmp_path, out)
    exported = load_file(str(out))
    assert_same_tensors({name: exported[name] for name in previous.params}, previous.params)


def test_export_with_only_damaged_checkpoints_fails_and_writes_nothing(tmp_path: Path) -> None:
    truncate(save_checkpoint(tmp_path / "state", make_state(1)) / MODEL_FILE)
    with pytest.raises(DamagedCheckpointsError, match="bytes"):
        export_model(tmp_path / "state", tmp_path / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


@pytest.mark.parametrize("make_root", [False, True])
def test_export_without_checkpoint_says_where_it_looked(tmp_path: Path, make_root: bool) -> None:
    state_dir = tmp_path / "state"
    if make_root:
        (state_dir / CHECKPOINTS_DIR).mkdir(parents=True)
    with pytest.raises(NoCheckpointError, match=f"no checkpoint in {state_dir / CHECKPOINTS_DIR}"):
        export_model(state_dir, tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()
