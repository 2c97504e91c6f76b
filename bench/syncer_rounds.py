"""Syncer benchmark: merged rounds per second, merge latency and event-loop lag under M learners.

For each M and each phase, a fresh `python -m dilocod syncer` child process on 127.0.0.1 holds a
model built by a small entry module written into a temporary directory (24 Linear layers of equal
width with their biases, float32, fixed seed: 48 tensors, about --params parameters, so the 24
fragments of the balanced plan are equal). M scripted learners in this process, on one uvloop
event loop, speak the real protocol to it: JOIN, take the PLAN and heal (every fragment), then
report one step every step_s seconds on a fixed schedule and answer every FRAGMENT_REQUEST, one
push at a time per learner, oldest round first, with a float32 outer gradient of that fragment.
The gradients are made once (Gaussian x 1e-3, per fragment) and shared read-only by every learner,
with their chunk checksums computed beforehand (`send_fragment(checksums=...)`), so a push costs
the learner a socket write. Received updates land in a buffer pool shared by the learners and are
only counted.

Two phases (syncer defaults otherwise: P = H = 24, tau = 2, RDA, updates uncompressed):

- paced: the syncer's default K = 1 and a step of --paced-step-s (0.5 s: with H = P one round
  opens per step, 2 rounds/s), below what the syncer can merge: merge latency without a queue,
  and the loop's lag at a steady load;
- saturated: K = M and a step of --saturated-step-s (0.02 s: 50 rounds/s offered), more than
  the syncer can merge, so every fragment has a round open and rounds/s is the syncer's capacity.
  K = M makes every merge take all M pushes (with K = 1 and steps shorter than the merge path
  the grace window is 0 and a round merges with whatever has arrived).

After every learner has healed, the learners start stepping; after --warmup-s (which must cover
one cycle of P rounds: each fragment's first merge allocates its scratch and snapshot buffers)
the measured window of --seconds begins. Recorded per run:

- merged rounds per second: "round merged" log lines (the syncer's stderr, one JSON line each)
  received in the window, and the status's rounds_merged over the same window;
- merge latency: their duration_s (from the start of the merge task on the loop, through the wait
  for the one merge worker, the merge, the snapshot copy and its checksums, to the publish);
- the syncer's event-loop lag as its status reports it (`loop_lag_ms`, sampled every 50 ms over
  its last 1200 samples: with the default --warmup-s 15 and --seconds 45 that is the warm-up and
  the window), asked for once a second on a status session; beside it, the lag of a probe process
  that only sleeps 50 ms at a time (the machine's own scheduling noise), and the syncer's loop
  thread's time on a CPU and runnable but waiting for one (/proc/PID/task/PID/schedstat);
- bytes in and out (status), the syncer's resident memory (VmRSS from /proc/PID/status, once a
  second) and CPU time (/proc/PID/stat), and this process's CPU time (is it the learners that
  limit?).

It measures and records; it asserts nothing. Run from the repository root:
``python bench/syncer_rounds.py [--learners 4,8,16] [--seconds 45] [--params 50000000]``.
Must not be imported by dilocod or the tests; it imports dilocod's wire and transport layers and
torch (for the gradients) and starts the syncer through its command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from devkit.machine import machine_facts
from dilocod.ops.processes import read_ready_line
from dilocod.transport.endpoints import connect
from dilocod.transport.errors import SessionClosed, TransferFailed
from dilocod.transport.loop import run
from dilocod.transport.session import FragmentReceived, Session
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.manifest import ModelEntry, TensorEntry, fragment_manifest
from dilocod.wire.messages import Error, FragmentRequest, Join, Plan, PushHeader, StepReport, UpdateHeader
from dilocod.wire.stream import StreamHeader

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = Path("bench") / "results" / "syncer_rounds.json"
LAYERS = 24
ENTRY_MODULE = "bench_syncer_entry"
ENTRY_SOURCE = """
import torch
import dilocod

WIDTH = {width}
LAYERS = {layers}


