"""How many of each learner's pushes are uploaded for nothing: a syncer and two learners of the
embedded model (defaults, loopback) for a while, then `dilocod status --json`: per learner the
push headers it sent and those the syncer did not merge (refused at the header, or released:
stale, superseded, zero weight, screened out), and the requests answered with NOTHING_TO_PUSH (a
fragment with no step since its last push). On a WAN each wasted push is upload bandwidth.

    python bench/wasted_pushes.py --seconds 120 [--apply keep-local]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

from devkit.loopback import DILOCOD, syncer_and_learners


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--apply", default="overwrite", help="the learners' --apply")
    args = parser.parse_args()
    with syncer_and_learners(args.learners, ("--apply", args.apply)) as run:
        time.sleep(args.seconds)  # the run's length, not a wait for an event
        status = json.loads(
            subprocess.run(
                [*DILOCOD, "status", "--syncer", run.address, "--insecure", "--json"],
                capture_output=True,
                check=True,
                text=True,
                timeout=60,
            ).stdout
        )
    print(f"{args.seconds:g} s, --apply {args.apply}, {status['rounds_merged']} rounds merged")
    for learner in status["learners"]:
        pushes, wasted = learner["pushes"], learner["pushes_wasted"]
        share = wasted / pushes if pushes else 0.0
        passes = learner.get("passes", 0)
        print(f"{learner['id']}: {wasted} of {pushes} pushes wasted ({share:.1%}), {passes} nothing to push")
    print(f"rejected by reason: {status['rejected_by_reason']}")


if __name__ == "__main__":
    main()
