"""Chunk codecs: byte-plane shuffle, lz4/zstd with the fallback to none, checksums, digests, and
decompression bounded by the declared raw length (compression bombs cost at most one chunk).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import TYPE_CHECKING

import lz4.block
import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.wire import codecs
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.frames import (
    SHUFFLE_ITEM_SIZES,
    ChunkHeader,
    Codec,
    decode_chunk_header,
    encode_chunk_header,
)
from dilocod.wire.limits import DEFAULT_LIMITS, GiB, KiB, MiB, chunk_payload_bound

if TYPE_CHECKING:
    import torch

COMPRESSING = [Codec.LZ4, Codec.ZSTD]


def chunk_for(raw: bytes | bytearray | memoryview, codec: Codec, shuffle: int, seq: int = 0) -> ChunkHeader:
    return ChunkHeader(seq, len(raw), codec, shuffle, codecs.checksum(raw))


def encode(codec: Codec, raw: bytes | bytearray | memoryview, shuffle: int = 0) -> tuple[ChunkHeader, bytes]:
    used, item_size, payload = codecs.compress(codec, raw, shuffle)
    return chunk_for(raw, used, item_size), bytes(payload)


def random_bytes(n: int) -> bytes:
    """Deterministic bytes without redundancy (xxh3 output is indistinguishable from random)."""
    return b"".join(xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(-(-n // 16)))[:n]


def decode(chunk: ChunkHeader, payload: bytes | bytearray | memoryview) -> bytes:
    out = bytearray(chunk.raw_length)
    codecs.decompress_into(chunk, payload, memoryview(out))
    return bytes(out)


# ------------------------------------------------------------------------------------ shuffle


def test_shuffle_layout() -> None:
    assert codecs.shuffle(b"\x01\x02\x03\x04\x05\x06", 2) == b"\x01\x03\x05\x02\x04\x06"
    assert codecs.shuffle(bytes(range(8)), 4) == bytes([0, 4, 1, 5, 2, 6, 3, 7])


@settings(max_examples=150, deadline=None)
@given(item_size=st.sampled_from([2, 4, 8]), data=st.data())
def test_shuffle_round_trip(item_size: int, data: st.DataObject) -> None:
    items = data.draw(st.integers(0, 300))
    raw = data.draw(st.binary(min_size=items * item_size, max_size=items * item_size))
    planes = codecs.shuffle(raw, item_size)
    assert len(planes) == len(raw)
    assert sorted(planes) == sorted(raw)
    out = bytearray(len(raw))
    codecs.unshuffle_into(planes, item_size, memoryview(out))
    assert bytes(out) == raw


def test_unshuffle_into_a_typed_view() -> None:
    raw = bytes(range(64))
    out = bytearray(64)
    codecs.unshuffle_into(codecs.shuffle(raw, 4), 4, memoryview(out).cast("f"))
    assert bytes(out) == raw


# ----------------------------------------------------------------------------------- compress


@pytest.mark.parametrize("codec", COMPRESSING, ids=lambda c: c.name)
@pytest.mark.parametrize("shuffle", [0, 2, 4, 8])
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_incompressible_chunk_is_sent_as_it_is(codec: Codec, shuffle: int, kind: type) -> None:
    raw = kind(random_bytes(64 * KiB))
    used, item_size, payload = codecs.compress(codec, raw, shuffle)
    assert (used, item_size) == (Codec.NONE, 0)
    assert payload is raw  # the very same buffer: no copy


def test_codec_none_returns_the_same_buffer() -> None:
    raw = bytearray(b"\x00" * 4096)
    assert codecs.compress(Codec.NONE, raw, 2) == (Codec.NONE, 0, raw)
    assert codecs.compress(Codec.NONE, raw, 2)[2] is raw


@pytest.mark.parametrize("codec", COMPRESSING, ids=lambda c: c.name)
def test_compressible_chunk_shrinks_and_round_trips(codec: Codec) -> None:
    raw = b"dilocod " * 2048
    chunk, payload = encode(codec, raw)
    assert chunk.codec is codec and len(payload) < len(raw) // 10
    assert decode(chunk, payload) == raw


@pytest.mark.parametrize("codec", COMPRESSING, ids=lambda c: c.name)
@pytest.mark.parametrize("length", [1, 3, 4095, 4097, 10_001])
def test_shuffle_of_a_ragged_chunk_still_decodes(codec: Codec, length: int) -> None:
    """A chunk whose length is not a multiple of the item size (the last chunk of a fragment
    with byte-sized tensors) must come out as a chunk the receiver accepts."""
    raw = (b"\x00\x01" * length)[:length]
    for item_size in (2, 4, 8):
        chunk, payload = encode(codec, raw, item_size)
        assert chunk.shuffle == 0 or length % chunk.shuffle == 0
        assert decode_chunk_header(encode_chunk_header(chunk), len(payload), DEFAULT_LIMITS) == chunk
        assert decode(chunk, payload) == raw


# --------------------------------------------------------------------- real gradient deltas


@pytest.fixture(scope="module")
def deltas() -> torch.Tensor:
    """Parameter deltas of a tiny model after a few AdamW steps: what an outer gradient is."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(5):
        x = torch.randn(16, 32)
        loss = (model(x) - x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)])


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.contiguous()
    raw = bytes(tensor.untyped_storage())
    assert len(raw) == tensor.numel() * tensor.element_size()
    return raw


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("codec", COMPRESSING, ids=lambda c: c.name)
@pytest.mark.parametrize("shuffled", [False, True], ids=["plain", "shuffled"])
def test_gradient_round_trip(deltas: torch.Tensor, dtype_name: str, codec: Codec, shuffled: bool) -> None:
    import torch

    dtype = getattr(torch, dtype_name)
    raw = tensor_bytes(deltas.to(dtype))
    item_size = deltas.to(dtype).element_size() if shuffled else 0
    chunk, payload = encode(codec, raw, item_size)
    decoded = decode(chunk, payload)
    assert decoded == raw
    back = torch.frombuffer(bytearray(decoded), dtype=dtype)
    assert torch.equal(back, deltas.to(dtype))


