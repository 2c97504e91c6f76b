"""A server session choosing where each inbound fragment lands, refusing some by their header,
and hearing about every opened transfer that failed: the seams the syncer admits pushes through.
Real sockets on loopback, both loop kinds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from devkit.transfers import (
    CHUNK_BYTES,
    TEST_OPTIONS,
    TRANSFER_TIMEOUT_S,
    Fragments,
    in_process_server,
    wait_until,
)
from dilocod.transport.endpoints import _dial, connect
from dilocod.transport.errors import HandshakeFailed, TransferFailed
from dilocod.transport.session import FragmentReceived, Session
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.limits import Limits, MiB
from dilocod.wire.stream import StreamHeader

Arun = Callable[..., object]


@dataclass
class Admitting:
    """Refuses pushes of odd rounds; records what was delivered and what failed after opening."""

    allocated: list[int] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)

    def allocate(self, header: StreamHeader) -> memoryview:
        round_ = getattr(header, "round", 0)
        if round_ % 2:
            raise RemoteProtocolError(ErrorCode.NOT_REQUESTED, f"round {round_} was not requested")
        self.allocated.append(round_)
        return memoryview(bytearray(header.raw_bytes))

    async def __call__(self, session: Session) -> None:
        session.set_allocator(self.allocate)
        session.on_inbound_failed = lambda cut: self.failed.append(getattr(cut.header, "round", -1))
        while True:
            item = await session.recv()
            if isinstance(item, FragmentReceived):
                self.delivered.append(getattr(item.header, "round", -1))


def test_refused_by_header_then_accepted(arun: Arun, fragments: Fragments) -> None:
    handler = Admitting()
    fragment = fragments.get(2 * MiB)

    async def main() -> None:
        async with in_process_server(handler) as (server, port):
            session = await connect("127.0.0.1", port, peer_id="admission", streams=2)
            try:
                async with asyncio.timeout(TRANSFER_TIMEOUT_S):
                    with pytest.raises(TransferFailed) as refused:
                        await session.send_fragment(fragment.push_header("none", round_=1), fragment.data)
                    assert refused.value.code == ErrorCode.NOT_REQUESTED
                    assert "round 1 was not requested" in refused.value.message
                    await session.send_fragment(fragment.push_header("zstd", round_=2), fragment.data)
                    await wait_until(lambda: handler.delivered == [2], TRANSFER_TIMEOUT_S)
            finally:
                await session.close("done")
            assert not server.handler_errors

    arun(main())
    assert handler.allocated == [2] and handler.failed == []


def test_opened_transfers_that_fail_are_reported(arun: Arun, fragments: Fragments) -> None:
    """A checksum failure after the buffer was allocated, and a session that goes away with a
    push half sent, each give the buffer back through on_inbound_failed."""
    handler = Admitting()
    fragment = fragments.get(4 * MiB)
    checksums = chunk_checksums(fragment.data, CHUNK_BYTES)
    changed = bytearray(fragment.data)
    changed[-1] ^= 1

    async def main() -> None:
        async with in_process_server(handler) as (_server, port):
            session = await connect("127.0.0.1", port, peer_id="failing", streams=1)
            async with asyncio.timeout(TRANSFER_TIMEOUT_S):
                with pytest.raises(TransferFailed):
                    await session.send_fragment(
                        fragment.push_header("none", round_=4), changed, checksums=checksums
                    )
                await wait_until(lambda: handler.failed == [4], TRANSFER_TIMEOUT_S)
                # The header and one chunk, then the client vanishes mid-fragment.
                header = fragment.push_header("none", round_=6)
                session.control.send(header, 101)
                await wait_until(lambda: handler.allocated == [4, 6], TRANSFER_TIMEOUT_S)
                assert session.control.transport is not None
                session.control.transport.abort()
                await wait_until(lambda: handler.failed == [4, 6], TRANSFER_TIMEOUT_S)

    arun(main())
    assert handler.delivered == []


def test_a_data_connection_beyond_the_limit_is_refused_at_its_handshake(arun: Arun) -> None:
    """The (k+1)-th data connection of a session gets ERROR LIMIT_EXCEEDED in place of WELCOME,
    so the dial fails then and there; a slot freed by a lost connection can be taken again."""
    handler = Admitting()

    async def main() -> None:
        async with in_process_server(handler, limits=Limits(max_data_connections=2)) as (server, port):
            with pytest.raises(HandshakeFailed) as refused:
                await connect("127.0.0.1", port, peer_id="greedy", streams=3)
            assert refused.value.code == ErrorCode.LIMIT_EXCEEDED
            assert "max_data_connections = 2" in refused.value.message
            session = await connect("127.0.0.1", port, peer_id="modest", streams=2)
            try:
                (held,) = server.sessions.values()
                await wait_until(lambda: len(held.data) == 2, TRANSFER_TIMEOUT_S)
                assert session.data[0].transport is not None
                session.data[0].transport.abort()
                await wait_until(lambda: len(held.data) == 1, TRANSFER_TIMEOUT_S)
                proto, _ = await _dial(
                    "127.0.0.1",
                    port,
                    peer_id="modest",
                    role="learner",
                    kind="data",
                    session=session.session_id,
                    secret=None,
                    ssl=None,
                    options=TEST_OPTIONS,
                    limits=Limits(),
                )
                session.attach_data(proto)
                await wait_until(lambda: len(held.data) == 2, TRANSFER_TIMEOUT_S)
            finally:
                await session.close("done")

    arun(main())
