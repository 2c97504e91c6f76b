"""The learner's side of the network, on its own event loop: one session with the syncer at a time,
JOIN and PLAN, healing, requests in, pushes out, merged fragments in, step reports out, and
reconnection with capped exponential backoff and jitter when the session is lost.

Outer gradients are computed here, never on the training thread: δ = anchor - θ (float32) from a
snapshot the training thread took at a step boundary, in a worker thread, with the chunk checksums
computed in the same pass over the bytes (the session then hashes nothing). δ is written over θ in
the snapshot's own buffer, and the anchor is the update's buffer the training side applied: no
fragment is copied here. Updates are received straight into buffers of the bridge
(Bridge.update_buffer, the session's allocator); each buffer goes back to the bridge once this
side is done with it (Bridge.snapshot_done when a push no longer needs its snapshot). An update at
bf16 (the syncer's --update-precision) is received into a half-size buffer of the bridge and
decoded in the push worker thread into a full-size one (precision.recast: the anchor is exactly the
upcast of what was received), which is posted as an fp32 update is; the bf16 buffer goes back.
An update whose manifest is not the plan's layout at fp32 or bf16 is refused and logged. Failures that no
reconnect can fix (the syncer's model is not ours, wrong credentials, no common protocol version,
another live learner under our id) are posted to the training thread as fatal.

An update a lost session cut short is kept with the chunks it holds (a _Partial, at most one per
fragment) once the old session's decodes are done with its buffer, and named in the next JOIN
(JOIN.partial): the same syncer incarnation sends that version again without those chunks
(UpdateHeader.skip), into the same buffer. A partial whose version the plan has moved past, or of
another incarnation, is let go. A push a lost session cut short is kept the same way (a _CutPush:
its outer gradient and checksums, at most one per fragment): when the syncer asks for that round
again, naming the chunks it holds (FragmentRequest.have), the same bytes go again without them
(PushHeader.skip); when it asks for the fragment at another round, or another incarnation plans,
the push is posted to the training side as lost, as one lost before it was sent is.

--streams auto and --codec auto: the advice `dilocod bench` saved for this syncer when there is
some (LinkConfig.advice); otherwise the stream count is chosen for every session from the RTT the
kernel measured on its control connection (enough streams for AUTO_RATE_GBPS), and the codec by a
tuning.CodecTuner from codec figures measured (in the push worker thread) on the first outer
gradient of at least one step and MIN_PERIOD_BYTES, and from the throughput pushes achieve. Every
choice is logged with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import secrets
import ssl
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import structlog

from dilocod.config import Address, LearnerConfig
from dilocod.learner.bridge import Adopt, Bridge, Buffer, LostPush, Snapshot
from dilocod.learner.delta import decode_update, encode_lossy, fragment_delta_, zero_residual
from dilocod.learner.plancheck import UpdateRefused, check_plan, check_update
from dilocod.model.compare import PlanMismatch
from dilocod.ops.looplag import LoopLag
from dilocod.transport.endpoints import connect
from dilocod.transport.errors import HandshakeFailed, SessionClosed, TransferFailed
from dilocod.transport.options import TransportOptions
from dilocod.transport.session import FragmentReceived, Session, allocate_bytearray
from dilocod.tuning.advice import Advice
from dilocod.tuning.codecs import CodecChoice, CodecFigure, measure_codecs, spread_sample
from dilocod.tuning.streams import AUTO_RATE_GBPS, auto_streams, bdp_warning, read_tcp_settings
from dilocod.tuning.tuner import CodecTuner, PushMeter
from dilocod.wire.choices import AUTO, UPDATE_PRECISIONS
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.layouts import push_layout
from dilocod.wire.limits import DEFAULT_LIMITS
from dilocod.wire.manifest import ModelEntry, TensorEntry, fragment_manifest
from dilocod.wire.messages import (
    MAX_HAVE_BYTES,
    FragmentRequest,
    Join,
    NothingToPush,
    PartialUpdate,
    Plan,
    PushHeader,
    StepReport,
    UpdateHeader,
    chunk_bitmap,
    fits_chunks,
    held_current,
)
from dilocod.wire.stream import CutShort, Resumed, StreamHeader

if TYPE_CHECKING:
    from torch import Tensor

log = structlog.get_logger("dilocod.learner")
#: The defaults of the learner's settings, declared once in dilocod.config.daemons.
_DEFAULTS = LearnerConfig()

#: Codes after which reconnecting cannot help: the configuration must change.
FATAL_CODES = {
    ErrorCode.MODEL_MISMATCH,
    ErrorCode.LEARNER_ID_IN_USE,
    ErrorCode.AUTH_FAILED,
    ErrorCode.AUTH_REQUIRED,
    ErrorCode.UNSUPPORTED_VERSION,
}


#: --codec auto: push periods that carried less say more about latency than about the link rate,
#: and are not counted; a model whose fragments are smaller stays uncompressed, and its codecs are
#: not even timed.
MIN_PERIOD_BYTES = 8 << 20
#: --codec auto: the codecs are timed on this much of the first outer gradient, each for at least
#: CODEC_MIN_SECONDS: about 0.2 s of the push worker thread, once, which delays that one push's
#: successor at most.
CODEC_SAMPLE_BYTES = 8 << 20
CODEC_MIN_SECONDS = 0.05
#: Byte-plane shuffle of compressed pushes (float32 items; it still groups bytes of narrower ones).
PUSH_SHUFFLE = 4
#: A push the syncer found damaged on the way (TransferFailed.damaged) is sent again, this many
#: times in all; a refusal for any other reason is final.
PUSH_ATTEMPTS = 3


class FatalLinkError(Exception):
    """The learner cannot work with this syncer as configured."""


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """The syncer link's part of the learner's configuration (LinkConfig.of) and what it
    authenticates with; the defaults are LearnerConfig's."""

    host: str
    port: int
    learner_id: str
    secret: bytes | None
    #: Mutual TLS around every connection to the syncer, or None.
    tls: ssl.SSLContext | None = None
    #: The files tls was made from (certificate, key, CA), for a network process to make its own.
    tls_files: tuple[Path, Path, Path] | None = None
    #: Data connections, or "auto" (the advice's count, else chosen per session from its RTT).
    streams: int | Literal["auto"] = _DEFAULTS.streams  # type: ignore[assignment]
    #: Codec of pushes: none, lz4, zstd, or "auto" (the advice's, else tuned while pushing).
    codec: str = _DEFAULTS.codec
    #: What `dilocod bench` saved for this syncer (tuning.load_advice): used by the "auto" values.
    advice: Advice | None = None
    #: Wire precision of outer gradients (dilocod.model.precision): fp32, bf16, int8 or int4.
    precision: str = _DEFAULTS.precision
    chunk_bytes: int = _DEFAULTS.chunk
    join_timeout_s: float = _DEFAULTS.join_timeout_s
    backoff_min_s: float = 0.5
    backoff_max_s: float = 30.0
    #: This learner's instance id (JOIN's instance), kept in its state directory across restarts;
    #: "" draws one for this process (a learner without a state directory).
    instance: str = ""

    @classmethod
    def of(
        cls,
        config: LearnerConfig,
        *,
        secret: bytes | None,
        tls: ssl.SSLContext | None = None,
        tls_files: tuple[Path, Path, Path] | None = None,
        advice: Advice | None = None,
    ) -> LinkConfig:
        """The learner's configuration as its link takes it, with the credentials made from it
        and the advice saved for its syncer. `syncer` and `id` must be set (the command checks)."""
        if config.syncer is None or config.id is None:
            raise ValueError("a learner's link needs its syncer and id")
        return cls(
            host=config.syncer.host,
            port=config.syncer.port,
            learner_id=config.id,
            secret=secret,
            tls=tls,
            tls_files=tls_files,
            streams=config.streams,  # type: ignore[arg-type]
            codec=config.codec,
            advice=advice,
            precision=config.precision,
            chunk_bytes=config.chunk,
            join_timeout_s=config.join_timeout_s,
        )


