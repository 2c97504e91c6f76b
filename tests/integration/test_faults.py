"""Faults on real sockets: data connections that die mid-fragment, bad input of every kind against
a real `dilocod bench serve` process, and mutual TLS.

The rules under test: a lost data connection loses no chunk that another connection can resend,
and never yields a corrupt fragment; bad input is the peer's fault, so that connection gets an
ERROR frame (or its transfer a STREAM_RESET) and is closed, while the same server process goes on
serving good clients, which every bad-input test checks with a whole fragment round trip.
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
from collections.abc import Callable

import lz4.block
import msgpack
import pytest
import zstandard

from devkit.transfers import (
    CHUNK_BYTES,
    REPLY_TIMEOUT_S,
    SMALL_BUFFERS,
    BenchServer,
    BenchServers,
    CoreClient,
    EchoHandler,
    Fragment,
    Fragments,
    RawReply,
    TlsSet,
    assert_echo_matches,
    check_serves,
    echo,
    in_process_server,
    kill_when_queued,
    raw_exchange,
    read_until_closed,
    recv_fragment,
)
from dilocod.linkbench.serve import ECHO_ROUND
from dilocod.transport import endpoints
from dilocod.transport.credentials import client_context, server_context
from dilocod.transport.endpoints import connect
from dilocod.transport.errors import HandshakeFailed, SessionClosed
from dilocod.transport.loop import run
from dilocod.transport.options import TransportOptions
from dilocod.transport.protocol import FrameProtocol
from dilocod.transport.session import Session
from dilocod.wire import codecs
from dilocod.wire.connection import PROTOCOL_MAX_VERSION, Connection, Role
from dilocod.wire.errors import ErrorCode
from dilocod.wire.events import ChunkReceived, MessageReceived
from dilocod.wire.frames import (
    CHUNK_HEADER_BYTES,
    FRAME_VERSION,
    HEADER,
    MAGIC,
    ChunkHeader,
    Codec,
    FrameType,
    encode_chunk_header,
)
from dilocod.wire.limits import Limits, MiB
from dilocod.wire.messages import (
    CHUNK_RESEND_CAPABILITY,
    NONCE_BYTES,
    AuthResponse,
    ChunkResend,
    FragmentAck,
    FragmentEnd,
    Goodbye,
    Hello,
    StatusRequest,
    StatusResponse,
    StepReport,
    StreamReset,
    UpdateHeader,
    encode_body,
)
from dilocod.wire.stream import MIN_CHUNK_RESENDS

Arun = Callable[..., object]
PUSH_BYTES = 64 * MiB
#: The short deadline given to the stall server (`bench serve --stall-timeout-s`).
STALL_S = 1.5
#: A stalled connection must be cut off by then: the deadline, plus its check period (a quarter
#: of it), plus scheduling slack on a busy machine.
STALL_CUTOFF_S = STALL_S * 1.25 + 4.0


def _serves(server: BenchServer, fragments: Fragments) -> None:
    run(check_serves(server, fragments.get(MiB + 17)))


# ------------------------------------------------------------------ (a) a data connection dies


async def _push_while_killing(
    session: Session, fragments: Fragments, codec: str, *, every: bool = False
) -> None:
    """Push a large fragment while aborting the busiest data connection (or every one) mid-
    fragment; the push must complete and its echo be bit-exact."""
    fragment = fragments.get(PUSH_BYTES)
    before = list(session.data)
    killed: list[int] = []
    async with asyncio.TaskGroup() as tasks:
        kill = tasks.create_task(kill_when_queued(session, fragment.raw_bytes, killed, every=every))
        await session.send_fragment(
            fragment.push_header(codec), fragment.data, shuffle_item_size=4 if codec != "none" else 0
        )
        pushed_first = not kill.done()
        kill.cancel()
    assert not pushed_first, "the push completed before any connection was killed"
    assert killed and killed[0] < fragment.raw_bytes
    lost = [p for p in before if not p.is_open]
    assert len(lost) == (len(before) if every else 1)
    assert all(p not in session.data for p in lost)
    assert_echo_matches(await recv_fragment(session), fragment, codec)


KILL_CASES = [
    pytest.param("none", 4, id="none-4conn"),
    pytest.param("none", 2, id="none-2conn"),
    pytest.param("zstd", 2, id="zstd-shuffle-2conn"),
]


@pytest.mark.parametrize(("codec", "streams"), KILL_CASES)
def test_data_connection_killed_mid_push_in_process(
    arun: Arun, fragments: Fragments, codec: str, streams: int
) -> None:
    """The push completes on the surviving connections, bit-exact, and the server's session
    never delivers anything but the original bytes."""
    handler = EchoHandler()

    async def main() -> None:
        async with in_process_server(handler, options=SMALL_BUFFERS) as (server, port):
            session = await connect(
                "127.0.0.1", port, peer_id="victim", streams=streams, options=SMALL_BUFFERS
            )
            try:
                await _push_while_killing(session, fragments, codec)
                assert len(session.data) == streams - 1
                # The survivors go on carrying fragments.
                small = fragments.get(MiB + 17)
                assert_echo_matches(await echo(session, small, codec, shuffle=4), small, codec)
            finally:
                await session.close("done")
            assert not server.handler_errors

    arun(main())
    original = fragments.get(PUSH_BYTES).digest
    assert handler.delivered[0] == original
    assert handler.update_failures == []


def test_every_data_connection_killed_mid_push_falls_back_to_control(
    arun: Arun, fragments: Fragments
) -> None:
    """With no data connection left, the rest of the fragment travels on the control connection."""
    handler = EchoHandler()

    async def main() -> None:
        async with in_process_server(handler, options=SMALL_BUFFERS) as (_, port):
            session = await connect("127.0.0.1", port, peer_id="victim", streams=2, options=SMALL_BUFFERS)
            try:
                await _push_while_killing(session, fragments, "none", every=True)
                assert session.data == []
            finally:
                await session.close("done")

    arun(main())
    assert handler.delivered == [fragments.get(PUSH_BYTES).digest]


def test_a_session_is_closed_once_its_control_connection_closes(arun: Arun) -> None:
    """The control connection closes (here: it gives up on the peer, as on bad input or a deadline)
    a turn of the event loop before its transport reports the loss that finishes the session. In
    between the session is not open and sending on it is SessionClosed, the error every caller
    handles, not the core's LocalProtocolError (which once escaped a learner's step report and
    killed its network process under the chaos suite)."""

    async def main() -> None:
        async with in_process_server(EchoHandler(), options=SMALL_BUFFERS) as (_, port):
            session = await connect("127.0.0.1", port, peer_id="closing", streams=1, options=SMALL_BUFFERS)
            try:
                assert session.is_open
                session.control.abort(ErrorCode.TIMEOUT, "test: the peer is given up on")
                assert not session.closed.is_set()  # the loss is not reported yet
                assert not session.is_open
                with pytest.raises(SessionClosed):
                    await session.send(StepReport(1, 1, 0.1))
                async with asyncio.timeout(REPLY_TIMEOUT_S):
                    await session.closed.wait()
            finally:
                await session.close("done")

    arun(main())


def _peer_ended(sock: socket.socket, timeout_s: float) -> bool:
    """Wait (in a thread) until the other side has ended its half: a FIN or a reset."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(int(timeout_s * 1000)))