@pytest.mark.parametrize("codec", COMPRESSING, ids=lambda c: c.name)
def test_shuffle_makes_bf16_gradients_compress(deltas: torch.Tensor, codec: Codec) -> None:
    import torch

    raw = tensor_bytes(deltas.to(torch.bfloat16))
    chunk, payload = encode(codec, raw, 2)
    assert (chunk.codec, chunk.shuffle) == (codec, 2)
    assert len(raw) / len(payload) > 1.05
    _, plain = encode(codec, raw, 0)
    assert len(payload) < len(plain)


# ------------------------------------------------------------------------------ bad chunks


@pytest.mark.parametrize("codec", [Codec.NONE, *COMPRESSING], ids=lambda c: c.name)
def test_checksum_mismatch(codec: Codec) -> None:
    raw = b"gradient" * 1024
    chunk, payload = encode(codec, raw)
    wrong = ChunkHeader(chunk.seq, chunk.raw_length, chunk.codec, chunk.shuffle, chunk.checksum ^ 1)
    with pytest.raises(RemoteProtocolError) as info:
        decode(wrong, payload)
    assert info.value.code is ErrorCode.CHECKSUM_MISMATCH


def test_corrupt_uncompressed_payload() -> None:
    raw = bytearray(random_bytes(4096))
    chunk = chunk_for(raw, Codec.NONE, 0)
    raw[1234] ^= 0x40
    with pytest.raises(RemoteProtocolError) as info:
        decode(chunk, raw)
    assert info.value.code is ErrorCode.CHECKSUM_MISMATCH


def test_in_place_chunk_is_only_verified() -> None:
    raw = bytearray(random_bytes(4096))
    chunk = chunk_for(raw, Codec.NONE, 0)
    codecs.decompress_into(chunk, raw, memoryview(raw), in_place=True)
    raw[0] ^= 1
    with pytest.raises(RemoteProtocolError) as info:
        codecs.decompress_into(chunk, raw, memoryview(raw), in_place=True)
    assert info.value.code is ErrorCode.CHECKSUM_MISMATCH


