"""`dilocod learner` from configuration to a running learner: the user's entry loaded and checked
before anything connects, the local state restored, the network started (by default in a child
process, dilocod.learner.netproc, so that its CPU time and the GIL stay off the training thread;
with --network thread on an event-loop thread of this process), the training loop on the main
thread, and an orderly exit (local state saved, goodbye said) on SIGTERM, SIGINT or when --steps
are done.

With a systemd notify socket (Type=notify), rank 0 says READY=1 once the entry is loaded, its state
restored and the network started; STATUS= every --progress-every-s; STOPPING=1 when it starts to
wind down. Watchdog pings come from an event-loop thread of this process (the network's, or the one
reading the network process's statistics) and only while that loop runs, the network process
still reports, and no single step has run for the whole watchdog timeout (so a hung training step
stops them too): WatchdogSec= must exceed the slowest step, the first one included.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import threading
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any

import structlog
import torch

from dilocod.contract import LearnerContext, Trainer
from dilocod.learner.arena import anchors_ready
from dilocod.learner.bridge import Bridge, TrainingSide
from dilocod.learner.device import copier_for
from dilocod.learner.health import StepWatch, status_line
from dilocod.learner.island import Island, IslandConfig
from dilocod.learner.link import Link, LinkConfig
from dilocod.learner.netproc import ProcessBridge, SideReader, encode_config, open_network_process
from dilocod.learner.runtime import LearnerStopped, RuntimeConfig, TrainingLoop
from dilocod.learner.state import LOCK_FILE, LocalStateError, learner_instance, rank_state_dir
from dilocod.learner.threads import HostCpus, choose_intra_op_threads
from dilocod.model.compare import PlanMismatch
from dilocod.model.entry import EntryError, load_trainer
from dilocod.model.params import model_entries
from dilocod.ops.notify import USEC_PER_S, Notifier, watchdog_loop
from dilocod.ops.statedir import StateDirError, StateNotSaved, hold_state_dir, probe_writes

log = structlog.get_logger("dilocod.learner")
#: How long the network (process or thread) may take to say goodbye once training has stopped.
NETWORK_STOP_TIMEOUT_S = 30.0
#: How long to wait for a stopped network process's last statistics.
SIDE_DRAIN_TIMEOUT_S = 5.0


class LearnerSetupError(Exception):
    """The learner cannot start as configured (entry, device, state); the message says why."""


@dataclass(frozen=True, slots=True)
class LearnerSetup:
    runtime: RuntimeConfig
    link: LinkConfig
    device: str
    seed: int
    use_uvloop: bool = True
    #: Set under torchrun (WORLD_SIZE > 1): this process is one rank of an island.
    island: IslandConfig | None = None
    #: "process": the link runs in a child process (dilocod.learner.netchild); "thread": here.
    network: str = "process"
    #: What the command read about this host's cores, for torch's intra-op threads; None leaves
    #: torch's choice alone.
    cpus: HostCpus | None = None


def resolve_device(setup: LearnerSetup) -> torch.device:
    device = torch.device(setup.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LearnerSetupError(f"--device {setup.device}: CUDA is not available on this host")
        if setup.island is not None and device.index is None:
            device = torch.device("cuda", setup.island.local_rank)  # one GPU per rank
    return device


def load_entry(setup: LearnerSetup, device: torch.device) -> Trainer:
    """Load and check the user's entry: the first thing a learner does, before any connection."""
    rank, world = (setup.island.rank, setup.island.world_size) if setup.island is not None else (0, 1)
    ctx = LearnerContext(
        setup.link.learner_id, "learner", str(device), rank, world, setup.runtime.state_dir, setup.seed
    )
    try:
        return load_trainer(setup.runtime.entry, ctx)
    except EntryError as exc:
        raise LearnerSetupError(str(exc)) from exc.__cause__


def run_learner(setup: LearnerSetup, notifier: Notifier | None = None) -> None:
    """Train until SIGTERM, SIGINT or --steps; `notifier` (from cli.py) talks to systemd."""
    device = resolve_device(setup)
    with contextlib.ExitStack() as held:
        setup = claim_state_dir(setup, held)
        # The process group first: the user's factory may wrap the model for data parallelism.
        island = Island.start(setup.island, device) if setup.island is not None else None
        try:
            _run(setup, device, island, notifier or Notifier())
        finally:
            if island is not None:
                island.close()


