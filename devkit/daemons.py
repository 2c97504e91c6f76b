"""`dilocod syncer` and `dilocod learner` child processes for the tests, and the small model
entries they build from.

The entry module is written into the test's own directory and put on the child's PYTHONPATH, the
way a user's package would be installed. The syncer's ready line (--ready-json) is waited for with
a deadline; stderr (structlog JSON lines) goes to a file the tests read merged rounds from.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dilocod.wire.manifest import ModelEntry

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0

ENTRY_SOURCE = """
import torch
import dilocod


def make_trainer(ctx):
    torch.manual_seed(1234)  # every process builds the same initial model
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if ctx.role == "learner" else None

    def step(index):
        return dilocod.StepResult(tokens=64, loss=0.0)

    return dilocod.Trainer(model=model, optimizer=optimizer, step=step)
"""
ENTRY = "syncer_test_entry:make_trainer"


def write_entry(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "syncer_test_entry.py").write_text(ENTRY_SOURCE)
    return directory


def entry_model(directory: Path) -> tuple[tuple[ModelEntry, ...], dict[str, Any]]:
    """The entry's parameters as JOIN lists them, and their initial values (float32 tensors)."""
    sys.path.insert(0, str(directory))
    try:
        import syncer_test_entry

        from dilocod import LearnerContext

        model = syncer_test_entry.make_trainer(LearnerContext("t", "syncer", "cpu", 0, 1, None, 0)).model
    finally:
        sys.path.remove(str(directory))
    entries = tuple(ModelEntry(n, "float32", tuple(p.shape)) for n, p in model.named_parameters())
    return entries, {n: p.detach().clone() for n, p in model.named_parameters()}


@dataclass
class DaemonProcess:
    process: subprocess.Popen[bytes]
    info: dict[str, Any]
    stderr_path: Path
    lines: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def follow(self, stream: IO[bytes]) -> None:
        """Copy the child's stderr to its file and to `lines` (run on a thread), waking waiters."""
        with self.stderr_path.open("ab") as copy:
            for raw in stream:
                copy.write(raw)
                copy.flush()
                with self.changed:
                    self.lines.append(raw.decode(errors="replace"))
                    self.changed.notify_all()

    def wait_for(
        self, event: str, accept: Callable[[dict[str, Any]], bool], timeout_s: float
    ) -> dict[str, Any]:
        """The first log record of `event` that accept() takes, waiting for it with a deadline."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self.changed:
            while True:
                for line in self.lines[seen:]:
                    record = _record(line)
                    if record is not None and record.get("event") == event and accept(record):
                        return record
                seen = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.alive():
                    raise TimeoutError(f"no {event!r} log record within {timeout_s} s:\n{self.stderr()}")
                self.changed.wait(remaining)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def port(self) -> int:
        return int(self.info["port"])

    def alive(self) -> bool:
        return self.process.poll() is None

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def log_events(self, event: str) -> list[dict[str, Any]]:
        with self.changed:
            records = [_record(line) for line in self.lines]
        return [r for r in records if r is not None and r.get("event") == event]

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait: the orderly shutdown (checkpoint, goodbye)."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def _record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def start_syncer(
    work: Path,
    entry_dir: Path,
    state_dir: Path,
    *args: str,
    entry: str = ENTRY,
    credentials: tuple[str, ...] = ("--insecure",),
) -> DaemonProcess:
    stderr_path = work / f"syncer-{len(list(work.glob('syncer-*.stderr')))}.stderr"
    env = _child_env(entry_dir)
    command = [
        sys.executable,
        "-m",
        "dilocod",
        "syncer",
        "--listen",
        "127.0.0.1:0",
        *credentials,
        "--entry",
        entry,
        "--state-dir",
        str(state_dir),
        "--ready-json",
        *args,
    ]
    stderr_path.touch()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout is not None and process.stderr is not None
    syncer = DaemonProcess(process, {}, stderr_path)
    threading.Thread(target=syncer.follow, args=(process.stderr,), daemon=True).start()
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(READY_TIMEOUT_S):
            process.kill()
            raise RuntimeError(f"syncer not ready within {READY_TIMEOUT_S} s: {syncer.stderr()}")
    line = process.stdout.readline()
    if not line:
        process.wait()
        raise RuntimeError(f"syncer exited with {process.returncode}: {syncer.stderr()}")
    syncer.info = json.loads(line)
    return syncer


LEARNER_ENTRY_SOURCE = """
import os
import time

import torch
import dilocod

TEACHER_SEED = 0
# Simulated compute per step, so that rounds keep pace with training as they would on a real model.
STEP_S = float(os.environ.get("LEARNER_TEST_STEP_S", "0"))


def batch(generator, size=32):
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(TEACHER_SEED))
    x = torch.randn(size, 16, generator=generator)
    return x, torch.tanh(x @ teacher)


