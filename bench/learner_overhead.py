"""Learner overhead benchmark: a training step alone against the same step under `dilocod learner`.

The model is a small byte-level GPT built by an entry module written into a temporary directory
(4 blocks, 4 heads, width chosen from --params, untied head, float32, fixed seed: 53 parameter
tensors), trained with AdamW on --batches sequences of 32 tokens of a fixed synthetic byte stream
per step (2 by default; each batch size in the list is measured in turn, so the same per-step work
of the runtime is seen against steps of different lengths), with --torch-threads intra-op threads.
The same entry's Trainer.step is run alone and under dilocod, each in its own child process:

- alone: a plain loop calling trainer.step(i), no dilocod runtime (the entry is imported and its
  factory called with role "learner"; nothing else of dilocod runs);
- under dilocod: `python -m dilocod learner --steps N` against a real `python -m dilocod syncer
  --fragments 24 --sync-every 24 --overlap 2` (P = H = 24, tau = 2; otherwise the syncer's
  defaults, K = 1, RDA, uncompressed) on 127.0.0.1, a fresh syncer for every run, once per
  --networks value: the learner's link in a child process (`--network process`, its default) and
  on a thread of the training process (`--network thread`).

Each learner process also runs the alone loop itself before dilocod starts: the entry's factory
(called before the learner connects anywhere) trains --warmup + --steps steps in a plain loop and
records them, then hands dilocod the trainer as the alone process starts it (the parameters put
back, a fresh AdamW, the data generator reseeded). That baseline shares the learner process's heap and
memory layout, which separate processes of the same loop do not (they differ by a few percent on
this host), and runs seconds before the dilocod steps it is compared with; the separate alone
process stays the headline's baseline.

The step times are taken by the entry itself, identically in both: time.perf_counter() at the end
of each step (after the optimizer step and the loss read back), and the interval from the end of
one step to the end of the next, so under dilocod an interval includes the runtime's work at the
step boundary (taking the inbox, applying merged fragments, copying requested ones out, reporting
the step). Also recorded per step: the time inside the user's step (its first line to its last),
so an interval splits into the step itself and the time between steps. After --warmup steps (two
cycles of the 24 fragments by default: every fragment has been pushed, merged and applied, so
the syncer's buffers exist) the next --steps intervals are kept, with the process's and the main
(training) thread's CPU time over that window and the syncer's (from /proc). The syncer's "round
merged" log lines (JSON on its stderr) whose timestamps fall in the window are the rounds merged
during the measurement.

The runs are interleaved (--reps rounds per placement, alone and each network, the order rotated
from one round to the next) so load from other tenants of this shared 2-core machine hits all of
them, and the medians are taken over the intervals of all rounds. Placements (--placements),
since the syncer here shares the two cores with the learner, which it never does across sites:

- shared: no pinning, the scheduler places every thread of both processes;
- pinned: the learner process (training, network and push threads, and its network process,
  which inherits the affinity) on CPU 0, the syncer on CPU 1; the alone process on CPU 0;
- split: the learner's training thread on CPU 0, its other threads and its network process with
  the syncer on CPU 1 (the shape of a learner host with cores to spare); the alone process on CPU
  0. The learner starts on CPU 0, as the alone process does, and after its first step its training
  thread moves every other thread of the learner and of its network process to CPU 1 (again just
  before the measured window, for threads started since); each run records where every thread
  was allowed to run after its last step, and a run where that is not so is an error. Where a
  process builds its model matters here: the alone loop started on CPU 1 and moved to CPU 0 after
  building its model ran 1.7 to 3.2 % slower (medians of 20 rounds, two runs) than one started on
  CPU 0 (bench/notes/launch-cpu.md).

With --beside (split only), each round also runs the alone process on CPU 0 while a fresh syncer
and a learner whose steps only sleep (the entry's sleeping_step: the same fragments, pushes and
merges at the alone step's rate, nothing trained) run on CPU 1, started before it and past their
warm-up. Against that baseline the other core does the same work as in a dilocod run, so the
overhead splits into what that work costs the step (alone-beside against alone) and what the
training process itself pays (dilocod against alone-beside).

It measures and records; it asserts nothing. Run from the repository root:
``python bench/learner_overhead.py [--steps 300] [--params 2500000] [--json FILE]``.
Must not be imported by dilocod or the tests; it starts dilocod through its command line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import select
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from devkit.machine import machine_facts
from dilocod.ops.processes import read_ready_line

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "learner_overhead.json"
ENTRY_MODULE = "learner_overhead_entry"
ENTRY = f"{ENTRY_MODULE}:make_trainer"
SYNCER_FLAGS = ("--fragments", "24", "--sync-every", "24", "--overlap", "2")
LAYERS, VOCAB, SEQ = 4, 256, 32
READY_TIMEOUT_S = 120.0
#: Resamples of the rounds for the overhead's confidence interval (bootstrap_interval).
BOOTSTRAP_RESAMPLES = 2000
RUN_TIMEOUT_S = 600.0
#: The alone process beside dilocod's work on the other core (--beside; run_beside).
BESIDE = "alone-beside"

ENTRY_SOURCE = '''
"""Benchmark entry (written by bench/learner_overhead.py): a small GPT, and step timing."""

import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import dilocod

CONFIG = json.loads((Path(__file__).parent / "learner_overhead_config.json").read_text())
WIDTH, LAYERS, HEADS = CONFIG["width"], CONFIG["layers"], 4
VOCAB, SEQ, BATCH = CONFIG["vocab"], CONFIG["seq"], CONFIG["batch"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def byte_stream(length=1 << 18):
    """A fixed, learnable byte stream: each byte follows from the one before it, with noise."""
    g = torch.Generator().manual_seed(7)
    table = torch.randint(0, VOCAB, (VOCAB,), generator=g)
    noise = torch.randint(0, VOCAB, (length,), generator=g)
    keep = torch.rand(length, generator=g) < 0.8
    table, noise, keep = table.tolist(), noise.tolist(), keep.tolist()
    out = [0]
    for i in range(1, length):
        out.append(table[out[-1]] if keep[i] else noise[i])
    return torch.tensor(out, dtype=torch.long)


def proc_cpu_s(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid):
    """The processes pid started, and theirs, from /proc (Linux)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:  # the thread has exited
            continue
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def threads(pid):
    """(tid, name) of each of pid's threads."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append((int(task), Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()))
        except OSError:
            continue
    return out


def move_others(cpus):
    """Every other thread of this process, and every thread of the processes it started, onto cpus
    (Linux: a thread id names one thread; threads and processes started later inherit the CPUs
    of the thread that starts them)."""
    me = threading.get_native_id()
    for pid in [os.getpid(), *descendants(os.getpid())]:
        for tid, _ in threads(pid):
            if tid != me:
                try:
                    os.sched_setaffinity(tid, cpus)
                except ProcessLookupError:  # exited since it was listed
                    pass


def placement():
    """Where each thread of this process (the calling one first) and of its children may run."""
    me = threading.get_native_id()
    out = [["training", sorted(os.sched_getaffinity(0))]]
    for pid in [os.getpid(), *descendants(os.getpid())]:
        process = "learner" if pid == os.getpid() else f"child {pid}"
        for tid, name in threads(pid):
            if tid != me:
                try:
                    out.append([f"{process} thread {tid} ({name})", sorted(os.sched_getaffinity(tid))])
                except ProcessLookupError:
                    pass
    return out


class Recorder:
    """Per-step times taken inside the step; written to `path` after the last one."""

    def __init__(self, path):
        self.path = path
        self.warmup, self.steps = CONFIG["warmup"], CONFIG["steps"]
        self.calls = 0
        self.last_end = None
        self.intervals, self.work = [], []
        self.window = {}
        self.extra = {}

    def end_of_step(self, started, loss):
        now = time.perf_counter()
        self.calls += 1
        if self.calls > self.warmup:
            self.intervals.append(now - self.last_end)
            self.work.append(now - started)
        self.last_end = now
        if self.calls in (self.warmup, self.warmup + self.steps):
            mark = {
                "wall": time.time(),
                "perf": now,
                "process_cpu_s": time.process_time(),
                "thread_cpu_s": time.thread_time(),
                "loss": loss,
            }
            if CONFIG.get("syncer_pid"):
                mark["syncer_cpu_s"] = proc_cpu_s(CONFIG["syncer_pid"])
            self.window["start" if self.calls == self.warmup else "end"] = mark
        if self.calls == self.warmup + self.steps:
            self.save()

    def save(self):
        record = {"intervals_s": self.intervals, "work_s": self.work, "window": self.window, **self.extra}
        Path(self.path).write_text(json.dumps(record))


def make_trainer(ctx):
    torch.set_num_threads(CONFIG["torch_threads"])
    torch.manual_seed(1234)  # the syncer builds the same initial model
    model = GPT()
    if ctx.role == "syncer":
        return dilocod.Trainer(model=model, optimizer=None, step=lambda i: dilocod.StepResult(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = byte_stream()
    generator = torch.Generator().manual_seed(ctx.seed)
    recorder = Recorder(CONFIG["times"])
    others = CONFIG.get("others_cpu")

    def step(index):
        result = timed_step(recorder)
        # Between steps whose interval is not measured: after the first, again just before the
        # window (for threads started since), and after the last.
        if others is not None and recorder.calls in (1, recorder.warmup - 1):
            move_others({others})
        if others is not None and recorder.calls == recorder.warmup + recorder.steps:
            recorder.extra["placement"] = placement()
            recorder.save()
        return result

    def timed_step(rec):
        started = time.perf_counter()
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=generator)
        rows = torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        value = loss.item()
        rec.end_of_step(started, value)
        return dilocod.StepResult(tokens=BATCH * SEQ, loss=value)

    if CONFIG.get("sleep_step_s"):
        return dilocod.Trainer(model=model, optimizer=optimizer, step=sleeping_step(model))
    if CONFIG.get("times_before"):  # set for the learner's runs only
        # The same loop alone in this very process, before dilocod connects anywhere (it loads the
        # entry first): the process's own heap and layout on both sides of the comparison.
        initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        before = Recorder(CONFIG["times_before"])
        for _ in range(before.warmup + before.steps):
            timed_step(before)
        # dilocod then trains from where the alone process starts: the heal restores only the
        # parameters, and AdamW's moments from these steps would not fit them.
        model.load_state_dict(initial)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator.manual_seed(ctx.seed)
    return dilocod.Trainer(model=model, optimizer=optimizer, step=step)


def sleeping_step(model):
    """A step that trains nothing and sleeps out the step time: dilocod's runtime, its network
    process and the syncer then do a training run's work (the same fragments, pushes and merges at
    the same rate) while this process's training thread leaves the CPU to others. Each step nudges a
    24th of the tensors, so every push carries an outer gradient of real norm (zero deltas take a
    cheaper merge). Writes a byte to the descriptor CONFIG["ready_fd"] once --warmup steps are done."""
    tensors = list(model.parameters())
    groups = [tensors[i::24] for i in range(24)]
    period, ready = CONFIG["sleep_step_s"], CONFIG["ready_fd"]
    calls = 0

    def step(index):
        nonlocal calls
        started = time.perf_counter()
        with torch.no_grad():
            for tensor in groups[calls % len(groups)]:
                tensor.add_(1e-4)
        calls += 1
        if calls == CONFIG["warmup"]:
            os.write(ready, b"r")
            os.close(ready)
        time.sleep(max(0.0, period - (time.perf_counter() - started)))
        return dilocod.StepResult(tokens=BATCH * SEQ, loss=None)

    return step


def alone():
    """The same step in a plain loop: no dilocod runtime."""
    ctx = dilocod.LearnerContext("alone", "learner", "cpu", 0, 1, None, CONFIG["seed"])
    trainer = make_trainer(ctx)
    for index in range(CONFIG["warmup"] + CONFIG["steps"]):
        trainer.step(index)
'''


def width_for(params: int) -> int:
    """The width (a multiple of 16) whose model has the parameter count closest to params."""
    return min(range(16, 4097, 16), key=lambda d: abs(param_count(d) - params))


def param_count(d: int) -> int:
    per_block = 12 * d * d + 13 * d  # qkv, proj, fc, out with biases; two LayerNorms
    return LAYERS * per_block + VOCAB * d + SEQ * d + 2 * d + VOCAB * d


def entry_config(
    batch: int | None,
    warmup: int,
    steps: int,
    *,
    params: int = 2_500_000,
    torch_threads: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """What the entry module reads (learner_overhead_config.json), before a run's own keys."""
    config = {
        "width": width_for(params),
        "layers": LAYERS,
        "vocab": VOCAB,
        "seq": SEQ,
        "warmup": warmup,
        "steps": steps,
        "torch_threads": torch_threads,
        "seed": seed,
    }
    return config if batch is None else {**config, "batch": batch}


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@contextlib.contextmanager
def children_on(cpus: set[int] | None) -> Iterator[None]:
    """Children started inside inherit these CPUs (this process's own affinity, restored after)."""
    if cpus is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def child_env(entry_dir: Path) -> dict[str, str]:
    # The children also run in entry_dir: `python -m` and `-c` put the working directory first on
    # sys.path, and a stray copy of the entry there would be imported instead of this one.
    paths = [str(entry_dir), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def write_config(entry_dir: Path, config: dict[str, Any]) -> None:
    (entry_dir / "learner_overhead_config.json").write_text(json.dumps(config))


def run_alone(entry_dir: Path, config: dict[str, Any], cpus: set[int] | None) -> None:
    write_config(entry_dir, config)
    command = [sys.executable, "-c", f"import {ENTRY_MODULE} as e; e.alone()"]
    with children_on(cpus):
        process = subprocess.Popen(
            command, env=child_env(entry_dir), stdout=subprocess.DEVNULL, cwd=entry_dir
        )
    if process.wait(timeout=RUN_TIMEOUT_S) != 0:
        raise RuntimeError(f"the alone run exited with {process.returncode}")


def start_syncer(entry_dir: Path, work: Path, cpus: set[int] | None) -> tuple[subprocess.Popen[bytes], int]:
    state = tempfile.mkdtemp(prefix="syncer-", dir=work)
    stderr = (work / "syncer.stderr").open("wb")
    command = [sys.executable, "-m", "dilocod", "syncer", "--listen", "127.0.0.1:0", "--insecure"]
    command += ["--entry", ENTRY, "--state-dir", state, "--ready-json", *SYNCER_FLAGS]
    with children_on(cpus):
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, env=child_env(entry_dir), cwd=entry_dir
        )
    stderr.close()
    try:
        ready = read_ready_line(process, "syncer", READY_TIMEOUT_S)
    except RuntimeError as exc:
        process.kill()
        process.wait()
        raise RuntimeError(f"{exc}: {(work / 'syncer.stderr').read_text(errors='replace')}") from None
    return process, int(ready["port"])