def make_trainer(ctx):
    torch.manual_seed(1234)  # the same initial model in every run
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

    def step(index):
        return dilocod.StepResult(tokens=0)

    return dilocod.Trainer(model=model, optimizer=None, step=step)
"""
READY_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
SAMPLE_EVERY_S = 1.0
TOKENS_PER_STEP = 1000
MiB = 1 << 20


# ---------------------------------------------------------------------------- the syncer process


def model_width(params: int) -> int:
    """Width w of LAYERS Linear(w, w) layers with biases holding about `params` parameters."""
    per_layer = params / LAYERS
    return max(1, round((-1 + math.sqrt(1 + 4 * per_layer)) / 2))


def model_specs(width: int) -> tuple[ModelEntry, ...]:
    """The entry's parameters as torch names them, without building the model here."""
    specs: list[ModelEntry] = []
    for i in range(LAYERS):
        specs.append(ModelEntry(f"{i}.weight", "float32", (width, width)))
        specs.append(ModelEntry(f"{i}.bias", "float32", (width,)))
    return tuple(specs)


@dataclass
class SyncerChild:
    process: subprocess.Popen[bytes]
    port: int
    #: (monotonic time received, record) of every "round merged" line.
    merged: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def follow(self, stream: IO[bytes]) -> None:
        """Read the child's stderr (structlog JSON lines) on a thread."""
        for raw in stream:
            line = raw.decode(errors="replace")
            received = time.monotonic()
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            with self.lock:
                self.tail.append(line.rstrip())
                if isinstance(record, dict):
                    if record.get("event") == "round merged":
                        self.merged.append((received, record))
                    elif record.get("level") in ("warning", "error", "critical"):
                        self.warnings.append(record)

    def merged_between(self, start: float, end: float) -> list[dict[str, Any]]:
        with self.lock:
            return [r for t, r in self.merged if start <= t < end]

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


def start_syncer(work: Path, width: int, syncer_args: Sequence[str]) -> SyncerChild:
    entry_dir = work / "entry"
    entry_dir.mkdir(parents=True, exist_ok=True)
    (entry_dir / f"{ENTRY_MODULE}.py").write_text(ENTRY_SOURCE.format(width=width, layers=LAYERS))
    path = os.pathsep.join(p for p in (str(entry_dir), os.environ.get("PYTHONPATH", "")) if p)
    command = [
        sys.executable,
        "-m",
        "dilocod",
        "syncer",
        "--listen",
        "127.0.0.1:0",
        "--insecure",
        "--entry",
        f"{ENTRY_MODULE}:make_trainer",
        "--state-dir",
        str(work / "state"),
        "--ready-json",
        *syncer_args,
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path}
    )
    assert process.stdout is not None and process.stderr is not None
    child = SyncerChild(process, 0)
    threading.Thread(target=child.follow, args=(process.stderr,), daemon=True).start()
    try:
        ready = read_ready_line(process, "syncer", READY_TIMEOUT_S)
    except RuntimeError as exc:
        process.kill()
        process.wait()
        raise RuntimeError(f"{exc}:\n" + "\n".join(child.tail)) from None
    child.port = int(ready["port"])
    return child


