"""Fragment streams across several connections: reassembly, resends and resets, decided by the
real SessionCore (wire/session.py) on both ends; InboundStreams and OutboundTransfer alone below.

A learner (client side) pushes a fragment to a syncer (server side) over one control connection
and several data connections, each a client/server Connection pair in memory; every server-side
connection has the receiving core's chunk_target as its chunk sink, and the receiving core's
actions are carried out as the transport does (Receiver.run). Delivery order across connections
is arbitrary (only each connection keeps its own order), so chunks may overtake their header,
arrive twice, or arrive after FRAGMENT_END.
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.wire import codecs
from dilocod.wire.connection import Connection
from dilocod.wire.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from dilocod.wire.events import ChunkReceived, Event, MessageReceived
from dilocod.wire.frames import CHUNK_HEADER_BYTES, HEADER_BYTES, ChunkHeader, Codec
from dilocod.wire.limits import Limits
from dilocod.wire.manifest import pack_manifest
from dilocod.wire.messages import (
    ChunkResend,
    FragmentAck,
    FragmentEnd,
    PushHeader,
    StreamReset,
    UpdateHeader,
    chunk_bitmap,
)
from dilocod.wire.session import (
    Action,
    Decode,
    DeliverFragment,
    InboundCutShort,
    ResendChunks,
    SendMessage,
    SessionCore,
)
from dilocod.wire.states import Role
from dilocod.wire.stream import (
    MAX_EARLY_BYTES,
    MIN_CHUNK_RESENDS,
    FragmentAssembled,
    InboundStreams,
    OutboundTransfer,
    Resumed,
)

Connect = Callable[..., tuple[Connection, Connection]]

LIMITS = Limits()
CHUNK_BYTES = LIMITS.min_chunk_bytes  # 4 KiB: small fragments still have several chunks
TID = 1  # the first transfer a client (the learner) sends: client-sent ids are odd
HEADS = HEADER_BYTES + CHUNK_HEADER_BYTES  # what precedes a chunk's payload on the wire
SESSION = bytes(range(16))


def make_fragment(seed: int, n_bytes: int) -> bytes:
    """Mixed content: compressible stretches (which lz4/zstd shrink) and random ones (which
    compress() sends as they are, so they land in place)."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        n = rng.choice([1000, 3000, 5000])
        parts.append(rng.randbytes(n) if rng.random() < 0.5 else bytes([rng.randrange(4)]) * n)
        size += n
    return b"".join(parts)[:n_bytes]


RAW_BYTES = 7 * CHUNK_BYTES + 1000  # eight chunks, the last one short
FRAGMENT = make_fragment(0, RAW_BYTES)


