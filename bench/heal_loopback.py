"""How fast learners heal from a syncer holding a large model, on loopback, as real processes.

Starts `dilocod syncer` with an entry of N x Linear(4096, 4096, bias=False) (N = 15: 252M float32
parameters, 1.0 GB), then L learners of the same entry at once (their steps only sleep), and times
each learner's first heal: from the syncer's "learner joined" line for it to the learner's own
"healed" line (every fragment received, verified and applied). Before that, `dilocod bench
loopback`'s raw TCP figure of the same run's machine is taken for comparison.

    python bench/heal_loopback.py --layers 15 --learners 1
    python bench/heal_loopback.py --layers 60 --learners 1       # 4.0 GB
    python bench/heal_loopback.py --layers 15 --learners 3

Measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

DILOCOD = [sys.executable, "-m", "dilocod"]
ENTRY = """
import os, time, torch
from torch import nn
import dilocod

def make_trainer(ctx):
    torch.manual_seed(0)
    layers = int(os.environ["HEAL_BENCH_LAYERS"])
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(layers)])
    model.requires_grad_(True)
    if ctx.role == "syncer":
        return dilocod.Trainer(model=model, optimizer=None, step=lambda i: dilocod.StepResult(0))
    def step(index):
        time.sleep(0.2)
        return dilocod.StepResult(tokens=1)
    return dilocod.Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), step=step)
"""


def _stamp(line: dict) -> float:
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


def _lines(stream, sink: list[dict], seen: threading.Event | None = None, marker: str = "") -> None:
    for raw in stream:
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        sink.append(line)
        if seen is not None and line.get("event") == marker:
            seen.set()


def raw_loopback_gbps() -> float:
    """The raw TCP figure (one thread per stream, 4 streams) of `dilocod bench loopback`."""
    command = [*DILOCOD, "bench", "loopback", "--size", "256MiB", "--streams", "4", "--codec", "none"]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # The table's row of prepared checksums: codec, checksums, streams, Gbps, raw T (Gbit/s).
    match = re.search(r"none\s+prepared\s+4\s+[\d.]+\s+([\d.]+)", out)
    if match is None:
        raise RuntimeError(f"no raw figure in:\n{out}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--learners", type=int, default=1)
    parser.add_argument("--fragments", type=int, default=24)
    parser.add_argument("--streams", default="4")
    parser.add_argument("--network", default="process")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw TCP measurement")
    args = parser.parse_args()
    raw = None if args.no_raw else raw_loopback_gbps()
    model_bytes = args.layers * 4096 * 4096 * 4
    with tempfile.TemporaryDirectory(prefix="dilocod-heal-") as tmp:
        work = Path(tmp)
        (work / "heal_entry.py").write_text(ENTRY)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "HEAL_BENCH_LAYERS": str(args.layers),
            "PYTHONPATH": os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")]),
        }
        syncer_cmd = [
            *DILOCOD, "syncer", "--entry", "heal_entry:make_trainer", "--listen", "127.0.0.1:0",
            "--insecure", "--ready-json", "--state-dir", str(work / "s"), "--fragments", str(args.fragments),
        ]  # fmt: skip
        pipes = {"stderr": subprocess.PIPE, "text": True, "env": env}
        syncer = subprocess.Popen(syncer_cmd, stdout=subprocess.PIPE, **pipes)
        processes = [syncer]
        try:
            assert syncer.stdout is not None and syncer.stderr is not None
            started = time.monotonic()
            port = json.loads(syncer.stdout.readline())["port"]
            print(f"syncer ready after {time.monotonic() - started:.1f} s", flush=True)
            syncer_log: list[dict] = []
            threading.Thread(target=_lines, args=(syncer.stderr, syncer_log), daemon=True).start()
            learner_logs: list[list[dict]] = []
            healed: list[threading.Event] = []
            for m in range(args.learners):
                command = [
                    *DILOCOD, "learner", "--entry", "heal_entry:make_trainer", "--syncer",
                    f"127.0.0.1:{port}", "--insecure", "--device", "cpu", "--id", f"l{m}",
                    "--streams", args.streams, "--network", args.network,
                ]  # fmt: skip
                learner = subprocess.Popen(command, stdout=subprocess.DEVNULL, **pipes)
                processes.append(learner)
                log: list[dict] = []
                event = threading.Event()
                learner_logs.append(log)
                healed.append(event)
                reader = threading.Thread(
                    target=_lines, args=(learner.stderr, log, event, "healed"), daemon=True
                )
                reader.start()
            for m, event in enumerate(healed):
                if not event.wait(600):
                    raise RuntimeError(f"learner l{m} did not heal in 600 s")
            print(f"model {model_bytes / 1e9:.2f} GB, {args.learners} learner(s)")
            if raw is not None:
                print(f"raw loopback (4 streams, thread each): {raw:.2f} Gbit/s")
            for m in range(args.learners):
                joined = next(
                    _stamp(x)
                    for x in syncer_log
                    if x.get("event") == "learner joined" and x.get("learner") == f"l{m}"
                )
                done = next(_stamp(x) for x in learner_logs[m] if x.get("event") == "healed")
                seconds = done - joined
                gbps = model_bytes * 8 / seconds / 1e9
                share = f", {gbps / raw:.2f}x raw" if raw else ""
                print(f"  l{m}: healed in {seconds:.2f} s: {gbps:.2f} Gbit/s{share}")
            merged = [x for x in syncer_log if x.get("event") == "round merged"]
            print(f"rounds merged meanwhile: {len(merged)}")
        finally:
            for process in reversed(processes):
                process.send_signal(signal.SIGTERM)
            for process in reversed(processes):
                try:
                    process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    process.kill()


if __name__ == "__main__":
    main()
