"""Checkpoints as real processes see them: a save killed at every fsync leaves nothing that loads
as a checkpoint, and a user's script that knows only safetensors, json and torch reads the newest
checkpoint without dilocod.

Each test spawns `python -c` children and waits for them to exit (with a timeout); nothing sleeps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dilocod.syncer.checkpoint import CHECKPOINTS_DIR, SyncerState, load_latest_checkpoint, save_checkpoint

#: Importing torch in a child on a busy 2-core machine takes seconds; this is far above that.
CHILD_TIMEOUT_S = 120.0

#: A save that kills its own process (exit 9) at the n-th fsync: a crash at that point.
CRASHING_SAVE = """
import os, sys
from pathlib import Path
import torch
from dilocod.syncer.checkpoint import SyncerState, save_checkpoint

crash_at, calls = int(sys.argv[2]), []
real_fsync = os.fsync

def fsync(fd):
    calls.append(fd)
    if len(calls) == crash_at:
        os._exit(9)
    real_fsync(fd)

os.fsync = fsync
params = {"w": torch.full((64, 64), 2.0, dtype=torch.bfloat16), "b": torch.full((64,), 2.0)}
momentum = {name: torch.zeros(p.shape) for name, p in params.items()}
save_checkpoint(Path(sys.argv[1]), SyncerState(params, momentum, [2, 2], {"crash_at": crash_at}))
"""

#: What a user would write: find the newest checkpoint by name, read it, print what it holds.
READ_WITHOUT_DILOCOD = """
import json, os, sys
import torch
from safetensors.torch import load_file

root = os.path.join(sys.argv[1], "checkpoints")
newest = os.path.join(root, max(n for n in os.listdir(root) if n.startswith("ckpt-")))
with open(os.path.join(newest, "state.json")) as f:
    state = json.load(f)
report = {"checkpoint": os.path.basename(newest), "versions": state["versions"], "meta": state["meta"],
          "param_names": state["param_names"]}
for key, file_name in (("params", "model.safetensors"), ("momentum", "momentum.safetensors")):
    tensors = load_file(os.path.join(newest, file_name))
    report[key] = {name: [str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).tolist()]
                   for name, t in tensors.items()}
report["dilocod_imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "dilocod")
print(json.dumps(report))
"""


def run_child(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )


def make_state(value: float, versions: list[int]) -> SyncerState:
    params = {
        "w": torch.full((64, 64), value, dtype=torch.bfloat16),
        "b": torch.arange(64, dtype=torch.float32) * value,
    }
    return SyncerState(params, {n: torch.ones(p.shape) for n, p in params.items()}, versions, {"v": value})


def described(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    return {
        name: [str(t.dtype), list(t.shape), t.reshape(-1).contiguous().view(torch.uint8).tolist()]
        for name, t in tensors.items()
    }


@pytest.mark.parametrize("crash_at", [1, 2, 3, 4, 5])
def test_a_crash_at_any_fsync_never_leaves_a_checkpoint_that_looks_complete(
    tmp_path: Path, crash_at: int
) -> None:
    """fsyncs of one save: model file, momentum file, state.json, the temporary directory, then
    (after the rename) the checkpoints directory. A crash before the rename leaves a temporary
    directory that loading ignores and the next save removes; after it, a whole checkpoint."""
    first = save_checkpoint(tmp_path, make_state(1.0, [1, 1]))
    child = run_child(CRASHING_SAVE, str(tmp_path), str(crash_at), cwd=tmp_path)
    assert child.returncode == 9, child.stderr
    root = tmp_path / CHECKPOINTS_DIR
    entries = sorted(p.name for p in root.iterdir())

    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.skipped == ()
    if crash_at < 5:
        assert entries[0].startswith(".tmp-ckpt-000000000002-") and entries[1:] == [first.name]
        assert (loaded.path, loaded.state.versions) == (first, [1, 1])
    else:
        assert entries == [first.name, "ckpt-000000000002"]
        assert (loaded.state.versions, loaded.state.meta) == ([2, 2], {"crash_at": 5})

    third = save_checkpoint(tmp_path, make_state(3.0, [3, 3]))
    assert third.name == ("ckpt-000000000002" if crash_at < 5 else "ckpt-000000000003")
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


def test_the_newest_checkpoint_loads_without_dilocod(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, make_state(1.0, [1, 0]))
    newest = make_state(-2.5, [4, 3])
    newest.params["w"][0, :3] = torch.tensor([float("nan"), -0.0, 1e-30])
    path = save_checkpoint(tmp_path, newest)

    child = run_child(READ_WITHOUT_DILOCOD, str(tmp_path), cwd=tmp_path)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    assert report["dilocod_imported"] == []
    assert report["checkpoint"] == path.name
    assert (report["versions"], report["meta"]) == ([4, 3], {"v": -2.5})
    assert report["param_names"] == ["w", "b"]
    assert report["params"] == described(newest.params)
    assert report["momentum"] == described(newest.momentum)
