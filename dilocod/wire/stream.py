"""Fragment stream bookkeeping on both ends, shared by all connections of one session.

A fragment travels as a header on the control connection, chunks striped over the data
connections, and FRAGMENT_END with the digest. TCP orders bytes only within one connection, so a
chunk may overtake its header: the InboundStreams table keeps such early chunks (bounded) until the
header names their destination. Chunks are reassembled by sequence number; duplicates (a sender
resending what a lost connection carried) are dropped, and so are chunks of finished transfers:
transfer ids increase per sender (protocol/SPEC.md §1), so one number, the highest id a header
named, tells every finished transfer from one still to come, and a session's bookkeeping stays the
same size however many transfers it carries. OutboundTransfer remembers which connection carried
which chunk until the receiver acknowledges, so a lost connection's chunks can be resent on the
survivors. A chunk that arrives damaged (its checksum or its decoding fails) is asked for again
(CHUNK_RESEND, protocol/SPEC.md §5.12) a bounded number of times per transfer, so one flipped bit
costs one chunk, not the whole transfer. Pure bookkeeping, which SessionCore (session.py) consults
to decide: no asyncio, socket, torch or logging.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dilocod.wire.codecs import fragment_digest
from dilocod.wire.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from dilocod.wire.frames import ChunkHeader, Codec
from dilocod.wire.limits import Limits, MiB
from dilocod.wire.messages import FragmentEnd, PushHeader, UpdateHeader

StreamHeader = PushHeader | UpdateHeader


@dataclass(frozen=True, slots=True)
class Resumed:
    """Where a resumed transfer lands (a stream header with `skip`): the buffer that already
    holds the skipped chunks, and the checksum each of them was verified against."""

    buffer: memoryview
    checksums: Mapping[int, int]


@dataclass(frozen=True, slots=True)
class CutShort:
    """An opened transfer that ended without completing (reset, or its session lost): its header,
    its buffer, and the chunks it holds, verified, with their checksums (what a resumed transfer
    of the same bytes may skip)."""

    header: StreamHeader
    buffer: memoryview
    held: dict[int, int]


#: Called once a header is validated: returns a writable buffer of exactly header.raw_bytes, or,
#: for a header that skips chunks, the Resumed buffer holding them. Raises RemoteProtocolError to
#: refuse the transfer.
Allocate = Callable[[StreamHeader], "memoryview | Resumed"]

_PENDING, _ARRIVING, _DONE = 0, 1, 2
#: What an early chunk costs against the early budget beyond its payload (its bookkeeping), so
#: that a flood of empty payloads is bounded too.
EARLY_CHUNK_OVERHEAD_BYTES = 256
#: What early chunks may hold per session (protocol/SPEC.md §6), where the receiver takes inbound
#: transfers at all; one that refuses every header (a syncer before JOIN) keeps none.
MAX_EARLY_BYTES = 64 * MiB
#: Damaged chunks a receiver asks for again per transfer (SPEC §5.12): one per chunk of the
#: transfer, and at least this many; past that the transfer is reset. A link that damages more
#: than that is not one a transfer should lean on.
MIN_CHUNK_RESENDS = 8
#: Codes of a chunk whose bytes arrived damaged: its checksum, or its decoding (a damaged
#: compressed payload decodes to the wrong length or not at all).
DAMAGED_CHUNK_CODES = frozenset({ErrorCode.CHECKSUM_MISMATCH, ErrorCode.LENGTH_MISMATCH})


def resend_allowance(chunks: int) -> int:
    """How many chunks of a transfer of `chunks` chunks a receiver asks for again, and a sender
    sends again, at most (SPEC §5.12)."""
    return max(MIN_CHUNK_RESENDS, chunks)


@dataclass(frozen=True, slots=True)
class FragmentAssembled:
    """Every chunk arrived and verified, and the end digest matches."""

    transfer_id: int
    header: StreamHeader
    buffer: memoryview


@dataclass(slots=True)
class _Inbound:
    header: StreamHeader
    buffer: memoryview
    state: bytearray
    checksums: list[int]
    done: int = 0
    end: FragmentEnd | None = None
    #: Damaged chunks asked for again so far (chunk_damaged).
    resends: int = 0


@dataclass(frozen=True, slots=True)
class EarlyChunk:
    chunk: ChunkHeader
    payload: memoryview


class InboundStreams:
    """Receiving side of one session: transfer id -> destination buffer and chunk states."""

    def __init__(self, limits: Limits, allocate: Allocate, max_early_bytes: int = MAX_EARLY_BYTES):
        self.limits = limits
        #: Where a transfer's bytes go, chosen per header (a session may replace it).
        self.allocate = allocate
        self._transfers: dict[int, _Inbound] = {}
        self._early: dict[int, list[EarlyChunk]] = {}
        # Budget charged per transfer when an early chunk's header comes in (chunk_target), and
        # released in one go when that transfer is opened or reset: a chunk still arriving when its
        # header does, or whose connection dies mid-payload, is released with the rest.
        self._early_charged: dict[int, int] = {}
        self._early_bytes = 0
        #: The early-chunk bound; a session may change it with its allocator.
        self.max_early_bytes = max_early_bytes
        # The highest id a header named: the peer's ids increase, so every id up to it that is not
        # open is finished (completed, reset, or skipped: its header can no longer come).
        self._highest_opened = 0
        # Ids above it reset before their header arrived (a STREAM_RESET that overtook the header
        # on a data connection), at most max_transfers_in_flight of them.
        self._reset_ahead: set[int] = set()

    def __len__(self) -> int:
        return len(self._transfers)

    def finished(self, transfer_id: int) -> bool:
        """Whether frames of this transfer id are late: it completed, was reset, or can no longer
        be opened. Its chunks and FRAGMENT_END are dropped, its header refused as a duplicate."""
        if transfer_id in self._transfers:
            return False
        return transfer_id <= self._highest_opened or transfer_id in self._reset_ahead

    def open(self, transfer_id: int, header: StreamHeader) -> list[EarlyChunk]:
        """Register a header; returns chunks that arrived before it, to be decoded now."""
        if transfer_id <= self._highest_opened or transfer_id in self._reset_ahead:
            raise RemoteProtocolError(
                ErrorCode.DUPLICATE_TRANSFER,
                f"transfer {transfer_id} reused (ids increase; the last header named {self._highest_opened})",
            )
        if len(self._transfers) >= self.limits.max_transfers_in_flight:
            raise RemoteProtocolError(
                ErrorCode.LIMIT_EXCEEDED, f"more than {self.limits.max_transfers_in_flight} transfers"
            )
        self._advance(transfer_id)
        destination = self.allocate(header)
        buffer = destination.buffer if isinstance(destination, Resumed) else destination
        if len(buffer) != header.raw_bytes:
            raise LocalProtocolError(ErrorCode.INTERNAL, "allocator returned a buffer of the wrong size")
        n = header.chunks
        inbound = _Inbound(header, buffer, bytearray(n), [0] * n)
        skipped = header.skipped
        if skipped:
            held = destination.checksums if isinstance(destination, Resumed) else {}
            if not all(seq in held for seq in skipped):
                raise RemoteProtocolError(
                    ErrorCode.UNKNOWN_TRANSFER,
                    f"transfer {transfer_id} skips chunks of fragment {header.fragment} this receiver "
                    "does not hold",
                )
            for seq in skipped:
                inbound.state[seq], inbound.checksums[seq] = _DONE, held[seq]
            inbound.done = len(skipped)
        self._transfers[transfer_id] = inbound
        self._release_early(transfer_id)
        return self._early.pop(transfer_id, [])

    def chunk_target(self, transfer_id: int, chunk: ChunkHeader, payload_length: int) -> memoryview | None:
        """ChunkSink for every connection of the session: uncompressed chunks of a known transfer
        land in their final place; everything else gets a fresh buffer (None)."""
        inbound = self._transfers.get(transfer_id)
        if inbound is None:
            if not self.finished(transfer_id):
                cost = payload_length + EARLY_CHUNK_OVERHEAD_BYTES
                if self._early_bytes + cost > self.max_early_bytes:
                    raise RemoteProtocolError(
                        ErrorCode.UNKNOWN_TRANSFER,
                        f"chunks for undeclared transfer {transfer_id} beyond the early-chunk bound "
                        f"of {self.max_early_bytes} bytes",
                    )
                self._early_bytes += cost
                self._early_charged[transfer_id] = self._early_charged.get(transfer_id, 0) + cost
            return None
        start = self._check_chunk(inbound, chunk)
        if chunk.codec is not Codec.NONE or inbound.state[chunk.seq] != _PENDING:
            return None
        inbound.state[chunk.seq] = _ARRIVING
        return inbound.buffer[start : start + chunk.raw_length]

    def _check_chunk(self, inbound: _Inbound, chunk: ChunkHeader) -> int:
        header = inbound.header
        if chunk.seq >= header.chunks:
            raise RemoteProtocolError(
                ErrorCode.LENGTH_MISMATCH, f"chunk {chunk.seq} of a {header.chunks}-chunk fragment"
            )
        start = chunk.seq * header.chunk_bytes
        expected = min(header.chunk_bytes, header.raw_bytes - start)
        if chunk.raw_length != expected:
            raise RemoteProtocolError(
                ErrorCode.LENGTH_MISMATCH,
                f"chunk {chunk.seq} has {chunk.raw_length} raw bytes, not {expected}",
            )
        return start

    def destination(
        self, transfer_id: int, chunk: ChunkHeader, payload: memoryview, in_place: bool = False
    ) -> memoryview | None:
        """Where a received chunk decodes to; None means drop it (a duplicate or a finished
        transfer). in_place says the payload already sits in the slice chunk_target lent. A chunk
        of an undeclared transfer is kept until its header arrives."""
        inbound = self._transfers.get(transfer_id)
        if inbound is None:
            if not self.finished(transfer_id):
                self._early.setdefault(transfer_id, []).append(EarlyChunk(chunk, payload))
            return None
        start = self._check_chunk(inbound, chunk)
        state = inbound.state[chunk.seq]
        if state == _DONE:
            return None
        view = inbound.buffer[start : start + chunk.raw_length]
        if state == _ARRIVING and not in_place:
            return None  # a duplicate while the first copy is still being verified
        inbound.state[chunk.seq] = _ARRIVING
        return view

    def chunk_verified(self, transfer_id: int, chunk: ChunkHeader) -> FragmentAssembled | None:
        inbound = self._transfers.get(transfer_id)
        if inbound is None or inbound.state[chunk.seq] == _DONE:
            return None
        inbound.state[chunk.seq] = _DONE
        inbound.checksums[chunk.seq] = chunk.checksum
        inbound.done += 1
        return self._maybe_complete(transfer_id, inbound)

    def chunk_damaged(self, transfer_id: int, chunk: ChunkHeader) -> bool:
        """A chunk of an open transfer failed its checksum or its decoding: whether to ask the
        sender for it again (True: its slot is free for the copy) or to reset the transfer (its
        resends are spent: max(MIN_CHUNK_RESENDS, chunks)). A transfer that is not open has
        nothing to ask for."""
        inbound = self._transfers.get(transfer_id)
        if inbound is None or chunk.seq >= len(inbound.state) or inbound.state[chunk.seq] == _DONE:
            return False
        if inbound.resends >= resend_allowance(inbound.header.chunks):
            return False
        inbound.resends += 1
        inbound.state[chunk.seq] = _PENDING
        return True

    def chunk_abandoned(self, transfer_id: int, chunk: ChunkHeader) -> None:
        """The connection lent this chunk's slice (Connection.lent_chunk) closed before the payload
        was complete. The slice is free again, so a copy resent on another connection is taken
        instead of being dropped as a duplicate of the half-written one."""
        inbound = self._transfers.get(transfer_id)
        if inbound is not None and chunk.seq < len(inbound.state) and inbound.state[chunk.seq] == _ARRIVING:
            inbound.state[chunk.seq] = _PENDING

    def end(self, transfer_id: int, end: FragmentEnd) -> FragmentAssembled | None:
        inbound = self._transfers.get(transfer_id)
        if inbound is None:
            if self.finished(transfer_id):
                return None  # reset (or done) already: the sender's END crossed our STREAM_RESET
            raise RemoteProtocolError(
                ErrorCode.UNKNOWN_TRANSFER, f"FRAGMENT_END for unknown transfer {transfer_id}"
            )
        if end.chunks != inbound.header.chunks:
            raise RemoteProtocolError(
                ErrorCode.LENGTH_MISMATCH, f"end counts {end.chunks} chunks, header {inbound.header.chunks}"
            )
        inbound.end = end
        return self._maybe_complete(transfer_id, inbound)

    def _maybe_complete(self, transfer_id: int, inbound: _Inbound) -> FragmentAssembled | None:
        if inbound.end is None or inbound.done < inbound.header.chunks:
            return None
        if fragment_digest(inbound.checksums) != inbound.end.digest:
            self.reset(transfer_id)
            raise RemoteProtocolError(
                ErrorCode.DIGEST_MISMATCH, f"transfer {transfer_id}: end digest differs"
            )
        del self._transfers[transfer_id]  # at or below the highest id opened: finished from now on
        return FragmentAssembled(transfer_id, inbound.header, inbound.buffer)

    def reset(self, transfer_id: int) -> CutShort | None:
        """Forget a transfer (failed, or reset by the sender); later chunks of it are dropped.
        Returns what a transfer that had been opened holds."""
        inbound = self._transfers.pop(transfer_id, None)
        self._early.pop(transfer_id, None)
        self._release_early(transfer_id)
        if transfer_id > self._highest_opened:
            self._reset_ahead.add(transfer_id)
            if len(self._reset_ahead) > self.limits.max_transfers_in_flight:
                # Only a peer that resets transfers it has not announced gets here: forgetting the
                # lowest lets its late chunks wait as early ones, within the early budget.
                self._reset_ahead.remove(min(self._reset_ahead))
        if inbound is None:
            return None
        held = {seq: inbound.checksums[seq] for seq, state in enumerate(inbound.state) if state == _DONE}
        return CutShort(inbound.header, inbound.buffer, held)

    def reset_all(self) -> list[CutShort]:
        """Forget every open transfer (the session is gone); what each holds."""
        return [opened for transfer_id in list(self._transfers) if (opened := self.reset(transfer_id))]

    def _release_early(self, transfer_id: int) -> None:
        self._early_bytes -= self._early_charged.pop(transfer_id, 0)

    def _advance(self, transfer_id: int) -> None:
        """A header named transfer_id, above every id before it: ids below it that never had a
        header are spent, and early chunks kept for them are dropped."""
        self._highest_opened = transfer_id
        if self._reset_ahead:
            self._reset_ahead = {tid for tid in self._reset_ahead if tid > transfer_id}
        for tid in [tid for tid in {*self._early, *self._early_charged} if tid < transfer_id]:
            self._early.pop(tid, None)
            self._release_early(tid)

    def missing(self, transfer_id: int) -> int:
        inbound = self._transfers.get(transfer_id)
        return 0 if inbound is None else inbound.header.chunks - inbound.done


@dataclass(slots=True)
class OutboundTransfer:
    """Sending side of one transfer: what each connection carried, until the receiver acks."""

    transfer_id: int
    chunks: int
    checksums: list[int] = field(default_factory=list)
    carried_by: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.chunks <= 0:
            raise LocalProtocolError(ErrorCode.INTERNAL, "a transfer has at least one chunk")
        self.checksums = [0] * self.chunks

    def record(self, seq: int, connection: int, chunk_checksum: int) -> None:
        self.checksums[seq] = chunk_checksum
        self.carried_by.setdefault(connection, []).append(seq)

    def connection_lost(self, connection: int) -> list[int]:
        """Sequence numbers that went out on a lost connection and must be sent again."""
        return self.carried_by.pop(connection, [])

    def end(self) -> FragmentEnd:
        return FragmentEnd(self.chunks, fragment_digest(self.checksums))
