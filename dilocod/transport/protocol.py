"""FrameProtocol: the asyncio adapter around one wire Connection.

It lends the core's receive buffer to the event loop (BufferedProtocol), so chunk payloads land in
their destination without an intermediate copy; writes header and payload views with writelines;
turns pause/resume_writing into an awaitable drain; and enforces the handshake and mid-frame stall
deadlines. Protocol decisions stay in the core; what the events mean is the session's business.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable

from dilocod.transport.options import TransportOptions
from dilocod.transport.sockets import tune
from dilocod.wire.connection import Buffer, Connection
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.events import Event, HandshakeCompleted, MessageReceived, PeerWentAway
from dilocod.wire.frames import ChunkHeader
from dilocod.wire.messages import Message, Ping, Pong
from dilocod.wire.states import State

EventHandler = Callable[["FrameProtocol", Event], None]
LostHandler = Callable[["FrameProtocol", BaseException | None], None]
#: After an error frame is queued, how long the peer gets to read it before we abort.
CLOSE_GRACE_S = 2.0


def _refusal(event: PeerWentAway) -> BaseException:
    try:
        code = ErrorCode(event.error_code) if event.error_code is not None else None
    except ValueError:
        code = None
    if code is None:
        return ConnectionError(f"peer closed during the handshake: {event.reason}")
    return RemoteProtocolError(code, f"peer refused the handshake: {event.reason}")


class FrameProtocol(asyncio.BufferedProtocol):
    def __init__(self, conn: Connection, options: TransportOptions) -> None:
        self.conn = conn
        self.options = options
        self.transport: asyncio.Transport | None = None
        self.on_event: EventHandler | None = None
        self.on_lost: LostHandler | None = None
        self.index = -1  # position among the session's data connections, set by the session
        self.error: BaseException | None = None
        loop = asyncio.get_running_loop()
        self._loop = loop
        self.handshake: asyncio.Future[HandshakeCompleted] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._drain: asyncio.Future[None] | None = None
        self._paused = False
        self.last_receive = loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._started = loop.time()
        self._backlog: list[Event] = []
        # Reading paused from the handshake until attach() (see _dispatch).
        self._held = False
        # Answers to the peer's own frames still in the write buffer: (stream offset where each
        # ends, its size), and their total (reply()).
        self._replies: deque[tuple[int, int]] = deque()
        self._reply_bytes = 0
        self._ending = False  # _close_after_flush has run

    # --------------------------------------------------------------- asyncio side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # TCP, or TLS over TCP
        # asyncio's default 64 KiB high-water mark pauses after every chunk and lets the socket
        # run dry while the loop wakes up; keeping a few chunks queued keeps the kernel fed.
        transport.set_write_buffer_limits(
            high=self.options.write_buffer_high_bytes, low=self.options.write_buffer_high_bytes // 4
        )
        sock: socket.socket | None = transport.get_extra_info("socket")
        if sock is not None:
            tune(sock, buffer_bytes=self.options.socket_buffer_bytes, congestion=self.options.congestion)
        self._arm_timer()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.last_receive = self._loop.time()
        try:
            events = self.conn.buffer_updated(nbytes)
        except RemoteProtocolError as exc:
            self._close_with(exc)
            return
        self._dispatch(events)

    def eof_received(self) -> bool:
        try:
            events = self.conn.receive_eof()
        except RemoteProtocolError as exc:
            self._close_with(exc)
            return False
        self._dispatch(events)
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.conn.state = State.CLOSED
        if exc is not None and self.error is None:
            self.error = exc
        if not self.handshake.done():
            self.handshake.set_exception(self.error or ConnectionError("connection closed during handshake"))
            self.handshake.exception()  # retrieved: a failed dial reports it through its own await
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionError("connection lost"))
            self._drain.exception()
        if not self.closed.done():
            self.closed.set_result(None)
        if self.on_lost is not None:
            self.on_lost(self, self.error)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # ------------------------------------------------------------ session side

    def attach(self, on_event: EventHandler, on_lost: LostHandler) -> None:
        """Hand this connection to its session; events that arrived before are replayed."""
        self.on_event, self.on_lost = on_event, on_lost
        backlog, self._backlog = self._backlog, []
        for event in backlog:
            on_event(self, event)
        self.flush()
        if self.closed.done():
            on_lost(self, self.error)
        elif self._held and self.transport is not None:
            self._held = False
            self.transport.resume_reading()

    @property
    def is_open(self) -> bool:
        return self.conn.state is State.OPEN and not self.closed.done()

    @property
    def paused(self) -> bool:
        return self._paused

    def write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport else 0

    def send(self, message: Message, stream_id: int = 0) -> None:
        self.conn.send(message, stream_id)
        self.flush()

    def send_chunk(self, transfer_id: int, chunk: ChunkHeader, payload: Buffer) -> None:
        self.conn.send_chunk(transfer_id, chunk, payload)
        self.flush()

    def reply(self, message: Message, stream_id: int = 0) -> None:
        """Send an answer the peer's own frame called for (PONG, a STREAM_RESET or FRAGMENT_ACK of
        its transfer). Unlike our own sends, these are as many as the peer makes us write, so at
        most options.max_reply_backlog_bytes of them may wait unsent: a peer that goes on asking
        without reading the answers is cut off with LIMIT_EXCEEDED."""
        before = self.conn.bytes_sent
        self.send(message, stream_id)
        self._replies.append((self.conn.bytes_sent, self.conn.bytes_sent - before))
        self._reply_bytes += self.conn.bytes_sent - before
        written = self.conn.bytes_sent - self.write_buffer_size()  # handed to the kernel
        while self._replies and self._replies[0][0] <= written:
            self._reply_bytes -= self._replies.popleft()[1]
        if self._reply_bytes > self.options.max_reply_backlog_bytes:
            self.abort(
                ErrorCode.LIMIT_EXCEEDED,
                f"{self._reply_bytes} bytes of answers to the peer's frames are unread "
                f"(max_reply_backlog_bytes = {self.options.max_reply_backlog_bytes})",
            )

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.ending:
            self.transport.writelines(data)  # type: ignore[union-attr]  # ending covers None

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its low-water mark."""
        if not self._paused:
            return
        if self.closed.done():
            raise ConnectionError("connection lost")
        if self._drain is None:
            self._drain = self._loop.create_future()
        async with asyncio.timeout(self.options.write_timeout_s):
            await asyncio.shield(self._drain)

    def go_away(self, reason: str) -> None:
        self.conn.go_away(reason)
        self._close_after_flush()

    def abort(self, code: ErrorCode, message: str) -> None:
        """Our side gives up on this connection (deadline, unusable peer): ERROR frame, close."""
        self.error = self.error or RemoteProtocolError(code, message)
        self.conn.fail(code, message)
        self._close_after_flush()

    # ---------------------------------------------------------------- internals

    def _dispatch(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, HandshakeCompleted) and not self.handshake.done():
                self.handshake.set_result(event)
                if self.on_event is None and self.transport is not None:
                    # Nothing more is read until a session attaches this connection: what follows
                    # the handshake (a chunk) needs the session's sink to be received under its
                    # bounds, and the session is made by a callback that may run after the next read.
                    self.transport.pause_reading()
                    self._held = True
            elif isinstance(event, PeerWentAway) and not self.handshake.done() and self.error is None:
                # The peer refused the handshake with an ERROR frame: keep its code, so the dialer
                # reports AUTH_FAILED (or whatever it was) rather than a bare closed connection.
                self.error = _refusal(event)
            elif isinstance(event, MessageReceived) and isinstance(event.message, Ping):
                if self.is_open:
                    self.reply(Pong(event.message.seq))
                continue
            if self.on_event is not None:
                self.on_event(self, event)
            else:
                self._backlog.append(event)  # frames right behind the handshake, before a session
        self.flush()
        if self.conn.state is State.CLOSED:
            self._close_after_flush()

    def _close_with(self, exc: RemoteProtocolError) -> None:
        self.error = exc
        self._close_after_flush()

    def close(self) -> None:
        """End a connection that has no last frame to deliver (one that never opened): at once."""
        self.conn.state = State.CLOSED
        if not self.ending:
            self._ending = True
            self.transport.close()  # type: ignore[union-attr]  # ending covers None
            self._loop.call_later(CLOSE_GRACE_S, self.transport.abort)  # type: ignore[union-attr]

    @property
    def ending(self) -> bool:
        """Our side has begun to close (half-closed or closed): nothing more is written."""
        return self._ending or self.transport is None or self.transport.is_closing()

    def _close_after_flush(self) -> None:
        """Our last frame (GOODBYE or ERROR), if any, is queued: send it, then close without a reset.

        A socket closed with unread bytes in its receive queue sends RST, and the kernel drops
        what it had not yet sent, our last frame included; a peer that writes after the RST
        arrived fails on the write before it has read that frame. So where TCP allows it we only
        half-close (FIN after the last frame) and go on reading, into the core's scratch buffer,
        until the peer closes its side on reading our frame (eof_received then closes the
        transport). TLS cannot half-close; it closes at once. Either way a peer that neither
        reads nor closes is aborted after CLOSE_GRACE_S."""
        self.flush()
        if self.ending:
            return
        self._ending = True
        transport = self.transport
        assert transport is not None
        if transport.can_write_eof():
            transport.write_eof()
            if not transport.is_reading():
                transport.resume_reading()  # held for a session, or paused for flow control
        else:
            transport.close()
        self._loop.call_later(CLOSE_GRACE_S, transport.abort)

    def _arm_timer(self) -> None:
        period = min(self.options.stall_timeout_s, self.options.handshake_timeout_s) / 4
        self._timer = self._loop.call_later(period, self._check_deadlines)

    def _check_deadlines(self) -> None:
        now = self._loop.time()
        if self.closed.done():
            return
        if not self.handshake.done() and now - self._started > self.options.handshake_timeout_s:
            self.abort(ErrorCode.TIMEOUT, "handshake not completed in time")
            return
        if self.conn.mid_frame and now - self.last_receive > self.options.stall_timeout_s:
            self.abort(ErrorCode.TIMEOUT, f"peer stalled mid-frame for {self.options.stall_timeout_s} s")
            return
        self._arm_timer()
