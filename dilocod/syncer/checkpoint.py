"""The syncer's checkpoint store and the model export (docs/design.md §3.5).

Owns the on-disk layout under a state directory:

    STATE_DIR/checkpoints/
        ckpt-000000000042/         one complete checkpoint; the number is its sequence
            model.safetensors      the global model Θ, keyed by parameter name
            momentum.safetensors   the outer Nesterov buffers b, keyed by parameter name, float32
            state.json             written last: versions, meta, parameter order, sequence, time,
                                   and the size and SHA-256 of both tensor files
        .tmp-ckpt-000000000043-…   a checkpoint being written (or left by a crash); never loaded

A checkpoint is written into a temporary directory, every file fsync'd, the directory fsync'd,
renamed to its final name and the parent fsync'd, so a directory with a final name is complete
unless something outside dilocod damaged it; loading checks every recorded size and digest anyway
and falls back to the previous checkpoint. Whatever is wrong with a checkpoint's files makes it
damaged, never a crash or a hang: a state.json that does not parse (deep nesting included) or is
larger than MAX_STATE_FILE_BYTES, a FIFO or a directory in a file's place (files are opened without
blocking and read only if they are regular files). The files need no dilocod to read: safetensors
plus JSON.

Tensor files are written here in the documented safetensors format (8-byte little-endian header
length, JSON header padded to 8 bytes, tensors packed back to back). The layout follows from the
names, dtypes and shapes alone, so both files are sized up front and filled piece by piece with
pwrite at computed offsets: a piece is a byte range of one tensor (a whole tensor, or the rows of
it that one fragment holds). Once every piece is in, the files are fsync'd and then hashed (read
back, both at once). They are read only through safetensors, never through pickle.

The syncer writes fragment by fragment (`save_fragments`): a caller-given `lend` lends one
fragment's Θ_p and b_p and says which version they are, bytes that nothing writes until the lend
ends (the syncer's merges commit new buffers and keep retired ones out of the pool while lent), and
the disk writes happen from them while merges go on, with no copy. So each fragment's Θ_p, b_p and
recorded version agree, and different fragments may be at versions of different moments (as they are at any
moment anyway: fragments merge independently). `save_checkpoint` writes a SyncerState whose
tensors do not change while it runs, each tensor as one piece straight from its memory.

Plain blocking file I/O; the daemon runs it in a worker thread. Must not import networking or
logging: skipped checkpoints are returned to the caller, who logs them.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from dilocod.ops.priority import lower_this_thread
from dilocod.ops.statedir import fsync_dir, open_regular, read_regular

CHECKPOINTS_DIR = "checkpoints"
MODEL_FILE = "model.safetensors"
MOMENTUM_FILE = "momentum.safetensors"
STATE_FILE = "state.json"
FORMAT = "dilocod-syncer-checkpoint"
FORMAT_VERSION = 1
DEFAULT_KEEP = 3

_NAME_PREFIX = "ckpt-"
_NAME_RE = re.compile(r"ckpt-(\d{12,})")
_TEMP_PREFIX = ".tmp-"
#: The most bytes of a state.json that loading reads: far above what a model's parameter names and
#: a large roster take (about 100 bytes a parameter, 300 a learner), and a save never writes more,
#: so a larger file is damage and is passed over unread.
MAX_STATE_FILE_BYTES = 64 * 1024 * 1024
#: Read buffer for hashing while exporting: large enough that syscalls do not dominate.
_COPY_CHUNK_BYTES = 8 * 1024 * 1024
_WRITE_SLICE_BYTES = 64 * 1024 * 1024
#: A safetensors file starts with its header's length as a little-endian u64.
_HEADER_LENGTH = struct.Struct("<Q")
#: Where tensor data starts relative to the header end; safetensors pads its header the same way.
_HEADER_ALIGNMENT = 8

#: torch dtype -> safetensors dtype, in the order of safetensors' own Dtype enum: its writer lays
#: tensors out by that order descending, then by name; doing the same gives byte-identical files,
#: and every tensor starts aligned to its element size.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
}
_DTYPE_RANKS = {dtype: rank for rank, dtype in enumerate(_DTYPE_NAMES)}


@dataclass
class SyncerState:
    """What a checkpoint holds. params and momentum have the same names and shapes; the order of
    params is kept across a save and load (other code may rely on named_parameters order)."""

    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    versions: list[int]
    meta: dict[str, Any]


class TensorPiece(NamedTuple):
    """Bytes [tensor_offset, tensor_offset + nbytes) of the tensor `name`'s data (C order: a range of
    rows along dim 0 is one such range), found at source_offset in a fragment's buffer."""

    name: str
    tensor_offset: int
    source_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Lent:
    """One fragment's Θ and b bytes (its buffer layout, the one its pieces' source_offset refer to)
    and the version they hold, unchanged while lent."""

    params: memoryview
    momentum: memoryview
    version: int