@dataclass(slots=True)
class _Partial:
    """An update a lost session cut short: its header, its buffer (the bridge's), and the chunks
    it holds with their checksums. `session` is the one that received it until that session's
    decodes are over (Link._settle_partials); None once nothing else writes into the buffer."""

    header: UpdateHeader
    buffer: memoryview
    held: dict[int, int]
    session: Session | None


@dataclass(slots=True)
class _CutPush:
    """A push a lost session cut short: the snapshot whose buffers hold its outer gradient, and
    the header, bytes and chunk checksums it was sent with."""

    snapshot: Snapshot
    header: PushHeader
    data: Buffer
    checksums: list[int]


@dataclass(slots=True)
class LinkStats:
    connected: bool = False
    sessions: int = 0
    #: Sessions that got as far as PLAN (joined), of `sessions` opened.
    joins: int = 0
    pushes_sent: int = 0
    pushes_refused: int = 0
    #: Pushes sent again after the syncer found them damaged on the way.
    pushes_resent: int = 0
    #: Pushes whose session ended under them (their steps go into the fragment's next push).
    pushes_lost: int = 0
    updates_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_push_to_update_s: float | None = None
    incarnation: str = ""
    #: Data connections of the current session, and the codec pushes use now.
    streams: int = 0
    codec: str = ""
    #: How late this link's event loop wakes (ms, p50/p99/max over the last minute; ops.looplag).
    loop_lag_ms: dict[str, float] = field(default_factory=dict)


