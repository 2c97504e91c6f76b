"""The syncer's round state machine (docs/design.md §3.2 and §3.4) as a pure object with injected time.

It owns the roster (who is live, how fast each learner steps, what each contributed), the global
clock, the versions of the fragments, and every open round: which learners were asked, which
pushes arrived, when quorum was reached and how long the grace window runs. It decides; the
service acts. Every input is a method call that takes `now` (seconds on any monotonic clock), and
every decision comes back as a value: requests to send, rounds to merge, pushes to drop.

What it deliberately does not hold: tensors (the service keeps the pushed buffers, keyed by
(learner, round)), sockets, clocks, logging. Schedule and weights come from dilocod.outer, which
nothing here re-implements.

Push life cycle. A push header is admitted or refused at once (NOT_REQUESTED, STALE_VERSION:
refusing before the bytes arrive saves the link). Once the whole fragment has arrived and the
service has screened it (outer.check_outer_gradient against that fragment's `norm_history`; norms of
fragments of different sizes are not comparable), `push_complete` records it and feeds its norm to
that history, whatever the verdict. A push that completes after its round started merging is late:
it is carried into the next round of the same fragment, with its weight, unless by then its base
version is more than `staleness` versions behind (a Carry says so, and the service may keep its
bytes out of memory for that cycle).

Sync time. A round's ξ_sync sample runs from the moment it starts merging until every learner it
asked that is still live holds the merged version: acknowledged it (or a newer one), or had its
update given up, or left (`update_done`, `leave`). Every, not the first: the grace window budgets
the time until the merged fragment is back where it is applied, and the last learner to get it
applies it last. A slow reader can only make ξ_sync larger, which shortens grace windows (rounds
merge sooner, never later); its update's own deadlines end the sample.

Who a round waits for: the learners it asked that are live and have not answered, minus those
whose push was screened out, refused as stale or failed in transit (a learner does not push a round
twice unless it is asked again on a rejoin). A carried push does not answer for its learner. After
one whole cycle of the schedule a round waits for nobody: a push held up in flight must not keep
its fragment from its next turn.

What one learner's numbers can do to the others. Step times, step and token counts are the learners'
own word (range-checked when decoded). How long a round waits is taken from medians of the asked
learners' step times, and a cycle also ends once the clock (the quorum's steps) has gone H steps
past the round's opening, so one learner reporting slow steps neither stretches the grace window
nor keeps a fragment from its next turn; merge weights are bounded per learner
(outer.weights.bounded_merge_weights). Totals saturate at MAX_TOTAL, and the roster forgets
learners gone longer than the caller's retention, and all but the MAX_GONE_LEARNERS most recent.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter, OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
from enum import Enum

from dilocod.config import SyncerConfig
from dilocod.outer import RoundOpening, open_rounds, quorum_clock, round_fragment, rounds_due
from dilocod.outer.guard import NormHistory, Verdict
from dilocod.outer.schedule import due_step
from dilocod.outer.weights import bounded_merge_weights
from dilocod.wire.messages import QUORUM_ALL

#: Ended rounds remembered (to admit late pushes), in units of the fragment count.
CLOSED_ROUNDS_PER_FRAGMENT = 2
#: The shortest time a round waits for learners that have not answered (see Rounds._expires_at).
MIN_WAIT_S = 1.0
#: A learner's token total saturates here: exact in float64 and in every JSON reader.
MAX_TOTAL = 2**53 - 1
#: Learners that left, remembered (for status and goodput) beyond those live: the most recent ones.
MAX_GONE_LEARNERS = 1024
#: Lock-step: the shortest time a round waits for a learner it asked that has not answered (the
#: others stand still meanwhile; a learner gives up on a merge after its --join-timeout-s).
LOCKSTEP_MIN_WAIT_S = 30.0
#: Decoupled rounds that fall due while this many rounds wait for (or are in) the service's merge
#: worker are skipped: their fragments sync at their next turn. Each queued round holds up to M
#: fragment-sized pushes, so a syncer whose merges cannot keep up with the schedule (too few
#: cores) holds a bounded backlog, not a growing one; the learners train on, and their next pushes
#: carry the steps. Lock-step skips no round.
MAX_MERGES_BEHIND = 2
#: The defaults of the syncer's settings, declared once in dilocod.config.daemons.
_DEFAULTS = SyncerConfig()
#: Lateness samples (steps between a round's due step and a learner's snapshot or apply) kept per
#: learner for the status's median and p99.
LATENESS_SAMPLES = 1024


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """The schedule's knobs (docs/design.md §3.6 defaults): the syncer's settings of the same
    names (RoundConfig.of), and their defaults."""

    fragments: int = _DEFAULTS.fragments  # P
    sync_every: int = _DEFAULTS.sync_every  # H
    overlap: int = _DEFAULTS.overlap  # tau
    quorum: int = _DEFAULTS.quorum  # K; QUORUM_ALL: lock-step, every live learner
    grace_factor: float = _DEFAULTS.grace_factor  # gamma
    #: A push may be merged into a fragment at most this many versions ahead of its base.
    staleness: int = _DEFAULTS.staleness
    #: Weight of the newest sample in the running means (step, quorum and sync times).
    ema_alpha: float = 0.2

    def __post_init__(self) -> None:
        for name in ("fragments", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.quorum < 0:
            raise ValueError(f"quorum must be at least 1, or QUORUM_ALL ({QUORUM_ALL}), got {self.quorum}")
        if self.overlap < 0 or self.staleness < 0:
            raise ValueError("overlap and staleness must not be negative")
        if not (math.isfinite(self.grace_factor) and self.grace_factor >= 0):
            raise ValueError(f"grace_factor must be finite and non-negative, got {self.grace_factor}")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")

    @property
    def lockstep(self) -> bool:
        return self.quorum == QUORUM_ALL

    @classmethod
    def of(cls, config: SyncerConfig, *, fragments: int) -> RoundConfig:
        """The syncer's settings of the same names, for a plan of this many fragments (the
        model may have fewer pieces than --fragments asks)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"fragments", "ema_alpha"}
        return cls(fragments=fragments, **{name: getattr(config, name) for name in names})


