"""A syncer and N learners of the embedded model as real processes on loopback, at their defaults
(insecure, CPU), for the benchmarks that watch such a run from outside (learner_memory.py,
wasted_pushes.py). Every process is stopped with SIGTERM on the way out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DILOCOD = [sys.executable, "-m", "dilocod"]


@dataclass
class LoopbackRun:
    syncer: subprocess.Popen[bytes]
    learners: list[subprocess.Popen[bytes]]
    address: str


@contextmanager
def syncer_and_learners(learners: int, learner_args: tuple[str, ...] = ()) -> Iterator[LoopbackRun]:
    """Learner m has --id lm (and learner_args); every state directory is in a temporary folder,
    removed at the end."""
    with tempfile.TemporaryDirectory(prefix="dilocod-bench-") as tmp:
        yield from _run(Path(tmp), learners, learner_args)


def _run(work: Path, learners: int, learner_args: tuple[str, ...]) -> Iterator[LoopbackRun]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    serve = ["--listen", "127.0.0.1:0", "--insecure", "--ready-json", "--state-dir", str(work / "s")]
    syncer = subprocess.Popen(
        [*DILOCOD, "syncer", *serve], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    started = [syncer]
    try:
        assert syncer.stdout is not None
        address = f"127.0.0.1:{json.loads(syncer.stdout.readline())['port']}"
        join = ["--syncer", address, "--insecure", "--device", "cpu"]
        for m in range(learners):
            command = [*DILOCOD, "learner", *join, "--id", f"l{m}", "--state-dir", str(work / f"l{m}")]
            command += learner_args
            started.insert(-1, subprocess.Popen(command, stderr=subprocess.DEVNULL, env=env))
        yield LoopbackRun(syncer, started[:-1], address)
    finally:
        for process in started:  # the learners first, then the syncer (it writes a checkpoint)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
