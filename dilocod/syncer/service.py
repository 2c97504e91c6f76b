"""The syncer service: sessions with learners, glued to the round state machine and the model store.

It owns the I/O and nothing else: per learner, one session (JOIN, then PLAN and every fragment to
heal it but those it already holds at their current version, back on this incarnation; then step
reports and pushes in, requests and updates out); one merge worker thread that
merges rounds one at a time, and a checkpoint thread that writes fragments lent by the model
meanwhile (a merge commits new buffers, so a checkpoint always sees a fragment as of one version);
a ticker that wakes the state machine at its grace deadlines. Decisions
are Rounds'; numbers are GlobalModel's. A learner may vanish at any point: it is simply absent
from the rounds, and whatever it had in flight is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import ssl
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from dilocod.config import SyncerConfig
from dilocod.model.compare import first_difference
from dilocod.model.precision import decode
from dilocod.ops.figures import quantiles
from dilocod.ops.looplag import LoopLag
from dilocod.ops.priority import lower_this_thread
from dilocod.outer.guard import Verdict
from dilocod.syncer.checkpoint import CheckpointPruneError, FragmentedModel, save_fragments
from dilocod.syncer.model import Encoding, GlobalModel, MergeRejected, Snapshot
from dilocod.syncer.pushes import PushStore
from dilocod.syncer.rounds import Action, Carry, Merge, Push, Refusal, Release, Request, Rounds
from dilocod.syncer.steprate import StepRates
from dilocod.transport.endpoints import Server
from dilocod.transport.errors import SessionClosed, TransferFailed
from dilocod.transport.options import TransportOptions
from dilocod.transport.session import FragmentReceived, Session
from dilocod.tuning.streams import AUTO_RATE_GBPS
from dilocod.wire.errors import ErrorCode, RemoteProtocolError
from dilocod.wire.layouts import push_layout
from dilocod.wire.messages import (
    MAX_HAVE_BYTES,
    Error,
    FragmentRequest,
    Join,
    NothingToPush,
    Plan,
    PushHeader,
    StatusRequest,
    StatusResponse,
    StepReport,
    UpdateHeader,
    chunk_bitmap,
    fits_chunks,
    held_current,
)
from dilocod.wire.stream import CutShort, Resumed, StreamHeader

log = structlog.get_logger("dilocod.syncer")

#: The interpreter's switch interval while serving (the default is 5 ms). The merge worker's fused
#: step is some 500 torch calls per fragment, each of which lets go of the GIL and must take it
#: back; behind an event loop busy with Python (chunks of pushes and updates) it waited up to the
#: whole interval each time: a 40 ms merge took 3 s beside a thread running Python, 0.2 s at 1 ms
#: (bench/notes/syncer-merge-in-run.md). The loop gives way a little more often for it.
SWITCH_INTERVAL_S = 0.001
#: A learner must say JOIN this soon after its session opens.
JOIN_TIMEOUT_S = 30.0
#: An update that fails this many times in a row is given up until the next version.
UPDATE_ATTEMPTS = 3
#: A round trip below this (a LAN, loopback) sends one update at a time; above, several are in
#: flight (_update_window).
UPDATE_PIPELINE_MIN_RTT_S = 0.002
MAX_UPDATES_IN_FLIGHT = 32
#: Learners the status lists at most (connected ones first, then those that left last), so that it
#: stays far inside its frame limit (about 400 bytes a learner) however many ids are live.
STATUS_MAX_LEARNERS = 2048


def _refuse_before_join(header: StreamHeader) -> memoryview:
    """Every session's allocator until its learner joins: nothing is allocated for a peer that
    has not (status clients never do), and no early chunks are kept for it either."""
    raise RemoteProtocolError(ErrorCode.NOT_JOINED, "a push before the learner has joined")


_REFUSAL_CODES = {
    Refusal.NOT_REQUESTED: ErrorCode.NOT_REQUESTED,
    Refusal.STALE_VERSION: ErrorCode.STALE_VERSION,
}


@dataclass(frozen=True, slots=True)
class _CutPush:
    """A learner's push that its lost session cut short: the chunks received, in their buffer (a
    pool buffer, back to nobody but a resumed transfer), and the session, whose decodes must be
    over before the buffer is lent again."""

    cut: CutShort
    session: Session


@dataclass(slots=True)
class _Peer:
    """One joined learner."""

    learner: str
    session: Session
    #: Fragments whose current snapshot this learner has not been sent yet, oldest need first (a
    #: newer version of a waiting fragment keeps its place, so no fragment index starves).
    pending: dict[int, None] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    healed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Versions sent, per fragment.
    sent: dict[int, int] = field(default_factory=dict)
    joined: bool = False
    #: The learner process's own id from its JOIN ("" when it sent none).
    instance: str = ""
    #: Updates a lost session cut short, from its JOIN: fragment -> (version, chunks it holds).
    #: The next send of that version skips those chunks (UpdateHeader.skip), once.
    partial: dict[int, tuple[int, bytes]] = field(default_factory=dict)


def id_in_use_refusal(learner: str, *, same_instance: bool, quiet_s: float, liveness_s: float) -> str | None:
    """A JOIN under the id of a session that is still open (SPEC §4.4): the message to refuse it
    with (LEARNER_ID_IN_USE), or None when the new session replaces the old one. The same learner
    process coming back (its JOIN names the old one's instance) always does: it gave the old
    connection up, the syncer just has not seen it close. Otherwise the old session holds the id
    while it was heard from within the liveness timeout that would cut it off anyway; a learner
    that died without its kernel closing its connections (a power loss) holds it until then."""
    if same_instance or quiet_s >= liveness_s:
        return None
    return (
        f"learner id {learner!r} is in use by a session heard from {quiet_s:.1f} s ago; if that "
        f"learner has died, its session ends after {liveness_s:g} s of silence: retry in "
        f"{math.ceil(liveness_s - quiet_s)} s"
    )


class SyncerService:
    """Serve learners until `stop` is set; see the module docstring."""

    def __init__(
        self,
        config: SyncerConfig,
        model: GlobalModel,
        rounds: Rounds,
        *,
        state_dir: Path,
        incarnation: str,
        secret: bytes | None,
        meta: dict[str, Any],
        clock: Callable[[], float] = time.monotonic,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.rounds = rounds
        self.state_dir = state_dir
        self.incarnation = incarnation
        self.secret = secret
        self.tls = tls  # mutual TLS around every connection, or None
        self.meta = meta
        self.clock = clock
        self.peers: dict[str, _Peer] = {}
        self.bytes_in = 0
        self.bytes_out = 0
        #: Damaged chunks of pushes asked for again (CHUNK_RESEND), by sessions that have ended;
        #: and fragments not sent again to a learner back on this incarnation (JOIN's held).
        self._chunks_asked_again_ended = 0
        self.fragments_held_at_join = 0
        #: Chunks of updates and pushes not sent again: the receiver held them from a transfer cut
        #: short by a lost session (UpdateHeader.skip, PushHeader.skip).
        self.chunks_resumed = 0
        #: Pushes cut short by a lost session, at most one per learner: asked for again, with the
        #: chunks held (FragmentRequest.have), while their round still collects (SPEC §4.4).
        self._cut_pushes: dict[str, _CutPush] = {}
        self.checkpoints_written = 0
        self.last_checkpoint: Path | None = None
        #: Checkpoints that failed since the last one written, and why the last one failed.
        self.checkpoints_failed = 0
        self.checkpoint_problem: str | None = None
        #: Why the checkpoint on the way out failed (None: written, or not tried yet).
        self.final_checkpoint_problem: str | None = None
        self.started_at = clock()
        self.step_rates = StepRates()
        self._specs = [model.specs[name] for name in model.order]
        # Admitted pushes' bytes: in pool buffers, carried ones in files under the state directory.
        self.pushes = PushStore(model.buffers, state_dir)
        # Screening (decode, norm) reads only push buffers: on its own thread, so a ready merge never
        # queues behind the screens of later pushes. Merges have the merge thread to themselves.
        # Both run at the process's CPU priority, not below it: lowered (nice +10), they got a tenth
        # of a core beside two learners on 2 cores, each merge took 5-9 s instead of 0.1, and every
        # queued round held its pushes' buffers meanwhile (bench/notes/syncer-scale.md). The event
        # loop is not the worse for it: it sleeps between events, and the scheduler runs a thread
        # that wakes from a sleep ahead of threads that have been running.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dilocod-merge")
        self._screener = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dilocod-screen")
        # Checkpoints are written here, fragment by fragment, each fragment lent by the model as it
        # is (checkpoint()): merges go on while the disk works. Below the loop's priority: the
        # disk waits, not the sessions.
        self._checkpointer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="dilocod-checkpoint", initializer=lower_this_thread
        )
        # Updates at bf16 of a version whose encoding was let go (heals): made again here, one at
        # a time, never on the event loop, and shared by every send that waits for it.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dilocod-encode")
        self._encoding: dict[int, tuple[Snapshot, asyncio.Future[Encoding]]] = {}
        self._tasks: asyncio.TaskGroup | None = None
        self._ticker_wake = asyncio.Event()
        self._merges: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._server: Server | None = None
        self._lag = LoopLag(on_stall=self._stalled)
        self._checkpointing = False
        self._merge_started: dict[int, float] = {}

    # ------------------------------------------------------------------ lifecycle

    async def serve(self, stop: asyncio.Event, ready: Callable[[str, int], None]) -> None:
        """Listen, serve until stop is set, then wind down: finish merges in flight, write a
        checkpoint, say goodbye to every learner. A checkpoint that fails on the way out (a full
        disk) is logged and kept in final_checkpoint_problem; the goodbyes are said all the same."""
        self.model.publish_all()
        # Everything built so far (torch, the modules, the model store) lives as long as the
        # daemon: out of the collector's sight, a full collection no longer walks it. It was
        # 170 000 objects, 80-125 ms a full collection on the event loop (bench/notes/syncer-scale.md).
        gc.freeze()
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(switch_interval, SWITCH_INTERVAL_S))
        options = TransportOptions(chunk_bytes=self.config.chunk)
        try:
            async with (
                Server(
                    self._handle,
                    server_id="syncer",
                    secret=self.secret,
                    ssl=self.tls,
                    options=options,
                    allocate=_refuse_before_join,
                    max_early_bytes=0,
                    incarnation=self.incarnation,
                ) as server,
                asyncio.TaskGroup() as tasks,
            ):
                self._server, self._tasks = server, tasks
                host, port = await server.listen(self.config.listen.host, self.config.listen.port)
                background = [
                    tasks.create_task(self._ticker(), name="ticker"),
                    tasks.create_task(self._checkpoint_loop(), name="checkpoints"),
                    tasks.create_task(self._lag.watch(), name="loop lag"),
                ]
                if self.config.metrics is not None:
                    background.append(tasks.create_task(self._serve_metrics(), name="metrics"))
                ready(host, port)
                await stop.wait()
                self._stopping = True
                # Pushes held but not being merged are dropped with this process (checkpoints hold
                # the model, not pending pushes): named here, so none goes missing unsaid.
                log.info(
                    "stopping",
                    merges_in_flight=len(self._merges),
                    unmerged_pushes=[[learner, index] for learner, index in self.pushes.pending()],
                )
                for task in background:
                    task.cancel()
                if self._merges:
                    await asyncio.wait(self._merges, timeout=60.0)
                try:
                    await self.checkpoint()
                except Exception:  # logged by checkpoint(); the learners are told all the same
                    self.final_checkpoint_problem = self.checkpoint_problem
                await server.close("syncer shutting down")
        finally:
            # The checkpointer first: a checkpoint under way reads what merges retire.
            self._checkpointer.shutdown(wait=True, cancel_futures=True)
            self._screener.shutdown(wait=True, cancel_futures=True)
            self._encoder.shutdown(wait=True, cancel_futures=True)
            self._executor.shutdown(wait=True, cancel_futures=True)
            self.pushes.close()
            sys.setswitchinterval(switch_interval)

    async def checkpoint(self) -> Path:
        """Write a checkpoint now: in the checkpoint thread, fragment by fragment, each fragment's
        Θ_p, b_p and version lent together by the model (GlobalModel.lend), so rounds go on while
        it is written (checkpoint.save_fragments). A failure is counted,
        logged with its reason and raised; nothing of it is left on disk, so the previous
        checkpoint stays the newest. Old checkpoints that cannot be removed are only logged."""
        now = self.clock()
        self._forget_gone(now)
        meta = {
            **self.meta,
            "next_round": self.rounds.next_round,
            "clock": self.rounds.clock,
            "rounds_merged": self.rounds.rounds_merged,
            "roster": {
                r.learner: {
                    "contributions": r.contributions,
                    "steps": r.steps,
                    "local_step": r.local_step,
                    "tokens": r.tokens,
                    # The goodput's terms, carried over a restart (the daemon adds the downtime),
                    # and the time since it left (for the roster's retention).
                    "useful_s": _finite(r.useful_s, 6),
                    "tracked_s": _finite(r.tracked_s(now), 6),
                    "idle_s": _finite(r.idle_s(now), 6),
                }
                for r in self.rounds.learners.values()
            },
        }

        model = self.model
        layout = FragmentedModel(
            {name: model.specs[name].shape for name in model.order},
            tuple(store.raw_bytes for store in model.fragments),
            tuple(model.checkpoint_pieces(store.index) for store in model.fragments),
        )

        # Each fragment is written from the committed Θ_p and b_p themselves, lent (no copy, and
        # nothing of the merge worker's time): merges commit new buffers meanwhile.
        started = self.clock()
        self._checkpointing = True
        try:
            path = await asyncio.get_running_loop().run_in_executor(
                self._checkpointer, partial(save_fragments, self.state_dir, layout, model.lend, meta)
            )
        except CheckpointPruneError as exc:  # written and durable; the disk will fill up
            path = exc.saved
            log.error("old checkpoints not removed", path=str(path), error=str(exc.__cause__))
        except Exception as exc:
            self.checkpoints_failed += 1
            self.checkpoint_problem = f"{type(exc).__name__}: {exc}"
            log.error(
                "checkpoint failed",
                error=self.checkpoint_problem,
                failed=self.checkpoints_failed,
                newest=str(self.last_checkpoint) if self.last_checkpoint else None,
            )
            raise
        finally:
            self._checkpointing = False
        self.checkpoints_written += 1
        self.last_checkpoint = path
        self.checkpoints_failed, self.checkpoint_problem = 0, None
        log.info(
            "checkpoint",
            path=str(path),
            versions=sum(self.model.versions),
            duration_s=round(self.clock() - started, 3),
        )
        return path

    def _stalled(self, lag_ms: float) -> None:
        """The loop woke lag_ms late: said with what was under way, to tell what blocked it."""
        log.warning(
            "loop stalled",
            lag_ms=round(lag_ms, 1),
            merges_in_flight=len(self._merges),
            checkpointing=self._checkpointing,
            pushes_held=len(self.pushes.pending()),
            late_pushes_on_disk=self.pushes.on_disk(),
            peers=len(self.peers),
        )

    def _forget_gone(self, now: float) -> None:
        """Learners gone past the retention leave the roster, and what else is kept per id."""
        for learner in self.rounds.forget_gone(now, self.config.roster_retention_s):
            self.step_rates.forget(learner)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.checkpoint_every_s)
            # A full disk must not stop training: logged by checkpoint(), and the next try may work.
            with contextlib.suppress(Exception):
                await self.checkpoint()

    def healthy(self) -> bool:
        """For the systemd watchdog: no merge has been stuck in the worker for ten minutes."""
        now = self.clock()
        return all(now - started < 600.0 for started in self._merge_started.values())

    async def _serve_metrics(self) -> None:
        from dilocod.ops.metrics import MetricsServer  # noqa: PLC0415 - only with --metrics
        from dilocod.syncer.metrics import render_syncer_metrics  # noqa: PLC0415

        address = self.config.metrics
        assert address is not None
        async with MetricsServer(
            address.host, address.port, lambda: render_syncer_metrics(self.status())
        ) as server:
            log.info("metrics", host=address.host, port=server.port)
            await asyncio.Event().wait()  # until cancelled at shutdown

    async def _ticker(self) -> None:
        """Wake the state machine at its next grace deadline (or when told the deadline moved)."""
        while True:
            deadline = self.rounds.next_deadline()
            self._ticker_wake.clear()
            timeout = None if deadline is None else max(0.0, deadline - self.clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._ticker_wake.wait()
            self._apply(self.rounds.tick(self.clock()))

    # ------------------------------------------------------------------ sessions

    async def _handle(self, session: Session) -> None:
        """One session: a learner (JOIN first) or a status client (STATUS_REQUEST)."""
        try:
            async with asyncio.timeout(JOIN_TIMEOUT_S):
                first = await session.recv()
        except TimeoutError:
            await self._refuse(session, ErrorCode.TIMEOUT, f"no JOIN within {JOIN_TIMEOUT_S:g} s")
            return
        if isinstance(first, StatusRequest):
            await self._serve_status(session)
            return
        if not isinstance(first, Join):
            await self._refuse(session, ErrorCode.NOT_JOINED, f"{type(first).__name__} before JOIN")
            return
        mismatch = first_difference(first.model, self._specs, "the learner", "the syncer")
        if mismatch is not None:
            log.warning("model mismatch", learner=session.peer.peer_id, detail=mismatch)
            await self._refuse(session, ErrorCode.MODEL_MISMATCH, mismatch)
            return
        await self._serve_learner(session, first)

    async def _refuse(self, session: Session, code: ErrorCode, message: str) -> None:
        with contextlib.suppress(SessionClosed, ConnectionError):
            await session.send(Error(int(code), message))
        await session.close(message)

    async def _serve_status(self, session: Session) -> None:
        await session.send(StatusResponse(self.status()))
        while True:
            item = await session.recv()
            if isinstance(item, StatusRequest):
                await session.send(StatusResponse(self.status()))

    async def _serve_learner(self, session: Session, join: Join) -> None:
        learner = session.peer.peer_id
        previous = self.peers.get(learner)
        if previous is not None and previous.session.is_open:
            quiet_s = asyncio.get_running_loop().time() - previous.session.control.last_receive
            same_instance = bool(join.instance) and join.instance == previous.instance
            refusal = id_in_use_refusal(
                learner,
                same_instance=same_instance,
                quiet_s=quiet_s,
                liveness_s=previous.session.options.idle_timeout_s,
            )
            if refusal is not None:
                log.warning("learner id in use", learner=learner, heard_s_ago=round(quiet_s, 3))
                await self._refuse(session, ErrorCode.LEARNER_ID_IN_USE, refusal)
                return
            log.info(
                "learner session replaced",
                learner=learner,
                why="the same learner came back" if same_instance else "the old session fell silent",
                heard_s_ago=round(quiet_s, 3),
            )
        # Registered before the old session is closed: a third JOIN meanwhile finds this one.
        peer = _Peer(learner, session, instance=join.instance)
        if join.incarnation == self.incarnation:
            peer.partial = {u.fragment: (u.version, u.have) for u in join.partial}
        self.peers[learner] = peer
        self._size_pool()
        if previous is not None:
            await previous.session.close("replaced by a newer session of the same learner")
        session.set_allocator(partial(self._allocate, peer))
        session.on_inbound_failed = partial(self._push_failed, peer)
        session.on_peer_error = partial(self._peer_error, peer)
        plan = self._plan(learner)
        # A learner back on this incarnation names the versions it holds: those still current are
        # not sent again (_send_update skips what `sent` says it has), the rest are.
        held = held_current(join, plan)
        peer.sent.update({fragment: plan.versions[fragment] for fragment in held})
        self.fragments_held_at_join += len(held)
        log.info(
            "learner joined",
            learner=learner,
            had_incarnation=join.incarnation or None,
            heals=len(plan.fragments) - len(held),
            held=len(held),
        )
        try:
            await session.send(plan)
            peer.pending.update(dict.fromkeys(range(len(self.model.fragments))))
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._send_updates(peer), name=f"updates {learner}")
                tasks.create_task(self._join_when_healed(peer), name=f"heal {learner}")
                while True:
                    self._on_message(peer, await session.recv())
        finally:
            self._chunks_asked_again_ended += session.chunks_asked_again
            if self.peers.get(learner) is peer:
                del self.peers[learner]
                self._size_pool()
                if peer.joined:
                    self._apply(self.rounds.leave(learner, self.clock()))
                else:
                    self._apply(self.rounds.end_join(learner, self.clock()))
            log.info("learner left", learner=learner, reason=session.close_reason)

    async def _join_when_healed(self, peer: _Peer) -> None:
        await peer.healed.wait()
        peer.joined = True
        self._apply(self.rounds.join(peer.learner, self.clock()))

    def _plan(self, learner: str) -> Plan:
        next_round = self.rounds.begin_join(learner)
        return Plan(
            self.incarnation,
            tuple(self._specs),
            tuple(f.pieces for f in self.model.plan.fragments),
            tuple(s.current.version if s.current else 0 for s in self.model.fragments),
            self.rounds.config.sync_every,
            self.rounds.config.overlap,
            self.rounds.config.quorum,
            next_round,
        )

    def _on_message(self, peer: _Peer, item: object) -> None:
        now = self.clock()
        if isinstance(item, StepReport):
            if peer.joined:
                self.step_rates.record(peer.learner, now)
                self._apply(
                    self.rounds.step(peer.learner, item.tokens, item.step_time_s, now, local_step=item.step)
                )
        elif isinstance(item, FragmentReceived):
            self._on_push(peer, item)
        elif isinstance(item, NothingToPush):
            if peer.joined:
                self._apply(
                    self.rounds.nothing_to_push(peer.learner, item.round, item.fragment, item.step, now)
                )
        elif isinstance(item, StatusRequest):
            if peer.session.is_open:  # a request read before its connection closed gets no answer
                peer.session.control.reply(StatusResponse(self.status()))
        elif isinstance(item, Join):
            peer.session.control.abort(ErrorCode.NOT_JOINED, "a second JOIN on one session")

    # ------------------------------------------------------------------ pushes

    def _allocate(self, peer: _Peer, header: StreamHeader) -> memoryview | Resumed:
        """Admit a push by its header (refusals become STREAM_RESET) and lend it a buffer: for one
        that resumes a push cut short, the buffer holding the chunks it skips."""
        if not isinstance(header, PushHeader):
            raise RemoteProtocolError(ErrorCode.UNEXPECTED_FRAME, "a learner sends pushes, not updates")
        if not peer.joined:
            raise RemoteProtocolError(ErrorCode.NOT_JOINED, "push before the learner has joined")
        resumed = self._resumed_push(peer, header)
        if not 0 <= header.fragment < len(self.model.fragments):
            raise RemoteProtocolError(ErrorCode.NOT_REQUESTED, f"there is no fragment {header.fragment}")
        precision = header.precision
        store = self.model.fragments[header.fragment]
        if precision == "fp32":
            manifest, size = store.manifest, store.raw_bytes
        else:
            manifest, size = push_layout(self._shapes(header.fragment), precision)
        if header.manifest != manifest:
            raise RemoteProtocolError(
                ErrorCode.BAD_MANIFEST,
                f"push of fragment {header.fragment} at {precision}: its manifest is not the plan's "
                f"layout of the fragment at {precision}",
            )
        # A manifest only has to fit inside raw_bytes: the size is checked on its own, before
        # anything is allocated, against what the plan says this fragment has at this precision.
        if header.raw_bytes != size:
            raise RemoteProtocolError(
                ErrorCode.LIMIT_EXCEEDED if header.raw_bytes > size else ErrorCode.LENGTH_MISMATCH,
                f"push of fragment {header.fragment} declares {header.raw_bytes} raw bytes; the "
                f"plan's layout at {precision} has {size}",
            )
        push = Push(
            peer.learner,
            header.round,
            header.fragment,
            header.base_version,
            header.c_steps,
            header.c_tokens,
            header.step,
            header.apply_late,
        )
        refusal = self.rounds.admit(push, self.clock())
        if refusal is not None:
            log.warning(
                "push refused",
                learner=peer.learner,
                round=header.round,
                fragment=header.fragment,
                base_version=header.base_version,
                version=self.rounds.versions[header.fragment],
                why=refusal.value,
            )
            raise RemoteProtocolError(_REFUSAL_CODES[refusal], f"round {header.round}: {refusal.value}")
        if resumed is not None:
            self.chunks_resumed += len(header.skipped)
            self.pushes.hold(push, resumed.cut.buffer, precision)
            return Resumed(resumed.cut.buffer, resumed.cut.held)
        buffer = memoryview(self.model.buffers.take(header.raw_bytes))
        self.pushes.hold(push, buffer, precision)
        return buffer

    def _peer_error(self, peer: _Peer, where: str, error: RemoteProtocolError) -> None:
        """Bad input on one of a learner's connections (a corrupt chunk, a truncated frame): the
        peer's fault, answered by the transport (STREAM_RESET, or closing that connection); said
        here once, with whose fault it was. Refusals by the schedule are logged where decided."""
        if error.code in (ErrorCode.NOT_REQUESTED, ErrorCode.STALE_VERSION):
            return
        log.warning(
            "bad input from learner",
            learner=peer.learner,
            fault="peer",
            where=where,
            code=error.code.name,
            detail=error.message,
        )

    def _shapes(self, fragment: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(entry.name, entry.shape) for entry in self.model.fragments[fragment].manifest]

    def _push_failed(self, peer: _Peer, cut: CutShort) -> None:
        """A push transfer that was admitted failed: forget it (its buffer may still be written).
        One its lost session cut short is kept with the chunks that arrived, for the learner to
        resume if it is asked for that round again."""
        header = cut.header
        if isinstance(header, PushHeader):
            # Not to the pool: the transfer may still be writing into it.
            held = self.pushes.take((peer.learner, header.round))
            if held is not None:
                self._apply(self.rounds.push_failed(held.push, self.clock()))
                if peer.session.closed.is_set() and cut.held and held.buffer is cut.buffer:
                    self._cut_pushes[peer.learner] = _CutPush(cut, peer.session)

    def _on_push(self, peer: _Peer, item: FragmentReceived) -> None:
        header = item.header
        if not isinstance(header, PushHeader):
            return
        held = self.pushes.get((peer.learner, header.round))
        if held is None or held.buffer is None:
            return
        self.bytes_in += header.raw_bytes
        self._spawn(self._screen(held.push, held.buffer, held.precision), f"screen {peer.learner}")

    async def _screen(self, push: Push, buffer: memoryview, precision: str) -> None:
        history = self.rounds.norm_history[push.fragment].samples()
        target = None
        if precision != "fp32":
            # Lossy pushes are decoded to float32 once, in the worker; the merge sees float32 only.
            target = memoryview(self.model.buffers.take(self.model.fragments[push.fragment].raw_bytes))
        shapes = self._shapes(push.fragment)

        def work() -> Verdict:
            data = buffer
            if target is not None:
                decode(buffer, shapes, precision, self.model.deltas(push.fragment, target))
                data = target
            return self.model.screen(
                push.fragment,
                data,
                history,
                self.config.max_norm_ratio,
                self.config.max_fragment_ratio,
                steps=push.c_steps,
            )

        key = (push.learner, push.round_index)
        try:
            verdict: Verdict = await asyncio.get_running_loop().run_in_executor(self._screener, work)
        except Exception as exc:
            # Whatever a push holds, it must not leave its buffer held and its round waiting for
            # it: a push that cannot be screened is a push that failed.
            log.error("push not screened", learner=push.learner, round=push.round_index, error=repr(exc))
            self.pushes.drop(key)
            if target is not None:
                self._give_back(target)
            self._apply(self.rounds.push_failed(push, self.clock()))
            return
        if target is not None:
            self.pushes.replace(key, target)
        if not verdict.accepted:
            log.warning(
                "push rejected",
                learner=push.learner,
                fragment=push.fragment,
                round=push.round_index,
                reason=verdict.reason,
                norm=verdict.norm,
                limit=verdict.limit,
                steps=push.c_steps,
            )
        self._apply(self.rounds.push_complete(push, verdict, self.clock()))

    # ------------------------------------------------------------------ decisions

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Request):
                self._request(action)
            elif isinstance(action, Merge):
                task = self._spawn(self._merge(action), f"merge {action.round_index}")
                if task is None:  # stopping: the round is dropped, its version kept
                    self.rounds.merge_failed(action.round_index, self.clock())
                else:
                    self._merges.add(task)
                    task.add_done_callback(self._merges.discard)
            elif isinstance(action, Release):
                log.info(
                    "push released",
                    learner=action.push.learner,
                    fragment=action.push.fragment,
                    round=action.push.round_index,
                    reason=action.reason,
                )
                self.pushes.drop((action.push.learner, action.push.round_index))
            elif isinstance(action, Carry):
                self._spawn(self._carry(action.push), f"carry {action.push.learner}")
        # A new round or a new quorum may have moved the next deadline.
        self._ticker_wake.set()

    async def _carry(self, push: Push) -> None:
        """A late push waits a cycle for its fragment's next round: on disk, not in memory."""
        problem = await self.pushes.carry((push.learner, push.round_index))
        if problem is not None:
            log.warning(
                "late push kept in memory",
                learner=push.learner,
                fragment=push.fragment,
                round=push.round_index,
                directory=str(self.pushes.directory),
                error=repr(problem),
            )

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None] | None:
        """Run work in the service's task group; a bug in it is logged, never fatal to the daemon
        (an exception in a task-group child would cancel every session)."""
        if self._tasks is None or self._stopping:
            work.close()
            return None

        async def guarded() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("internal error", task=name, error=repr(exc))

        return self._tasks.create_task(guarded(), name=name)

    def _request(self, request: Request) -> None:
        message = FragmentRequest(request.fragment, request.round_index, request.version)
        for learner in request.learners:
            peer = self.peers.get(learner)
            if peer is not None and peer.session.control.is_open:
                # Control messages are small; the session's deadlines cut off a peer that stops reading.
                have = self._push_held(learner, request)
                peer.session.control.send(replace(message, have=have) if have else message)

    def _push_held(self, learner: str, request: Request) -> bytes:
        """FragmentRequest.have: the chunks held of this learner's push for the round, cut short by
        its lost session (once that session's decodes are over), else b"". A request for the same
        fragment at another round lets the cut push go."""
        kept = self._cut_pushes.get(learner)
        if kept is None or kept.cut.header.fragment != request.fragment:
            return b""
        have = chunk_bitmap(kept.cut.held, kept.cut.header.chunks)
        idle = kept.session.decodes_idle.is_set()
        if kept.cut.header.round != request.round_index or not idle or len(have) > MAX_HAVE_BYTES:
            del self._cut_pushes[learner]
            return b""
        return have

    def _resumed_push(self, peer: _Peer, header: PushHeader) -> _CutPush | None:
        """The cut push a header with `skip` resumes, taken; UNKNOWN_TRANSFER (from the header,
        before admission) when this syncer does not hold every chunk it skips of those bytes."""
        if not header.skip:
            return None
        kept = self._cut_pushes.pop(peer.learner, None)
        if (
            kept is None
            or not kept.session.decodes_idle.is_set()
            or replace(header, skip=b"") != replace(kept.cut.header, skip=b"")
            or not set(header.skipped) <= set(kept.cut.held)
        ):
            raise RemoteProtocolError(
                ErrorCode.UNKNOWN_TRANSFER,
                f"round {header.round}: the push skips chunks this syncer does not hold of it",
            )
        return kept

    async def _merge(self, merge: Merge) -> None:
        started = self.clock()
        # The round collects no more: a push of it cut short will not be asked for again.
        over = [
            learner
            for learner, kept in self._cut_pushes.items()
            if kept.cut.header.round == merge.round_index
        ]
        for learner in over:
            del self._cut_pushes[learner]
        taken = [self.pushes.take((p.learner, p.round_index)) for p in merge.pushes]
        if any(h is None for h in taken):
            log.error("merge without its pushes", fragment=merge.fragment, round=merge.round_index)
            self.pushes.discard([h for h in taken if h is not None])
            self.rounds.merge_failed(merge.round_index, self.clock())
            return
        held = [h for h in taken if h is not None]
        buffers: list[memoryview] = []
        worked: list[float] = []  # when the worker began and ended this merge

        def run() -> Snapshot:
            # Carried pushes are read back here, and the merge takes its two outputs (Θ_p and b_p)
            # from the pool here: nothing fragment-sized is allocated or copied on the event loop.
            worked.append(time.perf_counter())
            try:
                buffers.extend(self.pushes.load_all(held))
                return self._merged(merge, buffers)
            finally:
                worked.append(time.perf_counter())

        self._merge_started[merge.round_index] = started
        try:
            snapshot: Snapshot = await asyncio.get_running_loop().run_in_executor(self._executor, run)
        except MergeRejected as exc:
            # Its pushes are not merged, counted by reason like pushes the screen rejects.
            for buffer in buffers:
                self._give_back(buffer)
            log.warning(
                "merge rejected",
                fragment=merge.fragment,
                round=merge.round_index,
                reason=exc.reason,
                detail=str(exc),
            )
            self.rounds.rejected[exc.reason] += len(merge.pushes)
            self.rounds.merge_failed(merge.round_index, self.clock())
            return
        except Exception as exc:
            # Its push buffers are dropped, not reused: the failure may have left them anywhere.
            log.error("merge failed", fragment=merge.fragment, round=merge.round_index, error=repr(exc))
            self.rounds.merge_failed(merge.round_index, self.clock())
            return
        finally:
            self._merge_started.pop(merge.round_index, None)
        # The round's sync time (ξ_sync) runs on until its learners hold this version (update_done).
        version = self.rounds.merged(merge.round_index, self.clock())
        self.model.publish(merge.fragment, snapshot)
        for buffer in buffers:
            self._give_back(buffer)
        log.info(
            "round merged",
            fragment=merge.fragment,
            round=merge.round_index,
            version=version,
            contributors=[p.learner for p in merge.pushes],
            # The round each contributor's push answered (a late push carried into this round
            # names its own): a push is (learner, round), so none may appear in two merges.
            push_rounds=[p.round_index for p in merge.pushes],
            base_versions=[p.base_version for p in merge.pushes],
            weights=[round(w, 4) for w in merge.weights],
            tokens=[p.c_tokens for p in merge.pushes],
            steps=[p.c_steps for p in merge.pushes],
            bytes=len(held) * self.model.fragments[merge.fragment].raw_bytes,
            read_back=sum(1 for h in held if h.buffer is None),
            grace_waited_s=round(merge.grace_waited_s, 4),
            duration_s=round(self.clock() - started, 4),
            # Of that, the merge worker's own time (reading carried pushes back, merging, stepping,
            # hashing); the rest waited for the worker (a checkpoint's copies, earlier merges).
            worker_s=round(worked[-1] - worked[0], 4),
            # xxh3-64 of the new fragment's bytes, so any copy of that version can be checked.
            digest=f"{snapshot.digest:016x}",
        )
        for peer in self.peers.values():
            peer.pending.setdefault(merge.fragment, None)
            peer.wake.set()
        self._ticker_wake.set()

    def _merged(self, merge: Merge, pushes: list[memoryview]) -> Snapshot:
        """The merge itself, in the merge worker."""
        return self.model.merge(
            merge.fragment,
            pushes,
            merge.weights,
            lr=self.config.outer_lr,
            mu=self.config.outer_momentum,
            merge=self.config.merge,
            version=merge.version + 1,
        )

    def _give_back(self, buffer: memoryview) -> None:
        """A push buffer (or a decoded push) back to the model's pool, which keeps a bounded count
        of idle buffers across sizes for reuse (syncer.buffers)."""
        self.model.buffers.give(buffer.obj)  # type: ignore[arg-type]  # always a pool buffer

    def _size_pool(self) -> None:
        """Keep idle what a round needs: a push per connected learner and the merge's two outputs
        (a master and a momentum retired by a merge come back in their place)."""
        self.model.buffers.max_idle = len(self.peers) + 2

    # ------------------------------------------------------------------ updates

    async def _send_updates(self, peer: _Peer) -> None:
        """Send this learner the newest snapshot of every fragment it lacks, the longest waiting
        first; an update superseded while queued goes out once, at its newest version. As many at
        a time as _update_window allows: one where the round trip is short (on loopback the
        receiver is the bottleneck, and two updates in flight made a heal slower:
        bench/notes/checkpoint-and-heal.md), enough to keep the link busy across a WAN's round
        trip, where one at a time costs a round trip per fragment (a heal of 24 small fragments
        took 24 round trips: bench/notes/wan-rtt.md). A fragment is never in flight twice. The
        first heal is logged once, with its duration and rate."""
        failures: dict[int, int] = defaultdict(int)
        heal_started, heal_bytes, heal_sent = self.clock(), 0, 0
        in_flight: dict[int, asyncio.Task[int]] = {}
        try:
            while True:
                window = self._update_window(peer)
                for index in [i for i in peer.pending if i not in in_flight]:
                    if len(in_flight) >= window:
                        break
                    del peer.pending[index]
                    in_flight[index] = asyncio.create_task(
                        self._send_update(peer, index, failures), name=f"update {peer.learner} {index}"
                    )
                if not in_flight and not peer.pending:
                    if not peer.healed.is_set():
                        seconds = max(self.clock() - heal_started, 1e-9)
                        log.info(
                            "learner healed",
                            learner=peer.learner,
                            fragments=len(self.model.fragments),
                            sent=heal_sent,
                            bytes=heal_bytes,
                            duration_s=round(seconds, 3),
                            gbit_s=round(heal_bytes * 8 / seconds / 1e9, 3),
                        )
                    peer.healed.set()
                peer.wake.clear()
                woken = asyncio.ensure_future(peer.wake.wait())
                try:
                    await asyncio.wait([*in_flight.values(), woken], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woken.cancel()
                for index, task in list(in_flight.items()):
                    if task.done():
                        del in_flight[index]
                        sent = task.result()  # a closed session ends this learner's sends
                        if not peer.healed.is_set():
                            heal_bytes += sent
                            heal_sent += 1 if sent else 0
        finally:
            for task in in_flight.values():
                task.cancel()
            await asyncio.gather(*in_flight.values(), return_exceptions=True)

    def _update_window(self, peer: _Peer) -> int:
        """Updates this learner may have in flight: 1 below UPDATE_PIPELINE_MIN_RTT_S of round trip
        (as the kernel measured it on the control connection), else enough of the largest to keep
        AUTO_RATE_GBPS x RTT in flight, plus one, at most MAX_UPDATES_IN_FLIGHT."""
        rtt_s = peer.session.round_trip_s()
        if rtt_s is None or rtt_s < UPDATE_PIPELINE_MIN_RTT_S:
            return 1
        largest = max((store.update_bytes for store in self.model.fragments), default=1) or 1
        in_flight = AUTO_RATE_GBPS * 1e9 / 8 * rtt_s
        return max(1, min(MAX_UPDATES_IN_FLIGHT, math.ceil(in_flight / largest) + 1))

    async def _send_update(self, peer: _Peer, index: int, failures: dict[int, int]) -> int:
        """One fragment's newest snapshot to this learner, unless it has that version already; the
        bytes sent (0 when nothing was). A failed transfer is queued again, up to UPDATE_ATTEMPTS."""
        store = self.model.fragments[index]
        snapshot = self.model.acquire(index)
        try:
            if peer.sent.get(index) == snapshot.version:
                self.rounds.update_done(peer.learner, index, snapshot.version, self.clock())
                return 0
            header = UpdateHeader(
                store.update_manifest,
                store.update_bytes,
                self.config.codec,
                self.config.chunk,
                fragment=index,
                version=snapshot.version,
                precision=self.model.update_precision,
                skip=self._resumable(peer, index, snapshot.version),
            )
            data, checksums = snapshot.buffer, snapshot.checksums
            if self.model.update_precision != "fp32":
                encoding = await self._encoded(index, snapshot)
                data, checksums = encoding.buffer, encoding.checksums
            await peer.session.send_fragment(header, data, checksums=checksums)
            peer.sent[index] = snapshot.version
            sent = store.update_bytes - header.skipped_bytes
            self.chunks_resumed += len(header.skipped)
            self.bytes_out += sent
            failures.pop(index, None)
            # Acknowledged: the end of this learner's part of the round's sync time (ξ_sync).
            self.rounds.update_done(peer.learner, index, snapshot.version, self.clock())
            return sent
        except TransferFailed as exc:
            failures[index] += 1
            log.warning("update failed", learner=peer.learner, fragment=index, error=str(exc))
            if failures[index] < UPDATE_ATTEMPTS:
                peer.pending.setdefault(index, None)
                peer.wake.set()
            else:  # given up until the next version: the round no longer waits on this send
                self.rounds.update_done(peer.learner, index, snapshot.version, self.clock())
            return 0
        finally:
            # The encoding is kept while a healed learner still waits for this version (after
            # a merge, every one of them): one encoding per version, shared.
            waiting = any(index in other.pending and other.joined for other in self.peers.values())
            self.model.release(index, snapshot, keep_encoding=waiting)

    def _resumable(self, peer: _Peer, index: int, version: int) -> bytes:
        """The chunks of this version the learner holds from a transfer its lost session cut short
        (JOIN.partial), as the header's skip; b"" to send it whole. Used once: a send that fails
        again is sent whole, as the learner drops what it held once it is offered a transfer."""
        held = peer.partial.pop(index, None)
        if held is None or held[0] != version:
            return b""
        chunks = -(-self.model.fragments[index].update_bytes // self.config.chunk)
        return held[1] if fits_chunks(held[1], chunks) and any(held[1]) else b""

    async def _encoded(self, index: int, snapshot: Snapshot) -> Encoding:
        """The snapshot's encoding at the update precision: the one kept on it, else made in the
        encoder thread (once for all the sends that ask meanwhile) and kept on it."""
        if snapshot.encoding is not None:
            return snapshot.encoding
        pending = self._encoding.get(index)
        if pending is None or pending[0] is not snapshot:
            future = asyncio.get_running_loop().run_in_executor(
                self._encoder, self.model.encode, index, snapshot.buffer
            )
            pending = self._encoding[index] = (snapshot, future)
            future.add_done_callback(partial(self._encoding_made, index, snapshot))
        # Shielded: a send cancelled meanwhile must not cancel the encoding others wait for.
        made = await asyncio.shield(pending[1])
        # Attached by _encoding_made before this resumed; this send's hold keeps it there.
        return snapshot.encoding if snapshot.encoding is not None else made

    def _encoding_made(self, index: int, snapshot: Snapshot, future: asyncio.Future[Encoding]) -> None:
        """Kept on its snapshot as soon as it is made (before any waiting send resumes), whoever
        still waits for it. A snapshot's buffer is held by the send that asked, so it is intact."""
        if self._encoding.get(index, (None, None))[1] is future:
            del self._encoding[index]
        if future.cancelled() or future.exception() is not None:
            return
        self.model.attach_encoding(snapshot, future.result())

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        rounds = self.rounds
        now = self.clock()
        self._forget_gone(now)
        total_weight = sum(r.weight_total for r in rounds.learners.values()) or 1.0
        listed = sorted(
            rounds.learners.values(), key=lambda r: (r.learner not in self.peers, not r.live, r.idle_s(now))
        )[:STATUS_MAX_LEARNERS]
        return {
            "role": "syncer",
            "incarnation": self.incarnation,
            "uptime_s": round(now - self.started_at, 3),
            "clock": rounds.clock,
            "next_round": rounds.next_round,
            "fragments": [
                {"index": s.index, "version": s.current.version if s.current else s.version}
                for s in self.model.fragments
            ],
            # Largest fragment over the mean (numel); 1.0 is perfectly even (docs/design.md §3.1).
            "fragment_imbalance": round(self.model.plan.imbalance, 4),
            "steps_per_s_window_s": round(self.step_rates.window_s),
            "learners": [
                {
                    "id": r.learner,
                    "connected": r.learner in self.peers,
                    "live": r.live,
                    "contributions": r.contributions,
                    # Push headers sent, and those whose bytes were not merged (upload wasted).
                    "pushes": r.pushes,
                    "pushes_wasted": r.pushes_wasted,
                    "weight_share": _finite(r.weight_total / total_weight, 6),
                    # Throughput: step reports over the last steps_per_s_window_s of wall time.
                    "steps_per_s": _finite(self.step_rates.rate(r.learner, now), 4),
                    # The mean reported step time (the step alone, not what happens between steps).
                    "step_time_s": _finite(r.step_time.value or 0.0, 6),
                    "steps": r.steps,
                    "step": r.local_step,
                    # Rounds answered with NOTHING_TO_PUSH (no step since the last push).
                    "passes": r.passes,
                    # Steps between a round's due step and this learner's snapshot, and between a
                    # snapshot and the apply of its merge (as its pushes report them).
                    "snapshot_late_steps": quantiles(r.snapshot_late),
                    "apply_late_steps": quantiles(r.apply_late),
                    "tokens": r.tokens,
                    # Reported step time over wall time since the id first joined.
                    "goodput": _finite(r.goodput(now), 4),
                    "useful_s": _finite(r.useful_s, 3),
                    "tracked_s": _finite(r.tracked_s(now), 3),
                }
                for r in sorted(listed, key=lambda r: r.learner)
            ],
            # Learners in the roster; the status lists STATUS_MAX_LEARNERS of them at most.
            "learners_total": len(rounds.learners),
            "mode": "lock-step" if rounds.config.lockstep else "decoupled",
            "rounds_merged": rounds.rounds_merged,
            "rounds_abandoned": rounds.rounds_abandoned,
            # Rounds due but not opened: "busy" (the fragment's previous round still open) or
            # "merges-behind" (the merge worker had MAX_MERGES_BEHIND rounds waiting).
            "rounds_skipped": dict(rounds.rounds_skipped),
            "quorum_sizes": {str(k): v for k, v in sorted(rounds.quorum_sizes.items())},
            "grace_waited_s": round(rounds.grace_waited_s, 4),
            # Pushes held (admitted, not yet merged or let go); of them, late ones whose bytes wait
            # for their fragment's next round in files; late pushes written out so far.
            "pushes_held": len(self.pushes.pending()),
            "late_pushes_on_disk": self.pushes.on_disk(),
            "late_pushes_written": self.pushes.written,
            # Fragment-sized buffers the pool has mapped (a steady state maps none) and freed.
            "pool_buffers_created": self.model.buffers.created,
            "pool_buffers_freed": self.model.buffers.freed,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            # A damaging path shows here: chunks of pushes that arrived damaged and were asked for
            # again; and what rejoins did not need sent again (fragments held at their version).
            "chunks_asked_again": self._chunks_asked_again_ended
            + sum(peer.session.chunks_asked_again for peer in self.peers.values()),
            "fragments_held_at_join": self.fragments_held_at_join,
            "chunks_resumed": self.chunks_resumed,
            # How updates travel (bytes_out counts them at it).
            "update_precision": self.model.update_precision,
            "rejected_pushes": sum(rounds.rejected.values()),
            "rejected_by_reason": dict(rounds.rejected),
            "checkpoints_written": self.checkpoints_written,
            # Session handlers that failed by a bug of their own (logged with the traceback).
            "handler_errors": self._server.handler_errors if self._server is not None else 0,
            "loop_lag_ms": self._lag.figures(),
            "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            # Checkpoints failed since the last one written (a full disk), and the last reason.
            "checkpoints_failed": self.checkpoints_failed,
            "checkpoint_problem": self.checkpoint_problem,
        }


def _finite(value: float, digits: int) -> float:
    """A roster figure for JSON and msgpack: rounded, and 0.0 in place of an infinity or NaN."""
    return round(value, digits) if math.isfinite(value) else 0.0