def claim_state_dir(setup: LearnerSetup, held: contextlib.ExitStack) -> LearnerSetup:
    """Lock this process's state directory until `held` closes (a second learner on it is a
    setup error), and take the instance id kept there for the link: a restart of this learner is
    then known to the syncer as the same learner, and takes its old session's place at once."""
    state_dir = rank_state_dir(setup.runtime.state_dir, None if setup.island is None else setup.island.rank)
    if state_dir is None:
        return setup
    try:
        hold_state_dir(state_dir, LOCK_FILE, "learner", held)
        # A read-only or unwritable directory is named now, not at the first save; a full disk
        # is not a configuration error: training goes on, and every save tries again.
        problem = probe_writes(state_dir)
        instance = learner_instance(state_dir)
    except (StateDirError, LocalStateError) as exc:
        raise LearnerSetupError(str(exc)) from None
    except OSError as exc:
        raise LearnerSetupError(f"--state-dir {state_dir}: {exc.strerror or exc}") from None
    if problem is not None:
        log.warning("state directory cannot be written now; training anyway", problem=problem)
    return dataclasses.replace(setup, link=dataclasses.replace(setup.link, instance=instance))


def set_intra_op_threads(setup: LearnerSetup, torch_default: int) -> None:
    """torch's intra-op threads, chosen so that the network does not take a core from them (see
    dilocod.learner.threads); after the entry has run, whose own torch.set_num_threads is kept."""
    if setup.cpus is None:
        return
    here = setup.island is None or setup.island.rank - setup.island.local_rank == 0
    # torchrun numbers ranks node by node: the island's rank 0, whose network it is, runs on the
    # node whose first rank is 0.
    network = setup.network if here else None
    current = torch.get_num_threads()
    choice = choose_intra_op_threads(setup.cpus, network, torch_default=torch_default, current=current)
    if choice.threads is None:
        log.info("torch threads kept", threads=current, reason=choice.reason)
        return
    if choice.threads != current:
        torch.set_num_threads(choice.threads)
    log.info("torch threads chosen", threads=choice.threads, reason=choice.reason)


def _run(setup: LearnerSetup, device: torch.device, island: Island | None, notifier: Notifier) -> None:
    watch = StepWatch()
    torch_default = torch.get_num_threads()  # before the entry: torch's own, or OMP_NUM_THREADS's
    trainer = load_entry(setup, device)
    set_intra_op_threads(setup, torch_default)
    trainer = dataclasses.replace(trainer, step=watch.watch(trainer.step))
    try:
        model = model_entries(trainer.model)
    except PlanMismatch as exc:
        raise LearnerSetupError(f"--entry {setup.runtime.entry}: {exc}") from None
    leader = island is None or island.leader
    in_process = setup.network == "process" and leader
    # The training loop sees either network through TrainingSide alone; what differs (a Link
    # here, or a child process to start and stop) is this function's.
    bridge: TrainingSide
    link: Link | None = None
    process: ProcessBridge | None = None
    side: SideReader | None = None
    # The anchors' memory, faulted in before the Link joins (dilocod.learner.arena); an island's
    # other ranks never run a Link.
    # With its anchors on a GPU (--anchors device) the host keeps none.
    device_anchors = setup.runtime.anchors == "device" and device.type == "cuda"
    arena = anchors_ready(model, shared=in_process) if leader and not device_anchors else None
    copier = copier_for(device)
    if in_process:
        process, side, side_child = open_network_process()
        bridge = process
    else:
        # A buffer the bridge discards (a failed update) is unpinned.
        threaded = Bridge(arena, page_aligned=device.type == "cuda", on_discard=copier.forget)
        link = Link(setup.link, model, threaded)
        bridge = threaded

    def link_stats() -> dict[str, Any]:
        # Plain values written by the network thread (or the last statistics of the network
        # process); a slightly stale read is fine for a progress line.
        return asdict(link.stats) if link is not None else side.stats if side is not None else {}

    def network_status() -> dict[str, object]:
        stats = link_stats()
        latency = stats.get("last_push_to_update_s")
        return {
            "syncer": "connected" if stats.get("connected") else "away",
            "last_round_s": None if latency is None else round(latency, 3),
            "sent_bytes": stats.get("bytes_sent", 0),
            "received_bytes": stats.get("bytes_received", 0),
            "refused": stats.get("pushes_refused", 0),
            # Pushes sent again after arriving damaged; sessions joined (the first included).
            "resent": stats.get("pushes_resent", 0),
            "joins": stats.get("joins", 0),
            "loop_lag_ms": stats.get("loop_lag_ms") or None,
        }

    loop = TrainingLoop(
        setup.runtime, trainer, bridge, device, setup.link.learner_id, island, network_status, copier
    )
    try:
        # The factory's initial state, before anything connects: a state that the next start could
        # not load is found now, not by the restart that follows the first save.
        loop.check_state()
        loop.restore()
    except EntryError as exc:
        raise LearnerSetupError(str(exc)) from exc.__cause__  # the user's traceback follows
    except LocalStateError as exc:
        raise LearnerSetupError(str(exc)) from None
    if link is not None:
        link.incarnation = loop.incarnation
    if process is not None:
        process.spawn(encode_config(setup.link, model, loop.incarnation, setup.use_uvloop), side_child, arena)
    if not loop.leader:
        # Under torchrun, systemd watches the launcher, not the ranks; rank 0 speaks for the island.
        notifier = Notifier()
    stop = threading.Event()

    def on_signal(*_: object) -> None:  # only sets the event (and tells systemd, a non-blocking send)
        if not stop.is_set():
            notifier.stopping("stopping: finishing the step, saving the local state")
        stop.set()

    companions: list[Callable[[], Coroutine[Any, Any, None]]] = []
    if notifier.watchdog_usec is not None:
        limit_s = notifier.watchdog_usec / USEC_PER_S

        def healthy() -> bool:
            # A network process whose loop stalls stops its statistics, and so the pings.
            return watch.healthy(limit_s) and (side is None or side.alive(limit_s))

        companions.append(lambda: watchdog_loop(notifier, healthy))
    if notifier.enabled:
        companions.append(
            lambda: _report_status(notifier, loop, network_status, setup.runtime.progress_every_s)
        )
    # Rank 0 alone talks to the syncer (through its network thread or process); the other ranks of
    # an island follow its inbox.
    serve = (link.run if link is not None else side.run if side is not None else None) if leader else None
    network = _NetworkThread(serve, setup.use_uvloop, companions) if serve is not None else None
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    if network is not None:
        network.start()
    notifier.ready(f"training from step {loop.step_index}, syncer {setup.link.host}:{setup.link.port}")
    try:
        loop.run(stop)
    except LearnerStopped as exc:
        raise LearnerSetupError(f"the syncer cannot use this learner: {exc}") from None
    except EntryError as exc:
        # What a step returned, or the state to save, breaks the entry contract: restarting would
        # only do it again (a step that raises is a StepFailed, and goes to the command as it is).
        raise LearnerSetupError(str(exc)) from exc.__cause__
    except LocalStateError as exc:
        raise LearnerSetupError(str(exc)) from None
    finally:
        if not stop.is_set():  # --steps done, or an error: no signal said STOPPING=1 yet
            notifier.stopping(f"stopping at step {loop.step_index}")
        if process is not None:
            process.close(NETWORK_STOP_TIMEOUT_S)  # the child says goodbye to the syncer and exits
            if side is not None and network is not None:
                side.finished.wait(SIDE_DRAIN_TIMEOUT_S)  # its last statistics, for the line below
        if network is not None:
            network.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        final = network_status()
        log.info(
            "learner stopped",
            step=loop.step_index,
            saves_failed=loop.saves_failed,
            pushes=(asdict(link.stats) if link is not None else side.stats if side else {}).get(
                "pushes_sent"
            ),
            sent_bytes=final["sent_bytes"],
            received_bytes=final["received_bytes"],
        )
    if loop.save_problem is not None:  # the save on the way out failed (the disk, not the state)
        raise StateNotSaved(f"the local state of step {loop.step_index} was not saved: {loop.save_problem}")