class RoundState(Enum):
    OPEN = "open"  # requests out, collecting pushes
    MERGING = "merging"  # handed to the service's merge worker
    MERGED = "merged"
    ABANDONED = "abandoned"


class Refusal(Enum):
    """Why a push header is refused (the service maps these to wire error codes)."""

    NOT_REQUESTED = "not-requested"  # unknown round, wrong fragment, not asked, or a second push
    STALE_VERSION = "stale-version"  # base version too old, or newer than the syncer's


@dataclass(frozen=True, slots=True)
class Push:
    """One learner's outer gradient for one fragment, as far as the schedule cares."""

    learner: str
    round_index: int
    fragment: int
    base_version: int
    c_steps: int
    c_tokens: int
    #: The learner's own step at its snapshot, and how late (steps) it applied this fragment's
    #: previous merge; None when its push header did not say.
    step: int | None = None
    apply_late: int | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """Ask these learners for their outer gradient of `fragment` (FRAGMENT_REQUEST)."""

    round_index: int
    fragment: int
    version: int
    learners: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Merge:
    """Merge these pushes (weights sum to 1, zero-weight pushes already left out) into
    `fragment` at `version`; call `merged` when done."""

    round_index: int
    fragment: int
    version: int
    pushes: tuple[Push, ...]
    weights: tuple[float, ...]
    grace_waited_s: float


@dataclass(frozen=True, slots=True)
class Release:
    """The service may free the buffer of this push: it will never be merged."""

    push: Push
    reason: str


@dataclass(frozen=True, slots=True)
class Carry:
    """This push is late: it waits for its fragment's next round (a cycle away), merged there
    unless let go first. The service may move its bytes out of memory meanwhile (syncer.pushes)."""

    push: Push


Action = Request | Merge | Release | Carry


@dataclass(slots=True)
class _Ema:
    alpha: float
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.alpha * (sample - self.value)


