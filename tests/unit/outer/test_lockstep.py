"""A whole lock-step streaming DiLoCo run (tau = 0, quorum = M = 2) composed from dilocod.outer
equals a straightforward implementation written here from the equations, with torch's own SGD as
the outer optimizer and the RDA merge in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dilocod.model.plan import Piece, plan_module
from dilocod.outer import (
    apply_update_,
    merge_weights,
    nesterov_step_,
    open_rounds,
    outer_step_,
    pseudo_gradient,
    quorum_clock,
    rda_merge,
)

H = 4  # steps between two syncs of one fragment
P = 2  # fragments: a round every H / P = 2 steps
ROUNDS = 6
BATCHES = (8, 16)  # learner 1 sees twice the tokens per step: weights 0.2 / 0.8
OUTER_LR, OUTER_MU = 0.7, 0.9


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class Learner:
    """A model, its AdamW and its own data stream; identical in both implementations."""

    def __init__(self, model: nn.Module, index: int) -> None:
        self.model = copy.deepcopy(model)
        self.params = dict(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.gen = torch.Generator().manual_seed(100 + index)
        self.batch = BATCHES[index]
        self.target = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))

    def step(self) -> int:
        x = torch.randn(self.batch, 8, generator=self.gen)
        loss = nn.functional.mse_loss(self.model(x), torch.sin(x @ self.target))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return self.batch  # tokens


def run_with_dilocod(fused: bool) -> tuple[dict[str, torch.Tensor], list[Learner]]:
    model = make_model()
    plan = plan_module(model, P)
    learners = [Learner(model, m) for m in range(2)]
    global_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    momentum = {n: torch.zeros_like(p) for n, p in global_params.items()}
    anchors = [{n: p.clone() for n, p in global_params.items()} for _ in learners]
    tokens = [[0] * P for _ in learners]
    steps = [[0] * P for _ in learners]
    done = [0, 0]
    next_round = 0
    clock = 0
    while next_round < ROUNDS:
        for m, learner in enumerate(learners):
            got = learner.step()
            done[m] += 1
            for p in range(P):
                tokens[m][p] += got
                steps[m][p] += 1
        clock = quorum_clock(done, quorum=2, previous=clock)
        for opening in open_rounds(clock, next_round, set(), H, plan):
            next_round = opening.round_index + 1
            assert not opening.skipped  # lock-step: every round completes before the next opens
            p = opening.fragment
            pieces = plan.fragments[p].pieces  # row slices: the tensors below are views of them
            deltas = [
                pseudo_gradient(
                    [rows(anchors[m], piece) for piece in pieces],
                    [rows(learners[m].params, piece) for piece in pieces],
                )
                for m in range(2)
            ]
            weights = merge_weights([tokens[m][p] for m in range(2)], [steps[m][p] for m in range(2)])
            theta = [rows(global_params, piece) for piece in pieces]
            buffers = [rows(momentum, piece) for piece in pieces]
            if fused:
                outer_step_(theta, buffers, deltas, weights, OUTER_LR, OUTER_MU)
            else:
                nesterov_step_(theta, rda_merge(deltas, weights), buffers, OUTER_LR, OUTER_MU)
            for m, learner in enumerate(learners):
                apply_update_([rows(learner.params, piece) for piece in pieces], theta, "overwrite")
                for piece in pieces:
                    rows(anchors[m], piece).copy_(rows(global_params, piece))
                tokens[m][p] = steps[m][p] = 0
    return global_params, learners


def rows(tensors: dict[str, torch.Tensor], piece: Piece) -> torch.Tensor:
    """A piece's rows of a named tensor, as a view (of .data: writable in place)."""
    return tensors[piece.name].data[piece.start : piece.stop]


def reference_rda(deltas: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    d64 = [d.double() for d in deltas]
    mean_norm = sum(w * d.norm() for w, d in zip(weights, d64, strict=True)) / sum(weights)
    u = sum(w * d / d.norm() for w, d in zip(weights, d64, strict=True)) / sum(weights)
    return (mean_norm * u / u.norm()).float()


def run_reference() -> tuple[dict[str, torch.Tensor], list[Learner]]:
    model = make_model()
    fragments = [f.pieces for f in plan_module(model, P).fragments]
    learners = [Learner(model, m) for m in range(2)]
    start = {n: p.detach() for n, p in model.named_parameters()}
    # One outer tensor per piece, keyed by the piece; whole parameters are put together at the end.
    outer = {piece: nn.Parameter(rows(start, piece).clone()) for pieces in fragments for piece in pieces}
    optimizers = [
        torch.optim.SGD([outer[n] for n in pieces], lr=OUTER_LR, momentum=OUTER_MU, nesterov=True)
        for pieces in fragments
    ]
    anchors = [{n: p.detach().clone() for n, p in outer.items()} for _ in learners]
    since_sync = [[(0, 0)] * P for _ in learners]  # (tokens, steps) per fragment
    every = H // P
    for t in range(1, ROUNDS * every + 1):
        for m, learner in enumerate(learners):
            got = learner.step()
            since_sync[m] = [(tok + got, st + 1) for tok, st in since_sync[m]]
        if t % every:
            continue
        p = (t // every - 1) % P
        raw = [tok * tok / st for tok, st in (since_sync[m][p] for m in range(2))]
        weights = [w / sum(raw) for w in raw]
        with torch.no_grad():
            for n in fragments[p]:
                deltas = [anchors[m][n] - rows(learners[m].params, n) for m in range(2)]
                outer[n].grad = reference_rda(deltas, weights)
            optimizers[p].step()
            for m, learner in enumerate(learners):
                for n in fragments[p]:
                    rows(learner.params, n).copy_(outer[n])
                    anchors[m][n] = outer[n].detach().clone()
                since_sync[m][p] = (0, 0)
    whole = {
        name: torch.cat([outer[piece].detach() for piece in sorted(outer) if piece.name == name])
        for name in start
    }
    return whole, learners


@pytest.mark.parametrize("fused", [False, True])
def test_lockstep_run_equals_reference(fused: bool) -> None:
    got_global, got_learners = run_with_dilocod(fused)
    want_global, want_learners = run_reference()
    start = {n: p.detach() for n, p in make_model().named_parameters()}
    moved = sum(float((got_global[n] - start[n]).norm()) for n in got_global)
    assert moved > 0.1  # the run did something worth comparing
    for name, want in want_global.items():
        torch.testing.assert_close(got_global[name], want, rtol=1e-4, atol=1e-5)
    for got, want in zip(got_learners, want_learners, strict=True):
        for name, p in want.params.items():
            torch.testing.assert_close(got.params[name].detach(), p.detach(), rtol=1e-4, atol=1e-5)
