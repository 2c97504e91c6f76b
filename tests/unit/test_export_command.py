"""`dilocod export` as a user runs it: into a folder that does not exist yet, saying which
checkpoint it wrote (sequence, fragment versions, when it was saved), and one line instead of a
traceback when the output cannot be written."""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dilocod.cli import main
from dilocod.syncer.checkpoint import SyncerState, export_newest, save_checkpoint


def _state(versions: list[int]) -> SyncerState:
    params = {"embed.weight": torch.arange(6.0).reshape(2, 3), "head.bias": torch.ones(3)}
    momentum = {name: torch.zeros_like(p) for name, p in params.items()}
    return SyncerState(params, momentum, versions, {"rounds_merged": 7})


def _two_checkpoints(state_dir: Path) -> None:
    save_checkpoint(state_dir, _state([1, 1, 0]))
    save_checkpoint(state_dir, _state([4, 2, 9]))


def test_export_creates_the_missing_folder_and_says_what_it_wrote(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path / "state")
    out = tmp_path / "exports" / "today" / "model.safetensors"

    result = CliRunner().invoke(main, ["export", "--state-dir", str(tmp_path / "state"), "--out", str(out)])

    assert result.exit_code == 0, result.output
    assert set(load_file(str(out))) == {"embed.weight", "head.bias"}
    assert "checkpoint 2" in result.output
    assert "fragment versions 2..9" in result.output and "sum 15" in result.output
    assert "saved " in result.output and str(out) in result.output


def test_export_newest_reports_the_checkpoint(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path / "state")
    exported = export_newest(tmp_path / "state", tmp_path / "new" / "model.safetensors")
    assert exported.sequence == 2
    assert exported.versions == (4, 2, 9)
    assert exported.saved_at_unix_s > 0
    assert exported.path.is_file()


def test_export_that_cannot_write_says_so_in_one_line(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path / "state")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")

    result = CliRunner().invoke(
        main, ["export", "--state-dir", str(tmp_path / "state"), "--out", str(blocker / "model.safetensors")]
    )

    assert result.exit_code == 1
    assert f"cannot write {blocker / 'model.safetensors'}" in result.output
    assert not isinstance(result.exception, OSError)  # handled, not a traceback