@dataclass(slots=True)
class LearnerRecord:
    """What the syncer knows of one learner, live or not."""

    learner: str
    live: bool
    #: Steps in the clock's units: set to the clock on (re)join, +1 per step report.
    progress: int
    step_time: _Ema
    steps: int = 0
    #: The learner's own step counter as it last reported it. Unlike `steps` (reports this
    #: syncer has received) it outlives the syncer's restarts, and it goes back when the learner
    #: restarts from an older save of its state: the steps its current model has trained.
    local_step: int = 0
    tokens: int = 0
    contributions: int = 0
    #: Push headers this learner sent, and those of them whose bytes were not merged: refused at
    #: the header, or received and then released (screened out, stale, superseded, zero weight).
    #: Each wasted one was upload bandwidth for nothing.
    pushes: int = 0
    pushes_wasted: int = 0
    #: Sum of this learner's merge weights over all merged rounds.
    weight_total: float = 0.0
    #: When this learner id first joined (on the caller's clock), and the sum of the step times it
    #: has reported since: the goodput's two terms. Both outlive the learner's restarts (the id
    #: is stable) and leaves; steps it trains while not joined are never reported here.
    first_joined: float | None = None
    useful_s: float = 0.0
    #: When this learner last left (on the caller's clock); None while it is live.
    left_at: float | None = None
    #: Rounds it answered with NOTHING_TO_PUSH (no step since its last push of the fragment).
    passes: int = 0
    #: Steps between each round's due step and this learner's snapshot for it, and between its
    #: snapshots and the applies of their merges (as its pushes report them): the newest ones.
    snapshot_late: deque[int] = field(default_factory=lambda: deque(maxlen=LATENESS_SAMPLES))
    apply_late: deque[int] = field(default_factory=lambda: deque(maxlen=LATENESS_SAMPLES))

    @property
    def steps_per_s(self) -> float:
        value = self.step_time.value
        return 0.0 if not value else 1.0 / value

    def tracked_s(self, now: float) -> float:
        """Wall time since this learner id first joined."""
        return 0.0 if self.first_joined is None else max(0.0, now - self.first_joined)

    def idle_s(self, now: float) -> float:
        """Wall time since this learner left; 0 while it is live."""
        return 0.0 if self.left_at is None else max(0.0, now - self.left_at)

    def goodput(self, now: float) -> float:
        """Share of the wall time since the first join spent in reported training steps: time a
        learner spends restarting, healing, stopped or cut off (its reports lost) is not useful."""
        tracked = self.tracked_s(now)
        return self.useful_s / tracked if tracked > 0 else 0.0


@dataclass(slots=True)
class _SendBack:
    """A merged round whose fragment is on its way back to the learners it asked (ξ_sync)."""

    fragment: int
    version: int
    merge_started_at: float
    #: Learners asked in the round, live at the merge, that do not hold `version` yet.
    waiting: set[str]


@dataclass(slots=True)
class _Round:
    index: int
    fragment: int
    version: int
    opened_at: float
    requested: set[str]
    #: The clock when the round opened: a cycle after it (sync_every steps), it waits for nobody.
    opened_clock: int = 0
    state: RoundState = RoundState.OPEN
    #: Completed, accepted pushes (only while the round is open: later ones are carried).
    pushes: dict[str, Push] = field(default_factory=dict)
    #: Learners whose push header was admitted and has not failed: one push per learner a round.
    admitted: set[str] = field(default_factory=set)
    #: Learners whose push was screened out, refused as stale or failed in transit: nothing more
    #: is expected of them this round (unless they are asked again).
    refused: set[str] = field(default_factory=set)
    #: Learners that answered NOTHING_TO_PUSH: no contribution, and nothing more expected.
    passed: set[str] = field(default_factory=set)
    quorum_at: float | None = None
    deadline: float | None = None
    merge_started_at: float | None = None
    #: Set once the round has waited a whole cycle and stopped waiting for anyone (_expires_at).
    waited_out: bool = False