def learner_command(port: int, learner_id: str, seed: int) -> list[str]:
    """`dilocod learner` against the syncer on port, with the benchmark's entry, on the CPU."""
    command = [sys.executable, "-m", "dilocod", "learner", "--syncer", f"127.0.0.1:{port}", "--insecure"]
    return [*command, "--entry", ENTRY, "--id", learner_id, "--device", "cpu", "--seed", str(seed)]


def stop(process: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM (the daemons save and leave on it), then SIGKILL after 60 s; nothing if it has exited."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_under_dilocod(
    entry_dir: Path,
    work: Path,
    config: dict[str, Any],
    learner_cpus: set[int] | None,
    syncer_cpus: set[int] | None,
) -> dict[str, Any]:
    """One `dilocod learner` run against a fresh syncer."""
    write_config(entry_dir, {**config, "syncer_pid": None})  # the syncer reads it too
    syncer, port = start_syncer(entry_dir, work, syncer_cpus)
    learner: subprocess.Popen[bytes] | None = None
    try:
        write_config(entry_dir, {**config, "syncer_pid": syncer.pid})
        command = learner_command(port, "bench", config["seed"])
        command += ["--steps", str(config["warmup"] + config["steps"]), "--network", config["network"]]
        with (work / "learner.stderr").open("wb") as stderr, children_on(learner_cpus):
            learner = subprocess.Popen(
                command, env=child_env(entry_dir), stdout=subprocess.DEVNULL, stderr=stderr, cwd=entry_dir
            )
        if learner.wait(timeout=RUN_TIMEOUT_S) != 0:
            log = (work / "learner.stderr").read_text(errors="replace")
            raise RuntimeError(f"the learner exited with {learner.returncode}: {log}")
    finally:
        stop(learner)  # one that outran RUN_TIMEOUT_S
        stop(syncer)
    return {
        "syncer": records(work / "syncer.stderr"),
        "learner": records(work / "learner.stderr"),
    }


