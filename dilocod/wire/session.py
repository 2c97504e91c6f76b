"""The sans-IO session core: every decision about one session's fragment transfers, both ways.

A session is one control connection plus N data connections to one peer. The core is fed what
happened (a message or a chunk received, a chunk verified or found damaged, a data connection
lost, a send started, an acknowledgement overdue, the session closed) and answers with what to do,
as frozen dataclasses: send this message on the control connection, decode this chunk into this
slice, deliver this fragment, resend these chunks, complete or fail this send. It owns transfer-id
parity (odd when the client sends, even when the server does, protocol/SPEC.md §6: a STREAM_RESET,
FRAGMENT_ACK or CHUNK_RESEND names one transfer, never two), which transfer a control message
refers to, acknowledgements, resets of inbound and outbound transfers, the resending of a lost
connection's chunks, CHUNK_RESEND allowances (SPEC §5.12), the spare copy of a chunk still
landing in place on another connection, and the inbound transfer deadline (time is passed in).

Reassembly bookkeeping is InboundStreams' and OutboundTransfer's (stream.py); the asyncio executor
(transport/session.py) does the IO, the thread pool and flow control. No asyncio, sockets, torch,
clocks or logging in here; nothing of the project outside wire/.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from dilocod.wire.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from dilocod.wire.frames import ChunkHeader
from dilocod.wire.limits import Limits
from dilocod.wire.messages import (
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
    EarlyChunk,
    FragmentAssembled,
    InboundStreams,
    OutboundTransfer,
    StreamHeader,
    resend_allowance,
)

# ------------------------------------------------------------------------------------ actions


@dataclass(frozen=True, slots=True)
class SendMessage:
    """Send message on the control connection (while it is open). answer: it answers the peer's
    own frame (an acknowledgement, a reset of its transfer, a CHUNK_RESEND), so it counts against
    the peer's reply backlog."""

    message: Message
    stream_id: int
    answer: bool = True


@dataclass(frozen=True, slots=True)
class AbortControl:
    """The peer broke the session's protocol: close the control connection with this code."""

    code: ErrorCode
    reason: str


@dataclass(frozen=True, slots=True)
class Decode:
    """Decode (or, uncompressed, verify) a chunk's payload into dest, then report chunk_verified
    or chunk_failed. in_place: the payload already sits in dest."""

    transfer_id: int
    chunk: ChunkHeader
    payload: memoryview
    dest: memoryview
    in_place: bool


@dataclass(frozen=True, slots=True)
class DeliverFragment:
    """A whole fragment, verified chunk by chunk and against its end digest, for the application."""

    fragment: FragmentAssembled


@dataclass(frozen=True, slots=True)
class DeliverMessage:
    """A control message for the application (not one about transfers, PING or PONG)."""

    message: Message
    stream_id: int


@dataclass(frozen=True, slots=True)
class ResendChunks:
    """Send these chunks of an outbound transfer again (a lost connection carried them, or the
    receiver asked), on any open connection."""

    transfer_id: int
    seqs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CompleteSend:
    """The receiver acknowledged an outbound transfer: its send succeeded."""

    transfer_id: int


@dataclass(frozen=True, slots=True)
class FailSend:
    """An outbound transfer failed: code says why, or None where the session ended under it."""

    transfer_id: int
    code: ErrorCode | None
    reason: str


@dataclass(frozen=True, slots=True)
class InboundCutShort:
    """An opened inbound transfer ended without completing (reset, or the session closed)."""

    cut: CutShort


@dataclass(frozen=True, slots=True)
class PeerFaulted:
    """The peer's input failed a check (an inbound transfer was reset for it), for the log."""

    where: str
    error: RemoteProtocolError


Action = (
    SendMessage
    | AbortControl
    | Decode
    | DeliverFragment
    | DeliverMessage
    | ResendChunks
    | CompleteSend
    | FailSend
    | InboundCutShort
    | PeerFaulted
)


def blames_peer(exc: BaseException | None) -> bool:
    """Whether an error is the peer's input failing a check; our own give-ups (a deadline, an
    internal error) are not."""
    return isinstance(exc, RemoteProtocolError) and exc.code not in (ErrorCode.INTERNAL, ErrorCode.TIMEOUT)


def sender_parity(role: Role) -> int:
    """The parity of the transfer ids an end with this role sends: odd from a client, even from a
    server (SPEC §6)."""
    return 1 if role is Role.CLIENT else 0


# ------------------------------------------------------------------------------------ the core


