"""Reference DiLoCo and Streaming DiLoCo in plain torch, written from the equations for the
equivalence tests: what a lock-step run of M learners must produce, step for step.

Independent of dilocod's own maths on purpose: nothing here imports dilocod but the fragment plan
(dilocod.model.plan and the manifest names of its pieces, docs/design.md §3.1: which rows of which
parameters a fragment holds, not maths; both sides must cut the model alike). The outer gradient
is δ = anchor - θ per piece (a parameter's rows in one fragment, keyed `name` or
`name[start:stop]`), the merge is the weighted mean or RDA (docs/design.md §3.4 step 3, computed in
float64), and the outer step is torch.optim.SGD(lr=η, momentum=μ, nesterov=True) stepped with
grad = Δ, one optimizer per fragment.

Two references, so that each can check the other:
- reference_diloco: DiLoCo as its paper writes it: every learner starts each outer step from the
  global model, trains H steps, and the global model takes one outer step on the merged δ;
- reference_streaming: Streaming DiLoCo with the lock-step schedule of issue 21: round r syncs
  fragment r mod P at every learner's step s_r = ⌈(r + 1)·H/P⌉ (the snapshot), and every learner
  applies the merged fragment at step s_r + τ (overwrite, or the alpha-mix), after the round's merge.
  At a boundary, applies happen before snapshots; with τ = 0 the apply follows its own snapshot.
With P = 1 and τ = 0 the second is the first (tests/unit/test_equivalence_references.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from dilocod.model.plan import plan_fragments
from dilocod.wire.manifest import fragment_shapes

#: Below this ‖u‖ the directions of an RDA merge cancel and the weighted mean is used instead.
RDA_CANCELLED_NORM = 1e-6

#: A merge of one tensor: the learners' outer gradients and their weights -> Δ (float32).
Merge = Callable[[Sequence[Tensor], Sequence[float]], Tensor]


# ------------------------------------------------------------------------------------ the plan


#: A piece of a fragment: (parameter name, start row, stop row).
Piece = tuple[str, int, int]


def plan_pieces(shapes: Mapping[str, tuple[int, ...]], count: int) -> list[dict[str, Piece]]:
    """docs/design.md §3.1, by dilocod.model.plan: each fragment's pieces keyed by the name its
    manifest gives them (`name` for a whole tensor, `name[start:stop]` for a row slice)."""
    plan = plan_fragments(list(shapes.items()), count)
    out = []
    for f in plan.fragments:
        labels = [label for label, _ in fragment_shapes(f.pieces, shapes)]
        out.append({label: (p.name, p.start, p.stop) for label, p in zip(labels, f.pieces, strict=True)})
    return out


def rows(tensor: Tensor, piece: Piece) -> Tensor:
    """The piece's rows of a whole tensor, as a view (a tensor without rows is whole)."""
    _, start, stop = piece
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return tensor
    return tensor[start:stop]