def make_model():
    torch.manual_seed(1234)  # every process builds the same initial model
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def eval_loss(model):
    x, y = batch(torch.Generator().manual_seed(999), size=2048)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


evaluate = eval_loss  # what `dilocod demo` scores the global model with


def make_trainer(ctx):
    model = make_model()
    if ctx.role == "syncer":
        return dilocod.Trainer(model=model, optimizer=None, step=lambda i: dilocod.StepResult(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(ctx.seed)
    cursor = {"batches": 0}

    def step(index):
        x, y = batch(generator)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        cursor["batches"] += 1
        if STEP_S:
            time.sleep(STEP_S)
        return dilocod.StepResult(tokens=32, loss=float(loss))

    return dilocod.Trainer(
        model=model,
        optimizer=optimizer,
        step=step,
        state_dict=lambda: dict(cursor),
        load_state_dict=lambda state: cursor.update(state),
    )


def raising(ctx):
    raise FileNotFoundError("training data not found at /data/shards")


def make_wider(ctx):
    # A learner whose model is not the syncer's: 48 hidden units instead of 32.
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return dilocod.Trainer(model=model, optimizer=optimizer, step=lambda i: dilocod.StepResult(32))


def make_island_trainer(ctx):
    # One rank of a torchrun island: data parallel inside the island with DDP over gloo.
    model = make_model()
    if ctx.role == "syncer":
        return dilocod.Trainer(model=model, optimizer=None, step=lambda i: dilocod.StepResult(0))
    parallel = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1000 * ctx.seed + ctx.rank)

    def step(index):
        x, y = batch(generator)
        loss = torch.nn.functional.mse_loss(parallel(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return dilocod.StepResult(tokens=32, loss=float(loss))

    return dilocod.Trainer(model=model, optimizer=optimizer, step=step)
"""
LEARNER_ENTRY = "learner_test_entry:make_trainer"


def write_learner_entry(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "learner_test_entry.py").write_text(LEARNER_ENTRY_SOURCE)
    return directory


def _child_env(entry_dir: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(entry_dir), os.environ.get("PYTHONPATH", "")])}


def start_learner(
    work: Path,
    entry_dir: Path,
    port: int,
    learner_id: str,
    *args: str,
    credentials: tuple[str, ...] = ("--insecure",),
    entry: str = LEARNER_ENTRY,
) -> DaemonProcess:
    """Start `dilocod learner` (no ready line: the tests wait on its log records)."""
    stderr_path = (
        work / f"learner-{learner_id}-{len(list(work.glob(f'learner-{learner_id}-*.stderr')))}.stderr"
    )
    stderr_path.touch()
    command = [sys.executable, "-m", "dilocod", "learner", "--syncer", f"127.0.0.1:{port}", *credentials]
    command += ["--entry", entry, "--id", learner_id, "--device", "cpu", *args]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_child_env(entry_dir)
    )
    assert process.stderr is not None
    learner = DaemonProcess(process, {"id": learner_id}, stderr_path)
    threading.Thread(target=learner.follow, args=(process.stderr,), daemon=True).start()
    return learner


def run_island(
    work: Path, entry_dir: Path, port: int, entry: str, device: str, steps: int, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """`dilocod learner --id island` as a torchrun job of 2 ranks on this host, run to its end, its
    state under work/island. torchrun's agent makes a torchelastic_* folder in TMPDIR and never
    removes it: it gets the test's own, and nothing may be left in the shared one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        master_port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    command += ["-m", "dilocod", "learner", "--syncer", f"127.0.0.1:{port}", "--insecure"]
    command += ["--entry", entry, "--id", "island", "--device", device]
    command += ["--steps", str(steps), "--state-dir", str(work / "island")]
    env = _child_env(entry_dir)
    (work / "tmp").mkdir(exist_ok=True)
    env["TMPDIR"] = str(work / "tmp")
    before = set(Path(tempfile.gettempdir()).glob("torchelastic_*"))
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    assert set(Path(tempfile.gettempdir()).glob("torchelastic_*")) <= before, "left in the shared TMPDIR"
    return done


def dilocod_cli(*args: str, timeout_s: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one short `dilocod` command (status, export) and return what it printed."""
    return subprocess.run(
        [sys.executable, "-m", "dilocod", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=check,
    )


def syncer_status(port: int) -> dict[str, Any]:
    """`dilocod status --json` of the syncer on this loopback port."""
    done = dilocod_cli("status", "--syncer", f"127.0.0.1:{port}", "--insecure", "--json")
    return json.loads(done.stdout)


def export_global_model(state_dir: Path, out: Path) -> Path:
    dilocod_cli("export", "--state-dir", str(state_dir), "--out", str(out))
    return out
