"""The fault injector's network seam: a TCP proxy between each learner and the syncer that reads the
frame headers of dilocod's wire protocol (protocol/SPEC.md §2, dilocod/wire/frames.py) as they pass,
so it can aim a fault at one frame and keep a ledger of what the syncer acknowledged.

Every learner dials its own listening port of the proxy (so each connection belongs to a known
learner); the proxy dials the syncer's current address (`set_upstream` moves it when the syncer is
restarted elsewhere). It runs an asyncio loop on its own thread; faults are armed from any thread and
fire on the next matching frame:

- flip: XOR one byte of a CHUNK's payload (after its 20-byte sub-header), so the receiver's
  checksum or decoder fails and it resets that transfer;
- truncate: forward the frame's header and half its body, then close both sides (the receiver sees
  a frame cut short by end of file);
- hold: forward half the frame, stop forwarding that connection and call a function (the chaos
  schedule kills the learner there: "mid-push", "mid-update");
- blackhole(seconds): a partition: nothing moves on the learner's connections, new ones are accepted
  but get no answer, then everything resumes where it stopped;
- sever(seconds): every connection of the learner is reset and new ones are refused for a while;
- relay faults (RelayFaults, `set_relay_faults`): a flaky relay rather than aimed faults: every
  frame not already aimed at has a chance of being cut halfway (its connection closed there), and
  every CHUNK a chance of having one byte of its payload flipped.

The ledger: per control connection the proxy decodes PUSH_HEADER bodies (learner to syncer) and
records each push the syncer answered with FRAGMENT_ACK (it has the whole push, verified) or
STREAM_RESET, and the same for updates in the other direction. That is what the learner was told,
seen from outside both daemons. Test code only: nothing in dilocod knows about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from dilocod.wire.errors import RemoteProtocolError
from dilocod.wire.frames import CHUNK_HEADER_BYTES, HEADER, HEADER_BYTES, MAGIC, FrameType
from dilocod.wire.limits import Limits
from dilocod.wire.messages import Hello, PushHeader, UpdateHeader, decode_body

LIMITS = Limits()
#: Control bodies the ledger decodes; nothing larger is ever kept.
DECODED = frozenset({FrameType.HELLO, FrameType.PUSH_HEADER, FrameType.UPDATE_HEADER})


class Way(Enum):
    UP = "learner to syncer"
    DOWN = "syncer to learner"


class Kind(Enum):
    FLIP = "flip"
    TRUNCATE = "truncate"
    HOLD = "hold"


@dataclass(frozen=True)
class RelayFaults:
    """Faults at random, frame by frame, in both directions on every connection of every learner."""

    #: Chance that a frame is cut halfway (as TRUNCATE: its connection closes there).
    cut_per_frame: float = 0.005
    #: Chance that a CHUNK has one byte of its payload flipped (as FLIP).
    corrupt_per_chunk: float = 0.05
    seed: int = 0


@dataclass
class Fault:
    """One armed fault: fires once, on the first frame that matches, then sets `done`."""

    kind: Kind
    way: Way
    frame_types: frozenset[FrameType]
    #: "control", "data", or None for either.
    connection: str | None = None
    #: For HOLD: called on the proxy's thread right after the first half of the frame went out.
    then: Callable[[], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    #: What it hit: frame type, stream id, body length, connection kind, time.
    hit: dict[str, Any] = field(default_factory=dict)

    def matches(self, way: Way, frame_type: int, length: int, connection: str | None) -> bool:
        if way is not self.way or frame_type not in self.frame_types:
            return False
        if self.connection is not None and connection != self.connection:
            return False
        # A flip needs a payload byte; a cut needs a body to cut in two.
        return length > CHUNK_HEADER_BYTES if self.kind is Kind.FLIP else length >= 2


@dataclass(frozen=True)
class Answer:
    """The syncer's (or the learner's) answer to one transfer, as it passed the proxy."""

    learner: str
    upstream: int  # the syncer's port: which syncer process the connection went to
    transfer: str  # "push" or "update"
    fragment: int
    round_or_version: int
    base_version: int
    acked: bool
    at: float  # time.monotonic()


class _Learner:
    """What the proxy holds for one learner: its listener, its connections, its armed faults."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = 0
        self.pipes: set[_Pipe] = set()
        self.faults: list[Fault] = []
        self.lock = threading.Lock()
        self.blackholed = False
        self.refusing_until = 0.0
        self.server: asyncio.Server | None = None

    def take_fault(self, way: Way, frame_type: int, length: int, connection: str | None) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.matches(way, frame_type, length, connection):
                    self.faults.remove(fault)
                    return fault
        return None


