"""Dialing and listening: the small public async API of the transport.

connect() opens a session (control connection, then N data connections that name it);
Server accepts connections, authenticates each on its own, groups data connections under their
session, and runs one handler task per session in its TaskGroup. A handler that ends because its
peer left is the normal end of a session; one that fails with its own bug is logged and counted
here, the one place every server's handlers end.
"""

from __future__ import annotations

import asyncio
import secrets
import ssl as ssl_module
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

import structlog

from dilocod.transport.errors import HandshakeFailed
from dilocod.transport.options import TransportOptions
from dilocod.transport.protocol import FrameProtocol
from dilocod.transport.session import Session
from dilocod.wire.connection import Connection
from dilocod.wire.errors import ErrorCode, ProtocolError, RemoteProtocolError
from dilocod.wire.events import HandshakeCompleted
from dilocod.wire.limits import DEFAULT_LIMITS, Limits
from dilocod.wire.messages import CHUNK_RESEND_CAPABILITY, Hello
from dilocod.wire.states import Role, State
from dilocod.wire.stream import MAX_EARLY_BYTES, Allocate

CAPABILITIES = ("lz4", "zstd", "shuffle", CHUNK_RESEND_CAPABILITY)
Handler = Callable[[Session], Awaitable[None]]

log = structlog.get_logger("dilocod.transport")


