"""SessionCore (wire/session.py): the decisions about a session's transfers, on their own and as a
pair of sessions talking over real Connection cores in memory.

The pair test is the transport in miniature: each end's actions are carried out as
transport/session.py does (a Decode inline with its outcome fed back, messages on the control
connection, chunks only while the core says the transfer is going), and hypothesis picks the
order of everything else: which connection delivers next and how much of it, which chunk is
written next on which connection, damaged copies, duplicates, lost data connections, senders
giving up, the session closing. Whatever the order, every fragment is delivered at most once and
only whole and verified, every send completes or fails exactly once, no chunk of a transfer is
written after it ended, and transfer ids keep their sender's parity.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.wire import codecs
from dilocod.wire.connection import Connection
from dilocod.wire.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from dilocod.wire.events import ChunkReceived, Event, MessageReceived
from dilocod.wire.frames import ChunkHeader, Codec
from dilocod.wire.limits import Limits
from dilocod.wire.manifest import pack_manifest
from dilocod.wire.messages import (
    ChunkResend,
    FragmentAck,
    FragmentEnd,
    Join,
    PushHeader,
    StreamReset,
    UpdateHeader,
)
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
)
from dilocod.wire.states import Role
from dilocod.wire.stream import resend_allowance

Connect = Callable[..., tuple[Connection, Connection]]

LIMITS = Limits()
CHUNK_BYTES = LIMITS.min_chunk_bytes
SESSION = bytes(range(16))


def header_of(raw_bytes: int, *, fragment: int = 0) -> PushHeader:
    entries, _ = pack_manifest([("w", "float32", [raw_bytes // 4])])  # any tail is padding
    return PushHeader(
        tuple(entries), raw_bytes, "lz4", CHUNK_BYTES, fragment=fragment, round=1, base_version=0
    )


def fresh(header: PushHeader | UpdateHeader) -> memoryview:
    return memoryview(bytearray(header.raw_bytes))


def core(role: Role, *, peer_resends: bool = True) -> SessionCore:
    return SessionCore(role, LIMITS, fresh, peer_resends=peer_resends)


def sent(actions: Sequence[Action]) -> list[tuple[type, int]]:
    return [(type(a.message), a.stream_id) for a in actions if isinstance(a, SendMessage)]


# ------------------------------------------------------------------------------ one core


def test_ids_keep_their_senders_parity() -> None:
    client, server = core(Role.CLIENT), core(Role.SERVER)
    header = header_of(CHUNK_BYTES)
    assert [client.start_send(header, None)[0] for _ in range(3)] == [1, 3, 5]
    assert [server.start_send(header, None)[0] for _ in range(3)] == [2, 4, 6]
    # A header with the id parity of the receiver's own transfers is the peer breaking the session.
    (abort,) = client.message_received(header, 3, now=0.0)
    assert isinstance(abort, AbortControl) and abort.code is ErrorCode.MALFORMED_BODY
    assert server.message_received(header, 3, now=0.0) == []  # a client's id: opened


def test_acks_resets_and_resend_requests_name_one_transfer() -> None:
    """FRAGMENT_ACK, STREAM_RESET and CHUNK_RESEND of our own id concern our send; a STREAM_RESET of
    the peer's id its transfer to us. The same number is never both."""
    client = core(Role.CLIENT)
    header = header_of(2 * CHUNK_BYTES)
    mine, _ = client.start_send(header, None)
    client.message_received(header, 2, now=0.0)  # the server's transfer 2 to us
    assert client.message_received(ChunkResend(1), mine, now=0.0) == [ResendChunks(mine, (1,))]
    (cut,) = client.message_received(StreamReset(ErrorCode.NOT_REQUESTED, "no"), 2, now=0.0)
    assert isinstance(cut, InboundCutShort) and client.sending(mine)
    assert client.message_received(FragmentAck(), 2, now=0.0) == []  # not ours: nothing to complete
    assert client.message_received(FragmentAck(), mine, now=0.0) == [CompleteSend(mine)]
    # Ended: later frames about it change nothing.
    assert client.message_received(FragmentAck(), mine, now=0.0) == []
    assert client.message_received(StreamReset(ErrorCode.TIMEOUT, "late"), mine, now=0.0) == []
    assert client.message_received(ChunkResend(0), mine, now=0.0) == []
    with pytest.raises(LocalProtocolError):
        client.chunk_sent(mine, 0, 0, 0)


