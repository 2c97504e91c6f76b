"""What a new user's mistakes in their own training code look like from `dilocod learner`, as a real
process: a state the next start could not load, and a step that returns the wrong thing, end in one
paragraph naming the problem and exit 78 (which systemd does not restart), within seconds and
before anything connects; a step that raises ends with the user's own traceback and exit 1. Every
wait is on the process's exit, with a deadline."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from devkit.daemons import DaemonProcess, start_learner, write_learner_entry

DEADLINE_S = 180.0
EX_CONFIG = 78

USER_ENTRY = """
import numpy as np
import torch
import dilocod


def _trainer(ctx, step, state_dict=None):
    torch.manual_seed(1234)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    load = (lambda state: None) if state_dict is not None else None
    return dilocod.Trainer(
        model=model, optimizer=optimizer, step=step, state_dict=state_dict, load_state_dict=load
    )


def numpy_rng(ctx):
    rng = np.random.default_rng(ctx.seed)
    return _trainer(ctx, lambda i: dilocod.StepResult(tokens=4, loss=float(rng.random())),
                    state_dict=lambda: {"cursor": 0, "rng": rng})


def returns_float(ctx):
    return _trainer(ctx, lambda i: 0.25)


def returns_tensor_loss(ctx):
    return _trainer(ctx, lambda i: dilocod.StepResult(tokens=4, loss=torch.tensor(0.25)))


def bad_batch(index):
    raise ValueError(f"batch {index} has no labels")


def raises(ctx):
    return _trainer(ctx, lambda i: bad_batch(i))
"""


@pytest.fixture
def entry_dir(tmp_path: Path) -> Path:
    directory = write_learner_entry(tmp_path / "entry")
    (directory / "user_errors_entry.py").write_text(USER_ENTRY)
    return directory


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _learner(tmp_path: Path, entry_dir: Path, name: str, *args: str) -> DaemonProcess:
    """A learner of entry user_errors_entry:NAME with nothing listening where its syncer should be:
    it trains on after a one-second wait for the first heal."""
    return start_learner(
        tmp_path,
        entry_dir,
        _free_port(),
        name.replace("_", "-"),
        "--entry",
        f"user_errors_entry:{name}",
        "--join-timeout-s",
        "1",
        *args,
    )


def _paragraph(learner: DaemonProcess) -> str:
    """The learner's own message: the stderr lines that are not JSON log records."""
    return "\n".join(
        line for line in learner.stderr().splitlines() if line.strip() and not line.startswith("{")
    )


def test_a_state_that_would_not_load_is_refused_at_startup(tmp_path: Path, entry_dir: Path) -> None:
    """It used to be saved after --steps 20 (exit 0) and refused at the next start (exit 78)."""
    state = tmp_path / "state"
    learner = _learner(tmp_path, entry_dir, "numpy_rng", "--state-dir", str(state), "--steps", "20")
    assert learner.process.wait(timeout=DEADLINE_S) == EX_CONFIG, learner.stderr()
    message = _paragraph(learner)
    assert message.startswith("dilocod learner: ") and "\n" not in message, message
    assert "Trainer.state_dict()['rng'] is a numpy.random._generator.Generator" in message
    assert "weights_only=True" in message
    assert not learner.log_events("healed") and not learner.log_events("no syncer yet")  # before the network
    assert not (state / "learner-state.pt").exists()


@pytest.mark.parametrize(
    ("name", "wanted"),
    [
        ("returns_float", "step(0) returned a float, not a dilocod.StepResult"),
        (
            "returns_tensor_loss",
            "step(0) reported loss=tensor(0.2500): a float or None (a tensor: report loss.item())",
        ),
    ],
)
def test_a_step_that_returns_the_wrong_type_is_an_entry_error(
    tmp_path: Path, entry_dir: Path, name: str, wanted: str
) -> None:
    learner = _learner(tmp_path, entry_dir, name)
    assert learner.process.wait(timeout=DEADLINE_S) == EX_CONFIG, learner.stderr()
    message = _paragraph(learner)
    assert (
        message.startswith(f"dilocod learner: --entry 'user_errors_entry:{name}': ") and "\n" not in message
    )
    assert wanted in message, message
    assert "Traceback" not in learner.stderr()


def test_a_step_that_raises_shows_the_users_traceback_only(tmp_path: Path, entry_dir: Path) -> None:
    learner = _learner(tmp_path, entry_dir, "raises")
    assert learner.process.wait(timeout=DEADLINE_S) == 1, learner.stderr()
    lines = _paragraph(learner).splitlines()
    assert lines[0] == (
        "dilocod learner: --entry 'user_errors_entry:raises': step(0) raised ValueError: batch 0 has "
        "no labels (its traceback follows)"
    )
    assert lines[1] == "Traceback (most recent call last):"
    frames = [line.strip() for line in lines[2:] if line.strip().startswith("File ")]
    assert frames and all("user_errors_entry.py" in frame for frame in frames), lines
    assert lines[-1] == "ValueError: batch 0 has no labels"