def is_departure(exc: BaseException) -> bool:
    """Whether a handler ended because its session's connection went away (SessionClosed, or a
    connection lost under a write), rather than by a bug of its own. A handler that runs a task
    group gets every such error wrapped in an ExceptionGroup: a departure when all of them are."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_departure(inner) for inner in exc.exceptions)
    return isinstance(exc, ConnectionError)


def _executor(options: TransportOptions) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, options.codec_threads), thread_name_prefix="dilocod-codec")


async def _dial(
    host: str,
    port: int,
    *,
    peer_id: str,
    role: str,
    kind: str,
    session: bytes,
    secret: bytes | None,
    ssl: ssl_module.SSLContext | None,
    options: TransportOptions,
    limits: Limits,
) -> tuple[FrameProtocol, HandshakeCompleted]:
    loop = asyncio.get_running_loop()
    conn = Connection(Role.CLIENT, secret=secret, limits=limits, local_id=peer_id, capabilities=CAPABILITIES)
    try:
        async with asyncio.timeout(options.handshake_timeout_s):
            _, proto = await loop.create_connection(
                lambda: FrameProtocol(conn, options),
                host,
                port,
                ssl=ssl,
                server_hostname=host if ssl else None,
            )
            if conn.state is State.CLOSED or proto.closed.done():
                # Reset between the TCP connect and HELLO (a refusing middlebox, a syncer going
                # down): a connection that failed, for the caller to retry, not our protocol bug.
                proto.close()
                raise ConnectionError(f"{host}:{port} closed the connection before the handshake")
            conn.start(kind=kind, role=role, session=session)
            proto.flush()
            try:
                peer = await asyncio.shield(proto.handshake)
            except ProtocolError as exc:
                raise HandshakeFailed(exc.code, exc.message) from None
    except TimeoutError:
        raise HandshakeFailed(
            ErrorCode.TIMEOUT, f"no session with {host}:{port} within {options.handshake_timeout_s} s"
        ) from None
    return proto, peer


async def connect(
    host: str,
    port: int,
    *,
    peer_id: str,
    role: str = "learner",
    secret: bytes | None = None,
    ssl: ssl_module.SSLContext | None = None,
    streams: int = 1,
    options: TransportOptions | None = None,
    limits: Limits = DEFAULT_LIMITS,
    allocate: Allocate | None = None,
    data_streams: Callable[[Session], int] | None = None,
) -> Session:
    """Open a session: authenticate the control connection, then `streams` data connections.

    data_streams, when given, decides the number of data connections instead of `streams`, once
    the control connection is authenticated (it can read Session.round_trip_s, say).
    Raises HandshakeFailed (credentials, version, timeout) or OSError (nothing listening).
    """
    options = options or TransportOptions()
    if not 0 <= streams <= limits.max_data_connections:
        raise ValueError(f"streams must be in 0..{limits.max_data_connections}")
    kw = {
        "peer_id": peer_id,
        "role": role,
        "secret": secret,
        "ssl": ssl,
        "options": options,
        "limits": limits,
    }
    control, peer = await _dial(host, port, kind="control", session=b"", **kw)
    session = Session(
        control,
        peer,
        role=Role.CLIENT,
        options=options,
        limits=limits,
        executor=_executor(options),
        allocate=allocate,
        owns_executor=True,
    )
    try:
        if data_streams is not None:
            streams = data_streams(session)
            if not 0 <= streams <= limits.max_data_connections:
                raise ValueError(f"data_streams chose {streams}, not in 0..{limits.max_data_connections}")
        dials = [_dial(host, port, kind="data", session=peer.session, **kw) for _ in range(streams)]
        for proto, _ in await asyncio.gather(*dials):
            session.attach_data(proto)
    except BaseException:
        await session.close("data connections failed")
        raise
    return session


class Server:
    """Accepts sessions and runs `handler(session)` for each, concurrently, until closed.

    Use as `async with Server(...) as server:`; handlers are cancelled when the block exits.
    A handler's exception closes its own session and never disturbs other sessions: a departure
    of its peer (is_departure) is how sessions end; any other exception is a bug in the handler,
    logged with its traceback and counted in `handler_errors`.

    A data connection is admitted at its handshake, before WELCOME: it must name an open session
    of the same client (else UNKNOWN_SESSION), and that session must hold fewer than
    limits.max_data_connections data connections (else LIMIT_EXCEEDED). `allocate` and
    `max_early_bytes` are every new session's inbound policy until its handler sets its own
    (Session.set_allocator).
    """

    def __init__(
        self,
        handler: Handler,
        *,
        server_id: str,
        secret: bytes | None,
        ssl: ssl_module.SSLContext | None = None,
        options: TransportOptions | None = None,
        limits: Limits = DEFAULT_LIMITS,
        allocate: Allocate | None = None,
        max_early_bytes: int = MAX_EARLY_BYTES,
        incarnation: str | None = None,
    ) -> None:
        self.handler = handler
        self.server_id = server_id
        self.incarnation = incarnation or secrets.token_hex(8)
        self.options = options or TransportOptions()
        self.limits = limits
        self.sessions: dict[bytes, Session] = {}
        #: Handlers that failed with an exception of their own (not their peer's departure).
        self.handler_errors = 0
        self.rejected_connections = 0
        self._secret = secret
        self._ssl = ssl
        self._allocate = allocate
        self._max_early_bytes = max_early_bytes
        # Data connections admitted (WELCOME sent) but not yet attached, per session id: they
        # count against max_data_connections from the moment they are admitted.
        self._admitted: dict[bytes, set[FrameProtocol]] = {}
        self._server: asyncio.Server | None = None
        self._tasks: asyncio.TaskGroup | None = None
        self._executor = _executor(self.options)

    async def __aenter__(self) -> Server:
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
        assert self._tasks is not None
        await self._tasks.__aexit__(exc_type, exc, tb)
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        """Bind and start accepting; returns the bound address (port 0 picks a free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._new_connection, host, port, ssl=self._ssl, reuse_address=True, backlog=512
        )
        address = self._server.sockets[0].getsockname()
        return address[0], address[1]

    async def close(self, reason: str = "server shutting down") -> None:
        if self._server is not None:
            self._server.close()
        for session in list(self.sessions.values()):
            await session.close(reason)

    def _new_connection(self) -> FrameProtocol:
        conn = Connection(
            Role.SERVER,
            secret=self._secret,
            limits=self.limits,
            local_id=self.server_id,
            incarnation=self.incarnation,
            capabilities=CAPABILITIES,
        )
        proto = FrameProtocol(conn, self.options)
        conn.admit = lambda hello: self._admit(proto, hello)
        proto.handshake.add_done_callback(lambda fut: self._handshaken(proto, fut))
        return proto

    def _admit(self, proto: FrameProtocol, hello: Hello) -> None:
        """A client proved itself: refuse a data connection here, before WELCOME, if its session
        cannot take it (the client's dial fails with the code instead of opening)."""
        if hello.kind != "data":
            return
        session = self.sessions.get(hello.session)
        if session is None or session.peer.peer_id != hello.peer_id or not session.is_open:
            raise RemoteProtocolError(ErrorCode.UNKNOWN_SESSION, "no open session with that id for this peer")
        admitted = self._admitted.setdefault(hello.session, set())
        held = len(session.data) + len(admitted)
        if held >= self.limits.max_data_connections:
            raise RemoteProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"the session holds {held} data connections, the most it may "
                f"(max_data_connections = {self.limits.max_data_connections})",
            )
        admitted.add(proto)

    def _handshaken(self, proto: FrameProtocol, fut: asyncio.Future[HandshakeCompleted]) -> None:
        for session_id, admitted in list(self._admitted.items()):
            if proto in admitted:
                admitted.discard(proto)
                if not admitted:
                    del self._admitted[session_id]
        if fut.cancelled() or fut.exception() is not None:
            self.rejected_connections += 1
            return
        peer = fut.result()
        if peer.kind == "data":
            session = self.sessions.get(peer.session)
            if session is None or session.peer.peer_id != peer.peer_id or not session.is_open:
                proto.abort(ErrorCode.UNKNOWN_SESSION, "no open session with that id for this peer")
                return
            session.attach_data(proto)
            return
        session = Session(
            proto,
            peer,
            role=Role.SERVER,
            options=self.options,
            limits=self.limits,
            executor=self._executor,
            allocate=self._allocate,
            max_early_bytes=self._max_early_bytes,
        )
        self.sessions[peer.session] = session
        assert self._tasks is not None
        self._tasks.create_task(self._run(session), name=f"session {peer.peer_id}")

    async def _run(self, session: Session) -> None:
        try:
            await self.handler(session)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a handler's bug closes its session, never the server
            if not is_departure(exc):  # else the peer left or the server is closing: normal
                self.handler_errors += 1
                log.error(
                    "session handler failed",
                    peer=session.peer.peer_id,
                    role=session.peer.role,
                    error=repr(exc),
                    exc_info=exc,
                )
        finally:
            self.sessions.pop(session.session_id, None)
            await session.close("session ended")
