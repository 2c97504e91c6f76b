"""Session: one control connection plus N data connections to one peer, on either end.

The asyncio executor of a SessionCore (wire/session.py), which makes every decision about the
session's transfers (ids and their parity, acknowledgements, resets, resends, CHUNK_RESEND
allowances, spare chunks): this module feeds it what the connections report and carries out the
actions it returns. What stays here is IO and its pacing. Sending: the header goes on the control
connection, chunks are compressed on a thread pool (in order, a few ahead) and written to the
least-loaded data connection, then FRAGMENT_END; send_fragment returns when the core says the
receiver acknowledged, resending what the core asks for meanwhile, and resets the transfer when no
acknowledgement comes in time. Receiving: chunks land in the destination buffer (straight from the
socket when uncompressed) and are verified inline or decompressed off the loop (reading pauses
while too many decodes wait); messages and whole fragments wait in a bounded queue for recv()
(reading the control connection pauses while it is full); keepalive pings and idle deadlines.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from dilocod.transport.errors import SessionClosed, TransferFailed
from dilocod.transport.options import TransportOptions
from dilocod.transport.protocol import FrameProtocol
from dilocod.transport.sockets import round_trip_s
from dilocod.wire import codecs
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.events import ChunkReceived, Event, HandshakeCompleted, MessageReceived, PeerWentAway
from dilocod.wire.frames import CODECS_BY_NAME, ChunkHeader, Codec
from dilocod.wire.limits import Limits
from dilocod.wire.messages import CHUNK_RESEND_CAPABILITY, Message, Ping, PushHeader, UpdateHeader
from dilocod.wire.session import (
    AbortControl,
    Action,
    CompleteSend,
    Decode,
    DeliverFragment,
    DeliverMessage,
    FailSend,
    InboundCutShort,
    PeerFaulted,
    ResendChunks,
    SendMessage,
    SessionCore,
    blames_peer,
)
from dilocod.wire.states import Role
from dilocod.wire.stream import MAX_EARLY_BYTES, Allocate, CutShort, StreamHeader


@dataclass(frozen=True, slots=True)
class FragmentReceived:
    """A whole fragment, verified chunk by chunk and against its end digest."""

    transfer_id: int
    header: StreamHeader
    buffer: memoryview


Incoming = Message | FragmentReceived


def allocate_bytearray(header: StreamHeader) -> memoryview:
    return memoryview(bytearray(header.raw_bytes))


def _encode(
    codec: Codec, raw: memoryview, shuffle: int, checksum: int | None
) -> tuple[Codec, int, codecs.Buffer, int]:
    used, used_shuffle, payload = codecs.compress(codec, raw, shuffle)
    return used, used_shuffle, payload, codecs.checksum(raw) if checksum is None else checksum


@dataclass(slots=True)
class _Send:
    """What the coroutine sending one transfer waits on; the core decides what goes in."""

    transfer_id: int
    header: StreamHeader
    view: memoryview
    shuffle: int
    checksums: Sequence[int] | None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    resend: list[int] = field(default_factory=list)
    acked: bool = False
    error: BaseException | None = None


class Session:
    def __init__(
        self,
        control: FrameProtocol,
        peer: HandshakeCompleted,
        *,
        role: Role,
        options: TransportOptions,
        limits: Limits,
        executor: Executor,
        allocate: Allocate | None = None,
        max_early_bytes: int = MAX_EARLY_BYTES,
        owns_executor: bool = False,
    ) -> None:
        self.control = control
        self.peer = peer
        self.role = role
        self.options = options
        self.data: list[FrameProtocol] = []
        self._loop = asyncio.get_running_loop()
        self._executor = executor
        self._owns_executor = owns_executor
        #: Every decision about this session's transfers (wire/session.py); this class executes them.
        self.core = SessionCore(
            role,
            limits,
            allocate or allocate_bytearray,
            max_early_bytes=max_early_bytes,
            peer_resends=CHUNK_RESEND_CAPABILITY in peer.capabilities,
        )
        self._sends: dict[int, _Send] = {}
        self._data_index = itertools.count()
        self._incoming: deque[Incoming] = deque()
        self._wakeup = asyncio.Event()
        self._pending_decodes = 0
        #: Set while no chunk is being decoded in a worker: once the session is closed, nothing
        #: writes into the buffers of its cut-short transfers any more (a resumed one may reuse them).
        self.decodes_idle = asyncio.Event()
        self.decodes_idle.set()
        self._reading_paused = False
        self._control_paused = False
        self._ping_seq = itertools.count(1)
        self.close_reason: str | None = None
        #: The code of the peer's ERROR frame that closed the session, if that is how it ended.
        self.close_code: int | None = None
        #: What the peer said as it closed the session (ERROR message, GOODBYE reason), if it did.
        self.close_detail: str | None = None
        self.closed = asyncio.Event()
        self.bytes_payload_sent = 0
        self.bytes_payload_received = 0
        #: Called with what an inbound transfer that was opened and then failed or was abandoned
        #: (reset by either side, or the session closed) holds. A decompression may still be
        #: writing into its buffer: drop it, or (the session closed) wait for decodes_idle before
        #: handing it out again.
        self.on_inbound_failed: Callable[[CutShort], None] | None = None
        #: Called with (where, error) when the peer's input failed a check: a transfer reset for
        #: it ("transfer N"), or a connection closed for it ("control connection", "data
        #: connection"). For the application's log: the transport itself logs nothing.
        self.on_peer_error: Callable[[str, RemoteProtocolError], None] | None = None
        control.conn.chunk_sink = self.core.chunk_target
        control.attach(self._on_event, self._on_control_lost)
        self._timer = self._loop.call_later(options.ping_interval_s, self._keepalive)

    # ----------------------------------------------------------------- public

    @property
    def session_id(self) -> bytes:
        return self.peer.session

    @property
    def is_open(self) -> bool:
        # The control connection closes (a protocol error it detected, a deadline's abort) before
        # its transport reports the loss that finishes the session: between the two, nothing may
        # be sent on it, and the session is as good as closed.
        return not self.closed.is_set() and self.control.is_open

    @property
    def chunks_asked_again(self) -> int:
        """Damaged chunks of inbound transfers this end asked for again (CHUNK_RESEND)."""
        return self.core.chunks_asked_again

    def round_trip_s(self) -> float | None:
        """The kernel's lowest round-trip time among this session's open connections (TCP_INFO),
        or None where the platform does not measure it."""
        times = []
        for proto in [self.control, *self.data]:
            if proto.transport is not None and proto.is_open:
                sock = proto.transport.get_extra_info("socket")
                rtt = round_trip_s(sock) if sock is not None else None
                if rtt is not None:
                    times.append(rtt)
        return min(times, default=None)

    def set_allocator(self, allocate: Allocate, *, max_early_bytes: int = MAX_EARLY_BYTES) -> None:
        """Choose where this session's inbound fragments land, per header. An allocator may refuse
        a transfer by raising RemoteProtocolError: the peer gets STREAM_RESET with its code, and
        the session goes on. max_early_bytes bounds the chunks kept ahead of their header (0 for
        an allocator that refuses everything: such chunks could never be used)."""
        self.core.set_allocator(allocate, max_early_bytes)

    def attach_data(self, proto: FrameProtocol) -> None:
        """Add an authenticated data connection of this session."""
        proto.index = next(self._data_index)
        proto.conn.chunk_sink = self.core.chunk_target
        self.data.append(proto)
        proto.attach(self._on_event, self._on_data_lost)

    async def send(self, message: Message, stream_id: int = 0) -> None:
        """Send one control message, waiting (with the write deadline) while the peer is slow."""
        self._check_open()
        self.control.send(message, stream_id)
        try:
            await self.control.drain()
        except TimeoutError:
            self.control.abort(ErrorCode.TIMEOUT, "peer stopped reading the control connection")
            raise SessionClosed("peer stopped reading") from None

    async def recv(self) -> Incoming:
        """Next control message or whole fragment from the peer; SessionClosed once it is gone."""
        while not self._incoming:
            if self.closed.is_set():
                raise SessionClosed(self.close_reason or "session closed", self.close_code, self.close_detail)
            self._wakeup.clear()
            await self._wakeup.wait()
        item = self._incoming.popleft()
        if self._control_paused and len(self._incoming) < self.options.max_queued_messages // 2:
            self._control_paused = False
            if self.control.transport is not None:
                self.control.transport.resume_reading()
        return item

    async def send_fragment(
        self,
        header: PushHeader | UpdateHeader,
        buffer: codecs.Buffer,
        *,
        shuffle_item_size: int = 0,
        checksums: Sequence[int] | None = None,
    ) -> int:
        """Stream one fragment and wait for the receiver's acknowledgement.

        buffer is lent until this returns (chunks are written from it without copies). checksums,
        when given, are codecs.chunk_checksums(buffer, header.chunk_bytes) computed beforehand
        (where the fragment was made, or once for many receivers); a buffer changed since then
        fails the transfer at the receiver rather than arriving corrupt. Raises TransferFailed
        (retry the fragment) or SessionClosed (reconnect).
        """
        self._check_open()
        view = memoryview(buffer).cast("B")
        if len(view) != header.raw_bytes:
            raise ValueError(f"buffer holds {len(view)} bytes, header declares {header.raw_bytes}")
        transfer_id, to_send = self.core.start_send(header, checksums)
        send = _Send(transfer_id, header, view, shuffle_item_size, checksums)
        self._sends[transfer_id] = send
        try:
            await self.send(header, transfer_id)
            await self._send_chunks(send, to_send)
            if self.core.sending(transfer_id):
                await self.send(self.core.fragment_end(transfer_id), transfer_id)
            deadline = self._loop.time() + self.options.ack_timeout_s
            while not send.acked and send.error is None:
                if send.resend:
                    seqs, send.resend = send.resend, []
                    await self._send_chunks(send, seqs)
                    continue
                send.wake.clear()
                try:
                    async with asyncio.timeout_at(deadline):
                        await send.wake.wait()
                except TimeoutError:
                    self._execute(self.core.ack_overdue(transfer_id))
            if send.error is not None:
                raise send.error
        finally:
            del self._sends[transfer_id]
            self.core.send_abandoned(transfer_id)  # cancelled: nothing waits for its outcome
        self.bytes_payload_sent += header.raw_bytes
        return transfer_id

    async def close(self, reason: str = "closing") -> None:
        """Say goodbye on every connection and wait (briefly) for them to close."""
        if not self.closed.is_set():
            for proto in [*self.data, self.control]:
                if proto.is_open:
                    proto.go_away(reason)
            self._finish(reason)
        waits = [p.closed for p in [*self.data, self.control]]
        if waits:
            await asyncio.wait(waits, timeout=self.options.handshake_timeout_s)

    # ------------------------------------------------------------- sending side

    async def _send_chunks(self, send: _Send, seqs: Iterable[int]) -> None:
        """Write chunks while the core says the transfer is going (never after it ended)."""
        codec = CODECS_BY_NAME[send.header.codec]
        if codec is Codec.NONE:
            await self._send_plain_chunks(send, seqs)
            return
        chunk_bytes = send.header.chunk_bytes
        depth = max(1, self.options.codec_threads * 2)
        window: deque[tuple[int, asyncio.Future[tuple[Codec, int, codecs.Buffer, int]]]] = deque()

        def submit(seq: int) -> None:
            raw = send.view[seq * chunk_bytes : (seq + 1) * chunk_bytes]
            known = None if send.checksums is None else send.checksums[seq]
            future = self._loop.run_in_executor(self._executor, _encode, codec, raw, send.shuffle, known)
            window.append((seq, future))

        try:
            for seq in seqs:
                submit(seq)
                if len(window) >= depth and not await self._write_chunk(send, *window.popleft()):
                    return
            while window:
                if not await self._write_chunk(send, *window.popleft()):
                    return
        finally:
            for _, future in window:
                future.cancel()

    async def _send_plain_chunks(self, send: _Send, seqs: Iterable[int]) -> None:
        """Codec none: no pool, no window. Without prepared checksums each chunk is hashed just
        before it is written, so the kernel copies it out of cache (xxh3 runs about 4x faster on
        a cached chunk than on one it must read from memory)."""
        transfer_id, chunk_bytes = send.transfer_id, send.header.chunk_bytes
        view, known, core = send.view, send.checksums, self.core
        for seq in seqs:
            proto = await self._pick_connection()
            if not core.sending(transfer_id):
                return
            raw = view[seq * chunk_bytes : (seq + 1) * chunk_bytes]
            checksum = codecs.checksum(raw) if known is None else known[seq]
            proto.send_chunk(transfer_id, ChunkHeader(seq, len(raw), Codec.NONE, 0, checksum), raw)
            core.chunk_sent(transfer_id, seq, proto.index, checksum)

    async def _write_chunk(
        self,
        send: _Send,
        seq: int,
        encoded: asyncio.Future[tuple[Codec, int, codecs.Buffer, int]],
    ) -> bool:
        """Write one encoded chunk; False once the transfer has ended (nothing more is written)."""
        used, shuffle, payload, checksum = await encoded
        header = send.header
        raw_length = min(header.chunk_bytes, header.raw_bytes - seq * header.chunk_bytes)
        proto = await self._pick_connection()
        if not self.core.sending(send.transfer_id):
            return False
        proto.send_chunk(send.transfer_id, ChunkHeader(seq, raw_length, used, shuffle, checksum), payload)
        self.core.chunk_sent(send.transfer_id, seq, proto.index, checksum)
        return True

    async def _pick_connection(self) -> FrameProtocol:
        """The open data connection with the least unsent data; the control one if none is left."""
        while True:
            self._check_open()
            candidates = [p for p in self.data if p.is_open] or [self.control]
            best = min(candidates, key=lambda p: (p.paused, p.write_buffer_size()))
            if not best.paused:
                return best
            try:
                await best.drain()
            except ConnectionError:
                continue  # lost while we waited: its chunks are queued for resending
            except TimeoutError:
                best.abort(ErrorCode.TIMEOUT, "peer stopped reading this connection")

    # ----------------------------------------------------------- receiving side

    def _on_event(self, proto: FrameProtocol, event: Event) -> None:
        if isinstance(event, ChunkReceived):
            self._execute(
                self.core.chunk_received(event.transfer_id, event.chunk, event.payload, event.in_place)
            )
        elif isinstance(event, MessageReceived):
            self._execute(self.core.message_received(event.message, event.stream_id, self._loop.time()))
        elif isinstance(event, PeerWentAway) and proto is self.control:
            if not self.closed.is_set():
                self.close_code, self.close_detail = event.error_code, event.reason
            self._finish(f"peer went away: {event.reason}")

    def _execute(self, actions: list[Action]) -> None:
        """Carry out the core's actions, in order."""
        for action in actions:
            if isinstance(action, Decode):
                self._decode(action)
            elif isinstance(action, SendMessage):
                if self.control.is_open:
                    if action.answer:
                        self.control.reply(action.message, action.stream_id)
                    else:
                        self.control.send(action.message, action.stream_id)
            elif isinstance(action, DeliverFragment):
                done = action.fragment
                self.bytes_payload_received += done.header.raw_bytes
                self._queue(FragmentReceived(done.transfer_id, done.header, done.buffer))
            elif isinstance(action, DeliverMessage):
                self._queue(action.message)
            elif isinstance(action, ResendChunks | CompleteSend | FailSend):
                self._wake_sender(action)
            elif isinstance(action, InboundCutShort):
                if self.on_inbound_failed is not None:
                    self.on_inbound_failed(action.cut)
            elif isinstance(action, PeerFaulted):
                self._peer_error(action.where, action.error)
            elif isinstance(action, AbortControl):
                self.control.abort(action.code, action.reason)

    def _wake_sender(self, action: ResendChunks | CompleteSend | FailSend) -> None:
        send = self._sends.get(action.transfer_id)
        if send is None:
            return  # no coroutine sends it (a transfer started by hand, or already given up)
        if isinstance(action, ResendChunks):
            send.resend.extend(action.seqs)
        elif isinstance(action, CompleteSend):
            send.acked = True
        elif action.code is None:
            send.error = SessionClosed(action.reason)
        else:
            send.error = TransferFailed(action.code, action.reason)
        send.wake.set()

    def _decode(self, action: Decode) -> None:
        chunk = action.chunk
        if chunk.codec is Codec.NONE:
            # Verifying a checksum runs at memory speed: cheaper inline than a thread hop.
            try:
                codecs.decompress_into(chunk, action.payload, action.dest, in_place=action.in_place)
            except RemoteProtocolError as exc:
                self._execute(self.core.chunk_failed(action.transfer_id, chunk, exc))
                return
            self._execute(self.core.chunk_verified(action.transfer_id, chunk))
            return
        self._pending_decodes += 1
        self.decodes_idle.clear()
        if self._pending_decodes >= self.options.max_pending_decodes and not self._reading_paused:
            self._set_reading(paused=True)
        future = self._loop.run_in_executor(
            self._executor, codecs.decompress_into, chunk, action.payload, action.dest
        )
        future.add_done_callback(lambda done: self._decoded(action.transfer_id, chunk, done))

    def _decoded(self, transfer_id: int, chunk: ChunkHeader, future: asyncio.Future[None]) -> None:
        self._pending_decodes -= 1
        if not self._pending_decodes:
            self.decodes_idle.set()
        if self._reading_paused and self._pending_decodes <= self.options.max_pending_decodes // 2:
            self._set_reading(paused=False)
        if future.cancelled():
            return
        exc = future.exception()  # retrieved even when moot, or asyncio logs it as never retrieved
        if isinstance(exc, RemoteProtocolError):
            self._execute(self.core.chunk_failed(transfer_id, chunk, exc))
        elif exc is not None:
            internal = RemoteProtocolError(ErrorCode.INTERNAL, repr(exc))
            self._execute(self.core.chunk_failed(transfer_id, chunk, internal))
        else:
            self._execute(self.core.chunk_verified(transfer_id, chunk))

    def _queue(self, item: Incoming) -> None:
        self._incoming.append(item)
        self._wakeup.set()
        if len(self._incoming) >= self.options.max_queued_messages and not self._control_paused:
            self._control_paused = True
            if self.control.transport is not None:
                self.control.transport.pause_reading()

    def _set_reading(self, *, paused: bool) -> None:
        self._reading_paused = paused
        for proto in self.data:
            if proto.transport is not None and proto.is_open:
                (proto.transport.pause_reading if paused else proto.transport.resume_reading)()

    # ------------------------------------------------------------ liveness

    def _keepalive(self) -> None:
        if self.closed.is_set():
            return
        now = self._loop.time()
        for proto in [self.control, *self.data]:
            if not proto.is_open:
                continue
            quiet_s = now - proto.last_receive
            if quiet_s > self.options.idle_timeout_s:
                proto.abort(ErrorCode.TIMEOUT, f"peer silent for {quiet_s:.0f} s")
            elif quiet_s > self.options.ping_interval_s:
                proto.send(Ping(next(self._ping_seq)))
        self._execute(self.core.expire(now, self.options.transfer_timeout_s))
        self._timer = self._loop.call_later(self.options.ping_interval_s, self._keepalive)

    def _on_data_lost(self, proto: FrameProtocol, exc: BaseException | None) -> None:
        self._peer_error("data connection", exc)
        if proto in self.data:
            self.data.remove(proto)
        # The connection may have died in the middle of a chunk it was reading into its
        # destination (lent_chunk): the core frees that slot for the copy the sender resends.
        self._execute(self.core.data_lost(proto.index, proto.conn.lent_chunk))

    def _on_control_lost(self, proto: FrameProtocol, exc: BaseException | None) -> None:
        self._peer_error("control connection", exc)
        self._finish(f"control connection lost: {exc}" if exc else "control connection closed")

    def _finish(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        self._wakeup.set()
        self._timer.cancel()
        self._execute(self.core.close(reason))
        for proto in [*self.data, self.control]:
            if proto.is_open:
                proto.go_away(reason)
            else:
                proto.close()
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _peer_error(self, where: str, exc: BaseException | None) -> None:
        if self.on_peer_error is not None and isinstance(exc, RemoteProtocolError) and blames_peer(exc):
            self.on_peer_error(where, exc)

    def _check_open(self) -> None:
        if self.closed.is_set():
            raise SessionClosed(self.close_reason or "session closed", self.close_code, self.close_detail)
        if not self.control.is_open:
            raise SessionClosed("control connection closing", self.close_code, self.close_detail)