def test_an_unknown_reset_code_is_transfer_aborted() -> None:
    client = core(Role.CLIENT)
    tid, _ = client.start_send(header_of(CHUNK_BYTES), None)
    assert client.message_received(StreamReset(999, "?"), tid, now=0.0) == [
        FailSend(tid, ErrorCode.TRANSFER_ABORTED, "receiver reset the transfer: ?")
    ]


def test_chunk_resend_requests_are_bounded() -> None:
    """A receiver asks for at most resend_allowance(chunks) chunks again; past that the send fails
    with LIMIT_EXCEEDED and the transfer is reset. A chunk past the end breaks the session."""
    client = core(Role.CLIENT)
    header = header_of(3 * CHUNK_BYTES)
    tid, seqs = client.start_send(header, None)
    assert seqs == [0, 1, 2]
    (abort,) = client.message_received(ChunkResend(3), tid, now=0.0)
    assert isinstance(abort, AbortControl) and abort.code is ErrorCode.MALFORMED_BODY
    for _ in range(resend_allowance(header.chunks)):
        assert client.message_received(ChunkResend(2), tid, now=0.0) == [ResendChunks(tid, (2,))]
    fail, reset = client.message_received(ChunkResend(2), tid, now=0.0)
    assert isinstance(fail, FailSend) and fail.code is ErrorCode.LIMIT_EXCEEDED
    assert sent([reset]) == [(StreamReset, tid)] and not client.sending(tid)


def test_an_overdue_ack_resets_the_transfer_once() -> None:
    client = core(Role.CLIENT)
    tid, _ = client.start_send(header_of(CHUNK_BYTES), None)
    reset, fail = client.ack_overdue(tid)
    assert sent([reset]) == [(StreamReset, tid)] and isinstance(reset, SendMessage) and not reset.answer
    assert fail == FailSend(tid, ErrorCode.TIMEOUT, "receiver did not acknowledge in time")
    assert client.ack_overdue(tid) == []
    assert client.message_received(FragmentAck(), tid, now=0.0) == []


def test_a_transfer_that_skips_chunks_sends_the_rest_and_digests_all() -> None:
    client = core(Role.CLIENT)
    data = random.Random(1).randbytes(4 * CHUNK_BYTES)
    checksums = codecs.chunk_checksums(data, CHUNK_BYTES)
    header = UpdateHeader(header_of(len(data)).manifest, len(data), "none", CHUNK_BYTES, 0, 5, skip=b"\x05")
    with pytest.raises(ValueError):
        client.start_send(header, None)  # the digest needs the skipped chunks' checksums
    with pytest.raises(ValueError):
        client.start_send(header, checksums[:3])
    tid, seqs = client.start_send(header, checksums)
    assert seqs == [1, 3]
    for seq in seqs:
        client.chunk_sent(tid, seq, 0, checksums[seq])
    assert client.fragment_end(tid) == FragmentEnd(4, codecs.fragment_digest(checksums))


def test_inbound_transfers_expire_on_the_injected_clock() -> None:
    server = core(Role.SERVER)
    header = header_of(CHUNK_BYTES)
    server.message_received(header, 1, now=100.0)
    server.message_received(header, 3, now=130.0)
    assert server.expire(now=129.0, transfer_timeout_s=30.0) == []
    cut, reset = server.expire(now=130.5, transfer_timeout_s=30.0)
    assert isinstance(cut, InboundCutShort) and sent([reset]) == [(StreamReset, 1)]
    assert [(type(a), getattr(a, "stream_id", None)) for a in server.expire(160.5, 30.0)] == [
        (InboundCutShort, None),
        (SendMessage, 3),
    ]
    assert server.expire(1e9, 30.0) == []


def test_application_messages_pass_through() -> None:
    server = core(Role.SERVER)
    join = Join((), "", "learner-1")
    assert server.message_received(join, 0, now=0.0) == [DeliverMessage(join, 0)]


