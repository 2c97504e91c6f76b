"""Goodput under chip failures, simulated: data-parallel, elastic data-parallel and Decoupled DiLoCo
on the same fleet (the model, its parameters and its closed forms: devkit/goodput.py). Prints a
table of goodput and uptime per fleet size, or the headline as JSON; --out records every figure.

Run from the repository root: ``python bench/goodput.py [--chips 1200000 --json] [--seeds 5]
[--days 60] [--sensitivity] [--out FILE]``. bench/RESULTS.md §6 records a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from devkit.goodput import (
    CHIP_COUNTS,
    DEFAULT_DAYS,
    DEFAULT_SEEDS,
    DEFAULT_SENSITIVITY_DAYS,
    LEARNER_COUNTS,
    PAPER_AT_1_2M,
    SECONDS_PER_DAY,
    Params,
    headline,
    run_fleet,
    run_sensitivity,
)


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}"


def _format_table(fleets: list[dict[str, Any]], learner_counts: Sequence[int]) -> str:
    cols = ["dp", "elastic_dp", *(f"decoupled_{m}" for m in learner_counts)]
    head = ["chips", "interruptions/h", "dp", "elastic dp", *(f"M={m}" for m in learner_counts)]
    lines = ["goodput %, mean ± std over seeds (closed form in brackets)", " | ".join(head)]
    for f in fleets:
        cf = f["closed_form"]
        cf_vals = {"dp": cf["dp"], "elastic_dp": cf["elastic_dp"]}
        cf_vals.update({f"decoupled_{m}": cf["decoupled"][str(m)] for m in learner_counts})
        cells = [f"{f['chips']:,}", f"{f['interruptions_per_hour']:.0f}"]
        for c in cols:
            g = f["schemes"][c]["goodput"]
            cells.append(f"{_pct(g['mean'])} ± {_pct(g['std'])} [{_pct(cf_vals[c])}]")
        lines.append(" | ".join(cells))
    lines.append("")
    lines.append("uptime %: dp running / elastic dp not paused / at least K islands live")
    for f in fleets:
        cells = [f"{f['chips']:,}"]
        cells += [_pct(f["schemes"][c]["uptime"]["mean"]) for c in cols]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def _format_sensitivity(rows: list[dict[str, Any]], chips: int, learner_counts: Sequence[int]) -> str:
    head = ["parameter", "value", "dp", "elastic dp", *(f"M={m}" for m in learner_counts)]
    lines = [f"sensitivity at {chips:,} chips, goodput % (one parameter changed at a time)", " | ".join(head)]
    for r in rows:
        g = r["goodput"]
        mark = " (default)" if r["is_default"] else ""
        cells = [r["parameter"], f"{r['value']:g}{mark}", _pct(g["dp"]), _pct(g["elastic_dp"])]
        cells += [_pct(g["decoupled"][str(m)]) for m in learner_counts]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    d = Params()
    ap = argparse.ArgumentParser(
        prog="python bench/goodput.py",
        description="Discrete-event simulation of training goodput under chip failures: "
        "data-parallel, elastic data-parallel and Decoupled DiLoCo (M = 2, 4, 8, 16).",
    )
    ap.add_argument(
        "--chips",
        type=_int_list,
        default=list(CHIP_COUNTS),
        help="fleet sizes, comma-separated (default: 150000,300000,600000,1200000,2400000)",
    )
    ap.add_argument("--json", action="store_true", help="print mean goodputs as JSON instead of the table")
    ap.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help=f"seeds per cell ({DEFAULT_SEEDS})")
    ap.add_argument("--days", type=float, default=DEFAULT_DAYS, help=f"simulated days ({DEFAULT_DAYS:g})")
    ap.add_argument("--learners", type=_int_list, default=list(LEARNER_COUNTS), help="M values (2,4,8,16)")
    ap.add_argument("--mtbi-days", type=float, default=d.mtbi_chip_s / SECONDS_PER_DAY, help="per-chip MTBI")
    ap.add_argument(
        "--domain-chips", type=int, default=d.failure_domain_chips, help="chips per interrupted host"
    )
    ap.add_argument("--group-chips", type=int, default=d.dp_group_chips, help="chips per DP group")
    ap.add_argument("--step-s", type=float, default=d.step_s, help="training step time")
    ap.add_argument("--sync-every", type=int, default=d.sync_every_steps, help="H (0: nothing lost)")
    ap.add_argument("--quorum", type=int, default=d.quorum_k, help="K, the minimum quorum of islands")
    ap.add_argument("--detect-s", type=float, default=d.detect_s, help="failure detection time")
    ap.add_argument("--restart-s", type=float, default=d.restart_s, help="job or island restart time")
    ap.add_argument("--ckpt-interval-s", type=float, default=d.ckpt_interval_s, help="DP snapshot interval")
    ap.add_argument("--reconfig-s", type=float, default=d.reconfig_s, help="elastic DP reconfiguration")
    ap.add_argument("--repair-s", type=float, default=d.group_repair_s, help="elastic DP group repair")
    ap.add_argument("--heal-s", type=float, default=d.heal_s, help="learner heal from the syncer")
    ap.add_argument(
        "--sensitivity", action="store_true", help="also vary the influential parameters one at a time"
    )
    ap.add_argument(
        "--sensitivity-chips", type=int, default=1_200_000, help="fleet size of the sensitivity runs"
    )
    ap.add_argument(
        "--sensitivity-days",
        type=float,
        default=DEFAULT_SENSITIVITY_DAYS,
        help=f"simulated days per sensitivity cell ({DEFAULT_SENSITIVITY_DAYS:g})",
    )
    ap.add_argument("--out", help="write every figure, the parameters and the timing to this JSON file")
    return ap


def params_from_args(args: argparse.Namespace) -> Params:
    return Params(
        mtbi_chip_s=args.mtbi_days * SECONDS_PER_DAY,
        failure_domain_chips=args.domain_chips,
        dp_group_chips=args.group_chips,
        step_s=args.step_s,
        sync_every_steps=args.sync_every,
        quorum_k=args.quorum,
        detect_s=args.detect_s,
        restart_s=args.restart_s,
        ckpt_interval_s=args.ckpt_interval_s,
        reconfig_s=args.reconfig_s,
        group_repair_s=args.repair_s,
        heal_s=args.heal_s,
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.days <= 0 or args.step_s <= 0 or args.ckpt_interval_s <= 0:
        ap.error("--seeds must be >= 1 and --days, --step-s, --ckpt-interval-s > 0")
    if args.domain_chips < 1 or args.group_chips < 1 or not 1 <= args.quorum <= min(args.learners):
        ap.error("--domain-chips and --group-chips must be >= 1, and 1 <= --quorum <= min(--learners)")
    p = params_from_args(args)
    started = time.perf_counter()
    fleets = [
        run_fleet(c, p, seeds=args.seeds, days=args.days, learner_counts=args.learners) for c in args.chips
    ]
    sensitivity = None
    if args.sensitivity:
        sensitivity = run_sensitivity(
            args.sensitivity_chips,
            p,
            seeds=args.seeds,
            days=args.sensitivity_days,
            learner_counts=args.learners,
        )
    elapsed_s = time.perf_counter() - started
    if args.json:
        heads = [headline(f, args.learners) for f in fleets]
        doc: Any = (
            heads[0] if len(heads) == 1 else {str(f["chips"]): h for f, h in zip(fleets, heads, strict=True)}
        )
        print(json.dumps(doc))
    else:
        print(_format_table(fleets, args.learners))
        if sensitivity is not None:
            print()
            print(_format_sensitivity(sensitivity, args.sensitivity_chips, args.learners))
            print(f"({args.seeds} seeds x {args.sensitivity_days:g} days per sensitivity cell)")
        print(f"\n{args.seeds} seeds x {args.days:g} days per cell, {elapsed_s:.1f} s")
    if args.out:
        record = {
            "command": "python bench/goodput.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "params": asdict(p),
            "seeds": args.seeds,
            "days": args.days,
            "sensitivity_days": args.sensitivity_days if args.sensitivity else None,
            "elapsed_s": elapsed_s,
            "paper_at_1_2m": PAPER_AT_1_2M,
            "fleets": fleets,
            "sensitivity": sensitivity,
        }
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=1)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