async def _report_status(
    notifier: Notifier, loop: TrainingLoop, network: Callable[[], dict[str, object]], every_s: float
) -> None:
    """A STATUS= line for `systemctl status` every `every_s`, with the step rate since the last one.

    Reads plain values the training thread writes; a slightly stale read is fine for a status line.
    """
    clock = asyncio.get_running_loop().time
    last_s, last_step = clock(), loop.step_index
    while True:
        await asyncio.sleep(every_s)
        now_s, step = clock(), loop.step_index
        rate = (step - last_step) / max(now_s - last_s, 1e-9)
        line = status_line(step, rate, loop.progress.last_loss, network())
        if loop.save_problem is not None:
            line += f"; local state not saved ({loop.saves_failed} failed saves): {loop.save_problem}"
        notifier.status(line)
        last_s, last_step = now_s, step


class _NetworkThread:
    """The event loop thread that runs the Link (or, with a network process, the reader of its
    statistics) until stopped, and its companions (the watchdog, the status reporter) on the same
    loop, cancelled when it returns."""

    def __init__(
        self,
        serve: Callable[[asyncio.Event], Coroutine[Any, Any, None]],
        use_uvloop: bool,
        companions: list[Callable[[], Coroutine[Any, Any, None]]] | None = None,
    ) -> None:
        self.serve = serve
        self.use_uvloop = use_uvloop
        self.companions = companions or []
        self._thread = threading.Thread(target=self._main, name="dilocod-network", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        from dilocod.transport.loop import run  # noqa: PLC0415

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._started.set()
            async with asyncio.TaskGroup() as tasks:
                helpers = [tasks.create_task(make()) for make in self.companions]
                try:
                    await self.serve(self._stop)
                finally:
                    for helper in helpers:
                        helper.cancel()

        try:
            run(main(), use_uvloop=self.use_uvloop)
        finally:
            self._started.set()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop has already finished
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(NETWORK_STOP_TIMEOUT_S)