def compute_push(
    snapshot: Snapshot,
    manifest: tuple[TensorEntry, ...],
    chunk_bytes: int,
    precision: str = "fp32",
    residual: list[Tensor] | None = None,
    *,
    in_place: bool = False,
) -> tuple[tuple[TensorEntry, ...], Buffer, list[int]]:
    """δ = anchor - θ (float32), laid out at the wire precision (lossy ones with error feedback
    through residual), and its chunk checksums. Runs in the push worker thread. in_place: δ is
    written over θ in the snapshot's buffer (fp32: that buffer is what goes on the wire)."""
    if snapshot.ready is not None:
        snapshot.ready.wait()  # the push worker's thread: waiting here costs training nothing
    out: Buffer = snapshot.theta if in_place else bytearray(len(snapshot.theta))
    if snapshot.delta:
        # Computed where the anchor lives (a GPU's --anchors device): theta holds δ already.
        if out is not snapshot.theta:
            out[:] = snapshot.theta
    else:
        # The whole fragment at once (padding included: zero in both, zero in δ), written straight
        # into the bytes that go on the wire; torch only for a lossy precision (see learner.delta).
        fragment_delta_(snapshot.anchor, snapshot.theta, out)
    if precision != "fp32":
        manifest, out = encode_lossy(out, manifest, precision, residual)
    return manifest, out, chunk_checksums(out, chunk_bytes)


def codec_figures(data: Buffer, chunk_bytes: int) -> list[CodecFigure]:
    """The codecs timed on a spread of whole chunks of an outer gradient, as pushes compress them.
    Runs in the push worker thread."""
    sample = spread_sample(data, chunk_bytes, CODEC_SAMPLE_BYTES)
    return measure_codecs(
        sample, chunk_bytes=chunk_bytes, shuffle_item_size=PUSH_SHUFFLE, min_seconds=CODEC_MIN_SECONDS
    )