class _Half:
    """One direction of one connection: where the frame boundaries are, and a fault in progress."""

    def __init__(self, pipe: _Pipe, way: Way) -> None:
        self.pipe = pipe
        self.way = way
        self.head = bytearray()
        self.frame: tuple[int, int, int] | None = None  # type, stream id, body length
        self.pos = 0
        self.body: bytearray | None = None
        self.fault: Fault | None = None
        self.flip_at = -1
        self.cut_at = -1
        #: Not a dilocod frame stream (garbage, or TLS): relayed as is, nothing aimed at it.
        self.opaque = False

    def relay(self, data: bytes) -> tuple[bytearray, Fault | None]:
        """The bytes to forward, and a fault that must cut the connection right after them."""
        buf = bytearray(data)
        if self.opaque:
            return buf, None
        out = bytearray()
        i = 0
        while i < len(buf):
            if self.frame is None:
                take = buf[i : i + HEADER_BYTES - len(self.head)]
                self.head += take
                out += take
                i += len(take)
                if len(self.head) == HEADER_BYTES:
                    self._start_frame()
                    if self.opaque:
                        out += buf[i:]
                        return out, None
                continue
            length = self.frame[2]
            take = min(length - self.pos, len(buf) - i)
            segment = buf[i : i + take]
            if self.pos <= self.flip_at < self.pos + take:
                segment[self.flip_at - self.pos] ^= 0xFF
                self.flip_at = -1
                self._fired()
            if self.cut_at >= 0 and self.pos + take >= self.cut_at:
                out += segment[: self.cut_at - self.pos]
                fault, self.fault, self.cut_at = self.fault, None, -1
                self._fired(fault)
                return out, fault
            out += segment
            if self.body is not None:
                self.body += segment
            self.pos += take
            i += take
            if self.pos == length:
                self._end_frame()
        return out, None

    def _start_frame(self) -> None:
        magic, _, frame_type, _, _, stream_id, length = HEADER.unpack(self.head)
        self.head.clear()
        if magic != MAGIC:
            self.opaque = True
            return
        self.frame = (frame_type, stream_id, length)
        self.pos = 0
        self.body = bytearray() if frame_type in DECODED and length <= LIMITS.max_control_body_bytes else None
        self.pipe.proxy.frames[(self.pipe.learner.name, self.way, _frame_name(frame_type))] += 1
        fault = self.pipe.learner.take_fault(self.way, frame_type, length, self.pipe.kind)
        if fault is None:
            fault = self.pipe.proxy.random_fault(self.way, frame_type, length)
        if fault is not None:
            self.fault = fault
            fault.hit = {
                "frame": _frame_name(frame_type),
                "stream": stream_id,
                "length": length,
                "connection": self.pipe.kind,
                "way": self.way.name,
            }
            if fault.kind is Kind.FLIP:
                self.flip_at = CHUNK_HEADER_BYTES + random.randrange(length - CHUNK_HEADER_BYTES)
            else:
                self.cut_at = max(1, length // 2)
        if length == 0:
            self._end_frame()

    def _fired(self, fault: Fault | None = None) -> None:
        fault = fault or self.fault
        if fault is not None:
            fault.hit["at"] = time.monotonic()
            self.pipe.proxy.injected[fault.kind.value] += 1
            if fault.kind is Kind.FLIP:
                self.fault = None
                fault.done.set()

    def _end_frame(self) -> None:
        assert self.frame is not None
        frame_type, stream_id, _ = self.frame
        if self.body is not None:
            self.pipe.on_frame(self.way, frame_type, stream_id, bytes(self.body))
        elif frame_type in (FrameType.FRAGMENT_ACK, FrameType.STREAM_RESET):
            self.pipe.on_answer(self.way, stream_id, frame_type == FrameType.FRAGMENT_ACK)
        self.frame, self.body = None, None


def _frame_name(frame_type: int) -> str:
    try:
        return FrameType(frame_type).name
    except ValueError:
        return f"0x{frame_type:02x}"


class _Side(asyncio.Protocol):
    """One socket of a pipe (the learner's or the syncer's); everything goes to the pipe."""

    def __init__(self, pipe: _Pipe, way: Way) -> None:
        self.pipe = pipe
        self.way = way  # the direction of what this side receives
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.pipe.connected(self)

    def data_received(self, data: bytes) -> None:
        self.pipe.received(self.way, data)

    def eof_received(self) -> bool:
        self.pipe.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.pipe.close()

    # Flow control, as a network has it: a receiver that stops reading stops its sender.
    def pause_writing(self) -> None:
        self.pipe.throttle(self, paused=True)

    def resume_writing(self) -> None:
        self.pipe.throttle(self, paused=False)


class _Pipe:
    """One proxied connection: the learner's side, the syncer's side, a parser each way."""

    def __init__(self, proxy: FaultProxy, learner: _Learner) -> None:
        self.proxy = proxy
        self.learner = learner
        self.upstream_port = proxy.upstream[1]
        self.down = _Side(self, Way.UP)  # the learner's socket: receives what goes up
        self.up = _Side(self, Way.DOWN)  # the syncer's socket: receives what comes down
        self.halves = {Way.UP: _Half(self, Way.UP), Way.DOWN: _Half(self, Way.DOWN)}
        self.kind: str | None = None  # from the learner's HELLO
        self.pending: bytearray = bytearray()  # from the learner before the syncer answered the dial
        self.dialed = False
        self.held = False
        self.closed = False
        self.throttled: set[_Side] = set()
        #: This session's transfers whose answer the ledger waits for: id -> (kind, fragment, n, base).
        self.transfers: dict[int, tuple[str, int, int, int]] = {}

    def connected(self, side: _Side) -> None:
        if side is self.down:
            self.learner.pipes.add(self)
        if self.learner.blackholed:
            self.pause()  # a partition: accepted by the kernel, answered by nobody
        elif side is self.down:
            self.proxy.dial(self)
        else:
            self._flush_pending()

    def _flush_pending(self) -> None:
        if self.pending and self.up.transport is not None:
            data, self.pending = bytes(self.pending), bytearray()
            self.forward(Way.UP, data)

    def throttle(self, target: _Side, *, paused: bool) -> None:
        (self.throttled.add if paused else self.throttled.discard)(target)
        source = self.down if target is self.up else self.up
        if source.transport is None or source.transport.is_closing():
            return
        if paused:
            source.transport.pause_reading()
        elif not (self.learner.blackholed or self.held):
            source.transport.resume_reading()

    def received(self, way: Way, data: bytes) -> None:
        if self.closed or self.held:
            return
        if way is Way.UP and (self.up.transport is None):
            self.pending += data
            return
        self.forward(way, data)

    def forward(self, way: Way, data: bytes) -> None:
        out, fault = self.halves[way].relay(data)
        target = self.up if way is Way.UP else self.down
        if out and target.transport is not None and not target.transport.is_closing():
            target.transport.write(out)
        self.proxy.bytes[way] += len(out)
        if fault is None:
            return
        if fault.kind is Kind.TRUNCATE:
            # close() sends what is buffered, then FIN: the receiver reads half a frame, then EOF.
            if target.transport is not None:
                target.transport.close()
            source = self.down if way is Way.UP else self.up
            if source.transport is not None:
                source.transport.abort()
            self.close()
        else:  # HOLD: the rest of this connection never moves; the caller acts (kill -9)
            self.held = True
            self.pause()
            if fault.then is not None:
                fault.then()
        fault.done.set()

    def on_frame(self, way: Way, frame_type: int, stream_id: int, body: bytes) -> None:
        try:
            message = decode_body(FrameType(frame_type), body, LIMITS)
        except (RemoteProtocolError, ValueError):
            return
        if isinstance(message, Hello) and way is Way.UP:
            self.kind = message.kind
        elif isinstance(message, PushHeader) and way is Way.UP:
            self.transfers[stream_id] = ("push", message.fragment, message.round, message.base_version)
        elif isinstance(message, UpdateHeader) and way is Way.DOWN:
            self.transfers[stream_id] = ("update", message.fragment, message.version, message.version)

    def on_answer(self, way: Way, stream_id: int, acked: bool) -> None:
        known = self.transfers.get(stream_id)
        if known is None:
            return
        kind, fragment, number, base = known
        # A push is answered by the syncer (down), an update by the learner (up).
        if (kind == "push") != (way is Way.DOWN):
            return
        del self.transfers[stream_id]
        now = time.monotonic()
        learner, port = self.learner.name, self.upstream_port
        self.proxy.answers.append(Answer(learner, port, kind, fragment, number, base, acked, now))

    def pause(self) -> None:
        for side in (self.down, self.up):
            if side.transport is not None and not side.transport.is_closing():
                side.transport.pause_reading()

    def resume(self) -> None:
        if self.held or self.closed:
            return
        if not self.dialed:
            self.proxy.dial(self)
        self._flush_pending()
        for side in (self.down, self.up):
            target = self.up if side is self.down else self.down
            if target in self.throttled or side.transport is None or side.transport.is_closing():
                continue
            side.transport.resume_reading()

    def abort(self) -> None:
        for side in (self.down, self.up):
            if side.transport is not None:
                side.transport.abort()
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.learner.pipes.discard(self)
        for side in (self.down, self.up):
            if side.transport is not None and not side.transport.is_closing():
                side.transport.close()


class FaultProxy:
    """Start with `with FaultProxy(("127.0.0.1", syncer_port), ["a", "b"]) as proxy:`; each
    learner dials `proxy.port_of(name)`."""

    def __init__(self, upstream: tuple[str, int], learners: list[str]) -> None:
        self.upstream = upstream
        self.learners = {name: _Learner(name) for name in learners}
        self.injected: Counter[str] = Counter()
        self.bytes: Counter[Way] = Counter()
        self.answers: list[Answer] = []
        #: Frames seen, per (learner, direction, frame type name).
        self.frames: Counter[tuple[str, Way, str]] = Counter()
        self._relay: RelayFaults | None = None
        self._relay_rng = random.Random(0)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._call(self._listen_all())
        return self

    def __exit__(self, *_: object) -> None:
        with contextlib.suppress(Exception):
            self._call(self._close_all())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self._loop.close()

    def port_of(self, learner: str) -> int:
        return self.learners[learner].port

    def set_upstream(self, host: str, port: int) -> None:
        """Where new connections go from now on (the syncer restarted on another port)."""
        self._loop.call_soon_threadsafe(setattr, self, "upstream", (host, port))

    # ------------------------------------------------------------------ faults

    def arm(self, learner: str, fault: Fault) -> Fault:
        with self.learners[learner].lock:
            self.learners[learner].faults.append(fault)
        return fault

    def disarm(self, learner: str, fault: Fault) -> bool:
        """Take back a fault that has not fired; False if it already did."""
        with self.learners[learner].lock:
            if fault in self.learners[learner].faults:
                self.learners[learner].faults.remove(fault)
                return True
        return False

    def set_relay_faults(self, faults: RelayFaults | None) -> None:
        """Random faults on every frame from now on (None: none). Returns once they are in force."""
        self._call(self._set_relay(faults))

    def random_fault(self, way: Way, frame_type: int, length: int) -> Fault | None:
        """On the proxy's loop, as a frame starts: the relay fault that hits it, if any."""
        relay = self._relay
        if relay is None:
            return None
        chunk = frame_type == FrameType.CHUNK and length > CHUNK_HEADER_BYTES
        if chunk and self._relay_rng.random() < relay.corrupt_per_chunk:
            return Fault(Kind.FLIP, way, frozenset({FrameType(frame_type)}))
        # A cut lands inside the body: frames of fewer than 2 bytes have no middle.
        if length >= 2 and self._relay_rng.random() < relay.cut_per_frame:
            return Fault(Kind.TRUNCATE, way, frozenset())
        return None

    def blackhole(self, learner: str, seconds: float) -> None:
        """Nothing moves to or from this learner for `seconds` (returns at once)."""
        self._loop.call_soon_threadsafe(self._blackhole, self.learners[learner], seconds)

    def sever(self, learner: str, seconds: float) -> None:
        """Reset every connection of this learner now and refuse new ones for `seconds`."""
        self._loop.call_soon_threadsafe(self._sever, self.learners[learner], seconds)

    def connections(self, learner: str) -> int:
        """How many connections of this learner the proxy carries now."""
        return self._call(self._count(self.learners[learner]))

    # ------------------------------------------------------------------ loop side

    def _call(self, work: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(work, self._loop)
        return future.result(timeout=30.0)

    async def _set_relay(self, faults: RelayFaults | None) -> None:
        self._relay = faults
        if faults is not None:
            self._relay_rng = random.Random(faults.seed)

    async def _count(self, learner: _Learner) -> int:
        return len(learner.pipes)

    async def _listen_all(self) -> None:
        for learner in self.learners.values():
            learner.server = await self._loop.create_server(
                lambda learner=learner: self._accept(learner), "127.0.0.1", 0
            )
            learner.port = learner.server.sockets[0].getsockname()[1]

    def _accept(self, learner: _Learner) -> asyncio.Protocol:
        if time.monotonic() < learner.refusing_until:
            return _RefusingSide()
        return _Pipe(self, learner).down

    def dial(self, pipe: _Pipe) -> None:
        host, port = self.upstream
        pipe.upstream_port = port
        pipe.dialed = True

        async def connect() -> None:
            try:
                await self._loop.create_connection(lambda: pipe.up, host, port)
            except OSError:
                pipe.abort()  # the syncer is down: the learner sees its dial fail

        self._loop.create_task(connect())

    def _blackhole(self, learner: _Learner, seconds: float) -> None:
        self.injected["blackhole"] += 1
        learner.blackholed = True
        for pipe in list(learner.pipes):
            pipe.pause()

        def lift() -> None:
            learner.blackholed = False
            for pipe in list(learner.pipes):
                pipe.resume()

        self._loop.call_later(seconds, lift)

    def _sever(self, learner: _Learner, seconds: float) -> None:
        self.injected["sever"] += 1
        learner.refusing_until = time.monotonic() + seconds
        for pipe in list(learner.pipes):
            pipe.abort()

    async def _close_all(self) -> None:
        for learner in self.learners.values():
            if learner.server is not None:
                learner.server.close()
            for pipe in list(learner.pipes):
                pipe.abort()


class _RefusingSide(asyncio.Protocol):
    """An accepted connection of a severed learner: reset at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()  # type: ignore[attr-defined]