@dataclass(slots=True)
class _Outbound:
    header: StreamHeader
    sent: OutboundTransfer
    #: Chunks the receiver asked for again (CHUNK_RESEND), against its allowance.
    asked_again: int = 0


class SessionCore:
    """One session's transfers, both directions. Feed it events; execute the actions it returns,
    in order."""

    def __init__(
        self,
        role: Role,
        limits: Limits,
        allocate: Allocate,
        *,
        max_early_bytes: int = MAX_EARLY_BYTES,
        peer_resends: bool = False,
    ) -> None:
        self.role = role
        #: Whether the peer resends a chunk it is asked for again (its handshake said so).
        self.peer_resends = peer_resends
        self.inbound = InboundStreams(limits, allocate, max_early_bytes)
        self._outbound: dict[int, _Outbound] = {}
        self._transfer_ids = itertools.count(2 - sender_parity(role), 2)
        self._peer_parity = sender_parity(Role.SERVER if role is Role.CLIENT else Role.CLIENT)
        #: When each open inbound transfer's header arrived (the caller's clock).
        self._opened: dict[int, float] = {}
        #: (transfer, seq) of chunks whose payload a connection is reading into their slice now.
        self._lent: set[tuple[int, int]] = set()
        #: (transfer, seq) -> a resent copy of a chunk that another connection is still reading in
        #: place; kept until that read completes (then dropped) or its connection dies (then used).
        self._spares: dict[tuple[int, int], EarlyChunk] = {}
        self.closed = False
        #: Damaged chunks of inbound transfers this end asked for again (CHUNK_RESEND).
        self.chunks_asked_again = 0

    def set_allocator(self, allocate: Allocate, max_early_bytes: int) -> None:
        self.inbound.allocate = allocate
        self.inbound.max_early_bytes = max_early_bytes

    # ------------------------------------------------------------------------ sending side

    def start_send(self, header: StreamHeader, checksums: Sequence[int] | None) -> tuple[int, list[int]]:
        """A new outbound transfer: its id, and the chunks to send (all but the skipped ones)."""
        if self.closed:
            raise LocalProtocolError(ErrorCode.INTERNAL, "a send started on a closed session")
        if checksums is not None and len(checksums) != header.chunks:
            raise ValueError(f"{len(checksums)} checksums given for a fragment of {header.chunks} chunks")
        skipped = set(header.skipped)
        if skipped and checksums is None:
            raise ValueError("a transfer that skips chunks needs their checksums (for the end digest)")
        transfer_id = next(self._transfer_ids)
        sent = OutboundTransfer(transfer_id, header.chunks)
        for seq in skipped:  # the receiver holds these (the header's skip); the digest covers them
            sent.checksums[seq] = checksums[seq]  # type: ignore[index]  # checked above
        self._outbound[transfer_id] = _Outbound(header, sent)
        return transfer_id, [seq for seq in range(header.chunks) if seq not in skipped]

    def sending(self, transfer_id: int) -> bool:
        """Whether an outbound transfer is still going: neither acknowledged, failed nor given up.
        No chunk of a transfer is written once this is False."""
        return transfer_id in self._outbound

    def chunk_sent(self, transfer_id: int, seq: int, connection: int, checksum: int) -> None:
        """A chunk was handed to a connection (its index): resent on the survivors if it is lost."""
        out = self._outbound.get(transfer_id)
        if out is None:
            raise LocalProtocolError(
                ErrorCode.INTERNAL, f"chunk {seq} sent after transfer {transfer_id} ended"
            )
        out.sent.record(seq, connection, checksum)

    def fragment_end(self, transfer_id: int) -> FragmentEnd:
        """FRAGMENT_END of an outbound transfer whose every chunk has been sent."""
        return self._outbound[transfer_id].sent.end()

    def ack_overdue(self, transfer_id: int) -> list[Action]:
        """The receiver did not acknowledge in time: the transfer is reset and fails."""
        if self._outbound.pop(transfer_id, None) is None:
            return []
        return [
            SendMessage(StreamReset(ErrorCode.TIMEOUT, "no acknowledgement"), transfer_id, answer=False),
            FailSend(transfer_id, ErrorCode.TIMEOUT, "receiver did not acknowledge in time"),
        ]

    def send_abandoned(self, transfer_id: int) -> None:
        """The sender gave up on a transfer (cancelled) or has taken its outcome: forget it."""
        self._outbound.pop(transfer_id, None)

    # ------------------------------------------------------------------------ receiving side

    def chunk_target(self, transfer_id: int, chunk: ChunkHeader, payload_length: int) -> memoryview | None:
        """ChunkSink for every connection of the session (see InboundStreams.chunk_target)."""
        target = self.inbound.chunk_target(transfer_id, chunk, payload_length)
        if target is not None:
            self._lent.add((transfer_id, chunk.seq))
        return target

    def message_received(self, message: Message, stream_id: int, now: float) -> list[Action]:
        """A message arrived on the control connection (or, a STREAM_RESET, on any)."""
        if self.closed:
            return []
        if isinstance(message, PushHeader | UpdateHeader):
            return self._header_received(stream_id, message, now)
        if isinstance(message, FragmentEnd):
            try:
                return self._completed(stream_id, self.inbound.end(stream_id, message))
            except RemoteProtocolError as exc:
                return self._reset_inbound(stream_id, exc)
        if isinstance(message, FragmentAck):
            if self._outbound.pop(stream_id, None) is None:
                return []  # ended already (failed, given up): nothing waits for it
            return [CompleteSend(stream_id)]
        if isinstance(message, StreamReset):
            return self._reset_received(stream_id, message)
        if isinstance(message, ChunkResend):
            return self._resend_asked(stream_id, message.seq)
        if isinstance(message, Ping | Pong):
            # PING is answered and PONG taken as liveness by the connection itself (any frame
            # is): neither concerns the application, so neither waits in its queue.
            return []
        return [DeliverMessage(message, stream_id)]

    def chunk_received(
        self, transfer_id: int, chunk: ChunkHeader, payload: memoryview, in_place: bool
    ) -> list[Action]:
        """A chunk's payload arrived (in_place: into the slice chunk_target lent)."""
        if self.closed:
            return []
        key = (transfer_id, chunk.seq)
        if in_place:
            self._lent.discard(key)
            self._spares.pop(key, None)
        try:
            dest = self.inbound.destination(transfer_id, chunk, payload, in_place)
        except RemoteProtocolError as exc:
            return self._reset_inbound(transfer_id, exc)
        if dest is not None:
            return [Decode(transfer_id, chunk, payload, dest, in_place)]
        if not in_place and key in self._lent:
            # The sender resent this chunk because it lost a connection; the receiving end of that
            # connection may not have noticed yet and still holds the slot, half written.
            self._spares[key] = EarlyChunk(chunk, payload)
        return []

    def chunk_verified(self, transfer_id: int, chunk: ChunkHeader) -> list[Action]:
        """A Decode succeeded: the chunk's bytes are in place and match its checksum."""
        if self.closed:
            return []
        try:
            return self._completed(transfer_id, self.inbound.chunk_verified(transfer_id, chunk))
        except RemoteProtocolError as exc:  # the end digest differs: that transfer only is void
            return self._reset_inbound(transfer_id, exc)

    def chunk_failed(self, transfer_id: int, chunk: ChunkHeader, error: RemoteProtocolError) -> list[Action]:
        """A Decode failed. A chunk damaged on the way is asked for again where the peer resends
        chunks, within the transfer's allowance; otherwise, or past that, the transfer is reset."""
        if self.closed:
            return []
        if (
            error.code in DAMAGED_CHUNK_CODES
            and self.peer_resends
            and self.inbound.chunk_damaged(transfer_id, chunk)
        ):
            self.chunks_asked_again += 1
            return [
                PeerFaulted(f"transfer {transfer_id}", error),
                SendMessage(ChunkResend(chunk.seq), transfer_id),
            ]
        return self._reset_inbound(transfer_id, error)

    def expire(self, now: float, transfer_timeout_s: float) -> list[Action]:
        """Reset the inbound transfers opened more than transfer_timeout_s before now."""
        actions: list[Action] = []
        for transfer_id, opened in list(self._opened.items()):
            if now - opened > transfer_timeout_s:
                timeout = RemoteProtocolError(ErrorCode.TIMEOUT, "transfer not completed in time")
                actions += self._reset_inbound(transfer_id, timeout)
        return actions

    # ------------------------------------------------------------------------ the session

    def data_lost(self, connection: int, lent: tuple[int, ChunkHeader] | None) -> list[Action]:
        """A data connection (its index) closed; lent is the chunk it was reading in place, if any
        (Connection.lent_chunk). Its slot is free for the resent copy (or the spare already here),
        and every outbound chunk it carried is sent again on the survivors."""
        if self.closed:
            return []
        actions: list[Action] = []
        if lent is not None:
            transfer_id, chunk = lent
            key = (transfer_id, chunk.seq)
            self._lent.discard(key)
            self.inbound.chunk_abandoned(transfer_id, chunk)
            spare = self._spares.pop(key, None)
            if spare is not None:
                actions += self.chunk_received(transfer_id, spare.chunk, spare.payload, False)
        for transfer_id, out in self._outbound.items():
            lost = out.sent.connection_lost(connection)
            if lost:
                actions.append(ResendChunks(transfer_id, tuple(lost)))
        return actions

    def close(self, reason: str) -> list[Action]:
        """The session ended: every outbound transfer fails, every opened inbound one is cut short.
        Nothing is decided after this."""
        if self.closed:
            return []
        self.closed = True
        actions: list[Action] = [FailSend(tid, None, reason) for tid in self._outbound]
        self._outbound.clear()
        actions += [InboundCutShort(cut) for cut in self.inbound.reset_all()]
        self._opened.clear()
        self._spares.clear()
        self._lent.clear()
        return actions

    # ------------------------------------------------------------------------ internals

    def _header_received(self, transfer_id: int, header: StreamHeader, now: float) -> list[Action]:
        if transfer_id % 2 != self._peer_parity:
            return [AbortControl(ErrorCode.MALFORMED_BODY, f"transfer id {transfer_id} has the wrong parity")]
        try:
            early = self.inbound.open(transfer_id, header)
        except RemoteProtocolError as exc:  # a duplicate id, too many transfers, or the allocator's no
            return self._reset_inbound(transfer_id, exc)
        self._opened[transfer_id] = now
        actions: list[Action] = []
        for chunk in early:
            actions += self.chunk_received(transfer_id, chunk.chunk, chunk.payload, False)
        return actions

    def _reset_received(self, transfer_id: int, reset: StreamReset) -> list[Action]:
        if self._outbound.pop(transfer_id, None) is not None:
            try:
                code = ErrorCode(reset.code)
            except ValueError:
                code = ErrorCode.TRANSFER_ABORTED
            return [FailSend(transfer_id, code, f"receiver reset the transfer: {reset.message}")]
        if transfer_id % 2 != self._peer_parity:
            return []  # one of our own transfers that has ended already (acknowledged, failed)
        self._opened.pop(transfer_id, None)
        self._drop_spares(transfer_id)
        cut = self.inbound.reset(transfer_id)
        return [] if cut is None else [InboundCutShort(cut)]

    def _resend_asked(self, transfer_id: int, seq: int) -> list[Action]:
        out = self._outbound.get(transfer_id)
        if out is None:
            return []  # ended already (acknowledged, failed): nothing to send
        chunks = out.header.chunks
        if seq >= chunks:
            return [
                AbortControl(
                    ErrorCode.MALFORMED_BODY,
                    f"CHUNK_RESEND for chunk {seq} of a {chunks}-chunk transfer {transfer_id}",
                )
            ]
        if out.asked_again >= resend_allowance(chunks):
            # More than a receiver may ask (SPEC §5.12): a peer that asks on and on would have this
            # end send a transfer many times over. The transfer fails; the session goes on.
            del self._outbound[transfer_id]
            return [
                FailSend(
                    transfer_id,
                    ErrorCode.LIMIT_EXCEEDED,
                    f"the receiver asked for more than {out.asked_again} chunks again",
                ),
                SendMessage(
                    StreamReset(ErrorCode.LIMIT_EXCEEDED, "too many chunks asked for again"), transfer_id
                ),
            ]
        out.asked_again += 1
        return [ResendChunks(transfer_id, (seq,))]

    def _completed(self, transfer_id: int, done: FragmentAssembled | None) -> list[Action]:
        """A step of an inbound transfer went through; a completed fragment is acknowledged and
        delivered."""
        if done is None:
            return []
        self._opened.pop(transfer_id, None)
        self._drop_spares(transfer_id)
        return [SendMessage(FragmentAck(), transfer_id), DeliverFragment(done)]

    def _reset_inbound(self, transfer_id: int, exc: RemoteProtocolError) -> list[Action]:
        actions: list[Action] = [PeerFaulted(f"transfer {transfer_id}", exc)] if blames_peer(exc) else []
        cut = self.inbound.reset(transfer_id)
        if cut is not None:
            actions.append(InboundCutShort(cut))
        self._opened.pop(transfer_id, None)
        self._drop_spares(transfer_id)
        actions.append(SendMessage(StreamReset(int(exc.code), exc.message), transfer_id))
        return actions

    def _drop_spares(self, transfer_id: int) -> None:
        if self._spares:
            for key in [k for k in self._spares if k[0] == transfer_id]:
                del self._spares[key]
