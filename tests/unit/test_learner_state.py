"""The learner's local state file (dilocod.learner.state): what torch.load(weights_only=True) would
refuse at the next start is refused before it is written, naming the key and the type, so that a
learner never saves a file that it then cannot load; a write the disk fails keeps the previous file
whole; a FIFO or a directory in the file's place is named, never waited on."""

from __future__ import annotations

import collections
import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from devkit.mounts import FILLER, fill, small_tmpfs
from dilocod.learner.state import (
    STATE_FILE,
    LocalStateError,
    LocalStateNotSaved,
    check_loadable,
    load_local_state,
    save_local_state,
)


def _state(user: Any) -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "user": user,
        "step": 4,
        "incarnation": "abc",
    }


@pytest.mark.parametrize(
    "user",
    [
        None,
        {"cursor": 3, "order": torch.arange(3), "name": "shard-7", "seen": {1, 2}},
        {"nested": [{"a": (1, 2.5, None, b"x")}], "od": collections.OrderedDict(k=torch.ones(2))},
        # What a numpy Generator's state reduces to is plain values: the suggested fix loads.
        {"rng": np.random.default_rng(0).bit_generator.state},
    ],
)
def test_tensors_and_plain_values_pass_and_round_trip(tmp_path: Path, user: Any) -> None:
    state = _state(user)
    check_loadable(state)
    save_local_state(tmp_path, state)
    assert load_local_state(tmp_path) is not None


@pytest.mark.parametrize(
    ("user", "where", "kind"),
    [
        pytest.param(
            {"rng": np.random.default_rng(0)},
            "['rng']",
            "numpy.random._generator.Generator",
            id="np-generator",
        ),
        pytest.param({"cursor": np.int64(3)}, "['cursor']", "numpy.int64", id="np-int64"),
        pytest.param({"a": [1, {"b": np.zeros(2)}]}, "['a'][1]['b']", "numpy.ndarray", id="nested-ndarray"),
        pytest.param(
            {"c": collections.defaultdict(int)}, "['c']", "collections.defaultdict", id="defaultdict"
        ),
        pytest.param({"r": range(3)}, "['r']", "range", id="range"),
    ],
)
def test_what_would_be_refused_at_load_is_refused_before_saving(
    tmp_path: Path, user: Any, where: str, kind: str
) -> None:
    state = _state(user)
    # The check agrees with the load: written anyway, such a file is refused when read back.
    torch.save({"format": "dilocod-learner-state/1", **state}, tmp_path / STATE_FILE)
    with pytest.raises(LocalStateError, match="is refused"):
        load_local_state(tmp_path)
    (tmp_path / STATE_FILE).unlink()
    with pytest.raises(LocalStateError) as caught:
        check_loadable(state)
    message = str(caught.value)
    assert f"Trainer.state_dict(){where}" in message and kind in message, message
    assert "\n" not in message  # one paragraph
    # Mutation caught: save_local_state writing without the check (the next start exits 78).
    with pytest.raises(LocalStateError):
        save_local_state(tmp_path, state)
    assert not (tmp_path / STATE_FILE).exists()


def test_a_value_torch_save_cannot_write_is_named(tmp_path: Path) -> None:
    state = _state({"callback": lambda: None})
    with pytest.raises(LocalStateError, match=r"Trainer.state_dict\(\)\['callback'\] is a function"):
        check_loadable(state)


def test_a_good_file_is_not_replaced_by_a_bad_state(tmp_path: Path) -> None:
    save_local_state(tmp_path, _state({"cursor": 1}))
    with pytest.raises(LocalStateError):
        save_local_state(tmp_path, _state({"cursor": np.int64(2)}))
    loaded = load_local_state(tmp_path)
    assert loaded is not None and loaded["user"] == {"cursor": 1}


def test_tensors_are_not_serialised_by_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check pickles the state's structure, not its tensors: a model's worth of parameters
    (on its device) costs no copy."""
    state = _state({"cursor": 1, "order": torch.arange(3)})

    def refuse(self: torch.Tensor, protocol: int) -> Any:
        raise AssertionError("a tensor was serialised by the check")

    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", refuse)
    check_loadable(state)


# --- what a disk can do ---------------------------------------------------------------------------


def _saved_step(state_dir: Path) -> int:
    loaded = load_local_state(state_dir)
    assert loaded is not None
    return int(loaded["step"])


def test_a_full_disk_keeps_the_previous_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    """A real full tmpfs: torch.save reports the failed write as a RuntimeError about stream
    positions; the save names the cause (no space left), keeps the previous file whole, and the
    next save after space is freed succeeds."""
    with small_tmpfs(tmp_path / "disk", 1024 * 1024) as disk:
        save_local_state(disk, _state({"cursor": 1}))
        filler = fill(disk)
        later = _state({"cursor": 2})
        later["step"] = 9
        with pytest.raises(LocalStateNotSaved, match=r"No space left on device.*the previous file is kept"):
            save_local_state(disk, later)
        assert _saved_step(disk) == 4
        assert sorted(p.name for p in disk.iterdir()) == sorted([FILLER, STATE_FILE])
        filler.unlink()
        save_local_state(disk, later)
        assert _saved_step(disk) == 9


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_write_the_disk_fails_is_not_saved_and_the_old_file_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    save_local_state(tmp_path, _state({"cursor": 1}))

    def broken(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, failing, broken)
    with pytest.raises(LocalStateNotSaved, match="Input/output error"):
        save_local_state(tmp_path, _state({"cursor": 2}))
    monkeypatch.undo()
    loaded = load_local_state(tmp_path)
    assert loaded is not None and loaded["user"] == {"cursor": 1}
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]


# A plain open of a FIFO waits for a writer: without the non-blocking open this test hangs, and
# the timeout turns that into a failure.
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_a_state_file_that_is_not_a_regular_file_is_named_without_blocking(tmp_path: Path, kind: str) -> None:
    if kind == "FIFO":
        os.mkfifo(tmp_path / STATE_FILE)
    else:
        (tmp_path / STATE_FILE).mkdir()
    with pytest.raises(LocalStateError, match=f"{STATE_FILE} is a {kind}, not a file; move it away"):
        load_local_state(tmp_path)