def run_beside(entry_dir: Path, work: Path, config: dict[str, Any], step_s: float) -> dict[str, Any]:
    """The alone process on CPU 0 while a syncer and a learner whose steps sleep (the entry's
    sleeping_step, step_s each) run on CPU 1: what dilocod's work on the other core costs the step
    without dilocod in the training process. The learner is in its steady state (past --warmup
    steps) before the alone process starts, and is stopped after it ends."""
    write_config(entry_dir, {**config, "syncer_pid": None})
    syncer, port = start_syncer(entry_dir, work, {1})
    ready_read, ready_write = os.pipe()
    learner: subprocess.Popen[bytes] | None = None
    try:
        sleeping = {"syncer_pid": None, "sleep_step_s": step_s, "ready_fd": ready_write}
        write_config(entry_dir, {**config, **sleeping})
        command = learner_command(port, "beside", config["seed"])
        with (work / "learner.stderr").open("wb") as stderr, children_on({1}):
            learner = subprocess.Popen(
                command,
                env=child_env(entry_dir),
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                cwd=entry_dir,
                pass_fds=(ready_write,),
            )
        os.close(ready_write)
        ready_write = -1
        # The learner writes a byte once past its warm-up, or the pipe ends when it exits.
        readable, _, _ = select.select([ready_read], [], [], READY_TIMEOUT_S)
        if not readable or not os.read(ready_read, 1):
            log = (work / "learner.stderr").read_text(errors="replace")
            raise RuntimeError(f"the sleeping learner did not reach its steady state: {log}")
        run_alone(entry_dir, {**config, "syncer_pid": syncer.pid}, {0})
        if learner.poll() is not None:
            raise RuntimeError(f"the sleeping learner exited with {learner.returncode} during the run")
    finally:
        os.close(ready_read)
        if ready_write >= 0:
            os.close(ready_write)
        stop(learner)
        stop(syncer)
    return {"syncer": records(work / "syncer.stderr"), "learner": records(work / "learner.stderr")}


