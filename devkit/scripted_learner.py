"""A scripted learner that speaks the real protocol to a real syncer, with made-up training.

Each "step" moves every parameter of its local copy by -rate (so an outer gradient is exactly
rate x the steps since the anchor), reports the step, answers every FRAGMENT_REQUEST with that
outer gradient as a float32 push, and adopts every update by overwriting (anchor = local = new).
Everything it sent and received is recorded for the tests to check against dilocod.outer.

Importable by the tests, and runnable as a process (so it can be SIGSTOPped or killed -9):
    python -m devkit.scripted_learner --port P --id NAME [--step-s 0.05] [--tokens 100] [--steps N]
It prints one JSON line per event of interest ("joined", "update", "push", "done") on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dilocod.transport.endpoints import connect
from dilocod.transport.errors import SessionClosed, TransferFailed
from dilocod.transport.session import FragmentReceived, Session
from dilocod.wire.manifest import ModelEntry, TensorEntry, fragment_manifest
from dilocod.wire.messages import Error, FragmentRequest, Join, Plan, PushHeader, StepReport, UpdateHeader

CHUNK_BYTES = 64 * 1024


@dataclass
class Pushed:
    fragment: int
    round: int
    base_version: int
    c_steps: int
    c_tokens: int
    delta: bytes


@dataclass
class ScriptedLearner:
    name: str
    port: int
    model: tuple[ModelEntry, ...]
    tokens_per_step: int = 100
    step_s: float = 0.02
    rate: float = 1e-3
    #: Lock-step DiLoCo with H = P and K = M: every step is followed by one round (the one that
    #: step's clock tick opens); wait for its update before the next step.
    lockstep: bool = False
    secret: bytes | None = None
    #: This many first pushes carry poison_value in every element instead of the outer gradient
    #: (NaN: a diverged learner; a huge finite value: a hostile one).
    poison_pushes: int = 0
    poison_value: float = float("nan")
    emit: Callable[[dict[str, Any]], None] = lambda event: None
    plan: Plan | None = None
    manifests: list[tuple[TensorEntry, ...]] = field(default_factory=list)
    anchors: list[torch.Tensor] = field(default_factory=list)
    local: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    c_steps: list[int] = field(default_factory=list)
    c_tokens: list[int] = field(default_factory=list)
    pushes: list[Pushed] = field(default_factory=list)
    updates: list[tuple[int, int, bytes]] = field(default_factory=list)  # fragment, version, bytes
    refused: list[str] = field(default_factory=list)
    steps: int = 0
    #: Updates adopted for fragments this learner had pushed (completed rounds it took part in).
    synced: int = 0
    session: Session | None = None
    _waiting_for: set[int] = field(default_factory=set)
    _adopted: asyncio.Event = field(default_factory=asyncio.Event)

    async def join(self, timeout_s: float = 60.0) -> None:
        """Connect, JOIN, take the PLAN and adopt every fragment (healing)."""
        self.session = await connect(
            "127.0.0.1", self.port, peer_id=self.name, role="learner", secret=self.secret, streams=1
        )
        await self.session.send(Join(self.model, ""))
        async with asyncio.timeout(timeout_s):
            first = await self.session.recv()
            if isinstance(first, Error):
                raise RuntimeError(f"syncer refused the join: {first.code} {first.message}")
            if not isinstance(first, Plan):
                raise RuntimeError(f"expected PLAN, got {first!r}")
            self.plan = first
            shapes = {e.name: e.shape for e in first.model}
            for pieces in first.fragments:
                manifest, raw = fragment_manifest(pieces, shapes)
                self.manifests.append(manifest)
                self.anchors.append(torch.zeros(raw // 4))
                self.local.append(torch.zeros(raw // 4))
            count = len(first.fragments)
            self.versions = [-1] * count
            self.c_steps, self.c_tokens = [0] * count, [0] * count
            while min(self.versions) < 0:
                self._handle(await self.session.recv())
        self.emit({"event": "joined", "learner": self.name, "versions": self.versions})

    async def run(
        self,
        steps: int | None = None,
        stop: asyncio.Event | None = None,
        until: Callable[[], bool] | None = None,
    ) -> None:
        """Step (and answer the syncer) until `steps` steps are done and until() holds (checked
        after each step: a signal to wait for, under the caller's deadline); with stop, go on
        answering requests and adopting updates after that until stop is set."""
        assert self.session is not None
        session = self.session

        def stepping() -> bool:
            if stop is not None and stop.is_set():
                return False
            return (
                (steps is None and until is None)
                or (steps is not None and self.steps < steps)
                or (until is not None and not until())
            )

        async with asyncio.TaskGroup() as tasks:
            receiver = tasks.create_task(self._receive(tasks))
            try:
                while stepping():
                    if self.lockstep:
                        await self.wait_until(lambda: self.synced >= self.steps)
                    started = time.monotonic()
                    await asyncio.sleep(self.step_s)
                    for p in range(len(self.local)):
                        self.local[p] -= self.rate
                        self.c_steps[p] += 1
                        self.c_tokens[p] += self.tokens_per_step
                    self.steps += 1
                    await session.send(
                        StepReport(self.steps, self.tokens_per_step, time.monotonic() - started)
                    )
                if stop is not None:
                    await stop.wait()
            finally:
                receiver.cancel()
        self.emit({"event": "done", "learner": self.name, "steps": self.steps, "versions": self.versions})

    async def wait_until(self, done: Callable[[], bool]) -> None:
        """Wait (on updates arriving, not on a timer) until done() holds."""
        while not done():
            self._adopted.clear()
            await self._adopted.wait()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close("scripted learner done")

    async def _receive(self, tasks: asyncio.TaskGroup) -> None:
        assert self.session is not None
        with contextlib.suppress(SessionClosed):
            while True:
                item = self.session.recv()
                message = await item
                if isinstance(message, FragmentRequest):
                    self._waiting_for.add(message.fragment)
                    tasks.create_task(self._push(message))
                else:
                    self._handle(message)

    def _handle(self, item: object) -> None:
        if isinstance(item, FragmentReceived) and isinstance(item.header, UpdateHeader):
            p, version = item.header.fragment, item.header.version
            data = bytes(item.buffer)
            values = torch.frombuffer(bytearray(data), dtype=torch.float32)
            self.anchors[p] = values.clone()
            self.local[p] = values.clone()
            self.versions[p] = version
            self.c_steps[p] = self.c_tokens[p] = 0
            self.updates.append((p, version, data))
            if p in self._waiting_for:
                self.synced += 1
            self._waiting_for.discard(p)
            self._adopted.set()
            self.emit({"event": "update", "learner": self.name, "fragment": p, "version": version})

    async def _push(self, request: FragmentRequest) -> None:
        assert self.session is not None
        p = request.fragment
        delta = (self.anchors[p] - self.local[p]).contiguous()
        if self.poison_pushes > 0:
            self.poison_pushes -= 1
            delta.fill_(self.poison_value)
        data = bytearray(delta.numel() * 4)
        torch.frombuffer(data, dtype=torch.float32).copy_(delta)
        header = PushHeader(
            self.manifests[p],
            len(data),
            "none",
            CHUNK_BYTES,
            fragment=p,
            round=request.round,
            base_version=self.versions[p],
            c_steps=self.c_steps[p],
            c_tokens=self.c_tokens[p],
        )
        try:
            await self.session.send_fragment(header, data)
        except TransferFailed as exc:
            self.refused.append(f"{exc.code.name}: {exc.message}")
            self._waiting_for.discard(p)
            return
        except SessionClosed:
            return
        self.pushes.append(
            Pushed(p, request.round, self.versions[p], self.c_steps[p], self.c_tokens[p], bytes(data))
        )
        self.emit({"event": "push", "learner": self.name, "fragment": p, "round": request.round})


def model_entries(model: torch.nn.Module) -> tuple[ModelEntry, ...]:
    return tuple(ModelEntry(n, "float32", tuple(p.shape)) for n, p in model.named_parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--shapes", required=True, help="JSON list of [name, shape]")
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    model = tuple(ModelEntry(n, "float32", tuple(s)) for n, s in json.loads(args.shapes))

    def emit(event: dict[str, Any]) -> None:
        print(json.dumps(event), flush=True)

    async def go() -> None:
        learner = ScriptedLearner(args.id, args.port, model, args.tokens, args.step_s, emit=emit)
        await learner.join()
        try:
            await learner.run(args.steps)
        finally:
            await learner.close()

    asyncio.run(go())
    sys.exit(0)


if __name__ == "__main__":
    main()