def proc_rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (fields 14 and 15 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_schedstat(pid: int, tid: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of one thread, from
    /proc/PID/task/TID/schedstat: how much of a loop's lag is the machine's, not the loop's."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
            on_cpu, waiting, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def threads_schedstat(pid: int) -> dict[int, tuple[float, float]]:
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return {}
    return {tid: stat for tid in tids if (stat := thread_schedstat(pid, tid)) is not None}


#: A process that only sleeps 50 ms at a time and records how late it wakes up: the machine's own
#: scheduling lag beside the syncer's (same interval and quantiles as the syncer's status).
PROBE_SOURCE = """
import json, signal, sys, time
lags = []
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
while not stop:
    due = time.monotonic() + 0.05
    time.sleep(0.05)
    lags.append(max(0.0, (time.monotonic() - due) * 1e3))
lags.sort()
pick = lambda q: lags[min(len(lags) - 1, int(q * len(lags)))]
print(json.dumps({"samples": len(lags), "p50": pick(0.5), "p99": pick(0.99), "max": lags[-1]}))
"""


def self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# ---------------------------------------------------------------------------- the learners


@dataclass
class Gradient:
    manifest: tuple[TensorEntry, ...]
    buffer: bytearray
    checksums: list[int]


def make_gradients(plan: Plan, chunk_bytes: int, seed: int) -> list[Gradient]:
    """One float32 outer gradient per fragment of the plan, shared by every learner."""
    shapes = {e.name: e.shape for e in plan.model}
    generator = torch.Generator().manual_seed(seed)
    gradients = []
    for pieces in plan.fragments:
        manifest, raw = fragment_manifest(pieces, shapes)
        buffer = bytearray(raw)
        values = torch.frombuffer(buffer, dtype=torch.float32)
        values.copy_(torch.randn(values.numel(), generator=generator) * 1e-3)
        gradients.append(Gradient(tuple(manifest), buffer, chunk_checksums(buffer, chunk_bytes)))
    return gradients


class BufferPool:
    """Receive buffers for updates, by size, shared by the learners: an update is only counted,
    so its buffer goes back as soon as it has been delivered."""

    def __init__(self) -> None:
        self.free: dict[int, list[bytearray]] = {}
        self.allocated = 0

    def allocate(self, header: StreamHeader) -> memoryview:
        free = self.free.setdefault(header.raw_bytes, [])
        if free:
            return memoryview(free.pop())
        self.allocated += 1
        return memoryview(bytearray(header.raw_bytes))

    def give_back(self, buffer: memoryview) -> None:
        owner = buffer.obj
        if isinstance(owner, bytearray):
            self.free.setdefault(len(owner), []).append(owner)


@dataclass
class Learner:
    name: str
    session: Session
    fragments: int
    versions: list[int] = field(default_factory=list)
    c_steps: list[int] = field(default_factory=list)
    steps: int = 0
    pushes: int = 0
    pushes_refused: int = 0
    updates: int = 0
    #: Requests not answered yet, by fragment (a newer round of a fragment replaces the older).
    pending: dict[int, FragmentRequest] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    healed: asyncio.Event = field(default_factory=asyncio.Event)
    refusals: list[str] = field(default_factory=list)
    #: Per fragment: requests answered while this learner's copy was behind the round's version
    #: (the update had not arrived yet), by one version and by two or more; pushes refused.
    behind_one: list[int] = field(default_factory=list)
    behind_more: list[int] = field(default_factory=list)
    refused_by_fragment: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.versions = [-1] * self.fragments
        self.c_steps = [0] * self.fragments
        self.behind_one = [0] * self.fragments
        self.behind_more = [0] * self.fragments
        self.refused_by_fragment = [0] * self.fragments


@dataclass(frozen=True)
class Phase:
    """How hard the learners drive the syncer: their step time, and the quorum K."""

    name: str
    step_s: float
    #: A number, or "all" for K = M.
    quorum: str

    def k(self, m: int) -> int:
        return m if self.quorum == "all" else int(self.quorum)


class Learners:
    """M scripted learners on this process's event loop."""

    def __init__(
        self, port: int, specs: tuple[ModelEntry, ...], args: argparse.Namespace, step_s: float
    ) -> None:
        self.port = port
        self.specs = specs
        self.args = args
        self.step_s = step_s
        self.pool = BufferPool()
        self.plan: Plan | None = None
        self.gradients: list[Gradient] = []
        self.learners: list[Learner] = []
        self.stepping = asyncio.Event()
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    async def join(self, name: str) -> Learner:
        session = await connect(
            "127.0.0.1", self.port, peer_id=name, role="learner", streams=1, allocate=self.pool.allocate
        )
        session.on_inbound_failed = lambda header, buffer: None  # never reuse a failed buffer
        await session.send(Join(self.specs, ""))
        async with asyncio.timeout(JOIN_TIMEOUT_S):
            first = await session.recv()
        if isinstance(first, Error):
            raise RuntimeError(f"syncer refused the join: {first.code} {first.message}")
        if not isinstance(first, Plan):
            raise RuntimeError(f"expected PLAN, got {first!r}")
        if self.plan is None:
            self.plan = first
            self.gradients = make_gradients(first, self.args.chunk, self.args.seed)
        learner = Learner(name, session, len(first.fragments))
        self.learners.append(learner)
        return learner

    async def serve(self, learner: Learner, tasks: asyncio.TaskGroup) -> None:
        for work in (self._receive(learner), self._push(learner), self._step(learner)):
            self.tasks.append(tasks.create_task(work, name=learner.name))

    async def close(self) -> None:
        self.stop.set()
        for learner in self.learners:
            await learner.session.close("benchmark done")
        for task in self.tasks:
            task.cancel()

    async def _receive(self, learner: Learner) -> None:
        with contextlib.suppress(SessionClosed):
            while True:
                item = await learner.session.recv()
                if isinstance(item, FragmentRequest):
                    learner.pending[item.fragment] = item
                    learner.wake.set()
                elif isinstance(item, FragmentReceived) and isinstance(item.header, UpdateHeader):
                    p = item.header.fragment
                    learner.versions[p] = item.header.version
                    learner.c_steps[p] = 0
                    learner.updates += 1
                    self.pool.give_back(item.buffer)
                    if min(learner.versions) >= 0:
                        learner.healed.set()
                elif isinstance(item, Error):
                    learner.refusals.append(f"{item.code}: {item.message}")

    async def _push(self, learner: Learner) -> None:
        """One push at a time, oldest round first (a learner's data connection is busy anyway)."""
        chunk = self.args.chunk
        while True:
            while not learner.pending:
                learner.wake.clear()
                await learner.wake.wait()
            request = min(learner.pending.values(), key=lambda r: r.round)
            del learner.pending[request.fragment]
            p = request.fragment
            gradient = self.gradients[p]
            steps = learner.c_steps[p]
            if self.stepping.is_set():
                behind = request.version - learner.versions[p]
                if behind == 1:
                    learner.behind_one[p] += 1
                elif behind > 1:
                    learner.behind_more[p] += 1
            header = PushHeader(
                gradient.manifest,
                len(gradient.buffer),
                "none",
                chunk,
                fragment=p,
                round=request.round,
                base_version=max(learner.versions[p], 0),
                c_steps=steps,
                c_tokens=steps * TOKENS_PER_STEP,
            )
            try:
                await learner.session.send_fragment(header, gradient.buffer, checksums=gradient.checksums)
            except TransferFailed as exc:
                learner.pushes_refused += 1
                learner.refused_by_fragment[p] += 1
                learner.refusals.append(f"{exc.code.name}: {exc.message}")
                continue
            except SessionClosed:
                return
            learner.pushes += 1

    async def _step(self, learner: Learner) -> None:
        """A step every step_s on a fixed schedule (a late wake-up does not shift later steps)."""
        await self.stepping.wait()
        loop = asyncio.get_running_loop()
        step_s = self.step_s
        started = loop.time()
        with contextlib.suppress(SessionClosed):
            while not self.stop.is_set():
                due = started + (learner.steps + 1) * step_s
                await asyncio.sleep(max(0.0, due - loop.time()))
                learner.steps += 1
                for p in range(learner.fragments):
                    learner.c_steps[p] += 1
                await learner.session.send(StepReport(learner.steps, TOKENS_PER_STEP, step_s))


# ---------------------------------------------------------------------------- one measurement


@dataclass
class Sample:
    t: float
    status: dict[str, Any]
    rss: int | None
    syncer_cpu_s: float | None
    self_cpu_s: float
    #: Per thread of the syncer (the main thread, tid == pid, runs the event loop).
    syncer_threads: dict[int, tuple[float, float]] = field(default_factory=dict)


async def sample_status(port: int, pid: int, samples: list[Sample], stop: asyncio.Event) -> None:
    """Ask the syncer for its status once a second on one status session; read its RSS beside."""
    from dilocod.wire.messages import StatusRequest, StatusResponse

    session = await connect("127.0.0.1", port, peer_id="bench-status", role="status", streams=0)
    try:
        while True:
            await session.send(StatusRequest())
            async with asyncio.timeout(30.0):
                while not isinstance(item := await session.recv(), StatusResponse):
                    pass
            samples.append(
                Sample(
                    time.monotonic(),
                    item.status,
                    proc_rss_bytes(pid),
                    proc_cpu_s(pid),
                    self_cpu_s(),
                    threads_schedstat(pid),
                )
            )
            if stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SAMPLE_EVERY_S):
                    await stop.wait()
    finally:
        await session.close("status read")


def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive(
    child: SyncerChild, specs: tuple[ModelEntry, ...], m: int, phase: Phase, args: argparse.Namespace
) -> dict[str, Any]:
    learners = Learners(child.port, specs, args, phase.step_s)
    samples: list[Sample] = []
    sampler_stop = asyncio.Event()
    marks: dict[str, float] = {}
    async with asyncio.TaskGroup() as tasks:
        joined_at = time.monotonic()
        first = await learners.join("learner-00")
        await learners.serve(first, tasks)
        rest = await asyncio.gather(*(learners.join(f"learner-{i:02d}") for i in range(1, m)))
        for learner in rest:
            await learners.serve(learner, tasks)
        async with asyncio.timeout(JOIN_TIMEOUT_S):
            for learner in learners.learners:
                await learner.healed.wait()
        marks["healed_s"] = time.monotonic() - joined_at
        sampler = tasks.create_task(sample_status(child.port, child.process.pid, samples, sampler_stop))
        learners.stepping.set()
        await asyncio.sleep(args.warmup_s)
        start_steps = sum(lr.steps for lr in learners.learners)
        start_pushes = sum(lr.pushes for lr in learners.learners)
        probe = await asyncio.create_subprocess_exec(
            sys.executable, "-c", PROBE_SOURCE, stdout=asyncio.subprocess.PIPE
        )
        marks["start"] = time.monotonic()
        await asyncio.sleep(args.seconds)
        marks["end"] = time.monotonic()
        probe.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10.0):
            probe_out, _ = await probe.communicate()
        end_steps = sum(lr.steps for lr in learners.learners)
        end_pushes = sum(lr.pushes for lr in learners.learners)
        sampler_stop.set()
        await sampler
        await learners.close()
    result = summarize(
        child, learners, samples, marks, m, args, end_steps - start_steps, end_pushes - start_pushes
    )
    result["probe_lag_ms"] = json.loads(probe_out) if probe_out.strip() else None
    return result