def records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def summarise(times: dict[str, Any]) -> dict[str, Any]:
    intervals, work = times["intervals_s"], times["work_s"]
    start, end = times["window"]["start"], times["window"]["end"]
    wall = end["perf"] - start["perf"]
    between = [i - w for i, w in zip(intervals, work, strict=True)]
    out = {
        "steps": len(intervals),
        "median_ms": statistics.median(intervals) * 1e3,
        "p90_ms": percentile(intervals, 0.9) * 1e3,
        "mean_ms": statistics.fmean(intervals) * 1e3,
        "step_median_ms": statistics.median(work) * 1e3,
        "between_median_ms": statistics.median(between) * 1e3,
        "between_mean_ms": statistics.fmean(between) * 1e3,
        "process_cores": (end["process_cpu_s"] - start["process_cpu_s"]) / wall,
        "training_thread_cores": (end["thread_cpu_s"] - start["thread_cpu_s"]) / wall,
        "loss_start": start["loss"],
        "loss_end": end["loss"],
    }
    if "syncer_cpu_s" in start:
        out["syncer_cores"] = (end["syncer_cpu_s"] - start["syncer_cpu_s"]) / wall
    return out


def merged_in_window(logs: dict[str, Any], times: dict[str, Any]) -> dict[str, Any]:
    start, end = times["window"]["start"]["wall"], times["window"]["end"]["wall"]
    merged = []
    for record in logs["syncer"]:
        if record.get("event") != "round merged" or "timestamp" not in record:
            continue
        at = datetime.fromisoformat(record["timestamp"]).timestamp()
        if start <= at <= end:
            merged.append(record)
    everything = logs["learner"] + logs["syncer"]
    warnings = sorted({r.get("event", "") for r in everything if r.get("level") in {"warning", "error"}})
    return {
        "rounds_merged": len(merged),
        "fragments_merged": len({r["fragment"] for r in merged}),
        "merge_duration_median_ms": (
            statistics.median(r["duration_s"] for r in merged) * 1e3 if merged else None
        ),
        "log_warnings": warnings,
    }