def test_a_goodbye_said_over_unread_input_reaches_a_peer_that_writes_on(arun: Arun) -> None:
    """A side that says GOODBYE while the peer's bytes wait unread must not close with a reset:
    the kernel would drop the GOODBYE if still queued, and a peer that writes on (a learner
    mid-push) fails on the write before it reads the GOODBYE. Found by CI: a learner reported
    "connection reset by peer" where the syncer had said "syncer shutting down". The side
    half-closes, drops what it still reads, and closes on the peer's FIN."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with socket.create_server(("127.0.0.1", 0)) as listener:
            conn = Connection(Role.SERVER, secret=None)
            _, proto = await loop.create_connection(
                lambda: FrameProtocol(conn, SMALL_BUFFERS), *listener.getsockname()
            )
            assert proto.transport is not None
            proto.transport.pause_reading()  # what the peer sends now waits unread
            peer, _ = listener.accept()
            with peer:
                peer.sendall(bytes(16 * 1024))
                proto.go_away("test: going away")
                assert await loop.run_in_executor(None, _peer_ended, peer, REPLY_TIMEOUT_S)
                peer.sendall(b"more, from a peer still pushing")  # ConnectionResetError after a reset
                reply = read_until_closed(peer)
                assert reply.closed and not reply.reset, reply
                assert [(f.frame_type, f.message) for f in reply.frames] == [
                    (FrameType.GOODBYE, Goodbye("test: going away"))
                ]
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                await proto.closed
            assert proto.error is None

    arun(main())


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_server_loses_data_connection_mid_update(arun: Arun, fragments: Fragments, codec: str) -> None:
    """The sending side may be the server: it aborts one of its own data connections while the
    update is in flight, and the client still receives exactly the original bytes."""
    handler = EchoHandler(kill_during_update=True)
    fragment = fragments.get(PUSH_BYTES)

    async def main() -> None:
        async with in_process_server(handler, options=SMALL_BUFFERS) as (_, port):
            session = await connect("127.0.0.1", port, peer_id="receiver", streams=4)
            try:
                received = await echo(session, fragment, codec, shuffle=4 if codec != "none" else 0)
                assert_echo_matches(received, fragment, codec)
                assert len(handler.killed_at) == 1
            finally:
                await session.close("done")

    arun(main())
    assert handler.update_failures == []


@pytest.mark.parametrize(("codec", "streams"), KILL_CASES)
def test_data_connection_killed_mid_push_against_server_process(
    arun: Arun, bench_server: BenchServer, fragments: Fragments, codec: str, streams: int
) -> None:
    async def main() -> None:
        session = await connect(
            "127.0.0.1", bench_server.port, peer_id="victim", streams=streams, options=SMALL_BUFFERS
        )
        try:
            await _push_while_killing(session, fragments, codec)
        finally:
            await session.close("done")
        await check_serves(bench_server, fragments.get(MiB + 17))

    arun(main())


def test_resent_chunk_that_overtakes_the_lost_connection(
    bench_servers: BenchServers, fragments: Fragments
) -> None:
    """The sender resends a chunk (on another connection) before the receiver notices that the
    connection first carrying it died half way through: the copy must not be lost as a duplicate.
    A hand-built client makes that order (near) certain."""
    server = bench_servers.get()
    fragment = fragments.get(2 * CHUNK_BYTES)
    raw = memoryview(fragment.data)
    chunks = [
        ChunkHeader(seq, CHUNK_BYTES, Codec.NONE, 0, codecs.checksum(raw[seq * CHUNK_BYTES :][:CHUNK_BYTES]))
        for seq in range(2)
    ]
    with CoreClient(server.port) as control:
        data = CoreClient(server.port, kind="data", session=control.peer.session)
        control.conn.send(fragment.push_header("none", round_=0), 1)
        control.sync()  # the server knows the transfer, so chunk 0 will be read in place
        # Half of chunk 0 on the data connection: the server reads it straight into its slot.
        head = HEADER.pack(MAGIC, FRAME_VERSION, FrameType.CHUNK, 0, 0, 1, CHUNK_HEADER_BYTES + CHUNK_BYTES)
        data.sock.sendall(head + encode_chunk_header(chunks[0]) + raw[: CHUNK_BYTES // 2])
        # On loopback those bytes sit in the server's socket before this round trip starts, and
        # its loop serves sockets in the order they became readable.
        control.sync()
        # Both chunks, whole, on the control connection: chunk 0 is a copy of one still arriving.
        for seq, chunk in enumerate(chunks):
            control.conn.send_chunk(1, chunk, raw[seq * CHUNK_BYTES :][:CHUNK_BYTES])
        control.sync()
        data.close()  # only now does the first carrier of chunk 0 die
        control.conn.send(FragmentEnd(2, codecs.fragment_digest([c.checksum for c in chunks])), 1)
        control.flush()
        done = control.wait_for(
            lambda e: isinstance(e, MessageReceived) and isinstance(e.message, FragmentAck | StreamReset)
        )
        assert isinstance(done, MessageReceived)
        assert done.message == FragmentAck() and done.stream_id == 1, done
    _serves(server, fragments)


# ------------------------------------------------------------------ (b) bad input, raw sockets


def _header(
    frame_type: int = FrameType.HELLO,
    length: int = 0,
    *,
    magic: int = MAGIC,
    version: int = FRAME_VERSION,
    flags: int = 0,
    stream_id: int = 0,
) -> bytes:
    return HEADER.pack(magic, version, frame_type, flags, 0, stream_id, length)


def _hello(min_version: int = 1, max_version: int = PROTOCOL_MAX_VERSION) -> bytes:
    body = encode_body(Hello(min_version, max_version, "control", "learner", "raw", bytes(NONCE_BYTES)))
    return _header(FrameType.HELLO, len(body)) + body


def _refused(reply: RawReply, code: ErrorCode, *, after: tuple[FrameType, ...] = ()) -> None:
    """The peer sent exactly `after` frames, then ERROR with `code`, and closed."""
    assert reply.closed, f"connection still open after {reply.elapsed_s:.1f} s"
    types = [f.frame_type for f in reply.frames]
    assert types == [*after, FrameType.ERROR], reply.frames
    error = reply.frames[-1].message
    assert error is not None and error.code == code, error  # type: ignore[union-attr]


_GARBAGE = bytes((i * 131 + 7) % 256 for i in range(64 * 1024))

BAD_INPUT = [
    pytest.param(_GARBAGE[:16], ErrorCode.BAD_MAGIC, (), id="garbage-16-bytes"),
    pytest.param(_GARBAGE, ErrorCode.BAD_MAGIC, (), id="garbage-64KiB"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: syncer\r\n\r\n", ErrorCode.BAD_MAGIC, (), id="http-request"),
    pytest.param(_header(magic=0xBEEF, length=8) + bytes(8), ErrorCode.BAD_MAGIC, (), id="wrong-magic"),
    pytest.param(_header(version=2, length=8) + bytes(8), ErrorCode.UNSUPPORTED_VERSION, (), id="frame-v2"),
    pytest.param(_header(length=2**31), ErrorCode.FRAME_TOO_LARGE, (), id="length-above-limit"),
    pytest.param(_header(length=64 * 1024), ErrorCode.FRAME_TOO_LARGE, (), id="hello-above-handshake-cap"),
    pytest.param(_header(0x7F), ErrorCode.UNKNOWN_FRAME_TYPE, (), id="unknown-frame-type"),
    pytest.param(_header(flags=1, length=4), ErrorCode.BAD_RESERVED, (), id="nonzero-flags"),
    pytest.param(
        _header(FrameType.CHUNK, CHUNK_HEADER_BYTES + 64, stream_id=1) + bytes(CHUNK_HEADER_BYTES + 64),
        ErrorCode.UNEXPECTED_FRAME,
        (),
        id="chunk-before-auth",
    ),
    pytest.param(
        _header(FrameType.STATUS_REQUEST, 1) + b"\x80", ErrorCode.UNEXPECTED_FRAME, (), id="status-first"
    ),
    pytest.param(
        _hello() + _header(FrameType.STATUS_REQUEST, 1) + b"\x80",
        ErrorCode.UNEXPECTED_FRAME,
        (FrameType.AUTH_CHALLENGE,),
        id="status-before-auth-response",
    ),
    pytest.param(_header(length=5) + b"\xc1" * 5, ErrorCode.MALFORMED_BODY, (), id="hello-not-msgpack"),
    pytest.param(
        _header(length=len(b := msgpack.packb({"kind": "control"}))) + b,
        ErrorCode.MALFORMED_BODY,
        (),
        id="hello-missing-fields",
    ),
    pytest.param(_hello(4, 5), ErrorCode.UNSUPPORTED_VERSION, (), id="hello-only-versions-4-5"),
]


@pytest.mark.parametrize(("payload", "code", "after"), BAD_INPUT)
def test_bad_input_gets_error_frame_and_close(
    bench_servers: BenchServers,
    fragments: Fragments,
    payload: bytes,
    code: ErrorCode,
    after: tuple[FrameType, ...],
) -> None:
    server = bench_servers.get()
    _refused(raw_exchange(server.port, payload), code, after=after)
    _serves(server, fragments)


TRUNCATED = [
    pytest.param(_header(length=200)[:8], id="half-a-header"),
    pytest.param(_header(length=200) + bytes(50), id="quarter-of-a-body"),
    pytest.param(_hello()[:-3], id="hello-minus-three-bytes"),
]


@pytest.mark.parametrize("payload", TRUNCATED)
def test_truncated_frame_then_close(
    bench_servers: BenchServers, fragments: Fragments, payload: bytes
) -> None:
    """A peer that sends part of a frame and closes its socket altogether."""
    server = bench_servers.get()
    raw_exchange(server.port, payload, timeout_s=0.001)  # closes straight after sending
    _serves(server, fragments)


@pytest.mark.parametrize("payload", TRUNCATED)
def test_truncated_frame_then_half_close(
    bench_servers: BenchServers, fragments: Fragments, payload: bytes
) -> None:
    """A peer that sends part of a frame and shuts its sending side: the server closes too. No
    ERROR frame: protocol/SPEC.md §9 sends TRUNCATED as nothing (the connection is gone)."""
    server = bench_servers.get()
    reply = raw_exchange(server.port, payload, shut_write=True)
    assert reply.closed and reply.frames == []
    _serves(server, fragments)


class _ResetOnArrival(FrameProtocol):
    """A connection the network resets as soon as it is made (a refusing proxy, a middlebox)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.abort()  # type: ignore[attr-defined]


