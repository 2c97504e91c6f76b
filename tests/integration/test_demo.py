"""`dilocod demo` end to end with a small entry: a syncer and learners as real processes, live
progress, chaos that kills -9 and restarts learners while the rounds go on, and the global model's
eval loss against where it started."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.daemons import LEARNER_ENTRY, write_learner_entry

#: The demo runs for a fixed wall time; this covers the start, the evaluation and a 4x slower host.
DEADLINE_S = 420.0


def _demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    entry_dir = write_learner_entry(tmp_path / "entry")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(entry_dir), os.environ.get("PYTHONPATH", "")]),
        "LEARNER_TEST_STEP_S": "0.005",
    }
    command = [sys.executable, "-m", "dilocod", "demo", "--learners", "2", *args]
    command += ["--entry", LEARNER_ENTRY, "--state-dir", str(tmp_path / "demo")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S, env=env, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _eval_loss(out: str) -> tuple[float, float]:
    """The global model's eval loss at the end and before training, from the demo's last words."""
    found = re.search(r"^eval loss: ([\d.e+-]+) \(.*; ([\d.e+-]+) before training\)$", out, re.MULTILINE)
    assert found is not None, out
    return float(found.group(1)), float(found.group(2))


def test_demo_shows_progress_and_what_its_result_means(tmp_path: Path) -> None:
    """The Quick start's first command, short: progress per learner, the syncer's rounds and
    quorum in words, and the eval loss against where it started."""
    out = _demo(tmp_path, "--minutes", "0.2").stdout
    assert re.search(r"^learner-1\s+running\s+step\s+\d+", out, re.MULTILINE), out
    quorum = r"^syncer: \d+ rounds merged .*; quorum: (\d+ rounds? with \d learners?|no round merged yet)"
    assert re.search(quorum, out, re.MULTILINE), out
    loss, initial = _eval_loss(out)
    assert 0 < loss < initial


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_with_chaos_reports_the_eval_loss(tmp_path: Path) -> None:
    # 30 s of chaos after the first merged round: several kills (one every 6 s at most); the test
    # entry reaches an eval loss near 1e-5 within 20 s, so 0.5 still says training went on.
    plot = tmp_path / "loss.png"
    out = _demo(tmp_path, "--minutes", "0.5", "--chaos", "--chaos-every-s", "6", "--plot", str(plot)).stdout
    # Live progress: a line per learner and the syncer's rounds.
    assert re.search(r"^learner-0\s+running\s+step\s+\d+", out, re.MULTILINE), out
    assert re.search(r"^syncer: \d+ rounds merged \(\d+/min\)", out, re.MULTILINE), out
    # Chaos (from the first merged round on): learners killed and restarted, the rounds went on.
    assert out.count("chaos: kill -9") >= 2, out
    assert "training never stopped" in out, out
    loss, initial = _eval_loss(out)
    assert 0 < loss < 0.5 < initial  # the untrained model scores about 0.83 on this task
    # Without matplotlib the plot is skipped with a clear word; with it, the file exists.
    assert plot.exists() or "matplotlib is not installed" in out
    for name in ("syncer.log", "learner-0.log", "learner-1.log"):
        assert (tmp_path / "demo" / name).stat().st_size > 0