def measure_placement(
    name: str, args: argparse.Namespace, entry_dir: Path, work: Path, base: dict[str, Any]
) -> dict[str, Any]:
    learner_cpus: set[int] | None = None
    syncer_cpus: set[int] | None = None
    alone_cpus: set[int] | None = None
    config = dict(base)
    if name == "pinned":
        learner_cpus, syncer_cpus, alone_cpus = {0}, {1}, {0}
    elif name == "split":
        learner_cpus, syncer_cpus, alone_cpus = {0}, {1}, {0}
        config["others_cpu"] = 1
    dilocods = [f"dilocod-{network}" for network in args.networks]
    baselines = ["alone", *([BESIDE] if args.beside else [])]
    kinds = [*baselines, *dilocods]
    pairs = []
    alone_step_s: float | None = None  # the sleeping learner's step: the last alone run's median
    for rep in range(args.reps):
        pair: dict[str, Any] = {}
        # Each rep rotates the order, so no kind always runs first (or right after another); the
        # first rep starts with alone, which gives the sleeping learner its step time.
        for kind in kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]:
            times_path = work / f"{name}-{config['batch']}-{rep}-{kind}.json"
            run_config = {**config, "times": str(times_path)}
            if kind in baselines:
                run_config.pop("others_cpu", None)
                if kind == "alone":
                    run_alone(entry_dir, run_config, alone_cpus)
                    logs = None
                else:
                    assert alone_step_s is not None, "the first rep runs alone first"
                    logs = run_beside(entry_dir, work, run_config, alone_step_s)
                times = json.loads(times_path.read_text())
                summary = summarise(times)
                if logs is not None:
                    summary |= merged_in_window(logs, times)
                else:
                    alone_step_s = summary["median_ms"] / 1e3
                pair[kind] = {"summary": summary, "times": times}
            else:
                run_config["network"] = kind.removeprefix("dilocod-")
                before_path = work / f"{name}-{config['batch']}-{rep}-{kind}-before.json"
                run_config["times_before"] = str(before_path)
                logs = run_under_dilocod(entry_dir, work, run_config, learner_cpus, syncer_cpus)
                times = json.loads(times_path.read_text())
                summary = summarise(times) | merged_in_window(logs, times)
                if "others_cpu" in run_config:
                    check_split(times.get("placement"), run_config["others_cpu"])
                    summary["placement"] = times["placement"]
                pair[kind] = {"summary": summary, "times": times}
                before = json.loads(before_path.read_text())
                pair[before_key(kind)] = {"summary": summarise(before), "times": before}
        a = pair["alone"]["summary"]
        parts = []
        if args.beside:
            s = pair[BESIDE]["summary"]
            parts.append(f"{BESIDE} {s['median_ms']:.2f} ms ({s['median_ms'] / a['median_ms'] - 1:+.1%})")
        for kind in dilocods:
            d, b = pair[kind]["summary"], pair[before_key(kind)]["summary"]
            parts.append(
                f"{kind} {d['median_ms']:.2f} ms ({d['median_ms'] / a['median_ms'] - 1:+.1%}; "
                f"alone in its process {b['median_ms']:.2f} ms, {d['median_ms'] / b['median_ms'] - 1:+.1%}; "
                f"{d['rounds_merged']} rounds)"
            )
        line = ", ".join(parts)
        head = f"{name} batch {config['batch']} pair {rep}: alone {a['median_ms']:.2f} ms"
        print(f"{head}, {line}", file=sys.stderr)
        pairs.append(pair)
    shape = {"batch": config["batch"], "tokens_per_step": config["batch"] * SEQ}
    return shape | aggregate(name, pairs, baselines, dilocods)


