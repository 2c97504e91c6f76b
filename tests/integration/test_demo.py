"""`dilocod demo` end to end with a small entry: a syncer and learners as real processes, chaos
that kills -9 and restarts learners while the rounds go on, and the global model's eval loss."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .syncer_process import LEARNER_ENTRY, write_learner_entry

DEADLINE_S = 240.0


@pytest.mark.slow
def test_demo_with_chaos_reports_the_eval_loss(tmp_path: Path) -> None:
    entry_dir = write_learner_entry(tmp_path / "entry")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(entry_dir), os.environ.get("PYTHONPATH", "")]),
        "LEARNER_TEST_STEP_S": "0.005",
    }
    command = [sys.executable, "-m", "dilocod", "demo", "--learners", "2", "--minutes", "0.5", "--chaos"]
    command += ["--chaos-every-s", "8", "--entry", LEARNER_ENTRY, "--state-dir", str(tmp_path / "demo")]
    command += ["--plot", str(tmp_path / "loss.png")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S, env=env, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    # Live progress: a line per learner and the syncer's rounds.
    assert re.search(r"^learner-0\s+running\s+step\s+\d+", out, re.MULTILINE), out
    assert re.search(r"^syncer: \d+ rounds merged \(\d+/min\)", out, re.MULTILINE), out
    # Chaos: learners killed and restarted, and the rounds went on meanwhile.
    assert out.count("chaos: kill -9") >= 2
    assert "training never stopped" in out
    found = re.search(r"^eval loss: ([\d.e+-]+) \(.*; ([\d.e+-]+) before training\)$", out, re.MULTILINE)
    assert found is not None, out
    loss, initial = float(found.group(1)), float(found.group(2))
    assert loss < initial
    assert 0 < loss < 0.5  # the untrained model scores about 0.83 on this task
    # Without matplotlib the plot is skipped with a clear word; with it, the file exists.
    assert (tmp_path / "loss.png").exists() or "matplotlib is not installed" in out
    for name in ("syncer.log", "learner-0.log", "learner-1.log"):
        assert (tmp_path / "demo" / name).stat().st_size > 0
