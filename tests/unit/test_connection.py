"""The Connection core as a pair of cores talking in memory, and fed garbage.

Covers the handshake (HMAC, insecure, every way authentication or version negotiation can fail),
which frames each side may send and receive once open, closing (ERROR, GOODBYE, EOF), chunk
receiving in both styles (receive_data and get_buffer/buffer_updated), and hypothesis runs that
feed arbitrary bytes and check that only events or RemoteProtocolError come out, with every
receive buffer bounded by the limits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dilocod.wire import auth
from dilocod.wire.connection import PROTOCOL_MAX_VERSION, Connection
from dilocod.wire.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from dilocod.wire.events import ChunkReceived, Event, HandshakeCompleted, MessageReceived, PeerWentAway
from dilocod.wire.frames import (
    CHUNK_HEADER,
    CHUNK_HEADER_BYTES,
    FRAME_VERSION,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    TRANSFER_FRAMES,
    ChunkHeader,
    Codec,
    FrameType,
    encode_header,
    max_body_bytes,
)
from dilocod.wire.limits import KiB, Limits
from dilocod.wire.manifest import ModelEntry, pack_manifest
from dilocod.wire.messages import (
    AuthChallenge,
    AuthResponse,
    ChunkResend,
    Error,
    FragmentAck,
    FragmentEnd,
    FragmentRequest,
    Goodbye,
    Hello,
    Join,
    Message,
    NothingToPush,
    Ping,
    Plan,
    Pong,
    PushHeader,
    StatusRequest,
    StatusResponse,
    StepReport,
    StreamReset,
    UpdateHeader,
    Welcome,
    decode_body,
    encode_body,
)
from dilocod.wire.states import OPEN_SENDS, Role, State, peer_of

Shuttle = Callable[[Connection, Connection], list[Event]]
Connect = Callable[..., tuple[Connection, Connection]]

SECRET = b"correct horse battery staple!!!!"
OTHER_SECRET = b"incorrect horse battery staple!!"
TID = 7  # a transfer id
CLOSING = frozenset({FrameType.ERROR, FrameType.GOODBYE})

_ENTRIES, _RAW = pack_manifest([("w", "float32", [4, 4]), ("b", "float32", [3])])
_MODEL = (ModelEntry("w", "float32", (4, 4)), ModelEntry("b", "bfloat16", (3,)))
#: The protocol version this reference speaks (protocol/SPEC.md §7.2).
V = PROTOCOL_MAX_VERSION
#: One well-formed message for every frame type but CHUNK.
SAMPLES: dict[FrameType, Message] = {
    FrameType.HELLO: Hello(V, V, "control", "learner", "x", bytes(32)),
    FrameType.AUTH_CHALLENGE: AuthChallenge(1, "none", bytes(32)),
    FrameType.AUTH_RESPONSE: AuthResponse(b""),
    FrameType.WELCOME: Welcome(bytes(16), "syncer", "inc", b""),
    FrameType.STEP_REPORT: StepReport(10, 4096, 0.25),
    FrameType.FRAGMENT_REQUEST: FragmentRequest(2, 5, 4),
    FrameType.NOTHING_TO_PUSH: NothingToPush(2, 5, 4, 120),
    FrameType.JOIN: Join(_MODEL, "inc-0"),
    FrameType.PLAN: Plan("inc-1", _MODEL, ((("w", 0, 4),), (("b", 0, 3),)), (6, 5), 24, 2, 1),
    FrameType.PUSH_HEADER: PushHeader(tuple(_ENTRIES), _RAW, "zstd", 4096, 2, 5, 4, 100, 409_600),
    FrameType.UPDATE_HEADER: UpdateHeader(tuple(_ENTRIES), _RAW, "lz4", 4096, 2, 6),
    FrameType.FRAGMENT_ACK: FragmentAck(),
    FrameType.PING: Ping(1),
    FrameType.PONG: Pong(1),
    FrameType.STATUS_REQUEST: StatusRequest(),
    FrameType.STATUS_RESPONSE: StatusResponse({"round": 3, "learners": ["a", "b"]}),
    FrameType.ERROR: Error(int(ErrorCode.TIMEOUT), "too slow"),
    FrameType.GOODBYE: Goodbye("done"),
    FrameType.FRAGMENT_END: FragmentEnd(1, 12345),
    FrameType.STREAM_RESET: StreamReset(int(ErrorCode.TRANSFER_ABORTED), "abandoned"),
    FrameType.CHUNK_RESEND: ChunkResend(3),
}

#: What each side may send on an open connection (protocol/SPEC.md §8), written out independently
#: of states.py so that a change to the table has to change this too. CHUNK, ERROR and GOODBYE
#: are tested on their own.
EXPECTED_OPEN_SENDS: dict[tuple[Role, str], set[FrameType]] = {
    (Role.CLIENT, "control"): {
        FrameType.JOIN,
        FrameType.STEP_REPORT,
        FrameType.PUSH_HEADER,
        FrameType.NOTHING_TO_PUSH,
        FrameType.FRAGMENT_END,
        FrameType.FRAGMENT_ACK,
        FrameType.CHUNK_RESEND,
        FrameType.STATUS_REQUEST,
        FrameType.PING,
        FrameType.PONG,
        FrameType.STREAM_RESET,
    },
    (Role.SERVER, "control"): {
        FrameType.PLAN,
        FrameType.FRAGMENT_REQUEST,
        FrameType.UPDATE_HEADER,
        FrameType.FRAGMENT_END,
        FrameType.FRAGMENT_ACK,
        FrameType.CHUNK_RESEND,
        FrameType.STATUS_RESPONSE,
        FrameType.PING,
        FrameType.PONG,
        FrameType.STREAM_RESET,
    },
    (Role.CLIENT, "data"): {FrameType.PING, FrameType.PONG, FrameType.STREAM_RESET},
    (Role.SERVER, "data"): {FrameType.PING, FrameType.PONG, FrameType.STREAM_RESET},
}
SIDES = sorted(EXPECTED_OPEN_SENDS, key=lambda k: (k[0].value, k[1]))


def ident(value: object) -> str | None:
    """Readable test ids for enum parameters (FrameType 18 -> FRAGMENT_ACK)."""
    return value.name if isinstance(value, FrameType | Role) else None


def stream_id_for(frame_type: FrameType) -> int:
    return TID if frame_type in TRANSFER_FRAMES else 0


def raw_frame(message: Message, stream_id: int | None = None) -> bytes:
    """A frame built by hand, bypassing every check the sending Connection makes."""
    body = encode_body(message)
    sid = stream_id_for(message.TYPE) if stream_id is None else stream_id
    return encode_header(message.TYPE, sid, len(body)) + body


def frames_of(buffers: Iterable[bytes | bytearray | memoryview]) -> list[tuple[FrameType, int, bytes]]:
    """Split queued output into (frame type, stream id, body) without a Connection."""
    data = b"".join(bytes(b) for b in buffers)
    out = []
    while data:
        _, _, frame_type, _, _, stream_id, length = HEADER.unpack(data[:HEADER_BYTES])
        out.append((FrameType(frame_type), stream_id, data[HEADER_BYTES : HEADER_BYTES + length]))
        data = data[HEADER_BYTES + length :]
    return out


def decoded(frames: list[tuple[FrameType, int, bytes]]) -> list[Message]:
    limits = Limits()
    return [decode_body(t, body, limits) for t, _, body in frames if t is not FrameType.CHUNK]


def sole_error(conn: Connection) -> Error:
    """The one ERROR frame a failed connection queued (and nothing after it)."""
    messages = decoded(frames_of(conn.data_to_send()))
    assert messages and isinstance(messages[-1], Error), messages
    assert not any(isinstance(m, Welcome) for m in messages)
    return messages[-1]


def new_client(secret: bytes | None) -> Connection:
    return Connection(Role.CLIENT, secret=secret, local_id="learner-1", capabilities=("zstd",))


def new_server(secret: bytes | None) -> Connection:
    return Connection(
        Role.SERVER, secret=secret, local_id="syncer", incarnation="inc-1", capabilities=("shuffle",)
    )


def open_pair(connect: Connect, sender: Role, kind: str) -> tuple[Connection, Connection]:
    """(sender, receiver) of an open pair of the given kind."""
    session = bytes(range(16)) if kind == "data" else b""
    client, server = connect(kind, client_secret=SECRET, server_secret=SECRET, session=session)
    return (client, server) if sender is Role.CLIENT else (server, client)


# ----------------------------------------------------------------------------------- handshake


def test_hmac_handshake_completes_with_matching_sessions(shuttle: Shuttle) -> None:
    client, server = new_client(SECRET), new_server(SECRET)
    client.start(kind="control", role="learner")
    assert client.state is State.AWAIT_CHALLENGE
    hello_out = client.data_to_send()
    assert [t for t, _, _ in frames_of(hello_out)] == [FrameType.HELLO]
    assert [e for b in hello_out for e in server.receive_data(b)] == []
    assert server.state is State.AWAIT_RESPONSE

    challenge_out = server.data_to_send()
    (challenge,) = decoded(frames_of(challenge_out))
    assert isinstance(challenge, AuthChallenge) and challenge.method == "hmac-sha256"
    assert challenge.version == V and len(challenge.nonce) == 32
    assert [e for b in challenge_out for e in client.receive_data(b)] == []
    assert client.state is State.AWAIT_WELCOME

    response_out = client.data_to_send()
    (response,) = decoded(frames_of(response_out))
    assert isinstance(response, AuthResponse) and len(response.mac) == 32
    server_events = [e for b in response_out for e in server.receive_data(b)]
    client_events = shuttle(server, client)

    assert client.state is State.OPEN and server.state is State.OPEN
    assert len(server_events) == 1 and len(client_events) == 1
    on_server, on_client = server_events[0], client_events[0]
    assert isinstance(on_server, HandshakeCompleted) and isinstance(on_client, HandshakeCompleted)
    assert on_server.session == on_client.session == server.session == client.session
    assert len(server.session) == 16
    assert on_server == HandshakeCompleted(
        V, "control", "learner", "learner-1", server.session, "inc-1", ("zstd",)
    )
    assert on_client == HandshakeCompleted(
        V, "control", "learner", "syncer", client.session, "inc-1", ("shuffle",)
    )
    assert server.peer == on_server and client.peer == on_client
    assert client.data_to_send() == [] and server.data_to_send() == []


def test_two_handshakes_get_different_sessions(connect: Connect) -> None:
    first = connect(client_secret=SECRET, server_secret=SECRET)
    second = connect(client_secret=SECRET, server_secret=SECRET)
    assert first[0].session != second[0].session


def test_insecure_handshake_completes_without_macs(shuttle: Shuttle) -> None:
    client, server = new_client(None), new_server(None)
    client.start(kind="control", role="status")
    shuttle(client, server)
    (challenge,) = decoded(frames_of(server.data_to_send()))
    assert isinstance(challenge, AuthChallenge) and challenge.method == "none"
    client.receive_data(raw_frame(challenge))
    (response,) = decoded(frames_of(client.data_to_send()))
    assert response == AuthResponse(b"")
    server.receive_data(raw_frame(response))
    welcome_out = server.data_to_send()
    (welcome,) = decoded(frames_of(welcome_out))
    assert isinstance(welcome, Welcome) and welcome.mac == b""
    events = [e for b in welcome_out for e in client.receive_data(b)]
    assert client.state is State.OPEN and server.state is State.OPEN
    assert isinstance(events[0], HandshakeCompleted) and events[0].role == "status"
    assert client.session == server.session


def test_client_without_secret_meets_server_with_one(shuttle: Shuttle) -> None:
    client, server = new_client(None), new_server(SECRET)
    client.start(kind="control", role="learner")
    shuttle(client, server)
    with pytest.raises(RemoteProtocolError) as info:
        shuttle(server, client)
    assert info.value.code is ErrorCode.AUTH_REQUIRED
    assert client.state is State.CLOSED
    # The server learns why.
    assert shuttle(client, server) == [PeerWentAway(info.value.message, ErrorCode.AUTH_REQUIRED)]
    assert server.state is State.CLOSED


def test_wrong_secret_fails_on_the_server(shuttle: Shuttle) -> None:
    client, server = new_client(OTHER_SECRET), new_server(SECRET)
    client.start(kind="control", role="learner")
    shuttle(client, server)
    shuttle(server, client)
    with pytest.raises(RemoteProtocolError) as info:
        shuttle(client, server)
    assert info.value.code is ErrorCode.AUTH_FAILED
    assert server.state is State.CLOSED
    assert server.peer is None and server.session == b""
    error = sole_error(server)
    assert error.code == ErrorCode.AUTH_FAILED
    assert client.receive_data(raw_frame(error)) == [PeerWentAway(error.message, ErrorCode.AUTH_FAILED)]
    assert client.state is State.CLOSED


def test_client_with_secret_refuses_a_server_without_one(shuttle: Shuttle) -> None:
    client, server = new_client(SECRET), new_server(None)
    client.start(kind="control", role="learner")
    shuttle(client, server)
    with pytest.raises(RemoteProtocolError) as info:
        shuttle(server, client)
    assert info.value.code is ErrorCode.AUTH_REQUIRED
    assert client.state is State.CLOSED
    assert sole_error(client).code == ErrorCode.AUTH_REQUIRED


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda w: Welcome(w.session, w.server_id, w.incarnation, bytes(32)), id="zero-mac"),
        pytest.param(lambda w: Welcome(w.session, w.server_id, w.incarnation, b""), id="empty-mac"),
        pytest.param(
            lambda w: Welcome(w.session, w.server_id, w.incarnation, bytes([w.mac[0] ^ 1]) + w.mac[1:]),
            id="flipped-bit",
        ),
        pytest.param(lambda w: Welcome(bytes(16), w.server_id, w.incarnation, w.mac), id="other-session"),
    ],
)
def test_forged_welcome_fails_on_the_client(shuttle: Shuttle, forge: Callable[[Welcome], Welcome]) -> None:
    client, server = new_client(SECRET), new_server(SECRET)
    client.start(kind="control", role="learner")
    shuttle(client, server)  # HELLO
    shuttle(server, client)  # AUTH_CHALLENGE
    shuttle(client, server)  # AUTH_RESPONSE; the server is open and has queued WELCOME
    (welcome,) = decoded(frames_of(server.data_to_send()))
    assert isinstance(welcome, Welcome)
    with pytest.raises(RemoteProtocolError) as info:
        client.receive_data(raw_frame(forge(welcome)))
    assert info.value.code is ErrorCode.AUTH_FAILED
    assert client.state is State.CLOSED and client.peer is None


def test_replayed_auth_response_fails() -> None:
    """An AUTH_RESPONSE answers one server nonce; replayed to a fresh server it is refused."""
    client = new_client(SECRET)
    client.start(kind="control", role="learner")
    hello = client.data_to_send()
    first = new_server(SECRET)
    for b in hello:
        first.receive_data(b)
    for b in first.data_to_send():
        client.receive_data(b)
    response = client.data_to_send()
    second = new_server(SECRET)
    for b in hello:
        second.receive_data(b)
    with pytest.raises(RemoteProtocolError) as info:
        for b in response:
            second.receive_data(b)
    assert info.value.code is ErrorCode.AUTH_FAILED


def test_proofs_bind_every_field_of_the_hello() -> None:
    hello = Hello(V, V, "control", "learner", "a", bytes(32))
    base = auth.client_proof(SECRET, hello, 1, bytes(32))
    variants = [
        Hello(V, V, "control", "learner", "b", bytes(32)),
        Hello(V, V, "control", "status", "a", bytes(32)),
        Hello(V, V, "data", "learner", "a", bytes(32), bytes(16)),
        Hello(V, V, "control", "learner", "a", bytes(31) + b"\x01"),
    ]
    assert all(auth.client_proof(SECRET, v, 1, bytes(32)) != base for v in variants)
    assert auth.client_proof(SECRET, hello, 1, bytes(31) + b"\x01") != base
    assert auth.client_proof(OTHER_SECRET, hello, 1, bytes(32)) != base
    # The server's proof is not the client's (no reflection) and binds the session.
    assert auth.server_proof(SECRET, hello, 1, bytes(32), bytes(16)) != base
    assert auth.server_proof(SECRET, hello, 1, bytes(32), bytes(16)) != auth.server_proof(
        SECRET, hello, 1, bytes(32), b"\x01" * 16
    )


@pytest.mark.parametrize("secret", [SECRET, None], ids=["hmac", "insecure"])
def test_data_connection_joins_the_control_session(connect: Connect, secret: bytes | None) -> None:
    control_client, _ = connect(client_secret=secret, server_secret=secret)
    client, server = connect(
        "data", client_secret=secret, server_secret=secret, session=control_client.session
    )
    assert client.session == server.session == control_client.session
    assert server.kind == client.kind == "data"
    assert server.peer is not None and server.peer.kind == "data"
    assert client.peer is not None and client.peer.session == control_client.session


def test_data_connection_answered_for_another_session(shuttle: Shuttle) -> None:
    client, server = new_client(None), new_server(None)
    client.start(kind="data", role="learner", session=b"\x05" * 16)
    shuttle(client, server)
    shuttle(server, client)
    shuttle(client, server)
    (welcome,) = decoded(frames_of(server.data_to_send()))
    assert isinstance(welcome, Welcome) and welcome.session == b"\x05" * 16
    forged = Welcome(b"\x06" * 16, welcome.server_id, welcome.incarnation, b"")
    with pytest.raises(RemoteProtocolError) as info:
        client.receive_data(raw_frame(forged))
    assert info.value.code is ErrorCode.UNKNOWN_SESSION


@pytest.mark.parametrize("versions", [(1, 1), (1, 2), (4, 9), (0, 0)])
def test_hello_without_a_common_version(versions: tuple[int, int]) -> None:
    server = new_server(SECRET)
    hello = Hello(versions[0], versions[1], "control", "learner", "future", bytes(32))
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(raw_frame(hello))
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION
    assert server.state is State.CLOSED
    messages = decoded(frames_of(server.data_to_send()))
    assert [type(m) for m in messages] == [Error]  # no challenge went out
    assert messages[0].code == ErrorCode.UNSUPPORTED_VERSION


def test_hello_from_a_newer_client_negotiates_down() -> None:
    server = new_server(None)
    server.receive_data(raw_frame(Hello(1, 5, "control", "learner", "future", bytes(32))))
    (challenge,) = decoded(frames_of(server.data_to_send()))
    assert isinstance(challenge, AuthChallenge) and challenge.version == V
    assert server.version == V


def test_challenge_with_an_unsupported_version() -> None:
    client = new_client(None)
    client.start(kind="control", role="learner")
    client.data_to_send()
    with pytest.raises(RemoteProtocolError) as info:
        client.receive_data(raw_frame(AuthChallenge(V + 1, "none", bytes(32))))
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION
    assert client.state is State.CLOSED


@pytest.mark.parametrize(
    "frame_type", [t for t in SAMPLES if t not in (FrameType.HELLO, *CLOSING)], ids=ident
)
def test_server_wants_hello_first(frame_type: FrameType) -> None:
    server = new_server(None)
    header = raw_frame(SAMPLES[frame_type])[:HEADER_BYTES]
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(header)  # refused on the header alone
    assert info.value.code is ErrorCode.UNEXPECTED_FRAME
    assert server.state is State.CLOSED


def test_chunk_before_authentication_is_refused() -> None:
    server = new_server(SECRET)
    server.receive_data(raw_frame(Hello(V, V, "data", "learner", "x", bytes(32), bytes(16))))
    chunk = encode_header(FrameType.CHUNK, TID, CHUNK_HEADER_BYTES + 4)
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(chunk)
    assert info.value.code is ErrorCode.UNEXPECTED_FRAME


def test_client_receives_nothing_before_it_says_hello() -> None:
    client = new_client(None)
    with pytest.raises(RemoteProtocolError) as info:
        client.receive_data(raw_frame(AuthChallenge(1, "none", bytes(32))))
    assert info.value.code is ErrorCode.UNEXPECTED_FRAME


def test_only_the_client_says_hello() -> None:
    with pytest.raises(LocalProtocolError):
        new_server(None).start(kind="control", role="syncer")
    client = new_client(None)
    client.start(kind="control", role="learner")
    with pytest.raises(LocalProtocolError):
        client.start(kind="control", role="learner")


# --------------------------------------------------------------------------------- open frames


def test_expected_sends_cover_the_state_table() -> None:
    """The table in states.py lets each side send exactly what the spec lists (plus the frames
    tested on their own)."""
    for key, expected in EXPECTED_OPEN_SENDS.items():
        assert set(OPEN_SENDS[key]) == expected | {FrameType.CHUNK} | CLOSING, key


@pytest.mark.parametrize(
    ("sender", "kind", "frame_type"),
    [(role, kind, t) for role, kind in SIDES for t in sorted(EXPECTED_OPEN_SENDS[(role, kind)])],
    ids=ident,
)
def test_allowed_message_arrives_unchanged(
    connect: Connect, shuttle: Shuttle, sender: Role, kind: str, frame_type: FrameType
) -> None:
    a, b = open_pair(connect, sender, kind)
    message = SAMPLES[frame_type]
    a.send(message, stream_id_for(frame_type))
    assert shuttle(a, b) == [MessageReceived(message, stream_id_for(frame_type))]
    assert a.state is State.OPEN and b.state is State.OPEN


@pytest.mark.parametrize(
    ("sender", "kind", "frame_type"),
    [
        (role, kind, t)
        for role, kind in SIDES
        for t in sorted(set(SAMPLES) - EXPECTED_OPEN_SENDS[(role, kind)] - CLOSING)
        if not (role is Role.SERVER and t is FrameType.WELCOME)
    ],
    ids=ident,
)
def test_forbidden_send_is_a_local_error(
    connect: Connect, sender: Role, kind: str, frame_type: FrameType
) -> None:
    a, _ = open_pair(connect, sender, kind)
    with pytest.raises(LocalProtocolError):
        a.send(SAMPLES[frame_type], stream_id_for(frame_type))
    assert a.data_to_send() == []
    assert a.state is State.OPEN


def test_second_welcome_is_a_local_error(connect: Connect) -> None:
    _, server = connect()
    with pytest.raises(LocalProtocolError):
        server.send(SAMPLES[FrameType.WELCOME])


@pytest.mark.parametrize("frame_type", sorted(TRANSFER_FRAMES - {FrameType.CHUNK}), ids=ident)
def test_transfer_frame_without_a_transfer_id_is_a_local_error(
    connect: Connect, frame_type: FrameType
) -> None:
    sender = Role.SERVER if frame_type is FrameType.UPDATE_HEADER else Role.CLIENT
    a, _ = open_pair(connect, sender, "control")
    with pytest.raises(LocalProtocolError):
        a.send(SAMPLES[frame_type])  # stream id 0
    assert a.data_to_send() == []


def test_control_frame_with_a_transfer_id_is_a_local_error(connect: Connect) -> None:
    a, _ = open_pair(connect, Role.CLIENT, "control")
    with pytest.raises(LocalProtocolError):
        a.send(Ping(1), stream_id=3)
    assert a.data_to_send() == []


@pytest.mark.parametrize(
    ("receiver", "kind", "frame_type"),
    [
        (role, kind, t)
        for role, kind in SIDES
        for t in sorted(set(SAMPLES) - EXPECTED_OPEN_SENDS[(peer_of(role), kind)] - CLOSING)
    ],
    ids=ident,
)
def test_frame_not_allowed_from_the_peer(
    connect: Connect, receiver: Role, kind: str, frame_type: FrameType
) -> None:
    _, b = open_pair(connect, peer_of(receiver), kind)
    frame = raw_frame(SAMPLES[frame_type])
    with pytest.raises(RemoteProtocolError) as info:
        b.receive_data(frame[:HEADER_BYTES])  # refused before the body is read
    assert info.value.code is ErrorCode.UNEXPECTED_FRAME
    assert b.state is State.CLOSED
    assert sole_error(b).code == ErrorCode.UNEXPECTED_FRAME
    assert b.receive_data(frame[HEADER_BYTES:]) == []  # a closed connection reads nothing more


@pytest.mark.parametrize(("sender", "kind"), SIDES, ids=ident)
def test_goodbye_closes_both_sides(connect: Connect, shuttle: Shuttle, sender: Role, kind: str) -> None:
    a, b = open_pair(connect, sender, kind)
    a.go_away("shutting down")
    assert a.state is State.CLOSED
    assert shuttle(a, b) == [PeerWentAway("shutting down", None)]
    assert b.state is State.CLOSED
    with pytest.raises(LocalProtocolError):
        a.send(Ping(2))
    with pytest.raises(LocalProtocolError):
        b.send(Ping(2))
    a.go_away("again")  # idempotent: nothing more is queued
    assert a.data_to_send() == []
    assert b.receive_data(raw_frame(Ping(3))) == []
    assert b.receive_eof() == []


@pytest.mark.parametrize(("sender", "kind"), SIDES, ids=ident)
def test_error_closes_both_sides(connect: Connect, shuttle: Shuttle, sender: Role, kind: str) -> None:
    a, b = open_pair(connect, sender, kind)
    a.fail(ErrorCode.TIMEOUT, "no progress for 30 s")
    assert a.state is State.CLOSED
    assert shuttle(a, b) == [PeerWentAway("no progress for 30 s", ErrorCode.TIMEOUT)]
    assert b.state is State.CLOSED


def test_error_during_the_handshake_is_a_departure() -> None:
    server = new_server(SECRET)
    assert server.receive_data(raw_frame(Error(int(ErrorCode.SHUTTING_DOWN), "bye"))) == [
        PeerWentAway("bye", ErrorCode.SHUTTING_DOWN)
    ]
    client = new_client(SECRET)
    client.start(kind="control", role="learner")
    assert client.receive_data(raw_frame(Goodbye("restarting"))) == [PeerWentAway("restarting")]


def test_frames_after_goodbye_in_the_same_read_are_ignored(connect: Connect) -> None:
    _, b = open_pair(connect, Role.SERVER, "control")
    data = raw_frame(Ping(1)) + raw_frame(Goodbye("bye")) + raw_frame(Ping(2)) + b"garbage"
    assert b.receive_data(data) == [MessageReceived(Ping(1)), PeerWentAway("bye")]


def test_long_error_message_still_makes_a_valid_error_frame(connect: Connect) -> None:
    """The reason in an ERROR frame may quote peer-supplied text; it must stay decodable."""
    client, server = connect()
    bad = PushHeader((), 0, "zstd", 4096, 1)
    body = bad.to_body()
    body["manifest"] = [["é" * 500, "ü" * 700 + "€" * 300, [1], 0]]
    raw = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(encode_header(FrameType.PUSH_HEADER, TID, len(raw)) + raw)
    assert info.value.code is ErrorCode.BAD_MANIFEST
    events = [e for b in server.data_to_send() for e in client.receive_data(b)]
    assert len(events) == 1 and isinstance(events[0], PeerWentAway)
    assert events[0].error_code == ErrorCode.BAD_MANIFEST
    assert 0 < len(events[0].reason.encode()) <= 1024


def test_long_goodbye_reason_is_cut_to_whole_characters(connect: Connect, shuttle: Shuttle) -> None:
    client, server = connect()
    client.go_away("€" * 1000)  # 3000 bytes of UTF-8
    (event,) = shuttle(client, server)
    assert isinstance(event, PeerWentAway)
    assert event.reason == "€" * 341  # 1023 bytes: the 342nd character would not fit whole


# -------------------------------------------------------------------------------------- EOF


def test_eof_between_frames_is_a_departure(connect: Connect) -> None:
    _, server = connect()
    assert not server.mid_frame
    assert server.receive_eof() == [PeerWentAway("connection closed")]
    assert server.state is State.CLOSED
    assert server.receive_eof() == []


@pytest.mark.parametrize("cut", [1, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 3])
def test_eof_inside_a_frame_is_a_truncation(connect: Connect, cut: int) -> None:
    _, server = connect()
    server.receive_data(raw_frame(StepReport(1, 2, 0.5))[:cut])
    assert server.mid_frame
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_eof()
    assert info.value.code is ErrorCode.TRUNCATED
    assert server.state is State.CLOSED


@pytest.mark.parametrize("cut", [HEADER_BYTES + 1, HEADER_BYTES + CHUNK_HEADER_BYTES + 100])
def test_eof_inside_a_chunk_is_a_truncation(connect: Connect, cut: int) -> None:
    client, server = connect("data", session=bytes(16))
    payload = bytes(4096)
    client.send_chunk(TID, ChunkHeader(0, 4096, Codec.NONE, 0, 1), payload)
    server.receive_data(b"".join(client.data_to_send())[:cut])
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_eof()
    assert info.value.code is ErrorCode.TRUNCATED


def test_eof_before_the_handshake_is_a_departure() -> None:
    assert new_server(None).receive_eof() == [PeerWentAway("connection closed")]


# ----------------------------------------------------------------------------------- chunks


def test_chunk_payload_is_lent_not_copied(connect: Connect) -> None:
    client, _ = connect("data", session=bytes(16))
    payload = bytearray(b"\x01" * 5000)
    client.send_chunk(TID, ChunkHeader(3, 5000, Codec.NONE, 0, 99), payload)
    out = client.data_to_send()
    assert out[-1] is payload
    assert len(out) == 2 and out[0][:HEADER_BYTES] == encode_header(
        FrameType.CHUNK, TID, CHUNK_HEADER_BYTES + 5000
    )
    assert client.bytes_sent >= HEADER_BYTES + CHUNK_HEADER_BYTES + 5000


@pytest.mark.parametrize("kind", ["control", "data"])
def test_chunk_arrives_in_a_fresh_buffer_without_a_sink(
    connect: Connect, shuttle: Shuttle, kind: str
) -> None:
    client, server = connect(kind, session=bytes(16) if kind == "data" else b"")
    header = ChunkHeader(2, 4096, Codec.LZ4, 0, 0xFEED)
    client.send_chunk(TID, header, b"compressed bytes")
    (event,) = shuttle(client, server)
    assert isinstance(event, ChunkReceived)
    assert (event.transfer_id, event.chunk, bytes(event.payload), event.in_place) == (
        TID,
        header,
        b"compressed bytes",
        False,
    )


def test_chunk_lands_where_the_sink_says(connect: Connect, shuttle: Shuttle) -> None:
    destination = bytearray(10_000)
    calls: list[tuple[int, ChunkHeader, int]] = []

    def sink(transfer_id: int, chunk: ChunkHeader, payload_length: int) -> memoryview | None:
        calls.append((transfer_id, chunk, payload_length))
        return memoryview(destination)[1000 : 1000 + payload_length]

    client, server = connect("data", session=bytes(16), server_sink=sink)
    payload = bytes(range(256)) * 16
    header = ChunkHeader(0, len(payload), Codec.NONE, 0, 1)
    client.send_chunk(TID, header, payload)
    (event,) = shuttle(client, server)
    assert calls == [(TID, header, len(payload))]
    assert isinstance(event, ChunkReceived) and event.in_place
    assert destination[1000 : 1000 + len(payload)] == payload
    assert event.payload.obj is destination


def test_sink_lending_the_wrong_size_is_a_local_error(connect: Connect) -> None:
    client, server = connect(
        "data", session=bytes(16), server_sink=lambda tid, chunk, n: memoryview(bytearray(n + 1))
    )
    client.send_chunk(TID, ChunkHeader(0, 4096, Codec.NONE, 0, 1), bytes(4096))
    with pytest.raises(LocalProtocolError):
        for b in client.data_to_send():
            server.receive_data(b)


def test_chunk_with_transfer_id_zero_is_a_local_error(connect: Connect) -> None:
    client, _ = connect("data", session=bytes(16))
    with pytest.raises(LocalProtocolError):
        client.send_chunk(0, ChunkHeader(0, 4, Codec.NONE, 0, 1), b"abcd")


def test_bad_chunk_header_is_refused_before_the_payload(connect: Connect) -> None:
    _, server = connect("data", session=bytes(16))
    sub = CHUNK_HEADER.pack(0, 4096, 9, 0, 0, 0)  # codec 9
    head = encode_header(FrameType.CHUNK, TID, CHUNK_HEADER_BYTES + 4096)
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(head + sub)
    assert info.value.code is ErrorCode.UNSUPPORTED_CODEC
    assert server.state is State.CLOSED


# ------------------------------------------------------------------------- feeding styles


def insecure_client_bytes() -> bytes:
    """Everything an insecure client sends in a short exchange with an insecure server.

    An insecure server accepts any client whatever nonces it picks, so these bytes replay to a
    fresh server; a secure one would refuse the replay (test_replayed_auth_response_fails).
    """
    client = Connection(Role.CLIENT, secret=None, local_id="learner-1")
    server = Connection(Role.SERVER, secret=None, local_id="syncer")
    client.start(kind="control", role="learner")
    sent: list[bytes] = []
    for _ in range(2):
        out = [bytes(b) for b in client.data_to_send()]
        sent += out
        for b in out:
            server.receive_data(b)
        for b in server.data_to_send():
            client.receive_data(b)
    assert client.state is State.OPEN
    client.send(StepReport(1, 2, 3.0))
    client.send(SAMPLES[FrameType.PUSH_HEADER], stream_id=TID)
    client.send_chunk(TID, ChunkHeader(0, 8, Codec.NONE, 0, 5), b"12345678")
    client.send(FragmentEnd(1, 77), stream_id=TID)
    client.go_away("done")
    sent += [bytes(b) for b in client.data_to_send()]
    return b"".join(sent)


def normalized(events: list[Event]) -> list[object]:
    """Events with payload views replaced by their bytes and the (random) session dropped."""
    out: list[object] = []
    for e in events:
        if isinstance(e, ChunkReceived):
            out.append((e.transfer_id, e.chunk, bytes(e.payload), e.in_place))
        elif isinstance(e, HandshakeCompleted):
            out.append((e.version, e.kind, e.role, e.peer_id))
        else:
            out.append(e)
    return out


def test_byte_at_a_time_gives_the_same_events() -> None:
    whole = insecure_client_bytes()
    expected = [
        (V, "control", "learner", "learner-1"),
        MessageReceived(StepReport(1, 2, 3.0)),
        MessageReceived(SAMPLES[FrameType.PUSH_HEADER], TID),
        (TID, ChunkHeader(0, 8, Codec.NONE, 0, 5), b"12345678", False),
        MessageReceived(FragmentEnd(1, 77), TID),
        PeerWentAway("done"),
    ]
    at_once = Connection(Role.SERVER, secret=None)
    assert normalized(at_once.receive_data(whole)) == expected
    assert at_once.bytes_received == len(whole)

    one_by_one = Connection(Role.SERVER, secret=None)
    got: list[Event] = []
    for i in range(len(whole)):
        got += one_by_one.receive_data(whole[i : i + 1])
    assert normalized(got) == expected

    buffered = Connection(Role.SERVER, secret=None)
    got, pos = [], 0
    while pos < len(whole):
        target = buffered.get_buffer()
        assert len(target) > 0
        n = min(len(target), 3, len(whole) - pos)
        target[:n] = whole[pos : pos + n]
        pos += n
        got += buffered.buffer_updated(n)
    assert normalized(got) == expected
    assert buffered.bytes_received == len(whole)


# ------------------------------------------------------------------------------ hypothesis

SMALL = Limits(
    max_handshake_body_bytes=1 * KiB,
    max_control_body_bytes=16 * KiB,
    max_chunk_bytes=8 * KiB,
    min_chunk_bytes=4 * KiB,
    max_message_bytes=1 * KiB,
)
LARGEST_BODY = max(max_body_bytes(t, SMALL, handshaking=h) for t in FrameType for h in (True, False))


def framed(
    frame_type: int,
    stream_id: int,
    body: bytes,
    length: int | None = None,
    *,
    magic: int = MAGIC,
    version: int = FRAME_VERSION,
    flags: int = 0,
) -> bytes:
    n = len(body) if length is None else length
    return HEADER.pack(magic, version, frame_type, flags, 0, stream_id, n) + body


@st.composite
def frame_bytes(draw: st.DrawFn) -> bytes:
    """Mostly plausible frames: real types, right or wrong stream ids, valid or mangled bodies."""
    kind = draw(st.sampled_from(["message", "chunk", "junk"]))
    frame_type = draw(st.one_of(st.sampled_from(list(FrameType)), st.integers(0, 255)))
    stream_id = draw(st.sampled_from([0, 0, TID, 1, 2**32 - 1]))
    if kind == "message":
        message = draw(st.sampled_from(list(SAMPLES.values())))
        body = encode_body(message)
        frame_type = draw(st.sampled_from([message.TYPE, message.TYPE, frame_type]))
        if draw(st.booleans()):
            cut = draw(st.integers(0, len(body)))
            body = body[:cut] + draw(st.binary(max_size=8)) + body[cut + 1 :]
    elif kind == "chunk":
        frame_type = FrameType.CHUNK
        raw_length = draw(st.sampled_from([0, 1, 64, 4096, SMALL.max_chunk_bytes + 1, 2**32 - 1]))
        payload = draw(st.binary(max_size=96))
        codec = draw(st.sampled_from([0, 1, 2, 3]))
        shuffle = draw(st.sampled_from([0, 2, 3, 4, 8]))
        if codec == 0 and draw(st.booleans()):
            raw_length = len(payload)
        body = CHUNK_HEADER.pack(draw(st.integers(0, 4)), raw_length, codec, shuffle, 0, 0) + payload
    else:
        body = draw(st.binary(max_size=64))
    length = draw(st.one_of(st.none(), st.none(), st.integers(0, 2**32 - 1)))
    header_noise = draw(st.sampled_from(["none"] * 8 + ["magic", "version", "flags"]))
    return framed(
        frame_type,
        stream_id,
        body,
        length,
        magic=0xBEEF if header_noise == "magic" else MAGIC,
        version=2 if header_noise == "version" else FRAME_VERSION,
        flags=1 if header_noise == "flags" else 0,
    )


#: A plausible opening for an insecure server: a valid HELLO and AUTH_RESPONSE.
INSECURE_OPENING = raw_frame(Hello(V, V, "control", "learner", "fuzz", bytes(32))) + raw_frame(
    AuthResponse(b"")
)

garbage = st.one_of(
    st.binary(max_size=512),
    st.lists(frame_bytes(), max_size=6).map(b"".join),
    st.lists(frame_bytes(), max_size=6).map(lambda fs: INSECURE_OPENING + b"".join(fs)),
)


def feed_split(conn: Connection, data: bytes, cuts: list[int]) -> list[Event]:
    """Feed data in pieces at the given cut points, checking the receive buffer after each."""
    events: list[Event] = []
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for start, stop in itertools.pairwise(points):
        events += conn.receive_data(data[start:stop])
        assert len(conn.get_buffer()) <= LARGEST_BODY
    return events


def feed_via_buffer(conn: Connection, data: bytes, steps: list[int]) -> list[Event]:
    """The BufferedProtocol style: write into get_buffer(), then report how much."""
    events: list[Event] = []
    pos, i = 0, 0
    while pos < len(data) and conn.state is not State.CLOSED:
        target = conn.get_buffer()
        assert 0 < len(target) <= LARGEST_BODY
        n = min(len(target), len(data) - pos, 1 + steps[i % len(steps)])
        target[:n] = data[pos : pos + n]
        pos, i = pos + n, i + 1
        events += conn.buffer_updated(n)
    return events


def check_garbage(conn: Connection, feed: Callable[[Connection], list[Event]]) -> None:
    try:
        events = feed(conn)
    except RemoteProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
        assert conn.state is State.CLOSED
        # What it sent last is a well-formed ERROR carrying that code.
        messages = decoded(frames_of(conn.data_to_send()))
        assert isinstance(messages[-1], Error) and messages[-1].code == exc.code
        return
    assert all(
        isinstance(e, HandshakeCompleted | MessageReceived | ChunkReceived | PeerWentAway) for e in events
    )
    assert len(conn.get_buffer()) <= LARGEST_BODY
    try:
        conn.receive_eof()
    except RemoteProtocolError as exc:
        assert exc.code is ErrorCode.TRUNCATED


CUTS = st.lists(st.integers(0, 10_000), max_size=12)
GARBAGE_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@GARBAGE_SETTINGS
@given(data=garbage, secret=st.sampled_from([None, SECRET]), cuts=CUTS)
def test_garbage_to_a_fresh_server(data: bytes, secret: bytes | None, cuts: list[int]) -> None:
    check_garbage(Connection(Role.SERVER, secret=secret, limits=SMALL), lambda c: feed_split(c, data, cuts))


@GARBAGE_SETTINGS
@given(data=garbage, cuts=CUTS)
def test_garbage_to_a_fresh_client(data: bytes, cuts: list[int]) -> None:
    conn = Connection(Role.CLIENT, secret=None, limits=SMALL)
    conn.start(kind="control", role="learner")
    conn.data_to_send()
    check_garbage(conn, lambda c: feed_split(c, data, cuts))


@GARBAGE_SETTINGS
@given(
    data=st.one_of(st.binary(max_size=512), st.lists(frame_bytes(), max_size=8).map(b"".join)),
    receiver=st.sampled_from([Role.CLIENT, Role.SERVER]),
    kind=st.sampled_from(["control", "data"]),
    cuts=CUTS,
)
def test_garbage_to_an_open_connection(
    connect: Connect, data: bytes, receiver: Role, kind: str, cuts: list[int]
) -> None:
    client, server = connect(kind, session=bytes(16) if kind == "data" else b"", limits=SMALL)
    check_garbage(server if receiver is Role.SERVER else client, lambda c: feed_split(c, data, cuts))


@GARBAGE_SETTINGS
@given(data=garbage, steps=st.lists(st.integers(0, 40), min_size=1, max_size=10))
def test_garbage_through_get_buffer(data: bytes, steps: list[int]) -> None:
    check_garbage(
        Connection(Role.SERVER, secret=None, limits=SMALL), lambda c: feed_via_buffer(c, data, steps)
    )


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=20))
def test_valid_stream_split_anywhere_gives_the_same_events(connect: Connect, cuts: list[int]) -> None:
    client, server = connect()
    client.send(StepReport(1, 2, 3.0))
    client.send(SAMPLES[FrameType.PUSH_HEADER], stream_id=TID)
    client.send_chunk(TID, ChunkHeader(0, 4096, Codec.NONE, 0, 9), bytes(range(256)) * 16)
    client.send(FragmentEnd(1, 5), stream_id=TID)
    client.send(Ping(4))
    data = b"".join(bytes(b) for b in client.data_to_send())
    reference = [
        MessageReceived(StepReport(1, 2, 3.0)),
        MessageReceived(SAMPLES[FrameType.PUSH_HEADER], TID),
        (TID, ChunkHeader(0, 4096, Codec.NONE, 0, 9), bytes(range(256)) * 16, False),
        MessageReceived(FragmentEnd(1, 5), TID),
        MessageReceived(Ping(4)),
    ]
    assert normalized(feed_split(server, data, cuts)) == reference