def test_closing_fails_every_send_and_cuts_every_inbound_transfer_once() -> None:
    client = core(Role.CLIENT)
    header = header_of(CHUNK_BYTES)
    ours = [client.start_send(header, None)[0] for _ in range(2)]
    client.message_received(header, 2, now=0.0)
    actions = client.close("bye")
    assert [a for a in actions if isinstance(a, FailSend)] == [FailSend(t, None, "bye") for t in ours]
    assert sum(isinstance(a, InboundCutShort) for a in actions) == 1
    assert client.close("again") == []
    assert client.message_received(FragmentAck(), ours[0], now=0.0) == []
    assert client.data_lost(0, None) == [] and client.expire(1e9, 1.0) == []
    with pytest.raises(LocalProtocolError):
        client.start_send(header, None)


def test_a_damaged_chunk_is_asked_for_only_where_the_peer_resends() -> None:
    chunk = ChunkHeader(0, CHUNK_BYTES, Codec.NONE, 0, 0)
    damaged = RemoteProtocolError(ErrorCode.CHECKSUM_MISMATCH, "bad")
    for peer_resends, expected in ((True, [(ChunkResend, 1)]), (False, [(StreamReset, 1)])):
        server = core(Role.SERVER, peer_resends=peer_resends)
        server.message_received(header_of(CHUNK_BYTES), 1, now=0.0)
        (decode,) = server.chunk_received(1, chunk, memoryview(bytearray(CHUNK_BYTES)), False)
        assert isinstance(decode, Decode)
        actions = server.chunk_failed(1, chunk, damaged)
        assert sent(actions) == expected
        assert any(isinstance(a, PeerFaulted) for a in actions)
        assert server.chunks_asked_again == int(peer_resends)


# ------------------------------------------------------------------------------ a pair of sessions


@dataclass
class Pipe:
    """One direction of one connection: what src wrote waits in packets until delivered to dst."""

    src: Connection
    dst: Connection
    to: End
    index: int  # the connection's index (-1: control)
    packets: list[bytes] = field(default_factory=list)
    alive: bool = True  # a lost connection delivers nothing more: what is written to it is gone

    def capture(self) -> None:
        data = b"".join(bytes(b) for b in self.src.data_to_send())
        if data and self.alive:
            self.packets.append(data)


@dataclass
class Outgoing:
    header: PushHeader | UpdateHeader
    fragment: bytes
    queue: list[int]
    ended: bool = False


