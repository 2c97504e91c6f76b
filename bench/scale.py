"""dilocod at real model sizes: a syncer, real learners and scripted pushers on loopback, per size.

For each run SIZE:LEARNERS:PUSHERS (default 64M:2:6, 256M:2:6 and 1B:1:1) the model is a stack of
Linear(4096, 4096, bias=False) layers (dilocod/examples/scale.py: a step that sleeps --step-s and nudges
one layer, so the cost measured is dilocod's), trained with the daemons' defaults (P = 24, H = 24,
tau = 2, K = 1) by LEARNERS `dilocod learner` processes and PUSHERS scripted learners
(devkit/scale_pusher.py: the same Link, no model), so the syncer sees M = LEARNERS + PUSHERS.

Recorded per size, next to what bounds it in the same run:
- peak memory (VmHWM and sampled PSS) of the syncer, each learner and its network process, and of
  the same entry run alone; the learner's overhead is learner + network process minus that;
  against the floors: syncer 2 x model + (M + 2) x largest fragment, learner overhead
  1 x model + (tau + 2) x largest fragment; and the syncer against that floor plus its fixed cost
  (an interpreter importing what it imports), or at start the entry alone plus Θ if larger;
- fragments and their imbalance (largest / mean);
- rounds due (by the syncer's clock), merged, abandoned and skipped;
- merge time per fragment (the merge worker's own, without waiting for it) against the fused
  memory-bandwidth bound ((2M + 4) x F bytes at the
  rate an in-place torch.add reaches here, single thread), that rate measured alone before the
  run and again every BOUND_EVERY_S during it (the same cores, shared with the learners as the
  merge worker shares them; the ratio against the in-run rate is dilocod's own cost);
- heal time of each learner (joined to healed) against the raw loopback rate of
  `dilocod bench loopback` measured right before that size's daemons start;
- event-loop lag p50/p99/max of the syncer (and of the learners' network loops where they say);
- checkpoint write times against the disk's own sequential write rate (same directory, fsync);
- SIGTERM-to-exit times; bytes per learner per step.

    python bench/scale.py --json bench/results/scale.json
    python bench/scale.py --runs 256M:2:6 --seconds 150

Measures and records; asserts nothing. The 1B run needs about 20 GB of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from devkit.machine import machine_facts
from dilocod.examples.scale import WIDTH, build, memory_kib
from dilocod.model.plan import plan_module

HERE = Path(__file__).resolve().parent
DILOCOD = [sys.executable, "-m", "dilocod"]
SAMPLE_EVERY_S = 0.5
#: The fused bound's rate is measured again this often during a run.
BOUND_EVERY_S = 15.0
FRAGMENTS, SYNC_EVERY, OVERLAP = 24, 24, 2
DEFAULT_RUNS = "64M:2:6,256M:2:6,1B:1:1"
SIZES = {"64M": 4, "256M": 15, "1B": 60}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    peak_pss_kib: int = 0
    peak_hwm_kib: int = 0
    child_peak_pss_kib: int = 0
    child_peak_hwm_kib: int = 0
    #: Peak of (this process + its network child) PSS sampled together.
    peak_sum_pss_kib: int = 0
    exit_s: float | None = None

    def sample(self) -> None:
        own = memory_kib(self.popen.pid)
        kids = [memory_kib(c) for c in children(self.popen.pid)]
        if not own:
            return
        self.peak_pss_kib = max(self.peak_pss_kib, own.get("pss", 0))
        self.peak_hwm_kib = max(self.peak_hwm_kib, own.get("hwm", 0))
        total = own.get("pss", 0)
        for kid in kids:
            self.child_peak_pss_kib = max(self.child_peak_pss_kib, kid.get("pss", 0))
            self.child_peak_hwm_kib = max(self.child_peak_hwm_kib, kid.get("hwm", 0))
            total += kid.get("pss", 0)
        self.peak_sum_pss_kib = max(self.peak_sum_pss_kib, total)


@dataclass
class Run:
    label: str
    layers: int
    learners: int
    pushers: int
    procs: list[Proc] = field(default_factory=list)


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def log_lines(path: Path) -> list[dict[str, Any]]:
    lines = []
    for raw in path.read_text(errors="replace").splitlines():
        if raw.startswith("{"):
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                continue
    return lines


def stamp(line: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00")).timestamp()


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "n": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "p50": round(pick(0.5), 4),
        "p99": round(pick(0.99), 4),
        "max": round(ordered[-1], 4),
        "n": len(ordered),
    }


# ----------------------------------------------------------------------------- references


def raw_loopback_gbps() -> float:
    out = subprocess.run(
        [
            *DILOCOD,
            "bench",
            "loopback",
            "--size",
            "256MiB",
            "--streams",
            "4",
            "--codec",
            "none",
            "--repeats",
            "3",
            "--json",
            "-",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return float(json.loads(out.stdout)["raw_gbps"])


def add_bandwidth_gbs(fragment_bytes: int, repeats: int = 5, adds: int = 1, best: bool = True) -> float:
    """Bytes per second in-place torch.adds move over a fragment (3 x F each), one thread: `adds`
    of them back to back, timed together, the best (or the median) of `repeats`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = max(1, fragment_bytes // 4)
        a, b = torch.ones(n), torch.ones(n)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(adds):
                a.add_(b)
            times.append(time.perf_counter() - started)
        taken = min(times) if best else statistics.median(times)
        return adds * 3 * n * 4 / taken / 1e9
    finally:
        torch.set_num_threads(threads)


def disk_write_gbs(directory: Path, nbytes: int) -> float:
    """Sequential write of nbytes with fsync, 64 MiB at a time, into directory."""
    block = os.urandom(1 << 20) * 64
    path = directory / ".disk-probe"
    started = time.perf_counter()
    with path.open("wb") as handle:
        written = 0
        while written < nbytes:
            handle.write(block)
            written += len(block)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - started
    path.unlink()
    return written / elapsed / 1e9


def entry_alone(layers: int, step_s: float) -> dict[str, int]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocod.examples.scale",
            "--layers",
            str(layers),
            "--seconds",
            "8",
            "--step-s",
            str(step_s),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def syncer_fixed_kib() -> int:
    """RSS of an interpreter that imports what the syncer imports (torch among it) and nothing else:
    the syncer's fixed cost, which the memory floor's formula leaves out."""
    code = (
        "import torch, dilocod.cli, dilocod.syncer.daemon, dilocod.syncer.service\n"
        "from dilocod.examples.scale import memory_kib\n"
        "import os; print(memory_kib(os.getpid())['rss'])"
    )
    command = [sys.executable, "-c", code]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- one size


def run_size(run: Run, seconds: float, step_s: float, work: Path, network: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "DILOCOD_SCALE_LAYERS": str(run.layers),
        "DILOCOD_SCALE_STEP_S": str(step_s),
    }
    meta = build(run.layers, 0, "meta")
    plan = plan_module(meta, FRAGMENTS)
    model_bytes = 4 * plan.total_numel
    largest = 4 * max(f.numel for f in plan.fragments)
    m = run.learners + run.pushers
    print(
        f"[{run.label}] {plan.total_numel / 1e6:.0f}M params, {model_bytes / 1e9:.2f} GB, "
        f"{plan.num_fragments} fragments, imbalance {plan.imbalance:.3f}",
        flush=True,
    )
    alone = entry_alone(run.layers, step_s)
    alone["syncer_fixed_kib"] = syncer_fixed_kib()
    bandwidth = add_bandwidth_gbs(largest)
    disk = disk_write_gbs(work, min(model_bytes, 2 << 30))
    # The raw rate the heals are set against, measured right before this size's daemons start
    # (loopback on a shared host moves by a third from one minute to the next).
    raw_gbps = raw_loopback_gbps()
    print(f"[{run.label}] raw loopback: {raw_gbps} Gbit/s", flush=True)
    entry = ["--entry", "dilocod.examples.scale:make_trainer"]
    checkpoint_every = max(30.0, seconds / 2)
    syncer_log = work / "syncer.log"
    syncer = subprocess.Popen(
        [
            *DILOCOD,
            "syncer",
            *entry,
            "--listen",
            "127.0.0.1:0",
            "--insecure",
            "--ready-json",
            "--state-dir",
            str(work / "s"),
            "--checkpoint-every-s",
            str(checkpoint_every),
        ],
        stdout=subprocess.PIPE,
        stderr=syncer_log.open("wb"),
        env=env,
    )
    procs = [Proc("syncer", syncer, syncer_log)]
    run.procs = procs
    stop_sampling = threading.Event()

    def sampler() -> None:
        while not stop_sampling.is_set():
            for proc in procs:
                proc.sample()
            stop_sampling.wait(SAMPLE_EVERY_S)  # the sampling period

    in_run_bandwidth: list[float] = []

    def bound_sampler() -> None:
        # The bound again while the daemons run: the merge worker shares these cores with the
        # learners, and so does this. A merge's worth of traffic ((2M + 4) x F, as adds of 3 x F)
        # timed as one, the median of 3 per sample (a merge, too, gets what the cores give over its
        # whole length, not its best moment), one sample every BOUND_EVERY_S.
        adds = max(1, round((2 * m + 4) / 3))
        while not stop_sampling.wait(BOUND_EVERY_S):
            in_run_bandwidth.append(add_bandwidth_gbs(largest, repeats=3, adds=adds, best=False))

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    bound_thread = threading.Thread(target=bound_sampler, daemon=True)
    bound_thread.start()
    started_at = time.time()
    try:
        assert syncer.stdout is not None
        address = f"127.0.0.1:{json.loads(syncer.stdout.readline())['port']}"
        for i in range(run.learners):
            path = work / f"l{i}.log"
            command = [
                *DILOCOD,
                "learner",
                *entry,
                "--syncer",
                address,
                "--insecure",
                "--device",
                "cpu",
                "--id",
                f"l{i}",
                "--state-dir",
                str(work / f"l{i}"),
                "--progress-every-s",
                "5",
                "--network",
                network,
            ]
            procs.append(Proc(f"l{i}", subprocess.Popen(command, stderr=path.open("wb"), env=env), path))
        for i in range(run.pushers):
            path = work / f"p{i}.log"
            command = [
                sys.executable,
                "-m",
                "devkit.scale_pusher",
                "--syncer",
                address,
                "--id",
                f"p{i}",
                "--layers",
                str(run.layers),
                "--step-s",
                str(step_s),
            ]
            procs.append(Proc(f"p{i}", subprocess.Popen(command, stderr=path.open("wb"), env=env), path))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if any(p.popen.poll() is not None for p in procs):
                dead = [p.name for p in procs if p.popen.poll() is not None]
                raise RuntimeError(f"[{run.label}] exited early: {dead}; see {work}")
            time.sleep(1.0)  # the run's duration, polled for early exits
        status = json.loads(
            subprocess.run(
                [*DILOCOD, "status", "--syncer", address, "--insecure", "--json"],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            ).stdout
        )
        for proc in procs[1:] + procs[:1]:  # learners and pushers first, then the syncer
            sent = time.monotonic()
            proc.popen.send_signal(signal.SIGTERM)
            proc.popen.wait(timeout=300)
            proc.exit_s = round(time.monotonic() - sent, 3)
    finally:
        stop_sampling.set()
        thread.join()
        bound_thread.join()
        for proc in procs:
            if proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait()
    in_run = statistics.median(in_run_bandwidth) if in_run_bandwidth else bandwidth
    figures = (alone, bandwidth, in_run, disk, raw_gbps, model_bytes, largest, m, started_at, network)
    return summarize(run, status, plan, *figures)


def summarize(
    run: Run,
    status: dict[str, Any],
    plan: Any,
    alone: dict[str, int],
    bandwidth_gbs: float,
    in_run_bandwidth_gbs: float,
    disk_gbs: float,
    raw_gbps: float,
    model_bytes: int,
    largest: int,
    m: int,
    started_at: float,
    network: str,
) -> dict[str, Any]:
    syncer, learners = run.procs[0], [p for p in run.procs if p.name.startswith("l")]
    lines = log_lines(syncer.log)
    merges = [line for line in lines if line.get("event") == "round merged"]
    merge_s = [float(line["duration_s"]) for line in merges]
    # The worker's own time (older syncers logged only the total, waits for the worker included).
    worker_s = [float(line.get("worker_s", line["duration_s"])) for line in merges]
    ratios, in_run_ratios = [], []
    for line, work_s in zip(merges, worker_s, strict=True):
        # Pushes, not learners: a late push merged beside its learner's own answer is one more.
        pushes = max(1, len(line.get("push_rounds", line.get("contributors", []))))
        fragment_bytes = int(line.get("bytes", 0)) // pushes
        traffic = (2 * pushes + 4) * fragment_bytes
        if traffic > 0:
            ratios.append(work_s / (traffic / (bandwidth_gbs * 1e9)))
            in_run_ratios.append(work_s / (traffic / (in_run_bandwidth_gbs * 1e9)))
    checkpoints = [line for line in lines if line.get("event") == "checkpoint"]
    clock = int(status.get("clock", 0))
    due = clock * plan.num_fragments // SYNC_EVERY
    merged, abandoned = int(status.get("rounds_merged", 0)), int(status.get("rounds_abandoned", 0))
    heals, lags, per_step = [], [], []
    for learner in learners:
        events = log_lines(learner.log)
        joined = next((stamp(e) for e in events if e.get("event") == "joined"), None)
        healed = next((stamp(e) for e in events if e.get("event") == "healed"), None)
        if joined is not None and healed is not None:
            heals.append(healed - joined)
        progress = [e for e in events if e.get("event") == "progress"]
        if progress:
            last = progress[-1]
            steps = max(1, int(last.get("step", 1)))
            per_step.append((int(last.get("sent_bytes", 0)) + int(last.get("received_bytes", 0))) / steps)
            if "loop_lag_ms" in last:
                lags.append(last["loop_lag_ms"])
    entry_kib = alone.get("peak_pss_kib", 0)
    syncer_floor = 2 * model_bytes + (m + 2) * largest
    # With what the formula leaves out: the interpreter, and at start the entry's model beside Θ.
    fixed_kib = alone.get("syncer_fixed_kib", 0)
    syncer_bound = max(fixed_kib * 1024 + syncer_floor, alone.get("peak_rss_kib", 0) * 1024 + model_bytes)
    learner_floor = model_bytes + (OVERLAP + 2) * largest
    gib = lambda kib: round(kib * 1024 / 1e9, 3)  # noqa: E731 - KiB to GB
    heal_gbps = [model_bytes * 8 / s / 1e9 for s in heals if s > 0]
    return {
        "label": run.label,
        "network": network,
        "params": plan.total_numel,
        "model_gb": round(model_bytes / 1e9, 3),
        "learners": run.learners,
        "pushers": run.pushers,
        "m": m,
        "fragments": plan.num_fragments,
        "imbalance": round(plan.imbalance, 4),
        "largest_fragment_mb": round(largest / 1e6, 1),
        "syncer_peak_rss_gb": gib(syncer.peak_hwm_kib),
        "syncer_peak_pss_gb": gib(syncer.peak_pss_kib),
        "syncer_floor_gb": round(syncer_floor / 1e9, 3),
        "syncer_fixed_gb": gib(fixed_kib),
        "syncer_bound_gb": round(syncer_bound / 1e9, 3),
        "entry_alone_peak_pss_gb": gib(entry_kib),
        "entry_alone_peak_rss_gb": gib(alone.get("peak_rss_kib", 0)),
        "learner_peak_rss_gb": [gib(p.peak_hwm_kib) for p in learners],
        "learner_child_peak_rss_gb": [gib(p.child_peak_hwm_kib) for p in learners],
        "learner_peak_pss_sum_gb": [gib(p.peak_sum_pss_kib) for p in learners],
        "learner_overhead_gb": [gib(p.peak_sum_pss_kib - entry_kib) for p in learners],
        "learner_overhead_floor_gb": round(learner_floor / 1e9, 3),
        "rounds_due": due,
        "rounds_merged": merged,
        "rounds_abandoned": abandoned,
        "rounds_skipped": max(0, due - merged - abandoned),
        "merged_share": round(merged / due, 4) if due else 0.0,
        "merge_s": quantiles(merge_s),
        "merge_worker_s": quantiles(worker_s),
        "merge_over_bound": quantiles(ratios),
        "merge_over_bound_in_run": quantiles(in_run_ratios),
        "add_bandwidth_gbs": round(bandwidth_gbs, 2),
        "add_bandwidth_in_run_gbs": round(in_run_bandwidth_gbs, 2),
        "late_pushes_written": status.get("late_pushes_written"),
        "rounds_skipped_by_reason": status.get("rounds_skipped"),
        "pool_buffers_created": status.get("pool_buffers_created"),
        "heal_s": [round(s, 2) for s in heals],
        "heal_gbps": [round(g, 2) for g in heal_gbps],
        "raw_loopback_gbps": raw_gbps,
        "heal_over_raw": [round(g / raw_gbps, 3) for g in heal_gbps],
        "syncer_loop_lag_ms": status.get("loop_lag_ms"),
        "learner_loop_lag_ms": lags,
        "checkpoints": [
            {"duration_s": c.get("duration_s"), "at_s": round(stamp(c) - started_at, 1)} for c in checkpoints
        ],
        "checkpoint_gb": round(2 * model_bytes / 1e9, 3),
        "disk_write_gbs": round(disk_gbs, 3),
        "sigterm_exit_s": {p.name: p.exit_s for p in run.procs if not p.name.startswith("p")},
        "bytes_per_learner_step_mb": [round(b / 1e6, 2) for b in per_step],
        "steps": {lr["id"]: lr["steps"] for lr in status.get("learners", [])},
    }


def table(results: list[dict[str, Any]]) -> str:
    """The RESULTS.md table: one column per size."""

    def fmt(value: Any) -> str:
        if isinstance(value, dict) and "p99" in value:
            return f"{value['p50']:g} / {value['p99']:g} / {value['max']:g}"
        if isinstance(value, list):
            return ", ".join(fmt(v) for v in value) or "-"
        return str(value)

    rows = [
        (
            "params (M learners + pushers)",
            lambda r: f"{r['params'] / 1e6:.0f}M ({r['learners']}+{r['pushers']})",
        ),
        ("fragments / imbalance", lambda r: f"{r['fragments']} / {r['imbalance']}"),
        ("syncer peak RSS / floor, GB", lambda r: f"{r['syncer_peak_rss_gb']} / {r['syncer_floor_gb']}"),
        (
            "syncer bound with its fixed cost (interpreter), GB",
            lambda r: f"{r.get('syncer_bound_gb', '-')} ({r.get('syncer_fixed_gb', '-')})",
        ),
        (
            "learner overhead (PSS) / floor, GB",
            lambda r: f"{fmt(r['learner_overhead_gb'])} / {r['learner_overhead_floor_gb']}",
        ),
        (
            "learner peak RSS (+ network process), GB",
            lambda r: f"{fmt(r['learner_peak_rss_gb'])} (+{fmt(r['learner_child_peak_rss_gb'])})",
        ),
        ("entry alone peak PSS, GB", lambda r: fmt(r["entry_alone_peak_pss_gb"])),
        (
            "rounds due / merged / abandoned / skipped",
            lambda r: (
                f"{r['rounds_due']} / {r['rounds_merged']} / {r['rounds_abandoned']} / {r['rounds_skipped']}"
            ),
        ),
        ("merged share", lambda r: fmt(r["merged_share"])),
        ("merge s (ready to merged) p50 / p99 / max", lambda r: fmt(r["merge_s"])),
        ("of which the merge worker's, s", lambda r: fmt(r.get("merge_worker_s", "-"))),
        ("merge / fused bound alone p50 / p99 / max", lambda r: fmt(r["merge_over_bound"])),
        (
            "merge / fused bound in the run p50 / p99 / max",
            lambda r: fmt(r.get("merge_over_bound_in_run", "-")),
        ),
        (
            "torch.add GB/s alone / in the run",
            lambda r: f"{r['add_bandwidth_gbs']} / {r.get('add_bandwidth_in_run_gbs', '-')}",
        ),
        ("late pushes written out", lambda r: fmt(r.get("late_pushes_written", "-"))),
        ("syncer pool buffers created", lambda r: fmt(r.get("pool_buffers_created", "-"))),
        (
            "heal s (Gbit/s; / raw loopback)",
            lambda r: f"{fmt(r['heal_s'])} ({fmt(r['heal_gbps'])}; {fmt(r['heal_over_raw'])})",
        ),
        ("syncer loop lag ms p50 / p99 / max", lambda r: fmt(r["syncer_loop_lag_ms"])),
        ("learner loop lag ms p50 / p99 / max", lambda r: fmt(r["learner_loop_lag_ms"])),
        (
            "checkpoint s (of GB; disk GB/s)",
            lambda r: (
                f"{fmt([c['duration_s'] for c in r['checkpoints']])} "
                f"({r['checkpoint_gb']}; {r['disk_write_gbs']})"
            ),
        ),
        ("SIGTERM to exit s", lambda r: ", ".join(f"{k} {v}" for k, v in r["sigterm_exit_s"].items())),
        ("bytes per learner step, MB", lambda r: fmt(r["bytes_per_learner_step_mb"])),
    ]
    lines = [
        "| measure | " + " | ".join(r["label"] for r in results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    for name, get in rows:
        lines.append(f"| {name} | " + " | ".join(get(r) for r in results) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runs", default=DEFAULT_RUNS, help="SIZE:LEARNERS:PUSHERS,... (sizes: 64M, 256M, 1B)"
    )
    parser.add_argument("--seconds", type=float, default=150.0, help="run time per size, from the start")
    parser.add_argument("--step-s", type=float, default=1.0, help="the entry's step time")
    parser.add_argument("--network", choices=("process", "thread"), default="process")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "scale.json")
    parser.add_argument("--keep", type=Path, default=None, help="keep logs and state under this directory")
    args = parser.parse_args()
    runs = []
    for spec in args.runs.split(","):
        size, learners, pushers = spec.split(":")
        runs.append(Run(f"{size} {learners}+{pushers}", SIZES[size], int(learners), int(pushers)))
    results = []
    for run in runs:
        with tempfile.TemporaryDirectory(prefix="dilocod-scale-") as tmp:
            # One directory per run: a second run of a size must not resume the first's checkpoint.
            work = Path(tmp) if args.keep is None else args.keep / run.label.replace(" ", "_")
            work.mkdir(parents=True, exist_ok=True)
            results.append(run_size(run, args.seconds, args.step_s, work, args.network))
        print(json.dumps(results[-1]), flush=True)
    document = {
        "command": shlex.join(["python", "bench/scale.py", *sys.argv[1:]]),
        "machine": machine_facts(),
        "width": WIDTH,
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