def summarize(
    child: SyncerChild,
    learners: Learners,
    samples: list[Sample],
    marks: dict[str, float],
    m: int,
    args: argparse.Namespace,
    steps: int,
    pushes: int,
) -> dict[str, Any]:
    start, end = marks["start"], marks["end"]
    wall = end - start
    window = [s for s in samples if start - SAMPLE_EVERY_S <= s.t <= end + SAMPLE_EVERY_S]
    before = min(window, key=lambda s: abs(s.t - start))
    after = min(window, key=lambda s: abs(s.t - end))
    span = after.t - before.t
    records = child.merged_between(start, end)
    durations = [float(r["duration_s"]) for r in records]
    contributors = [len(r.get("contributors", ())) for r in records]
    grace = [float(r.get("grace_waited_s", 0.0)) for r in records]
    st0, st1 = before.status, after.status
    rss = [s.rss for s in window if s.rss is not None]
    in_window = [s for s in samples if start <= s.t <= end]
    lag = st1.get("loop_lag_ms")
    fragment_bytes = len(learners.gradients[0].buffer) if learners.gradients else 0
    result: dict[str, Any] = {
        "learners": m,
        "window_s": round(wall, 3),
        "heal_s": round(marks["healed_s"], 3),
        "rounds_per_s": round(len(records) / wall, 3),
        "rounds_per_s_status": round((st1["rounds_merged"] - st0["rounds_merged"]) / span, 3),
        "rounds_merged_in_window": len(records),
        "rounds_abandoned_in_window": st1.get("rounds_abandoned", 0) - st0.get("rounds_abandoned", 0),
        "merge_latency_s": {
            "p50": quantile(durations, 0.5),
            "p99": quantile(durations, 0.99),
            "max": max(durations, default=None),
            "mean": round(statistics.fmean(durations), 4) if durations else None,
        },
        "contributors_mean": round(statistics.fmean(contributors), 3) if contributors else None,
        "quorum_sizes_at_end": st1.get("quorum_sizes"),
        "grace_waited_mean_s": round(statistics.fmean(grace), 4) if grace else None,
        "loop_lag_ms_at_end": lag,
        "loop_lag_ms_at_window_start": st0.get("loop_lag_ms"),
        "loop_lag_p99_ms_samples": [s.status.get("loop_lag_ms", {}).get("p99") for s in in_window],
        "bytes_in_per_s": round((st1["bytes_in"] - st0["bytes_in"]) / span),
        "bytes_out_per_s": round((st1["bytes_out"] - st0["bytes_out"]) / span),
        "bytes_in_window": st1["bytes_in"] - st0["bytes_in"],
        "bytes_out_window": st1["bytes_out"] - st0["bytes_out"],
        "fragment_bytes": fragment_bytes,
        "rejected_pushes_at_end": st1.get("rejected_pushes"),
        "rejected_by_reason_at_end": st1.get("rejected_by_reason"),
        "syncer_rss_bytes": {
            "window_start": before.rss,
            "window_end": after.rss,
            "min": min(rss, default=None),
            "max": max(rss, default=None),
            "after_heal": samples[0].rss if samples else None,
            "samples": [s.rss for s in in_window],
        },
        "syncer_cores": (
            round((after.syncer_cpu_s - before.syncer_cpu_s) / span, 3)
            if after.syncer_cpu_s is not None and before.syncer_cpu_s is not None
            else None
        ),
        "learner_process_cores": round((after.self_cpu_s - before.self_cpu_s) / span, 3),
        "learner_steps_per_s": round(steps / wall / m, 3),
        "learner_pushes_per_s": round(pushes / wall, 3),
        "learner_pushes_refused": sum(lr.pushes_refused for lr in learners.learners),
        "learner_refusals_sample": sorted({r for lr in learners.learners for r in lr.refusals})[:5],
        "learner_receive_buffers": learners.pool.allocated,
        "pushes_behind_by_fragment": {
            "one_version": per_fragment(learners, "behind_one"),
            "two_or_more": per_fragment(learners, "behind_more"),
            "refused": per_fragment(learners, "refused_by_fragment"),
        },
        "pending_requests_at_end": sum(len(lr.pending) for lr in learners.learners),
        "syncer_warnings": len(child.warnings),
        "syncer_warning_events": sorted({str(w.get("event")) for w in child.warnings}),
    }
    result["syncer_threads"] = thread_shares(child.process.pid, before, after, span)
    return result


