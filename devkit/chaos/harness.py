"""A chaos run on real processes: one `dilocod syncer` and three `dilocod learner` processes training
the embedded model (dilocod.examples.charlm) on loopback, every learner behind the fault proxy
(devkit/chaos/proxy.py), a schedule of faults, and the evidence gathered while it runs and after.

What it owns: starting and restarting the daemons, the fault schedule (network faults through the
proxy at a steady rate, kills with -9 aimed mid-push and mid-update, SIGSTOP/SIGCONT, a partition,
the syncer killed with -9 and restarted on its state directory), sampling `dilocod status` and each
process's VmRSS once a second, and the analysis of what the daemons said (their JSON logs, their
state directories, the proxy's ledger of acknowledged pushes) into a ChaosReport. It asserts
nothing: tests/chaos/test_chaos.py does, bench/chaos.py records.

Learner "c" is the survivor: it gets only network faults and the syncer's restart, never a kill or a
stop; "a" and "b" get everything. Every wait is on a log record, a process exit or a status
reading, with a deadline; a sleep in here is the schedule itself (how long a fault lasts).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dilocod.config import Address
from dilocod.ops.processes import read_ready_line
from dilocod.ops.status import fetch_status
from dilocod.transport.loop import run
from dilocod.transport.options import TransportOptions
from dilocod.wire.frames import FrameType

from .proxy import Fault, FaultProxy, Kind, RelayFaults, Way

LEARNERS = ("a", "b", "c")
SURVIVOR = "c"
#: Small, fast settings: 4 fragments, each synced every 8 steps (a round every 2 steps), so a run
#: of a few minutes merges thousands of rounds; checkpoints every 5 s so a syncer killed with -9
#: loses little. The outer momentum is lowered as bench/RESULTS.md §7 found best at this scale.
SYNCER_ARGS = (
    *("--fragments", "4", "--sync-every", "8", "--checkpoint-every-s", "5"),
    *("--outer-momentum", "0.5"),
)
#: Two data connections each (chunks striped, resent on a survivor when one is cut); learner b
#: compresses its pushes, so corrupted zstd payloads reach the syncer's decoder too.
LEARNER_ARGS = ("--device", "cpu", "--streams", "2", "--save-every-s", "5", "--progress-every-s", "2")
CODECS = {"a": "none", "b": "zstd", "c": "none"}
CHARLM_ENTRY = "dilocod.examples.charlm:make_trainer"
#: The transport's deadline the long faults are measured against: a session silent this long is
#: closed (30 s). Nothing is scaled down: the partition is 2/3 of it (the session survives), the
#: long stop 10 s more (the syncer drops the session; the learner reconnects and heals).
IDLE_TIMEOUT_S = TransportOptions().idle_timeout_s
#: Quorum K of the run (the syncer's default): training must go on while K learners are live.
QUORUM = 1
READY_TIMEOUT_S = 120.0
EVENT_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 60.0
SAMPLE_EVERY_S = 1.0
#: A process is warm this long after it started (bench/notes/learner-memory.md: a learner's RSS
#: is flat from about 20 s on); its growth is measured from a window of WINDOW_S after that to
#: the last WINDOW_S of its life, for processes that lived at least WARM_S + 2 * WINDOW_S.
WARM_S = 30.0
WINDOW_S = 15.0
#: Versions must rise within any window this long in which >= K learners are live and unimpaired.
PROGRESS_WINDOW_S = 6.0
#: A learner counts as impaired this long after a stop or partition ends (its backlog drains).
IMPAIRED_TAIL_S = 2.0
#: A learner's progress lines come every 2 s (--progress-every-s) while it steps.
PROGRESS_GAP_S = 6.0
#: A single fragment whose version stands still this long while learners are live is reported.
FRAGMENT_STALL_S = 20.0
#: Where a run keeps a copy of every checkpoint its syncer writes (the syncer keeps the newest 3).
CURVE_DIR = "curve"
#: Checkpoints at the end of a run whose mean loss is compared (ChaosReport.compare_tail): the
#: last 30 s at one checkpoint every 5 s.
TAIL_CHECKPOINTS = 6


@dataclass(frozen=True)
class ChaosPlan:
    work: Path
    #: Length of the fault schedule; a fault-free run trains for as long.
    duration_s: float = 150.0
    faults: bool = True
    #: One network fault through the proxy this often (flips, truncations, short cuts).
    network_every_s: float = 1.0
    #: The long partition and the long stop, at full scale (see IDLE_TIMEOUT_S).
    cut_s: float = IDLE_TIMEOUT_S * 2 / 3
    long_stop_s: float = IDLE_TIMEOUT_S + 10.0
    seed: int = 0
    learners: tuple[str, ...] = LEARNERS
    #: Keep every checkpoint with the steps trained by then: the loss-versus-steps curve another
    #: run is compared with at equal steps (ChaosReport.loss_at_steps).
    keep_curve: bool = False
    #: Instead of the schedule (faults=False): a flaky relay for the whole run (devkit/chaos/proxy.py),
    #: on from the moment every learner is live until the run's length has passed.
    relay: RelayFaults | None = None
    #: The training both daemons run (--entry), and environment it reads; "" is the embedded
    #: charlm, the only one whose eval loss a report gives.
    entry: str = ""
    env: tuple[tuple[str, str], ...] = ()
    #: Flags every learner is started with beyond the harness's own (e.g. ("--answer", "arrival")).
    learner_args: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------- processes


@dataclass
class Daemon:
    """One daemon process, its JSON log lines (stderr, also copied to a file) and how it ended."""

    name: str
    command: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)
    info: dict[str, Any] = field(default_factory=dict)
    #: Set when the schedule kills it: its exit by SIGKILL is expected, not a crash.
    killed: bool = False
    started_at: float = 0.0
    exit_code: int | None = None
    #: Signals go to the daemon's whole process group: a learner is its training process and the
    #: child that runs its network (--network process), and a host that crashes or freezes takes
    #: both. (SIGTERM goes to the daemon alone: it stops its child itself.)
    group: bool = False

    def start(self, env: dict[str, str], *, ready: bool = False) -> None:
        self.started_at = time.time()
        self.process = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE if ready else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=self.group,
        )
        assert self.process.stderr is not None
        threading.Thread(target=self._follow, args=(self.process.stderr,), daemon=True).start()
        if ready:
            self.info = read_ready_line(self.process, f"{self.name} (see {self.log_path})", READY_TIMEOUT_S)

    def _follow(self, stream: IO[bytes]) -> None:
        with self.log_path.open("ab") as copy:
            for raw in stream:
                copy.write(raw)
                copy.flush()
                try:
                    record = json.loads(raw)
                except ValueError:
                    record = {"event": "(not json)", "text": raw.decode(errors="replace")}
                if not isinstance(record, dict):
                    continue
                with self.changed:
                    self.records.append(record)
                    self.changed.notify_all()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def events(self, event: str) -> list[dict[str, Any]]:
        with self.changed:
            return [r for r in self.records if r.get("event") == event]

    def wait_for(
        self, event: str, accept: Callable[[dict[str, Any]], bool] = lambda r: True, timeout_s: float = 60.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self.changed:
            while True:
                for record in self.records[seen:]:
                    if record.get("event") == event and accept(record):
                        return record
                seen = len(self.records)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.alive():
                    raise TimeoutError(
                        f"{self.name}: no {event!r} within {timeout_s:.0f} s ({self.log_path})"
                    )
                self.changed.wait(min(remaining, 1.0))

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.process is not None
            self.process.send_signal(sig)

    def signal_all(self, sig: int) -> None:
        """sig to the daemon and every process it started (its group), or to it alone."""
        if not self.group:
            self.signal(sig)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def pids(self) -> list[int]:
        """The daemon and its children (a learner's network process)."""
        if not self.alive():
            return []
        try:
            children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        except OSError:
            children = []
        return [self.pid, *(int(child) for child in children)]

    def kill(self) -> int:
        self.killed = True
        self.signal_all(signal.SIGKILL)
        return self.wait(STOP_TIMEOUT_S)

    def wait(self, timeout_s: float) -> int:
        assert self.process is not None
        try:
            self.exit_code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.exit_code = self.process.wait()
            raise
        return self.exit_code


def _epoch(record: dict[str, Any]) -> float:
    stamp = str(record.get("timestamp", "")).replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


def _rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


# ------------------------------------------------------------------------------------------ run


@dataclass
class Sample:
    at: float  # epoch seconds
    syncer: str | None  # incarnation, None when the syncer did not answer
    versions: list[int] | None
    live: set[str]
    rss: dict[int, int]  # pid -> bytes


@dataclass
class Impairment:
    learner: str
    kind: str
    start: float
    end: float


class ChaosRun:
    def __init__(self, plan: ChaosPlan) -> None:
        self.plan = plan
        self.work = plan.work
        self.rng = random.Random(plan.seed)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **dict(plan.env)}
        self.entry_args = ("--entry", plan.entry) if plan.entry else ()
        self.syncers: list[Daemon] = []
        self.learners: dict[str, list[Daemon]] = {name: [] for name in plan.learners}
        self.samples: list[Sample] = []
        self.impairments: list[Impairment] = []
        self.faults: Counter[str] = Counter()
        self.fault_log: list[dict[str, Any]] = []
        self.checkpoint_checks: list[dict[str, Any]] = []
        self.notes: list[str] = []
        #: Learners the schedule has down or cut off right now: network faults aim elsewhere.
        self._busy: set[str] = set()
        self._pid_names: dict[int, str] = {}
        self._stop_sampling = threading.Event()
        self._stop_network = threading.Event()
        self._lock = threading.Lock()
        self.proxy: FaultProxy | None = None
        self.started = 0.0
        self.faults_ended = 0.0
        self.final_status: dict[str, Any] = {}
        self.status_table = ""
        self.terminated_at = 0.0

    # -------------------------------------------------------------- daemons

    @property
    def syncer(self) -> Daemon:
        return self.syncers[-1]

    def learner(self, name: str) -> Daemon:
        return self.learners[name][-1]

    def _start_syncer(self) -> Daemon:
        index = len(self.syncers)
        daemon = Daemon(
            f"syncer-{index}",
            [
                *(sys.executable, "-m", "dilocod", "syncer", "--listen", "127.0.0.1:0"),
                *("--state-dir", str(self.work / "syncer"), "--ready-json", *SYNCER_ARGS),
                *self.entry_args,
            ],
            self.work / f"syncer-{index}.log",
        )
        daemon.start(self.env, ready=True)
        self.syncers.append(daemon)
        if self.proxy is not None:
            self.proxy.set_upstream("127.0.0.1", int(daemon.info["port"]))
        return daemon

    def _start_learner(self, name: str) -> Daemon:
        assert self.proxy is not None
        index = len(self.learners[name])
        seed = self.plan.learners.index(name)
        through_proxy = f"127.0.0.1:{self.proxy.port_of(name)}"
        daemon = Daemon(
            f"learner-{name}-{index}",
            [
                *(sys.executable, "-m", "dilocod", "learner", "--syncer", through_proxy, "--id", name),
                *("--seed", str(seed), "--codec", CODECS.get(name, "none"), *LEARNER_ARGS),
                *("--state-dir", str(self.work / name)),
                *self.entry_args,
                *self.plan.learner_args,
            ],
            self.work / f"learner-{name}-{index}.log",
        )
        daemon.info = {"id": name}
        daemon.group = True
        daemon.start(self.env)
        self.learners[name].append(daemon)
        return daemon

    def _status(self) -> dict[str, Any] | None:
        port = self.syncer.info.get("port")
        try:
            return run(fetch_status(Address("127.0.0.1", int(port)), secret=None, timeout_s=5.0))
        except (OSError, ConnectionError, TimeoutError):
            return None

    def _wait_status(
        self, accept: Callable[[dict[str, Any]], bool], what: str, timeout_s: float
    ) -> dict[str, Any]:
        """Poll the syncer's status until accept() takes it (a deadline, not a sleep)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self._status()
            if status is not None and accept(status):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not reached within {timeout_s:.0f} s (last status: {status})")
            if not self.syncer.alive():
                raise RuntimeError(f"the syncer exited while waiting for {what}")
            self._stop_sampling.wait(0.25)  # the polling period

    # -------------------------------------------------------------- the run

    def run(self) -> ChaosReport:
        self.work.mkdir(parents=True, exist_ok=True)
        wall = time.monotonic()
        try:
            self._start_syncer()
            with FaultProxy(("127.0.0.1", int(self.syncer.info["port"])), list(self.plan.learners)) as proxy:
                self.proxy = proxy
                for name in self.plan.learners:
                    self._start_learner(name)
                for name in self.plan.learners:
                    self.learner(name).wait_for("healed", timeout_s=READY_TIMEOUT_S)
                self._wait_status(
                    lambda s: _live(s) == set(self.plan.learners), "every learner live", EVENT_TIMEOUT_S
                )
                self.started = time.time()
                sampler = threading.Thread(target=self._sample_loop, name="sampler", daemon=True)
                sampler.start()
                network = threading.Thread(target=self._network_faults, name="network faults", daemon=True)
                if self.plan.faults:
                    network.start()
                try:
                    self._schedule()
                finally:
                    self._stop_network.set()
                    if network.is_alive():
                        network.join(60.0)
                self.faults_ended = time.time()
                self._settle()
                self.final_status = json.loads(self._status_command("--json"))
                self.status_table = self._status_command()
                self._stop_sampling.set()
                sampler.join(30.0)
                self._terminate()
                report = self._analyse(proxy)
        finally:
            self._stop_sampling.set()
            self._stop_network.set()
            for daemon in [*(d for ds in self.learners.values() for d in ds), *self.syncers]:
                if daemon.alive():
                    with contextlib.suppress(Exception):
                        daemon.kill()
        report.wall_s = time.monotonic() - wall
        (self.work / "report.json").write_text(json.dumps(report.details(), indent=1, default=str) + "\n")
        return report

    def _status_command(self, *args: str) -> str:
        """`dilocod status` as a user runs it, its output."""
        address = f"127.0.0.1:{self.syncer.info['port']}"
        command = [sys.executable, "-m", "dilocod", "status", "--syncer", address, *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True, env=self.env)
        return done.stdout

    def _sample_loop(self) -> None:
        while not self._stop_sampling.is_set():
            status = self._status()
            for daemon in [self.syncer, *(self.learner(n) for n in self.plan.learners)]:
                for pid in daemon.pids():
                    self._pid_names.setdefault(
                        pid, daemon.name if pid == daemon.pid else f"{daemon.name} child"
                    )
            pids = [*self.syncer.pids(), *(pid for n in self.plan.learners for pid in self.learner(n).pids())]
            rss = {pid: value for pid in pids if (value := _rss_bytes(pid)) is not None}
            sample = Sample(
                time.time(),
                None if status is None else status["incarnation"],
                None if status is None else [f["version"] for f in status["fragments"]],
                set() if status is None else _live(status),
                rss,
            )
            with self._lock:
                self.samples.append(sample)
            if self.plan.keep_curve:
                self._keep_checkpoints()
            self._stop_sampling.wait(SAMPLE_EVERY_S)  # the sampling period

    def _keep_checkpoints(self) -> None:
        """Copy each checkpoint the syncer has written since the last call (one every 5 s; the
        sampler calls this every second, the syncer deletes a checkpoint three later)."""
        from dilocod.syncer.checkpoint import CHECKPOINTS_DIR  # torch, so only when needed

        source = self.work / "syncer" / CHECKPOINTS_DIR
        for entry in sorted(source.iterdir()) if source.is_dir() else []:
            target = self.work / CURVE_DIR / entry.name
            if not entry.name.startswith("ckpt-") or target.exists():
                continue
            staging = self.work / CURVE_DIR / f".{entry.name}"
            try:
                shutil.copytree(entry, staging / CHECKPOINTS_DIR / entry.name)
            except (FileNotFoundError, shutil.Error):  # pruned while being copied: load would refuse it
                shutil.rmtree(staging, ignore_errors=True)
                continue
            staging.rename(target)

    # -------------------------------------------------------------- the schedule

    def _at(self, fraction: float) -> None:
        """Sleep until this point of the schedule: the schedule's own pacing."""
        target = self.started + fraction * self.plan.duration_s
        delay = target - time.time()
        if delay > 0:
            time.sleep(delay)

    def _schedule(self) -> None:
        if self.plan.relay is not None:
            assert self.proxy is not None
            self.proxy.set_relay_faults(self.plan.relay)
            try:
                self._at(1.0)
            finally:
                self.proxy.set_relay_faults(None)
            return
        if not self.plan.faults:
            self._at(1.0)
            return
        plan = self.plan
        self._at(0.06)
        self._kill_learner("a", mid=Way.UP)
        self._at(0.13)
        self._stop_learner("b", 3.0, "short stop")
        self._at(0.20)
        self._kill_learner("b", mid=Way.DOWN)
        self._at(0.28)
        self._kill_syncer()
        self._at(0.40)
        self._blackhole("a", plan.cut_s)
        self._at(0.46)
        self._stop_learner("b", plan.long_stop_s, "long stop")  # returns after SIGCONT
        self._at(0.78)
        self._kill_learner("a", mid=Way.DOWN)
        self._at(0.84)
        self._kill_learner("b", mid=Way.UP)
        self._at(0.90)
        self._sever("a", 3.0)
        self._at(0.93)
        self._stop_learner("a", 3.0, "short stop")
        self._at(1.0)

    def _record(self, kind: str, learner: str, **details: Any) -> None:
        with self._lock:
            self.faults[kind] += 1
            now = time.time()
            self.fault_log.append(
                {"kind": kind, "learner": learner, "at_s": round(now - self.started, 1), **details}
            )

    def _impaired(self, learner: str, kind: str, start: float, end: float) -> None:
        with self._lock:
            self.impairments.append(Impairment(learner, kind, start, end + IMPAIRED_TAIL_S))

    def _kill_learner(self, name: str, *, mid: Way) -> None:
        """kill -9 in the middle of a push (mid=UP) or an update (mid=DOWN): the proxy forwards half
        a CHUNK frame of that direction, stops that connection and sends SIGKILL right then."""
        assert self.proxy is not None
        victim = self.learner(name)
        victim.killed = True
        fault = self.proxy.arm(
            name,
            Fault(
                Kind.HOLD, mid, frozenset({FrameType.CHUNK}), then=lambda: victim.signal_all(signal.SIGKILL)
            ),
        )
        start = time.time()
        self._busy.add(name)
        where = "mid-push" if mid is Way.UP else "mid-update"
        if not fault.done.wait(EVENT_TIMEOUT_S) and self.proxy.disarm(name, fault):
            self.notes.append(f"{name}: no {where} chunk within {EVENT_TIMEOUT_S:.0f} s: killed anyway")
            where = "at a random point"
        victim.kill()
        self._record(f"kill -9 learner {where}", name, exit_code=victim.exit_code, hit=fault.hit)
        self._start_learner(name)
        healed = self.learner(name).wait_for("healed", timeout_s=EVENT_TIMEOUT_S)
        self._impaired(name, "kill", start, _epoch(healed))
        self._busy.discard(name)

    def _stop_learner(self, name: str, seconds: float, what: str) -> None:
        victim = self.learner(name)
        start = time.time()
        self._busy.add(name)
        victim.signal_all(signal.SIGSTOP)
        time.sleep(seconds)  # the fault itself
        victim.signal_all(signal.SIGCONT)
        self._busy.discard(name)
        self._record(f"SIGSTOP learner ({what}, {seconds:g} s)", name, seconds=seconds)
        self._impaired(name, what, start, time.time())

    def _blackhole(self, name: str, seconds: float) -> None:
        assert self.proxy is not None
        start = time.time()
        self._hold_busy(name, seconds)
        self.proxy.blackhole(name, seconds)
        self._record(f"partition learner ({seconds:g} s)", name, seconds=seconds)
        self._impaired(name, "partition", start, start + seconds)

    def _sever(self, name: str, seconds: float) -> None:
        assert self.proxy is not None
        start = time.time()
        self._hold_busy(name, seconds)
        self.proxy.sever(name, seconds)
        self._record(f"sever learner ({seconds:g} s)", name, seconds=seconds)
        self._impaired(name, "sever", start, start + seconds)

    def _hold_busy(self, name: str, seconds: float) -> None:
        self._busy.add(name)
        timer = threading.Timer(seconds, self._busy.discard, (name,))
        timer.daemon = True
        timer.start()

    def _kill_syncer(self) -> None:
        """kill -9 the syncer and start it again on its state directory: it must resume from its
        newest checkpoint, never below it."""
        from dilocod.syncer.checkpoint import load_latest_checkpoint  # torch, so only when needed

        old = self.syncer
        old.kill()
        loaded = load_latest_checkpoint(self.work / "syncer")
        saved = list(loaded.state.versions) if loaded is not None else None
        new = self._start_syncer()
        self._record("kill -9 syncer and restart", "syncer", exit_code=old.exit_code)
        self.checkpoint_checks.append(
            {"checkpoint_versions": saved, "resumed_versions": list(new.info["versions"])}
        )

    def _network_faults(self) -> None:
        """Flips and truncations through the proxy, at a steady rate, on any learner."""
        assert self.proxy is not None
        kinds = [
            ("flip a push chunk", 3, Kind.FLIP, Way.UP, {FrameType.CHUNK}, None),
            ("flip an update chunk", 3, Kind.FLIP, Way.DOWN, {FrameType.CHUNK}, None),
            ("truncate a push chunk", 1, Kind.TRUNCATE, Way.UP, {FrameType.CHUNK}, "data"),
            ("truncate an update chunk", 1, Kind.TRUNCATE, Way.DOWN, {FrameType.CHUNK}, "data"),
            (
                "truncate a control frame",
                1,
                Kind.TRUNCATE,
                self.rng.choice([Way.UP, Way.DOWN]),
                {
                    FrameType.STEP_REPORT,
                    FrameType.PUSH_HEADER,
                    FrameType.FRAGMENT_REQUEST,
                    FrameType.UPDATE_HEADER,
                },
                "control",
            ),
        ]
        weights = [k[1] for k in kinds]
        next_at = time.monotonic()
        while not self._stop_network.is_set():
            next_at += self.plan.network_every_s * self.rng.uniform(0.5, 1.5)
            if self._stop_network.wait(max(0.0, next_at - time.monotonic())):  # the fault rate
                break
            label, _, kind, way, types, connection = self.rng.choices(kinds, weights)[0]
            # Aim at learners with traffic to hit: not down by the schedule, connected right now.
            free = [n for n in self.plan.learners if n not in self._busy and self.proxy.connections(n) > 0]
            if not free:
                continue
            name = self.rng.choice(free)
            fault = self.proxy.arm(name, Fault(kind, way, frozenset(types), connection))
            # A learner reconnecting carries nothing to aim at for a moment: give up on this one.
            if fault.done.wait(5.0) or not self.proxy.disarm(name, fault):
                self._record(label, name, hit=fault.hit)

    # -------------------------------------------------------------- the end

    def _settle(self) -> None:
        """After the last fault: every learner live, then rounds merged again with all of them
        there (two per fragment on average), so each has had the newest fragments sent."""
        for name in self.plan.learners:
            if not self.learner(name).alive():
                raise RuntimeError(
                    f"learner {name} is not running after the schedule ({self.learner(name).log_path})"
                )
        everyone = set(self.plan.learners)
        ended = self._wait_status(lambda s: _live(s) == everyone, "every learner live", EVENT_TIMEOUT_S)
        floor = sum(f["version"] for f in ended["fragments"]) + 2 * len(ended["fragments"])
        self._wait_status(
            lambda s: sum(f["version"] for f in s["fragments"]) >= floor and _live(s) == everyone,
            "rounds merged with every learner live",
            EVENT_TIMEOUT_S,
        )

    def _terminate(self) -> None:
        """SIGTERM the learners together (each saves its state and says which fragments it holds),
        then, once the syncer has seen them all leave, the syncer (it checkpoints)."""
        self.terminated_at = time.time()
        for name in self.plan.learners:
            self.learner(name).signal(signal.SIGTERM)
        for name in self.plan.learners:
            self.learner(name).wait(STOP_TIMEOUT_S)
        for name in self.plan.learners:
            self.syncer.wait_for(
                "learner left",
                lambda r, name=name: r.get("learner") == name and _epoch(r) >= self.terminated_at - 1.0,
                timeout_s=EVENT_TIMEOUT_S,
            )
        self.syncer.signal(signal.SIGTERM)
        self.syncer.wait(STOP_TIMEOUT_S)

    # -------------------------------------------------------------- analysis

    def _analyse(self, proxy: FaultProxy) -> ChaosReport:
        report = ChaosReport(plan=self.plan)
        report.faults = dict(self.faults)
        report.proxy_injected = dict(proxy.injected)
        report.fault_log = self.fault_log
        report.notes = self.notes
        report.checkpoint_checks = self.checkpoint_checks
        report.status = self.final_status
        report.status_table = self.status_table
        with self._lock:
            report.timeline = [
                [round(x.at - self.started, 1), (x.syncer or "-")[:6], x.versions, sorted(x.live)]
                for x in self.samples
            ]
        self._check_processes(report)
        self._check_pushes(report, proxy)
        self._check_versions(report)
        self._check_holding(report)
        self._check_memory(report)
        self._check_learners_train_on(report)
        report.goodput = {
            learner["id"]: learner["goodput"] for learner in self.final_status.get("learners", [])
        }
        report.rounds_merged = sum(len(s.events("round merged")) for s in self.syncers)
        report.frames = dict(
            sorted((f"{learner} {way.name} {kind}", n) for (learner, way, kind), n in proxy.frames.items())
        )
        for name in self.plan.learners:
            report.joins[name] = sum(len(d.events("joined")) for d in self.learners[name])
        report.heals = [
            {
                "learner": r["learner"],
                "bytes": r["bytes"],
                "fragments": r["fragments"],
                "duration_s": r["duration_s"],
            }
            for s in self.syncers
            for r in s.events("learner healed")
        ]
        report.bad_input_logged = Counter(
            r["code"] for s in self.syncers for r in s.events("bad input from learner")
        )
        report.eval_loss = float("nan") if self.plan.entry else _eval_loss(self.work / "syncer")
        report.steps = self._steps_trained()
        if self.plan.keep_curve:
            self._keep_checkpoints()  # the one written at shutdown
            report.curve = _curve(self.work / CURVE_DIR)
        return report

    def _steps_trained(self) -> int:
        """Steps the learners kept, summed: each one's step counter when it stopped last. Steps a
        learner trained and lost (between its last state save and a kill) are not counted, just
        as bench/convergence.py counts tokens."""
        total = 0
        for name in self.plan.learners:
            stopped = self.learner(name).events("learner stopped")
            if not stopped:
                raise RuntimeError(f"learner {name} never said it stopped ({self.learner(name).log_path})")
            total += int(stopped[-1]["step"])
        return total

    def _check_processes(self, report: ChaosReport) -> None:
        for daemon in [*self.syncers, *(d for ds in self.learners.values() for d in ds)]:
            expected = -signal.SIGKILL if daemon.killed else 0
            code = daemon.exit_code
            report.exits.append({"process": daemon.name, "exit_code": code, "expected": expected})
            if code != expected:
                report.crashes.append(
                    f"{daemon.name} exited with {code}, expected {expected} ({daemon.log_path})"
                )
            for record in daemon.records:
                if record.get("event") in ("internal error", "merge failed", "merge without its pushes") or (
                    "Traceback" in json.dumps(record)
                ):
                    report.crashes.append(f"{daemon.name}: {json.dumps(record)[:400]}")

    def _check_pushes(self, report: ChaosReport, proxy: FaultProxy) -> None:
        """Every push the syncer acknowledged ends in exactly one way in that syncer's log: merged
        (once), released or rejected (with a reason), named unmerged at its shutdown, or lost with it
        when it was killed. A (learner, round) merged twice by one syncer is a push applied twice."""
        by_port = {int(s.info["port"]): s for s in self.syncers}
        acked = [a for a in proxy.answers if a.transfer == "push" and a.acked]
        report.pushes["acked"] = len(acked)
        report.pushes["refused"] = sum(1 for a in proxy.answers if a.transfer == "push" and not a.acked)
        report.updates_acked = sum(1 for a in proxy.answers if a.transfer == "update" and a.acked)
        report.updates_refused = sum(1 for a in proxy.answers if a.transfer == "update" and not a.acked)
        outcome: dict[int, dict[tuple[str, int], list[str]]] = {}
        for port, syncer in by_port.items():
            seen: dict[tuple[str, int], list[str]] = defaultdict(list)
            bases: Counter[tuple[str, int, int]] = Counter()
            for record in syncer.events("round merged"):
                for learner, push_round, base in zip(
                    record["contributors"], record["push_rounds"], record["base_versions"], strict=True
                ):
                    seen[(learner, push_round)].append("merged")
                    bases[(learner, record["fragment"], base)] += 1
            for record in syncer.events("push released"):
                seen[(record["learner"], record["round"])].append(f"released: {record['reason']}")
            for record in syncer.events("push rejected"):
                seen[(record["learner"], record["round"])].append(f"rejected: {record['reason']}")
            for record in syncer.events("stopping"):
                for learner, index in record.get("unmerged_pushes", []):
                    seen[(learner, index)].append("unmerged at shutdown")
            outcome[port] = seen
            for key, fates in seen.items():
                if fates.count("merged") > 1:
                    report.double_applied.append(
                        f"{syncer.name}: push {key} merged {fates.count('merged')} times"
                    )
            report.pushes["merged from an already merged base"] += sum(n - 1 for n in bases.values() if n > 1)
        acked_keys: dict[int, set[tuple[str, int]]] = defaultdict(set)
        for answer in acked:
            key = (answer.learner, answer.round_or_version)
            acked_keys[answer.upstream].add(key)
            syncer = by_port.get(answer.upstream)
            fates = outcome.get(answer.upstream, {}).get(key, [])
            if fates:
                first = fates[0].split(":")[0]
                report.pushes[first] += 1
            elif syncer is not None and syncer.killed:
                report.pushes["lost with a syncer killed by -9"] += 1
            else:
                report.lost.append(f"{answer} has no fate in {syncer.name if syncer else '?'}'s log")
        for port, seen in outcome.items():
            for key, fates in seen.items():
                if "merged" in fates and key not in acked_keys[port]:
                    # Merged but never acknowledged through the proxy: only possible for a push
                    # whose acknowledgement raced a kill or a cut of that connection.
                    report.pushes["merged, acknowledgement not seen"] += 1

    def _check_versions(self, report: ChaosReport) -> None:
        with self._lock:
            samples = list(self.samples)
            impairments = list(self.impairments)
        report.samples = len(samples)
        previous: dict[str, list[int]] = {}
        for sample in samples:
            if sample.versions is None or sample.syncer is None:
                continue
            last = previous.get(sample.syncer)
            if last is not None and any(v < w for v, w in zip(sample.versions, last, strict=True)):
                report.version_drops.append(
                    f"{sample.syncer}: {last} -> {sample.versions} at {sample.at:.1f}"
                )
            previous[sample.syncer] = sample.versions
        for check in self.checkpoint_checks:
            saved, resumed = check["checkpoint_versions"], check["resumed_versions"]
            if saved is not None and any(r < s for r, s in zip(resumed, saved, strict=True)):
                report.version_drops.append(f"resumed {resumed} below the checkpoint's {saved}")

        # Survivors never stop: within any window of PROGRESS_WINDOW_S in which >= K learners are
        # live (the syncer says so) and unimpaired (not stopped or cut off by the schedule) from
        # start to end, with one syncer, the versions rise.
        def healthy(sample: Sample) -> bool:
            if sample.versions is None:
                return False
            impaired = {i.learner for i in impairments if i.start <= sample.at <= i.end}
            return len(sample.live - impaired) >= QUORUM

        windows = 0
        for i, first in enumerate(samples):
            if not healthy(first):
                continue
            for later in samples[i + 1 :]:
                if not healthy(later) or later.syncer != first.syncer:
                    break
                if later.at - first.at >= PROGRESS_WINDOW_S:
                    windows += 1
                    assert first.versions is not None and later.versions is not None
                    if sum(later.versions) <= sum(first.versions):
                        since, until = first.at - self.started, later.at - self.started
                        report.stalls.append(
                            f"no merge between {since:.1f} s and {until:.1f} s with {sorted(first.live)} live"
                        )
                    break
        report.progress_windows = windows

        # The same per fragment: the longest time each one stood still while >= K learners were
        # live and unimpaired (reported, not asserted: test_chaos.py says why).
        def standing(fragment: int, since: Sample, until: Sample) -> None:
            if until.at - since.at >= FRAGMENT_STALL_S:
                assert since.versions is not None
                report.fragment_stalls.append(
                    f"fragment {fragment} stood at version {since.versions[fragment]} for "
                    f"{until.at - since.at:.0f} s from {since.at - self.started:.0f} s"
                )

        for fragment in range(len(next((s.versions for s in samples if s.versions), []))):
            since: Sample | None = None
            last: Sample | None = None
            for sample in samples:
                same = since is not None and healthy(sample) and sample.syncer == since.syncer
                if same and since.versions[fragment] == sample.versions[fragment]:  # type: ignore[index]
                    last = sample
                    continue
                if since is not None and last is not None:
                    standing(fragment, since, last)
                since = last = sample if healthy(sample) else None
            if since is not None and last is not None:
                standing(fragment, since, last)

    def _check_holding(self, report: ChaosReport) -> None:
        """Each learner's last word ("holding fragments") against the syncer: every fragment at
        the syncer's final version with the bytes of its final checkpoint, or else at a version the
        syncer had at least 1 s before the learners were told to stop (a merge in the last second
        may not have reached them) with the digest the syncer logged when it merged that version."""
        syncer = self.syncer
        final = _final_fragments(self.work / "syncer", self.plan.entry or CHARLM_ENTRY)
        digests: dict[tuple[int, int], str] = {(p, v): d for p, (v, d) in enumerate(final)}
        as_of: dict[int, int] = dict(enumerate(syncer.info["versions"]))
        for record in syncer.events("round merged"):
            key = (record["fragment"], record["version"])
            if digests.setdefault(key, record["digest"]) != record["digest"]:
                report.not_holding.append(
                    f"the syncer logged {record['digest']} for {key}, checkpointed {digests[key]}"
                )
            if _epoch(record) <= self.terminated_at - 1.0:
                as_of[record["fragment"]] = max(as_of[record["fragment"]], record["version"])
        for name in self.plan.learners:
            holding = self.learner(name).events("holding fragments")
            if not holding:
                report.not_holding.append(f"{name}: no 'holding fragments' record")
                continue
            last = holding[-1]
            if last["incarnation"] != syncer.info["incarnation"]:
                report.not_holding.append(f"{name}: holds fragments of incarnation {last['incarnation']}")
            for fragment, (version, digest) in enumerate(zip(last["versions"], last["digests"], strict=True)):
                if version is None or version < as_of[fragment]:
                    report.not_holding.append(
                        f"{name}: fragment {fragment} at {version}, the syncer had {as_of[fragment]}"
                    )
                elif (logged := digests.get((fragment, version))) != digest:
                    report.not_holding.append(
                        f"{name}: fragment {fragment} v{version} digest {digest}, the syncer's {logged}"
                    )
            report.holding[name] = {
                "versions": last["versions"],
                "as_of": [as_of[p] for p in range(len(last["versions"]))],
            }

    def _check_learners_train_on(self, report: ChaosReport) -> None:
        """From the learners' side: a learner process that is not stopped never stops stepping,
        whatever happens to its link or to the syncer. Its progress lines (every 2 s while it
        steps) must never be further apart than PROGRESS_GAP_S, nor repeat a step count."""
        stops = [i for i in self.impairments if "stop" in i.kind]
        for daemon in (d for ds in self.learners.values() for d in ds):
            progress = daemon.events("progress")
            for before, after in itertools.pairwise(progress):
                start, end = _epoch(before), _epoch(after)
                if any(i.learner == daemon.info.get("id") and i.start < end and start < i.end for i in stops):
                    continue
                if end - start > PROGRESS_GAP_S or after["step"] <= before["step"]:
                    report.learner_stalls.append(
                        f"{daemon.name}: step {before['step']} at {start - self.started:.1f} s, "
                        f"step {after['step']} at {end - self.started:.1f} s"
                    )
            report.learner_progress_lines += len(progress)

    def _check_memory(self, report: ChaosReport) -> None:
        """Peak RSS of every process, and for those that lived long enough, RSS once warm against
        RSS at the end. A process grows for its first tens of seconds (the heal, the inner
        optimizer's state at the first step, the first pushes; a learner restarted by the
        schedule is all warm-up), then stays flat: bench/notes/learner-memory.md. Comparing a
        window after WARM_S with the end tells a leak from that warm-up."""
        series: dict[int, list[tuple[float, int]]] = defaultdict(list)
        with self._lock:
            for sample in self.samples:
                for pid, value in sample.rss.items():
                    series[pid].append((sample.at, value))
        names = self._pid_names
        for pid, points in series.items():
            born, last = points[0][0], points[-1][0]
            values = [v for _, v in points]
            measure: dict[str, float] = {"samples": len(values), "lived_s": round(last - born, 1)}
            measure["peak_mib"] = round(max(values) / 2**20, 1)
            warm = [v for at, v in points if WARM_S <= at - born < WARM_S + WINDOW_S]
            end = [v for at, v in points if at > last - WINDOW_S]
            if last - born >= WARM_S + 2 * WINDOW_S and warm and end:
                measure["warm_mib"] = round(max(warm) / 2**20, 1)
                measure["end_mib"] = round(max(end) / 2**20, 1)
            report.memory[names.get(pid, str(pid))] = measure


