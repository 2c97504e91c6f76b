"""The learner entry of the equivalence tests: a small deterministic MLP trained by plain torch SGD
on batches drawn from the learner's seed (ctx.seed), and the same model and batches for the
references (devkit/diloco_reference.py) to train in the test's own process.

The test copies this file into the directory it puts on the children's PYTHONPATH, the way a
user's package is installed. Two environment variables, read by the factory, shape a learner:
- EQUIVALENCE_STEP_S: seconds each step sleeps after its update (simulated compute: a learner
  three times slower than the other gets three times this);
- EQUIVALENCE_GO_FIFO: a FIFO the first step reads one byte from before it trains, so that no
  learner steps before every learner has joined and healed (the test holds the FIFO open and
  writes the byte once the syncer counts both live).
Nothing here depends on dilocod's maths: only the entry contract (Trainer, StepResult).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

import dilocod

STEP_S_ENV = "EQUIVALENCE_STEP_S"
GO_FIFO_ENV = "EQUIVALENCE_GO_FIFO"
MODEL_SEED = 0
TARGET_SEED = 7
BATCH_SIZE = 16
INNER_LR = 0.05


def make_model() -> nn.Module:
    torch.manual_seed(MODEL_SEED)  # every process builds the same initial model
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of a fixed regression task: y = sin(x·A), x drawn from the learner's generator."""
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(TARGET_SEED))
    x = torch.randn(BATCH_SIZE, 8, generator=generator)
    return x, torch.sin(x @ target)


def _wait_for_go(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, 1)  # blocks until the test writes (or closes its end)
    finally:
        os.close(fd)


def make_trainer(ctx: dilocod.LearnerContext) -> dilocod.Trainer:
    torch.set_num_threads(1)  # the same kernels in every process, the test's included
    model = make_model()
    if ctx.role == "syncer":
        return dilocod.Trainer(model=model, optimizer=None, step=lambda index: dilocod.StepResult(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    generator = torch.Generator().manual_seed(ctx.seed)
    step_s = float(os.environ.get(STEP_S_ENV, "0"))
    go = os.environ.get(GO_FIFO_ENV)

    def step(index: int) -> dilocod.StepResult:
        if index == 0 and go:
            _wait_for_go(go)
        x, y = batch(generator)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step_s:
            time.sleep(step_s)
        return dilocod.StepResult(tokens=BATCH_SIZE, loss=float(loss.detach()))

    return dilocod.Trainer(model=model, optimizer=optimizer, step=step)
