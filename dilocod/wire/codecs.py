"""Chunk codecs: byte-plane shuffle, lz4 and zstd, the per-chunk checksum and the end digest.

Pure functions over byte buffers. Decompression is bounded by the declared raw length so a
compression bomb costs the receiver at most one chunk's worth of memory. Everything heavy here runs
without the GIL (lz4, zstd, xxhash, and the shuffle's strided copies in numpy), so callers may run
these on a small thread pool and get one core's worth from each thread. Must not import asyncio,
socket, torch or logging.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from types import ModuleType

import lz4.block
import xxhash
import zstandard

from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.frames import ChunkHeader, Codec
from dilocod.wire.limits import chunk_payload_bound

Buffer = bytes | bytearray | memoryview
ZSTD_LEVEL = 1  # level 1 already reaches the entropy bound of float gradients; 3 never wins.


def checksum(raw: Buffer) -> int:
    """xxh3-64 of a chunk's raw (uncompressed, unshuffled) bytes."""
    return xxhash.xxh3_64_intdigest(raw)


def chunk_checksums(raw: Buffer, chunk_bytes: int) -> list[int]:
    """The checksum of every chunk of a fragment, in sequence order.

    A sender that computes these where the fragment is made (while its bytes are still in cache,
    off the network thread) or once for many receivers hands them to Session.send_fragment, which
    then hashes nothing itself.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk size must be positive, not {chunk_bytes}")
    view = memoryview(raw).cast("B")
    return [checksum(view[start : start + chunk_bytes]) for start in range(0, len(view), chunk_bytes)]


def fragment_digest(checksums: Iterable[int]) -> int:
    """xxh3-64 over the chunk checksums in sequence order, each as 8 big-endian bytes."""
    h = xxhash.xxh3_64()
    for value in checksums:
        h.update(struct.pack(">Q", value))
    return h.intdigest()


def shuffle(raw: Buffer, item_size: int) -> memoryview:
    """Byte-plane shuffle: all first bytes of each item, then all second bytes, and so on.

    Float exponents and sign bytes cluster together, which is what lets a general compressor find
    the redundancy of bf16 and fp32 gradients. numpy copies the planes without the GIL; the bytes
    slicing it replaces held the GIL about as long as zstd-1 ran, so a second codec thread added
    about half a thread's worth (bench/RESULTS.md §2).
    """
    np = _numpy()
    source = np.frombuffer(raw, dtype=np.uint8)
    if len(source) % item_size:
        raise ValueError(f"{len(source)} bytes are not whole items of {item_size}")
    planes = np.empty((item_size, len(source) // item_size), dtype=np.uint8)
    items = source.reshape(-1, item_size)
    # One strided copy per plane: numpy runs each long inner loop without the GIL, where one copy
    # of the transposed matrix would iterate over the short axis (item_size) innermost.
    for plane in range(item_size):
        np.copyto(planes[plane], items[:, plane])
    return memoryview(planes.reshape(-1))


def unshuffle_into(planes: Buffer, item_size: int, out: memoryview) -> None:
    """Inverse of shuffle, written into out (any writable buffer of the same length)."""
    np = _numpy()
    # frombuffer reads any contiguous buffer as its bytes, whatever its item format.
    source = np.frombuffer(planes, dtype=np.uint8)
    target = np.frombuffer(out, dtype=np.uint8)
    if len(source) != len(target) or len(source) % item_size:
        raise ValueError(f"{len(source)} bytes of planes for {len(target)} of output, items of {item_size}")
    items, planes_2d = target.reshape(-1, item_size), source.reshape(item_size, -1)
    for plane in range(item_size):  # per plane, as in shuffle: 3 to 5 times faster than one 2-D copy
        np.copyto(items[:, plane], planes_2d[plane])


def _numpy() -> ModuleType:
    # Imported on first use: `dilocod status` and --help reach this module and never shuffle, and
    # numpy costs them a tenth of a second.
    import numpy  # noqa: PLC0415

    return numpy


def compress(codec: Codec, raw: Buffer, shuffle_item_size: int = 0) -> tuple[Codec, int, Buffer]:
    """Encode one chunk. Returns (codec used, shuffle used, payload).

    Falls back to Codec.NONE with the raw buffer itself (no copy) when compression would not
    shrink the chunk, which keeps every payload within chunk_payload_bound.
    """
    if codec is Codec.NONE:
        return Codec.NONE, 0, raw
    if shuffle_item_size > 1 and len(raw) % shuffle_item_size:
        shuffle_item_size = 0  # receivers refuse a shuffle that does not divide the chunk
    source: Buffer = shuffle(raw, shuffle_item_size) if shuffle_item_size > 1 else raw
    if codec is Codec.LZ4:
        payload: bytes = lz4.block.compress(source, mode="default", store_size=False)
    else:
        payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=False).compress(source)
    if len(payload) >= len(raw):
        return Codec.NONE, 0, raw
    return codec, shuffle_item_size if shuffle_item_size > 1 else 0, payload


def decompress_into(chunk: ChunkHeader, payload: Buffer, out: memoryview, *, in_place: bool = False) -> None:
    """Decode a chunk into out (exactly chunk.raw_length bytes) and verify its checksum.

    in_place: an uncompressed payload already sits in out; only the checksum is checked.

    Raises RemoteProtocolError on a length or checksum mismatch; never allocates more than
    chunk.raw_length for the decoded data, whatever the payload claims.
    """
    if len(out) != chunk.raw_length:
        raise ValueError("destination must be exactly raw_length bytes")
    if len(payload) > chunk_payload_bound(chunk.raw_length):
        raise RemoteProtocolError(ErrorCode.LIMIT_EXCEEDED, "chunk payload above its bound")
    if chunk.codec is Codec.NONE:
        if len(payload) != chunk.raw_length:
            raise RemoteProtocolError(ErrorCode.LENGTH_MISMATCH, "raw chunk of the wrong length")
        if not in_place:
            out[:] = payload
    else:
        decoded = _decode(chunk, payload)
        if chunk.shuffle > 1:
            unshuffle_into(decoded, chunk.shuffle, out)
        else:
            out[:] = decoded
    if checksum(out) != chunk.checksum:
        raise RemoteProtocolError(
            ErrorCode.CHECKSUM_MISMATCH, f"chunk {chunk.seq}: checksum of its raw bytes differs"
        )


def _decode(chunk: ChunkHeader, payload: Buffer) -> bytes:
    try:
        if chunk.codec is Codec.LZ4:
            decoded = lz4.block.decompress(payload, uncompressed_size=chunk.raw_length)
        else:
            # zstd trusts a content size written in the frame over max_output_size, so a bomb
            # declaring a huge size must be refused before decompress() allocates it.
            declared = zstandard.get_frame_parameters(payload).content_size
            if declared not in (zstandard.CONTENTSIZE_UNKNOWN, chunk.raw_length):
                raise RemoteProtocolError(
                    ErrorCode.LENGTH_MISMATCH,
                    f"chunk {chunk.seq}: zstd frame declares {declared} bytes, header {chunk.raw_length}",
                )
            # A payload is exactly one frame: bytes after it are refused, not ignored.
            decoded = zstandard.ZstdDecompressor().decompress(
                payload, max_output_size=chunk.raw_length, allow_extra_data=False
            )
    except (lz4.block.LZ4BlockError, zstandard.ZstdError) as exc:
        raise RemoteProtocolError(
            ErrorCode.LENGTH_MISMATCH, f"chunk {chunk.seq} does not decode to {chunk.raw_length} bytes: {exc}"
        ) from None
    if len(decoded) != chunk.raw_length:
        raise RemoteProtocolError(
            ErrorCode.LENGTH_MISMATCH,
            f"chunk {chunk.seq} decodes to {len(decoded)} bytes, header says {chunk.raw_length}",
        )
    return decoded
