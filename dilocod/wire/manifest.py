"""The tensor manifest of a fragment stream: names, dtypes, shapes and byte offsets.

Validation here is what lets a receiver size its destination buffer from a peer's declaration.
Must not import asyncio, socket, torch or logging (dtype names are plain strings).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def _bad(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.BAD_MANIFEST, message)


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
        name, dtype, shape, offset = item
        if not isinstance(name, str) or not name or len(name.encode()) > limits.max_name_bytes:
            raise _bad(
                f"entry {index}: name must be a non-empty string of at most {limits.max_name_bytes} bytes"
            )
        if name in names:
            raise _bad(f"entry {index}: duplicate name {name!r}")
        names.add(name)
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:  # a list is unhashable
            raise _bad(f"{name}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > limits.max_tensor_rank:
            raise _bad(f"{name}: shape must be an array of at most {limits.max_tensor_rank} dims")
        if not all(type(d) is int and 0 <= d <= raw_bytes for d in shape):
            raise _bad(f"{name}: dimensions must be integers in 0..raw_bytes")
        if type(offset) is not int or offset < end or offset % DTYPE_SIZES[dtype]:
            raise _bad(f"{name}: offset {offset!r} overlaps, goes backwards or is misaligned")
        entry = TensorEntry(name, dtype, tuple(shape), offset)
        end = offset + entry.nbytes
        if end > raw_bytes:
            raise _bad(f"{name}: ends at byte {end}, past the fragment's {raw_bytes} bytes")
        entries.append(entry)
    return tuple(entries)
