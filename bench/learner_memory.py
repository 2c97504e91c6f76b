"""Learner memory, two ways.

Growth (the default): resident memory of a fault-free run over time, a syncer and two learners of
the embedded model (defaults, loopback), VmRSS of every process (the learners' network processes
too) every 2 s. A leak shows as growth that goes on for the whole run; warm-up (the heal, the
inner optimizer's state at the first step, the first pushes) as growth in the first tens of
seconds, then a flat line.

    python bench/learner_memory.py --seconds 300 --out memory.tsv

Overhead (--overhead): what a learner costs in memory above its entry run alone. The entry is a
model of --layers x Linear(--width, --width, bias=False) in float32 (15 x 4096^2: 252M parameters,
1.0 GB) whose step sleeps --step-s and nudges one layer (its optimizer, plain SGD, keeps no state: the
model is all the entry holds). A syncer (`--fragments 24 --sync-every 24 --overlap 2`: P = H = 24, tau = 2) and one
learner (`--network process` or `thread`) run for --seconds on loopback; every 0.2 s the PSS and
RSS of the syncer, the learner and the learner's network process are read from
/proc/PID/smaps_rollup. PSS counts a page two processes map once, shared between them, so the
learner's figure is the sum of its two processes' PSS (their RSS would count the shared-memory
buffers both map twice). Then the same entry runs alone (its factory, then its step in a loop)
for --alone-seconds, sampled the same way: the baseline. The learner's overhead is its peak PSS
minus the baseline's peak, against the target 1.0 x model bytes (the anchors) + (tau + 2) x the
largest fragment. bench/notes/learner-memory.md records runs of both.

    python bench/learner_memory.py --overhead --network process --seconds 90 --out overhead.tsv

Measures and records; asserts nothing. Memory heavy (4-6 GB with the syncer): run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loopback_run import syncer_and_learners

SAMPLE_EVERY_S = 2.0
OVERHEAD_SAMPLE_EVERY_S = 0.2
READY_TIMEOUT_S = 120.0
ROOT = Path(__file__).resolve().parent.parent
ENTRY_MODULE = "learner_memory_entry"
ENTRY = f"{ENTRY_MODULE}:make_trainer"
SYNCER_FLAGS = ("--fragments", "24", "--sync-every", "24", "--overlap", "2")
OVERLAP = 2

ENTRY_SOURCE = """
import json
import time
from pathlib import Path

import torch
import dilocod

CONFIG = json.loads((Path(__file__).parent / "learner_memory_config.json").read_text())


def make_trainer(ctx):
    torch.manual_seed(1234)  # the syncer builds the same initial model
    width = CONFIG["width"]
    model = torch.nn.Sequential(
        *[torch.nn.Linear(width, width, bias=False) for _ in range(CONFIG["layers"])]
    )
    if ctx.role == "syncer":
        return dilocod.Trainer(model=model, optimizer=None, step=lambda i: dilocod.StepResult(0))
    layers = list(model)

    def step(index):
        time.sleep(CONFIG["step_s"])
        with torch.no_grad():
            layers[index % len(layers)].weight[0, 0] += 1e-3  # one layer moves
        return dilocod.StepResult(tokens=1, loss=0.0)

    # A learner must have an inner optimizer (to save it); plain SGD keeps no state, and the step
    # never calls it.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    return dilocod.Trainer(model=model, optimizer=optimizer, step=step)


def alone(seconds):
    from dilocod import LearnerContext

    trainer = make_trainer(LearnerContext("alone", "learner", "cpu", 0, 1, None, 0))
    started, index = time.monotonic(), 0
    while time.monotonic() - started < seconds:
        trainer.step(index)
        index += 1
