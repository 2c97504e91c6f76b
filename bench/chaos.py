"""Chaos against fault-free, on real processes: eval loss, goodput, faults, pushes, memory.

Each repeat runs the chaos harness (devkit/chaos/) twice with the same length: a syncer and three learners
(charlm, 4 fragments, H = 8, K = 1, checkpoints every 5 s) on loopback, once without faults and
once under the chaos schedule (network faults through the fault proxy about every 1 s, learners
killed with -9 mid-push and mid-update, SIGSTOP 3 s and 40 s, a 20 s partition, a 3 s sever, the
syncer killed with -9 and restarted). The two orders alternate between repeats, and each repeat
uses its own schedule seed. The numbers come from the daemons themselves: goodput from the
syncer's `dilocod status --json` just before the learners are stopped (reported step time over
wall time since each learner id first joined), eval loss of the syncer's last checkpoint
(charlm.evaluate, nats per byte on fixed held-out windows). Runs of equal wall time on a shared
host do unequal work, so each pair is also compared at equal steps: the fault-free run keeps every
checkpoint its syncer writes (every 5 s, with the steps trained by then), and its loss at the
steps the chaos run's learners kept is interpolated between the two checkpoints around them. One
final checkpoint's loss moves by a few percent from one checkpoint to the next, so the steadier
figure is the tail: the mean loss of the chaos run's last TAIL_CHECKPOINTS checkpoints against the
mean of the fault-free curve at each of their step counts. Both runs keep their checkpoints; the
steps of one are the sum of the learners' own step counters in the syncer's roster, which the
syncer's checkpoint carries over its restart.

Targets (bench/RESULTS.md §8): the chaos run's eval loss within 3 % of the fault-free run's (at
equal steps), and the goodput of the surviving learner (c: network faults and the syncer's restart
only, never killed or stopped) at least 85 %.

Usage: python bench/chaos.py [--repeats 2] [--first-repeat 0] [--duration-s 150]
       [--out bench/results/chaos.json] [--keep DIR] [--learner-args '--answer arrival']
A benchmark: it measures and records, it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from devkit.chaos.harness import SURVIVOR, TAIL_CHECKPOINTS, ChaosPlan, ChaosReport, ChaosRun

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "chaos.json"


def row(report: ChaosReport) -> dict[str, Any]:
    return {
        **report.summary(),
        "seed": report.plan.seed,
        "duration_s": report.plan.duration_s,
        "faults_on": report.plan.faults,
        "learner_args": list(report.plan.learner_args),
        "learner_steps": {learner["id"]: learner["steps"] for learner in report.status.get("learners", [])},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs (fault-free, chaos)")
    parser.add_argument(
        "--first-repeat",
        type=int,
        default=0,
        help="number of the first pair: its schedule seed, and whether fault-free goes first (even)",
    )
    parser.add_argument("--duration-s", type=float, default=150.0, help="length of each run's schedule")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file the results go to")
    parser.add_argument("--keep", type=Path, default=None, help="keep the daemons' logs and state here")
    parser.add_argument(
        "--learner-args",
        default="",
        help="flags every learner of both runs gets, in one string (e.g. '--answer arrival')",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.duration_s < 60 or args.first_repeat < 0:
        parser.error("--repeats must be >= 1, --duration-s >= 60 and --first-repeat >= 0")
    repeats = range(args.first_repeat, args.first_repeat + args.repeats)

    def say(text: str) -> None:
        print(text, flush=True)

    runs: list[dict[str, Any]] = []
    reports: dict[tuple[int, bool], ChaosReport] = {}
    pairs = []
    with contextlib.ExitStack() as stack:
        root = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dilocod-chaos-")))
        for repeat in repeats:
            order = (False, True) if repeat % 2 == 0 else (True, False)
            for faults in order:
                name = f"{'chaos' if faults else 'fault-free'}-{repeat}"
                plan = ChaosPlan(
                    work=root / name,
                    duration_s=args.duration_s,
                    faults=faults,
                    seed=repeat,
                    keep_curve=True,
                    learner_args=tuple(shlex.split(args.learner_args)),
                )
                report = ChaosRun(plan).run()
                reports[repeat, faults] = report
                runs.append({"name": name, "repeat": repeat, **row(report)})
                goodput = " ".join(f"{k} {v:.1%}" for k, v in sorted(report.goodput.items()))
                say(
                    f"{name:<14} eval loss {report.eval_loss:.4f}  goodput {goodput}"
                    f"  faults {report.injected}"
                    f"  lost {len(report.lost)}  twice {len(report.double_applied)}"
                    f"  crashes {len(report.crashes)}  ({report.wall_s:.0f} s)"
                )
        # Inside the ExitStack: the fault-free runs' kept checkpoints are evaluated here.
        for repeat in repeats:
            clean, chaos = reports[repeat, False], reports[repeat, True]
            at_steps, how = clean.loss_at_steps(chaos.steps)
            tail_chaos, tail_clean = chaos.compare_tail(clean, TAIL_CHECKPOINTS)
            pairs.append(
                {
                    "repeat": repeat,
                    "eval_loss_fault_free": clean.eval_loss,
                    "eval_loss_chaos": chaos.eval_loss,
                    "eval_loss_ratio": round(chaos.eval_loss / clean.eval_loss, 4),
                    "steps_fault_free": clean.steps,
                    "steps_chaos": chaos.steps,
                    # The fault-free run's loss when it had trained as many steps as the chaos run
                    # kept: equal work, whatever else the host was doing during either run.
                    "eval_loss_fault_free_at_equal_steps": round(at_steps, 4),
                    "equal_steps_from": how,
                    "eval_loss_ratio_at_equal_steps": round(chaos.eval_loss / at_steps, 4),
                    # The steadier measure: the chaos run's last TAIL_CHECKPOINTS checkpoints
                    # against the fault-free curve at each one's steps, mean against mean.
                    "tail_checkpoints": TAIL_CHECKPOINTS,
                    "tail_steps_chaos": [steps for steps, _ in chaos.tail(TAIL_CHECKPOINTS)],
                    "tail_eval_loss_chaos": round(tail_chaos, 4),
                    "tail_eval_loss_fault_free_at_equal_steps": round(tail_clean, 4),
                    "tail_eval_loss_ratio_at_equal_steps": round(tail_chaos / tail_clean, 4),
                    "survivor_goodput": chaos.goodput[SURVIVOR],
                    "fault_free_goodput": min(clean.goodput.values()),
                }
            )
    document = {
        # Where the logs were kept is this machine's business, not the record's.
        "command": f"python bench/chaos.py --repeats {args.repeats} --duration-s {args.duration_s:g}"
        + (f" --first-repeat {args.first_repeat}" if args.first_repeat else "")
        + (" --keep DIR" if args.keep else ""),
        "duration_s": args.duration_s,
        "repeats": args.repeats,
        "pairs": pairs,
        "runs": runs,
        "mean_eval_loss_ratio": round(statistics.fmean(p["eval_loss_ratio"] for p in pairs), 4),
        "mean_eval_loss_ratio_at_equal_steps": round(
            statistics.fmean(p["eval_loss_ratio_at_equal_steps"] for p in pairs), 4
        ),
        "mean_tail_eval_loss_ratio_at_equal_steps": round(
            statistics.fmean(p["tail_eval_loss_ratio_at_equal_steps"] for p in pairs), 4
        ),
        "faults_injected": sum(r["faults_injected"] for r in runs),
        "lost_pushes": sum(r["lost_pushes"] for r in runs),
        "double_applied_pushes": sum(r["double_applied_pushes"] for r in runs),
        "crashes": sum(len(r["crashes"]) for r in runs),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1, default=str) + "\n")
    for pair in pairs:
        say(
            f"repeat {pair['repeat']}: eval loss {pair['eval_loss_chaos']:.4f} under chaos against "
            f"{pair['eval_loss_fault_free']:.4f} fault-free ({100 * (pair['eval_loss_ratio'] - 1):+.1f} %); "
            f"at equal steps ({pair['steps_chaos']} of {pair['steps_fault_free']}) "
            f"{pair['eval_loss_fault_free_at_equal_steps']:.4f} "
            f"({100 * (pair['eval_loss_ratio_at_equal_steps'] - 1):+.1f} %); "
            f"last {TAIL_CHECKPOINTS} checkpoints {pair['tail_eval_loss_chaos']:.4f} against "
            f"{pair['tail_eval_loss_fault_free_at_equal_steps']:.4f} "
            f"({100 * (pair['tail_eval_loss_ratio_at_equal_steps'] - 1):+.1f} %), "
            f"survivor goodput {pair['survivor_goodput']:.1%} (fault-free {pair['fault_free_goodput']:.1%})"
        )
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