def per_fragment(learners: Learners, counter: str) -> list[int]:
    """A per-fragment counter of the learners, summed over them."""
    totals = [0] * (len(learners.plan.fragments) if learners.plan else 0)
    for learner in learners.learners:
        for p, count in enumerate(getattr(learner, counter)):
            totals[p] += count
    return totals


def thread_shares(pid: int, before: Sample, after: Sample, span: float) -> dict[str, Any]:
    """Per second of the window: the loop thread's time on a CPU and waiting for one; the other
    threads' (merge worker, torch's intra-op threads, codec pool) time on a CPU, the busiest one."""
    on_cpu: dict[int, float] = {}
    waiting: dict[int, float] = {}
    for tid, (cpu1, wait1) in after.syncer_threads.items():
        cpu0, wait0 = before.syncer_threads.get(tid, (0.0, 0.0))
        on_cpu[tid] = (cpu1 - cpu0) / span
        waiting[tid] = (wait1 - wait0) / span
    others = {tid: v for tid, v in on_cpu.items() if tid != pid}
    busiest = max(others, key=lambda t: others[t], default=None)
    return {
        "loop_on_cpu": round(on_cpu.get(pid, 0.0), 3),
        "loop_waiting_for_cpu": round(waiting.get(pid, 0.0), 3),
        "others_on_cpu": round(sum(others.values()), 3),
        "others_waiting_for_cpu": round(sum(w for t, w in waiting.items() if t != pid), 3),
        "busiest_other_on_cpu": round(others[busiest], 3) if busiest is not None else None,
        "threads": len(on_cpu),
    }


