"""How many of each learner's pushes are uploaded for nothing: a syncer and two learners of the
embedded model (defaults, loopback) for a while, then `dilocod status --json`: per learner the
push headers it sent and those the syncer did not merge (refused at the header, or released:
stale, superseded, zero weight, screened out). On a WAN each wasted push is upload bandwidth.

    python bench/wasted_pushes.py --seconds 120
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--learners", type=int, default=2)
    args = parser.parse_args()
    dilocod = [sys.executable, "-m", "dilocod"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="dilocod-wasted-") as tmp:
        work = Path(tmp)
        serve = ["--listen", "127.0.0.1:0", "--insecure", "--ready-json", "--state-dir", str(work / "s")]
        syncer = subprocess.Popen(
            [*dilocod, "syncer", *serve], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
        assert syncer.stdout is not None
        address = f"127.0.0.1:{json.loads(syncer.stdout.readline())['port']}"
        join = ["--syncer", address, "--insecure", "--device", "cpu"]
        learners = [
            subprocess.Popen(
                [*dilocod, "learner", *join, "--id", f"l{m}", "--state-dir", str(work / f"l{m}")],
                stderr=subprocess.DEVNULL,
                env=env,
            )
            for m in range(args.learners)
        ]
        time.sleep(args.seconds)  # the run's length, not a wait for an event
        status = json.loads(
            subprocess.run(
                [*dilocod, "status", "--syncer", address, "--insecure", "--json"],
                capture_output=True,
                check=True,
                text=True,
                timeout=60,
            ).stdout
        )
        for process in [*learners, syncer]:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    print(f"{args.seconds:g} s, {status['rounds_merged']} rounds merged")
    for learner in status["learners"]:
        pushes, wasted = learner["pushes"], learner["pushes_wasted"]
        share = wasted / pushes if pushes else 0.0
        print(f"{learner['id']}: {wasted} of {pushes} pushes wasted ({share:.1%})")
    print(f"rejected by reason: {status['rejected_by_reason']}")


if __name__ == "__main__":
    main()