"""


def rss_mib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


def pss_rss_kib(pid: int) -> tuple[int, int] | None:
    """(Pss, Rss) in KiB from /proc/PID/smaps_rollup; None once the process is gone."""
    values: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Pss", "Rss"):
                values[key] = int(rest.split()[0])
    except (OSError, ValueError):
        return None
    if "Pss" not in values or "Rss" not in values:
        return None
    return values["Pss"], values["Rss"]


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def growth(args: argparse.Namespace) -> None:
    with syncer_and_learners(args.learners) as run:
        parts = ("", " child")
        header = ["s", "syncer"] + [f"l{m}{part}" for m in range(args.learners) for part in parts]
        started = time.monotonic()
        with args.out.open("w") as out:
            out.write("\t".join(header) + "\n")
            while time.monotonic() - started < args.seconds:
                row = [f"{time.monotonic() - started:.0f}", str(rss_mib(run.syncer.pid))]
                for learner in run.learners:
                    row += [str(rss_mib(learner.pid)), *(str(rss_mib(c)) for c in children(learner.pid))]
                out.write("\t".join(row) + "\n")
                out.flush()
                time.sleep(SAMPLE_EVERY_S)  # the sampling period, not a wait for an event
    print(f"wrote {args.out}")


# ----------------------------------------------------------------------------- --overhead


def _model_figures(layers: int, width: int) -> tuple[int, int]:
    """(model bytes, largest fragment bytes) of the syncer's plan for this model at P = 24."""
    from dilocod.outer.plan import plan_fragments

    sizes = [(f"{i}.weight", (width, width)) for i in range(layers)]
    plan = plan_fragments(sizes, int(SYNCER_FLAGS[1]))
    return layers * width * width * 4, max(f.numel for f in plan.fragments) * 4


def _env(entry_dir: Path) -> dict[str, str]:
    paths = [str(entry_dir), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}


def _sample(processes: dict[str, int], out: list[dict[str, float]], started: float) -> None:
    row: dict[str, float] = {"s": round(time.monotonic() - started, 2)}
    for name, pid in processes.items():
        figures = pss_rss_kib(pid)
        if figures is not None:
            row[f"{name}_pss_mib"] = figures[0] / 1024
            row[f"{name}_rss_mib"] = figures[1] / 1024
    out.append(row)


def _peak(rows: list[dict[str, float]], *keys: str) -> float:
    return max((sum(r.get(k, 0.0) for k in keys) for r in rows), default=0.0)


def _learner_run(args: argparse.Namespace, entry_dir: Path, work: Path) -> list[dict[str, float]]:
    env = _env(entry_dir)
    syncer_err = (work / "syncer.stderr").open("wb")
    syncer = subprocess.Popen(
        [
            *(sys.executable, "-m", "dilocod", "syncer", "--listen", "127.0.0.1:0", "--insecure"),
            *("--entry", ENTRY, "--state-dir", str(work / "s"), "--ready-json", *SYNCER_FLAGS),
        ],
        stdout=subprocess.PIPE,
        stderr=syncer_err,
        env=env,
        cwd=entry_dir,
    )
    learner = None
    rows: list[dict[str, float]] = []
    try:
        assert syncer.stdout is not None
        port = json.loads(syncer.stdout.readline())["port"]
        learner_err = (work / "learner.stderr").open("wb")
        learner = subprocess.Popen(
            [
                *(sys.executable, "-m", "dilocod", "learner", "--syncer", f"127.0.0.1:{port}", "--insecure"),
                *("--entry", ENTRY, "--id", "m", "--device", "cpu", "--network", args.network),
            ],
            stderr=learner_err,
            env=env,
            cwd=entry_dir,
        )
        started = time.monotonic()
        while time.monotonic() - started < args.seconds and learner.poll() is None:
            processes = {"syncer": syncer.pid, "learner": learner.pid}
            kids = children(learner.pid)
            if kids:
                processes["child"] = kids[0]
            _sample(processes, rows, started)
            time.sleep(OVERHEAD_SAMPLE_EVERY_S)  # the sampling period, not a wait for an event
        if learner.poll() is not None:
            raise RuntimeError(f"the learner exited with {learner.returncode}: see {work}/learner.stderr")
    finally:
        for process in (learner, syncer):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=120)
    return rows