def measure(m: int, phase: Phase, args: argparse.Namespace) -> dict[str, Any]:
    width = model_width(args.params)
    specs = model_specs(width)
    quorum = phase.k(m)
    syncer_args = [
        "--fragments",
        str(args.fragments),
        "--quorum",
        str(quorum),
        "--chunk",
        str(args.chunk),
        *shlex.split(args.syncer_args),
    ]
    work = Path(tempfile.mkdtemp(prefix="dilocod-bench-syncer-"))
    child = None
    try:
        started = time.monotonic()
        child = start_syncer(work, width, syncer_args)
        ready_s = time.monotonic() - started
        result = {"phase": phase.name, "step_s": phase.step_s, **run(drive(child, specs, m, phase, args))}
        result["syncer_ready_s"] = round(ready_s, 3)
        result["syncer_args"] = syncer_args
        result["quorum"] = quorum
        stopping = time.monotonic()
        result["syncer_exit"] = child.stop()
        result["syncer_stop_s"] = round(time.monotonic() - stopping, 3)
        return result
    except BaseException:
        if child is not None:
            child.process.kill()
            child.process.wait()
            print("\n".join(child.tail), file=sys.stderr)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------- report


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| M | phase | K | rounds/s | contributors | merge p50 ms | merge p99 ms "
        "| loop lag p50 / p99 / max ms | probe lag p99 ms | loop on CPU / waiting | in MB/s | out MB/s "
        "| syncer cores | learners' cores | syncer RSS MB (window start -> end) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lag = r["loop_lag_ms_at_end"] or {}
        probe = r["probe_lag_ms"] or {}
        threads = r["syncer_threads"]
        rss = r["syncer_rss_bytes"]
        lines.append(
            f"| {r['learners']} | {r['phase']} | {r['quorum']} | {r['rounds_per_s']:.2f} "
            f"| {r['contributors_mean'] or 0:.1f} "
            f"| {fmt_ms(r['merge_latency_s']['p50'])} | {fmt_ms(r['merge_latency_s']['p99'])} "
            f"| {lag.get('p50', 0):.0f} / **{lag.get('p99', 0):.0f}** / {lag.get('max', 0):.0f} "
            f"| {probe.get('p99', 0):.0f} "
            f"| {threads['loop_on_cpu']:.2f} / {threads['loop_waiting_for_cpu']:.2f} "
            f"| {r['bytes_in_per_s'] / 1e6:,.0f} | {r['bytes_out_per_s'] / 1e6:,.0f} "
            f"| {r['syncer_cores']:.2f} | {r['learner_process_cores']:.2f} "
            f"| {(rss['window_start'] or 0) / 1e6:,.0f} -> {(rss['window_end'] or 0) / 1e6:,.0f} |"
        )
    return "\n".join(lines)