#: lend(fragment): a context holding the fragment's bytes as one version while it is open. Entered
#: once per fragment, in order, each exited before the next.
Lend = Callable[[int], AbstractContextManager[Lent]]


@dataclass(frozen=True, slots=True)
class FragmentedModel:
    """What `save_fragments` needs to know up front: every tensor's shape (Θ and b both float32,
    in this order: the param_names of state.json), and per fragment its size in bytes and pieces."""

    shapes: dict[str, tuple[int, ...]]
    fragment_bytes: tuple[int, ...]
    pieces: tuple[tuple[TensorPiece, ...], ...]


@dataclass(frozen=True, slots=True)
class SkippedCheckpoint:
    """A checkpoint directory that was not used, and why (for the daemon to log)."""

    path: Path
    reason: str


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    state: SyncerState
    path: Path
    sequence: int
    saved_at_unix_s: float
    #: Newer checkpoints that were damaged, newest first.
    skipped: tuple[SkippedCheckpoint, ...]


class CheckpointError(Exception):
    """Base of the errors this module raises about the store itself."""


class NoCheckpointError(CheckpointError):
    """The state directory holds no checkpoint at all."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(f"no checkpoint in {state_dir / CHECKPOINTS_DIR}")
        self.state_dir = state_dir


class DamagedCheckpointsError(CheckpointError):
    """Checkpoints exist but every one is damaged. Starting afresh would silently throw away
    training and reset versions, so the caller has to decide that explicitly."""

    def __init__(self, state_dir: Path, skipped: tuple[SkippedCheckpoint, ...]) -> None:
        reasons = "; ".join(f"{s.path.name}: {s.reason}" for s in skipped)
        super().__init__(f"no usable checkpoint in {state_dir / CHECKPOINTS_DIR} ({reasons})")
        self.state_dir = state_dir
        self.skipped = skipped


class CheckpointPruneError(CheckpointError):
    """The new checkpoint is saved and durable, but removing old ones failed (disk will fill)."""

    def __init__(self, saved: Path, cause: OSError) -> None:
        super().__init__(f"checkpoint saved to {saved}, but removing old checkpoints failed: {cause}")
        self.saved = saved


class _Damaged(Exception):
    """Internal: one checkpoint directory is unusable; the message is the reason."""


# --- saving -----------------------------------------------------------------------------------


def save_checkpoint(state_dir: Path, state: SyncerState, *, keep: int = DEFAULT_KEEP) -> Path:
    """Write state as a new checkpoint and return its directory; keep the newest `keep` complete
    checkpoints and delete older ones and leftovers of interrupted saves.

    The tensors must not change while this runs (pass snapshots, or hold the training thread).
    Raises ValueError for an inconsistent state (nothing is written), OSError when writing fails
    (nothing that looks complete is left), CheckpointPruneError when only the clean-up failed.
    """
    _check_keep(keep)
    _check_state(state)
    meta_json = _meta_json(state.meta)
    model = _FileLayout.of({n: (t.dtype, tuple(t.shape)) for n, t in state.params.items()})
    momentum = _FileLayout.of({n: (t.dtype, tuple(t.shape)) for n, t in state.momentum.items()})

    def write(model_fd: int, momentum_fd: int) -> list[int]:
        for layout, fd, tensors in ((model, model_fd, state.params), (momentum, momentum_fd, state.momentum)):
            for name, tensor in tensors.items():
                # A tensor that is not a contiguous CPU tensor is copied alone just before it is
                # written, so at most one tensor's copy exists at a time.
                packed = tensor.detach().to("cpu").contiguous()
                if packed.numel() * packed.element_size() != layout.sizes[name]:
                    raise CheckpointError(f"{name!r}: the tensors changed while they were being saved")
                if packed.numel():
                    _pwrite_all(fd, _bytes_of(packed), layout.data_start + layout.offsets[name])
                del packed
        return list(state.versions)

    return _save(state_dir, list(state.params), model, momentum, write, meta_json, keep)


def save_fragments(
    state_dir: Path,
    model: FragmentedModel,
    lend: Lend,
    meta: dict[str, Any],
    *,
    keep: int = DEFAULT_KEEP,
) -> Path:
    """Write a checkpoint of a model held as fragments, one fragment at a time (see the module
    docstring): while lend(p) holds fragment p, its pieces are written at their offsets in both
    files; versions[p] is the version it was lent at. Same files, same guarantees and the same
    errors as save_checkpoint; no memory of its own beyond the page cache.
    """
    _check_keep(keep)
    _check_fragmented(model)
    meta_json = _meta_json(meta)
    layout = _FileLayout.of({name: (torch.float32, shape) for name, shape in model.shapes.items()})

    def write(model_fd: int, momentum_fd: int) -> list[int]:
        versions = []
        for index, (size, pieces) in enumerate(zip(model.fragment_bytes, model.pieces, strict=True)):
            with lend(index) as lent:
                if type(lent.version) is not int or lent.version < 0:
                    raise ValueError(f"fragment {index} was lent at the version {lent.version!r}")
                if lent.params.nbytes != size or lent.momentum.nbytes != size:
                    raise ValueError(
                        f"fragment {index} was lent as {lent.params.nbytes} and {lent.momentum.nbytes} "
                        f"bytes; it has {size}"
                    )
                versions.append(lent.version)
                params, momentum = lent.params.cast("B"), lent.momentum.cast("B")
                for piece in pieces:
                    at = layout.data_start + layout.offsets[piece.name] + piece.tensor_offset
                    source = slice(piece.source_offset, piece.source_offset + piece.nbytes)
                    _pwrite_all(model_fd, params[source], at)
                    _pwrite_all(momentum_fd, momentum[source], at)
        return versions

    return _save(state_dir, list(model.shapes), layout, layout, write, meta_json, keep)


def _save(
    state_dir: Path,
    names: list[str],
    model: _FileLayout,
    momentum: _FileLayout,
    write: Callable[[int, int], list[int]],
    meta_json: str,
    keep: int,
) -> Path:
    """The steps every save shares: a temporary directory, both tensor files sized and headed,
    write() to fill them (returning the versions), fsync, digests, state.json, rename, prune."""
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; this host is big-endian")
    root = Path(state_dir) / CHECKPOINTS_DIR
    _make_dirs(root)
    sequence = max((seq for seq, _ in _final_dirs(root)), default=0) + 1
    name = f"{_NAME_PREFIX}{sequence:012d}"
    temp = root / f"{_TEMP_PREFIX}{name}-{secrets.token_hex(4)}"
    final = root / name
    temp.mkdir()
    try:
        model_fd = _create_tensor_file(temp / MODEL_FILE, model)
        try:
            momentum_fd = _create_tensor_file(temp / MOMENTUM_FILE, momentum)
            try:
                versions = write(model_fd, momentum_fd)
                _check_versions(versions)
                for fd in (model_fd, momentum_fd):
                    os.fsync(fd)
            finally:
                os.close(momentum_fd)
        finally:
            os.close(model_fd)
        # Below the event loop's priority, like the thread that calls this (ops/priority.py).
        with ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="dilocod-digest", initializer=lower_this_thread
        ) as pool:
            model_record, momentum_record = pool.map(_file_record, (temp / MODEL_FILE, temp / MOMENTUM_FILE))
        document = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "sequence": sequence,
            "saved_at_unix_s": time.time(),
            "param_names": names,
            "versions": versions,
            "meta": json.loads(meta_json),
            "files": {MODEL_FILE: model_record, MOMENTUM_FILE: momentum_record},
        }
        encoded = (json.dumps(document, indent=1, allow_nan=False) + "\n").encode()
        if len(encoded) > MAX_STATE_FILE_BYTES:
            # Loading would pass it over as damaged: never write a checkpoint that cannot load.
            raise CheckpointError(
                f"{STATE_FILE} would be {len(encoded)} bytes, more than the {MAX_STATE_FILE_BYTES} "
                "a load reads (too many parameter names or learners in the roster)"
            )
        _write_bytes(temp / STATE_FILE, encoded)
        fsync_dir(temp)
        # The directory is complete and durable before it gets a name that loading considers.
        temp.rename(final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    try:
        prune_checkpoints(state_dir, keep=keep)
    except OSError as exc:
        raise CheckpointPruneError(final, exc) from exc
    return final


def prune_checkpoints(state_dir: Path, *, keep: int = DEFAULT_KEEP) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, damaged ones outside those, and
    temporary directories; return what was deleted. Only one process may write a state dir."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    root = Path(state_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    kept = 0
    doomed: list[Path] = []
    for sequence, path in _final_dirs(root):
        if kept < keep and _looks_complete(path, sequence):
            kept += 1
        else:
            doomed.append(path)
    doomed += [p for p in sorted(root.iterdir()) if p.name.startswith(_TEMP_PREFIX) and p.is_dir()]
    for path in doomed:
        if path.name.startswith(_TEMP_PREFIX):
            shutil.rmtree(path)
        else:
            # Renamed first, so a crash half-way through rmtree leaves a temporary directory
            # (cleaned next time), never a final-named one with files missing.
            trash = root / f"{_TEMP_PREFIX}deleting-{path.name}-{secrets.token_hex(4)}"
            path.rename(trash)
            shutil.rmtree(trash)
    return doomed


def _check_state(state: SyncerState) -> None:
    if set(state.params) != set(state.momentum):
        missing = sorted(set(state.params) ^ set(state.momentum))
        raise ValueError(f"params and momentum must have the same names; differing: {missing[:10]}")
    for name, param in state.params.items():
        if not isinstance(name, str) or name == "__metadata__" or not name.isprintable():
            raise ValueError(f"parameter name {name!r} cannot be stored")
        momentum = state.momentum[name]
        for kind, tensor in (("param", param), ("momentum", momentum)):
            if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
                raise ValueError(f"{kind} {name!r} must be a dense tensor, got {type(tensor).__name__}")
            if tensor.dtype not in _DTYPE_NAMES:
                raise ValueError(f"{kind} {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
            if tensor.is_meta:
                raise ValueError(f"{kind} {name!r} is on the meta device and has no values")
        if momentum.dtype != torch.float32:
            raise ValueError(f"momentum {name!r} must be float32, got {momentum.dtype}")
        if momentum.shape != param.shape:
            raise ValueError(
                f"momentum {name!r} has shape {tuple(momentum.shape)}, its param {tuple(param.shape)}"
            )
    _check_versions(state.versions)
    if not isinstance(state.meta, dict):
        raise ValueError(f"meta must be a dict, got {type(state.meta).__name__}")


def _check_versions(versions: object) -> None:
    if not isinstance(versions, list):
        raise ValueError(f"versions must be a list, got {type(versions).__name__}")
    for index, version in enumerate(versions):
        # bool is an int subclass, and JSON true would otherwise pass as version 1.
        if type(version) is not int or version < 0:
            raise ValueError(f"version of fragment {index} must be a non-negative int, got {version!r}")


def _check_keep(keep: int) -> None:
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")


def _meta_json(meta: object) -> str:
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        return json.dumps(meta, allow_nan=False)  # fails here, before anything is written
    except (TypeError, ValueError) as exc:
        raise ValueError(f"meta is not JSON-serialisable: {exc}") from exc


def _check_fragmented(model: FragmentedModel) -> None:
    """Every byte of every tensor is in exactly one piece, every piece inside its fragment."""
    for name, shape in model.shapes.items():
        if not isinstance(name, str) or name == "__metadata__" or not name.isprintable():
            raise ValueError(f"parameter name {name!r} cannot be stored")
        if any(type(d) is not int or d < 0 for d in shape):
            raise ValueError(f"parameter {name!r} has shape {shape!r}")
    if len(model.fragment_bytes) != len(model.pieces):
        raise ValueError(f"{len(model.fragment_bytes)} fragment sizes for {len(model.pieces)} fragments")
    covered: dict[str, list[tuple[int, int]]] = {name: [] for name in model.shapes}
    for index, (size, pieces) in enumerate(zip(model.fragment_bytes, model.pieces, strict=True)):
        for piece in pieces:
            if piece.name not in covered:
                raise ValueError(f"fragment {index} holds {piece.name!r}, which is not in the model")
            if piece.nbytes < 0 or piece.source_offset < 0 or piece.source_offset + piece.nbytes > size:
                raise ValueError(f"fragment {index}: piece {piece} lies outside its {size} bytes")
            covered[piece.name].append((piece.tensor_offset, piece.tensor_offset + piece.nbytes))
    for name, ranges in covered.items():
        expected, at = math.prod(model.shapes[name]) * 4, 0
        for start, stop in sorted(ranges):
            if start != at:
                raise ValueError(f"the pieces of {name!r} do not cover its bytes once each (at byte {at})")
            at = stop
        if at != expected:
            raise ValueError(f"the pieces of {name!r} cover {at} of its {expected} bytes")


@dataclass(frozen=True, slots=True)
class _FileLayout:
    """Where everything goes in one safetensors file: its header and each tensor's data offset."""

    head: bytes
    offsets: dict[str, int]
    sizes: dict[str, int]
    total_bytes: int

    @property
    def data_start(self) -> int:
        return _HEADER_LENGTH.size + len(self.head)

    @classmethod
    def of(cls, tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> _FileLayout:
        order = sorted(tensors, key=lambda n: (-_DTYPE_RANKS[tensors[n][0]], n))
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offsets: dict[str, int] = {}
        sizes: dict[str, int] = {}
        offset = 0
        for name in order:
            dtype, shape = tensors[name]
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offsets[name], sizes[name] = offset, nbytes
            offset += nbytes
        head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        head += b" " * (-len(head) % _HEADER_ALIGNMENT)
        return cls(head, offsets, sizes, _HEADER_LENGTH.size + len(head) + offset)


def _create_tensor_file(path: Path, layout: _FileLayout) -> int:
    """A new file of the layout's full size with its header written; the data is filled in later."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, layout.total_bytes)
        _pwrite_all(fd, memoryview(_HEADER_LENGTH.pack(len(layout.head)) + layout.head), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """pwrite all of data at offset, in slices: one write of several GB may come back short."""
    data = data.cast("B") if data.format != "B" else data
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + _WRITE_SLICE_BYTES], offset + done)


def _file_record(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of a written file (hashlib releases the GIL: both files hash at once)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"bytes": size, "sha256": digest}


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor without a copy (torch offers no buffer protocol).
    The caller keeps tensor alive while the view is in use."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _make_dirs(path: Path) -> None:
    """mkdir -p, fsyncing each new directory's parent so that the new entry survives a crash."""
    missing: list[Path] = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        directory.mkdir(exist_ok=True)
        fsync_dir(directory.parent)


# --- loading ----------------------------------------------------------------------------------


def load_latest_checkpoint(state_dir: Path) -> LoadedCheckpoint | None:
    """The newest checkpoint whose state.json parses and whose tensor files match the recorded
    sizes and digests; damaged newer ones are listed in `skipped`. None when there is no
    checkpoint; DamagedCheckpointsError when there are some but none is usable. Reads only."""
    state_dir = Path(state_dir)
    skipped: list[SkippedCheckpoint] = []
    for sequence, path in _final_dirs(state_dir / CHECKPOINTS_DIR):
        try:
            document = _read_document(path, sequence)
            for file_name in (MODEL_FILE, MOMENTUM_FILE):
                _verify_file(path / file_name, document["files"][file_name])
            state = _read_state(path, document)
        except _Damaged as exc:
            skipped.append(SkippedCheckpoint(path, str(exc)))
            continue
        return LoadedCheckpoint(state, path, sequence, float(document["saved_at_unix_s"]), tuple(skipped))
    if skipped:
        raise DamagedCheckpointsError(state_dir, tuple(skipped))
    return None


def _final_dirs(root: Path) -> list[tuple[int, Path]]:
    """Final-named checkpoint directories, newest (highest sequence) first; CheckpointError when
    the checkpoints directory exists but cannot be listed (not a directory, no permission)."""
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(f"cannot list {root}: {exc.strerror or exc}") from None
    found = []
    for entry in entries:
        match = _NAME_RE.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    found.sort(reverse=True)
    return found


def _looks_complete(path: Path, sequence: int) -> bool:
    """Cheap completeness check for pruning: state.json is there and valid (no hashing)."""
    try:
        _read_document(path, sequence)
    except _Damaged:
        return False
    return True


def _read_document(path: Path, sequence: int) -> dict[str, Any]:
    """Parse and validate state.json; _Damaged says what is wrong."""
    try:
        raw = read_regular(path / STATE_FILE, MAX_STATE_FILE_BYTES)
    except FileNotFoundError:
        raise _Damaged(f"{STATE_FILE} is missing (incomplete checkpoint)") from None
    except OSError as exc:
        raise _Damaged(f"cannot read {STATE_FILE}: {exc.strerror or exc}") from None
    try:
        document = json.loads(raw)
    except Exception as exc:  # any failure to parse is damage (deep nesting: RecursionError)
        raise _Damaged(f"{STATE_FILE} does not parse: {type(exc).__name__}: {_first_line(exc)}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise _Damaged(f"{STATE_FILE} is not a {FORMAT} document")
    if document.get("format_version") != FORMAT_VERSION:
        raise _Damaged(
            f"{STATE_FILE} has format_version {document.get('format_version')!r}, "
            f"this dilocod reads {FORMAT_VERSION}"
        )
    if document.get("sequence") != sequence:
        raise _Damaged(f"{STATE_FILE} says sequence {document.get('sequence')!r}, the directory {sequence}")
    if not isinstance(document.get("saved_at_unix_s"), int | float):
        raise _Damaged(f"{STATE_FILE} has no saved_at_unix_s")
    try:
        _check_versions(document.get("versions"))
    except ValueError as exc:
        raise _Damaged(f"{STATE_FILE}: {exc}") from None
    if not isinstance(document.get("meta"), dict):
        raise _Damaged(f"{STATE_FILE} has no meta object")
    names = document.get("param_names")
    if (
        not isinstance(names, list)
        or not all(isinstance(n, str) for n in names)
        or len(set(names)) != len(names)
    ):
        raise _Damaged(f"{STATE_FILE} has no list of distinct param_names")
    files = document.get("files")
    for file_name in (MODEL_FILE, MOMENTUM_FILE):
        record = files.get(file_name) if isinstance(files, dict) else None
        if not (
            isinstance(record, dict)
            and type(record.get("bytes")) is int
            and isinstance(record.get("sha256"), str)
        ):
            raise _Damaged(f"{STATE_FILE} has no size and sha256 for {file_name}")
    return document


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else ""


def _verify_file(path: Path, record: dict[str, Any]) -> None:
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size != record["bytes"]:
                raise _Damaged(f"{path.name} has {size} bytes, {STATE_FILE} recorded {record['bytes']}")
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise _Damaged(f"cannot read {path.name}: {exc.strerror or exc}") from None
    if digest != record["sha256"]:
        raise _Damaged(f"{path.name} has sha256 {digest}, {STATE_FILE} recorded {record['sha256']}")


def _read_state(path: Path, document: dict[str, Any]) -> SyncerState:
    names: list[str] = document["param_names"]
    params = _read_tensor_file(path / MODEL_FILE, names)
    momentum = _read_tensor_file(path / MOMENTUM_FILE, names)
    for name in names:
        if momentum[name].dtype != torch.float32:
            raise _Damaged(f"{MOMENTUM_FILE}: {name!r} is {momentum[name].dtype}, not float32")
        if momentum[name].shape != params[name].shape:
            raise _Damaged(
                f"{MOMENTUM_FILE}: {name!r} has shape {tuple(momentum[name].shape)}, "
                f"the param {tuple(params[name].shape)}"
            )
    return SyncerState(params, momentum, list(document["versions"]), document["meta"])


def _read_tensor_file(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, in the order of names, which must be exactly its keys."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = set(f.keys())
            if keys != set(names):
                differing = sorted(keys ^ set(names))
                raise _Damaged(f"{path.name} holds other tensors than {STATE_FILE} lists: {differing[:10]}")
            return {name: f.get_tensor(name) for name in names}
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as exc:
        raise _Damaged(f"{path.name} does not load: {exc}") from None


# --- export -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExportedCheckpoint:
    """What `export_newest` wrote, and from which checkpoint (for the person who asked)."""

    path: Path
    sequence: int
    #: The fragment versions of the exported model, in fragment order.
    versions: tuple[int, ...]
    saved_at_unix_s: float


def export_model(state_dir: Path, out: Path) -> Path:
    """export_newest, returning only the path written."""
    return export_newest(state_dir, out).path


def export_newest(state_dir: Path, out: Path) -> ExportedCheckpoint:
    """Write the global model of the newest usable checkpoint to `out`: one safetensors file keyed
    by parameter name. Atomic: `out` is either the old file or the whole new one. A missing parent
    folder of `out` is created (once a checkpoint is known to exist).

    The checkpoint's model file already has that form, so it is copied (constant memory) and its
    digest checked on the way; a damaged checkpoint is passed over for the previous one. Raises
    NoCheckpointError when there is none, DamagedCheckpointsError when none is usable, OSError
    when `out` cannot be written.
    """
    state_dir, out = Path(state_dir), Path(out)
    candidates = _final_dirs(state_dir / CHECKPOINTS_DIR)
    if not candidates:
        raise NoCheckpointError(state_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    skipped: list[SkippedCheckpoint] = []
    for sequence, path in candidates:
        temp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")
        try:
            document = _read_document(path, sequence)
            _copy_verified(path / MODEL_FILE, document["files"][MODEL_FILE], temp)
            temp.replace(out)
        except _Damaged as exc:
            skipped.append(SkippedCheckpoint(path, str(exc)))
            continue
        finally:
            temp.unlink(missing_ok=True)
        fsync_dir(out.parent)
        return ExportedCheckpoint(
            out, sequence, tuple(document["versions"]), float(document["saved_at_unix_s"])
        )
    raise DamagedCheckpointsError(state_dir, tuple(skipped))


def _copy_verified(source: Path, record: dict[str, Any], target: Path) -> None:
    """Copy source to target (fsync'd), checking the recorded size and SHA-256 on the way."""
    digest = hashlib.sha256()
    try:
        src = open_regular(source)  # closed below; OSError here means damage
    except OSError as exc:
        raise _Damaged(f"cannot read {source.name}: {exc.strerror or exc}") from None
    with src, open(target, "xb") as dst:
        size = os.fstat(src.fileno()).st_size
        if size != record["bytes"]:
            raise _Damaged(f"{source.name} has {size} bytes, {STATE_FILE} recorded {record['bytes']}")
        for chunk in _chunks(src):
            digest.update(chunk)
            dst.write(chunk)
        if digest.hexdigest() != record["sha256"]:
            raise _Damaged(
                f"{source.name} has sha256 {digest.hexdigest()}, {STATE_FILE} recorded {record['sha256']}"
            )
        dst.flush()
        os.fsync(dst.fileno())


def _chunks(f: Any) -> Iterator[memoryview]:
    buffer = bytearray(_COPY_CHUNK_BYTES)
    view = memoryview(buffer)
    while n := f.readinto(buffer):
        yield view[:n]
