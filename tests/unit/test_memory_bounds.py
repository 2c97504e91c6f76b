"""What a peer can make this end hold, at the wire core and its asyncio adapter.

A frame's fresh buffer holds what arrived, not what the header declared (a slow peer costs what it
sent); a data connection is refused at its handshake by the server's admit rule; answers to the
peer's own frames (PONG) are cut off once too many wait unread; PING and PONG never reach the
application's queue. The adapter runs over an in-memory transport that records writes and drains
only when told to: no sockets, no sleeps.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from dilocod.transport.options import TransportOptions
from dilocod.transport.protocol import FrameProtocol
from dilocod.transport.session import Session
from dilocod.wire.connection import Connection
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.events import ChunkReceived, Event, HandshakeCompleted, MessageReceived, PeerWentAway
from dilocod.wire.frames import (
    CHUNK_HEADER_BYTES,
    ChunkHeader,
    Codec,
    FrameType,
    encode_chunk_header,
    encode_header,
)
from dilocod.wire.limits import DEFAULT_LIMITS, MiB, chunk_payload_bound
from dilocod.wire.manifest import pack_manifest
from dilocod.wire.messages import Hello, Ping, Pong, PushHeader, StatusRequest, StreamReset
from dilocod.wire.states import Role, State

Shuttle = Callable[[Connection, Connection], list[Event]]
Connect = Callable[..., tuple[Connection, Connection]]
TID = 7
#: What the tracer may see allocated while a large declared frame trickles in: a first piece
#: and bookkeeping, far below the megabytes declared.
TRICKLE_BUDGET_BYTES = 1 * MiB


def _peak_while(action: Any) -> int:
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_trickled_chunk_holds_what_arrived_not_what_it_declared(connect: Connect) -> None:
    """A compressed chunk (no destination slice to lend) declaring the largest payload, sent a
    kilobyte at a time: the receiver's buffer follows the bytes, and the chunk arrives whole."""
    _, server = connect("data", session=bytes(16))
    raw_length = DEFAULT_LIMITS.max_chunk_bytes
    declared = chunk_payload_bound(raw_length)
    head = encode_header(FrameType.CHUNK, TID, CHUNK_HEADER_BYTES + declared) + encode_chunk_header(
        ChunkHeader(0, raw_length, Codec.ZSTD, 0, 1)
    )
    peak = _peak_while(lambda: server.receive_data(head + bytes(1024)))
    assert peak < TRICKLE_BUDGET_BYTES, f"{peak} bytes held for 1 KiB of a {declared}-byte payload"
    assert server.mid_frame and server.state is State.OPEN
    payload = bytes(range(256)) * (declared // 256) + bytes(declared % 256)
    events = server.receive_data(payload[1024:])
    assert [type(e) for e in events] == [ChunkReceived]
    assert isinstance(events[0], ChunkReceived)
    assert events[0].payload == bytes(1024) + payload[1024:]


def test_a_trickled_control_body_holds_what_arrived(connect: Connect) -> None:
    _, server = connect()
    declared = DEFAULT_LIMITS.max_control_body_bytes
    peak = _peak_while(
        lambda: server.receive_data(encode_header(FrameType.PUSH_HEADER, TID, declared) + b"\x80")
    )
    assert peak < TRICKLE_BUDGET_BYTES, f"{peak} bytes held for 1 byte of a {declared}-byte body"


def test_admit_refuses_before_welcome(shuttle: Shuttle) -> None:
    """The server's admit rule runs once the client has proved itself and answers with ERROR in
    place of WELCOME: the client never opens."""
    seen: list[Hello] = []

    def admit(hello: Hello) -> None:
        seen.append(hello)
        raise RemoteProtocolError(ErrorCode.LIMIT_EXCEEDED, "the session holds 2 data connections")

    client = Connection(Role.CLIENT, secret=None, local_id="learner-1")
    server = Connection(Role.SERVER, secret=None, local_id="syncer", admit=admit)
    client.start(kind="data", role="learner", session=bytes(16))
    shuttle(client, server)
    shuttle(server, client)
    with pytest.raises(RemoteProtocolError):
        shuttle(client, server)
    (went,) = shuttle(server, client)
    assert isinstance(went, PeerWentAway) and went.error_code == ErrorCode.LIMIT_EXCEEDED
    assert "2 data connections" in went.reason
    assert client.state is State.CLOSED and client.peer is None
    assert [h.kind for h in seen] == ["data"]


# ------------------------------------------------------------------ the asyncio adapter


class _Transport(asyncio.Transport):
    """Records what is written; holds it as unsent until drain() (a peer that reads). A half-close
    (write_eof) is answered as a peer answers it, by closing: the connection is lost a turn later."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.unsent = 0
        self.closing = False
        self.eof = False
        self.reading = True
        self.protocol: FrameProtocol | None = None

    def writelines(self, data: Any) -> None:
        for piece in data:
            self.written += piece
            self.unsent += len(piece)

    def write(self, data: Any) -> None:
        self.writelines([data])

    def drain(self) -> None:
        self.unsent = 0

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return self.closing

    @property
    def ended(self) -> bool:
        """Our side is done sending: closed, or half-closed."""
        return self.closing or self.eof

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if not self.ended and self.protocol is not None:
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)
        self.eof = True

    def is_reading(self) -> bool:
        return self.reading

    def close(self) -> None:
        if not self.ended and self.protocol is not None:
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)
        self.closing = True

    def abort(self) -> None:
        self.close()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def _feed(proto: FrameProtocol, data: bytes) -> None:
    """What the event loop does for a BufferedProtocol: copy into get_buffer(), report the count."""
    view = memoryview(data)
    while view and not proto.closed.done() and not proto.ending:
        target = proto.get_buffer(-1)
        n = min(len(target), len(view))
        target[:n] = view[:n]
        proto.buffer_updated(n)
        view = view[n:]


def _open(options: TransportOptions) -> tuple[Connection, FrameProtocol, _Transport, HandshakeCompleted]:
    """A server FrameProtocol over the in-memory transport, handshaken with a client core."""
    client = Connection(Role.CLIENT, secret=None, local_id="learner-1")
    proto = FrameProtocol(Connection(Role.SERVER, secret=None, local_id="syncer"), options)
    transport = _Transport()
    transport.protocol = proto
    proto.connection_made(transport)
    client.start(kind="control", role="learner")
    for _ in range(2):
        _feed(proto, b"".join(bytes(b) for b in client.data_to_send()))
        client.receive_data(bytes(transport.written))
        transport.written.clear()
        transport.drain()
    assert proto.handshake.done() and client.state is State.OPEN
    return client, proto, transport, proto.handshake.result()


def _frames(data: bytes) -> list[Event]:
    """Decode what the server wrote with a fresh client core past its handshake."""
    reader = Connection(Role.CLIENT, secret=None)
    reader.state, reader.kind = State.OPEN, "control"
    try:
        return reader.receive_data(data)
    except RemoteProtocolError as exc:  # pragma: no cover - shows what was written
        raise AssertionError(f"server wrote bad frames: {exc}") from None


def test_pings_whose_pongs_are_unread_are_cut_off() -> None:
    """A peer that sends PINGs and never reads: once 64 KiB of PONGs wait unsent, the
    connection is closed with LIMIT_EXCEEDED instead of queueing answers for ever."""

    async def main() -> None:
        options = TransportOptions()
        client, proto, transport, _ = _open(options)
        _feed(proto, b"".join(_ping(client, i) for i in range(20_000)))
        assert proto.conn.state is State.CLOSED and transport.ended
        assert len(transport.written) < options.max_reply_backlog_bytes + 4096
        *pongs, error = _frames(bytes(transport.written))
        assert all(isinstance(e, MessageReceived) and isinstance(e.message, Pong) for e in pongs)
        assert isinstance(error, PeerWentAway) and error.error_code == ErrorCode.LIMIT_EXCEEDED
        assert "max_reply_backlog_bytes" in error.reason

    asyncio.run(main())


def test_pings_of_a_peer_that_reads_are_all_answered() -> None:
    async def main() -> None:
        client, proto, transport, _ = _open(TransportOptions())
        for i in range(20_000):
            _feed(proto, _ping(client, i))
            transport.drain()
        assert proto.is_open
        assert len(_frames(bytes(transport.written))) == 20_000

    asyncio.run(main())


def _ping(client: Connection, seq: int) -> bytes:
    client.send(Ping(seq))
    return b"".join(bytes(b) for b in client.data_to_send())


def test_ping_and_pong_never_reach_the_application() -> None:
    """PONG before JOIN is allowed (SPEC §4.4): the first message the application reads is the
    first that is not liveness."""

    async def main() -> None:
        client, proto, _, peer = _open(TransportOptions())
        with ThreadPoolExecutor(1) as executor:
            session = Session(
                proto,
                peer,
                role=Role.SERVER,
                options=TransportOptions(),
                limits=DEFAULT_LIMITS,
                executor=executor,
            )
            for message in [Pong(1), Ping(2), Pong(3), StatusRequest()]:
                client.send(message)
            _feed(proto, b"".join(bytes(b) for b in client.data_to_send()))
            async with asyncio.timeout(10.0):
                assert isinstance(await session.recv(), StatusRequest)
            await session.close()

    asyncio.run(main())


def test_nothing_is_read_between_the_handshake_and_the_session() -> None:
    """The session that bounds what a connection may hold (its chunk sink: early chunks, fresh
    buffers) is made by a callback of the handshake, which an event loop may run after the next
    read: until it attaches, the connection reads nothing, so no frame slips past its bounds."""

    async def main() -> None:
        _, proto, transport, peer = _open(TransportOptions())
        assert not transport.reading
        with ThreadPoolExecutor(1) as executor:
            role, options, limits = Role.SERVER, TransportOptions(), DEFAULT_LIMITS
            session = Session(proto, peer, role=role, options=options, limits=limits, executor=executor)
            assert transport.reading and proto.conn.chunk_sink is not None
            await session.close()

    asyncio.run(main())


def test_refused_pushes_whose_resets_are_unread_are_cut_off() -> None:
    """A peer that opens push after push the server refuses (not joined) and never reads the
    STREAM_RESETs: those answers are bounded like PONGs."""

    def refuse(header: object) -> memoryview:
        raise RemoteProtocolError(ErrorCode.NOT_JOINED, "a push before the learner has joined")

    async def main() -> None:
        options = TransportOptions()
        client, proto, transport, peer = _open(options)
        entries, raw = pack_manifest([("w", "float32", [16])])
        header = PushHeader(tuple(entries), raw, "none", 4096, fragment=0, round=0, base_version=0)
        with ThreadPoolExecutor(1) as executor:
            role, limits = Role.SERVER, DEFAULT_LIMITS
            session = Session(proto, peer, role=role, options=options, limits=limits, executor=executor)
            session.set_allocator(refuse, max_early_bytes=0)
            for transfer_id in range(1, 2 * 20_000, 2):
                client.send(header, transfer_id)
            _feed(proto, b"".join(bytes(b) for b in client.data_to_send()))
            assert proto.conn.state is State.CLOSED and transport.ended
            assert len(transport.written) < options.max_reply_backlog_bytes + 4096
            *resets, error = _frames(bytes(transport.written))
            assert resets
            assert all(isinstance(e, MessageReceived) and isinstance(e.message, StreamReset) for e in resets)
            assert isinstance(error, PeerWentAway) and error.error_code == ErrorCode.LIMIT_EXCEEDED
            await session.close()

    asyncio.run(main())