def push_header(raw_bytes: int = RAW_BYTES, codec: str = "zstd") -> PushHeader:
    entries, total = pack_manifest([("layer.weight", "float32", [raw_bytes // 4])])
    assert total <= raw_bytes  # a short tail after the last tensor is padding (SPEC §5.2)
    return PushHeader(tuple(entries), raw_bytes, codec, CHUNK_BYTES, fragment=3, round=1, base_version=0)


class Receiver:
    """The receiving session's SessionCore, behind every connection as the transport puts it, with
    its actions carried out the way the transport does (a Decode inline, its outcome fed back).
    With resend, the peer is taken to resend damaged chunks, so the core asks for them again
    (CHUNK_RESEND, their seqs kept in `asked`) while the transfer allows."""

    def __init__(
        self, max_early_bytes: int = 64 * 1024 * 1024, *, resend: bool = False, role: Role = Role.SERVER
    ) -> None:
        self.core = SessionCore(
            role, LIMITS, self.allocate, max_early_bytes=max_early_bytes, peer_resends=resend
        )
        self.streams = self.core.inbound
        self.asked: list[int] = []
        self.assembled: list[FragmentAssembled] = []
        self.acked: list[int] = []
        self.resets: list[tuple[int, ErrorCode]] = []  # STREAM_RESETs the core answered with
        self.early: list[int] = []  # seqs decoded as soon as their header arrived
        self.in_place: list[int] = []  # seqs whose payload arrived straight in the destination

    def allocate(self, header: PushHeader | UpdateHeader) -> memoryview:
        return memoryview(bytearray(header.raw_bytes))

    def handle(self, events: Sequence[Event]) -> None:
        for event in events:
            if isinstance(event, ChunkReceived):
                if event.in_place:
                    self.in_place.append(event.chunk.seq)
                self.run(
                    self.core.chunk_received(event.transfer_id, event.chunk, event.payload, event.in_place)
                )
            elif isinstance(event, MessageReceived):
                actions = self.core.message_received(event.message, event.stream_id, 0.0)
                if isinstance(event.message, PushHeader | UpdateHeader):
                    self.early += [action.chunk.seq for action in actions if isinstance(action, Decode)]
                self.run(actions)

    def run(self, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, Decode):
                try:
                    codecs.decompress_into(
                        action.chunk, action.payload, action.dest, in_place=action.in_place
                    )
                except RemoteProtocolError as exc:
                    self.run(self.core.chunk_failed(action.transfer_id, action.chunk, exc))
                else:
                    self.run(self.core.chunk_verified(action.transfer_id, action.chunk))
            elif isinstance(action, DeliverFragment):
                self.assembled.append(action.fragment)
            elif isinstance(action, SendMessage):
                message = action.message
                if isinstance(message, ChunkResend):
                    self.asked.append(message.seq)
                elif isinstance(message, StreamReset):
                    self.resets.append((action.stream_id, ErrorCode(message.code)))
                elif isinstance(message, FragmentAck):
                    self.acked.append(action.stream_id)


@dataclass
class Transfer:
    """One outbound transfer of the sending session's SessionCore, as the transport drives it."""

    core: SessionCore
    transfer_id: int

    def record(self, seq: int, connection: int, checksum: int) -> None:
        self.core.chunk_sent(self.transfer_id, seq, connection, checksum)

    def end(self) -> FragmentEnd:
        return self.core.fragment_end(self.transfer_id)

    def connection_lost(self, connection: int, lent: tuple[int, ChunkHeader] | None = None) -> list[int]:
        """The chunks of this transfer the core resends once a connection is lost."""
        return [
            seq
            for action in self.core.data_lost(connection, lent)
            if isinstance(action, ResendChunks) and action.transfer_id == self.transfer_id
            for seq in action.seqs
        ]


def start_transfer(
    sender: SessionCore, header: PushHeader | UpdateHeader, checksums: Sequence[int] | None = None
) -> Transfer:
    transfer_id, _ = sender.start_send(header, checksums)
    return Transfer(sender, transfer_id)


@dataclass
class Link:
    """One connection pair; what the client sent waits in packets until delivered."""

    client: Connection
    server: Connection
    packets: list[bytes] = field(default_factory=list)

    def capture(self) -> None:
        data = b"".join(bytes(b) for b in self.client.data_to_send())
        if data:
            self.packets.append(data)


class Session:
    """A learner's control connection and data connections to a syncer, in memory."""

    def __init__(self, connect: Connect, receiver: Receiver, n_data: int = 3) -> None:
        sink = receiver.core.chunk_target
        self.receiver = receiver
        self.sender = SessionCore(Role.CLIENT, LIMITS, receiver.allocate)
        self.control = Link(*connect(server_sink=sink))
        self.data = [Link(*connect("data", session=SESSION, server_sink=sink)) for _ in range(n_data)]

    def links(self) -> list[Link]:
        return [self.control, *self.data]

    def deliver(self, link: Link, nbytes: int | None = None) -> None:
        """Deliver the next packet of link (or only its first nbytes)."""
        packet = link.packets[0]
        n = len(packet) if nbytes is None else nbytes
        self.receiver.handle(link.server.receive_data(packet[:n]))
        if n >= len(packet):
            link.packets.pop(0)
        else:
            link.packets[0] = packet[n:]

    def deliver_all(self, link: Link) -> None:
        while link.packets:
            self.deliver(link)


def send_chunk(
    out: Transfer,
    link: Link,
    index: int,
    header: PushHeader,
    fragment: bytes,
    seq: int,
    codec: Codec,
    shuffle: int = 0,
    *,
    damaged: bool = False,
) -> None:
    """Chunk seq of fragment on link; damaged: one byte of its payload flipped on the way."""
    start = seq * header.chunk_bytes
    raw = memoryview(fragment)[start : start + header.chunk_bytes]
    used, item_size, payload = codecs.compress(codec, raw, shuffle)
    if damaged:
        payload = bytearray(payload)
        payload[len(payload) // 2] ^= 0x40
    chunk = ChunkHeader(seq, len(raw), used, item_size, codecs.checksum(raw))
    link.client.send_chunk(out.transfer_id, chunk, payload)
    out.record(seq, index, chunk.checksum)
    link.capture()


def send_fragment(
    session: Session,
    header: PushHeader,
    fragment: bytes,
    *,
    codec_of: Callable[[int], tuple[Codec, int]] = lambda seq: (Codec.ZSTD, 0),
) -> Transfer:
    """Header on control, chunks striped over the data connections, then FRAGMENT_END."""
    out = start_transfer(session.sender, header)
    session.control.client.send(header, out.transfer_id)
    session.control.capture()
    for seq in range(header.chunks):
        index = seq % len(session.data)
        send_chunk(out, session.data[index], index, header, fragment, seq, *codec_of(seq))
    session.control.client.send(out.end(), out.transfer_id)
    session.control.capture()
    return out


CODEC_CYCLE = [(Codec.NONE, 0), (Codec.LZ4, 0), (Codec.ZSTD, 2), (Codec.LZ4, 4), (Codec.ZSTD, 0)]


def cycle_codecs(seq: int) -> tuple[Codec, int]:
    return CODEC_CYCLE[seq % len(CODEC_CYCLE)]


def assert_assembled_once(receiver: Receiver, header: PushHeader, fragment: bytes) -> None:
    assert len(receiver.assembled) == 1
    done = receiver.assembled[0]
    assert done.transfer_id == TID and done.header == header
    assert bytes(done.buffer) == fragment
    assert len(receiver.streams) == 0


# ------------------------------------------------------------------------------ reassembly


def test_fragment_assembles_with_early_duplicate_and_late_chunks(connect: Connect) -> None:
    receiver = Receiver()
    session = Session(connect, receiver)
    header = push_header()
    out = send_fragment(session, header, FRAGMENT, codec_of=cycle_codecs)
    assert header.chunks == 8
    # Duplicates: chunks 0 and 4 (data link 0) resent on data link 1.
    for seq in (0, 4):
        send_chunk(out, session.data[1], 1, header, FRAGMENT, seq, *cycle_codecs(seq))
    link0, link1, link2 = session.data
    session.deliver(link2)  # chunk 2 overtakes the header: an early chunk
    session.deliver(link2)  # chunk 5, early too
    session.deliver(session.control)  # the header
    assert sorted(receiver.early) == [2, 5]
    session.deliver_all(link1)  # chunks 1, 4, 7, then the resent 0 (its first copy) and 4 (dropped)
    session.deliver(session.control)  # FRAGMENT_END before chunks 3 and 6 (link 0)
    assert receiver.assembled == []
    assert receiver.streams.missing(TID) == 2
    session.deliver(link0)  # chunk 0 again: dropped as a duplicate
    session.deliver(link0)  # chunk 3
    assert receiver.assembled == []
    session.deliver(link0)  # chunk 6 completes the fragment
    assert_assembled_once(receiver, header, FRAGMENT)
    assert receiver.in_place  # uncompressed chunks were received straight into place
    assert all(not link.packets for link in session.links())


def test_duplicate_does_not_race_a_chunk_landing_in_place(connect: Connect) -> None:
    """While a chunk's payload is still landing in its slice on one connection, a copy that
    arrives whole on another must not be verified into the same slice: the bytes still coming
    could differ, and a verified slice must never change afterwards."""
    receiver = Receiver()
    session = Session(connect, receiver, n_data=2)
    header = push_header(CHUNK_BYTES)
    session.control.client.send(header, TID)
    session.control.capture()
    session.deliver(session.control)
    raw = FRAGMENT[:CHUNK_BYTES]
    chunk = ChunkHeader(0, CHUNK_BYTES, Codec.NONE, 0, codecs.checksum(raw))
    corrupt = bytearray(raw)
    corrupt[-1] ^= 0xFF
    slow, fast = session.data
    slow.client.send_chunk(TID, chunk, corrupt)
    slow.capture()
    fast.client.send_chunk(TID, chunk, raw)
    fast.capture()
    session.deliver(slow, HEADS + 100)  # lent the slice, a hundred bytes in
    session.deliver(fast)  # the whole good copy, in a fresh buffer: dropped
    assert receiver.assembled == [] and receiver.streams.missing(TID) == 1
    session.deliver(slow)  # the rest of the slow copy, corrupt: found out, never assembled
    assert receiver.resets == [(TID, ErrorCode.CHECKSUM_MISMATCH)]
    assert receiver.assembled == []


def test_late_duplicates_after_assembly_are_dropped(connect: Connect) -> None:
    receiver = Receiver()
    session = Session(connect, receiver, n_data=2)
    header = push_header()
    out = send_fragment(session, header, FRAGMENT, codec_of=cycle_codecs)
    for link in session.links():
        session.deliver_all(link)
    assert len(receiver.assembled) == 1
    before = bytes(receiver.assembled[0].buffer)
    for seq in range(header.chunks):  # everything again, uncompressed and corrupted
        raw = bytearray(FRAGMENT[seq * CHUNK_BYTES : (seq + 1) * CHUNK_BYTES])
        chunk = ChunkHeader(seq, len(raw), Codec.NONE, 0, codecs.checksum(raw))
        raw[0] ^= 0xFF
        session.data[0].client.send_chunk(TID, chunk, raw)
        out.record(seq, 0, chunk.checksum)
    session.data[0].capture()
    session.deliver_all(session.data[0])
    assert len(receiver.assembled) == 1
    assert bytes(receiver.assembled[0].buffer) == before == FRAGMENT


@settings(max_examples=30, deadline=None)
@given(
    rng=st.randoms(use_true_random=False),
    n_data=st.integers(1, 4),
    raw_bytes=st.sampled_from([CHUNK_BYTES, 3 * CHUNK_BYTES + 1, RAW_BYTES]),
    n_duplicates=st.integers(0, 4),
)
def test_any_delivery_order_assembles_exactly_once(
    connect: Connect, rng: random.Random, n_data: int, raw_bytes: int, n_duplicates: int
) -> None:
    receiver = Receiver()
    session = Session(connect, receiver, n_data)
    header = push_header(raw_bytes)
    fragment = FRAGMENT[:raw_bytes]
    codec_choice = [rng.choice(CODEC_CYCLE) for _ in range(header.chunks)]
    out = send_fragment(session, header, fragment, codec_of=codec_choice.__getitem__)
    for _ in range(n_duplicates):
        seq, index = rng.randrange(header.chunks), rng.randrange(n_data)
        send_chunk(out, session.data[index], index, header, fragment, seq, *rng.choice(CODEC_CYCLE))
    # Interleave the connections arbitrarily, sometimes delivering half a packet at a time.
    while pending := [link for link in session.links() if link.packets]:
        link = rng.choice(pending)
        packet = link.packets[0]
        session.deliver(link, rng.choice([len(packet), rng.randrange(1, len(packet) + 1)]))
    assert_assembled_once(receiver, header, fragment)


# ------------------------------------------------------------------------------ resumed transfers


class Downlink(Session):
    """A syncer sending to a learner: the same connection pairs, with the server side sending
    (each Link's `client` is the sender) and the client side's connections sharing the sink."""

    def __init__(self, connect: Connect, receiver: Receiver, n_data: int = 3) -> None:
        sink = receiver.core.chunk_target
        self.receiver = receiver
        self.sender = SessionCore(Role.SERVER, LIMITS, receiver.allocate)
        learner, syncer = connect(client_sink=sink)
        self.control = Link(syncer, learner)
        self.data = []
        for _ in range(n_data):
            learner, syncer = connect("data", session=SESSION, client_sink=sink)
            self.data.append(Link(syncer, learner))


def update_header(raw_bytes: int = RAW_BYTES, skip: bytes = b"") -> UpdateHeader:
    entries, _ = pack_manifest([("layer.weight", "float32", [raw_bytes // 4])])  # any tail is padding
    return UpdateHeader(tuple(entries), raw_bytes, "zstd", CHUNK_BYTES, fragment=3, version=9, skip=skip)


@settings(max_examples=30, deadline=None)
@given(rng=st.randoms(use_true_random=False), n_data=st.integers(1, 3), cut_after=st.integers(0, 8))
def test_a_transfer_cut_short_resumes_from_the_chunks_it_holds(
    connect: Connect, rng: random.Random, n_data: int, cut_after: int
) -> None:
    """SPEC §4.4: the session carrying an update is lost after some of its chunks arrived (in any
    order, some cut mid-packet); the receiver keeps what it verified, and the same version sent
    again skipping those chunks completes in the same buffer, the digest covering every chunk."""
    fragment = FRAGMENT
    first = Receiver(role=Role.CLIENT)
    lost = Downlink(connect, first, n_data)
    header = update_header()
    out = start_transfer(lost.sender, header)
    lost.control.client.send(header, out.transfer_id)
    lost.control.capture()
    for seq in rng.sample(range(header.chunks), header.chunks):
        index = rng.randrange(n_data)
        send_chunk(out, lost.data[index], index, header, fragment, seq, *rng.choice(CODEC_CYCLE))
    lost.deliver_all(lost.control)
    packets = [(link, len(link.packets[0])) for link in lost.data for _ in range(len(link.packets))]
    rng.shuffle(packets)
    for link, _ in packets[:cut_after]:
        if link.packets:
            lost.deliver(link, rng.choice([None, rng.randrange(1, len(link.packets[0]) + 1)]))
    (closed,) = first.core.close("lost")
    assert isinstance(closed, InboundCutShort)
    cut = closed.cut
    assert first.assembled == []
    assert cut.header == header
    assert set(cut.held) <= set(range(header.chunks))
    assert all(
        codecs.checksum(cut.buffer[s * CHUNK_BYTES : (s + 1) * CHUNK_BYTES]) == c for s, c in cut.held.items()
    )

    second = Receiver(role=Role.CLIENT)
    second.core.set_allocator(lambda h: Resumed(cut.buffer, cut.held), MAX_EARLY_BYTES)
    again = Downlink(connect, second, n_data)
    resumed = update_header(skip=chunk_bitmap(cut.held, header.chunks))
    assert resumed.skipped == sorted(cut.held)
    out = start_transfer(again.sender, resumed, codecs.chunk_checksums(fragment, CHUNK_BYTES))
    again.control.client.send(resumed, out.transfer_id)
    again.control.capture()
    for seq in rng.sample(range(header.chunks), header.chunks):
        if seq not in cut.held:
            index = rng.randrange(n_data)
            send_chunk(out, again.data[index], index, resumed, fragment, seq, *rng.choice(CODEC_CYCLE))
    again.control.client.send(out.end(), out.transfer_id)
    again.control.capture()
    while pending := [link for link in again.links() if link.packets]:
        again.deliver(rng.choice(pending))
    (done,) = second.assembled
    assert bytes(done.buffer) == fragment
    assert done.buffer.obj is cut.buffer.obj  # no copy: the same buffer, completed


def test_a_transfer_that_skips_chunks_the_receiver_does_not_hold_is_refused() -> None:
    """A skip the receiver cannot honour (it holds fewer chunks, or nothing) is UNKNOWN_TRANSFER from
    the header: nothing is assembled from bytes it never received."""
    held = {0: 1, 1: 2}
    receiver = Receiver()
    receiver.streams.allocate = lambda h: Resumed(memoryview(bytearray(h.raw_bytes)), held)
    with pytest.raises(RemoteProtocolError) as refused:
        receiver.streams.open(TID, update_header(skip=chunk_bitmap([0, 1, 2], 8)))
    assert refused.value.code is ErrorCode.UNKNOWN_TRANSFER
    plain = Receiver()  # an allocator that offers no held chunks at all
    with pytest.raises(RemoteProtocolError) as refused:
        plain.streams.open(TID, update_header(skip=chunk_bitmap([5], 8)))
    assert refused.value.code is ErrorCode.UNKNOWN_TRANSFER


# ------------------------------------------------------------------------------ damaged chunks


@pytest.mark.parametrize("codec", [Codec.NONE, Codec.LZ4, Codec.ZSTD], ids=lambda c: c.name)
def test_a_damaged_chunk_is_asked_for_again_and_the_transfer_completes(
    connect: Connect, codec: Codec
) -> None:
    """Uncompressed, the damaged copy landed in place and fails its checksum; compressed, its
    decoding or its checksum fails. Either way its slot is free again, the transfer stays open, and
    the copy sent again completes it."""
    receiver = Receiver(resend=True)
    session = Session(connect, receiver, n_data=2)
    header = push_header()
    session.control.client.send(header, TID)
    session.control.capture()
    out = start_transfer(session.sender, header)  # the first: TID
    for seq in range(header.chunks):
        if seq == 3:
            send_chunk(out, session.data[1], 1, header, FRAGMENT, seq, codec, damaged=True)
        else:
            send_chunk(out, session.data[seq % 2], seq % 2, header, FRAGMENT, seq, codec)
    session.control.client.send(out.end(), TID)
    session.control.capture()
    for link in session.links():
        session.deliver_all(link)
    assert receiver.asked == [3]
    assert receiver.assembled == [] and len(receiver.streams) == 1
    send_chunk(out, session.data[0], 0, header, FRAGMENT, 3, codec)
    session.deliver_all(session.data[0])
    assert_assembled_once(receiver, header, FRAGMENT)


def test_damaged_chunks_are_asked_for_again_a_bounded_number_of_times() -> None:
    """One resend per chunk of the transfer, at least MIN_CHUNK_RESENDS: then the transfer is
    reset. A chunk already verified, or a transfer not open, has nothing to ask for."""
    streams = InboundStreams(LIMITS, lambda header: memoryview(bytearray(header.raw_bytes)))
    header = push_header()
    streams.open(TID, header)
    raw = FRAGMENT[:CHUNK_BYTES]
    chunk = ChunkHeader(0, CHUNK_BYTES, Codec.NONE, 0, codecs.checksum(raw))
    allowance = max(MIN_CHUNK_RESENDS, header.chunks)
    for _ in range(allowance):
        assert streams.destination(TID, chunk, memoryview(raw)) is not None
        assert streams.chunk_damaged(TID, chunk)
    assert streams.destination(TID, chunk, memoryview(raw)) is not None
    assert not streams.chunk_damaged(TID, chunk)
    good = ChunkHeader(1, CHUNK_BYTES, Codec.NONE, 0, 0)
    assert streams.destination(TID, good, memoryview(raw)) is not None
    streams.chunk_verified(TID, good)
    assert not streams.chunk_damaged(TID, good)  # verified already: a damaged duplicate is moot
    assert not streams.chunk_damaged(TID + 2, chunk)  # never opened


@settings(max_examples=30, deadline=None)
@given(
    rng=st.randoms(use_true_random=False),
    n_data=st.integers(1, 4),
    damaged=st.sets(st.integers(0, 7), max_size=8),
)
def test_damaged_copies_in_any_order_assemble_exactly_once(
    connect: Connect, rng: random.Random, n_data: int, damaged: set[int]
) -> None:
    """Some chunks arrive damaged first, in any interleaving with the rest and with the end; each
    is asked for exactly once, and the good copies sent in answer complete the transfer."""
    receiver = Receiver(resend=True)
    session = Session(connect, receiver, n_data)
    header = push_header()
    codec_choice = [rng.choice(CODEC_CYCLE) for _ in range(header.chunks)]
    session.control.client.send(header, TID)
    session.control.capture()
    out = start_transfer(session.sender, header)  # the first: TID
    for seq in range(header.chunks):
        index = rng.randrange(n_data)
        if seq in damaged:
            send_chunk(
                out, session.data[index], index, header, FRAGMENT, seq, *codec_choice[seq], damaged=True
            )
        else:
            send_chunk(out, session.data[index], index, header, FRAGMENT, seq, *codec_choice[seq])
    session.control.client.send(out.end(), TID)
    session.control.capture()
    answered: set[int] = set()
    while True:
        for seq in receiver.asked:  # the sender answers what it was asked, on any connection
            if seq not in answered:
                answered.add(seq)
                index = rng.randrange(n_data)
                send_chunk(out, session.data[index], index, header, FRAGMENT, seq, *rng.choice(CODEC_CYCLE))
        pending = [link for link in session.links() if link.packets]
        if not pending:
            break
        link = rng.choice(pending)
        packet = link.packets[0]
        session.deliver(link, rng.choice([len(packet), rng.randrange(1, len(packet) + 1)]))
    assert sorted(receiver.asked) == sorted(damaged)
    assert_assembled_once(receiver, header, FRAGMENT)


# ------------------------------------------------------------------------------ bad streams


def test_digest_mismatch(connect: Connect) -> None:
    receiver = Receiver()
    session = Session(connect, receiver, n_data=2)
    header = push_header()
    session.control.client.send(header, TID)
    out = start_transfer(session.sender, header)  # the first: TID
    for seq in range(header.chunks):
        send_chunk(out, session.data[seq % 2], seq % 2, header, FRAGMENT, seq, Codec.LZ4)
    good = out.end()
    session.control.client.send(FragmentEnd(good.chunks, good.digest ^ 1), TID)
    session.control.capture()
    session.deliver_all(session.data[0])
    session.deliver(session.control)
    session.deliver_all(session.data[1])  # the last chunk completes it: the digest differs
    assert receiver.resets == [(TID, ErrorCode.DIGEST_MISMATCH)]
    assert receiver.assembled == [] and receiver.acked == [] and len(receiver.streams) == 0


def test_digest_mismatch_found_at_the_end(connect: Connect) -> None:
    receiver = Receiver()
    session = Session(connect, receiver, n_data=1)
    header = push_header()
    send_fragment(session, header, FRAGMENT)
    reordered = codecs.chunk_checksums(FRAGMENT, CHUNK_BYTES)[::-1]  # the digest covers them in order
    session.control.packets.pop()
    session.control.client.send(FragmentEnd(header.chunks, codecs.fragment_digest(reordered)), TID)
    session.control.capture()
    session.deliver(session.control)
    session.deliver_all(session.data[0])
    session.deliver(session.control)
    assert receiver.resets == [(TID, ErrorCode.DIGEST_MISMATCH)]
    assert receiver.assembled == []


def test_end_with_the_wrong_chunk_count() -> None:
    receiver = Receiver()
    receiver.streams.open(TID, push_header())
    with pytest.raises(RemoteProtocolError) as info:
        receiver.streams.end(TID, FragmentEnd(7, 0))
    assert info.value.code is ErrorCode.LENGTH_MISMATCH


def test_end_of_an_unknown_transfer() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        Receiver().streams.end(TID, FragmentEnd(1, 0))
    assert info.value.code is ErrorCode.UNKNOWN_TRANSFER


@pytest.mark.parametrize(
    "chunk",
    [
        pytest.param(ChunkHeader(8, CHUNK_BYTES, Codec.NONE, 0, 0), id="seq-past-the-end"),
        pytest.param(ChunkHeader(2**32 - 1, CHUNK_BYTES, Codec.NONE, 0, 0), id="seq-max"),
        pytest.param(ChunkHeader(0, CHUNK_BYTES - 1, Codec.NONE, 0, 0), id="short-raw-length"),
        pytest.param(ChunkHeader(7, CHUNK_BYTES, Codec.NONE, 0, 0), id="last-chunk-too-long"),
        pytest.param(ChunkHeader(7, 999, Codec.LZ4, 0, 0), id="last-chunk-too-short"),
    ],
)
def test_chunk_that_does_not_fit_the_header(connect: Connect, chunk: ChunkHeader) -> None:
    receiver = Receiver()
    session = Session(connect, receiver, n_data=1)
    session.control.client.send(push_header(), TID)
    session.control.capture()
    session.deliver(session.control)
    payload = bytes(chunk.raw_length) if chunk.codec is Codec.NONE else b"x" * 10
    session.data[0].client.send_chunk(TID, chunk, payload)
    session.data[0].capture()
    link = session.data[0]
    with pytest.raises(RemoteProtocolError) as info:
        session.deliver(link, HEADS)  # frame header and chunk sub-header: refused before payload
    assert info.value.code is ErrorCode.LENGTH_MISMATCH


def test_early_chunk_that_does_not_fit_the_header(connect: Connect) -> None:
    receiver = Receiver()
    session = Session(connect, receiver, n_data=1)
    session.data[0].client.send_chunk(TID, ChunkHeader(99, CHUNK_BYTES, Codec.NONE, 0, 0), bytes(CHUNK_BYTES))
    session.data[0].capture()
    session.deliver(session.data[0])  # kept: its header has not arrived
    session.control.client.send(push_header(), TID)
    session.control.capture()
    session.deliver(session.control)
    assert receiver.resets == [(TID, ErrorCode.LENGTH_MISMATCH)]


def test_corrupt_chunk_voids_the_transfer(connect: Connect) -> None:
    receiver = Receiver()
    session = Session(connect, receiver, n_data=1)
    header = push_header()
    session.control.client.send(header, TID)
    session.control.capture()
    session.deliver(session.control)
    raw = bytearray(FRAGMENT[:CHUNK_BYTES])
    chunk = ChunkHeader(0, CHUNK_BYTES, Codec.NONE, 0, codecs.checksum(raw))
    raw[100] ^= 1
    session.data[0].client.send_chunk(TID, chunk, raw)
    session.data[0].capture()
    session.deliver(session.data[0])
    assert receiver.resets == [(TID, ErrorCode.CHECKSUM_MISMATCH)]
    assert len(receiver.streams) == 0
    # Later chunks and the end of the void transfer are dropped (the end may have crossed the
    # reset on the wire), its id is spent.
    good = ChunkHeader(
        1, CHUNK_BYTES, Codec.NONE, 0, codecs.checksum(FRAGMENT[CHUNK_BYTES : 2 * CHUNK_BYTES])
    )
    session.data[0].client.send_chunk(TID, good, FRAGMENT[CHUNK_BYTES : 2 * CHUNK_BYTES])
    session.data[0].capture()
    session.deliver(session.data[0])
    session.control.client.send(FragmentEnd(header.chunks, 0), TID)
    session.control.client.send(header, TID)
    session.control.capture()
    session.deliver_all(session.control)
    assert receiver.resets == [(TID, ErrorCode.CHECKSUM_MISMATCH), (TID, ErrorCode.DUPLICATE_TRANSFER)]
    assert receiver.assembled == [] and receiver.acked == []


def test_reset_drops_the_transfer_and_its_early_chunks() -> None:
    receiver = Receiver(max_early_bytes=3 * (CHUNK_BYTES + 1024))
    streams = receiver.streams
    chunk = ChunkHeader(0, CHUNK_BYTES, Codec.NONE, 0, 0)
    for _ in range(2):
        assert streams.chunk_target(TID, chunk, CHUNK_BYTES) is None
        assert streams.destination(TID, chunk, memoryview(bytearray(CHUNK_BYTES))) is None
    streams.reset(TID)
    # The budget is free again for another transfer, and late chunks of the reset one are dropped.
    for _ in range(2):
        assert streams.chunk_target(TID + 2, chunk, CHUNK_BYTES) is None
    assert streams.chunk_target(TID, chunk, CHUNK_BYTES) is None
    assert streams.destination(TID, chunk, memoryview(bytearray(CHUNK_BYTES))) is None
    with pytest.raises(RemoteProtocolError):
        streams.open(TID, push_header())


def test_transfer_id_reused_while_open() -> None:
    streams = Receiver().streams
    streams.open(TID, push_header())
    with pytest.raises(RemoteProtocolError) as info:
        streams.open(TID, push_header())
    assert info.value.code is ErrorCode.DUPLICATE_TRANSFER


def test_transfers_in_flight_are_bounded() -> None:
    limits = Limits(max_transfers_in_flight=3)
    streams = InboundStreams(limits, lambda h: memoryview(bytearray(h.raw_bytes)))
    for tid in (2, 4, 6):
        streams.open(tid, push_header())
    with pytest.raises(RemoteProtocolError) as info:
        streams.open(8, push_header())
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED
    streams.reset(2)
    streams.open(8, push_header())


def test_allocator_must_return_the_declared_size() -> None:
    streams = InboundStreams(LIMITS, lambda h: memoryview(bytearray(h.raw_bytes - 1)))
    with pytest.raises(LocalProtocolError):
        streams.open(TID, push_header())


# ------------------------------------------------------------------------------ early chunks


def early_chunk_frames(link: Link, count: int, payload_bytes: int = CHUNK_BYTES, tid: int = TID) -> None:
    for seq in range(count):
        if payload_bytes:
            raw = bytes(payload_bytes)
            chunk = ChunkHeader(seq, payload_bytes, Codec.NONE, 0, codecs.checksum(raw))
            link.client.send_chunk(tid, chunk, raw)
        else:  # an empty compressed payload: only found to be bad when decoded
            link.client.send_chunk(tid, ChunkHeader(seq, CHUNK_BYTES, Codec.LZ4, 0, 0), b"")
        link.capture()


def test_too_many_early_bytes(connect: Connect) -> None:
    budget = 4 * CHUNK_BYTES
    receiver = Receiver(max_early_bytes=budget)
    session = Session(connect, receiver, n_data=1)
    link = session.data[0]
    early_chunk_frames(link, 5)
    accepted, stage = 0, ""
    with pytest.raises(RemoteProtocolError) as info:
        while link.packets:
            stage = "headers"
            session.deliver(link, HEADS)
            stage = "payload"
            session.deliver(link)
            accepted += 1
    assert info.value.code is ErrorCode.UNKNOWN_TRANSFER
    assert stage == "headers"  # refused before the payload is buffered
    assert 2 <= accepted <= 4
    assert accepted * CHUNK_BYTES <= budget


def test_empty_early_chunks_are_bounded_too(connect: Connect) -> None:
    """Early chunks cost memory beyond their payload; a flood of empty ones must hit the cap."""
    receiver = Receiver(max_early_bytes=64 * 1024)
    session = Session(connect, receiver, n_data=1)
    link = session.data[0]
    early_chunk_frames(link, 5000, payload_bytes=0)
    with pytest.raises(RemoteProtocolError) as info:
        session.deliver_all(link)
    assert info.value.code is ErrorCode.UNKNOWN_TRANSFER


def test_early_budget_comes_back_when_the_header_arrives(connect: Connect) -> None:
    budget = 3 * CHUNK_BYTES + 3 * 1024
    receiver = Receiver(max_early_bytes=budget)
    session = Session(connect, receiver, n_data=1)
    link = session.data[0]
    header = push_header()
    for round_ in range(4):  # far more than the budget in total, never too much at once
        tid = TID + 2 * round_
        early_chunk_frames(link, 3, tid=tid)
        session.deliver_all(link)
        session.control.client.send(header, tid)
        session.control.capture()
        session.deliver(session.control)
        assert sorted(receiver.early[-3:]) == [0, 1, 2]


def test_header_arriving_mid_chunk_releases_the_budget(connect: Connect) -> None:
    """A chunk counted as early when its header came in, whose header arrived while its payload
    was still on the way, must not keep holding the early budget."""
    budget = 2 * CHUNK_BYTES + 2 * 1024
    receiver = Receiver(max_early_bytes=budget)
    session = Session(connect, receiver, n_data=1)
    link = session.data[0]
    header = push_header()
    for round_ in range(4):
        tid = TID + 2 * round_
        out = start_transfer(session.sender, header)
        assert out.transfer_id == tid
        for seq in range(2):
            send_chunk(out, link, 0, header, FRAGMENT, seq, Codec.NONE)
        session.control.client.send(header, tid)
        session.control.capture()
        session.deliver(link, 100)  # the first chunk is counted as early...
        session.deliver(session.control)  # ...then its header arrives...
        session.deliver_all(link)  # ...then the rest of it, and the second chunk
        assert receiver.streams.missing(tid) == header.chunks - 2


def test_rejected_early_chunk_does_not_shrink_the_budget() -> None:
    budget = 2 * CHUNK_BYTES + 2 * 1024
    streams = Receiver(max_early_bytes=budget).streams
    chunk = ChunkHeader(0, CHUNK_BYTES, Codec.NONE, 0, 0)
    for _ in range(2):
        assert streams.chunk_target(TID, chunk, CHUNK_BYTES) is None
        streams.destination(TID, chunk, memoryview(bytearray(CHUNK_BYTES)))
    for _ in range(3):  # refused, each on its own connection
        with pytest.raises(RemoteProtocolError):
            streams.chunk_target(TID + 2, chunk, CHUNK_BYTES)
    assert len(streams.open(TID, push_header())) == 2
    for _ in range(2):  # the whole budget is available again
        assert streams.chunk_target(TID + 4, chunk, CHUNK_BYTES) is None


# ------------------------------------------------------------------------------ lost links


def test_connection_lost_returns_what_it_carried() -> None:
    out = OutboundTransfer(TID, 6)
    carried = {0: [0, 3], 1: [1, 4], 2: [2, 5]}
    for seq in range(6):
        out.record(seq, seq % 3, 1000 + seq)
    out.record(3, 1, 1003)  # chunk 3 resent on connection 1
    assert out.connection_lost(0) == carried[0]
    assert out.connection_lost(0) == []
    assert out.connection_lost(1) == [*carried[1], 3]
    assert out.connection_lost(7) == []
    assert out.connection_lost(2) == carried[2]
    assert out.end() == FragmentEnd(6, codecs.fragment_digest([1000 + s for s in range(6)]))


def test_transfer_needs_a_chunk() -> None:
    with pytest.raises(LocalProtocolError):
        OutboundTransfer(TID, 0)


def test_lost_connection_chunks_resent_on_the_survivors(connect: Connect) -> None:
    receiver = Receiver()
    session = Session(connect, receiver)
    header = push_header()
    out = send_fragment(session, header, FRAGMENT, codec_of=cycle_codecs)
    session.deliver_all(session.control)
    session.deliver_all(session.data[0])
    session.deliver(session.data[1])  # link 1 delivers its first chunk, then dies
    session.data[1].packets.clear()
    lost = out.connection_lost(1)
    assert lost == list(range(1, header.chunks, 3))
    for i, seq in enumerate(lost):
        index = (0, 2)[i % 2]
        send_chunk(out, session.data[index], index, header, FRAGMENT, seq, *cycle_codecs(seq))
    session.deliver_all(session.data[2])
    session.deliver_all(session.data[0])
    assert_assembled_once(receiver, header, FRAGMENT)


def test_connection_lost_inside_a_chunk_received_in_place(connect: Connect) -> None:
    """A data connection dies halfway through an uncompressed chunk that was landing straight in
    the destination; the copy resent on another connection must be taken, not dropped as a
    duplicate of the half-written one."""
    receiver = Receiver()
    session = Session(connect, receiver, n_data=2)
    header = push_header()
    out = send_fragment(session, header, FRAGMENT, codec_of=lambda seq: (Codec.NONE, 0))
    session.deliver_all(session.control)
    session.deliver_all(session.data[0])
    dying = session.data[1]
    session.deliver(dying, HEADS + 1000)  # chunk 1 is a thousand bytes into its slice
    with pytest.raises(RemoteProtocolError):
        dying.server.receive_eof()  # the connection is lost: TRUNCATED
    lent = dying.server.lent_chunk  # what the transport hands back when a connection is lost
    assert lent is not None and lent[0] == TID and lent[1].seq == 1
    receiver.run(receiver.core.data_lost(1, lent))
    for seq in out.connection_lost(1):
        send_chunk(out, session.data[0], 0, header, FRAGMENT, seq, Codec.NONE)
    session.deliver_all(session.data[0])
    assert_assembled_once(receiver, header, FRAGMENT)


def test_a_resent_copy_waits_while_its_slot_is_lent(connect: Connect) -> None:
    """The sender noticed the loss first: the resent copy arrives whole while the dying connection
    still holds the chunk's slot, half written. The copy is kept (not verified into the slot, not
    dropped) and taken once the receiver notices the loss too."""
    receiver = Receiver()
    session = Session(connect, receiver, n_data=2)
    header = push_header()
    out = send_fragment(session, header, FRAGMENT, codec_of=lambda seq: (Codec.NONE, 0))
    session.deliver_all(session.control)
    session.deliver_all(session.data[0])
    dying = session.data[1]
    session.deliver(dying, HEADS + 1000)
    lost = out.connection_lost(1)
    assert lost == [1, 3, 5, 7]
    for seq in lost:
        send_chunk(out, session.data[0], 0, header, FRAGMENT, seq, Codec.NONE)
    session.deliver_all(session.data[0])
    assert receiver.assembled == [] and receiver.streams.missing(TID) == 1  # chunk 1: a spare
    receiver.run(receiver.core.data_lost(1, dying.server.lent_chunk))
    assert_assembled_once(receiver, header, FRAGMENT)


def test_nothing_is_lent_between_chunks(connect: Connect) -> None:
    receiver = Receiver()
    session = Session(connect, receiver, n_data=1)
    assert session.data[0].server.lent_chunk is None
    header = push_header()
    send_fragment(session, header, bytes(RAW_BYTES), codec_of=lambda seq: (Codec.LZ4, 0))
    session.deliver_all(session.control)
    session.deliver(session.data[0], HEADS + 1)  # a compressed chunk gets a fresh buffer
    assert session.data[0].server.lent_chunk is None
    session.deliver_all(session.data[0])
    assert session.data[0].server.lent_chunk is None
    assert len(receiver.assembled) == 1


# ------------------------------------------------------------------------------ finished transfers


def one_chunk_header() -> PushHeader:
    return push_header(raw_bytes=CHUNK_BYTES, codec="none")


ONE_CHUNK = ChunkHeader(0, CHUNK_BYTES, Codec.NONE, 0, codecs.checksum(bytes(CHUNK_BYTES)))
ONE_CHUNK_END = FragmentEnd(1, codecs.fragment_digest([ONE_CHUNK.checksum]))


def run_transfers(streams: InboundStreams, ids: range) -> None:
    """A transfer per id, in order: every third reset by its sender, the others completed."""
    header, payload = one_chunk_header(), memoryview(bytes(CHUNK_BYTES))
    for tid in ids:
        streams.open(tid, header)
        if tid % 3 == 0:
            streams.reset(tid)
            continue
        dest = streams.destination(tid, ONE_CHUNK, payload)
        assert dest is not None
        dest[:] = payload
        assert streams.chunk_verified(tid, ONE_CHUNK) is None
        assert streams.end(tid, ONE_CHUNK_END) is not None


def traced_after(work: Callable[[], None]) -> int:
    gc.collect()
    work()
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_finished_transfers_take_bounded_memory() -> None:
    """A session lives for days at a transfer every few milliseconds: what the receiver keeps to
    recognise its peer's finished transfers must not grow with their number."""
    streams = InboundStreams(LIMITS, lambda h: memoryview(bytearray(h.raw_bytes)))
    tracemalloc.start()
    try:
        warm = traced_after(lambda: run_transfers(streams, range(TID, TID + 2 * 1_000, 2)))
        many = traced_after(lambda: run_transfers(streams, range(TID + 2 * 1_000, TID + 2 * 21_000, 2)))
    finally:
        tracemalloc.stop()
    assert many - warm < 64 * 1024, f"{many - warm} bytes more after 20 000 more transfers"


def test_late_frames_of_old_finished_transfers_are_still_recognised() -> None:
    """However long ago a transfer finished, its late chunks and FRAGMENT_END are dropped (not kept
    as early chunks, which would use up the early budget) and its id cannot be opened again."""
    streams = InboundStreams(
        LIMITS, lambda h: memoryview(bytearray(h.raw_bytes)), max_early_bytes=CHUNK_BYTES + 1024
    )
    run_transfers(streams, range(TID, TID + 2 * 5_000, 2))
    payload = memoryview(bytes(CHUNK_BYTES))
    for tid in (TID, TID + 2, TID + 4, TID + 2 * 4_999):  # completed and reset ones, old and recent
        for _ in range(3):  # more than the early budget holds, were they kept
            assert streams.chunk_target(tid, ONE_CHUNK, CHUNK_BYTES) is None
            assert streams.destination(tid, ONE_CHUNK, payload) is None
        assert streams.end(tid, ONE_CHUNK_END) is None
        with pytest.raises(RemoteProtocolError) as info:
            streams.open(tid, one_chunk_header())
        assert info.value.code is ErrorCode.DUPLICATE_TRANSFER
    assert len(streams) == 0


def test_transfer_ids_must_increase() -> None:
    """Ids increase per sender (SPEC §1): a header below one already seen reuses a spent id, and
    frames of an id that was skipped can never be opened, so they are dropped like late ones."""
    streams = InboundStreams(
        LIMITS, lambda h: memoryview(bytearray(h.raw_bytes)), max_early_bytes=CHUNK_BYTES + 1024
    )
    streams.open(TID + 4, one_chunk_header())
    with pytest.raises(RemoteProtocolError) as info:
        streams.open(TID + 2, one_chunk_header())
    assert info.value.code is ErrorCode.DUPLICATE_TRANSFER
    payload = memoryview(bytes(CHUNK_BYTES))
    for _ in range(3):
        assert streams.chunk_target(TID, ONE_CHUNK, CHUNK_BYTES) is None
        assert streams.destination(TID, ONE_CHUNK, payload) is None
    assert streams.end(TID, ONE_CHUNK_END) is None
    assert len(streams) == 1


def test_early_chunks_of_an_id_skipped_over_are_dropped() -> None:
    """Early chunks wait for a header with their id; once a header with a higher id arrives, theirs
    can no longer come: they are dropped and their early budget comes back."""
    budget = CHUNK_BYTES + 1024
    streams = InboundStreams(LIMITS, lambda h: memoryview(bytearray(h.raw_bytes)), max_early_bytes=budget)
    payload = memoryview(bytes(CHUNK_BYTES))
    assert streams.chunk_target(TID, ONE_CHUNK, CHUNK_BYTES) is None
    assert streams.destination(TID, ONE_CHUNK, payload) is None  # kept: the budget is now spent
    with pytest.raises(RemoteProtocolError):
        streams.chunk_target(TID + 4, ONE_CHUNK, CHUNK_BYTES)
    assert streams.open(TID + 2, one_chunk_header()) == []
    assert streams.chunk_target(TID + 4, ONE_CHUNK, CHUNK_BYTES) is None  # the budget came back


def test_resets_ahead_of_their_header_are_remembered_within_a_limit() -> None:
    """A STREAM_RESET may overtake its header on a data connection: the id is void when the header
    comes. At most max_transfers_in_flight such ids are remembered (the lowest forgotten first)."""
    limits = Limits(max_transfers_in_flight=4)
    streams = InboundStreams(limits, lambda h: memoryview(bytearray(h.raw_bytes)))
    ahead = range(TID + 2, TID + 2 * 1_000, 2)
    for tid in ahead:
        streams.reset(tid)
    remembered = list(ahead)[-4:]
    for tid in remembered:
        assert streams.chunk_target(tid, ONE_CHUNK, CHUNK_BYTES) is None
        assert streams.destination(tid, ONE_CHUNK, memoryview(bytes(CHUNK_BYTES))) is None
        assert streams.end(tid, ONE_CHUNK_END) is None
        with pytest.raises(RemoteProtocolError) as info:
            streams.open(tid, one_chunk_header())
        assert info.value.code is ErrorCode.DUPLICATE_TRANSFER
    # A header below the ids reset ahead opens as usual.
    streams.open(TID, one_chunk_header())