class End:
    """One session end: its SessionCore, and its actions carried out as the transport does."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self.core = core(role)
        self.control: Pipe  # this end -> the peer
        self.data: dict[int, Pipe] = {}  # data connections not known lost, this end -> the peer
        self.sends: dict[int, Outgoing] = {}
        self.outcomes: dict[int, Action] = {}
        self.delivered: dict[int, bytes] = {}

    def start(self, fragment: bytes, number: int) -> None:
        header: PushHeader | UpdateHeader = header_of(len(fragment), fragment=number)
        if self.role is Role.SERVER:  # a server sends updates, a client pushes
            header = UpdateHeader(header.manifest, len(fragment), "lz4", CHUNK_BYTES, number, version=1)
        tid, seqs = self.core.start_send(header, None)
        assert tid % 2 == (1 if self.role is Role.CLIENT else 0)
        self.sends[tid] = Outgoing(header, fragment, seqs)
        self.control.src.send(header, tid)
        self.control.capture()

    def write(self, rng: random.Random, tid: int, *, damaged: bool = False) -> None:
        """Write the next queued chunk of tid, as Session._send_chunks does."""
        out = self.sends[tid]
        if not self.core.sending(tid):  # ended: nothing more of it is written
            out.queue.clear()
            return
        assert tid not in self.outcomes, "the core lets a chunk be written after its transfer ended"
        seq = out.queue.pop(0)
        pipe = self.data[rng.choice(sorted(self.data))] if self.data else self.control
        raw = memoryview(out.fragment)[seq * CHUNK_BYTES : (seq + 1) * CHUNK_BYTES]
        used, item_size, payload = codecs.compress(rng.choice([Codec.NONE, Codec.LZ4]), raw, 0)
        if damaged:
            payload = bytearray(payload)
            payload[len(payload) // 2] ^= 0x10
        chunk = ChunkHeader(seq, len(raw), used, item_size, codecs.checksum(raw))
        pipe.src.send_chunk(tid, chunk, payload)
        pipe.capture()
        self.core.chunk_sent(tid, seq, pipe.index, chunk.checksum)
        if not out.queue and not out.ended:
            out.ended = True
            self.control.src.send(self.core.fragment_end(tid), tid)
            self.control.capture()

    def handle(self, events: Sequence[Event]) -> None:
        for event in events:
            if isinstance(event, ChunkReceived):
                self.run(
                    self.core.chunk_received(event.transfer_id, event.chunk, event.payload, event.in_place)
                )
            elif isinstance(event, MessageReceived):
                self.run(self.core.message_received(event.message, event.stream_id, now=0.0))

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
            elif isinstance(action, SendMessage):
                self.control.src.send(action.message, action.stream_id)
                self.control.capture()
            elif isinstance(action, DeliverFragment):
                done = action.fragment
                assert done.transfer_id not in self.delivered, "a fragment delivered twice"
                self.delivered[done.transfer_id] = bytes(done.buffer)
            elif isinstance(action, ResendChunks):
                assert action.transfer_id in self.sends and self.core.sending(action.transfer_id)
                self.sends[action.transfer_id].queue.extend(action.seqs)
            elif isinstance(action, CompleteSend | FailSend):
                assert action.transfer_id in self.sends, "an outcome for a transfer this end never sent"
                assert action.transfer_id not in self.outcomes, "a send ended twice"
                self.outcomes[action.transfer_id] = action
            elif isinstance(action, AbortControl):
                raise AssertionError(f"a sane peer broke the session: {action}")


class Pair:
    def __init__(self, connect: Connect, n_data: int) -> None:
        self.client, self.server = End(Role.CLIENT), End(Role.SERVER)
        client_sink, server_sink = self.client.core.chunk_target, self.server.core.chunk_target
        self.pipes: list[Pipe] = []
        self.links: dict[int, tuple[Pipe, Pipe]] = {}
        #: Losses an end has yet to notice: each end finds out on its own, in any order.
        self.unnoticed: list[tuple[End, int]] = []
        for index in range(-1, n_data):
            kind, session = ("control", b"") if index < 0 else ("data", SESSION)
            c, s = connect(kind, session=session, client_sink=client_sink, server_sink=server_sink)
            up, down = Pipe(c, s, self.server, index), Pipe(s, c, self.client, index)
            if index < 0:
                self.client.control, self.server.control = up, down
            else:
                self.client.data[index], self.server.data[index] = up, down
                self.links[index] = (up, down)
            self.pipes += [up, down]

    def ends(self) -> tuple[End, End]:
        return self.client, self.server

    def deliver(self, pipe: Pipe, nbytes: int | None = None) -> None:
        packet = pipe.packets[0]
        n = len(packet) if nbytes is None else nbytes
        pipe.to.handle(pipe.dst.receive_data(packet[:n]))
        if n >= len(packet):
            pipe.packets.pop(0)
        else:
            pipe.packets[0] = packet[n:]

    def lose(self, index: int) -> None:
        """Data connection index is lost: what was in flight on it is gone; each end notices later."""
        for pipe in self.links[index]:
            pipe.alive = False
            pipe.packets.clear()
        self.unnoticed += [(self.client, index), (self.server, index)]

    def notice(self, end: End, index: int) -> None:
        """end finds its connection lost and hands back the chunk it was reading in place there, if
        any (Connection.lent_chunk), as the transport does."""
        del end.data[index]
        up, down = self.links[index]
        end.run(end.core.data_lost(index, (down if end is self.client else up).dst.lent_chunk))

    def notice_one(self, rng: random.Random) -> None:
        """One end notices a loss; mostly one that was not reading a chunk in place there, so that
        the other may get the resent copy while its half-written slot is still lent (the hard case)."""
        calm = [i for i, (end, index) in enumerate(self.unnoticed) if not self._lent_to(end, index)]
        pick = rng.choice(calm) if calm and rng.random() < 0.8 else rng.randrange(len(self.unnoticed))
        self.notice(*self.unnoticed.pop(pick))

    def _lent_to(self, end: End, index: int) -> bool:
        up, down = self.links[index]
        return (down if end is self.client else up).dst.lent_chunk is not None

    def busy(self) -> bool:
        return (
            bool(self.unnoticed)
            or any(p.packets for p in self.pipes)
            or any(
                out.queue and end.core.sending(tid) for end in self.ends() for tid, out in end.sends.items()
            )
        )


def fragment_for(rng: random.Random) -> bytes:
    n = rng.choice([CHUNK_BYTES, 2 * CHUNK_BYTES + 7, 4 * CHUNK_BYTES])
    return bytes(rng.choice([rng.randrange(256), 0]) for _ in range(64)) * (n // 64) + rng.randbytes(n % 64)


@settings(max_examples=40, deadline=None)
@given(
    rng=st.randoms(use_true_random=False),
    n_data=st.integers(0, 3),
    steps=st.integers(10, 120),
    close_at_end=st.booleans(),
)
def test_any_order_of_events_keeps_the_session_invariants(
    connect: Connect, rng: random.Random, n_data: int, steps: int, close_at_end: bool
) -> None:
    pair = Pair(connect, n_data)
    started = 0
    for _ in range(steps):
        end = rng.choice(pair.ends())
        live = [tid for tid, out in end.sends.items() if out.queue and end.core.sending(tid)]
        op = rng.random()
        if op < 0.08 and started < 6:
            end.start(fragment_for(rng), started)
            started += 1
        elif op < 0.45 and live:
            end.write(rng, rng.choice(live), damaged=rng.random() < 0.1)
        elif op < 0.5 and live:  # a duplicate: the same chunk written again, on any connection
            tid = rng.choice(live)
            end.sends[tid].queue.insert(0, rng.randrange(end.sends[tid].header.chunks))
            end.write(rng, tid)
        elif op < 0.54 and live and (alive := [i for i, (up, _) in pair.links.items() if up.alive]):
            index = rng.choice(alive)
            for pipe in pair.links[index]:  # mostly in the middle of a chunk (landing in place?)
                # (A packet's last byte, left by an earlier partial delivery, has no middle.)
                if pipe.packets and len(pipe.packets[0]) > 1 and rng.random() < 0.8:
                    pair.deliver(pipe, rng.randrange(1, len(pipe.packets[0])))
            pair.lose(index)
        elif op < 0.56 and pair.unnoticed:
            pair.notice_one(rng)
        elif op < 0.57 and (waiting := [tid for tid, out in end.sends.items() if out.ended]):
            end.run(end.core.ack_overdue(rng.choice(waiting)))  # gave up waiting for the ack
        elif pending := [p for p in pair.pipes if p.packets]:
            pipe = rng.choice(pending)
            pair.deliver(pipe, rng.choice([None, rng.randrange(1, len(pipe.packets[0]) + 1)]))
    if close_at_end:
        for end in pair.ends():
            end.run(end.core.close("closing"))
    while pair.busy():  # then everything runs to its end, in a random order
        end = rng.choice(pair.ends())
        live = [tid for tid, out in end.sends.items() if out.queue and end.core.sending(tid)]
        if pair.unnoticed and rng.random() < 0.2:
            pair.notice_one(rng)
        elif live and rng.random() < 0.5:
            end.write(rng, rng.choice(live))
        elif pending := [p for p in pair.pipes if p.packets]:
            pair.deliver(rng.choice(pending))
    for end, peer in ((pair.client, pair.server), (pair.server, pair.client)):
        # Every send ended exactly once (run() refuses a second outcome), and none is left waiting.
        assert set(end.outcomes) == set(end.sends)
        assert not any(end.core.sending(tid) for tid in end.sends)
        for tid, outcome in end.outcomes.items():
            if isinstance(outcome, CompleteSend):
                assert tid in peer.delivered  # acknowledged only once delivered
            else:
                assert isinstance(outcome, FailSend) and (outcome.code is not None or close_at_end)
        # Delivered only what the peer sent, whole and verified, each at most once (run() refuses
        # a second delivery). Ids keep their sender's parity (start() checks; a header of the
        # wrong parity would have broken the session, which run() refuses).
        for tid, data in peer.delivered.items():
            assert data == end.sends[tid].fragment
