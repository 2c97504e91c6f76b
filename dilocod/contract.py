"""The entry contract between dilocod and the user's training code (docs/design.md §6).

A user writes a factory `make_trainer(ctx: LearnerContext) -> Trainer` and names it with --entry
(module:attr) or as an entry point in the group `dilocod.trainers`. The learner calls it once per
process (once per rank in an island); the syncer calls it once on the CPU with role "syncer" to get
the model's initial parameters and names. Plain dataclasses, so this module imports nothing heavy:
`import dilocod` stays cheap, and the types only mention torch in annotations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Role = Literal["learner", "syncer"]


@dataclass(frozen=True, slots=True)
class LearnerContext:
    """What the factory is told about where it runs."""

    learner_id: str
    #: "syncer" when the syncer builds the model for its parameters: no data or optimizer needed.
    role: Role
    #: A torch device string: "cuda:0", "cpu", ...
    device: str
    #: Rank and size of this learner's island (torchrun); 0 and 1 for a single process.
    rank: int
    world_size: int
    #: Where the user's code may keep its own files (data cursors, caches); None if not given.
    state_dir: Path | None
    #: Seed for anything the user's code randomises (differs per learner, same on every rank).
    seed: int


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one inner step reports: the tokens it trained on (an int >= 0), and its loss for progress
    (a Python float, e.g. loss.item(), or None; not a tensor). Checked as each step returns."""

    tokens: int
    loss: float | None = None


@dataclass(frozen=True, slots=True)
class Trainer:
    """The user's training, as dilocod drives it.

    model: the torch.nn.Module whose parameters are synced. optimizer: the inner optimizer (saved
    and restored with the learner's state). step(step_index) runs one inner step and returns a
    StepResult. state_dict / load_state_dict, when given, save and restore the user's own state
    (e.g. a data cursor) with the learner's checkpoints. That state must load back with
    torch.load(weights_only=True): tensors and plain values (no numpy generators, arrays or
    scalars); with a state directory the learner checks it at startup and before every save.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    step: Callable[[int], StepResult]
    state_dict: Callable[[], Mapping[str, Any]] | None = None
    load_state_dict: Callable[[Mapping[str, Any]], None] | None = None
