"""`dilocod syncer` from configuration to a running service: the state directory (locked, so two
syncers never share one), the model from the newest checkpoint or from the user's factory, the
round state machine where the checkpoint left it, signals, systemd notifications, and the exit.

Everything that can be wrong with the setup is found here, before the port opens, and reported as
a SetupError naming what to fix.
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import signal
import ssl
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from dilocod.config import SyncerConfig
from dilocod.contract import LearnerContext
from dilocod.model.compare import PlanMismatch
from dilocod.model.entry import EntryError, load_trainer
from dilocod.model.params import model_entries
from dilocod.model.plan import plan_fragments
from dilocod.ops.notify import watchdog_loop
from dilocod.ops.statedir import StateDirError, StateNotSaved, hold_state_dir, probe_writes
from dilocod.syncer.checkpoint import CheckpointError, load_latest_checkpoint
from dilocod.syncer.model import GlobalModel, ModelMismatch
from dilocod.syncer.rounds import RoundConfig, Rounds
from dilocod.syncer.service import SyncerService
from dilocod.wire.limits import DEFAULT_LIMITS

log = structlog.get_logger("dilocod.syncer")
LOCK_FILE = "syncer.lock"


class SetupError(Exception):
    """The syncer cannot start as configured; the message says what to fix."""


@dataclass(slots=True)
class Prepared:
    service: SyncerService
    resumed_from: Path | None


def lock_state_dir(state_dir: Path, stack: ExitStack) -> None:
    """Hold an exclusive lock on the state directory for the life of the process, and try a write
    there: a read-only or unwritable directory is a SetupError now, not a failed checkpoint later.
    A full disk is not: the syncer serves, and every checkpoint says so and tries again."""
    try:
        hold_state_dir(state_dir, LOCK_FILE, "syncer", stack)
        problem = probe_writes(state_dir)
    except StateDirError as exc:
        raise SetupError(str(exc)) from None
    if problem is not None:
        log.warning("state directory cannot be written now; serving anyway", problem=problem)


def prepare(config: SyncerConfig, secret: bytes | None, *, tls: ssl.SSLContext | None = None) -> Prepared:
    """Build the model store, the round state machine and the service; nothing listens yet."""
    if config.state_dir is None:
        raise SetupError("--state-dir is required: checkpoints and the lock live there")
    state_dir = config.state_dir
    context = LearnerContext("syncer", "syncer", "cpu", 0, 1, state_dir, config.seed)
    try:
        trainer = load_trainer(config.entry, context)
    except EntryError as exc:
        raise SetupError(str(exc)) from exc.__cause__
    try:
        specs = list(model_entries(trainer.model))
    except PlanMismatch as exc:
        raise SetupError(f"--entry {config.entry}: {exc}") from None
    plan = plan_fragments([(s.name, s.shape) for s in specs], config.fragments)
    model = GlobalModel(
        plan,
        specs,
        chunk_bytes=config.chunk,
        embedding_pattern=config.embedding_pattern,
        update_precision=config.update_precision,
    )
    meta: dict[str, Any] = {"fragments": plan.num_fragments, "parameters": len(specs)}
    try:
        loaded = load_latest_checkpoint(state_dir)
    except CheckpointError as exc:
        raise SetupError(f"--state-dir {state_dir}: {exc}") from None
    if loaded is None:
        params = dict(trainer.model.named_parameters())
        model.load({s.name: params[s.name].detach() for s in specs})
        restored: dict[str, Any] = {}
    else:
        for skipped in loaded.skipped:
            log.warning("checkpoint skipped", path=str(skipped.path), reason=skipped.reason)
        state = loaded.state
        if len(state.versions) != plan.num_fragments:
            raise SetupError(
                f"the checkpoint {loaded.path} has {len(state.versions)} fragments, this syncer plans "
                f"{plan.num_fragments} (--fragments): start with the same value, or a new --state-dir"
            )
        try:
            model.load(state.params, state.momentum, state.versions)
        except ModelMismatch as exc:
            raise SetupError(
                f"the checkpoint {loaded.path} holds another model than --entry {config.entry}: {exc}"
            ) from None
        restored = state.meta
    del trainer  # the user's objects (optimizer, data) are not needed past this point
    round_config = RoundConfig.of(config, fragments=plan.num_fragments)
    rounds = Rounds(round_config, versions=model.versions, next_round=int(restored.get("next_round", 0)))
    # The clock and next_round belong together: rounds are due by the clock, so restoring one
    # without the other would open nothing until a fresh clock caught up.
    rounds.clock = int(restored.get("clock", 0))
    service = SyncerService(
        config,
        model,
        rounds,
        state_dir=state_dir,
        incarnation=secrets.token_hex(8),
        secret=secret,
        tls=tls,
        meta=meta,
    )
    if loaded is not None:
        down_s = time.time() - loaded.saved_at_unix_s
        _restore_roster(rounds, restored.get("roster"), down_s, service.clock())
    return Prepared(service, None if loaded is None else loaded.path)


def _restore_roster(rounds: Rounds, roster: object, down_s: float, now: float) -> None:
    """Each known learner's goodput terms, last reported step and time since it left, from the
    checkpoint's roster. The time since the checkpoint counts as wall time without useful steps:
    the learners' reports since then were lost with this syncer, and so is what they trained (they
    heal to the checkpoint's model). Entries out of range (an id no learner may have, a figure that
    is not a finite non-negative number, a step beyond what a learner may report) are skipped with
    a warning; the roster's retention then applies at the first status or checkpoint."""
    if not isinstance(roster, dict):
        return
    down_s = max(0.0, down_s) if math.isfinite(down_s) else 0.0
    skipped = 0
    for learner, entry in roster.items():
        restored = _roster_entry(learner, entry)
        if restored is None:
            skipped += 1
            continue
        tracked, useful, idle, step = restored
        rounds.restore_learner(
            learner,
            tracked_s=tracked + down_s,
            useful_s=useful,
            now=now,
            local_step=step,
            idle_s=idle + down_s,
        )
    if skipped:
        log.warning("checkpoint roster entries skipped", count=skipped, reason="out of range")


