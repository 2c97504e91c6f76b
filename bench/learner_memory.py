"""Resident memory of a fault-free run over time: a syncer and two learners of the embedded model
(defaults, loopback), VmRSS of every process (the learners' network processes too) every 2 s.

A leak shows as growth that goes on for the whole run; warm-up (the heal, the inner optimizer's
state at the first step, the first pushes) as growth in the first tens of seconds, then a flat
line. bench/notes/learner-memory.md records a run.

    python bench/learner_memory.py --seconds 300 --out memory.tsv
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from devkit.loopback import syncer_and_learners

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


if __name__ == "__main__":
    main()