@pytest.mark.parametrize("codec", COMPRESSING, ids=lambda c: c.name)
@pytest.mark.parametrize("delta", [-1, 1, 4096])
def test_decompressed_length_differs(codec: Codec, delta: int) -> None:
    raw = b"abcd" * 2048
    chunk, payload = encode(codec, raw)
    wrong = ChunkHeader(0, len(raw) + delta, codec, 0, chunk.checksum)
    with pytest.raises(RemoteProtocolError) as info:
        decode(wrong, payload)
    assert info.value.code is ErrorCode.LENGTH_MISMATCH


def test_zstd_frame_declaring_another_size() -> None:
    payload = zstandard.ZstdCompressor(write_content_size=True).compress(b"x" * 4000)
    chunk = ChunkHeader(0, 4096, Codec.ZSTD, 0, 0)
    with pytest.raises(RemoteProtocolError) as info:
        decode(chunk, payload)
    assert info.value.code is ErrorCode.LENGTH_MISMATCH


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(b"\x01\x02\x03", id="stray-bytes"),
        pytest.param(zstandard.ZstdCompressor().compress(b"more"), id="second-frame"),
    ],
)
def test_zstd_payload_with_trailing_bytes(extra: bytes) -> None:
    """A chunk's payload is exactly one zstd frame: nothing may follow it, even when the first
    frame alone decodes to the right bytes."""
    raw = b"q" * 4096
    chunk, payload = encode(Codec.ZSTD, raw)
    assert chunk.codec is Codec.ZSTD
    with pytest.raises(RemoteProtocolError) as info:
        decode(chunk, payload + extra)
    assert info.value.code is ErrorCode.LENGTH_MISMATCH


def test_zstd_frame_declaring_its_true_size_decodes() -> None:
    raw = b"y" * 4096
    payload = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    assert decode(chunk_for(raw, Codec.ZSTD, 0), payload) == raw


def test_uncompressed_payload_of_the_wrong_length() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode(ChunkHeader(0, 4096, Codec.NONE, 0, 0), bytes(4095))
    assert info.value.code is ErrorCode.LENGTH_MISMATCH


def test_payload_above_its_bound() -> None:
    payload = bytes(chunk_payload_bound(4096) + 1)
    with pytest.raises(RemoteProtocolError) as info:
        decode(ChunkHeader(0, 4096, Codec.LZ4, 0, 0), payload)
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED


def test_destination_of_the_wrong_size_is_a_caller_bug() -> None:
    chunk, payload = encode(Codec.LZ4, b"z" * 4096)
    with pytest.raises(ValueError):
        codecs.decompress_into(chunk, payload, memoryview(bytearray(4095)))


