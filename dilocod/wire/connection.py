"""The sans-IO connection: feed it received bytes, get events; tell it what to send, read bytes.

One Connection per TCP connection, for either role. It runs the handshake (version negotiation and
the HMAC challenge-response) itself, then checks every frame against the tables in states.py.
Receiving works in two styles over one parser: receive_data(bytes) for simple callers and tests,
or get_buffer()/buffer_updated(n) so an asyncio BufferedProtocol can read chunk payloads straight
into their destination. Sending never copies a payload: data_to_send() returns header bytes and the
caller's own buffers, ready for writelines. No asyncio, sockets, clocks or logging in here.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from enum import Enum

from dilocod.wire import auth
from dilocod.wire.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from dilocod.wire.events import (
    ChunkReceived,
    Event,
    HandshakeCompleted,
    MessageReceived,
    PeerWentAway,
)
from dilocod.wire.frames import (
    CHUNK_HEADER_BYTES,
    HANDSHAKE_FRAMES,
    HEADER_BYTES,
    TRANSFER_FRAMES,
    ChunkHeader,
    FrameHeader,
    FrameType,
    decode_chunk_header,
    decode_header,
    encode_chunk_header,
    encode_header,
)
from dilocod.wire.limits import DEFAULT_LIMITS, KiB, Limits
from dilocod.wire.messages import (
    NONCE_BYTES,
    SESSION_ID_BYTES,
    AuthChallenge,
    AuthResponse,
    Error,
    Goodbye,
    Hello,
    Message,
    Welcome,
    decode_body,
    encode_body,
)
from dilocod.wire.states import (
    CLOSING_FRAMES,
    HANDSHAKE_RECEIVE,
    HANDSHAKE_SEND,
    OPEN_SENDS,
    Role,
    State,
    peer_of,
)

#: Protocol version 3 (protocol/SPEC.md §7.2): PUSH_HEADER and UPDATE_HEADER state their wire
#: precision (version 2 left the receiver to infer it from the manifest). Peers of versions 1 and 2
#: are refused in the handshake (UNSUPPORTED_VERSION).
PROTOCOL_MIN_VERSION = 3
PROTOCOL_MAX_VERSION = 3

Buffer = bytes | bytearray | memoryview
#: ERROR messages and GOODBYE reasons are capped at this many UTF-8 bytes (messages.py checks it).
MAX_REASON_BYTES = 1024
#: (transfer id, chunk header, payload length) -> where the payload should land, or None for a
#: fresh buffer. Raises RemoteProtocolError for chunks the receiver does not expect.
ChunkSink = Callable[[int, ChunkHeader, int], memoryview | None]
#: Server only: called with a client's HELLO once its proof has verified, before WELCOME is sent.
#: Raises RemoteProtocolError to refuse the connection: the client gets ERROR instead of WELCOME.
Admit = Callable[[Hello], None]
#: A frame body or chunk payload that gets a fresh buffer (not a slice the chunk sink lent) is
#: first given this many bytes, and the buffer grows GROWTH times each time it fills: a peer that
#: declares a large frame and sends it slowly holds at most GROWTH times what it sent, never what it
#: declared. 4, not 2: a 1 MiB compressed chunk then costs two more allocations and a third of its
#: bytes copied again, not four and nearly all: 0.17 ms against 1.2 ms a chunk (0.10 ms when
#: allocated whole), where a 5 Gbit/s link brings one every 1.7 ms (bench/notes/receive-buffers.md).
FIRST_PIECE_BYTES = 64 * KiB
GROWTH = 4


def _clip(text: str) -> str:
    """Cut text to MAX_REASON_BYTES of UTF-8 (not characters: the peer counts bytes), never
    splitting a character. Error messages may quote peer-supplied strings."""
    return text.encode()[:MAX_REASON_BYTES].decode(errors="ignore")


class _Phase(Enum):
    HEADER = 1
    CHUNK_HEADER = 2
    BODY = 3
    PAYLOAD = 4


class Connection:
    """Protocol state of one connection. See protocol/SPEC.md §8 for the state table."""

    def __init__(
        self,
        role: Role,
        *,
        secret: bytes | None,
        limits: Limits = DEFAULT_LIMITS,
        local_id: str = "",
        incarnation: str = "",
        capabilities: tuple[str, ...] = (),
        chunk_sink: ChunkSink | None = None,
        admit: Admit | None = None,
        random_bytes: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        self.role = role
        self.limits = limits
        self.state = State.START if role is Role.CLIENT else State.AWAIT_HELLO
        self.kind: str | None = None
        self.version: int | None = None
        self.session = b""
        self.peer: HandshakeCompleted | None = None
        self._secret = secret
        self._local_id = local_id
        self._incarnation = incarnation
        self._capabilities = capabilities
        self._random_bytes = random_bytes
        self.chunk_sink = chunk_sink
        self.admit = admit
        self._hello: Hello | None = None
        self._server_nonce = b""
        self._outgoing: list[Buffer] = []
        self.bytes_received = 0
        self.bytes_sent = 0
        # Receive parser: the buffer being filled, how far, and what it is for.
        self._head = bytearray(HEADER_BYTES)
        self._chunk_head = bytearray(CHUNK_HEADER_BYTES)
        self._phase = _Phase.HEADER
        self._target: memoryview = memoryview(self._head)
        self._filled = 0
        # What the frame part being received declared: _target may be a smaller piece of it.
        self._declared = HEADER_BYTES
        self._frame: FrameHeader | None = None
        self._chunk: ChunkHeader | None = None
        self._in_place = False
        self._scratch: memoryview | None = None

    # ------------------------------------------------------------------ sending

    def start(self, *, kind: str, role: str, session: bytes = b"") -> None:
        """Client only: send HELLO for a control or data connection."""
        if self.role is not Role.CLIENT:
            raise LocalProtocolError(ErrorCode.UNEXPECTED_FRAME, "only the client says HELLO")
        self.kind = kind
        self._hello = Hello(
            PROTOCOL_MIN_VERSION,
            PROTOCOL_MAX_VERSION,
            kind,
            role,
            self._local_id,
            self._random_bytes(NONCE_BYTES),
            session,
            self._capabilities,
        )
        self.send(self._hello)

    def send(self, message: Message, stream_id: int = 0) -> None:
        """Queue one control message (or a FRAGMENT_END / STREAM_RESET / ACK of a transfer)."""
        if (stream_id != 0) != (message.TYPE in TRANSFER_FRAMES):
            # The peer would refuse the frame (frames.decode_header): our bug, not theirs.
            raise LocalProtocolError(
                ErrorCode.MALFORMED_BODY, f"{message.TYPE.name} with stream id {stream_id}"
            )
        self._check_send(message.TYPE)
        body = encode_body(message)
        self._queue(encode_header(message.TYPE, stream_id, len(body)), body)

    def send_chunk(self, transfer_id: int, chunk: ChunkHeader, payload: Buffer) -> None:
        """Queue one chunk; payload is lent to the caller of data_to_send() until written."""
        self._check_send(FrameType.CHUNK)
        if transfer_id == 0:
            raise LocalProtocolError(ErrorCode.MALFORMED_BODY, "transfer id 0 is reserved")
        head = encode_header(FrameType.CHUNK, transfer_id, CHUNK_HEADER_BYTES + len(payload))
        self._queue(head + encode_chunk_header(chunk), payload)

    def go_away(self, reason: str) -> None:
        """Say GOODBYE and stop; nothing more is sent or accepted."""
        if self.state is not State.CLOSED:
            body = encode_body(Goodbye(_clip(reason)))
            self._queue(encode_header(FrameType.GOODBYE, 0, len(body)), body)
            self.state = State.CLOSED

    def fail(self, code: ErrorCode, message: str) -> None:
        """Send ERROR and stop (used for our own deadlines and for the peer's protocol errors)."""
        if self.state is not State.CLOSED:
            body = encode_body(Error(int(code), _clip(message)))
            self._queue(encode_header(FrameType.ERROR, 0, len(body)), body)
            self.state = State.CLOSED

    def data_to_send(self) -> list[Buffer]:
        out, self._outgoing = self._outgoing, []
        return out

    def _queue(self, head: bytes, body: Buffer) -> None:
        self._outgoing.append(head)
        if len(body):
            self._outgoing.append(body)
        self.bytes_sent += len(head) + len(body)

    def _check_send(self, frame_type: FrameType) -> None:
        if self.state is State.CLOSED:
            raise LocalProtocolError(ErrorCode.UNEXPECTED_FRAME, f"{frame_type.name} after close")
        if frame_type in HANDSHAKE_FRAMES:
            nxt = HANDSHAKE_SEND.get((self.role, self.state, frame_type))
            if nxt is None:
                raise LocalProtocolError(
                    ErrorCode.UNEXPECTED_FRAME, f"{frame_type.name} in state {self.state.value}"
                )
            self.state = nxt
            return
        if self.state is not State.OPEN or frame_type not in OPEN_SENDS[(self.role, self.kind or "")]:
            raise LocalProtocolError(
                ErrorCode.UNEXPECTED_FRAME,
                f"{self.role.value} may not send {frame_type.name} on a {self.kind} connection "
                f"in state {self.state.value}",
            )

    # ---------------------------------------------------------------- receiving

    @property
    def mid_frame(self) -> bool:
        """True while part of a frame has arrived; a stall here is what the deadline is for."""
        return self._phase is not _Phase.HEADER or self._filled > 0

    @property
    def lent_chunk(self) -> tuple[int, ChunkHeader] | None:
        """(transfer id, chunk) while a chunk's payload is arriving in a slice the chunk sink lent.

        A connection that closes with a lent chunk must hand it back (InboundStreams.chunk_abandoned),
        or the copy resent on another connection is dropped as a duplicate.
        """
        if self._phase is _Phase.PAYLOAD and self._in_place and self._frame and self._chunk:
            return self._frame.stream_id, self._chunk
        return None

    def get_buffer(self) -> memoryview:
        """Where the next received bytes should go (never empty). Once closed, a scratch buffer:
        what a closing connection still reads is dropped there, never into a chunk's destination,
        which may already belong to someone else."""
        if self.state is State.CLOSED:
            if self._scratch is None:  # the smallest chunk: below every bound on what a peer is lent
                self._scratch = memoryview(bytearray(self.limits.min_chunk_bytes))
            return self._scratch
        return self._target[self._filled :]

    def buffer_updated(self, nbytes: int) -> list[Event]:
        """nbytes were written at the start of the last get_buffer(); returns completed events."""
        events: list[Event] = []
        if self.state is State.CLOSED:
            self._filled = 0  # discard: a closed connection reads nothing more
            return events
        self.bytes_received += nbytes
        self._filled += nbytes
        try:
            while self._filled == len(self._target) and self.state is not State.CLOSED:
                self._advance(events)
        except RemoteProtocolError as exc:
            self.fail(exc.code, exc.message)
            raise
        return events

    def receive_data(self, data: Buffer) -> list[Event]:
        """Feed received bytes; returns the events they complete. Raises RemoteProtocolError."""
        events: list[Event] = []
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view) and self.state is not State.CLOSED:
            target = self.get_buffer()
            n = min(len(target), len(view) - pos)
            target[:n] = view[pos : pos + n]
            pos += n
            events.extend(self.buffer_updated(n))
        return events

    def receive_eof(self) -> list[Event]:
        """The peer closed its side. Mid-frame that is a truncation; between frames, a departure."""
        if self.state is State.CLOSED:
            return []
        if self.mid_frame:
            self.state = State.CLOSED
            raise RemoteProtocolError(ErrorCode.TRUNCATED, "connection closed in the middle of a frame")
        self.state = State.CLOSED
        return [PeerWentAway("connection closed")]

    def _expect(self, phase: _Phase, target: memoryview) -> None:
        self._phase, self._target, self._filled = phase, target, 0
        self._declared = len(target)

    def _expect_fresh(self, phase: _Phase, nbytes: int) -> None:
        """Receive nbytes into a buffer of our own that grows as they arrive: FIRST_PIECE_BYTES,
        then GROWTH times larger each time it fills, so it never holds more than GROWTH times what
        has arrived (or FIRST_PIECE_BYTES)."""
        self._expect(phase, memoryview(bytearray(min(nbytes, FIRST_PIECE_BYTES))))
        self._declared = nbytes

    def _grow(self) -> None:
        grown = bytearray(min(self._declared, GROWTH * len(self._target)))
        grown[: self._filled] = self._target
        self._target = memoryview(grown)

    def _advance(self, events: list[Event]) -> None:
        phase = self._phase
        if len(self._target) < self._declared:
            self._grow()  # a fresh buffer is full but the frame part is not: more of it is coming
            return
        if phase is _Phase.HEADER:
            frame = decode_header(self._head, self.limits, handshaking=self.state is not State.OPEN)
            self._check_receive(frame.frame_type)
            self._frame = frame
            if frame.frame_type is FrameType.CHUNK:
                self._expect(_Phase.CHUNK_HEADER, memoryview(self._chunk_head))
            else:
                self._expect_fresh(_Phase.BODY, frame.body_length)
            return
        frame = self._frame
        assert frame is not None
        if phase is _Phase.CHUNK_HEADER:
            payload_length = frame.body_length - CHUNK_HEADER_BYTES
            chunk = decode_chunk_header(self._chunk_head, payload_length, self.limits)
            target = self.chunk_sink(frame.stream_id, chunk, payload_length) if self.chunk_sink else None
            self._in_place = target is not None
            self._chunk = chunk
            if target is None:
                self._expect_fresh(_Phase.PAYLOAD, payload_length)
            elif len(target) != payload_length:
                raise LocalProtocolError(ErrorCode.INTERNAL, "chunk sink lent a buffer of the wrong size")
            else:
                self._expect(_Phase.PAYLOAD, target)
            return
        if phase is _Phase.PAYLOAD:
            assert self._chunk is not None
            events.append(ChunkReceived(frame.stream_id, self._chunk, self._target, self._in_place))
        else:
            self._on_message(frame, decode_body(frame.frame_type, self._target, self.limits), events)
        self._frame, self._chunk = None, None
        self._expect(_Phase.HEADER, memoryview(self._head))

    def _check_receive(self, frame_type: FrameType) -> None:
        if frame_type in CLOSING_FRAMES:
            return
        if self.state is State.OPEN:
            allowed = OPEN_SENDS[(peer_of(self.role), self.kind or "")]
            if frame_type in allowed:
                return
        elif (self.role, self.state, frame_type) in HANDSHAKE_RECEIVE:
            return
        raise RemoteProtocolError(
            ErrorCode.UNEXPECTED_FRAME,
            f"{frame_type.name} is not allowed from the {peer_of(self.role).value} "
            f"in state {self.state.value}" + (f" on a {self.kind} connection" if self.kind else ""),
        )

    def _on_message(self, frame: FrameHeader, message: Message, events: list[Event]) -> None:
        if isinstance(message, Error):
            self.state = State.CLOSED
            events.append(PeerWentAway(message.message, message.code))
        elif isinstance(message, Goodbye):
            self.state = State.CLOSED
            events.append(PeerWentAway(message.reason))
        elif isinstance(message, Hello):
            self._on_hello(message)
        elif isinstance(message, AuthChallenge):
            self._on_challenge(message)
        elif isinstance(message, AuthResponse):
            events.append(self._on_response(message))
        elif isinstance(message, Welcome):
            events.append(self._on_welcome(message))
        else:
            events.append(MessageReceived(message, frame.stream_id))

    # ---------------------------------------------------------------- handshake

    def _on_hello(self, hello: Hello) -> None:
        low = max(hello.min_version, PROTOCOL_MIN_VERSION)
        high = min(hello.max_version, PROTOCOL_MAX_VERSION)
        if low > high:
            raise RemoteProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"peer speaks {hello.min_version}..{hello.max_version}, "
                f"this end {PROTOCOL_MIN_VERSION}..{PROTOCOL_MAX_VERSION}",
            )
        self._hello, self.version, self.kind = hello, high, hello.kind
        self._server_nonce = self._random_bytes(NONCE_BYTES)
        method = "hmac-sha256" if self._secret else "none"
        self.send(AuthChallenge(high, method, self._server_nonce))

    def _on_challenge(self, challenge: AuthChallenge) -> None:
        hello = self._hello
        assert hello is not None
        if not PROTOCOL_MIN_VERSION <= challenge.version <= PROTOCOL_MAX_VERSION:
            raise RemoteProtocolError(
                ErrorCode.UNSUPPORTED_VERSION, f"server chose version {challenge.version}"
            )
        if challenge.method == "none" and self._secret:
            # A server that skips authentication while we hold a key may be an impostor.
            raise RemoteProtocolError(
                ErrorCode.AUTH_REQUIRED, "server offers no authentication but this end has a secret"
            )
        if challenge.method == "hmac-sha256" and not self._secret:
            raise RemoteProtocolError(
                ErrorCode.AUTH_REQUIRED, "server requires a shared secret and this end has none"
            )
        self.version, self._server_nonce = challenge.version, challenge.nonce
        mac = b""
        if self._secret:
            mac = auth.client_proof(self._secret, hello, challenge.version, challenge.nonce)
        self.send(AuthResponse(mac))

    def _on_response(self, response: AuthResponse) -> HandshakeCompleted:
        hello = self._hello
        assert hello is not None and self.version is not None
        if self._secret:
            expected = auth.client_proof(self._secret, hello, self.version, self._server_nonce)
            if not auth.verify(expected, response.mac):
                raise RemoteProtocolError(ErrorCode.AUTH_FAILED, "authentication failed")
        if self.admit is not None:
            self.admit(hello)  # the server's own rules for this client (a data connection's session)
        self.session = hello.session or self._random_bytes(SESSION_ID_BYTES)
        mac = (
            auth.server_proof(self._secret, hello, self.version, self._server_nonce, self.session)
            if self._secret
            else b""
        )
        self.send(
            Welcome(
                self.session,
                self._local_id,
                self._incarnation,
                mac,
                self._capabilities,
                self.limits.max_chunk_bytes,
                self.limits.max_data_connections,
            )
        )
        self.peer = HandshakeCompleted(
            self.version,
            hello.kind,
            hello.role,
            hello.peer_id,
            self.session,
            self._incarnation,
            hello.capabilities,
        )
        return self.peer

    def _on_welcome(self, welcome: Welcome) -> HandshakeCompleted:
        hello = self._hello
        assert hello is not None and self.version is not None
        if self._secret:
            expected = auth.server_proof(
                self._secret, hello, self.version, self._server_nonce, welcome.session
            )
            if not auth.verify(expected, welcome.mac):
                raise RemoteProtocolError(ErrorCode.AUTH_FAILED, "server failed to prove the secret")
        if hello.session and welcome.session != hello.session:
            raise RemoteProtocolError(ErrorCode.UNKNOWN_SESSION, "server answered for another session")
        self.state = HANDSHAKE_RECEIVE[(self.role, State.AWAIT_WELCOME, FrameType.WELCOME)]
        self.session = welcome.session
        self.peer = HandshakeCompleted(
            self.version,
            hello.kind,
            hello.role,
            welcome.server_id,
            welcome.session,
            welcome.incarnation,
            welcome.capabilities,
        )
        return self.peer
