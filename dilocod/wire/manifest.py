"""Tensor lists on the wire: the manifest of a fragment stream (names, dtypes, shapes and byte
offsets), the model of JOIN and PLAN (names, dtypes and shapes of every parameter), and
fragment_manifest, the one function both ends derive a fragment's manifest from its pieces with.

Validation here is what lets a receiver size its destination buffer from a peer's declaration.
Must not import asyncio, socket, torch or logging (dtype names are plain strings).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.limits import Limits

#: Wire dtype names and their item sizes in bytes (protocol/SPEC.md §5.1).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
#: Offsets the packer uses; receivers accept any offset aligned to its item size.
PACK_ALIGNMENT = 64


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One parameter of a model as JOIN and PLAN list it: where it lives is the plan's business."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def to_wire(self) -> list[object]:
        return [self.name, self.dtype, list(self.shape)]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def to_wire(self) -> list[object]:
        return [self.name, self.dtype, list(self.shape), self.offset]


def pack_manifest(tensors: Sequence[tuple[str, str, Sequence[int]]]) -> tuple[list[TensorEntry], int]:
    """Lay tensors out back to back at PACK_ALIGNMENT boundaries; returns entries and total bytes."""
    entries: list[TensorEntry] = []
    offset = 0
    for name, dtype, shape in tensors:
        offset = -(-offset // PACK_ALIGNMENT) * PACK_ALIGNMENT
        entry = TensorEntry(name, dtype, tuple(int(d) for d in shape), offset)
        entries.append(entry)
        offset += entry.nbytes
    return entries, offset


def piece_rows(shape: Sequence[int]) -> int:
    """The rows a plan may cut a tensor of this shape at: dim 0, or 1 for a tensor without rows
    (0-d, or a first dimension of 0), which travels whole as the piece [0, 1)."""
    return shape[0] if len(shape) and shape[0] > 0 else 1


def fragment_shapes(
    pieces: Sequence[tuple[str, int, int]], shapes: Mapping[str, Sequence[int]]
) -> list[tuple[str, tuple[int, ...]]]:
    """(manifest name, shape) of each piece: `name` for a whole tensor, `name[start:stop]` for a
    row slice, whose shape is the tensor's with dim 0 = stop - start (protocol/SPEC.md §5.2)."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for name, start, stop in pieces:
        shape = tuple(int(d) for d in shapes[name])
        if (start, stop) == (0, piece_rows(shape)):
            out.append((name, shape))
        else:
            out.append((f"{name}[{start}:{stop}]", (stop - start, *shape[1:])))
    return out


def fragment_manifest(
    pieces: Sequence[tuple[str, int, int]], shapes: Mapping[str, Sequence[int]], dtype: str = "float32"
) -> tuple[tuple[TensorEntry, ...], int]:
    """The manifest and byte size of a fragment made of these pieces, every tensor in dtype. The
    syncer's buffers, the learner's layout and both ends' push and update streams all use it."""
    entries, raw_bytes = pack_manifest([(n, dtype, s) for n, s in fragment_shapes(pieces, shapes)])
    return tuple(entries), raw_bytes


def _bad(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.BAD_MANIFEST, message)


def _check_tensor(
    index: int, name: object, dtype: object, shape: object, names: set[str], max_dim: int, limits: Limits
) -> tuple[str, str, tuple[int, ...]]:
    """What a manifest entry and a model entry share: a new name, a known dtype, a bounded shape."""
    if not isinstance(name, str) or not name or len(name.encode()) > limits.max_name_bytes:
        raise _bad(f"entry {index}: name must be a non-empty string of at most {limits.max_name_bytes} bytes")
    if name in names:
        raise _bad(f"entry {index}: duplicate name {name!r}")
    names.add(name)
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:  # a list is unhashable
        raise _bad(f"{name}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > limits.max_tensor_rank:
        raise _bad(f"{name}: shape must be an array of at most {limits.max_tensor_rank} dims")
    if not all(type(d) is int and 0 <= d <= max_dim for d in shape):
        raise _bad(f"{name}: dimensions must be integers in 0..{max_dim}")
    return name, dtype, tuple(shape)


def parse_manifest(raw: object, raw_bytes: int, limits: Limits) -> tuple[TensorEntry, ...]:
    """Check a peer's manifest: known dtypes, bounded rank and names, aligned offsets in order,
    no overlap, everything inside raw_bytes."""
    if not isinstance(raw, list):
        raise _bad("manifest must be an array")
    if len(raw) > limits.max_tensors_per_fragment:
        raise RemoteProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"manifest lists {len(raw)} tensors, limit {limits.max_tensors_per_fragment}",
        )
    entries: list[TensorEntry] = []
    end = 0
    names: set[str] = set()
    for index, item in enumerate(raw):
        if not (isinstance(item, list) and len(item) == 4):
            raise _bad(f"entry {index} must be [name, dtype, shape, offset]")
        name, dtype, shape = _check_tensor(index, *item[:3], names, raw_bytes, limits)
        offset = item[3]
        if type(offset) is not int or offset < end or offset % DTYPE_SIZES[dtype]:
            raise _bad(f"{name}: offset {offset!r} overlaps, goes backwards or is misaligned")
        entry = TensorEntry(name, dtype, shape, offset)
        end = offset + entry.nbytes
        if end > raw_bytes:
            raise _bad(f"{name}: ends at byte {end}, past the fragment's {raw_bytes} bytes")
        entries.append(entry)
    return tuple(entries)


def parse_model(raw: object, limits: Limits) -> tuple[ModelEntry, ...]:
    """Check the model of a JOIN or PLAN: 1..max_model_tensors entries [name, dtype, shape] with
    unique names, known dtypes, bounded rank, and all of them together at most max_model_bytes (a
    tensor larger than a fragment is cut into row slices, so only the whole model is bounded)."""
    if not isinstance(raw, list):
        raise _bad("model must be an array")
    if len(raw) > limits.max_model_tensors:
        raise RemoteProtocolError(
            ErrorCode.LIMIT_EXCEEDED, f"model lists {len(raw)} tensors, limit {limits.max_model_tensors}"
        )
    if not raw:
        raise _bad("model lists no tensors")  # nothing to train, nothing to fragment
    entries: list[ModelEntry] = []
    names: set[str] = set()
    total = 0
    for index, item in enumerate(raw):
        if not (isinstance(item, list) and len(item) == 3):
            raise _bad(f"entry {index} must be [name, dtype, shape]")
        entry = ModelEntry(*_check_tensor(index, *item, names, limits.max_model_bytes, limits))
        total += entry.nbytes
        if total > limits.max_model_bytes:
            raise _bad(f"{entry.name}: the model reaches {total} bytes, above {limits.max_model_bytes}")
        entries.append(entry)
    return tuple(entries)