class Link:
    """Run with `await link.run(stop)` on the network thread's loop."""

    def __init__(self, config: LinkConfig, model: tuple[ModelEntry, ...], bridge: Bridge) -> None:
        self.config = config
        self.model = model
        self.bridge = bridge
        self.stats = LinkStats()
        self.incarnation = ""
        #: This learner's own id for the syncer (JOIN's instance), the same for all its sessions
        #: (and, with a state directory, its restarts): a reconnect or a restart takes its old
        #: session's place, another learner under its id is refused.
        self.instance = config.instance or secrets.token_hex(16)
        self.session: Session | None = None
        self._manifests: list[tuple[TensorEntry, ...]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dilocod-push")
        self._pushes: set[asyncio.Task[None]] = set()
        #: bf16 updates being decoded (in the push worker); one that finishes under another syncer
        #: incarnation is dropped, as post_plan drops that incarnation's updates.
        self._decodes: set[asyncio.Task[None]] = set()
        self._pushed_at: dict[int, float] = {}
        self._healing: set[int] = set()
        #: The version of each fragment posted to the training side under self.incarnation (which
        #: it applies or holds: Bridge.post_plan keeps updates of the same incarnation). A JOIN
        #: back to that incarnation names them, and the syncer sends only the fragments that moved.
        self._held: dict[int, int] = {}
        #: Updates of self.incarnation a lost session cut short, by fragment (see the module
        #: docstring); offered in a JOIN only once settled.
        self._partials: dict[int, _Partial] = {}
        #: Pushes of self.incarnation a lost session cut short, by fragment (module docstring).
        self._cut_pushes: dict[int, _CutPush] = {}
        #: Error-feedback residuals of the lossy precisions, per fragment (push worker only).
        self._residuals: dict[int, list[Tensor]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._options = TransportOptions(chunk_bytes=config.chunk_bytes)
        self._meter = PushMeter(min_bytes=MIN_PERIOD_BYTES)
        self._measuring = False
        #: Snapshots (by id) whose outer gradients the push worker is computing or has queued
        #: (each written over its θ).
        self._computing: set[int] = set()
        self._streams, self._codec, self._tuner = self._resolve_auto()
        self.stats.codec = self._codec

    @property
    def _syncer(self) -> str:
        """HOST:PORT this link dials, for every log line about the syncer."""
        return str(Address(self.config.host, self.config.port))

    def _resolve_auto(self) -> tuple[int | None, str, CodecTuner | None]:
        """Explicit values win; "auto" takes the saved advice, else is left to measurements:
        streams None (chosen per session), codec "none" with a CodecTuner."""
        config, advice = self.config, self.config.advice
        source = (
            f"dilocod bench against {advice.target or 'any syncer'} at {advice.measured_at}" if advice else ""
        )
        streams: int | None = None
        if config.streams != AUTO:
            streams = int(config.streams)
        elif advice is not None:
            streams = advice.streams
            log.info(
                "streams chosen",
                streams=streams,
                source="advice",
                reason=f"{source}: {advice.rate_gbps:.2f} Gbit/s at {advice.rtt_ms:.3g} ms RTT",
            )
        if config.codec != AUTO:
            return streams, config.codec, None
        if advice is not None:
            log.info(
                "codec chosen",
                codec=advice.codec,
                source="advice",
                reason=f"{source}, for a {advice.rate_gbps:.2f} Gbit/s link",
            )
            return streams, advice.codec, None
        return streams, "none", CodecTuner(threads=self._options.codec_threads)

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self.bridge.attach(self._loop, self._on_outbox)
        lag = asyncio.ensure_future(LoopLag().watch(partial(setattr, self.stats, "loop_lag_ms")))
        attempt = 0
        try:
            while not stop.is_set():
                joins = self.stats.joins
                try:
                    await self._one_session(stop)
                    attempt = 0
                except FatalLinkError as exc:
                    log.error("cannot work with this syncer", syncer=self._syncer, reason=str(exc))
                    self.bridge.post_fatal(str(exc))
                    return
                except (OSError, ConnectionError, TimeoutError) as exc:
                    if self.stats.joins > joins:
                        # A session that joined and then broke: a new outage, retried from the
                        # shortest delay (not from where the retries of earlier outages left off).
                        attempt = 0
                    log.warning(
                        "syncer unreachable",
                        syncer=self._syncer,
                        error=str(exc) or type(exc).__name__,
                        attempt=attempt,
                    )
                if stop.is_set():
                    break
                # Capped exponential backoff with jitter, so a fleet of learners does not reconnect
                # in lockstep after the syncer restarts.
                delay = min(self.config.backoff_max_s, self.config.backoff_min_s * 2**attempt)
                attempt = min(attempt + 1, 16)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay * random.uniform(0.5, 1.0)):
                        await stop.wait()
        finally:
            lag.cancel()
            for task in [*self._pushes, *self._decodes]:
                task.cancel()
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._drop_partials(lambda _: True)
            for cut in self._cut_pushes.values():
                self.bridge.snapshot_done(cut.snapshot)
            self._cut_pushes.clear()

    async def _one_session(self, stop: asyncio.Event) -> None:
        auto = None
        if self._streams is None:
            auto = partial(self._auto_streams, asyncio.get_running_loop().time())
        try:
            session = await connect(
                self.config.host,
                self.config.port,
                peer_id=self.config.learner_id,
                role="learner",
                secret=self.config.secret,
                ssl=self.config.tls,
                streams=self._streams or 0,
                options=self._options,
                data_streams=auto,
                allocate=self._update_buffer,
            )
        except HandshakeFailed as exc:
            if exc.code in FATAL_CODES:
                raise FatalLinkError(f"the syncer refused this learner: {exc}") from None
            raise
        session.on_inbound_failed = partial(self._update_failed, session)
        self.session = session
        self.stats.sessions += 1
        self.stats.streams = len(session.data)
        try:
            join = Join(
                self.model, self.incarnation, self.instance, self._held_versions(), self._partial_updates()
            )
            await session.send(join)
            try:
                async with asyncio.timeout(self.config.join_timeout_s):
                    first = await session.recv()
            except SessionClosed as exc:
                if exc.code == ErrorCode.LEARNER_ID_IN_USE:
                    raise FatalLinkError(self._id_in_use(exc.detail)) from None
                if exc.code in FATAL_CODES:
                    raise FatalLinkError(str(exc)) from None
                raise
            if not isinstance(first, Plan):
                raise ConnectionError(f"the syncer answered JOIN with {type(first).__name__}, not PLAN")
            try:
                check_plan(first, self.model)
            except PlanMismatch as exc:
                raise FatalLinkError(str(exc)) from None
            self._adopt_plan(first, join)
            self.stats.connected = True
            self.stats.joins += 1
            log.info("joined", syncer=self._syncer, incarnation=first.incarnation)
            closed = asyncio.ensure_future(stop.wait())
            try:
                while not stop.is_set():
                    receive = asyncio.ensure_future(session.recv())
                    done, _ = await asyncio.wait({receive, closed}, return_when=asyncio.FIRST_COMPLETED)
                    if receive not in done:
                        receive.cancel()
                        break
                    self._on_item(receive.result())
            finally:
                closed.cancel()
        finally:
            self.stats.connected = False
            self.session = None
            await session.close("learner leaving" if stop.is_set() else "learner reconnecting")
            await self._drop_unread(session)
            await self._settle_partials(session)

    async def _settle_partials(self, session: Session) -> None:
        """The closed session's cut-short updates may be offered once no decode of that session
        writes into their buffers any more; if its decodes do not end soon, they are let go."""
        try:
            async with asyncio.timeout(1.0):
                await session.decodes_idle.wait()
        except TimeoutError:
            self._drop_partials(lambda kept: kept.session is session)
            return
        for kept in self._partials.values():
            if kept.session is session:
                kept.session = None

    def _partial_updates(self) -> tuple[PartialUpdate, ...]:
        """JOIN.partial: the settled cut-short updates of self.incarnation."""
        offered = (
            PartialUpdate(fragment, kept.header.version, chunk_bitmap(kept.held, kept.header.chunks))
            for fragment, kept in sorted(self._partials.items())
            if kept.session is None
        )
        return tuple(update for update in offered if len(update.have) <= MAX_HAVE_BYTES)

    def _drop_partials(self, which: Callable[[_Partial], bool]) -> None:
        for fragment in [f for f, kept in self._partials.items() if which(kept)]:
            self.bridge.update_failed(self._partials.pop(fragment).buffer)

    async def _drop_unread(self, session: Session) -> None:
        """Updates the closed session received and nobody read: their buffers go back."""
        with contextlib.suppress(SessionClosed, TimeoutError):
            async with asyncio.timeout(1.0):  # closed: recv hands out what is queued, then raises
                while True:
                    item = await session.recv()
                    if isinstance(item, FragmentReceived) and isinstance(item.header, UpdateHeader):
                        self.bridge.release(item.buffer)

    def _update_buffer(self, header: StreamHeader) -> memoryview | Resumed:
        """The session's allocator: an update lands in a buffer of the bridge, which the training
        side applies and keeps as the fragment's anchor (no copy on the way); one that skips
        chunks, in the buffer of the cut-short transfer that holds them."""
        if not isinstance(header, UpdateHeader):
            return allocate_bytearray(header)  # a syncer sends updates only; read, then ignored
        kept = self._partials.pop(header.fragment, None)  # offered once; a newer version replaces it
        if header.skip:
            if (
                kept is not None
                and kept.session is None
                and (kept.header.version, kept.header.raw_bytes, kept.header.chunk_bytes)
                == (header.version, header.raw_bytes, header.chunk_bytes)
            ):
                return Resumed(kept.buffer, kept.held)
            if kept is not None:
                self.bridge.update_failed(kept.buffer)
            raise RemoteProtocolError(
                ErrorCode.UNKNOWN_TRANSFER,
                f"an update of fragment {header.fragment} version {header.version} skips chunks "
                "this learner does not hold",
            )
        if kept is not None:
            self.bridge.update_failed(kept.buffer)
        # The plan may not be read yet (it is queued ahead of this update): its layout is checked
        # when the update is read (_on_item); here only that it is at a precision we decode (the
        # wire checked that its dtypes are that precision's).
        if header.precision not in UPDATE_PRECISIONS:
            message = (
                f"an update of fragment {header.fragment} at {header.precision}: updates travel at "
                f"{' or '.join(UPDATE_PRECISIONS)}"
            )
            log.error("update refused", syncer=self._syncer, fragment=header.fragment, reason=message)
            raise RemoteProtocolError(ErrorCode.BAD_MANIFEST, message)
        return self.bridge.update_buffer(header.raw_bytes)

    def _update_failed(self, session: Session, cut: CutShort) -> None:
        """An update transfer that failed: kept for a resumed transfer when its session was lost
        holding some of it (JOIN.partial), else its buffer is let go."""
        header = cut.header
        if not isinstance(header, UpdateHeader):
            return
        if session.closed.is_set() and cut.held and self.incarnation:
            older = self._partials.get(header.fragment)
            if older is not None:
                self.bridge.update_failed(older.buffer)
            self._partials[header.fragment] = _Partial(header, cut.buffer, cut.held, session)
            return
        self.bridge.update_failed(cut.buffer)

    def _id_in_use(self, detail: str | None) -> str:
        """The syncer refused this learner's id (LEARNER_ID_IN_USE): what the operator must change,
        and the syncer's word on when a retry can succeed if the other learner is in fact gone."""
        message = (
            f"another learner with id {self.config.learner_id!r} is connected to the syncer at "
            f"{self._syncer}; give each learner its own --id"
        )
        return f"{message} (syncer: {detail})" if detail else message

    def _auto_streams(self, dialled_s: float, session: Session) -> int:
        """--streams auto without advice (tuning.auto_streams): enough data connections to keep
        AUTO_RATE_GBPS x RTT in flight with this host's TCP windows and some headroom, the RTT as
        the kernel measured it on the control connection. Where the kernel does not say, the time
        the control connection took to open stands in: a few round trips, so more streams than
        needed, the cheaper mistake."""
        rtt_s, measured_by = session.round_trip_s(), "kernel"
        if rtt_s is None:
            rtt_s, measured_by = asyncio.get_running_loop().time() - dialled_s, "connect time"
        settings = read_tcp_settings()
        choice = auto_streams(rtt_s, settings)
        warning = bdp_warning(AUTO_RATE_GBPS, rtt_s, settings, choice.streams)
        (log.warning if warning else log.info)(
            "streams chosen",
            streams=choice.streams,
            source="rtt",
            rtt_ms=round(rtt_s * 1e3, 3),
            rtt_from=measured_by,
            per_stream_gbps=round(choice.per_stream_gbps, 3),
            reason=choice.reason,
            sysctl=warning,
        )
        return choice.streams

    def _held_versions(self) -> tuple[int | None, ...]:
        """JOIN.held: per fragment of this incarnation's plan, the version posted, None if none."""
        if not self.incarnation or not self._held:
            return ()
        return tuple(self._held.get(p) for p in range(len(self._manifests)))

    def _adopt_plan(self, plan: Plan, join: Join) -> None:
        shapes = {e.name: e.shape for e in plan.model}
        layouts = [fragment_manifest(pieces, shapes) for pieces in plan.fragments]
        self._manifests = [manifest for manifest, _ in layouts]
        self.bridge.expect_anchors([size for _, size in layouts])
        same = plan.incarnation == self.incarnation
        if not same:
            if self.incarnation:
                log.info("new syncer incarnation: healing", old=self.incarnation, new=plan.incarnation)
            self._held.clear()
            self._residuals.clear()  # another syncer's plan may cut the model differently
            for fragment in list(self._cut_pushes):
                self._lose(self._cut_pushes.pop(fragment))
        # A cut-short update the syncer will not resume: another incarnation's, one not offered
        # in this JOIN, or one whose fragment has moved on (that version is no longer sent).
        offered = {u.fragment: u.version for u in join.partial}
        self._drop_partials(
            lambda kept: (
                not same
                or offered.get(kept.header.fragment) != kept.header.version
                or kept.header.fragment >= len(plan.versions)
                or plan.versions[kept.header.fragment] != kept.header.version
            )
        )
        self.incarnation = self.stats.incarnation = plan.incarnation
        self.bridge.post_plan(plan)
        # Back on the same incarnation, a fragment held at any version keeps its anchor: one that
        # moved arrives as a merge does (the syncer skips the ones still current: held_current).
        # Only the fragments not held are healed, that is, overwritten.
        self._healing = set(range(len(plan.fragments))) - set(self._held)
        skipped = held_current(join, plan)
        if same:
            log.info(
                "rejoined",
                syncer=self._syncer,
                held=len(self._held),
                current=len(skipped),
                to_receive=len(plan.fragments) - len(skipped),
                resuming=len(self._partials),
            )

    def _on_item(self, item: object) -> None:
        if isinstance(item, FragmentRequest):
            cut = self._cut_pushes.pop(item.fragment, None)
            if cut is not None:
                if cut.header.round == item.round and self.session is not None:
                    self._start(self._resume_push(self.session, cut, item.have))
                    return  # the training side took its snapshot for this round already
                self._lose(cut)
            self.bridge.post_request(item)
        elif isinstance(item, FragmentReceived) and isinstance(item.header, UpdateHeader):
            header = item.header
            buffer = item.buffer  # the bridge's (update_buffer): the training side's from here on
            try:
                if header.fragment >= len(self._manifests):
                    raise UpdateRefused(
                        f"an update of fragment {header.fragment}: the plan has {len(self._manifests)}"
                    )
                layout = self._manifests[header.fragment]
                precision = header.precision
                check_update(header.fragment, layout, precision, header.manifest, header.raw_bytes)
            except UpdateRefused as exc:
                log.error("update refused", syncer=self._syncer, fragment=header.fragment, reason=str(exc))
                self.bridge.release(buffer)
                return
            heal = header.fragment in self._healing
            self._healing.discard(header.fragment)
            self.stats.updates_received += 1
            self.stats.bytes_received += header.raw_bytes
            pushed = self._pushed_at.pop(header.fragment, None)
            if pushed is not None and self._loop is not None:
                self.stats.last_push_to_update_s = self._loop.time() - pushed
            adopt = Adopt(header.fragment, header.version, buffer, heal, self.incarnation)
            if precision == "fp32":
                self._post_update(adopt)
                return
            task = asyncio.ensure_future(self._decode(adopt, layout, precision))
            self._decodes.add(task)
            task.add_done_callback(self._decodes.discard)

    async def _decode(self, adopt: Adopt, layout: tuple[TensorEntry, ...], precision: str) -> None:
        """An update received at `precision` decoded into a float32 buffer of the bridge in the
        push worker thread (one at a time, in arrival order: never on this loop), then posted as
        an fp32 update is; the received buffer goes back to the bridge."""
        received = adopt.buffer
        shapes = [(entry.name, entry.shape) for entry in layout]
        manifest = push_layout(shapes, precision)[0]
        target = self.bridge.update_buffer(push_layout(shapes, "fp32")[1])
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._executor, decode_update, received, manifest, target, layout
            )
        except BaseException:
            # Cancelled (or a bug) while the worker may still read one and write the other: neither
            # buffer is handed out again.
            self.bridge.update_failed(received)
            self.bridge.update_failed(target)
            raise
        self.bridge.release(received)
        if adopt.incarnation != self.incarnation:  # another syncer's plan came meanwhile
            self.bridge.release(target)
            return
        self._post_update(Adopt(adopt.fragment, adopt.version, target, adopt.heal, adopt.incarnation))

    def _post_update(self, adopt: Adopt) -> None:
        """To the training side, which applies it (or a newer one of the fragment) in time."""
        held = self._held.get(adopt.fragment)
        if held is None or adopt.heal or adopt.version > held:  # what newer_update keeps
            self._held[adopt.fragment] = adopt.version
        self.bridge.post_update(adopt)

    # ------------------------------------------------------------------ outbox

    def _on_outbox(self) -> None:
        snapshots, steps = self.bridge.drain()
        session = self.session
        if session is None or not session.is_open:
            # The syncer is away: its rounds go on without these (the training side counts their
            # steps again); step reports are moot.
            for snapshot in snapshots:
                if not snapshot.empty:
                    self.bridge.post_lost(LostPush(snapshot.fragment, snapshot.round))
                self.bridge.snapshot_done(snapshot)
            return
        for item in steps:
            session.control.send(StepReport.within(item.step, item.tokens, item.step_time_s))
        for snapshot in snapshots:
            if snapshot.empty:
                # No step since the fragment's last push: a small answer, not a push of zeros.
                session.control.send(
                    NothingToPush(
                        snapshot.fragment,
                        snapshot.round,
                        snapshot.base_version,
                        min(snapshot.step or 0, DEFAULT_LIMITS.max_reported_steps),
                    )
                )
                self.bridge.snapshot_done(snapshot)
                continue
            self._start(self._push(session, snapshot))

    def _start(self, push: Coroutine[None, None, None]) -> None:
        task = asyncio.ensure_future(push)
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)

    async def _push(self, session: Session, snapshot: Snapshot) -> None:
        """Compute the snapshot's outer gradient and send it. The snapshot's buffers go back to the
        bridge once the push no longer reads them: sent, refused, failed or not made; not when
        cancelled while the worker computes (it may still write into θ: that buffer is never
        handed out again), nor when it is kept, cut short, for the syncer to ask for again."""
        try:
            kept = await self._push_one(session, snapshot)
        except asyncio.CancelledError:
            if id(snapshot) in self._computing:
                raise
            self.bridge.snapshot_done(snapshot)
            raise
        except BaseException:
            self.bridge.snapshot_done(snapshot)
            raise
        if not kept:
            self.bridge.snapshot_done(snapshot)

    async def _resume_push(self, session: Session, cut: _CutPush, have: bytes) -> None:
        """The syncer asked again for a round whose push a lost session cut short: the same bytes,
        without the chunks it says it holds (where `have` fits them), else whole."""
        skip = have if have and fits_chunks(have, cut.header.chunks) else b""
        header = dataclasses.replace(cut.header, skip=skip)
        log.info("resuming a push", fragment=header.fragment, round=header.round, skipped=len(header.skipped))
        kept = False
        try:
            kept = await self._send_push(session, cut.snapshot, header, cut.data, cut.checksums)
        finally:
            if not kept:
                self.bridge.snapshot_done(cut.snapshot)

    def _lose(self, cut: _CutPush) -> None:
        """A cut push the syncer will not ask for again: its steps are counted again, as a push
        lost before it was sent (LostPush), and its buffers go back."""
        self.stats.pushes_lost += 1
        self.bridge.post_lost(LostPush(cut.snapshot.fragment, cut.snapshot.round))
        self.bridge.snapshot_done(cut.snapshot)

    async def _push_one(self, session: Session, snapshot: Snapshot) -> bool:
        """Compute and send one push; True when a lost session cut it short and it is kept."""
        if snapshot.fragment >= len(self._manifests):
            return False
        layout = self._manifests[snapshot.fragment]
        residual = None
        if self.config.precision != "fp32":
            residual = self._residuals.get(snapshot.fragment)
            if residual is None:
                residual = self._residuals[snapshot.fragment] = zero_residual(layout)
        loop = asyncio.get_running_loop()
        work = partial(
            compute_push,
            snapshot,
            layout,
            self.config.chunk_bytes,
            self.config.precision,
            residual,
            in_place=True,
        )
        self._computing.add(id(snapshot))
        try:
            manifest, data, checksums = await loop.run_in_executor(self._executor, work)
        except asyncio.CancelledError:
            raise  # the worker may still be at it: id(snapshot) stays
        except BaseException:
            self._computing.discard(id(snapshot))
            raise
        self._computing.discard(id(snapshot))
        if (
            self._tuner is not None
            and not self._measuring
            and snapshot.c_steps > 0  # a gradient of no steps is all zeros: any codec looks perfect
            and len(data) >= MIN_PERIOD_BYTES
        ):
            self._measure_codecs(loop, data)
        codec = self._tuner.next_codec() if self._tuner is not None else self._codec
        header = PushHeader(
            manifest,
            len(data),
            codec,
            self.config.chunk_bytes,
            fragment=snapshot.fragment,
            round=snapshot.round,
            base_version=snapshot.base_version,
            # Within the ranges the syncer accepts (wire/limits.py), far above any real count.
            c_steps=min(snapshot.c_steps, DEFAULT_LIMITS.max_reported_steps),
            c_tokens=min(snapshot.c_tokens, DEFAULT_LIMITS.max_push_tokens),
            precision=self.config.precision,
            step=None if snapshot.step is None else min(snapshot.step, DEFAULT_LIMITS.max_reported_steps),
            apply_late=(
                None
                if snapshot.apply_late is None
                else min(snapshot.apply_late, DEFAULT_LIMITS.max_reported_steps)
            ),
        )
        return await self._send_push(session, snapshot, header, data, checksums)

    async def _send_push(
        self, session: Session, snapshot: Snapshot, header: PushHeader, data: Buffer, checksums: list[int]
    ) -> bool:
        """Send a push, again while the syncer resets it as damaged; True when a lost session cut
        it short and it is kept (_cut_pushes) for the syncer to ask for again."""
        loop = asyncio.get_running_loop()
        codec = header.codec
        shuffle = PUSH_SHUFFLE if codec != "none" else 0
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            self._meter.started(loop.time(), codec)
            sent: int | None = None
            try:
                self._pushed_at[snapshot.fragment] = loop.time()
                await session.send_fragment(header, data, shuffle_item_size=shuffle, checksums=checksums)
                sent = len(data) - header.skipped_bytes
                break
            except TransferFailed as exc:
                if exc.damaged and attempt < PUSH_ATTEMPTS:
                    # Damaged on the way: a failed push is not a second one, the syncer admits
                    # it again (SPEC §4.4).
                    self.stats.pushes_resent += 1
                    log.info(
                        "push damaged in transit: sending again",
                        fragment=snapshot.fragment,
                        round=snapshot.round,
                        attempt=attempt,
                        reason=str(exc),
                    )
                    header = dataclasses.replace(header, skip=b"")  # the syncer let go of what it held
                    continue
                self.stats.pushes_refused += 1
                log.warning("push refused", fragment=snapshot.fragment, round=snapshot.round, reason=str(exc))
                return False
            except SessionClosed:
                # The round goes on without this push. It is kept: a rejoin that the syncer asks
                # for this round again sends it, without what the syncer holds of it; otherwise
                # its steps are counted again in the fragment's next push (_lose).
                cut = _CutPush(snapshot, dataclasses.replace(header, skip=b""), data, checksums)
                older = self._cut_pushes.get(snapshot.fragment)
                if older is not None:
                    self._lose(older)
                self._cut_pushes[snapshot.fragment] = cut
                return True
            finally:
                self._push_ended(loop.time(), sent, session)
        self.stats.pushes_sent += 1
        self.stats.bytes_sent += sent or 0
        return False

    # ------------------------------------------------------------- --codec auto

    def _measure_codecs(self, loop: asyncio.AbstractEventLoop, data: Buffer) -> None:
        """Time the codecs on this outer gradient in the push worker thread, once. The push does
        not wait for it: the next push's gradient is computed after it, in the same thread. The
        sample is taken here (CODEC_SAMPLE_BYTES, a copy): the push's buffer goes back to the
        bridge when the push is done, and may be written again before the timing runs."""
        self._measuring = True
        sample = spread_sample(data, self.config.chunk_bytes, CODEC_SAMPLE_BYTES)
        future = loop.run_in_executor(self._executor, codec_figures, sample, self.config.chunk_bytes)
        future.add_done_callback(self._codecs_measured)

    def _codecs_measured(self, future: asyncio.Future[list[CodecFigure]]) -> None:
        if future.cancelled() or self._tuner is None:
            return
        exc = future.exception()
        if exc is not None:  # a bug, not a condition: say so and stay uncompressed
            log.error("codec figures not measured: pushes stay uncompressed", error=repr(exc))
            return
        figures = future.result()
        log.info(
            "codec figures measured",
            figures={
                f.codec: {"ratio": round(f.ratio, 3), "compress_gbps": round(f.compress_gbps, 2)}
                for f in figures
                if f.codec != "none"
            },
        )
        self._codec_chosen(self._tuner.figures_measured(figures))

    def _push_ended(self, now_s: float, raw_bytes: int | None, session: Session) -> None:
        period = self._meter.finished(now_s, raw_bytes, session.round_trip_s() or 0.0)
        if period is not None and self._tuner is not None:
            self._codec_chosen(self._tuner.push_done(period))

    def _codec_chosen(self, choice: CodecChoice | None) -> None:
        if choice is None:
            return
        self._codec = self.stats.codec = choice.codec
        log.info(
            "codec chosen",
            codec=choice.codec,
            source="measured",
            predicted_gbps=round(choice.predicted_gbps, 3),
            reason=choice.reason,
        )
