"""Session: one control connection plus N data connections to one peer, on either end.

Owns fragment transfers in both directions. Sending: the header goes on the control connection,
chunks are compressed on a thread pool (in order, a few ahead) and written to the least-loaded data
connection, then FRAGMENT_END; the send completes when the receiver acknowledges, and a lost data
connection's chunks are resent on the survivors meanwhile, as are the chunks the receiver asks for
again (CHUNK_RESEND, up to its allowance). Receiving: chunks land in the destination buffer
(straight from the socket when uncompressed), are verified or decompressed off the loop, and a
whole verified fragment is acknowledged and queued for recv(); a chunk that arrives damaged is
asked for again where the peer listed the chunk-resend capability (protocol/SPEC.md §5.12), else
its transfer is reset. Transfer ids are odd when the client sends and even when the server does,
so a STREAM_RESET is never ambiguous.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial

from dilocod.transport.errors import SessionClosed, TransferFailed
from dilocod.transport.options import TransportOptions
from dilocod.transport.protocol import FrameProtocol
from dilocod.transport.sockets import round_trip_s
from dilocod.wire import codecs
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.events import ChunkReceived, Event, HandshakeCompleted, MessageReceived, PeerWentAway
from dilocod.wire.frames import CODECS_BY_NAME, ChunkHeader, Codec
from dilocod.wire.limits import Limits
from dilocod.wire.messages import (
    CHUNK_RESEND_CAPABILITY,
    ChunkResend,
    FragmentAck,
    FragmentEnd,
    Message,
    Ping,
    Pong,
    PushHeader,
    StreamReset,
    UpdateHeader,
)
from dilocod.wire.states import Role
from dilocod.wire.stream import (
    DAMAGED_CHUNK_CODES,
    MAX_EARLY_BYTES,
    Allocate,
    CutShort,
    FragmentAssembled,
    InboundStreams,
    OutboundTransfer,
    StreamHeader,
    resend_allowance,
)

CONTROL_INDEX = -1


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
    header: StreamHeader
    view: memoryview
    shuffle: int
    checksums: Sequence[int] | None
    out: OutboundTransfer
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    resend: list[int] = field(default_factory=list)
    #: Chunks the receiver asked for again (CHUNK_RESEND), against its allowance.
    asked_again: int = 0
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
        self._inbound = InboundStreams(limits, allocate or allocate_bytearray, max_early_bytes)
        self._inbound_opened: dict[int, float] = {}
        #: (transfer, seq) -> a resent copy of a chunk that another connection is still reading in
        #: place; kept until that read completes (then dropped) or its connection dies (then used).
        self._spares: dict[tuple[int, int], ChunkReceived] = {}
        self._outbound: dict[int, _Send] = {}
        # Client-sent transfers are odd, server-sent even (protocol/SPEC.md §6).
        self._transfer_ids = itertools.count(1 if role is Role.CLIENT else 2, 2)
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
        #: Damaged chunks of inbound transfers this end asked for again (CHUNK_RESEND).
        self.chunks_asked_again = 0
        #: Whether the peer resends a chunk it is asked for again (its handshake said so).
        self._peer_resends = CHUNK_RESEND_CAPABILITY in peer.capabilities
        #: Called with what an inbound transfer that was opened and then failed or was abandoned
        #: (reset by either side, or the session closed) holds. A decompression may still be
        #: writing into its buffer: drop it, or (the session closed) wait for decodes_idle before
        #: handing it out again.
        self.on_inbound_failed: Callable[[CutShort], None] | None = None
        #: Called with (where, error) when the peer's input failed a check: a transfer reset for
        #: it ("transfer N"), or a connection closed for it ("control connection", "data
        #: connection"). For the application's log: the transport itself logs nothing.
        self.on_peer_error: Callable[[str, RemoteProtocolError], None] | None = None
        control.conn.chunk_sink = self._inbound.chunk_target
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
        self._inbound.allocate = allocate
        self._inbound.max_early_bytes = max_early_bytes

    def attach_data(self, proto: FrameProtocol) -> None:
        """Add an authenticated data connection of this session."""
        proto.index = next(self._data_index)
        proto.conn.chunk_sink = self._inbound.chunk_target
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
        if checksums is not None and len(checksums) != header.chunks:
            raise ValueError(f"{len(checksums)} checksums given for a fragment of {header.chunks} chunks")
        skipped = set(header.skipped)
        if skipped and checksums is None:
            raise ValueError("a transfer that skips chunks needs their checksums (for the end digest)")
        transfer_id = next(self._transfer_ids)
        send = _Send(header, view, shuffle_item_size, checksums, OutboundTransfer(transfer_id, header.chunks))
        for seq in skipped:  # the receiver holds these (the header's skip); the digest covers them
            send.out.checksums[seq] = checksums[seq]  # type: ignore[index]  # checked above
        self._outbound[transfer_id] = send
        try:
            await self.send(header, transfer_id)
            to_send = [seq for seq in range(header.chunks) if seq not in skipped]
            await self._send_chunks(transfer_id, send, to_send)
            await self.send(send.out.end(), transfer_id)
            deadline = self._loop.time() + self.options.ack_timeout_s
            while not send.acked:
                if send.error is not None:
                    raise send.error
                if send.resend:
                    seqs, send.resend = send.resend, []
                    await self._send_chunks(transfer_id, send, seqs)
                    continue
                send.wake.clear()
                try:
                    async with asyncio.timeout_at(deadline):
                        await send.wake.wait()
                except TimeoutError:
                    if self.control.is_open:
                        self.control.send(StreamReset(ErrorCode.TIMEOUT, "no acknowledgement"), transfer_id)
                    raise TransferFailed(ErrorCode.TIMEOUT, "receiver did not acknowledge in time") from None
        finally:
            del self._outbound[transfer_id]
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

    async def _send_chunks(self, transfer_id: int, send: _Send, seqs: Iterable[int]) -> None:
        codec = CODECS_BY_NAME[send.header.codec]
        if codec is Codec.NONE:
            await self._send_plain_chunks(transfer_id, send, seqs)
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
                if len(window) >= depth:
                    await self._write_chunk(transfer_id, send, *window.popleft())
            while window:
                await self._write_chunk(transfer_id, send, *window.popleft())
        finally:
            for _, future in window:
                future.cancel()

    async def _send_plain_chunks(self, transfer_id: int, send: _Send, seqs: Iterable[int]) -> None:
        """Codec none: no pool, no window. Without prepared checksums each chunk is hashed just
        before it is written, so the kernel copies it out of cache (xxh3 runs about 4x faster on
        a cached chunk than on one it must read from memory)."""
        chunk_bytes = send.header.chunk_bytes
        view, known, record = send.view, send.checksums, send.out.record
        for seq in seqs:
            proto = await self._pick_connection()
            raw = view[seq * chunk_bytes : (seq + 1) * chunk_bytes]
            checksum = codecs.checksum(raw) if known is None else known[seq]
            proto.send_chunk(transfer_id, ChunkHeader(seq, len(raw), Codec.NONE, 0, checksum), raw)
            record(seq, proto.index, checksum)

    async def _write_chunk(
        self,
        transfer_id: int,
        send: _Send,
        seq: int,
        encoded: asyncio.Future[tuple[Codec, int, codecs.Buffer, int]],
    ) -> None:
        used, shuffle, payload, checksum = await encoded
        raw_length = min(send.header.chunk_bytes, send.header.raw_bytes - seq * send.header.chunk_bytes)
        proto = await self._pick_connection()
        proto.send_chunk(transfer_id, ChunkHeader(seq, raw_length, used, shuffle, checksum), payload)
        send.out.record(seq, proto.index, checksum)

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
            self._on_chunk(event)
        elif isinstance(event, MessageReceived):
            self._on_message(proto, event)
        elif isinstance(event, PeerWentAway) and proto is self.control:
            if not self.closed.is_set():
                self.close_code, self.close_detail = event.error_code, event.reason
            self._finish(f"peer went away: {event.reason}")

    def _on_message(self, proto: FrameProtocol, event: MessageReceived) -> None:
        message, transfer_id = event.message, event.stream_id
        if isinstance(message, PushHeader | UpdateHeader):
            self._open_inbound(transfer_id, message)
        elif isinstance(message, FragmentEnd):
            self._guard(transfer_id, partial(self._inbound.end, transfer_id, message))
        elif isinstance(message, FragmentAck):
            send = self._outbound.get(transfer_id)
            if send is not None:
                send.acked = True
                send.wake.set()
        elif isinstance(message, StreamReset):
            self._on_reset(transfer_id, message)
        elif isinstance(message, ChunkResend):
            self._on_resend(transfer_id, message.seq)
        elif not isinstance(message, Ping | Pong):
            # PING is answered and PONG taken as liveness by the connection itself (any frame
            # is): neither concerns the application, so neither waits in its queue.
            self._queue(message)

    def _on_reset(self, transfer_id: int, reset: StreamReset) -> None:
        send = self._outbound.get(transfer_id)
        if send is not None:
            try:
                code = ErrorCode(reset.code)
            except ValueError:
                code = ErrorCode.TRANSFER_ABORTED
            if send.error is None:  # the first reason is the one that counts
                send.error = TransferFailed(code, f"receiver reset the transfer: {reset.message}")
            send.wake.set()
        elif transfer_id % 2 == self._peer_parity:
            self._inbound_failed(self._inbound.reset(transfer_id))
            self._inbound_opened.pop(transfer_id, None)
        # else: a reset of one of our own transfers that has already ended (acknowledged, failed)

    def _on_resend(self, transfer_id: int, seq: int) -> None:
        """The receiver asks for a chunk of one of our transfers again: queued for the sender.
        A transfer that has ended already (acknowledged, failed) has nothing to send."""
        send = self._outbound.get(transfer_id)
        if send is None:
            return
        if seq >= send.header.chunks:
            self.control.abort(
                ErrorCode.MALFORMED_BODY,
                f"CHUNK_RESEND for chunk {seq} of a {send.header.chunks}-chunk transfer {transfer_id}",
            )
            return
        if send.asked_again >= resend_allowance(send.header.chunks):
            # More than a receiver may ask (SPEC §5.12): a peer that asks on and on would have this
            # end send a transfer many times over. The transfer fails; the session goes on.
            if send.error is None:
                send.error = TransferFailed(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"the receiver asked for more than {send.asked_again} chunks again",
                )
                if self.control.is_open:
                    self.control.reply(
                        StreamReset(ErrorCode.LIMIT_EXCEEDED, "too many chunks asked for again"), transfer_id
                    )
            send.wake.set()
            return
        send.asked_again += 1
        send.resend.append(seq)
        send.wake.set()

    @property
    def _peer_parity(self) -> int:
        """Transfer ids the peer sends are even from a server, odd from a client."""
        return 0 if self.role is Role.CLIENT else 1

    def _open_inbound(self, transfer_id: int, header: StreamHeader) -> None:
        if transfer_id % 2 != self._peer_parity:
            self.control.abort(ErrorCode.MALFORMED_BODY, f"transfer id {transfer_id} has the wrong parity")
            return
        early = self._guard(transfer_id, partial(self._inbound.open, transfer_id, header))
        if not isinstance(early, list):
            return  # refused (duplicate id, too many transfers, or by the allocator): reset sent
        self._inbound_opened[transfer_id] = self._loop.time()
        for chunk in early:
            self._decode(transfer_id, chunk.chunk, chunk.payload, in_place=False)

    def _on_chunk(self, event: ChunkReceived) -> None:
        key = (event.transfer_id, event.chunk.seq)
        if event.in_place:
            self._spares.pop(key, None)
        dest = self._guard(
            event.transfer_id,
            partial(self._inbound.destination, event.transfer_id, event.chunk, event.payload, event.in_place),
        )
        if isinstance(dest, memoryview):
            self._decode(event.transfer_id, event.chunk, event.payload, in_place=event.in_place, dest=dest)
        elif dest is None and not event.in_place and self._lent_elsewhere(key):
            # The sender resent this chunk because it lost a connection; the receiving end of that
            # connection may not have noticed yet and still holds the slot, half written.
            self._spares[key] = event

    def _lent_elsewhere(self, key: tuple[int, int]) -> bool:
        for proto in self.data:
            lent = proto.conn.lent_chunk
            if lent is not None and (lent[0], lent[1].seq) == key:
                return True
        return False

    def _decode(
        self,
        transfer_id: int,
        chunk: ChunkHeader,
        payload: memoryview,
        *,
        in_place: bool,
        dest: memoryview | None = None,
    ) -> None:
        if dest is None:
            dest = self._guard(
                transfer_id, partial(self._inbound.destination, transfer_id, chunk, payload, False)
            )
            if not isinstance(dest, memoryview):
                return
        if chunk.codec is Codec.NONE:
            # Verifying a checksum runs at memory speed: cheaper inline than a thread hop.
            try:
                codecs.decompress_into(chunk, payload, dest, in_place=in_place)
            except RemoteProtocolError as exc:
                self._chunk_failed(transfer_id, chunk, exc)
                return
            self._verified(transfer_id, chunk)
            return
        self._pending_decodes += 1
        self.decodes_idle.clear()
        if self._pending_decodes >= self.options.max_pending_decodes and not self._reading_paused:
            self._set_reading(paused=True)
        future = self._loop.run_in_executor(self._executor, codecs.decompress_into, chunk, payload, dest)
        future.add_done_callback(partial(self._decoded, transfer_id, chunk))

    def _decoded(self, transfer_id: int, chunk: ChunkHeader, future: asyncio.Future[None]) -> None:
        self._pending_decodes -= 1
        if not self._pending_decodes:
            self.decodes_idle.set()
        if self._reading_paused and self._pending_decodes <= self.options.max_pending_decodes // 2:
            self._set_reading(paused=False)
        if future.cancelled():
            return
        exc = future.exception()  # retrieved even when moot, or asyncio logs it as never retrieved
        if self.closed.is_set():
            return
        if isinstance(exc, RemoteProtocolError):
            self._chunk_failed(transfer_id, chunk, exc)
        elif exc is not None:
            self._reset_inbound(transfer_id, RemoteProtocolError(ErrorCode.INTERNAL, repr(exc)))
        else:
            self._verified(transfer_id, chunk)

    def _chunk_failed(self, transfer_id: int, chunk: ChunkHeader, exc: RemoteProtocolError) -> None:
        """A chunk did not decode or verify. Damaged on the way, it is asked for again where the
        peer resends chunks (CHUNK_RESEND, within the transfer's allowance); otherwise, or past
        that, the transfer is reset."""
        if (
            exc.code in DAMAGED_CHUNK_CODES
            and self._peer_resends
            and self.control.is_open
            and self._inbound.chunk_damaged(transfer_id, chunk)
        ):
            self._peer_error(f"transfer {transfer_id}", exc)
            self.chunks_asked_again += 1
            self.control.reply(ChunkResend(chunk.seq), transfer_id)
            return
        self._reset_inbound(transfer_id, exc)

    def _verified(self, transfer_id: int, chunk: ChunkHeader) -> None:
        self._guard(transfer_id, partial(self._inbound.chunk_verified, transfer_id, chunk))

    def _guard(self, transfer_id: int, action: partial[object]) -> object:
        """Run one step of an inbound transfer; a protocol error voids that transfer only.

        Returns the action's result (delivering a completed fragment), or False after an error.
        """
        try:
            result = action()
        except RemoteProtocolError as exc:
            self._reset_inbound(transfer_id, exc)
            return False
        if isinstance(result, FragmentAssembled):
            self._deliver(result)
        return result

    def _reset_inbound(self, transfer_id: int, exc: RemoteProtocolError) -> None:
        self._peer_error(f"transfer {transfer_id}", exc)
        self._inbound_failed(self._inbound.reset(transfer_id))
        self._inbound_opened.pop(transfer_id, None)
        self._drop_spares(transfer_id)
        if self.control.is_open:
            self.control.reply(StreamReset(int(exc.code), exc.message), transfer_id)

    def _deliver(self, done: FragmentAssembled) -> None:
        self._inbound_opened.pop(done.transfer_id, None)
        self._drop_spares(done.transfer_id)
        if self.control.is_open:
            self.control.reply(FragmentAck(), done.transfer_id)
        self.bytes_payload_received += done.header.raw_bytes
        self._queue(FragmentReceived(done.transfer_id, done.header, done.buffer))

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
        for transfer_id, opened in list(self._inbound_opened.items()):
            if now - opened > self.options.transfer_timeout_s:
                self._reset_inbound(
                    transfer_id, RemoteProtocolError(ErrorCode.TIMEOUT, "transfer not completed in time")
                )
        self._timer = self._loop.call_later(self.options.ping_interval_s, self._keepalive)

    def _drop_spares(self, transfer_id: int) -> None:
        if self._spares:
            for key in [k for k in self._spares if k[0] == transfer_id]:
                del self._spares[key]

    def _on_data_lost(self, proto: FrameProtocol, exc: BaseException | None) -> None:
        self._peer_error("data connection", exc)
        if proto in self.data:
            self.data.remove(proto)
        lent = proto.conn.lent_chunk
        if lent is not None:
            # The connection died in the middle of a chunk it was writing into its destination:
            # free that slot for the copy the sender resends, or use the copy if it came first.
            transfer_id, chunk = lent
            self._inbound.chunk_abandoned(transfer_id, chunk)
            spare = self._spares.pop((transfer_id, chunk.seq), None)
            if spare is not None:
                self._on_chunk(spare)
        for send in self._outbound.values():
            lost = send.out.connection_lost(proto.index)
            if lost:
                send.resend.extend(lost)
                send.wake.set()

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
        for send in self._outbound.values():
            send.error = SessionClosed(reason)
            send.wake.set()
        for opened in self._inbound.reset_all():
            self._inbound_failed(opened)
        for proto in [*self.data, self.control]:
            if proto.is_open:
                proto.go_away(reason)
            else:
                proto.close()
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _peer_error(self, where: str, exc: BaseException | None) -> None:
        # Our own give-ups (deadlines, an internal error) are not the peer's input failing a check.
        if (
            isinstance(exc, RemoteProtocolError)
            and exc.code not in (ErrorCode.INTERNAL, ErrorCode.TIMEOUT)
            and self.on_peer_error is not None
        ):
            self.on_peer_error(where, exc)

    def _inbound_failed(self, cut: CutShort | None) -> None:
        if cut is not None and self.on_inbound_failed is not None:
            self.on_inbound_failed(cut)

    def _check_open(self) -> None:
        if self.closed.is_set():
            raise SessionClosed(self.close_reason or "session closed", self.close_code, self.close_detail)
        if not self.control.is_open:
            raise SessionClosed("control connection closing", self.close_code, self.close_detail)