def _live(status: dict[str, Any]) -> set[str]:
    return {learner["id"] for learner in status["learners"] if learner["live"] and learner["connected"]}


def _final_fragments(syncer_state: Path, entry: str) -> list[tuple[int, str]]:
    """(version, xxh3-64 of the bytes) of every fragment in the syncer's newest checkpoint, laid
    out as the syncer sends them (its plan and layout, rebuilt the way the syncer builds them)."""
    from dilocod.contract import LearnerContext
    from dilocod.model.entry import load_trainer
    from dilocod.model.params import model_entries
    from dilocod.model.plan import plan_fragments
    from dilocod.syncer.checkpoint import load_latest_checkpoint
    from dilocod.syncer.model import GlobalModel
    from dilocod.wire.codecs import checksum

    loaded = load_latest_checkpoint(syncer_state)
    if loaded is None:
        raise RuntimeError(f"no checkpoint in {syncer_state}")
    specs = list(
        model_entries(load_trainer(entry, LearnerContext("x", "syncer", "cpu", 0, 1, None, 0)).model)
    )
    plan = plan_fragments([(s.name, s.shape) for s in specs], len(loaded.state.versions))
    model = GlobalModel(plan, specs, chunk_bytes=1 << 20, embedding_pattern="*embed*")
    model.load(loaded.state.params, loaded.state.momentum, loaded.state.versions)
    return [(store.version, f"{checksum(store.master):016x}") for store in model.fragments]


