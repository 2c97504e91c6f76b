"""Resident memory of a fault-free run over time: a syncer and two learners of the embedded model
(defaults, loopback), VmRSS of every process (the learners' network processes too) every 2 s.

A leak shows as growth that goes on for the whole run; warm-up (the heal, the inner optimizer's
state at the first step, the first pushes) as growth in the first tens of seconds, then a flat
line. bench/notes/learner-memory.md records a run.

    python bench/learner_memory.py --seconds 300 --out memory.tsv
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAMPLE_EVERY_S = 2.0


def rss_mib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("memory.tsv"))
    args = parser.parse_args()
    dilocod = [sys.executable, "-m", "dilocod"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="dilocod-memory-") as tmp:
        work = Path(tmp)
        serve = ["--listen", "127.0.0.1:0", "--insecure", "--ready-json", "--state-dir", str(work / "s")]
        syncer = subprocess.Popen(
            [*dilocod, "syncer", *serve],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        assert syncer.stdout is not None
        port = json.loads(syncer.stdout.readline())["port"]
        join = ["--syncer", f"127.0.0.1:{port}", "--insecure", "--device", "cpu"]
        learners = [
            subprocess.Popen(
                [*dilocod, "learner", *join, "--id", f"l{m}", "--state-dir", str(work / f"l{m}")],
                stderr=subprocess.DEVNULL,
                env=env,
            )
            for m in range(args.learners)
        ]
        header = ["s", "syncer"] + [f"l{m}{part}" for m in range(args.learners) for part in ("", " child")]
        started = time.monotonic()
        with args.out.open("w") as out:
            out.write("\t".join(header) + "\n")
            while time.monotonic() - started < args.seconds:
                row = [f"{time.monotonic() - started:.0f}", str(rss_mib(syncer.pid))]
                for learner in learners:
                    row += [str(rss_mib(learner.pid)), *(str(rss_mib(c)) for c in children(learner.pid))]
                out.write("\t".join(row) + "\n")
                out.flush()
                time.sleep(SAMPLE_EVERY_S)  # the sampling period, not a wait for an event
        for process in [*learners, syncer]:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
