"""Syncer at a real model size: its peak memory, merge times and event-loop lag, on loopback.

Starts `python -m dilocod syncer` and N `python -m dilocod learner` processes on a model of
--layers Linear(--width, --width, bias=False) (15 x 4096 x 4096: 252M parameters, 1.0 GB in
float32), whose step sleeps --step-s and nudges one layer. Runs --seconds, sampling the syncer's
resident memory from /proc every 0.2 s, then asks the syncer's status (loop lag, rounds) and reads
its JSON log lines (each merged round's duration_s). Prints one JSON object.

Run from the repository root (heavy: about 1 + 3 x the model in memory per learner; 2 cores):
    python bench/syncer_memory.py [--learners 2] [--seconds 150] [--json FILE]
Measures and records; asserts nothing. Must not be imported by dilocod.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ENTRY = """
import os
import time

import torch
import dilocod

LAYERS = int(os.environ["SCALE_LAYERS"])
WIDTH = int(os.environ["SCALE_WIDTH"])
STEP_S = float(os.environ["SCALE_STEP_S"])


def make_trainer(ctx):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    if ctx.role == "syncer":
        return dilocod.Trainer(model=model, optimizer=None, step=lambda i: dilocod.StepResult(0))
    layers = list(model)

    def step(index):
        time.sleep(STEP_S)
        with torch.no_grad():
            layers[index % LAYERS].weight.add_(1e-4)
        return dilocod.StepResult(tokens=1000, loss=0.0)

    # Never stepped (the step nudges a layer itself); SGD without momentum keeps no state.
    return dilocod.Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), step=step)
"""


def proc_bytes(pid: int, key: str = "VmRSS") -> int:
    """A /proc/PID/status figure in bytes: VmRSS (resident now) or VmHWM (the process's peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("syncer_args", nargs="*", help="extra syncer flags (after --)")
    args = parser.parse_args()
    model_bytes = args.layers * args.width * args.width * 4
    work = Path(tempfile.mkdtemp(prefix="syncer-memory-"))
    (work / "scale_entry.py").write_text(ENTRY)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(work), os.getcwd(), os.environ.get("PYTHONPATH", "")]),
        "SCALE_LAYERS": str(args.layers),
        "SCALE_WIDTH": str(args.width),
        "SCALE_STEP_S": str(args.step_s),
    }
    dilocod = [sys.executable, "-m", "dilocod"]
    syncer_log = (work / "syncer.log").open("wb")
    syncer = subprocess.Popen(
        [
            *dilocod,
            "syncer",
            "--listen",
            "127.0.0.1:0",
            "--insecure",
            "--entry",
            "scale_entry:make_trainer",
            "--state-dir",
            str(work / "state"),
            "--ready-json",
            "--checkpoint-every-s",
            "60",
            *args.syncer_args,
        ],
        stdout=subprocess.PIPE,
        stderr=syncer_log,
        env=env,
    )
    assert syncer.stdout is not None
    port = json.loads(syncer.stdout.readline())["port"]
    samples: list[tuple[float, int]] = []
    done = threading.Event()
    started = time.monotonic()

    def sample() -> None:
        while not done.wait(0.2):
            samples.append((time.monotonic() - started, proc_bytes(syncer.pid)))

    threading.Thread(target=sample, daemon=True).start()
    learners = [
        subprocess.Popen(
            [
                *dilocod,
                "learner",
                "--syncer",
                f"127.0.0.1:{port}",
                "--insecure",
                "--entry",
                "scale_entry:make_trainer",
                "--id",
                f"l{i}",
                "--state-dir",
                str(work / f"l{i}"),
                "--device",
                "cpu",
                "--save-every-s",
                "100000",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(work / f"l{i}.log").open("wb"),
            env=env,
        )
        for i in range(args.learners)
    ]

    def ask_status() -> dict[str, Any]:
        command = [*dilocod, "status", "--syncer", f"127.0.0.1:{port}", "--insecure", "--json"]
        reply = subprocess.run(command, capture_output=True, env=env, check=True, timeout=120)
        return json.loads(reply.stdout)

    # The status's loop lag covers its last 60 s: asked every 45 s, so no part of the run is missed.
    lag_windows = []
    while time.monotonic() - started < args.seconds:
        time.sleep(min(45.0, max(0.0, args.seconds - (time.monotonic() - started))))
        lag_windows.append(ask_status()["loop_lag_ms"])
    status = ask_status()
    # Since the process started, including building the model from the entry (the daemon's startup).
    startup_peak = proc_bytes(syncer.pid, "VmHWM")
    for learner in learners:
        learner.terminate()
    for learner in learners:
        learner.wait(timeout=120)
    syncer.terminate()
    syncer.wait(timeout=120)
    done.set()
    merges = []
    for line in (work / "syncer.log").read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "round merged":
            merges.append(record)
    durations = sorted(float(m["duration_s"]) for m in merges)
    peak = max(rss for _, rss in samples)
    result: dict[str, Any] = {
        "model_bytes": model_bytes,
        "fragment_bytes_max": max(
            (int(m["bytes"]) // max(1, len(m["contributors"])) for m in merges), default=0
        ),
        "learners": args.learners,
        "seconds": args.seconds,
        "syncer_peak_rss_bytes": peak,
        "syncer_peak_rss_x_model": round(peak / model_bytes, 2),
        "syncer_vm_hwm_bytes": startup_peak,
        "rounds_merged": status["rounds_merged"],
        "rounds_abandoned": status["rounds_abandoned"],
        "next_round": status["next_round"],
        "merge_s": {
            "count": len(durations),
            "median": round(statistics.median(durations), 4) if durations else None,
            "p90": round(durations[int(0.9 * (len(durations) - 1))], 4) if durations else None,
            "max": round(durations[-1], 4) if durations else None,
        },
        "loop_lag_ms": status["loop_lag_ms"],
        "loop_lag_ms_windows": lag_windows,
        "loop_lag_ms_max": max(w["max"] for w in lag_windows),
        "loop_lag_ms_p99_worst_window": max(w["p99"] for w in lag_windows),
        "checkpoints_written": status["checkpoints_written"],
        "work_dir": str(work),
        # (seconds since the ready line, MB resident), one sample a second.
        "rss_mb_series": [(round(t, 1), round(rss / 1e6)) for t, rss in samples[::5]],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
