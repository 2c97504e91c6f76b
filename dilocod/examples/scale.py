"""An entry for measuring dilocod itself at real model sizes: a stack of Linear(4096, 4096,
bias=False) layers (16.8M parameters, 67 MB of float32 each) whose step sleeps and then nudges one
layer, so what a run measures is dilocod's own cost, not the training's (bench/scale.py, and the
memory-bound test). The size and step time come from the environment:

    --entry dilocod.examples.scale:make_trainer    DILOCOD_SCALE_LAYERS=15 DILOCOD_SCALE_STEP_S=1.0

Run alone, it is the baseline a learner's memory is compared with (the same model and step, no
dilocod): `python -m dilocod.examples.scale --layers 15 --seconds 10` prints its peak RSS and PSS.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from dilocod.contract import LearnerContext, StepResult, Trainer

WIDTH = 4096
#: Tokens each step reports: a fixed count, so every learner weighs the same.
TOKENS_PER_STEP = 4096


class Stack(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))


def layers_from_env() -> int:
    return int(os.environ.get("DILOCOD_SCALE_LAYERS", "15"))


def step_s_from_env() -> float:
    return float(os.environ.get("DILOCOD_SCALE_STEP_S", "1.0"))


def build(layers: int, seed: int, device: str = "cpu") -> Stack:
    torch.manual_seed(seed)
    with torch.device(device):
        return Stack(layers)


def make_trainer(ctx: LearnerContext) -> Trainer:
    layers, step_s = layers_from_env(), step_s_from_env()
    model = build(layers, ctx.seed, ctx.device)

    def step(index: int) -> StepResult:
        time.sleep(step_s)
        with torch.no_grad():
            model.layers[index % layers].weight.add_(1e-4)
        return StepResult(TOKENS_PER_STEP, None)

    # A learner saves and restores its inner optimizer: plain SGD keeps no state, so the memory
    # measured is the model's and dilocod's.
    return Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), step=step)


#: smaps_rollup lines memory_kib reads (as lower-case keys): proportional set size in all, and
#: split into anonymous memory, files (libraries: shared with every other torch process) and shmem
#: (the memfds a learner shares with its network process).
ROLLUP_KEYS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def memory_kib(pid: int) -> dict[str, int]:
    """Rss, Pss and its parts (smaps_rollup, ROLLUP_KEYS) and the peak RSS (VmHWM) of a process,
    in KiB; {} once it is gone."""
    figures: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ROLLUP_KEYS:
                figures[key.lower()] = int(rest.split()[0])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                figures["hwm"] = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return {}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the scale entry alone; print its peak memory.")
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--step-s", type=float, default=1.0)
    args = parser.parse_args()
    os.environ["DILOCOD_SCALE_LAYERS"] = str(args.layers)
    os.environ["DILOCOD_SCALE_STEP_S"] = str(args.step_s)
    context = LearnerContext("alone", "learner", "cpu", 0, 1, None, 0)
    trainer = make_trainer(context)
    peak_pss = 0
    started = time.monotonic()
    index = 0
    while time.monotonic() - started < args.seconds:
        trainer.step(index)
        index += 1
        peak_pss = max(peak_pss, memory_kib(os.getpid()).get("pss", 0))
    figures = memory_kib(os.getpid())
    print(json.dumps({"peak_rss_kib": figures.get("hwm", 0), "peak_pss_kib": peak_pss, "steps": index}))


if __name__ == "__main__":
    main()
