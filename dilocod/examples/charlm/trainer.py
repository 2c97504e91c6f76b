"""charlm as a dilocod entry: make_trainer(ctx) for both roles, and evaluate(model) on held-out text.

`dilocod.examples.charlm:make_trainer` is the embedded default entry. The syncer (role "syncer")
gets the model alone, without reading any data. A learner gets the model on ctx.device, AdamW,
and a step that trains on one batch of its shard: shard ctx.seed % shards, so `dilocod demo`
(which passes --seed m to learner m) gives learners 0..shards-1 disjoint data. Learners whose seeds
share a shard still draw different windows (the stream is seeded by the seed itself), and ranks of
an island draw different windows from their learner's shard.

For other shapes or hyperparameters, call build_trainer with a CharLMConfig and a TrainConfig
(e.g. data-parallel with shards=1 and a larger batch), and name a wrapper of it as the entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dilocod.contract import LearnerContext, StepResult, Trainer
from dilocod.examples.charlm.data import BatchStream, held_out_windows, load_held_out, load_shard
from dilocod.examples.charlm.model import CharLM, CharLMConfig

#: What evaluate() returns, for reports that print it (`dilocod demo`).
EVAL_LOSS_UNIT = "nats per byte"
EVAL_LOSS_MEANING = (
    "mean cross-entropy of the next byte of held-out standard-library sources (divide by ln 2 = "
    "0.693 for bits per byte); a uniform guess over the 256 byte values scores ln 256 = 5.545, and "
    "each 0.693 less halves the model's uncertainty about the next byte"
)


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """How a learner trains the model: batch, inner optimizer and data sharding."""

    batch_size: int = 16
    #: AdamW's learning rate. Measured on one learner at the default model over 1,500 steps
    #: (held-out nats/byte): 5e-4 2.05, 1e-3 1.92, 2e-3 1.79; 3e-3 trailed 2e-3 at 600 steps
    #: (2.38 against 2.19).
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    #: Gradients are clipped to this global norm (None: no clipping); guards the high lr early on.
    grad_clip: float | None = 1.0
    #: How many disjoint training shards the stdlib is dealt into; learner seed m reads m % shards.
    shards: int = 4

    def __post_init__(self) -> None:
        if type(self.batch_size) is not int or self.batch_size < 1:
            raise ValueError(f"TrainConfig.batch_size must be a positive int, got {self.batch_size!r}")
        if type(self.shards) is not int or self.shards < 1:
            raise ValueError(f"TrainConfig.shards must be a positive int, got {self.shards!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be positive, got {self.lr!r}")


def make_trainer(ctx: LearnerContext) -> Trainer:
    """The default entry: CharLMConfig() and TrainConfig() (see build_trainer)."""
    return build_trainer(ctx)


def build_trainer(
    ctx: LearnerContext,
    model_config: CharLMConfig | None = None,
    train_config: TrainConfig | None = None,
    *,
    root: Path | None = None,
) -> Trainer:
    """A Trainer for ctx: the model only for the syncer; model, AdamW and a data stream for a learner.

    root overrides the stdlib directory (default: sysconfig's), e.g. to train on other sources.
    """
    model_config = CharLMConfig() if model_config is None else model_config
    train_config = TrainConfig() if train_config is None else train_config
    # Built and initialised on the CPU everywhere, then moved: the same initial weights on any device.
    model = CharLM(model_config)
    if ctx.role == "syncer":
        return Trainer(model=model, optimizer=None, step=lambda index: StepResult(0))

    model.to(ctx.device)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=train_config.lr,
        betas=train_config.betas,
        weight_decay=train_config.weight_decay,
    )
    stream = BatchStream(
        load_shard(ctx.seed % train_config.shards, train_config.shards, root),
        context=model_config.context,
        batch_size=train_config.batch_size,
        seed=ctx.seed,
        rank=ctx.rank,
    )
    tokens_per_step = train_config.batch_size * model_config.context

    def step(index: int) -> StepResult:
        inputs, targets = stream.next_batch(ctx.device)
        loss = model.loss(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if train_config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.grad_clip)
        optimizer.step()
        return StepResult(tokens=tokens_per_step, loss=loss.item())

    return Trainer(
        model=model,
        optimizer=optimizer,
        step=step,
        state_dict=stream.state_dict,
        load_state_dict=stream.load_state_dict,
    )


def evaluate(
    model: CharLM,
    *,
    batches: int = 8,
    batch_size: int = 16,
    held_out: torch.Tensor | None = None,
) -> float:
    """Mean next-byte cross-entropy (nats per byte) on fixed held-out windows.

    The windows are batches * batch_size evenly spaced windows of the held-out files: the same on
    every call and in every process, so numbers from the syncer's model and a learner's compare.
    held_out (from data.load_held_out()) saves re-reading the files when evaluating often.
    Runs under no_grad on the model's device and leaves the model's train/eval mode as it was.
    """
    if batches < 1 or batch_size < 1:
        raise ValueError(f"batches and batch_size must be positive, got {batches} and {batch_size}")
    data = load_held_out() if held_out is None else held_out
    windows = held_out_windows(data, context=model.config.context, count=batches * batch_size)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for rows in windows.split(batch_size):
                batch = rows.to(device)
                # Every batch holds batch_size windows of equal length, so the mean of means is
                # the mean over all predicted bytes.
                total += model.loss(batch[:, :-1], batch[:, 1:]).item()
    finally:
        model.train(was_training)
    return total / batches
