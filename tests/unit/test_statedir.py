"""A daemon's hold on its state directory (dilocod.ops.statedir) and what a learner keeps there for
the syncer to know it by (its instance id, dilocod.learner.state)."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

import pytest

from dilocod.learner.state import INSTANCE_FILE, learner_instance, rank_state_dir
from dilocod.ops.statedir import StateDirError, StateDirInUse, hold_state_dir


def test_a_held_directory_refuses_a_second_holder_until_released(tmp_path: Path) -> None:
    state = tmp_path / "new" / "state"
    with ExitStack() as first:
        hold_state_dir(state, "x.lock", "learner", first)  # made if missing
        assert (state / "x.lock").read_text() == f"{os.getpid()}\n"
        with ExitStack() as second, pytest.raises(StateDirInUse) as refused:
            hold_state_dir(state, "x.lock", "learner", second)
        assert str(refused.value) == f"--state-dir {state} is in use by another learner (pid {os.getpid()})"
    with ExitStack() as again:
        hold_state_dir(state, "x.lock", "learner", again)


def test_a_directory_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with ExitStack() as stack, pytest.raises(StateDirError, match=f"--state-dir {blocker / 'state'}"):
        hold_state_dir(blocker / "state", "x.lock", "syncer", stack)


def test_the_instance_is_made_once_and_kept(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = learner_instance(state)
    assert len(first) == 32 and int(first, 16) >= 0
    assert learner_instance(state) == first  # a restart: the same learner
    assert learner_instance(tmp_path / "other") != first  # another learner's directory


@pytest.mark.parametrize("content", ["", "not hex", "ab" * 8, "zz" * 16])
def test_an_unreadable_instance_is_made_anew(tmp_path: Path, content: str) -> None:
    (tmp_path / INSTANCE_FILE).write_text(content)
    made = learner_instance(tmp_path)
    assert made != content.strip() and (tmp_path / INSTANCE_FILE).read_text() == made + "\n"


def test_each_rank_of_an_island_has_its_own_directory(tmp_path: Path) -> None:
    assert rank_state_dir(None, 3) is None
    assert rank_state_dir(tmp_path, None) == tmp_path
    assert rank_state_dir(tmp_path, 1) == tmp_path / "rank-1"