def progress_line(r: dict[str, Any]) -> str:
    lag = r["loop_lag_ms_at_end"] or {}
    latency = r["merge_latency_s"]
    rss = r["syncer_rss_bytes"]
    return (
        f"M={r['learners']} {r['phase']} (K={r['quorum']}, step {r['step_s']} s): "
        f"{r['rounds_per_s']:.2f} rounds/s, contributors {r['contributors_mean']}, "
        f"merge p50 {fmt_ms(latency['p50'])} ms p99 {fmt_ms(latency['p99'])} ms, "
        f"loop lag p99 {lag.get('p99')} ms (max {lag.get('max')}), "
        f"syncer {r['syncer_cores']} cores, learners {r['learner_process_cores']} cores, "
        f"RSS {rss['window_start']} -> {rss['window_end']}, threads {r['syncer_threads']}, "
        f"probe lag {r['probe_lag_ms']}, load {os.getloadavg()[0]:.2f}"
    )


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["python", "bench/syncer_rounds.py", *argv[1:]])


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--learners", default="4,8,16", help="learner counts M to measure")
    parser.add_argument(
        "--phases", default="paced,saturated", help="which runs per M (a fresh syncer each): paced, saturated"
    )
    parser.add_argument("--seconds", type=float, default=45.0, help="measured window of each run")
    parser.add_argument("--warmup-s", type=float, default=15.0, help="stepping before the window")
    parser.add_argument("--params", type=int, default=50_000_000, help="model parameters (about)")
    parser.add_argument("--fragments", type=int, default=24, help="P, passed to the syncer")
    parser.add_argument(
        "--paced-step-s",
        type=float,
        default=0.5,
        help="learners' step time when paced (H = P: rounds/s = 1/this)",
    )
    parser.add_argument("--paced-quorum", default="1", help="K when paced: a number, or 'all' for K = M")
    parser.add_argument(
        "--saturated-step-s", type=float, default=0.02, help="learners' step time when saturating the syncer"
    )
    parser.add_argument("--saturated-quorum", default="all", help="K when saturating: a number, or 'all'")
    parser.add_argument("--chunk", type=int, default=MiB, help="chunk bytes of pushes and updates")
    parser.add_argument("--seed", type=int, default=0, help="seed of the outer gradients")
    parser.add_argument("--syncer-args", default="", help="more flags for `dilocod syncer` (one string)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the numbers")
    args = parser.parse_args(argv)
    args.learner_counts = [int(m) for m in args.learners.split(",")]
    if min(args.learner_counts) < 1 or args.seconds <= 0 or args.warmup_s < 0 or args.params < LAYERS:
        parser.error("--learners must be positive, --seconds > 0, --warmup-s >= 0, --params >= 24")
    for quorum in (args.paced_quorum, args.saturated_quorum):
        if quorum != "all" and not quorum.isdigit():
            parser.error("a quorum is a number or 'all'")
    phases = {
        "paced": Phase("paced", args.paced_step_s, args.paced_quorum),
        "saturated": Phase("saturated", args.saturated_step_s, args.saturated_quorum),
    }
    try:
        args.phase_list = [phases[name] for name in args.phases.split(",")]
    except KeyError as exc:
        parser.error(f"unknown phase {exc}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    args = parse_args(argv[1:])
    machine = machine_facts("dilocod")
    width = model_width(args.params)
    params = LAYERS * (width * width + width)
    print(f"model: {LAYERS} x Linear({width}, {width}) = {params:,} parameters, {2 * LAYERS} tensors")
    results = []
    for m in args.learner_counts:
        for phase in args.phase_list:
            result = measure(m, phase, args)
            results.append(result)
            print(progress_line(result), flush=True)
    machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(table(results))
    record = {
        "command": command_line(argv),
        "machine": machine,
        "model": {"layers": LAYERS, "width": width, "parameters": params, "tensors": 2 * LAYERS},
        "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "phase_list"
        },
        "results": results,
    }
    path = args.json if args.json.is_absolute() else ROOT / args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