def _alone_run(args: argparse.Namespace, entry_dir: Path) -> list[dict[str, float]]:
    command = [sys.executable, "-c", f"import {ENTRY_MODULE} as e; e.alone({args.alone_seconds})"]
    process = subprocess.Popen(command, env=_env(entry_dir), cwd=entry_dir)
    rows: list[dict[str, float]] = []
    started = time.monotonic()
    while process.poll() is None:
        _sample({"alone": process.pid}, rows, started)
        time.sleep(OVERHEAD_SAMPLE_EVERY_S)  # the sampling period, not a wait for an event
    if process.returncode != 0:
        raise RuntimeError(f"the alone run exited with {process.returncode}")
    return rows


def overhead(args: argparse.Namespace) -> None:
    model_bytes, fragment_bytes = _model_figures(args.layers, args.width)
    with tempfile.TemporaryDirectory(prefix="dilocod-memory-") as tmp:
        entry_dir = Path(tmp)
        (entry_dir / f"{ENTRY_MODULE}.py").write_text(ENTRY_SOURCE)
        config = {"layers": args.layers, "width": args.width, "step_s": args.step_s}
        (entry_dir / "learner_memory_config.json").write_text(json.dumps(config))
        alone = _alone_run(args, entry_dir)
        rows = _learner_run(args, entry_dir, entry_dir)
        merged = (entry_dir / "syncer.stderr").read_text(errors="replace").count('"round merged"')
    mib = 1 << 20
    baseline = _peak(alone, "alone_pss_mib")
    learner_pss = _peak(rows, "learner_pss_mib", "child_pss_mib")
    summary = {
        "network": args.network,
        "seconds": args.seconds,
        "model_mib": round(model_bytes / mib, 1),
        "largest_fragment_mib": round(fragment_bytes / mib, 1),
        "target_overhead_mib": round((model_bytes + (OVERLAP + 2) * fragment_bytes) / mib, 1),
        "alone_peak_pss_mib": round(baseline, 1),
        "alone_peak_rss_mib": round(_peak(alone, "alone_rss_mib"), 1),
        "learner_peak_pss_mib": round(learner_pss, 1),
        "learner_peak_rss_mib": round(_peak(rows, "learner_rss_mib"), 1),
        "child_peak_pss_mib": round(_peak(rows, "child_pss_mib"), 1),
        "child_peak_rss_mib": round(_peak(rows, "child_rss_mib"), 1),
        "learner_and_child_peak_rss_mib": round(_peak(rows, "learner_rss_mib", "child_rss_mib"), 1),
        "syncer_peak_pss_mib": round(_peak(rows, "syncer_pss_mib"), 1),
        "overhead_mib": round(learner_pss - baseline, 1),
        "rounds_merged": merged,
    }
    summary["overhead_x_model"] = round(summary["overhead_mib"] * mib / model_bytes, 3)
    keys = sorted({k for r in rows for k in r if k != "s"})
    with args.out.open("w") as out:
        out.write("\t".join(["s", *keys]) + "\n")
        for row in rows:
            out.write("\t".join([str(row["s"]), *(f"{row[k]:.0f}" if k in row else "" for k in keys)]) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=None, help="300 (growth), 90 (--overhead)")
    parser.add_argument("--learners", type=int, default=2, help="growth: learners of the embedded model")
    parser.add_argument("--out", type=Path, default=Path("memory.tsv"))
    parser.add_argument(
        "--overhead", action="store_true", help="one learner of a large model against its entry alone"
    )
    parser.add_argument("--network", choices=("process", "thread"), default="process")
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--alone-seconds", type=float, default=20.0)
    args = parser.parse_args()
    if args.overhead:
        args.seconds = 90.0 if args.seconds is None else args.seconds
        overhead(args)
    else:
        args.seconds = 300.0 if args.seconds is None else args.seconds
        growth(args)


if __name__ == "__main__":
    main()