def due_step(round_index: int, sync_every: int, fragments: int) -> int:
    """The step s_r at whose boundary round r is due: the first g with ⌊g·P/H⌋ ≥ r + 1."""
    return -(-(round_index + 1) * sync_every // fragments)


# ---------------------------------------------------------------------------------- the merges


def merge_weights(tokens: Sequence[int], steps: Sequence[int]) -> list[float]:
    """docs/design.md §3.4 step 2 (without the clip, which equal contributions never reach):
    tokens² / steps, normalised to sum to 1."""
    raw = [t * t / s for t, s in zip(tokens, steps, strict=True)]
    return [w / sum(raw) for w in raw]


def mean_merge(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Σ w_m δ_m / Σ w_m, in float64."""
    total = sum(weights)
    merged = sum(w * d.double() for w, d in zip(weights, deltas, strict=True))
    assert isinstance(merged, Tensor)
    return (merged / total).float()


def rda_merge(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """docs/design.md §3.4 step 3, in float64:
        n̄ = Σ w_m‖δ_m‖ / Σ w_m,   u = Σ w_m (δ_m / ‖δ_m‖) / Σ w_m,   Δ = n̄ · u / ‖u‖;
    one contributor's δ is taken exactly; a zero δ or directions that cancel (‖u‖ ≤ 10⁻⁶) fall back
    to the weighted mean. (No tensor of the test models is an embedding.)"""
    if len(deltas) == 1:
        return deltas[0].clone()
    d64 = [d.double() for d in deltas]
    norms = [d.norm() for d in d64]
    if any(float(n) == 0.0 for n in norms):
        return mean_merge(deltas, weights)
    total = sum(weights)
    mean_norm = sum(w * n for w, n in zip(weights, norms, strict=True)) / total
    u = sum(w * d / n for w, d, n in zip(weights, d64, norms, strict=True)) / total
    assert isinstance(u, Tensor)
    if float(u.norm()) <= RDA_CANCELLED_NORM:
        return mean_merge(deltas, weights)
    return (mean_norm * u / u.norm()).float()


MERGES: dict[str, Merge] = {"mean": mean_merge, "rda": rda_merge}


class OuterNesterov:
    """The global model's fragments, each with its own torch.optim.SGD(nesterov=True)."""

    def __init__(
        self, initial: Mapping[str, Tensor], fragments: Sequence[Sequence[str]], lr: float, momentum: float
    ) -> None:
        self.params = {n: nn.Parameter(t.detach().clone().float()) for n, t in initial.items()}
        self.fragments = [list(names) for names in fragments]
        self.optimizers = [
            torch.optim.SGD([self.params[n] for n in names], lr=lr, momentum=momentum, nesterov=True)
            for names in self.fragments
        ]
        #: Each fragment's values at every version: [p][v] (version 0 is the initial model).
        self.versions: list[list[dict[str, Tensor]]] = [[self.fragment(p)] for p in range(len(fragments))]

    def fragment(self, p: int) -> dict[str, Tensor]:
        return {n: self.params[n].detach().clone() for n in self.fragments[p]}

    def step(self, p: int, merged: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """One outer step of fragment p with grad = Δ; returns its new values (a new version)."""
        for name in self.fragments[p]:
            self.params[name].grad = merged[name].clone()
        self.optimizers[p].step()
        values = self.fragment(p)
        self.versions[p].append(values)
        return values


# --------------------------------------------------------------------------------- the learners


class Learner(Protocol):
    """What the references need of a learner: its live parameters, and one inner step."""

    params: dict[str, Tensor]

    def step(self) -> int:
        """One inner step, in place on params; returns the tokens it trained on."""
        ...


@dataclass
class TorchLearner:
    """A model trained by plain torch SGD on batches drawn from its own seeded generator, as the
    equivalence entry's learner does: loss = mse(model(x), y), zero_grad, backward, step."""

    model: nn.Module
    batch: Callable[[torch.Generator], tuple[Tensor, Tensor]]
    seed: int
    lr: float
    params: dict[str, Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.model = copy.deepcopy(self.model)
        self.params = dict(self.model.named_parameters())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)
        self.generator = torch.Generator().manual_seed(self.seed)

    def step(self) -> int:
        x, y = self.batch(self.generator)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return int(x.shape[0])


def _target(learner: Learner, key: str, pieces: Mapping[str, Piece] | None) -> Tensor:
    """The learner's tensor a key names: a piece's rows of a parameter, or a whole parameter."""
    if pieces is not None and key in pieces:
        return rows(learner.params[pieces[key][0]], pieces[key])
    return learner.params[key]


def snapshot(learner: Learner, pieces: Mapping[str, Piece]) -> dict[str, Tensor]:
    return {key: _target(learner, key, pieces).detach().clone() for key in pieces}


def overwrite_(
    learner: Learner, values: Mapping[str, Tensor], pieces: Mapping[str, Piece] | None = None
) -> None:
    """θ ← values, keyed by parameter name or (with pieces) by piece."""
    with torch.no_grad():
        for key, value in values.items():
            _target(learner, key, pieces).copy_(value)


def mix_(
    learner: Learner, values: Mapping[str, Tensor], alpha: float, pieces: Mapping[str, Piece] | None = None
) -> None:
    """Streaming DiLoCo's mix: θ ← alpha·θ + (1 - alpha)·Θ_new."""
    with torch.no_grad():
        for key, value in values.items():
            theta = _target(learner, key, pieces)
            theta.copy_(alpha * theta + (1.0 - alpha) * value)


# ------------------------------------------------------------------------------ the references


@dataclass(frozen=True)
class Flags:
    """The run as the daemons' flags set it."""

    fragments: int = 1  # P
    sync_every: int = 8  # H
    overlap: int = 0  # τ
    merge: str = "mean"
    apply: str = "overwrite"
    mix_alpha: float = 0.5
    outer_lr: float = 0.7  # η
    outer_momentum: float = 0.9  # μ


@dataclass(frozen=True)
class Round:
    """One merged round as the reference made it."""

    index: int
    fragment: int
    step: int  # s_r: the boundary of the snapshot
    apply_step: int  # s_r + τ
    deltas: list[dict[str, Tensor]]  # per learner
    tokens: list[int]  # per learner, since its previous snapshot of the fragment
    steps: list[int]
    weights: list[float]  # of the learners merged, in their order
    merged: dict[str, Tensor]  # Δ
    version: int  # the fragment's version after this round


@dataclass
class Run:
    outer: OuterNesterov
    learners: list[Learner]
    rounds: list[Round]
    #: Every fragment's pieces by key (the outer optimizer's tensors are pieces).
    pieces: dict[str, Piece] = field(default_factory=dict)

    def global_at(self, versions: Sequence[int]) -> dict[str, Tensor]:
        """The global model, whole parameters by name, with fragment p at version versions[p]."""
        found: dict[str, list[tuple[int, Tensor]]] = {}
        for p, version in enumerate(versions):
            for key, value in self.outer.versions[p][version].items():
                name, start, _ = self.pieces.get(key, (key, 0, 0))
                found.setdefault(name, []).append((start, value))
        model: dict[str, Tensor] = {}
        for name, parts in found.items():
            parts.sort(key=lambda part: part[0])
            model[name] = parts[0][1] if len(parts) == 1 else torch.cat([v for _, v in parts])
        return model


def merge_fragment(
    merge: Merge, deltas: Sequence[Mapping[str, Tensor]], weights: Sequence[float]
) -> dict[str, Tensor]:
    return {name: merge([d[name] for d in deltas], weights) for name in deltas[0]}


def reference_streaming(
    initial: Mapping[str, Tensor],
    learners: Sequence[Learner],
    flags: Flags,
    steps: int,
    contributors: Callable[[int], Sequence[int]] | None = None,
) -> Run:
    """Lock-step Streaming DiLoCo for `steps` inner steps of every learner (see the module text).
    The learners are trained in place; they must start at `initial`. contributors(r) names the
    learners (by index) whose δ round r merges: every learner unless given (a run's last rounds,
    still in flight when the learners stopped, may have merged fewer)."""
    if flags.overlap >= flags.sync_every:
        raise ValueError(f"tau ({flags.overlap}) must be below H ({flags.sync_every})")
    merge = MERGES[flags.merge]
    fragments = plan_pieces({n: tuple(t.shape) for n, t in initial.items()}, flags.fragments)
    pieces = {key: piece for fragment in fragments for key, piece in fragment.items()}
    count = len(fragments)
    start = {key: rows(initial[piece[0]], piece).detach().float() for key, piece in pieces.items()}
    outer = OuterNesterov(start, [list(f) for f in fragments], flags.outer_lr, flags.outer_momentum)
    anchors = [{k: t.clone() for k, t in start.items()} for _ in learners]
    since_send = [[(0, 0)] * count for _ in learners]  # (tokens, steps) per learner, per fragment
    pending: list[tuple[int, int, dict[str, Tensor]]] = []  # (apply step, fragment, values)
    rounds: list[Round] = []

    def apply(p: int, values: dict[str, Tensor]) -> None:
        for m, learner in enumerate(learners):
            if flags.apply == "overwrite":
                overwrite_(learner, values, pieces)
            elif flags.apply == "mix":
                mix_(learner, values, flags.mix_alpha, pieces)
            else:
                raise ValueError(f"the reference knows overwrite and mix, not {flags.apply!r}")
            anchors[m].update({n: v.clone() for n, v in values.items()})

    for s in range(1, steps + 1):
        for m, learner in enumerate(learners):
            tokens = learner.step()
            since_send[m] = [(t + tokens, c + 1) for t, c in since_send[m]]
        for item in [item for item in pending if item[0] == s]:
            pending.remove(item)
            apply(item[1], item[2])
        while due_step(len(rounds), flags.sync_every, count) == s:
            r = len(rounds)
            p = r % count
            deltas = []
            for m, learner in enumerate(learners):
                theta = snapshot(learner, fragments[p])
                deltas.append({n: anchors[m][n] - theta[n] for n in fragments[p]})
            tokens = [since_send[m][p][0] for m in range(len(learners))]
            counted = [since_send[m][p][1] for m in range(len(learners))]
            for m in range(len(learners)):
                since_send[m][p] = (0, 0)
            taken = list(range(len(learners))) if contributors is None else list(contributors(r))
            weights = merge_weights([tokens[m] for m in taken], [counted[m] for m in taken])
            merged = merge_fragment(merge, [deltas[m] for m in taken], weights)
            values = outer.step(p, merged)
            version = len(outer.versions[p]) - 1
            rounds.append(
                Round(r, p, s, s + flags.overlap, deltas, tokens, counted, weights, merged, version)
            )
            if flags.overlap == 0:
                apply(p, values)
            else:
                pending.append((s + flags.overlap, p, values))
    return Run(outer, list(learners), rounds, pieces)


def reference_diloco(
    initial: Mapping[str, Tensor],
    learners: Sequence[Learner],
    sync_every: int,
    outer_steps: int,
    merge: Merge,
    outer_lr: float,
    outer_momentum: float,
) -> dict[str, Tensor]:
    """DiLoCo: outer_steps times, every learner sets its model to the global one and trains H
    steps; Δ = merge of (global - local) with tokens²/steps weights; one Nesterov outer step of
    the whole model. Returns the global model."""
    global_params = {n: nn.Parameter(t.detach().clone().float()) for n, t in initial.items()}
    optimizer = torch.optim.SGD(
        list(global_params.values()), lr=outer_lr, momentum=outer_momentum, nesterov=True
    )
    for _ in range(outer_steps):
        deltas, tokens = [], []
        for learner in learners:
            overwrite_(learner, {n: p.detach() for n, p in global_params.items()})
            tokens.append(sum(learner.step() for _ in range(sync_every)))
            deltas.append({n: p.detach() - learner.params[n].detach() for n, p in global_params.items()})
        weights = merge_weights(tokens, [sync_every] * len(learners))
        for name, param in global_params.items():
            param.grad = merge([d[name] for d in deltas], weights)
        optimizer.step()
    final = {n: p.detach().clone() for n, p in global_params.items()}
    for learner in learners:  # every learner ends on the global model, as after a lock-step round
        overwrite_(learner, final)
    return final


def relative_error(got: Tensor, want: Tensor) -> float:
    """‖got - want‖ / ‖want‖ (in float64; against 1 where want is zero)."""
    scale = max(float(want.double().norm()), 1e-30)
    return float((got.double() - want.double()).norm()) / scale