def _curve(root: Path) -> list[tuple[int, Path]]:
    """(steps trained by the learners, state dir) of every checkpoint kept under root, by steps:
    the sum of the learners' own step counters as the syncer last heard them when it saved (its
    roster's local_step, carried over the syncer's restarts; a learner restarted from an older
    save counts from that save again, as ChaosRun._steps_trained does)."""
    from dilocod.syncer.checkpoint import CheckpointError, load_latest_checkpoint

    points = []
    for state_dir in sorted(root.glob("ckpt-*")):
        try:
            loaded = load_latest_checkpoint(state_dir)
        except CheckpointError:
            continue  # damaged by a copy that raced the syncer's pruning
        if loaded is not None:
            roster = loaded.state.meta.get("roster", {})
            points.append((sum(int(r["local_step"]) for r in roster.values()), state_dir))
    return sorted(points)


def _eval_loss(syncer_state: Path) -> float:
    """charlm's eval loss (nats per byte, fixed held-out windows) of the syncer's last checkpoint."""
    from dilocod.examples.charlm import CharLM, CharLMConfig, evaluate  # torch, so only when needed
    from dilocod.syncer.checkpoint import load_latest_checkpoint

    loaded = load_latest_checkpoint(syncer_state)
    if loaded is None:
        raise RuntimeError(f"no checkpoint in {syncer_state}")
    model = CharLM(CharLMConfig())
    model.load_state_dict(loaded.state.params, strict=False)  # the tied head is stored once
    return float(evaluate(model))


