"""The learner's side of the network, on its own event loop: one session with the syncer at a time,
JOIN and PLAN, healing, requests in, pushes out, merged fragments in, step reports out, and
reconnection with capped exponential backoff and jitter when the session is lost.

Outer gradients are computed here, never on the training thread: δ = anchor - θ (float32) from a
snapshot the training thread took at a step boundary, in a worker thread, with the chunk checksums
computed in the same pass over the bytes (the session then hashes nothing). Failures that no
reconnect can fix (the syncer's model is not ours, wrong credentials, no common protocol version)
are posted to the training thread as fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import structlog
import torch

from dilocod.learner.bridge import Adopt, Bridge, Snapshot
from dilocod.learner.layout import PlanMismatch, check_plan
from dilocod.precision import encode, tensor_views
from dilocod.transport.endpoints import connect
from dilocod.transport.errors import HandshakeFailed, SessionClosed, TransferFailed
from dilocod.transport.options import TransportOptions
from dilocod.transport.session import FragmentReceived, Session
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.errors import ErrorCode
from dilocod.wire.manifest import ModelEntry, TensorEntry, pack_manifest
from dilocod.wire.messages import FragmentRequest, Join, Plan, PushHeader, StepReport, UpdateHeader

log = structlog.get_logger("dilocod.learner")

#: Codes after which reconnecting cannot help: the configuration must change.
FATAL_CODES = {
    ErrorCode.MODEL_MISMATCH,
    ErrorCode.AUTH_FAILED,
    ErrorCode.AUTH_REQUIRED,
    ErrorCode.UNSUPPORTED_VERSION,
}


class FatalLinkError(Exception):
    """The learner cannot work with this syncer as configured."""


@dataclass(frozen=True, slots=True)
class LinkConfig:
    host: str
    port: int
    learner_id: str
    secret: bytes | None
    #: Mutual TLS around every connection to the syncer, or None.
    tls: ssl.SSLContext | None = None
    streams: int = 4
    codec: str = "none"
    #: Wire precision of outer gradients (dilocod.precision): fp32, bf16, int8 or int4.
    precision: str = "fp32"
    chunk_bytes: int = 1 << 20
    join_timeout_s: float = 60.0
    backoff_min_s: float = 0.5
    backoff_max_s: float = 30.0


@dataclass(slots=True)
class LinkStats:
    connected: bool = False
    sessions: int = 0
    pushes_sent: int = 0
    pushes_refused: int = 0
    updates_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_push_to_update_s: float | None = None
    incarnation: str = ""


def compute_push(
    snapshot: Snapshot,
    manifest: tuple[TensorEntry, ...],
    chunk_bytes: int,
    precision: str = "fp32",
    residual: list[torch.Tensor] | None = None,
) -> tuple[tuple[TensorEntry, ...], bytearray, list[int]]:
    """δ = anchor - θ (float32), laid out at the wire precision (lossy ones with error feedback
    through residual), and its chunk checksums. Runs in the push worker thread."""
    if snapshot.ready is not None:
        snapshot.ready()
    out = bytearray(len(snapshot.theta))
    if out:
        delta = torch.frombuffer(out, dtype=torch.float32)
        torch.sub(
            torch.frombuffer(snapshot.anchor, dtype=torch.float32),
            torch.frombuffer(snapshot.theta, dtype=torch.float32),
            out=delta,
        )
    if precision != "fp32":
        manifest, out = encode(tensor_views(out, manifest), [e.name for e in manifest], precision, residual)
    return manifest, out, chunk_checksums(out, chunk_bytes)


class Link:
    """Run with `await link.run(stop)` on the network thread's loop."""

    def __init__(self, config: LinkConfig, model: tuple[ModelEntry, ...], bridge: Bridge) -> None:
        self.config = config
        self.model = model
        self.bridge = bridge
        self.stats = LinkStats()
        self.incarnation = ""
        self.session: Session | None = None
        self._manifests: list[tuple[TensorEntry, ...]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dilocod-push")
        self._pushes: set[asyncio.Task[None]] = set()
        self._pushed_at: dict[int, float] = {}
        self._healing: set[int] = set()
        #: Error-feedback residuals of the lossy precisions, per fragment (push worker only).
        self._residuals: dict[int, list[torch.Tensor]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self.bridge.attach(self._loop, self._on_outbox)
        attempt = 0
        try:
            while not stop.is_set():
                try:
                    await self._one_session(stop)
                    attempt = 0
                except FatalLinkError as exc:
                    log.error("cannot work with this syncer", reason=str(exc))
                    self.bridge.post_fatal(str(exc))
                    return
                except (OSError, ConnectionError, TimeoutError) as exc:
                    log.warning("syncer unreachable", error=str(exc) or type(exc).__name__, attempt=attempt)
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
            for task in list(self._pushes):
                task.cancel()
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _one_session(self, stop: asyncio.Event) -> None:
        options = TransportOptions(chunk_bytes=self.config.chunk_bytes)
        try:
            session = await connect(
                self.config.host,
                self.config.port,
                peer_id=self.config.learner_id,
                role="learner",
                secret=self.config.secret,
                ssl=self.config.tls,
                streams=self.config.streams,
                options=options,
            )
        except HandshakeFailed as exc:
            if exc.code in FATAL_CODES:
                raise FatalLinkError(f"the syncer refused this learner: {exc}") from None
            raise
        self.session = session
        self.stats.sessions += 1
        try:
            await session.send(Join(self.model, self.incarnation))
            try:
                async with asyncio.timeout(self.config.join_timeout_s):
                    first = await session.recv()
            except SessionClosed as exc:
                if exc.code in FATAL_CODES:
                    raise FatalLinkError(str(exc)) from None
                raise
            if not isinstance(first, Plan):
                raise ConnectionError(f"the syncer answered JOIN with {type(first).__name__}, not PLAN")
            try:
                check_plan(first, self.model)
            except PlanMismatch as exc:
                raise FatalLinkError(str(exc)) from None
            self._adopt_plan(first)
            self.stats.connected = True
            log.info("joined", syncer=f"{self.config.host}:{self.config.port}", incarnation=first.incarnation)
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

    def _adopt_plan(self, plan: Plan) -> None:
        shapes = {e.name: e.shape for e in plan.model}
        self._manifests = [
            tuple(pack_manifest([(n, "float32", shapes[n]) for n in names])[0]) for names in plan.fragments
        ]
        if plan.incarnation != self.incarnation and self.incarnation:
            log.info("new syncer incarnation: healing", old=self.incarnation, new=plan.incarnation)
        self.incarnation = self.stats.incarnation = plan.incarnation
        self.bridge.post_plan(plan)
        self._healing = set(range(len(plan.fragments)))
        self._residuals.clear()  # a new plan may cut the model differently

    def _on_item(self, item: object) -> None:
        if isinstance(item, FragmentRequest):
            self.bridge.post_request(item)
        elif isinstance(item, FragmentReceived) and isinstance(item.header, UpdateHeader):
            header = item.header
            owner = item.buffer.obj
            buffer = (
                owner
                if isinstance(owner, bytearray) and len(owner) == header.raw_bytes
                else bytearray(item.buffer)
            )
            heal = header.fragment in self._healing
            self._healing.discard(header.fragment)
            self.stats.updates_received += 1
            self.stats.bytes_received += header.raw_bytes
            pushed = self._pushed_at.pop(header.fragment, None)
            if pushed is not None and self._loop is not None:
                self.stats.last_push_to_update_s = self._loop.time() - pushed
            self.bridge.post_update(Adopt(header.fragment, header.version, buffer, heal, self.incarnation))

    # ------------------------------------------------------------------ outbox

    def _on_outbox(self) -> None:
        snapshots, steps = self.bridge.drain()
        session = self.session
        if session is None or not session.is_open:
            return  # the syncer is away: its rounds go on without these; step reports are moot
        for item in steps:
            session.control.send(StepReport(item.step, item.tokens, item.step_time_s))
        for snapshot in snapshots:
            task = asyncio.ensure_future(self._push(session, snapshot))
            self._pushes.add(task)
            task.add_done_callback(self._pushes.discard)

    async def _push(self, session: Session, snapshot: Snapshot) -> None:
        if snapshot.fragment >= len(self._manifests):
            return
        layout = self._manifests[snapshot.fragment]
        residual = None
        if self.config.precision != "fp32":
            residual = self._residuals.setdefault(
                snapshot.fragment, [torch.zeros(e.shape, dtype=torch.float32) for e in layout]
            )
        loop = asyncio.get_running_loop()
        work = partial(
            compute_push, snapshot, layout, self.config.chunk_bytes, self.config.precision, residual
        )
        manifest, data, checksums = await loop.run_in_executor(self._executor, work)
        header = PushHeader(
            manifest,
            len(data),
            self.config.codec,
            self.config.chunk_bytes,
            fragment=snapshot.fragment,
            round=snapshot.round,
            base_version=snapshot.base_version,
            c_steps=snapshot.c_steps,
            c_tokens=snapshot.c_tokens,
        )
        shuffle = 4 if self.config.codec != "none" else 0
        try:
            self._pushed_at[snapshot.fragment] = loop.time()
            await session.send_fragment(header, data, shuffle_item_size=shuffle, checksums=checksums)
        except TransferFailed as exc:
            self.stats.pushes_refused += 1
            log.warning("push refused", fragment=snapshot.fragment, round=snapshot.round, reason=str(exc))
            return
        except SessionClosed:
            return  # the round goes on without this push; the next session heals
        self.stats.pushes_sent += 1
        self.stats.bytes_sent += len(data)