class Rounds:
    """The round state machine of one syncer. Not thread-safe: the event loop owns it."""

    def __init__(self, config: RoundConfig, versions: list[int] | None = None, next_round: int = 0) -> None:
        if versions is not None and len(versions) != config.fragments:
            raise ValueError(f"{len(versions)} versions for {config.fragments} fragments")
        self.config = config
        self.versions: list[int] = list(versions) if versions is not None else [0] * config.fragments
        self.clock = 0
        self.next_round = next_round
        self.learners: dict[str, LearnerRecord] = {}
        #: The norms of the pushes screened recently, per fragment (what the guard compares against).
        self.norm_history: defaultdict[int, NormHistory] = defaultdict(NormHistory)
        self.rounds_merged = 0
        self.rounds_abandoned = 0
        #: Rounds not opened: their fragment's previous round was still open ("busy"), or the merge
        #: worker was MAX_MERGES_BEHIND rounds behind ("merges-behind").
        self.rounds_skipped: Counter[str] = Counter()
        self.quorum_sizes: Counter[int] = Counter()
        self.grace_waited_s = 0.0
        self.rejected: Counter[str] = Counter()
        self._open: dict[int, _Round] = {}  # by round index: OPEN or MERGING
        #: Rounds that ended, newest last, kept a while to admit their late pushes.
        self._closed: OrderedDict[int, _Round] = OrderedDict()
        self._carried: dict[int, dict[str, Push]] = {}  # by fragment: late pushes, by learner
        self._quorum_time = _Ema(config.ema_alpha)
        self._sync_time = _Ema(config.ema_alpha)
        #: Merged rounds whose update has not reached every learner they asked, by round index.
        self._sending: OrderedDict[int, _SendBack] = OrderedDict()
        #: Learners sent a PLAN and not healed yet: lock-step opens no round meanwhile, so that
        #: every round from the PLAN's next_round on asks them.
        self.joining: set[str] = set()

    # ------------------------------------------------------------------ roster

    def begin_join(self, learner: str) -> int:
        """A learner is being sent its PLAN: the round its schedule starts at (PLAN next_round).
        Lock-step opens no round until it has joined (join) or its session ended (end_join)."""
        self.joining.add(learner)
        return self.next_round

    def end_join(self, learner: str, now: float) -> list[Action]:
        """A session that was sent a PLAN ended before its learner healed."""
        self.joining.discard(learner)
        return self.tick(now)

    def join(self, learner: str, now: float) -> list[Action]:
        """A learner is live (connected and healed): it counts for the clock from here, and is
        asked for every fragment whose round is still collecting."""
        self.joining.discard(learner)
        record = self.learners.get(learner)
        if record is None:
            record = LearnerRecord(learner, True, self.clock, _Ema(self.config.ema_alpha))
            self.learners[learner] = record
        if record.first_joined is None:
            record.first_joined = now
        record.live = True
        record.left_at = None
        # Its earlier progress means nothing after a restart; starting at the clock neither holds
        # the clock back nor lets the newcomer run it ahead.
        record.progress = self.clock
        actions: list[Action] = []
        for rnd in self._open.values():
            if rnd.state is RoundState.OPEN and learner not in rnd.pushes:
                rnd.requested.add(learner)
                rnd.refused.discard(learner)  # asked again: its answer is expected again
                rnd.passed.discard(learner)
                actions.append(Request(rnd.index, rnd.fragment, rnd.version, (learner,)))
        return [*actions, *self.tick(now)] if self.config.lockstep else actions

    def leave(self, learner: str, now: float) -> list[Action]:
        """A learner is gone: it is simply absent from the rounds (its completed pushes stay)."""
        record = self.learners.get(learner)
        if record is not None:
            record.live = False
            record.left_at = now
        for rnd in self._open.values():
            rnd.requested.discard(learner)
            if learner not in rnd.pushes:
                rnd.admitted.discard(learner)
        for sending in self._sending.values():
            sending.waiting.discard(learner)  # nothing more reaches it: it no longer holds a sync up
        self._settle_send_backs(now)
        return self.tick(now)

    def step(
        self, learner: str, tokens: int, step_time_s: float, now: float, *, local_step: int | None = None
    ) -> list[Action]:
        """One inner step of a live learner (STEP_REPORT; local_step is the report's own counter)."""
        record = self.learners.get(learner)
        if record is None or not record.live:
            return []
        record.progress += 1
        record.steps += 1
        if local_step is not None:
            record.local_step = local_step
        record.tokens = min(record.tokens + max(0, tokens), MAX_TOTAL)
        if math.isfinite(step_time_s) and step_time_s > 0 and math.isfinite(record.useful_s + step_time_s):
            record.step_time.add(step_time_s)
            record.useful_s += step_time_s
        return self.tick(now)

    def restore_learner(
        self,
        learner: str,
        *,
        tracked_s: float,
        useful_s: float,
        now: float,
        local_step: int = 0,
        idle_s: float = 0.0,
    ) -> None:
        """A learner known before a restart of the syncer (from its checkpoint): not live, with
        its goodput terms and last reported step carried over. tracked_s is its wall time since it
        first joined, as of `now`, and idle_s the time since it left; the caller adds the time the
        syncer was down to both, since the learner lost that too."""
        if learner in self.learners:
            return
        record = LearnerRecord(learner, False, self.clock, _Ema(self.config.ema_alpha))
        record.first_joined = now - max(0.0, tracked_s)
        record.useful_s = max(0.0, useful_s)
        record.local_step = max(0, local_step)
        record.left_at = now - max(0.0, idle_s)
        self.learners[learner] = record

    def forget_gone(self, now: float, retention_s: float, keep: int = MAX_GONE_LEARNERS) -> list[str]:
        """Drop the learners that left more than retention_s ago, and all but the `keep` that left
        last; a learner whose push is still held (admitted to an open round, or carried) stays
        until it is merged or released. Returns the ids dropped (the caller drops what it keeps per id)."""
        held = {learner for rnd in self._open.values() for learner in (*rnd.pushes, *rnd.admitted)}
        held.update(learner for carried in self._carried.values() for learner in carried)
        gone = sorted(
            (r for r in self.learners.values() if not r.live and r.learner not in held),
            key=lambda r: r.idle_s(now),
        )
        dropped = [r.learner for rank, r in enumerate(gone) if rank >= keep or r.idle_s(now) > retention_s]
        for learner in dropped:
            del self.learners[learner]
        return dropped

    def live(self) -> list[str]:
        return [r.learner for r in self.learners.values() if r.live]

    # ------------------------------------------------------------------ pushes

    def admit(self, push: Push, now: float) -> Refusal | None:
        """A push header arrived: None to receive its bytes, or why it is refused."""
        record = self.learners.get(push.learner)
        if record is not None:
            record.pushes += 1
            self._record_lateness(record, push.round_index, push.step, push.apply_late)
        refusal = self._admission(push)
        if refusal is not None:
            self._count_wasted(push)
        return refusal

    def _admission(self, push: Push) -> Refusal | None:
        rnd = self._open.get(push.round_index) or self._closed.get(push.round_index)
        if (
            rnd is None
            or rnd.fragment != push.fragment
            or push.learner not in rnd.requested
            or push.learner in rnd.admitted
        ):
            return self._refuse(Refusal.NOT_REQUESTED)
        current = self.versions[push.fragment]
        if push.base_version > current or push.base_version + self.config.staleness < current:
            # Nothing more will come from this learner for this round: its grace window no
            # longer waits for it (and a carried push of its own, if any, answers for it).
            rnd.refused.add(push.learner)
            return self._refuse(Refusal.STALE_VERSION)
        rnd.admitted.add(push.learner)
        return None

    def nothing_to_push(
        self, learner: str, round_index: int, fragment: int, step: int, now: float
    ) -> list[Action]:
        """The learner answered a request with NOTHING_TO_PUSH (no step since its last push of the
        fragment): the round no longer waits for it, and nothing of it is merged or counted wasted.
        An answer for a round that did not ask it (or has ended) changes nothing."""
        record = self.learners.get(learner)
        rnd = self._open.get(round_index)
        if record is None or rnd is None or rnd.fragment != fragment or learner not in rnd.requested:
            return []
        if learner in rnd.admitted or learner in rnd.pushes:
            return []  # it pushed already: a contradicting answer does not undo the push
        record.passes += 1
        self._record_lateness(record, round_index, step, None)
        rnd.passed.add(learner)
        return self.tick(now)

    def _record_lateness(
        self, record: LearnerRecord, round_index: int, step: int | None, apply_late: int | None
    ) -> None:
        if step is not None:
            due = due_step(round_index, self.config.sync_every, self.config.fragments)
            record.snapshot_late.append(max(0, step - due))
        if apply_late is not None:
            record.apply_late.append(apply_late)

    def push_complete(self, push: Push, verdict: Verdict, now: float) -> list[Action]:
        """The whole push arrived and was screened. Accepted ones join their round, or the next
        round of their fragment when theirs is already merging."""
        rnd = self._open.get(push.round_index)
        # Every screened push teaches the guard the scale, rejected ones too: fed only accepted
        # norms, a lasting jump in scale above the ratio (a warm-up) rejected every later push of
        # the fragment until a restart (38 honest pushes in 3 s). The history keeps one sample per
        # learner and round and leaves out empty pushes (outer/guard.py says what a rogue can do).
        self.norm_history[push.fragment].record(push.round_index, push.learner, verdict.norm, push.c_steps)
        if not verdict.accepted:
            self.rejected[verdict.reason] += 1
            if rnd is not None:
                rnd.refused.add(push.learner)
            return [self._release(push, verdict.reason), *self.tick(now)]
        if rnd is not None and rnd.state is RoundState.OPEN:
            rnd.pushes[push.learner] = push
        else:
            carried = self._carried.setdefault(push.fragment, {})
            previous = carried.get(push.learner)
            carried[push.learner] = push
            actions: list[Action] = [Carry(push)]
            if previous is not None:
                actions.append(self._release(previous, "superseded by a later push"))
            return [*actions, *self.tick(now)]
        return self.tick(now)

    def push_failed(self, push: Push, now: float) -> list[Action]:
        """An admitted push never completed (a corrupt chunk, a transfer reset, the learner gone).
        A learner does not push a failed round again unless it is asked again (join), so the
        round stops waiting for it; a new header of its own is still admitted."""
        rnd = self._open.get(push.round_index) or self._closed.get(push.round_index)
        if rnd is not None:
            rnd.admitted.discard(push.learner)
            rnd.refused.add(push.learner)
        return self.tick(now)

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list[Action]:
        """Advance the clock, open the rounds it made due, and start the merges that are ready."""
        actions: list[Action] = []
        live = [r for r in self.learners.values() if r.live]
        busy = {rnd.fragment for rnd in self._open.values()}
        if self.config.lockstep:
            # The slowest live learner's own step: round r opens once every learner has reached
            # its due step (and is waiting there for the request).
            if live:
                self.clock = quorum_clock((r.local_step for r in live), len(live), self.clock)
            openings = self._lockstep_openings(busy)
        else:
            self.clock = quorum_clock((r.progress for r in live), self.config.quorum, self.clock)
            openings = open_rounds(
                self.clock, self.next_round, busy, self.config.sync_every, self.config.fragments
            )
        behind = sum(1 for rnd in self._open.values() if rnd.state is RoundState.MERGING)
        for opening in openings:
            self.next_round = opening.round_index + 1
            if opening.skipped:
                self.rounds_skipped["busy"] += 1
                continue
            if behind >= MAX_MERGES_BEHIND and not self.config.lockstep:
                self.rounds_skipped["merges-behind"] += 1
                continue
            rnd = _Round(
                opening.round_index,
                opening.fragment,
                self.versions[opening.fragment],
                now,
                {r.learner for r in live},
                self.clock,
            )
            self._open[rnd.index] = rnd
            actions.append(Request(rnd.index, rnd.fragment, rnd.version, tuple(sorted(rnd.requested))))
        for rnd in sorted(self._open.values(), key=lambda r: r.index):
            if rnd.state is RoundState.OPEN:
                actions.extend(self._maybe_merge(rnd, now))
        return actions

    def _lockstep_openings(self, busy: set[int]) -> list[RoundOpening]:
        """Lock-step skips no round: the due rounds open in order, up to the first whose fragment
        still has a round open (it opens once that one has ended), and none while a learner is
        healing (begin_join)."""
        openings: list[RoundOpening] = []
        if self.joining:
            return openings
        for round_index in range(
            self.next_round, rounds_due(self.clock, self.config.sync_every, self.config.fragments)
        ):
            fragment = round_fragment(round_index, self.config.fragments)
            if fragment in busy:
                break
            busy.add(fragment)
            openings.append(RoundOpening(round_index, fragment, False))
        return openings

    def next_deadline(self) -> float | None:
        """When tick must run next even if nothing arrives: the earliest grace deadline, or the
        earliest moment an open round stops waiting for its learners (_expires_at)."""
        deadlines = [
            when
            for r in self._open.values()
            if r.state is RoundState.OPEN
            for when in (r.deadline, None if r.waited_out else self._expires_at(r))
            if when is not None
        ]
        return min(deadlines, default=None)

    def merged(self, round_index: int, now: float) -> int:
        """The service finished a Merge: the fragment's new version. The round's sync time runs on
        until every learner it asked holds that version (update_done)."""
        rnd = self._open.get(round_index)
        if rnd is None or rnd.state is not RoundState.MERGING or rnd.merge_started_at is None:
            raise RuntimeError(f"round {round_index} was not merging")
        self._close(rnd, RoundState.MERGED)
        self.versions[rnd.fragment] += 1
        self.rounds_merged += 1
        version = self.versions[rnd.fragment]
        waiting = {learner for learner in rnd.requested if (r := self.learners.get(learner)) and r.live}
        self._sending[rnd.index] = _SendBack(rnd.fragment, version, rnd.merge_started_at, waiting)
        while len(self._sending) > CLOSED_ROUNDS_PER_FRAGMENT * self.config.fragments:
            # Still not back after two cycles: what is known is that it took at least this long.
            _, oldest = self._sending.popitem(last=False)
            self._sync_time.add(now - oldest.merge_started_at)
        self._settle_send_backs(now)  # nobody to send to: the merge alone was the sync
        return version

    def update_done(self, learner: str, fragment: int, version: int, now: float) -> None:
        """The service is done sending `version` of `fragment` to `learner`: the learner
        acknowledged it (or already held it), or the update was given up after its retries. It
        answers for every merged round of that fragment up to that version."""
        for sending in self._sending.values():
            if sending.fragment == fragment and sending.version <= version:
                sending.waiting.discard(learner)
        self._settle_send_backs(now)

    @property
    def sync_time_s(self) -> float | None:
        """ξ_sync: the running mean time from a merge's start until its fragment is back at every
        learner its round asked (None before the first)."""
        return self._sync_time.value

    def merge_failed(self, round_index: int, now: float) -> None:
        """The service could not merge (its own error): the round is dropped, the version kept."""
        rnd = self._open.get(round_index)
        if rnd is None or rnd.state is not RoundState.MERGING:
            raise RuntimeError(f"round {round_index} was not merging")
        self._close(rnd, RoundState.ABANDONED)
        self.rounds_abandoned += 1

    # ------------------------------------------------------------------ internals

    def _refuse(self, why: Refusal) -> Refusal:
        self.rejected[why.value] += 1
        return why

    def _close(self, rnd: _Round, state: RoundState) -> None:
        del self._open[rnd.index]
        rnd.state = state
        self._closed[rnd.index] = rnd
        while len(self._closed) > CLOSED_ROUNDS_PER_FRAGMENT * self.config.fragments:
            self._closed.popitem(last=False)

    def _step_times(self, rnd: _Round) -> list[float]:
        """The running mean step times of the learners this round still asks (live ones)."""
        records = [self.learners.get(learner) for learner in rnd.requested]
        return [t for r in records if r is not None and (t := r.step_time.value) is not None]

    def _grace_s(self, rnd: _Round) -> float:
        """grace = clamp(gamma * (tau * step - (quorum + sync)), 0, step), from running means;
        step is the lower median of the step times of the learners asked in this round. A median,
        not the mean: one learner reporting a step of an hour made every round wait half an hour
        for it (one report of 3600 s cut a run's merged rounds from 263 to 48 in 15 s). With two
        learners asked, the smaller of their step times."""
        times = self._step_times(rnd)
        if not times:
            return 0.0
        step = statistics.median_low(times)
        slack = self.config.overlap * step - (
            (self._quorum_time.value or 0.0) + (self._sync_time.value or 0.0)
        )
        return min(max(self.config.grace_factor * slack, 0.0), step)

    def _expires_at(self, rnd: _Round) -> float | None:
        """When a round stops waiting for learners that have not answered: one whole cycle of the
        schedule (H steps, at least MIN_WAIT_S) after it opened. A push can be held up far
        longer than that (a learner stopped mid-transfer keeps its session until the idle
        timeout), and a round that waits for it keeps its fragment from opening another.

        A step here is the upper median of the asked learners' step times, so one learner
        reporting tiny steps cannot cut the wait short of the others' cycle; one reporting huge
        ones is bounded by the clock instead (_maybe_merge: a cycle also ends H clock steps on)."""
        times = self._step_times(rnd)
        if not times:
            return None
        floor = LOCKSTEP_MIN_WAIT_S if self.config.lockstep else MIN_WAIT_S
        return rnd.opened_at + max(self.config.sync_every * statistics.median_high(times), floor)

    def _settle_send_backs(self, now: float) -> None:
        """A merged round whose every awaited learner holds its version gives its sync time sample:
        from its merge's start to now."""
        for index, sending in list(self._sending.items()):
            if not sending.waiting:
                del self._sending[index]
                self._sync_time.add(now - sending.merge_started_at)

    def _release(self, push: Push, reason: str) -> Release:
        self._count_wasted(push)
        return Release(push, reason)

    def _count_wasted(self, push: Push) -> None:
        record = self.learners.get(push.learner)
        if record is not None:
            record.pushes_wasted += 1

    def _take_carried(self, rnd: _Round) -> tuple[dict[str, Push], list[Action]]:
        """Late pushes of this fragment that may join the round, and releases for the rest.

        A late push joins beside its learner's own answer to this round when that answer starts
        from a newer version (the learner adopted the merge it missed, so the two outer gradients
        hold different steps); an answer from the same version holds every step of the late push
        too, which then goes."""
        carried = self._carried.get(rnd.fragment, {})
        joining: dict[str, Push] = {}
        actions: list[Action] = []
        for learner, push in list(carried.items()):
            fresh = rnd.pushes.get(learner)
            if push.base_version + self.config.staleness < rnd.version:
                del carried[learner]
                self.rejected[Refusal.STALE_VERSION.value] += 1
                actions.append(self._release(push, "stale"))
            elif fresh is not None and fresh.base_version <= push.base_version:
                # The fresh push covers every step of the late one: merging both counts them twice.
                del carried[learner]
                actions.append(self._release(push, "superseded by a later push"))
            else:
                joining[learner] = push
        return joining, actions

    def _maybe_merge(self, rnd: _Round, now: float) -> list[Action]:
        joining, actions = self._take_carried(rnd)
        pushes = [*rnd.pushes.values(), *joining.values()]
        # Still expected: asked, live (leave() forgets the others) and not refused, until the round
        # has waited a whole cycle. Every admitted push in flight is from an asked learner. A late
        # push carried in from an earlier round does not answer for its learner: counted, it let a
        # round reach quorum the moment it opened and merge before that learner's own push, which
        # then came with no steps to merge (found by tests/chaos: one fragment merged 128 times
        # against 211 for the others).
        if not rnd.waited_out:
            expires_at = self._expires_at(rnd)
            # Once past, the moment leaves next_deadline: a round below quorum stays open after it
            # (K > 1 with fewer learners live), and the ticker must not spin on a past deadline.
            # Lock-step learners step on while a push is in flight (tau >= 1, up to H): the clock
            # moving on says nothing there, only the time does.
            rnd.waited_out = (expires_at is not None and now >= expires_at) or (
                not self.config.lockstep and self.clock >= rnd.opened_clock + self.config.sync_every
            )
        waiting = set() if rnd.waited_out else rnd.requested - set(rnd.pushes) - rnd.refused - rnd.passed
        if self.config.lockstep and waiting:
            return actions  # lock-step merges every asked learner's push, or waits out the round
        if not pushes and not waiting:
            # Everyone asked answered with a push that was screened out or failed, or left, or the
            # round waited a whole cycle for nothing: nothing can ever merge here. Closing the
            # round frees its fragment for its next turn instead of blocking it until some learner
            # joins again. (A round holding pushes below quorum stays open: those pushes are work,
            # and the rounds resume when K learners are back.)
            self._close(rnd, RoundState.ABANDONED)
            self.rounds_abandoned += 1
            return actions
        # Quorum counts the round's own answers while anyone is still expected; carried pushes
        # are merged with them (and alone only when nobody asked is left to answer).
        quorum = 1 if self.config.lockstep else self.config.quorum
        if len({p.learner for p in (rnd.pushes.values() if waiting else pushes)}) < quorum:
            return actions
        if rnd.quorum_at is None:
            rnd.quorum_at = now
            self._quorum_time.add(now - rnd.opened_at)
            rnd.deadline = now + self._grace_s(rnd)
        if waiting and rnd.deadline is not None and now < rnd.deadline:
            return actions
        carried = self._carried.get(rnd.fragment, {})
        for learner in joining:
            del carried[learner]
        ordered = sorted(pushes, key=lambda p: (p.learner, p.round_index))
        return [*actions, *self._start_merge(rnd, now, ordered)]

    def _start_merge(self, rnd: _Round, now: float, pushes: list[Push]) -> list[Action]:
        try:
            weights = bounded_merge_weights(
                [p.c_tokens for p in pushes], [p.c_steps for p in pushes], [p.learner for p in pushes]
            )
        except ValueError:
            # Nobody trained since their anchor: nothing to merge, the fragment keeps its version.
            self._close(rnd, RoundState.ABANDONED)
            self.rounds_abandoned += 1
            return [self._release(p, "no steps to merge") for p in pushes]
        kept = [(p, w) for p, w in zip(pushes, weights, strict=True) if w > 0]
        actions: list[Action] = [
            self._release(p, "zero weight") for p, w in zip(pushes, weights, strict=True) if w == 0
        ]
        rnd.state = RoundState.MERGING
        rnd.merge_started_at = now
        waited = 0.0 if rnd.quorum_at is None else now - rnd.quorum_at
        self.grace_waited_s += waited
        # Learners, not pushes: a late push merged beside its learner's own answer is one learner.
        self.quorum_sizes[len({p.learner for p, _ in kept})] += 1
        for learner in {p.learner for p, _ in kept}:
            if (record := self.learners.get(learner)) is not None:
                record.contributions += 1
        for push, weight in kept:
            if (record := self.learners.get(push.learner)) is not None:
                record.weight_total += weight
        merge = Merge(
            rnd.index, rnd.fragment, rnd.version, tuple(p for p, _ in kept), tuple(w for _, w in kept), waited
        )
        return [*actions, merge]
