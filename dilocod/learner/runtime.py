"""The learner's training loop, on the main thread: the user's step, and at every step boundary the
outer loop's two touches on the parameters (docs/design.md §3.3). Parameters change only here.

At a step boundary, in this order (when is decided by dilocod.learner.cadence):
1. merged fragments that are due are applied (heal: overwrite; otherwise the chosen mode), and the
   update's buffer becomes the fragment's anchor (the one it replaces goes back to the bridge,
   bridge.release, as does the buffer of an update that will never be applied);
2. requested fragments that are due are copied out (to host memory, in wire layout) with their
   counters and anchor, for the network (thread or process) to turn into a push; the counters
   restart there, at the send (and where an overwrite drops the local progress). A fragment with
   no step since then is answered with NOTHING_TO_PUSH instead;
3. lock-step with tau = 0 only: the merges of the fragments just pushed are waited for and applied;
then the user's step runs. Decoupled (K < M), nothing here waits on the network. Lock-step
(PLAN quorum 0) waits at a round's due step for its request, and at its due step + tau for its
merge, each wait bounded by join_timeout_s (a syncer gone or a round given up must not stop
training for good); and, once at start, for the first heal (bounded the same way).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from dilocod.config import LearnerConfig
from dilocod.contract import Trainer
from dilocod.learner.bridge import (
    Adopt,
    Buffer,
    CopyInFlight,
    Inbox,
    LostPush,
    Snapshot,
    StepReportItem,
    TrainingSide,
    newer_update,
    stale_under,
)
from dilocod.learner.cadence import Cadence, InFlight, Lateness
from dilocod.learner.device import Copier, Staged, clock_for, copier_for
from dilocod.learner.island import Island
from dilocod.learner.layout import FragmentLayout, layouts_for
from dilocod.learner.state import (
    LocalStateError,
    LocalStateNotSaved,
    check_loadable,
    load_local_state,
    rank_state_dir,
    save_local_state,
)
from dilocod.model.entry import EntryError, check_step_result, step_failed
from dilocod.outer import apply_update_
from dilocod.wire.codecs import checksum
from dilocod.wire.messages import FragmentRequest

log = structlog.get_logger("dilocod.learner")
#: The defaults of the learner's settings, declared once in dilocod.config.daemons.
_DEFAULTS = LearnerConfig()


class LearnerStopped(Exception):
    """The network side gave up for good (e.g. the syncer's model is not ours)."""


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """The training loop's part of the learner's configuration (RuntimeConfig.of); the defaults
    are LearnerConfig's."""

    entry: str
    apply: str = _DEFAULTS.apply
    mix_alpha: float = _DEFAULTS.mix_alpha
    #: When a decoupled request is answered (learner.cadence.Cadence.answer_now).
    answer: str = _DEFAULTS.answer
    steps: int | None = _DEFAULTS.steps
    state_dir: Path | None = _DEFAULTS.state_dir
    save_every_s: float = _DEFAULTS.save_every_s
    join_timeout_s: float = _DEFAULTS.join_timeout_s
    progress_every_s: float = _DEFAULTS.progress_every_s
    #: Where a GPU learner keeps its anchors: "host" (the update's buffer, as received) or
    #: "device" (the update's staging buffer on the GPU, one model of device memory in float32:
    #: outer gradients are computed there and the host keeps no anchor). On the CPU both are host.
    anchors: str = _DEFAULTS.anchors

    @classmethod
    def of(cls, config: LearnerConfig) -> RuntimeConfig:
        """The learner's configuration as the training loop takes it: its fields by name."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclass(slots=True)
class Progress:
    steps: int = 0
    tokens: int = 0
    last_loss: float | None = None
    applied: int = 0
    snapshots: int = 0
    #: Requests answered with NOTHING_TO_PUSH (no step since the fragment's last push).
    passes: int = 0
    #: Pushes the syncer never received whole, whose steps the fragment's next push counts again.
    lost: int = 0
    started: float = field(default_factory=time.monotonic)


class TrainingLoop:
    def __init__(
        self,
        config: RuntimeConfig,
        trainer: Trainer,
        bridge: TrainingSide,
        device: torch.device,
        learner_id: str,
        island: Island | None = None,
        network_status: Callable[[], dict[str, Any]] | None = None,
        copier: Copier | None = None,
    ) -> None:
        self.config = config
        #: What the network thread last knew (connection, bytes, round latency), for progress lines.
        self.network_status = network_status
        #: In a torchrun island only rank 0 talks to the network; the others follow its inbox.
        self.island = island
        self.leader = island is None or island.leader
        self.trainer = trainer
        self.bridge = bridge
        self.learner_id = learner_id
        #: Snapshots out and updates in, between the parameters' device and host buffers.
        self.copier = copier if copier is not None else copier_for(device)
        self.clock = clock_for(self.copier)
        self.layouts: list[FragmentLayout] = []
        self.anchors: dict[int, Buffer] = {}
        #: --anchors device on a GPU: each fragment's anchor as a device buffer (wire layout, flat
        #: uint8), in place of a host one; outer gradients are computed on the device.
        self.device_anchors: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}
        #: progress.steps and progress.tokens when each fragment was last sent (or healed): a
        #: push's counters are the differences (no per-fragment work at every step, whatever P).
        self.sent_at: dict[int, tuple[int, int]] = {}
        #: θ_p at its last push, for keep-local: a copy where the parameters live (no host copy to
        #: wait for), in their own dtype.
        self.sent: dict[int, list[torch.Tensor]] = {}
        #: Pushed fragments whose merge has not been applied yet.
        self.in_flight: dict[int, InFlight] = {}
        #: Merged fragments that arrived and are not applied yet (lock-step holds one until its
        #: due step), and requests not answered yet (held until their round's due step).
        self.held: dict[int, Adopt] = {}
        self.requests: dict[int, FragmentRequest] = {}
        #: Lock-step: rounds below this one are not waited for (answered, given up, or before the plan).
        self.next_round = 0
        #: The highest round a request named since the plan: rounds open in order, so one below it
        #: that never came is not coming.
        self.newest_request = -1
        #: Lock-step: in-flight fragments whose merge was waited for in vain (not waited for again).
        self.given_up: set[int] = set()
        #: How late the last apply of each fragment was, for its next push header.
        self.apply_late: dict[int, int] = {}
        self.lateness = Lateness()
        self.step_index = 0
        self.progress = Progress()
        self.incarnation = ""
        #: The schedule from the syncer's plan (None until the first one).
        self.cadence: Cadence | None = None
        self._last_save = time.monotonic()
        self._last_progress = time.monotonic()
        #: Saves the disk failed since the last one that succeeded, and why the last one failed.
        self.saves_failed = 0
        self.save_problem: str | None = None

    # ------------------------------------------------------------------ life cycle

    @property
    def state_dir(self) -> Path | None:
        """Where this process keeps its state: one directory per rank in an island."""
        return rank_state_dir(self.config.state_dir, None if self.island is None else self.island.rank)

    def restore(self) -> bool:
        """Model, inner optimizer, user state and step count from --state-dir, if saved there."""
        if self.state_dir is None:
            return False
        state = load_local_state(self.state_dir)
        if state is None:
            return False
        self.trainer.model.load_state_dict(state["model"])
        if self.trainer.optimizer is not None and state.get("optimizer") is not None:
            self.trainer.optimizer.load_state_dict(state["optimizer"])
        if self.trainer.load_state_dict is not None and state.get("user") is not None:
            self.trainer.load_state_dict(state["user"])
        self.step_index = int(state.get("step", 0))
        self.incarnation = str(state.get("incarnation", ""))
        log.info("restored local state", step=self.step_index, state_dir=str(self.state_dir))
        return True

    def _state(self) -> dict[str, Any]:
        return {
            "model": self.trainer.model.state_dict(),
            "optimizer": self.trainer.optimizer.state_dict() if self.trainer.optimizer is not None else None,
            "user": self._user_state(),
            "step": self.step_index,
            "incarnation": self.incarnation,
            "learner_id": self.learner_id,
        }

    def _user_state(self) -> dict[str, Any] | None:
        if self.trainer.state_dict is None:
            return None
        try:
            return dict(self.trainer.state_dict())
        except Exception as exc:
            raise EntryError(
                f"--entry {self.config.entry!r}: Trainer.state_dict() raised {type(exc).__name__}: {exc} "
                "(its traceback follows)"
            ) from exc

    def check_state(self) -> None:
        """LocalStateError now if the state as it is could not be loaded once saved (at startup, on
        the factory's initial state: found in seconds, not at the restart after the first save)."""
        if self.state_dir is not None:
            check_loadable(self._state())

    def save(self) -> bool:
        """Write the local state (checked first: a state that would not load is refused, and the
        last good file stays). A write the disk fails (full, an I/O error) is logged and counted
        and training goes on: the previous file stays whole and the next save tries again."""
        if self.state_dir is None:
            return False
        self._last_save = time.monotonic()
        try:
            path = save_local_state(self.state_dir, self._state())
        except LocalStateNotSaved as exc:
            self.saves_failed += 1
            self.save_problem = str(exc)
            log.error("local state not saved", error=str(exc), step=self.step_index, failed=self.saves_failed)
            return False
        self.saves_failed, self.save_problem = 0, None
        log.info("saved local state", path=str(path), step=self.step_index)
        return True

    def _save_on_the_way_out(self) -> None:
        """Save while an exception is on its way out: a save that fails too is logged, and the
        exception that stopped training is the one reported."""
        try:
            self.save()
        except Exception as exc:
            log.error("local state not saved", error=str(exc), step=self.step_index)

    def run(self, stop: threading.Event) -> None:
        """Train until stop is set or --steps are done; saves the local state on the way out."""
        try:
            self._wait_for_first_heal(stop)
            try:
                self._train(stop)
            except LocalStateError:
                raise  # a save failed: another would fail the same way
            except BaseException:
                self._save_on_the_way_out()
                raise
            self.save()
        finally:
            self.copier.close()  # the copies still running finish; their buffers go back

    @property
    def overlap(self) -> int:
        """tau, from the syncer's plan (2 until the first one)."""
        return self.cadence.overlap if self.cadence is not None else 2

    @property
    def awaiting(self) -> set[int]:
        """Fragments pushed whose merge has not been applied yet."""
        return set(self.in_flight)

    def _train(self, stop: threading.Event) -> None:
        while self._agree(
            not stop.is_set() and (self.config.steps is None or self.step_index < self.config.steps)
        ):
            self.boundary(stop)
            if not self._agree(not stop.is_set()):
                break
            self.one_step()
            now = time.monotonic()
            if self.state_dir is not None and now - self._last_save >= self.config.save_every_s:
                self.save()
            if self.leader and now - self._last_progress >= self.config.progress_every_s:
                self._report_progress(now)
        self.boundary(stop, last=True)  # adopt what arrived during the last step before saving
        if self.leader:
            self._report_holding()

    # ------------------------------------------------------------------ the step boundary

    def _agree(self, local: bool) -> bool:
        """A decision every rank of an island takes together (all must say yes)."""
        return local if self.island is None else self.island.agree(local)

    def boundary(self, stop: threading.Event | None = None, *, last: bool = False) -> None:
        """The step boundary: applies, then snapshots (module docstring). Lock-step waits happen
        here, each bounded by join_timeout_s; `stop` ends them early. The last one, before the
        final save, applies every update that has arrived (on a GPU, those still on their way
        too)."""
        stop = stop if stop is not None else threading.Event()
        self.copier.settle()
        self._take()
        cadence = self.cadence
        if cadence is not None and not cadence.lockstep:
            # Decoupled, a request for the version this learner holds may reach the boundary with
            # the next version of its fragment (its round merged without this push). Where that
            # version would overwrite the fragment, the request is answered first: its push
            # holds the steps the overwrite drops, and the syncer merges it into the fragment's
            # next round. Only where δ against the held anchor is exactly what the counters count
            # (no push of the fragment in flight); mix and keep-local apply first and keep them.
            for request in sorted(self.requests.values(), key=lambda r: r.round):
                held = self.held.get(request.fragment)
                if (
                    held is not None
                    and not held.heal
                    and request.version == self.versions.get(request.fragment)
                    and request.fragment not in self.in_flight
                    and self._mode(request.fragment, heal=False) == "overwrite"
                    and cadence.answer_now(request.round, self.step_index)
                ):
                    self._answer(request)
        self._apply_due(stop, last=last)
        self._answer_due(stop)
        if cadence is not None and cadence.lockstep and cadence.overlap == 0:
            # Lock-step with tau = 0 waits here, right after the boundary that pushed: a step run
            # while the fragment is in flight would train on the pre-merge values (that is tau = 1).
            self._apply_due(stop)
        # One wake of the network thread per step, after the boundary's own work: woken earlier
        # (by the step report), it runs Python while this boundary's torch calls wait for the GIL.
        if self.leader:
            self.bridge.flush()

    def _take(self) -> None:
        """Everything the network posted (shared by rank 0 in an island) into the loop's state."""
        inbox = self.bridge.take() if self.leader else Inbox()
        if self.island is not None:
            inbox = self.island.share(inbox, self.copier)
        if inbox.fatal is not None:
            raise LearnerStopped(inbox.fatal)
        if inbox.plan is not None:
            plan = inbox.plan
            self.layouts = layouts_for(plan, self.trainer.model)
            self.cadence = Cadence.of(plan, self.config.answer)
            if plan.incarnation != self.incarnation:
                # Another syncer incarnation: what we pushed will not come back.
                self.in_flight.clear()
            # Requests of the old session mean nothing under the new plan; its updates do when
            # they come from the same syncer incarnation (bridge.stale_under).
            self.requests.clear()
            for fragment, adopt in list(self.held.items()):
                if stale_under(plan, adopt):
                    self._drop(adopt)
                    del self.held[fragment]
            for fragment in [p for p in self.anchors if p >= len(self.layouts)]:
                self._let_go(self.anchors.pop(fragment))  # no such fragment under the new plan
            for fragment in [p for p in self.device_anchors if p >= len(self.layouts)]:
                self.copier.done(Staged([], self.device_anchors.pop(fragment)))
            for fragment in [p for p in self.versions if p >= len(self.layouts)]:
                del self.versions[fragment]
            self.given_up.clear()
            self.next_round, self.newest_request = plan.next_round, -1
            self.incarnation = plan.incarnation
        for lost in inbox.lost:
            self._count_again(lost)
        for adopt in inbox.updates:
            pending = self.held.get(adopt.fragment)
            kept = newer_update(pending, adopt)
            if kept is None:
                self._drop(adopt)
                continue
            if kept.staged is None:
                # On a GPU its copy to the device starts now, and lands while the next step runs.
                upload = self.copier.prefetch(kept.buffer)
                if upload is not None:
                    kept = dataclasses.replace(kept, staged=upload)
            self.held[adopt.fragment] = kept
            if pending is not None and pending.buffer is not kept.buffer:
                self._drop(pending)
        for request in inbox.requests:
            self.requests[request.fragment] = request  # a newer round of a fragment replaces the older
            self.newest_request = max(self.newest_request, request.round)

    def _count_again(self, lost: LostPush) -> None:
        """A push that never reached the syncer: its steps are still in θ - anchor (the anchor has
        not moved since), so the fragment's counters go back to where they were before it, and
        its next push (the syncer asks a rejoining learner again for the rounds still open)
        counts them. Not where the fragment was applied or pushed again since: its counters have
        moved on from that push. (Keep-local's θ at the push stays: an apply before the next
        push keeps the steps after it, as when the round merged without the push.)"""
        flight = self.in_flight.get(lost.fragment)
        if (
            flight is None
            or flight.round != lost.round
            or flight.counted_from is None
            or self.sent_at.get(lost.fragment) != flight.counted_to
        ):
            return
        self.sent_at[lost.fragment] = flight.counted_from
        del self.in_flight[lost.fragment]
        self.given_up.discard(lost.fragment)
        self.progress.lost += 1

    # ------------------------------------------------------------------ applies

    def _apply_due(self, stop: threading.Event, *, last: bool = False) -> None:
        """Apply the merges that are due; lock-step first waits for those due at this step."""
        cadence = self.cadence
        if cadence is not None and cadence.lockstep:
            due = [
                p
                for p, sent in self.in_flight.items()
                if sent.step + cadence.overlap <= self.step_index and p not in self.given_up
            ]
            if due and not self._wait_until(stop, lambda: all(self._arrived(p) for p in due)):
                missing = sorted(p for p in due if not self._arrived(p))
                log.warning(
                    "merged fragments did not come back: stepping on",
                    fragments=missing,
                    step=self.step_index,
                    waited_s=self.config.join_timeout_s,
                )
                self.given_up.update(missing)
        for fragment in sorted(self.held):
            adopt = self.held[fragment]
            sent = self.in_flight.get(fragment)
            if (
                cadence is not None
                and cadence.lockstep
                and not adopt.heal
                and sent is not None
                and adopt.version > sent.base_version
                and self.step_index < sent.step + cadence.overlap
            ):
                continue  # held until its due step, s_r + tau
            if (
                not last
                and cadence is not None
                and not cadence.lockstep
                and not adopt.heal
                and adopt.staged is not None
                and not adopt.staged.landed()
            ):
                # Decoupled, an update whose copy to the device is still running is applied at the
                # next boundary, as if it had come a step later: the stream never waits for PCIe.
                continue
            del self.held[fragment]
            self._apply(adopt)

    def _arrived(self, fragment: int) -> bool:
        """Whether the merge of the fragment's push (a version newer than its base) is here."""
        adopt, sent = self.held.get(fragment), self.in_flight.get(fragment)
        return sent is None or (adopt is not None and (adopt.heal or adopt.version > sent.base_version))

    # ------------------------------------------------------------------ snapshots

    def _answer_due(self, stop: threading.Event) -> None:
        """Answer the requests that are due; lock-step first waits for those of the rounds due by
        this step (a round opens once the slowest learner has reached its due step)."""
        cadence = self.cadence
        if cadence is None:
            return
        if cadence.lockstep:
            due = cadence.rounds_due_by(self.step_index, self.next_round)
            if len(due) and not self._wait_until(stop, lambda: self._requested(due)):
                log.warning(
                    "round requests did not come: stepping on",
                    rounds=[r for r in due if not self._requested(range(r, r + 1))],
                    step=self.step_index,
                    waited_s=self.config.join_timeout_s,
                )
            self.next_round = max(self.next_round, due.stop)
        for request in sorted(self.requests.values(), key=lambda r: r.round):
            if cadence.answer_now(request.round, self.step_index):
                self._answer(request)

    def _requested(self, rounds: range) -> bool:
        """Whether every one of these rounds has its request here, or is known not to be coming
        (a later round's request came first)."""
        held = {request.round for request in self.requests.values()}
        return all(r in held or r < self.newest_request for r in rounds)

    def _answer(self, request: FragmentRequest) -> None:
        del self.requests[request.fragment]
        self._snapshot(request.fragment, request.round)

    # ------------------------------------------------------------------ waiting (only where asked)

    def _wait_until(self, stop: threading.Event, ready: Callable[[], bool]) -> bool:
        """Take what the network posts until ready() (evaluated on state every rank of an island
        shares), stop, or join_timeout_s; whether ready() holds at the end."""
        deadline = time.monotonic() + self.config.join_timeout_s
        while True:
            expired = self.leader and time.monotonic() >= deadline
            if not self._agree(not ready() and not expired and not stop.is_set()):
                break
            if self.leader:
                # What this boundary queued (the step report that opens the round, the push the
                # merge waits for) goes out before the wait.
                self.bridge.flush()
                # Bounded by the deadline too: a short join_timeout_s must not overshoot by a second.
                self.bridge.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            self._take()
        return ready()

    def one_step(self) -> None:
        self.clock.start()
        try:
            returned = self.trainer.step(self.step_index)
        except Exception as exc:
            raise step_failed(self.config.entry, self.step_index, exc) from exc
        # On a GPU the device's time per step, read a step or so late (learner.device.DeviceClock).
        elapsed = self.clock.stop()
        # Checked as soon as it is returned, the first step's included: a wrong type is an entry
        # error (exit 78), not a crash that a restart would repeat.
        result = check_step_result(self.config.entry, self.step_index, returned)
        tokens = result.tokens if self.island is None else self.island.total(result.tokens)
        self.step_index += 1
        self.progress.steps += 1
        self.progress.tokens += tokens
        self.progress.last_loss = result.loss
        if self.leader:
            self.bridge.report_step(StepReportItem(self.step_index, tokens, elapsed), wake=False)

    def _let_go(self, buffer: Buffer) -> None:
        """This loop no longer reads an update's buffer (rank 0's came from the bridge; the other
        ranks of an island have their own copies): it goes back once no device copy reads it."""
        if self.leader:
            self.copier.let_go(buffer, lambda: self.bridge.release(buffer))

    def _drop(self, adopt: Adopt) -> None:
        """An update that will not be applied: its buffer goes back, and its device copy if any."""
        self._let_go(adopt.buffer)
        if adopt.staged is not None:
            self.copier.discard(adopt.staged)

    def _apply(self, adopt: Adopt) -> None:
        if adopt.fragment >= len(self.layouts):
            self._drop(adopt)
            return
        sent = self.in_flight.get(adopt.fragment)
        if sent is not None and (adopt.heal or adopt.version > sent.base_version):
            del self.in_flight[adopt.fragment]
            self.given_up.discard(adopt.fragment)
            if not adopt.heal:
                late = max(0, self.step_index - (sent.step + self.overlap))
                self.lateness.apply(late)
                self.apply_late[adopt.fragment] = late
        layout = self.layouts[adopt.fragment]
        # Where the parameters are: on a GPU copied in on a side stream (started when the update
        # was taken) that the training stream waits for on the device (learner.device).
        staged = self.copier.stage(layout, adopt.buffer, adopt.staged)
        mode = self._mode(adopt.fragment, heal=adopt.heal)
        sent = self.sent.get(adopt.fragment) if mode == "keep-local" else None
        apply_update_(list(layout.params), staged.views, mode, alpha=self.config.mix_alpha, sent=sent)
        if self.leader and self.config.anchors == "device" and staged.flat is not None:
            # The staging buffer is the anchor (the update's bytes, on the device); the one it
            # replaces is reused after the work queued so far, and the host keeps none.
            replaced_flat = self.device_anchors.get(adopt.fragment)
            self.device_anchors[adopt.fragment] = staged.flat
            if replaced_flat is not None:
                self.copier.done(Staged([], replaced_flat))
            self._let_go(adopt.buffer)
        else:
            self.copier.done(staged)
            # The anchor it replaces goes back once no copy reads it (_let_go), and a push still
            # computed from that one holds it.
            replaced = self.anchors.get(adopt.fragment)
            self.anchors[adopt.fragment] = adopt.buffer
            if replaced is not None and replaced is not adopt.buffer:
                self._let_go(replaced)
        self.versions[adopt.fragment] = adopt.version
        if mode == "overwrite":
            # The local progress on this fragment is gone (a heal, or --apply overwrite): the next
            # push's outer gradient holds the steps from here on, and so do its counters. Mix and
            # keep-local keep it: their counters run on from the send.
            self.sent_at[adopt.fragment] = (self.progress.steps, self.progress.tokens)
        self.sent.pop(adopt.fragment, None)
        self.progress.applied += 1

    def _mode(self, fragment: int, *, heal: bool) -> str:
        """How a merged fragment is applied: a heal overwrites, and so does keep-local with nothing
        pushed since the last adoption (no steps to keep)."""
        if heal or (self.config.apply == "keep-local" and fragment not in self.sent):
            return "overwrite"
        return self.config.apply

    def counters(self, fragment: int) -> tuple[int, int]:
        """The steps and tokens trained since the fragment was last sent, or overwritten (a heal,
        --apply overwrite): a push's c_steps and c_tokens (docs/design.md §3.3). They restart at
        the send whatever the apply mode, so a step is counted in exactly one push."""
        steps_at, tokens_at = self.sent_at.get(fragment, (self.progress.steps, self.progress.tokens))
        return self.progress.steps - steps_at, self.progress.tokens - tokens_at

    def _snapshot(self, fragment: int, round_index: int) -> None:
        if fragment >= len(self.layouts) or fragment not in self.versions:
            return  # not healed yet: nothing meaningful to push
        c_steps, c_tokens = self.counters(fragment)
        cadence = self.cadence
        late = 0 if cadence is None else cadence.late(round_index, self.step_index)
        self.lateness.snapshot(late)
        if self.leader:
            # Every rank of an island holds the same parameters: rank 0 speaks for all of them.
            # With its anchor on the device, the outer gradient is computed there (δ in theta's
            # place, and no host anchor); else θ is copied out and the network computes δ.
            on_device = self.device_anchors.get(fragment)
            if c_steps == 0:
                # Nothing new since the last send: NOTHING_TO_PUSH, not a push of zeros.
                theta: Buffer = bytearray()
                ready: CopyInFlight | None = None
            else:
                theta, ready = self.copier.copy_out(
                    self.layouts[fragment], self.bridge.snapshot_buffer, anchor=on_device
                )
            snapshot = Snapshot(
                fragment,
                round_index,
                self.versions[fragment],
                c_steps,
                c_tokens,
                theta,
                self.anchors[fragment] if c_steps and on_device is None else bytearray(),
                ready,
                step=self.step_index,
                apply_late=self.apply_late.pop(fragment, None) if c_steps else None,
                delta=c_steps > 0 and on_device is not None,
            )
            self.bridge.send_snapshot(snapshot, wake=False)
        if c_steps == 0:
            self.progress.passes += 1
            return
        counted_from = self.sent_at.get(fragment)
        counted_to = self.sent_at[fragment] = (self.progress.steps, self.progress.tokens)
        if self.config.apply == "keep-local":
            # Every rank keeps its own: the snapshot's buffer belongs to the network (and may be
            # lent to its process and reused once the push is made).
            with torch.no_grad():
                self.sent[fragment] = [param.detach().clone() for param in self.layouts[fragment].params]
        self.in_flight[fragment] = InFlight(
            round_index, self.step_index, self.versions[fragment], counted_from, counted_to
        )
        self.progress.snapshots += 1

    # ------------------------------------------------------------------ waiting (only where asked)

    def _wait_for_first_heal(self, stop: threading.Event) -> None:
        deadline = time.monotonic() + self.config.join_timeout_s
        while True:
            self.boundary(stop)
            healed = bool(self.layouts) and len(self.versions) == len(self.layouts)
            # Rank 0 decides (its deadline, its network); any rank's stop ends the wait for all.
            waiting = not healed and time.monotonic() < deadline if self.leader else not healed
            if not self._agree(waiting and not stop.is_set()):
                break
            if self.leader:
                self.bridge.wait(min(1.0, max(0.0, deadline - time.monotonic())))
        if self.layouts and len(self.versions) == len(self.layouts):
            log.info("healed", fragments=len(self.layouts), versions=sum(self.versions.values()))
        elif not stop.is_set():
            log.warning(
                "no syncer yet", waited_s=self.config.join_timeout_s, then="training on; the first join heals"
            )

    def _report_holding(self) -> None:
        """Which version of every global fragment this learner holds as it stops, each with the
        xxh3-64 of its bytes: the syncer logs the same digest with every merged version, so anyone
        can check that a learner ended on the syncer's fragments, byte for byte."""
        fragments = range(len(self.layouts))
        log.info(
            "holding fragments",
            step=self.step_index,
            incarnation=self.incarnation,
            versions=[self.versions.get(p) for p in fragments],
            digests=[self._digest(p) for p in fragments],
            # How late (steps) its snapshots and applies were over the whole run: 0 in lock-step.
            **self.lateness.summary(),
        )

    def _digest(self, fragment: int) -> str | None:
        """The xxh3-64 of the bytes of the fragment's anchor (a device anchor is read back: once,
        at the end), None if it has none."""
        if fragment in self.device_anchors:
            return f"{checksum(self.device_anchors[fragment].cpu().numpy()):016x}"
        return f"{checksum(self.anchors[fragment]):016x}" if fragment in self.anchors else None

    def _report_progress(self, now: float) -> None:
        elapsed = max(now - self.progress.started, 1e-9)
        log.info(
            "progress",
            step=self.step_index,
            tokens=self.progress.tokens,
            steps_per_s=round(self.progress.steps / elapsed, 2),
            tokens_per_s=round(self.progress.tokens / elapsed, 1),
            loss=None if self.progress.last_loss is None else round(self.progress.last_loss, 4),
            applied=self.progress.applied,
            pushed=self.progress.snapshots,
            nothing_to_push=self.progress.passes,
            lost=self.progress.lost,
            in_flight=len(self.in_flight),
            **self.lateness.summary(),
            **(self.network_status() if self.network_status is not None else {}),
        )
        self._last_progress = now