def check_split(placement: list[list[Any]] | None, others: int) -> None:
    """The split placement held to the last step: the training thread on CPU 0, every other thread
    of the learner and of its network process on `others`."""
    if not placement:
        raise RuntimeError("the learner recorded no placement")
    (_, training), *rest = placement
    misplaced = [name for name, cpus in rest if cpus != [others]]
    if training != [0] or misplaced:
        where = f"the training thread on CPUs {training}, off CPU {others}: {misplaced}"
        raise RuntimeError(f"the split placement did not hold: {where}")


def interval(ci: list[float] | None) -> str:
    return "" if ci is None else f" (95 % interval over rounds {ci[0]:+.2%} to {ci[1]:+.2%})"


def before_key(kind: str) -> str:
    """The pair's entry for the alone loop run inside the `kind` learner's process, before dilocod
    started (the entry's factory runs it: see ENTRY_SOURCE)."""
    return f"{kind}:alone-before"


def bootstrap_interval(pairs: list[dict[str, Any]], kind: str, baseline: str = "alone") -> list[float] | None:
    """A 95 % interval for the pooled-median overhead of `kind` over `baseline`, resampling whole
    rounds (each round is a pair of processes, and processes of the same loop differ by a few
    percent on this host: the round, not the step, is the unit of noise). None with fewer than 3
    rounds."""
    if len(pairs) < 3:
        return None
    rng = random.Random(0)  # the same rounds give the same interval
    ratios = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        chosen = [rng.randrange(len(pairs)) for _ in pairs]
        alone = [x for i in chosen for x in pairs[i][baseline]["times"]["intervals_s"]]
        other = [x for i in chosen for x in pairs[i][kind]["times"]["intervals_s"]]
        ratios.append(statistics.median(other) / statistics.median(alone) - 1)
    ratios.sort()
    return [ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]]


