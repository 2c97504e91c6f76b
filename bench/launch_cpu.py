"""Does it matter on which CPU a training process builds its model? The learner overhead benchmark's
alone loop (bench/learner_overhead.py's entry: the same small GPT and AdamW step), with no dilocod
runtime, launched three ways and always stepping on CPU 0:

- cpu0: started on CPU 0 (as the benchmark's alone process is);
- cpu1-moved-after-build: started on CPU 1, moved to CPU 0 once the model and optimizer are built
  (as the benchmark's split placement used to start the learner);
- cpu1-moved-before-torch: started on CPU 1, moved to CPU 0 before torch is imported.

Rounds are interleaved (the order rotated each round) so load from other tenants hits every kind;
each run's median step interval is compared with the cpu0 run of the same round. It measures and
records; it asserts nothing. Run from the repository root:
``python bench/launch_cpu.py [--rounds 20] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import learner_overhead as lo  # bench/learner_overhead.py: run as python bench/<script>.py

from devkit.machine import machine_facts

_ENTRY = lo.ENTRY_MODULE
#: kind -> (the CPU it starts on, the program it runs)
KINDS: dict[str, tuple[int, str]] = {
    "cpu0": (0, f"import {_ENTRY} as e; e.alone()"),
    # alone() without its own loop: the move goes between building the trainer and the first step.
    "cpu1-moved-after-build": (
        1,
        f"import os, dilocod, {_ENTRY} as e\n"
        "ctx = dilocod.LearnerContext('alone', 'learner', 'cpu', 0, 1, None, e.CONFIG['seed'])\n"
        "t = e.make_trainer(ctx)\n"
        "os.sched_setaffinity(0, {0})\n"
        "for i in range(e.CONFIG['warmup'] + e.CONFIG['steps']):\n"
        "    t.step(i)\n",
    ),
    "cpu1-moved-before-torch": (
        1,
        f"import os; os.sched_setaffinity(0, {{0}}); import {_ENTRY} as e; e.alone()",
    ),
}


def run(entry_dir: Path, config: dict[str, Any], kind: str) -> float:
    """One process of `kind`; its median step interval in ms."""
    cpu, program = KINDS[kind]
    lo.write_config(entry_dir, config)
    with lo.children_on({cpu}):
        env, command = lo.child_env(entry_dir), [sys.executable, "-c", program]
        process = subprocess.Popen(command, env=env, cwd=entry_dir, stdout=subprocess.DEVNULL)
    if process.wait(timeout=lo.RUN_TIMEOUT_S) != 0:
        raise RuntimeError(f"the {kind} run exited with {process.returncode}")
    times = json.loads(Path(config["times"]).read_text())
    return statistics.median(times["intervals_s"]) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds of one run of each kind (default 20)")
    parser.add_argument("--steps", type=int, default=300, help="measured steps per run (default 300)")
    parser.add_argument("--warmup", type=int, default=60, help="steps before the measurement (default 60)")
    parser.add_argument("--batch", type=int, default=2, help="sequences of 32 tokens per step (default 2)")
    parser.add_argument("--json", type=Path, help="write every round's medians and the summary here")
    args = parser.parse_args(argv)
    if not {0, 1} <= os.sched_getaffinity(0):
        parser.error("needs CPUs 0 and 1")
    base = lo.entry_config(args.batch, args.warmup, args.steps)
    facts = machine_facts()  # before the runs: it records the load average at the start
    kinds = list(KINDS)
    medians: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="launch-cpu-") as tmp:
        work = Path(tmp)
        (work / f"{lo.ENTRY_MODULE}.py").write_text(lo.ENTRY_SOURCE)
        for r in range(args.rounds):
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                medians[kind].append(run(work, {**base, "times": str(work / f"{kind}-{r}.json")}, kind))
            line = ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in medians.items())
            print(f"round {r}: {line}", file=sys.stderr, flush=True)
    summary: dict[str, Any] = {}
    for kind in kinds:
        ratios = [m / b - 1 for m, b in zip(medians[kind], medians["cpu0"], strict=True)]
        summary[kind] = {
            "median_of_rounds_ms": statistics.median(medians[kind]),
            "ratio_to_cpu0_per_round": ratios,
            "ratio_to_cpu0_median": statistics.median(ratios),
            "rounds_slower_than_cpu0": sum(r > 0 for r in ratios),
        }
        print(
            f"{kind}: median of rounds {summary[kind]['median_of_rounds_ms']:.2f} ms, against cpu0 "
            f"{summary[kind]['ratio_to_cpu0_median']:+.1%} (median of rounds), slower in "
            f"{summary[kind]['rounds_slower_than_cpu0']} of {args.rounds}"
        )
    if args.json:
        record = {
            "command": shlex.join(["python", "bench/launch_cpu.py", *(argv or sys.argv[1:])]),
            "args": vars(args) | {"json": str(args.json)},
            "machine": facts,
            "medians_ms": medians,
        }
        args.json.write_text(json.dumps(record | {"summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
