"""A daemon's hold on its state directory (dilocod.ops.statedir) and what a learner keeps there for
the syncer to know it by (its instance id, dilocod.learner.state), and what a disk can do to both:
a FIFO, a directory or a huge file in a file's place, a read-only mount, a full file system."""

from __future__ import annotations

import fcntl
import os
from contextlib import ExitStack
from pathlib import Path

import pytest

from devkit.mounts import FILLER, fill, read_only_bind, small_tmpfs
from dilocod.learner.state import INSTANCE_FILE, LocalStateError, learner_instance, rank_state_dir
from dilocod.ops.statedir import (
    MAX_PID_BYTES,
    PROBE_FILE,
    StateDirError,
    StateDirInUse,
    hold_state_dir,
    probe_writes,
)


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


# --- what a disk can do ---------------------------------------------------------------------------


@pytest.mark.timeout(60)  # a plain open of a FIFO would wait for a writer
@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_a_lock_file_that_is_not_a_regular_file_is_named(tmp_path: Path, kind: str) -> None:
    if kind == "FIFO":
        os.mkfifo(tmp_path / "x.lock")
    else:
        (tmp_path / "x.lock").mkdir()
    with ExitStack() as stack, pytest.raises(StateDirError, match=f"--state-dir {tmp_path}: "):
        hold_state_dir(tmp_path, "x.lock", "learner", stack)


def test_a_huge_lock_file_is_read_only_as_far_as_a_pid(tmp_path: Path) -> None:
    (tmp_path / "x.lock").write_bytes(b"7" * (10 * MAX_PID_BYTES))
    with ExitStack() as first:
        fd = os.open(tmp_path / "x.lock", os.O_RDWR)
        first.callback(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_EX)  # another holder that wrote no pid of its own
        with ExitStack() as second, pytest.raises(StateDirInUse) as refused:
            hold_state_dir(tmp_path, "x.lock", "syncer", second)
    assert str(refused.value).endswith(f"(pid {'7' * MAX_PID_BYTES})")


def test_a_path_that_is_a_file_is_named_as_such(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("")
    with ExitStack() as stack, pytest.raises(StateDirError, match="exists and is not a directory"):
        hold_state_dir(tmp_path / "state", "x.lock", "syncer", stack)


def test_a_read_only_directory_is_found_by_the_write_probe(tmp_path: Path) -> None:
    """Root writes through chmod 0o555; not through a read-only mount."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "x.lock").write_text("")
    with read_only_bind(tmp_path / "state") as state, ExitStack() as stack:
        # The lock file is opened for writing: on a read-only file system that already fails.
        with pytest.raises(StateDirError, match="Read-only file system"):
            hold_state_dir(state, "x.lock", "learner", stack)
        with pytest.raises(StateDirError, match="a test write failed: Read-only file system"):
            probe_writes(state)


def test_a_full_disk_is_a_warning_at_start_and_the_lock_still_holds(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", 256 * 1024) as disk:
        fill(disk)
        with ExitStack() as stack:
            hold_state_dir(disk, "x.lock", "learner", stack)  # no room for the pid: held anyway
            assert probe_writes(disk) == f"--state-dir {disk}: a test write failed: No space left on device"
            with ExitStack() as second, pytest.raises(StateDirInUse, match="pid unknown"):
                hold_state_dir(disk, "x.lock", "learner", second)
        assert not (disk / PROBE_FILE).exists()


def test_the_write_probe_leaves_nothing(tmp_path: Path) -> None:
    assert probe_writes(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)  # a plain open of a FIFO would wait for a writer
@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_an_instance_that_is_not_a_regular_file_is_named(tmp_path: Path, kind: str) -> None:
    if kind == "FIFO":
        os.mkfifo(tmp_path / INSTANCE_FILE)
    else:
        (tmp_path / INSTANCE_FILE).mkdir()
    with pytest.raises(LocalStateError, match=f"{INSTANCE_FILE} is a {kind}, not a file: move it away"):
        learner_instance(tmp_path)


def test_a_huge_instance_file_is_not_read_whole_and_is_made_anew(tmp_path: Path) -> None:
    (tmp_path / INSTANCE_FILE).write_text("ab" * 16 + " " * 1000)
    made = learner_instance(tmp_path)
    assert made != "ab" * 16 and (tmp_path / INSTANCE_FILE).read_text() == made + "\n"


def test_on_a_full_disk_the_instance_is_used_unsaved(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", 256 * 1024) as disk:
        fill(disk)
        made = learner_instance(disk)
        assert len(made) == 32 and not (disk / INSTANCE_FILE).exists()
        assert [p.name for p in disk.iterdir()] == [FILLER]