@settings(max_examples=200, deadline=None)
@given(
    codec=st.sampled_from(list(Codec)),
    shuffle=st.sampled_from(sorted(SHUFFLE_ITEM_SIZES)),
    items=st.integers(1, 600),
    payload=st.one_of(
        st.binary(max_size=300),
        st.sampled_from([b"", b"\x28\xb5\x2f\xfd", b"\x28\xb5\x2f\xfd\x20\x10"]).flatmap(
            lambda head: st.binary(max_size=40).map(lambda tail: head + tail)
        ),
    ),
)
def test_any_payload_decodes_or_is_refused(codec: Codec, shuffle: int, items: int, payload: bytes) -> None:
    raw_length = items * max(shuffle, 1)
    if codec is Codec.NONE:
        payload = (payload * (raw_length // max(len(payload), 1) + 1))[:raw_length] or bytes(raw_length)
    chunk = ChunkHeader(0, raw_length, codec, shuffle, 0)
    try:
        decode(chunk, payload)
    except RemoteProtocolError as exc:
        assert exc.code in (ErrorCode.CHECKSUM_MISMATCH, ErrorCode.LENGTH_MISMATCH)


# --------------------------------------------------------------------------------- bombs


def peak_while(action: Callable[[], object]) -> int:
    """Peak traced allocation while action() runs (it must raise LENGTH_MISMATCH)."""
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError) as info:
            action()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code is ErrorCode.LENGTH_MISMATCH
    return peak


def test_zstd_bomb_declaring_a_gigabyte() -> None:
    """A real zstd frame of 1 GiB of zeros declaring its content size: 32 KiB on the wire."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=GiB)
    zeros = bytes(4 * MiB)
    payload = b"".join([*(compressor.compress(zeros) for _ in range(GiB // len(zeros))), compressor.flush()])
    assert zstandard.get_frame_parameters(payload).content_size == GiB
    raw_length = 64 * KiB
    assert len(payload) <= chunk_payload_bound(raw_length)
    chunk = ChunkHeader(0, raw_length, Codec.ZSTD, 0, 0)
    out = memoryview(bytearray(raw_length))
    assert peak_while(lambda: codecs.decompress_into(chunk, payload, out)) < 16 * MiB


def test_zstd_bomb_without_a_declared_size() -> None:
    payload = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(bytes(64 * MiB))
    assert zstandard.get_frame_parameters(payload).content_size == zstandard.CONTENTSIZE_UNKNOWN
    assert len(payload) <= chunk_payload_bound(4096)
    chunk = ChunkHeader(0, 4096, Codec.ZSTD, 0, 0)
    out = memoryview(bytearray(4096))
    assert peak_while(lambda: codecs.decompress_into(chunk, payload, out)) < 4 * MiB


def test_lz4_bomb() -> None:
    payload = lz4.block.compress(bytes(64 * MiB), store_size=False)
    raw_length = MiB
    assert len(payload) <= chunk_payload_bound(raw_length)
    chunk = ChunkHeader(0, raw_length, Codec.LZ4, 0, 0)
    out = memoryview(bytearray(raw_length))
    assert peak_while(lambda: codecs.decompress_into(chunk, payload, out)) < 8 * MiB


# --------------------------------------------------------------------- checksums and digests


def test_checksum_is_xxh3_64() -> None:
    assert codecs.checksum(b"") == 0x2D06800538D394C2
    assert (
        codecs.checksum(memoryview(b"abc"))
        == codecs.checksum(bytearray(b"abc"))
        == xxhash.xxh3_64_intdigest(b"abc")
    )


def test_fragment_digest_is_order_sensitive() -> None:
    checksums = [codecs.checksum(bytes([i]) * 100) for i in range(5)]
    digest = codecs.fragment_digest(checksums)
    assert codecs.fragment_digest(list(checksums)) == digest
    assert codecs.fragment_digest(iter(checksums)) == digest
    assert codecs.fragment_digest(checksums[::-1]) != digest
    assert codecs.fragment_digest([checksums[1], checksums[0], *checksums[2:]]) != digest
    assert codecs.fragment_digest(checksums[:-1]) != digest
    assert codecs.fragment_digest([]) == xxhash.xxh3_64_intdigest(b"")


def test_fragment_digest_covers_big_endian_checksums() -> None:
    assert codecs.fragment_digest([1, 2]) == xxhash.xxh3_64_intdigest(
        (1).to_bytes(8, "big") + (2).to_bytes(8, "big")
    )


@given(length=st.integers(0, 5000), chunk=st.integers(1, 1200))
@settings(max_examples=50, deadline=None)
def test_chunk_checksums_match_chunk_by_chunk(length: int, chunk: int) -> None:
    """One checksum per chunk, the last one ragged, each the xxh3-64 of exactly that chunk."""
    raw = bytes((i * 7 + 3) % 256 for i in range(length))
    expected = [xxhash.xxh3_64_intdigest(raw[start : start + chunk]) for start in range(0, length, chunk)]
    assert codecs.chunk_checksums(raw, chunk) == expected
    assert len(expected) == -(-length // chunk)


def test_chunk_checksums_of_a_typed_view_cover_its_bytes() -> None:
    words = memoryview(bytearray(range(16))).cast("I")
    assert codecs.chunk_checksums(words, 8) == [
        xxhash.xxh3_64_intdigest(bytes(range(8))),
        xxhash.xxh3_64_intdigest(bytes(range(8, 16))),
    ]


@pytest.mark.parametrize("chunk", [0, -1])
def test_chunk_checksums_need_a_positive_chunk_size(chunk: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        codecs.chunk_checksums(b"abc", chunk)