def aggregate(
    name: str, pairs: list[dict[str, Any]], baselines: list[str], dilocods: list[str]
) -> dict[str, Any]:
    pooled: dict[str, dict[str, Any]] = {}
    for kind in [*baselines, *dilocods, *(before_key(k) for k in dilocods)]:
        intervals = [x for p in pairs for x in p[kind]["times"]["intervals_s"]]
        work = [x for p in pairs for x in p[kind]["times"]["work_s"]]
        summaries = [p[kind]["summary"] for p in pairs]
        pooled[kind] = {
            "steps": len(intervals),
            "median_ms": statistics.median(intervals) * 1e3,
            "p90_ms": percentile(intervals, 0.9) * 1e3,
            "step_median_ms": statistics.median(work) * 1e3,
            "between_median_ms": statistics.median(i - w for i, w in zip(intervals, work, strict=True)) * 1e3,
            "between_mean_ms": statistics.fmean(i - w for i, w in zip(intervals, work, strict=True)) * 1e3,
            "process_cores": statistics.fmean(s["process_cores"] for s in summaries),
            "training_thread_cores": statistics.fmean(s["training_thread_cores"] for s in summaries),
            # The loss over the window: each kind must train as the alone loop does (a run that
            # diverges, or starts from the wrong state, could be timing other work).
            "loss_start_median": statistics.median(s["loss_start"] for s in summaries),
            "loss_end_median": statistics.median(s["loss_end"] for s in summaries),
        }
        if kind in dilocods or kind == BESIDE:
            pooled[kind]["rounds_merged"] = sum(s["rounds_merged"] for s in summaries)
            pooled[kind]["syncer_cores"] = statistics.fmean(s.get("syncer_cores", 0.0) for s in summaries)
    a = pooled["alone"]
    out: dict[str, Any] = {"placement": name, **pooled}
    if BESIDE in baselines:
        # What dilocod's work on the other core alone costs the step (none of it in this process).
        out[f"slowdown_median_{BESIDE}"] = pooled[BESIDE]["median_ms"] / a["median_ms"] - 1
        out[f"slowdown_median_per_pair_{BESIDE}"] = [
            p[BESIDE]["summary"]["median_ms"] / p["alone"]["summary"]["median_ms"] - 1 for p in pairs
        ]
        out[f"slowdown_median_ci95_{BESIDE}"] = bootstrap_interval(pairs, BESIDE)
    for kind in dilocods:
        d = pooled[kind]
        out[f"overhead_median_{kind}"] = d["median_ms"] / a["median_ms"] - 1
        out[f"overhead_p90_{kind}"] = d["p90_ms"] / a["p90_ms"] - 1
        out[f"overhead_median_per_pair_{kind}"] = [
            p[kind]["summary"]["median_ms"] / p["alone"]["summary"]["median_ms"] - 1 for p in pairs
        ]
        out[f"overhead_median_ci95_{kind}"] = bootstrap_interval(pairs, kind)
        # Against the alone loop in the same process (the process's own heap on both sides).
        before = pooled[before_key(kind)]
        out[f"overhead_median_same_process_{kind}"] = d["median_ms"] / before["median_ms"] - 1
        out[f"overhead_median_same_process_per_pair_{kind}"] = [
            p[kind]["summary"]["median_ms"] / p[before_key(kind)]["summary"]["median_ms"] - 1 for p in pairs
        ]
        out[f"overhead_median_same_process_ci95_{kind}"] = bootstrap_interval(pairs, kind, before_key(kind))
        if BESIDE in baselines:
            # Against the alone process beside the same other-core work: the training process's share.
            out[f"overhead_median_beside_{kind}"] = d["median_ms"] / pooled[BESIDE]["median_ms"] - 1
            out[f"overhead_median_beside_ci95_{kind}"] = bootstrap_interval(pairs, kind, BESIDE)
    out["pairs"] = [{k: p[k]["summary"] for k in p} for p in pairs]
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Median step time of a small model trained alone against the same step under "
        "`dilocod learner` with a real syncer on loopback (P = H = 24, tau = 2).",
    )
    parser.add_argument("--steps", type=int, default=300, help="measured steps per run (default 300)")
    parser.add_argument(
        "--warmup", type=int, default=60, help="steps before the measurement (default 60: 2.5 cycles of P)"
    )
    parser.add_argument(
        "--params",
        type=int,
        default=2_500_000,
        help="model size: the width is chosen to match (default 2.5M)",
    )
    parser.add_argument(
        "--batches",
        default="2",
        help="comma-separated sequences of 32 tokens per step, each measured in turn (default 2)",
    )
    parser.add_argument("--reps", type=int, default=2, help="alone/dilocod pairs per placement (default 2)")
    parser.add_argument(
        "--placements",
        default="shared,pinned,split",
        help="comma-separated: shared, pinned, split (default: all three)",
    )
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads in both (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="data seed handed to the factory (default 0)")
    parser.add_argument(
        "--networks",
        default="process,thread",
        help="where the learner runs its link to the syncer, each measured beside the same alone "
        "runs (default: process,thread; process is the learner's default)",
    )
    parser.add_argument(
        "--beside",
        action="store_true",
        help="split only: also run the alone process on CPU 0 while a syncer and a learner whose "
        "steps sleep do a run's work on CPU 1, to split the overhead into what that other-core work "
        "costs the step and what the training process itself pays",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the numbers")
    args = parser.parse_args(argv)
    args.placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    args.networks = [n.strip() for n in args.networks.split(",") if n.strip()]
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batches takes whole numbers, not {args.batches!r}")
    if not args.batches or min(args.batches) < 1:
        parser.error("--batches takes one or more sizes of at least 1")
    if not args.networks or set(args.networks) - {"process", "thread"}:
        parser.error("--networks takes process, thread or both")
    unknown = set(args.placements) - {"shared", "pinned", "split"}
    if unknown:
        parser.error(f"unknown placement(s): {', '.join(sorted(unknown))}")
    if args.beside and args.placements != ["split"]:
        parser.error("--beside goes with --placements split alone")
    if any(p != "shared" for p in args.placements) and not {0, 1} <= os.sched_getaffinity(0):
        parser.error("pinned and split need CPUs 0 and 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    width = width_for(args.params)
    base = entry_config(
        None, args.warmup, args.steps, params=args.params, torch_threads=args.torch_threads, seed=args.seed
    )
    machine = machine_facts("dilocod")
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="dilocod-learner-overhead-") as tmp:
        work = Path(tmp)
        entry_dir = work / "entry"
        entry_dir.mkdir()
        (entry_dir / f"{ENTRY_MODULE}.py").write_text(ENTRY_SOURCE)
        for batch in args.batches:
            for name in args.placements:
                results.append(measure_placement(name, args, entry_dir, work, {**base, "batch": batch}))
    machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    record = {
        "command": shlex.join(["python", "bench/learner_overhead.py", *(argv or sys.argv[1:])]),
        "settings": {
            "model": f"byte-level GPT, {LAYERS} blocks, width {width}, 4 heads, untied head",
            "parameters": param_count(width),
            "parameter_tensors": 12 * LAYERS + 5,
            "tokens_per_step": [batch * SEQ for batch in args.batches],
            "optimizer": "AdamW lr 1e-3",
            "torch_threads": args.torch_threads,
            "warmup_steps": args.warmup,
            "measured_steps_per_run": args.steps,
            "reps": args.reps,
            "syncer_flags": " ".join(SYNCER_FLAGS),
            "learner_flags": "--device cpu --insecure (streams 4, codec none, fp32, apply overwrite)",
        },
        "machine": machine,
        "seconds": round(time.monotonic() - started, 1),
        "placements": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    for r in results:
        a = r["alone"]
        if BESIDE in r:
            slowdown, ci = r[f"slowdown_median_{BESIDE}"], r[f"slowdown_median_ci95_{BESIDE}"]
            print(
                f"{r['placement']:>6} batch {r['batch']}: alone beside dilocod's other-core work "
                f"{r[BESIDE]['median_ms']:.2f} ms, slowdown {slowdown:+.2%}{interval(ci)}"
            )
        for kind in (k for k in r if k.startswith("dilocod-") and ":" not in k):
            d, b = r[kind], r[before_key(kind)]
            overhead, ci = r[f"overhead_median_{kind}"], r[f"overhead_median_ci95_{kind}"]
            same, same_ci = (
                r[f"overhead_median_same_process_{kind}"],
                r[f"overhead_median_same_process_ci95_{kind}"],
            )
            print(
                f"{r['placement']:>6} batch {r['batch']}: "
                f"alone median {a['median_ms']:.2f} ms p90 {a['p90_ms']:.2f} ms | "
                f"{kind} median {d['median_ms']:.2f} ms p90 {d['p90_ms']:.2f} ms | "
                f"overhead {overhead:+.2%}{interval(ci)} | "
                f"alone in the same process {b['median_ms']:.2f} ms, "
                f"overhead {same:+.2%}{interval(same_ci)} | "
                f"rounds merged {d['rounds_merged']} | loss over the window: alone "
                f"{a['loss_start_median']:.3f} to {a['loss_end_median']:.3f}, {kind} "
                f"{d['loss_start_median']:.3f} to {d['loss_end_median']:.3f}"
            )
            if BESIDE in r:
                beside, beside_ci = (
                    r[f"overhead_median_beside_{kind}"],
                    r[f"overhead_median_beside_ci95_{kind}"],
                )
                print(
                    f"{'':>6} {kind} against alone beside the same work: {beside:+.2%}{interval(beside_ci)}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