#: A kept checkpoint never changes, and the comparisons read each one several times.
_kept_loss = functools.cache(_eval_loss)


@dataclass
class ChaosReport:
    plan: ChaosPlan
    faults: dict[str, int] = field(default_factory=dict)
    proxy_injected: dict[str, int] = field(default_factory=dict)
    fault_log: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    exits: list[dict[str, Any]] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    pushes: Counter[str] = field(default_factory=Counter)
    updates_acked: int = 0
    updates_refused: int = 0
    lost: list[str] = field(default_factory=list)
    double_applied: list[str] = field(default_factory=list)
    checkpoint_checks: list[dict[str, Any]] = field(default_factory=list)
    version_drops: list[str] = field(default_factory=list)
    stalls: list[str] = field(default_factory=list)
    fragment_stalls: list[str] = field(default_factory=list)
    learner_stalls: list[str] = field(default_factory=list)
    learner_progress_lines: int = 0
    progress_windows: int = 0
    samples: int = 0
    not_holding: list[str] = field(default_factory=list)
    holding: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    goodput: dict[str, float] = field(default_factory=dict)
    rounds_merged: int = 0
    #: Frames the proxy saw, per "learner UP|DOWN FRAME_TYPE" (UP: learner to syncer).
    frames: dict[str, int] = field(default_factory=dict)
    #: Sessions that joined (got a PLAN), per learner, the first included.
    joins: dict[str, int] = field(default_factory=dict)
    #: The syncer's "learner healed" lines: per session, what it sent before the learner joined.
    heals: list[dict[str, Any]] = field(default_factory=list)
    bad_input_logged: Counter[str] = field(default_factory=Counter)
    eval_loss: float = float("nan")
    #: Steps the learners kept (ChaosRun._steps_trained).
    steps: int = 0
    #: With plan.keep_curve: (steps, state dir) of every checkpoint the syncer wrote.
    curve: list[tuple[int, Path]] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    status_table: str = ""
    #: Every status sample: seconds since the schedule started, syncer, versions, live learners.
    timeline: list[list[Any]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def injected(self) -> int:
        return sum(self.faults.values())

    def loss_at_steps(self, steps: int) -> tuple[float, str]:
        """This run's eval loss when its learners had trained `steps` steps in all, interpolated
        linearly between the two checkpoints around it, and how it was found. Past the last
        checkpoint, the final loss (a run that trained fewer steps than asked for)."""
        if not self.curve:
            raise ValueError("no curve: run with keep_curve=True")
        below = [(s, d) for s, d in self.curve if s <= steps]
        above = [(s, d) for s, d in self.curve if s > steps]
        if not above:
            return self.eval_loss, f"final ({self.steps} steps; {steps} asked)"
        high_steps, high_dir = above[0]
        if not below:
            return _kept_loss(high_dir), f"first checkpoint ({high_steps} steps; {steps} asked)"
        low_steps, low_dir = below[-1]
        low, high = _kept_loss(low_dir), _kept_loss(high_dir)
        share = (steps - low_steps) / (high_steps - low_steps)
        return low + share * (high - low), f"between checkpoints at {low_steps} and {high_steps} steps"

    def tail(self, checkpoints: int) -> list[tuple[int, float]]:
        """(steps, eval loss) of this run's last `checkpoints` kept checkpoints: the end of its
        curve. The loss moves by up to a few percent between two checkpoints 5 s apart
        (bench/RESULTS.md §8), so runs are compared on the mean of several."""
        if not self.curve:
            raise ValueError("no curve: run with keep_curve=True")
        # The last ones written (their names are their sequence numbers), not the most steps: a
        # learner restarted from an older save makes the steps go back for a while.
        last = sorted(self.curve, key=lambda point: point[1].name)[-checkpoints:]
        return [(steps, _kept_loss(state_dir)) for steps, state_dir in last]

    def compare_tail(self, reference: ChaosReport, checkpoints: int) -> tuple[float, float]:
        """Mean eval loss of this run's last `checkpoints` checkpoints, and the reference run's
        mean loss at the same steps (each interpolated on its curve): equal work, point by point."""
        tail = self.tail(checkpoints)
        mine = statistics.fmean(loss for _, loss in tail)
        theirs = statistics.fmean(reference.loss_at_steps(steps)[0] for steps, _ in tail)
        return mine, theirs

    def summary(self) -> dict[str, Any]:
        return {
            "faults_injected": self.injected,
            "faults": self.faults,
            "crashes": self.crashes,
            "pushes": dict(self.pushes),
            "lost_pushes": len(self.lost),
            "double_applied_pushes": len(self.double_applied),
            "updates_acked": self.updates_acked,
            "updates_refused": self.updates_refused,
            "version_drops": self.version_drops,
            "stalls": self.stalls,
            "fragment_stalls": self.fragment_stalls,
            "learner_stalls": self.learner_stalls,
            "progress_windows": self.progress_windows,
            "not_holding": self.not_holding,
            "checkpoint_checks": self.checkpoint_checks,
            "goodput": self.goodput,
            "memory_mib": self.memory,
            "rounds_merged": self.rounds_merged,
            "joins": self.joins,
            "bad_input_logged": dict(self.bad_input_logged),
            "eval_loss": round(self.eval_loss, 4),
            "steps": self.steps,
            "notes": self.notes,
            "wall_s": round(self.wall_s, 1),
        }

    def details(self) -> dict[str, Any]:
        """The summary plus everything it was made from that fits in a file."""
        return {
            **self.summary(),
            "lost": self.lost,
            "double_applied": self.double_applied,
            "exits": self.exits,
            "fault_log": self.fault_log,
            "proxy_injected": self.proxy_injected,
            "frames": self.frames,
            "heals": self.heals,
            "holding": self.holding,
            "status": self.status,
            "status_table": self.status_table.splitlines(),
            "timeline": self.timeline,
        }
