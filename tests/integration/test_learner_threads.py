"""torch's intra-op threads in a real `dilocod learner`: chosen to leave a core to the network
process, and logged with the reason; an explicit OMP_NUM_THREADS, or the entry's own
torch.set_num_threads, is kept. The training thread's count is read from the state the learner
saves (the entry's state_dict records it). Every wait is on the process's exit, with a deadline."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from devkit.daemons import DaemonProcess, start_learner, write_learner_entry

DEADLINE_S = 180.0

THREADS_ENTRY = """
import torch
import dilocod


def _trainer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return dilocod.Trainer(
        model=model,
        optimizer=optimizer,
        step=lambda i: dilocod.StepResult(tokens=1),
        state_dict=lambda: {"threads": torch.get_num_threads()},
        load_state_dict=lambda state: None,
    )


def make_trainer(ctx):
    return _trainer()


def sets_its_own(ctx):
    torch.set_num_threads(3)
    return _trainer()
"""


@pytest.fixture
def entry_dir(tmp_path: Path) -> Path:
    directory = write_learner_entry(tmp_path / "entry")
    (directory / "threads_entry.py").write_text(THREADS_ENTRY)
    return directory


def _run(tmp_path: Path, entry_dir: Path, name: str, factory: str) -> tuple[DaemonProcess, int]:
    """A learner of a few steps with nothing listening where its syncer should be; the threads its
    training thread had when it saved."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    state = tmp_path / name
    learner = start_learner(
        tmp_path,
        entry_dir,
        port,
        name,
        "--entry",
        f"threads_entry:{factory}",
        "--steps",
        "3",
        "--join-timeout-s",
        "0.5",
        "--state-dir",
        str(state),
    )
    assert learner.process.wait(timeout=DEADLINE_S) == 0, learner.stderr()
    saved = torch.load(state / "learner-state.pt", weights_only=True)
    return learner, saved["user"]["threads"]


def test_a_core_is_left_to_the_network_process(
    tmp_path: Path, entry_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    learner, threads = _run(tmp_path, entry_dir, "chosen", "make_trainer")
    (record,) = learner.log_events("torch threads chosen")
    cores = len(os.sched_getaffinity(0))
    assert record["threads"] == threads and 1 <= threads <= max(1, cores - 1)
    assert f"{cores} cores available" in record["reason"]
    if cores > 1:
        assert "1 for the network process" in record["reason"]


def test_omp_num_threads_is_kept(tmp_path: Path, entry_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    learner, threads = _run(tmp_path, entry_dir, "omp", "make_trainer")
    (record,) = learner.log_events("torch threads kept")
    assert threads == record["threads"] == 2 and "OMP_NUM_THREADS=2" in record["reason"]


def test_the_entrys_own_choice_is_kept(
    tmp_path: Path, entry_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    learner, threads = _run(tmp_path, entry_dir, "own", "sets_its_own")
    (record,) = learner.log_events("torch threads kept")
    assert threads == record["threads"] == 3 and "torch.set_num_threads(3)" in record["reason"]
