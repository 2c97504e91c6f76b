"""Fragments between two real processes: this test's client pushes gradient-like float32 to a
`dilocod bench serve` child process, which echoes each one back as an update; the echo must be
bit-exact for every size (one chunk, an uneven last chunk, many chunks), codec, shuffle setting and
number of data connections, on uvloop and on the default asyncio loop (the server runs the same
loop kind as the client).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from devkit.transfers import (
    CHUNK_BYTES,
    TRANSFER_TIMEOUT_S,
    BenchServer,
    Fragments,
    assert_echo_matches,
    echo,
    make_fragment,
    recv_fragment,
    wire_bytes_sent,
)
from dilocod.transport.endpoints import connect
from dilocod.transport.errors import TransferFailed
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.errors import ErrorCode
from dilocod.wire.limits import KiB, MiB

SIZES = [
    pytest.param(1 * KiB, id="1KiB"),
    pytest.param(1 * MiB + 17, id="1MiB+17"),  # the second chunk is 17 bytes: a partial float
    pytest.param(64 * MiB, id="64MiB"),
]
CODECS = [
    pytest.param("none", 0, id="none"),
    pytest.param("lz4", 0, id="lz4"),
    pytest.param("lz4", 4, id="lz4-shuffle"),
    pytest.param("zstd", 0, id="zstd"),
    pytest.param("zstd", 4, id="zstd-shuffle"),
]
STREAMS = [pytest.param(n, id=f"{n}conn") for n in (1, 2, 4)]
#: Codecs that must shrink float32 gradients on the wire (lz4 without shuffle cannot: its chunks
#: go out uncompressed). Measured ratios: zstd 0.92, zstd+shuffle 0.84, lz4+shuffle 0.93.
SHRINKS = {("zstd", 0): 0.97, ("zstd", 4): 0.90, ("lz4", 4): 0.97}


def _round_trip(
    arun: Callable[..., object],
    server: BenchServer,
    fragments: Fragments,
    size: int,
    codec: str,
    shuffle: int,
    streams: int,
) -> None:
    fragment = fragments.get(size)

    async def main() -> None:
        session = await connect(
            "127.0.0.1", server.port, peer_id=f"transfer-{codec}-{streams}", role="bench", streams=streams
        )
        try:
            assert len(session.data) == streams
            before = wire_bytes_sent(session)
            received = await echo(session, fragment, codec, shuffle=shuffle)
            sent = wire_bytes_sent(session) - before
            assert_echo_matches(received, fragment, codec)
            assert session.bytes_payload_sent == size
            assert session.bytes_payload_received == size
            if codec == "none":
                assert sent >= size
            elif size >= MiB and (codec, shuffle) in SHRINKS:
                assert sent < size * SHRINKS[codec, shuffle], f"{codec} sent {sent} of {size} bytes"
            # Chunks go to the least-loaded connection, so a fast receiver may see them all on one:
            # how they spread is not asserted, only that every connection is still up.
            assert all(p.is_open for p in [session.control, *session.data])
        finally:
            await session.close("transfer test done")
        assert server.alive(), server.stderr()

    arun(main())


@pytest.mark.parametrize("streams", STREAMS)
@pytest.mark.parametrize(("codec", "shuffle"), CODECS)
@pytest.mark.parametrize("size", SIZES)
def test_fragment_round_trip_between_processes(
    arun: Callable[..., object],
    bench_server: BenchServer,
    fragments: Fragments,
    size: int,
    codec: str,
    shuffle: int,
    streams: int,
) -> None:
    _round_trip(arun, bench_server, fragments, size, codec, shuffle, streams)


@pytest.mark.parametrize(
    ("codec", "shuffle", "streams"),
    [pytest.param("none", 0, 4, id="none-4conn"), pytest.param("zstd", 4, 2, id="zstd-shuffle-2conn")],
)
def test_256mib_round_trip_between_processes(
    arun: Callable[..., object],
    bench_server: BenchServer,
    fragments: Fragments,
    codec: str,
    shuffle: int,
    streams: int,
) -> None:
    _round_trip(arun, bench_server, fragments, 256 * MiB, codec, shuffle, streams)


def test_back_to_back_fragments_on_one_session(
    arun: Callable[..., object], bench_server: BenchServer, fragments: Fragments
) -> None:
    """One session carries fragments of different sizes and codecs in turn (buffers are reused
    by the server per size), each echoed bit-exact."""
    sizes = [1 * MiB + 17, 4 * KiB, 1 * MiB + 17, 3 * MiB]

    async def main() -> None:
        session = await connect("127.0.0.1", bench_server.port, peer_id="back-to-back", streams=2)
        try:
            for i, size in enumerate(sizes):
                codec = ("none", "lz4", "zstd")[i % 3]
                fragment = fragments.get(size)
                received = await echo(session, fragment, codec, shuffle=4 if codec != "none" else 0)
                assert_echo_matches(received, fragment, codec)
        finally:
            await session.close("done")

    arun(main())


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_uneven_last_chunk_that_compresses(
    arun: Callable[..., object], bench_server: BenchServer, codec: str
) -> None:
    """A last chunk whose length is not a multiple of the shuffle item size, and that compresses
    (zeros): it must not go out shuffled, which the receiver would refuse."""
    fragment = make_fragment(2 * MiB + 4099, zero_last_bytes=4099)

    async def main() -> None:
        session = await connect("127.0.0.1", bench_server.port, peer_id="uneven", streams=1)
        try:
            before = wire_bytes_sent(session)
            received = await echo(session, fragment, codec, shuffle=4)
            assert_echo_matches(received, fragment, codec)
            assert wire_bytes_sent(session) - before < fragment.raw_bytes
        finally:
            await session.close("done")

    arun(main())


@pytest.mark.parametrize(("codec", "shuffle"), [("none", 0), ("zstd", 4)])
def test_prepared_checksums_round_trip(
    arun: Callable[..., object], bench_server: BenchServer, fragments: Fragments, codec: str, shuffle: int
) -> None:
    """Checksums computed where the fragment is made are what the receiver verifies against."""
    fragment = fragments.get(3 * MiB + 17)
    checksums = chunk_checksums(fragment.data, CHUNK_BYTES)

    async def main() -> None:
        session = await connect("127.0.0.1", bench_server.port, peer_id="prepared", streams=2)
        try:
            async with asyncio.timeout(TRANSFER_TIMEOUT_S):
                await session.send_fragment(
                    fragment.push_header(codec), fragment.data, shuffle_item_size=shuffle, checksums=checksums
                )
                received = await recv_fragment(session)
            assert_echo_matches(received, fragment, codec)
        finally:
            await session.close("done")

    arun(main())


def test_buffer_changed_after_preparing_fails_the_transfer(
    arun: Callable[..., object], bench_server: BenchServer, fragments: Fragments
) -> None:
    """A fragment changed after its checksums were computed is refused by the receiver as a
    checksum mismatch (a retryable TransferFailed), never delivered; the session goes on, and a
    wrong number of checksums is the caller's error before anything is sent."""
    fragment = fragments.get(2 * MiB)
    checksums = chunk_checksums(fragment.data, CHUNK_BYTES)
    changed = bytearray(fragment.data)
    changed[MiB + 5] ^= 0x40

    async def main() -> None:
        session = await connect("127.0.0.1", bench_server.port, peer_id="changed", streams=2)
        try:
            with pytest.raises(ValueError, match="checksums"):
                await session.send_fragment(
                    fragment.push_header("none"), fragment.data, checksums=checksums[:1]
                )
            async with asyncio.timeout(TRANSFER_TIMEOUT_S):
                with pytest.raises(TransferFailed) as failed:
                    await session.send_fragment(fragment.push_header("none"), changed, checksums=checksums)
                assert failed.value.code == ErrorCode.CHECKSUM_MISMATCH
                received = await echo(session, fragment, "none", shuffle=0)
            assert_echo_matches(received, fragment, "none")
        finally:
            await session.close("done")

    arun(main())
