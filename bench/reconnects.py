"""Reconnects behind a flaky relay: how many of the learners' pushes still get through, and what each
rejoin costs.

A syncer and two learners (the chaos harness's settings: 4 fragments, H = 8, K = 1) on loopback,
training charlm (fragments of one chunk), or with --layers N the scale entry's stack of N
Linear(4096, 4096) layers (67 MB each: fragments of 16 chunks per layer) stepping every --step-s;
each learner behind the chaos fault proxy (devkit/chaos/proxy.py) in its relay mode: from the moment
both learners are live, every frame either way has a chance of being cut halfway (its connection
closes there) and every chunk a chance of a flipped byte, for the run's length. The same run
without faults comes first, as the reference.

Recorded per run (from the proxy's count of frames and its ledger of acknowledgements, and the
daemons' logs): the requests the syncer sent, the pushes the learners started, the pushes the
syncer acknowledged (whole and verified) and the NOTHING_TO_PUSH answers; "through" is acknowledged
pushes plus NOTHING_TO_PUSH over requests. Then the sessions each learner joined, and what the
syncer sent each session before it joined (its "learner healed" lines): bytes against the model's,
so a rejoin that re-sends the whole model shows as 1.0, and the chunks of updates cut short that a
rejoin did not need sent again (the syncer's chunks_resumed).

Target (issue 23): with 0.5 % of frames cut and 5 % of chunks corrupted, >= 80 % of pushes get
through, and a rejoin to the same syncer sends only the fragments that moved.

Usage: python bench/reconnects.py [--seconds 90] [--cut 0.005] [--corrupt 0.05] [--seed 0]
       [--layers 0] [--step-s 0.25] [--out bench/results/reconnects.json] [--keep DIR]
A benchmark: it measures and records, it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from devkit.chaos.harness import ChaosPlan, ChaosReport, ChaosRun
from devkit.chaos.proxy import RelayFaults

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "reconnects.json"

LEARNERS = ("a", "b")
SCALE_ENTRY = "dilocod.examples.scale:make_trainer"


def model_bytes(layers: int) -> int:
    """The float32 bytes of the model trained, as a heal carries them."""
    if layers:
        from dilocod.examples.scale import WIDTH

        return layers * WIDTH * WIDTH * 4
    from dilocod.examples.charlm.model import CharLM, CharLMConfig

    model = CharLM(CharLMConfig())
    return sum(p.numel() * 4 for p in model.parameters())


def row(report: ChaosReport, whole_model: int) -> dict[str, Any]:
    frames = report.frames

    def total(kind: str) -> int:
        """Frames of this kind, "UP" (learner to syncer) or "DOWN" and the type, of both learners."""
        return sum(frames.get(f"{name} {kind}", 0) for name in LEARNERS)

    requests = total("DOWN FRAGMENT_REQUEST")
    acked = report.pushes.get("acked", 0)
    passes = total("UP NOTHING_TO_PUSH")
    heals = report.heals
    return {
        "requests": requests,
        "push_headers": total("UP PUSH_HEADER"),
        "pushes_acked": acked,
        "pushes_refused": report.pushes.get("refused", 0),
        "nothing_to_push": passes,
        "through": round((acked + passes) / requests, 4) if requests else None,
        "joins": report.joins,
        "heals": len(heals),
        "heal_bytes": sum(h["bytes"] for h in heals),
        "heal_share_of_model": [round(h["bytes"] / whole_model, 3) for h in heals],
        "rejoin_bytes_mean_share": (
            round(
                sum(h["bytes"] for h in heals[len(LEARNERS) :])
                / (whole_model * (len(heals) - len(LEARNERS))),
                3,
            )
            if len(heals) > len(LEARNERS)
            else None
        ),
        "updates_acked": report.updates_acked,
        # Damaged chunks asked for again: of pushes (by the syncer), of updates (by the learners).
        "push_chunks_asked_again": total("DOWN CHUNK_RESEND"),
        "update_chunks_asked_again": total("UP CHUNK_RESEND"),
        "updates_refused": report.updates_refused,
        # Chunks of updates a lost session cut short that the rejoining learner held: not sent again.
        "update_chunks_resumed": report.status.get("chunks_resumed"),
        "faults_injected": report.proxy_injected,
        "rounds_merged": report.rounds_merged,
        "crashes": report.crashes,
        "lost_pushes": len(report.lost),
        "double_applied_pushes": len(report.double_applied),
        "eval_loss": round(report.eval_loss, 4),
        "steps": report.steps,
        "wall_s": round(report.wall_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="length of each run")
    parser.add_argument("--cut", type=float, default=0.005, help="chance that a frame's connection is cut")
    parser.add_argument("--corrupt", type=float, default=0.05, help="chance that a chunk is corrupted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=0, help="train the scale entry's N layers (0: charlm)")
    parser.add_argument("--step-s", type=float, default=0.25, help="the scale entry's step time")
    parser.add_argument("--no-reference", action="store_true", help="skip the fault-free run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file the results go to")
    parser.add_argument("--keep", type=Path, default=None, help="keep the daemons' logs and state here")
    args = parser.parse_args(argv)

    whole = model_bytes(args.layers)
    env: tuple[tuple[str, str], ...] = ()
    if args.layers:
        env = (("DILOCOD_SCALE_LAYERS", str(args.layers)), ("DILOCOD_SCALE_STEP_S", str(args.step_s)))
        os.environ.update(dict(env))  # the analysis builds the same model to check what is held
    relay = RelayFaults(cut_per_frame=args.cut, corrupt_per_chunk=args.corrupt, seed=args.seed)
    runs = [("relay", relay)] if args.no_reference else [("fault-free", None), ("relay", relay)]
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        root = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="reconnects-")))
        for label, faults in runs:
            plan = ChaosPlan(
                work=root / label,
                duration_s=args.seconds,
                faults=False,
                seed=args.seed,
                learners=LEARNERS,
                relay=faults,
                entry=SCALE_ENTRY if args.layers else "",
                env=env,
            )
            report = ChaosRun(plan).run()
            results[label] = row(report, whole)
            print(label, json.dumps(results[label]), flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False
    ).stdout.strip()
    record = {
        "command": "python bench/reconnects.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit,
        "model": f"scale, {args.layers} layers, step {args.step_s} s" if args.layers else "charlm",
        "model_bytes": whole,
        "cut_per_frame": args.cut,
        "corrupt_per_chunk": args.corrupt,
        "seconds": args.seconds,
        "runs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
