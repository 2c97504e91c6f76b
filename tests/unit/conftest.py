"""Fixtures shared by the wire unit tests: two sans-IO Connection cores wired together in memory.

Fixtures hand out plain functions (session scope: they hold no state), so hypothesis tests may use
them too. Nothing here does I/O or sleeps.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dilocod.wire.connection import ChunkSink, Connection
from dilocod.wire.events import Event, HandshakeCompleted
from dilocod.wire.limits import DEFAULT_LIMITS, Limits
from dilocod.wire.states import Role, State

Shuttle = Callable[[Connection, Connection], list[Event]]
Connect = Callable[..., tuple[Connection, Connection]]


def _shuttle(src: Connection, dst: Connection) -> list[Event]:
    """Hand everything src has queued to dst, one receive_data call per queued buffer."""
    events: list[Event] = []
    for buf in src.data_to_send():
        events.extend(dst.receive_data(buf))
    return events


def _connect(
    kind: str = "control",
    *,
    client_secret: bytes | None = None,
    server_secret: bytes | None = None,
    session: bytes = b"",
    client_sink: ChunkSink | None = None,
    server_sink: ChunkSink | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[Connection, Connection]:
    """A client and a server that completed the handshake; both outgoing queues are empty."""
    client = Connection(
        Role.CLIENT, secret=client_secret, limits=limits, local_id="learner-1", chunk_sink=client_sink
    )
    server = Connection(
        Role.SERVER,
        secret=server_secret,
        limits=limits,
        local_id="syncer",
        incarnation="inc-1",
        chunk_sink=server_sink,
    )
    client.start(kind=kind, role="learner", session=session)
    events: list[Event] = []
    for _ in range(4):  # HELLO, AUTH_CHALLENGE, AUTH_RESPONSE, WELCOME
        events += _shuttle(client, server) + _shuttle(server, client)
    if not (client.state is State.OPEN and server.state is State.OPEN):
        raise RuntimeError(f"handshake did not complete: {client.state}, {server.state}")
    if [type(e) for e in events] != [HandshakeCompleted, HandshakeCompleted]:
        raise RuntimeError(f"unexpected handshake events {events}")
    return client, server


@pytest.fixture(scope="session")
def shuttle() -> Shuttle:
    return _shuttle


@pytest.fixture(scope="session")
def connect() -> Connect:
    return _connect