def _roster_entry(learner: object, entry: object) -> tuple[float, float, float, int] | None:
    """(tracked_s, useful_s, idle_s, local_step) of one checkpoint roster entry, or None when any
    is out of range. idle_s and local_step are absent from checkpoints of earlier versions."""
    if not (
        isinstance(learner, str)
        and 0 < len(learner.encode()) <= DEFAULT_LIMITS.max_peer_id_bytes
        and isinstance(entry, dict)
    ):
        return None
    figures = [entry.get("tracked_s"), entry.get("useful_s"), entry.get("idle_s", 0.0)]
    if not all(
        isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
        for x in figures
    ):
        return None
    step = entry.get("local_step", 0)
    if not (
        isinstance(step, int)
        and not isinstance(step, bool)
        and 0 <= step <= DEFAULT_LIMITS.max_reported_steps
    ):
        return None
    tracked, useful, idle = (float(x) for x in figures)
    return tracked, useful, idle, step


STATUS_EVERY_S = 10.0


async def _report_status(notifier: Any, service: SyncerService) -> None:
    """One STATUS= line for `systemctl status` every few seconds."""
    while True:
        await asyncio.sleep(STATUS_EVERY_S)
        status = service.status()
        live = sum(1 for learner in status["learners"] if learner["connected"])
        notifier.status(
            f"{live} learners, {status['rounds_merged']} rounds merged, "
            f"{sum(f['version'] for f in status['fragments'])} fragment versions"
        )


def run_syncer(
    config: SyncerConfig,
    secret: bytes | None,
    *,
    tls: ssl.SSLContext | None = None,
    ready: Callable[[dict[str, Any]], None],
    use_uvloop: bool = True,
    notifier: Any = None,
) -> None:
    """Run until SIGTERM or SIGINT; SetupError before anything listens if the setup is wrong;
    StateNotSaved after the goodbyes when the checkpoint on the way out failed."""
    from dilocod.transport.loop import run  # noqa: PLC0415

    with ExitStack() as stack:
        if config.state_dir is not None:
            lock_state_dir(config.state_dir, stack)
        prepared = prepare(config, secret, tls=tls)
        service = prepared.service
        if prepared.resumed_from is not None:
            log.info(
                "resumed",
                checkpoint=str(prepared.resumed_from),
                versions=service.model.versions,
                next_round=service.rounds.next_round,
            )

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()

            def on_signal() -> None:  # a signal handler only sets the event (and tells systemd)
                if not stop.is_set() and notifier is not None:
                    notifier.stopping("stopping: finishing merges, writing a checkpoint")
                stop.set()

            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, on_signal)

            def listening(host: str, port: int) -> None:
                info: dict[str, Any] = {
                    "host": host,
                    "port": port,
                    "pid": os.getpid(),
                    "incarnation": service.incarnation,
                    "fragments": len(service.model.fragments),
                    "versions": service.model.versions,
                }
                log.info(
                    "listening",
                    **info,
                    fragment_imbalance=round(service.model.plan.imbalance, 4),
                    largest_fragment_bytes=max(store.raw_bytes for store in service.model.fragments),
                )
                ready({"event": "ready", **info})
                if notifier is not None:
                    # A STATUS with READY, so `systemctl status` says something before the first report.
                    notifier.ready(
                        f"listening on {host}:{port}, {len(service.model.fragments)} fragments, "
                        f"{sum(service.model.versions)} fragment versions"
                    )

            async with asyncio.TaskGroup() as tasks:
                helpers = []
                if notifier is not None and notifier.enabled:
                    helpers.append(tasks.create_task(watchdog_loop(notifier, service.healthy)))
                    helpers.append(tasks.create_task(_report_status(notifier, service)))
                try:
                    await service.serve(stop, listening)
                finally:
                    for helper in helpers:
                        helper.cancel()

        run(main(), use_uvloop=use_uvloop)
        if service.final_checkpoint_problem is not None:
            newest = service.last_checkpoint or prepared.resumed_from
            raise StateNotSaved(
                f"the final checkpoint was not written ({service.final_checkpoint_problem}); the newest "
                f"checkpoint is {newest if newest is not None else 'none: this syncer wrote none'}"
            )
