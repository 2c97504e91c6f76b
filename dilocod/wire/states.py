"""The connection state machine as one table (protocol/SPEC.md §8).

Everything about which frame may arrive or leave in which state lives here; the Connection consults
these tables and treats anything absent as UNEXPECTED_FRAME. Must not import asyncio, socket, torch
or logging.
"""

from __future__ import annotations

from enum import Enum

from dilocod.wire.frames import FrameType as F


class Role(Enum):
    CLIENT = "client"  # dialed out: learners, status clients, bench clients
    SERVER = "server"  # accepted: the syncer, bench servers


class State(Enum):
    START = "start"  # client before HELLO is sent
    AWAIT_HELLO = "await_hello"
    AWAIT_CHALLENGE = "await_challenge"
    AWAIT_RESPONSE = "await_response"
    AWAIT_WELCOME = "await_welcome"
    OPEN = "open"
    CLOSED = "closed"


#: Handshake: (our role, state, frame received) -> the state once it is handled. The core answers
#: HELLO, AUTH_CHALLENGE and AUTH_RESPONSE itself; the answer's send transition gets it there.
HANDSHAKE_RECEIVE: dict[tuple[Role, State, F], State] = {
    (Role.SERVER, State.AWAIT_HELLO, F.HELLO): State.AWAIT_RESPONSE,
    (Role.SERVER, State.AWAIT_RESPONSE, F.AUTH_RESPONSE): State.OPEN,
    (Role.CLIENT, State.AWAIT_CHALLENGE, F.AUTH_CHALLENGE): State.AWAIT_WELCOME,
    (Role.CLIENT, State.AWAIT_WELCOME, F.WELCOME): State.OPEN,
}
#: Handshake: (our role, state, frame sent) -> next state. Each is sent once: its source state is
#: left by sending it.
HANDSHAKE_SEND: dict[tuple[Role, State, F], State] = {
    (Role.CLIENT, State.START, F.HELLO): State.AWAIT_CHALLENGE,
    (Role.SERVER, State.AWAIT_HELLO, F.AUTH_CHALLENGE): State.AWAIT_RESPONSE,
    (Role.CLIENT, State.AWAIT_CHALLENGE, F.AUTH_RESPONSE): State.AWAIT_WELCOME,
    (Role.SERVER, State.AWAIT_RESPONSE, F.WELCOME): State.OPEN,
}

_ANY_OPEN = frozenset({F.PING, F.PONG, F.GOODBYE, F.ERROR, F.CHUNK, F.STREAM_RESET})
#: Frames the client sends on an open control connection (the server receives the same set).
#: Where JOIN falls in a session (first, once) is not a per-frame rule: the syncer enforces it
#: with NOT_JOINED (protocol/SPEC.md §4.4), this table only says which side may send it.
CLIENT_CONTROL = _ANY_OPEN | {
    F.JOIN,
    F.STEP_REPORT,
    F.PUSH_HEADER,
    F.NOTHING_TO_PUSH,
    F.FRAGMENT_END,
    F.FRAGMENT_ACK,
    F.CHUNK_RESEND,
    F.STATUS_REQUEST,
}
#: Frames the server sends on an open control connection (the client receives the same set).
SERVER_CONTROL = _ANY_OPEN | {
    F.PLAN,
    F.FRAGMENT_REQUEST,
    F.UPDATE_HEADER,
    F.FRAGMENT_END,
    F.FRAGMENT_ACK,
    F.CHUNK_RESEND,
    F.STATUS_RESPONSE,
}
#: Data connections carry only chunks, resets, liveness and closing frames, either way.
DATA = _ANY_OPEN

#: Open state: (sender's role, connection kind) -> frames that sender may send.
OPEN_SENDS: dict[tuple[Role, str], frozenset[F]] = {
    (Role.CLIENT, "control"): frozenset(CLIENT_CONTROL),
    (Role.SERVER, "control"): frozenset(SERVER_CONTROL),
    (Role.CLIENT, "data"): DATA,
    (Role.SERVER, "data"): DATA,
}
#: ERROR and GOODBYE may arrive in any state but CLOSED; they close the connection.
CLOSING_FRAMES = frozenset({F.ERROR, F.GOODBYE})


def peer_of(role: Role) -> Role:
    return Role.SERVER if role is Role.CLIENT else Role.CLIENT
