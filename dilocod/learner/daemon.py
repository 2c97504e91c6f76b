"""`dilocod learner` from configuration to a running learner: the user's entry loaded and checked
before anything connects, the local state restored, the network on its own event-loop thread, the
training loop on the main thread, and an orderly exit (local state saved, goodbye said) on SIGTERM,
SIGINT or when --steps are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from dataclasses import dataclass

import structlog
import torch

from dilocod.contract import LearnerContext, Trainer
from dilocod.learner.bridge import Bridge
from dilocod.learner.entry import EntryError, load_trainer
from dilocod.learner.island import Island, IslandConfig
from dilocod.learner.layout import PlanMismatch, model_entries
from dilocod.learner.link import Link, LinkConfig
from dilocod.learner.runtime import LearnerStopped, RuntimeConfig, TrainingLoop
from dilocod.learner.state import LocalStateError

log = structlog.get_logger("dilocod.learner")
#: How long the network thread may take to say goodbye once training has stopped.
NETWORK_STOP_TIMEOUT_S = 30.0


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


def run_learner(setup: LearnerSetup) -> None:
    device = resolve_device(setup)
    # The process group first: the user's factory may wrap the model for data parallelism.
    island = Island.start(setup.island, device) if setup.island is not None else None
    try:
        _run(setup, device, island)
    finally:
        if island is not None:
            island.close()


def _run(setup: LearnerSetup, device: torch.device, island: Island | None) -> None:
    trainer = load_entry(setup, device)
    try:
        model = model_entries(trainer.model)
    except PlanMismatch as exc:
        raise LearnerSetupError(f"--entry {setup.runtime.entry}: {exc}") from None
    bridge = Bridge()
    link = Link(setup.link, model, bridge)

    def network_status() -> dict[str, object]:
        # Plain values written by the network thread; a slightly stale read is fine for a progress line.
        stats = link.stats
        latency = stats.last_push_to_update_s
        return {
            "syncer": "connected" if stats.connected else "away",
            "last_round_s": None if latency is None else round(latency, 3),
            "sent_bytes": stats.bytes_sent,
            "received_bytes": stats.bytes_received,
            "refused": stats.pushes_refused,
        }

    loop = TrainingLoop(setup.runtime, trainer, bridge, device, setup.link.learner_id, island, network_status)
    try:
        loop.restore()
    except LocalStateError as exc:
        raise LearnerSetupError(str(exc)) from None
    link.incarnation = loop.incarnation
    stop = threading.Event()
    network = _NetworkThread(link, setup.use_uvloop) if loop.leader else None
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    if network is not None:
        network.start()
    try:
        loop.run(stop)
    except LearnerStopped as exc:
        raise LearnerSetupError(f"the syncer cannot use this learner: {exc}") from None
    finally:
        if network is not None:
            network.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info(
            "learner stopped",
            step=loop.step_index,
            pushes=link.stats.pushes_sent,
            sent_bytes=link.stats.bytes_sent,
            received_bytes=link.stats.bytes_received,
        )


class _NetworkThread:
    """The event loop thread that runs the Link until stopped."""

    def __init__(self, link: Link, use_uvloop: bool) -> None:
        self.link = link
        self.use_uvloop = use_uvloop
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
            await self.link.run(self._stop)

        try:
            run(main(), use_uvloop=self.use_uvloop)
        finally:
            self._started.set()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop has already finished
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(NETWORK_STOP_TIMEOUT_S)
