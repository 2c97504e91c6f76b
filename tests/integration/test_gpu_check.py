"""bench/gpu_check.py, the GPU host's check, run on the CPU with a tiny model: its three parts run
(the entry alone, the device path's copies, a real syncer and learner with host and with device
anchors) and it prints the one JSON a GPU host's run records. The figures themselves are a GPU's
(bench/RESULTS.md); this keeps the script working where no GPU is. `make test-slow`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_check_runs_its_parts_and_prints_one_json(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    command = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--layers", "2"]
    command += ["--width", "256", "--batch", "32", "--steps", "24", "--anchors", "device", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == report
    assert report["parameters"] == 2 * 256 * 256
    assert report["alone"]["period_ms"]["n"] >= 10
    assert report["copies"]["fragments"] == 24
    assert report["copies"]["snapshot"]["on_training_stream_ms"]["n"] == 24
    # One run with dilocod (on the CPU, device anchors are host memory: both runs would be one).
    run = report["dilocod_device"]
    assert run["exit"] == 0, run
    assert "--anchors device" in run["command"]
    assert run["rounds_merged"] >= 1 and run["period_ms"]["n"] >= 10, run
    assert run["peak_rss_kib"]["learner_kib"] > 0 and "overhead" in run