class _ClosedOnArrival(FrameProtocol):
    """A connection whose peer closes it (FIN) as soon as it is made: its end of file has reached
    the protocol core, the transport is not closed yet (uvloop can order it so), and the dialer
    has not sent HELLO."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.conn.receive_eof()


@pytest.mark.parametrize("protocol", [_ResetOnArrival, _ClosedOnArrival], ids=["reset", "closed"])
def test_a_connection_lost_before_the_handshake_is_a_connection_error(
    arun: Arun, monkeypatch: pytest.MonkeyPatch, protocol: type[FrameProtocol]
) -> None:
    """Lost between the TCP connect and HELLO: the dialer sees a ConnectionError to retry (found
    by tests/chaos: it was a LocalProtocolError, "HELLO after close", that ended a learner)."""
    monkeypatch.setattr(endpoints, "FrameProtocol", protocol)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # the kernel completes the connect

        async def main() -> None:
            for _ in range(5):
                with pytest.raises(ConnectionError):
                    await connect("127.0.0.1", listener.getsockname()[1], peer_id="learner", streams=0)

        arun(main())


def test_data_connection_for_unknown_session(bench_servers: BenchServers, fragments: Fragments) -> None:
    """Refused at its handshake: ERROR in place of WELCOME, so the dial itself fails."""
    server = bench_servers.get()

    async def main() -> None:
        with pytest.raises(HandshakeFailed) as refused:
            await endpoints._dial(
                "127.0.0.1",
                server.port,
                peer_id="stray",
                role="learner",
                kind="data",
                session=b"\x01" * 16,
                secret=None,
                ssl=None,
                options=TransportOptions(),
                limits=Limits(),
            )
        assert refused.value.code is ErrorCode.UNKNOWN_SESSION

    run(main())
    _serves(server, fragments)


# ---------------------------------------------------------------------------- authentication


WRONG_SECRET = b"not-the-secret-" * 3


def test_wrong_secret_is_refused(arun: Arun, bench_servers: BenchServers, fragments: Fragments) -> None:
    server = bench_servers.get(secure=True)

    async def main() -> None:
        with pytest.raises(HandshakeFailed) as refused:
            await connect("127.0.0.1", server.port, peer_id="intruder", secret=WRONG_SECRET)
        assert refused.value.code is ErrorCode.AUTH_FAILED
        await check_serves(server, fragments.get(MiB + 17))

    arun(main())


def test_missing_secret_is_refused(arun: Arun, bench_servers: BenchServers, fragments: Fragments) -> None:
    server = bench_servers.get(secure=True)

    async def main() -> None:
        with pytest.raises(HandshakeFailed) as refused:
            await connect("127.0.0.1", server.port, peer_id="anonymous", secret=None)
        assert refused.value.code is ErrorCode.AUTH_REQUIRED
        await check_serves(server, fragments.get(MiB + 17))

    arun(main())


def test_client_with_secret_refuses_insecure_server(
    arun: Arun, bench_servers: BenchServers, fragments: Fragments
) -> None:
    """A server that skips authentication while the client holds a key may be an impostor."""
    server = bench_servers.get()

    async def main() -> None:
        with pytest.raises(HandshakeFailed) as refused:
            await connect("127.0.0.1", server.port, peer_id="careful", secret=WRONG_SECRET)
        assert refused.value.code is ErrorCode.AUTH_REQUIRED
        await check_serves(server, fragments.get(MiB + 17))

    arun(main())


def test_wrong_mac_from_hand_built_client(bench_servers: BenchServers, fragments: Fragments) -> None:
    """The refusal as the wire shows it: AUTH_CHALLENGE, then ERROR AUTH_FAILED, then close."""
    server = bench_servers.get(secure=True)
    forged = encode_body(AuthResponse(bytes(32)))
    reply = raw_exchange(server.port, _hello() + _header(FrameType.AUTH_RESPONSE, len(forged)) + forged)
    _refused(reply, ErrorCode.AUTH_FAILED, after=(FrameType.AUTH_CHALLENGE,))
    _serves(server, fragments)


# ----------------------------------------------------------------------------- stalled senders


def test_stall_mid_header_before_handshake(bench_servers: BenchServers, fragments: Fragments) -> None:
    server = bench_servers.get(stall_timeout_s=STALL_S)
    reply = raw_exchange(server.port, _header(length=100)[:8], timeout_s=STALL_CUTOFF_S)
    _refused(reply, ErrorCode.TIMEOUT)
    assert STALL_S * 0.9 <= reply.elapsed_s <= STALL_CUTOFF_S
    _serves(server, fragments)


@pytest.mark.parametrize(
    "partial",
    [
        pytest.param(_header(FrameType.STATUS_REQUEST, 1)[:7], id="half-a-header"),
        pytest.param(_header(FrameType.STATUS_REQUEST, 1), id="header-without-body"),
    ],
)
def test_stall_mid_frame_after_handshake(
    bench_servers: BenchServers, fragments: Fragments, partial: bytes
) -> None:
    server = bench_servers.get(stall_timeout_s=STALL_S)
    with CoreClient(server.port) as client:
        client.sock.sendall(partial)
        reply = read_until_closed(client.sock, STALL_CUTOFF_S)
    _refused(reply, ErrorCode.TIMEOUT)
    assert STALL_S * 0.9 <= reply.elapsed_s <= STALL_CUTOFF_S
    _serves(server, fragments)


def test_quiet_between_frames_is_not_a_stall(bench_servers: BenchServers, fragments: Fragments) -> None:
    """Silence between whole frames is left to the idle timeout (pings), not cut off as a stall."""
    server = bench_servers.get(stall_timeout_s=STALL_S)
    with CoreClient(server.port) as client:
        reply = read_until_closed(client.sock, STALL_S * 2.5)
        assert not reply.closed and reply.frames == []
        client.conn.send(StatusRequest())
        client.flush()
        client.wait_for(lambda e: isinstance(e, MessageReceived) and isinstance(e.message, StatusResponse))
    _serves(server, fragments)


# -------------------------------------------------------------- bad chunks from a real session


def _push(
    client: CoreClient,
    transfer_id: int,
    fragment: Fragment,
    chunks: list[tuple[ChunkHeader, bytes | memoryview]],
    *,
    digest: int | None = None,
    echo: bool = False,
) -> None:
    """Push a fragment by hand: header, the given chunks, end marker (with their digest unless
    told otherwise). round 0: the bench server keeps it rather than echoing it (echo: it sends
    it back as an update)."""
    client.conn.send(fragment.push_header("zstd", round_=ECHO_ROUND if echo else 0), transfer_id)
    for chunk, payload in chunks:
        client.conn.send_chunk(transfer_id, chunk, payload)
    if digest is None:
        digest = codecs.fragment_digest([chunk.checksum for chunk, _ in chunks])
    client.conn.send(FragmentEnd(len(chunks), digest), transfer_id)
    client.flush()


def _verdict(client: CoreClient, transfer_id: int) -> FragmentAck | StreamReset:
    event = client.wait_for(
        lambda e: (
            isinstance(e, MessageReceived)
            and e.stream_id == transfer_id
            and isinstance(e.message, FragmentAck | StreamReset)
        )
    )
    assert isinstance(event, MessageReceived)
    assert isinstance(event.message, FragmentAck | StreamReset)
    return event.message


def _good_chunk(fragment: Fragment) -> tuple[ChunkHeader, memoryview]:
    raw = memoryview(fragment.data)
    return ChunkHeader(0, len(raw), Codec.NONE, 0, codecs.checksum(raw)), raw


def _zstd_bomb(size_bytes: int, *, declare_size: bool) -> bytes:
    """A small zstd frame of size_bytes zeros, made without holding them all in memory."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=declare_size)
    stream = compressor.compressobj(size=size_bytes if declare_size else -1)
    block = bytes(16 * MiB)
    parts = [stream.compress(block) for _ in range(size_bytes // len(block))]
    return b"".join([*parts, stream.flush()])


@pytest.fixture(scope="module")
def bad_chunk_server(bench_servers: BenchServers) -> BenchServer:
    """A server of its own, so its peak memory reflects only what these tests sent it."""
    return bench_servers.get(name="bad-chunks")


@pytest.mark.parametrize(
    ("codec", "shuffle"),
    [
        pytest.param(Codec.NONE, 0, id="none"),
        pytest.param(Codec.LZ4, 4, id="lz4-shuffle"),
        pytest.param(Codec.ZSTD, 4, id="zstd-shuffle"),
    ],
)
def test_chunk_with_wrong_checksum_resets_the_transfer(
    bad_chunk_server: BenchServer, fragments: Fragments, codec: Codec, shuffle: int
) -> None:
    """The transfer is reset with CHECKSUM_MISMATCH and nothing is acknowledged; the connection
    itself stays open and carries a correct push right after."""
    fragment = fragments.get(CHUNK_BYTES)
    used, used_shuffle, payload = codecs.compress(codec, fragment.data, shuffle)
    assert used is codec  # gradients compress: the bad chunk really goes through the decoder
    wrong = ChunkHeader(0, CHUNK_BYTES, used, used_shuffle, codecs.checksum(fragment.data) ^ 1)
    with CoreClient(bad_chunk_server.port) as client:
        _push(client, 1, fragment, [(wrong, payload)])
        verdict = _verdict(client, 1)
        assert isinstance(verdict, StreamReset) and verdict.code == ErrorCode.CHECKSUM_MISMATCH, verdict
        _push(client, 3, fragment, [_good_chunk(fragment)])
        assert _verdict(client, 3) == FragmentAck()
    _serves(bad_chunk_server, fragments)


@pytest.mark.parametrize(
    ("codec", "shuffle"),
    [
        pytest.param(Codec.NONE, 0, id="none"),
        pytest.param(Codec.ZSTD, 4, id="zstd-shuffle"),
    ],
)
def test_a_damaged_chunk_is_asked_for_again_from_a_peer_that_resends(
    bad_chunk_server: BenchServer, fragments: Fragments, codec: Codec, shuffle: int
) -> None:
    """A client that lists chunk-resend (SPEC §5.12) is asked for a damaged chunk again
    (CHUNK_RESEND with its seq) instead of having the transfer reset; the copy it sends completes
    the transfer. Past the transfer's allowance (8 for a one-chunk transfer) it is reset."""
    fragment = fragments.get(CHUNK_BYTES)
    used, used_shuffle, payload = codecs.compress(codec, fragment.data, shuffle)
    assert used is codec
    good = ChunkHeader(0, CHUNK_BYTES, used, used_shuffle, codecs.checksum(fragment.data))
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0x10

    def asked(client: CoreClient, transfer_id: int) -> ChunkResend | StreamReset:
        event = client.wait_for(
            lambda e: (
                isinstance(e, MessageReceived)
                and e.stream_id == transfer_id
                and isinstance(e.message, ChunkResend | StreamReset | FragmentAck)
            )
        )
        assert isinstance(event, MessageReceived)
        assert isinstance(event.message, ChunkResend | StreamReset), event.message
        return event.message

    with CoreClient(bad_chunk_server.port, capabilities=(CHUNK_RESEND_CAPABILITY,)) as client:
        _push(client, 1, fragment, [(good, damaged)])
        assert asked(client, 1) == ChunkResend(0)
        client.conn.send_chunk(1, good, payload)
        client.flush()
        assert _verdict(client, 1) == FragmentAck()
        # Damaged every time: asked again MIN_CHUNK_RESENDS times, then reset.
        _push(client, 3, fragment, [(good, damaged)])
        for _ in range(MIN_CHUNK_RESENDS):
            assert asked(client, 3) == ChunkResend(0)
            client.conn.send_chunk(3, good, damaged)
            client.flush()
        verdict = asked(client, 3)
        assert isinstance(verdict, StreamReset) and verdict.code in (
            ErrorCode.CHECKSUM_MISMATCH,
            ErrorCode.LENGTH_MISMATCH,
        ), verdict
    _serves(bad_chunk_server, fragments)


def test_a_peer_that_asks_for_chunks_again_and_again_has_the_transfer_reset(
    bad_chunk_server: BenchServer, fragments: Fragments
) -> None:
    """The sender's side of SPEC §5.12: a receiver may not have a transfer sent over and over. The
    server echoes a push as an update; asked for its one chunk again past the allowance (8), it
    resets that update with LIMIT_EXCEEDED, and the session goes on."""
    fragment = fragments.get(CHUNK_BYTES)
    with CoreClient(bad_chunk_server.port, capabilities=(CHUNK_RESEND_CAPABILITY,)) as client:
        _push(client, 1, fragment, [_good_chunk(fragment)], echo=True)
        assert _verdict(client, 1) == FragmentAck()
        header = client.wait_for(
            lambda e: isinstance(e, MessageReceived) and isinstance(e.message, UpdateHeader)
        )
        assert isinstance(header, MessageReceived)
        update_id = header.stream_id
        for _ in range(MIN_CHUNK_RESENDS + 1):
            client.wait_for(lambda e: isinstance(e, ChunkReceived) and e.transfer_id == update_id)
            client.conn.send(ChunkResend(0), update_id)
            client.flush()
        reset = client.wait_for(
            lambda e: (
                isinstance(e, MessageReceived)
                and e.stream_id == update_id
                and isinstance(e.message, StreamReset)
            )
        )
        assert isinstance(reset, MessageReceived) and isinstance(reset.message, StreamReset)
        assert reset.message.code == ErrorCode.LIMIT_EXCEEDED
        _push(client, 3, fragment, [_good_chunk(fragment)])
        assert _verdict(client, 3) == FragmentAck()
    _serves(bad_chunk_server, fragments)


def test_end_digest_mismatch_resets_the_transfer(bad_chunk_server: BenchServer, fragments: Fragments) -> None:
    fragment = fragments.get(CHUNK_BYTES)
    chunk = _good_chunk(fragment)
    with CoreClient(bad_chunk_server.port) as client:
        _push(client, 1, fragment, [chunk], digest=codecs.fragment_digest([chunk[0].checksum]) ^ 1)
        verdict = _verdict(client, 1)
        assert isinstance(verdict, StreamReset) and verdict.code == ErrorCode.DIGEST_MISMATCH, verdict
    _serves(bad_chunk_server, fragments)


BOMBS = [
    pytest.param(Codec.ZSTD, lambda: _zstd_bomb(1 << 30, declare_size=False), id="zstd-1GiB-undeclared"),
    pytest.param(Codec.ZSTD, lambda: _zstd_bomb(1 << 30, declare_size=True), id="zstd-1GiB-declared"),
    pytest.param(Codec.LZ4, lambda: lz4.block.compress(bytes(128 * MiB), store_size=False), id="lz4-128MiB"),
]


@pytest.mark.parametrize(("codec", "make_bomb"), BOMBS)
def test_compression_bomb_resets_the_transfer(
    bad_chunk_server: BenchServer, fragments: Fragments, codec: Codec, make_bomb: Callable[[], bytes]
) -> None:
    """A chunk declaring 1 MiB that inflates far beyond it: refused (LENGTH_MISMATCH) without the
    server ever holding the inflated bytes."""
    fragment = fragments.get(CHUNK_BYTES)
    bomb = make_bomb()
    assert len(bomb) < CHUNK_BYTES  # within the payload bound, so only decoding can catch it
    peak_before = bad_chunk_server.max_rss_bytes()
    with CoreClient(bad_chunk_server.port) as client:
        _push(client, 1, fragment, [(ChunkHeader(0, CHUNK_BYTES, codec, 0, 0), bomb)])
        verdict = _verdict(client, 1)
        assert isinstance(verdict, StreamReset) and verdict.code == ErrorCode.LENGTH_MISMATCH, verdict
    grown = bad_chunk_server.max_rss_bytes() - peak_before
    assert grown < 64 * MiB, f"server peak memory grew by {grown / MiB:.0f} MiB"
    _serves(bad_chunk_server, fragments)


def test_chunk_payload_above_its_bound_closes_the_connection(
    bad_chunk_server: BenchServer, fragments: Fragments
) -> None:
    """A chunk whose payload exceeds what its raw length allows is refused from its sub-header,
    before the payload is read: ERROR LIMIT_EXCEEDED and close."""
    fragment = fragments.get(CHUNK_BYTES)
    with CoreClient(bad_chunk_server.port) as client:
        client.conn.send(fragment.push_header("zstd", round_=0), 1)
        client.flush()
        chunk = ChunkHeader(0, 4096, Codec.ZSTD, 0, 0)
        head = HEADER.pack(MAGIC, FRAME_VERSION, FrameType.CHUNK, 0, 0, 1, CHUNK_HEADER_BYTES + 512 * 1024)
        client.sock.sendall(head + encode_chunk_header(chunk))
        _refused(read_until_closed(client.sock), ErrorCode.LIMIT_EXCEEDED)
    _serves(bad_chunk_server, fragments)


# ------------------------------------------------------------------------------- mutual TLS


def test_mutual_tls_round_trip(arun: Arun, tls_files: TlsSet, fragments: Fragments) -> None:
    handler = EchoHandler()
    fragment = fragments.get(MiB + 17)

    async def main() -> None:
        tls = server_context(tls_files.server)
        async with in_process_server(handler, ssl=tls) as (_, port):
            session = await connect(
                "127.0.0.1", port, peer_id="learner-1", ssl=client_context(tls_files.client), streams=2
            )
            try:
                for proto in [session.control, *session.data]:
                    assert proto.transport is not None
                    assert proto.transport.get_extra_info("ssl_object") is not None
                received = await echo(session, fragment, "zstd", shuffle=4)
                assert_echo_matches(received, fragment, "zstd")
                # The server saw the client's certificate: the TLS was mutual.
                (served,) = handler.sessions
                assert served.control.transport is not None
                peer_cert = served.control.transport.get_extra_info("peercert")
                assert peer_cert is not None
                assert ("DNS", "learner-1") in peer_cert["subjectAltName"], peer_cert
            finally:
                await session.close("done")

    arun(main())
    assert handler.delivered == [fragment.digest]


def _no_certificate(files: TlsSet) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(files.server.ca)
    return ctx


REFUSED_CLIENTS = [
    pytest.param(_no_certificate, id="no-client-certificate"),
    pytest.param(lambda files: client_context(files.stranger), id="certificate-from-another-ca"),
    pytest.param(lambda files: None, id="plain-tcp"),
]


@pytest.mark.parametrize("make_context", REFUSED_CLIENTS)
def test_mutual_tls_refuses_client(
    arun: Arun,
    tls_files: TlsSet,
    fragments: Fragments,
    make_context: Callable[[TlsSet], ssl.SSLContext | None],
) -> None:
    handler = EchoHandler()
    fragment = fragments.get(MiB + 17)

    async def main() -> None:
        async with in_process_server(handler, ssl=server_context(tls_files.server)) as (server, port):
            with pytest.raises(ConnectionError):  # HandshakeFailed is one too
                await asyncio.wait_for(
                    connect("127.0.0.1", port, peer_id="intruder", ssl=make_context(tls_files)),
                    REPLY_TIMEOUT_S,
                )
            assert handler.sessions == [] and server.sessions == {}
            # The listener goes on serving clients with the right certificate.
            session = await connect(
                "127.0.0.1", port, peer_id="learner-1", ssl=client_context(tls_files.client)
            )
            try:
                assert_echo_matches(await echo(session, fragment, "lz4", shuffle=4), fragment, "lz4")
            finally:
                await session.close("done")

    arun(main())
