"""The references of the equivalence tests (devkit/diloco_reference.py) checked against
each other and against hand computations, without processes: the fragment plan and the schedule
as docs/design.md states them, RDA and the weighted mean on inputs whose answer is known, two
Nesterov steps by hand, Streaming DiLoCo with one fragment equal to DiLoCo, and the step at which
Streaming DiLoCo snapshots and applies (seen through learners whose every step moves every value by
the same amount, so each outer gradient counts the steps since its anchor)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from devkit import equivalence_entry as problem
from devkit.diloco_reference import (
    MERGES,
    Flags,
    OuterNesterov,
    TorchLearner,
    due_step,
    mean_merge,
    merge_weights,
    plan_pieces,
    rda_merge,
    reference_diloco,
    reference_streaming,
    relative_error,
)

#: The bound the equivalence tests hold dilocod to; the references must tell apart runs that differ.
TOLERANCE = 1e-5
DRIFT = 1.0 / 64


class DriftLearner:
    """Every step moves every parameter by -DRIFT: δ = anchor - θ is DRIFT x the steps since θ
    last took the anchor's value (overwrite), whatever the global model is."""

    def __init__(self, initial: dict[str, Tensor], tokens: int = 10) -> None:
        self.params = {n: t.clone() for n, t in initial.items()}
        self.tokens = tokens

    def step(self) -> int:
        for value in self.params.values():
            value.sub_(DRIFT)
        return self.tokens


def _mlp_initial() -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in problem.make_model().named_parameters()}


def _mlp_learners(seeds: tuple[int, ...] = (1, 2)) -> list[TorchLearner]:
    model = problem.make_model()
    return [TorchLearner(model, problem.batch, seed, problem.INNER_LR) for seed in seeds]


def _max_error(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    return max(relative_error(got[n], want[n]) for n in want)


# ------------------------------------------------------------------------ plan and schedule


def test_plan_is_the_design_rule_on_the_test_model() -> None:
    # 484 elements in registration order: 0.weight (16 x 8), 0.bias (16), 2.weight (16 x 16),
    # 2.bias (16), 4.weight (4 x 16), 4.bias (4). P = 4 cuts at the row boundaries nearest 121,
    # 242 and 363: 120 (row 15 of 0.weight), 240 (row 6 of 2.weight) and 368 (row 14 of it).
    shapes = {n: tuple(t.shape) for n, t in _mlp_initial().items()}
    assert plan_pieces(shapes, 4) == [
        {"0.weight[0:15]": ("0.weight", 0, 15)},
        {
            "0.weight[15:16]": ("0.weight", 15, 16),
            "0.bias": ("0.bias", 0, 16),
            "2.weight[0:6]": ("2.weight", 0, 6),
        },
        {"2.weight[6:14]": ("2.weight", 6, 14)},
        {
            "2.weight[14:16]": ("2.weight", 14, 16),
            "2.bias": ("2.bias", 0, 16),
            "4.weight": ("4.weight", 0, 4),
            "4.bias": ("4.bias", 0, 4),
        },
    ]
    assert [list(f) for f in plan_pieces(shapes, 1)] == [list(shapes)]
    assert len(plan_pieces(shapes, 24)) == 24  # rows, not tensors, cap P


def test_due_steps_are_the_schedule_of_the_design() -> None:
    assert [due_step(r, 8, 4) for r in range(6)] == [2, 4, 6, 8, 10, 12]
    assert [due_step(r, 4, 1) for r in range(3)] == [4, 8, 12]
    # docs/design.md §3.2 and dilocod/outer/schedule.py: H = 30, P = 24 -> ticks 2, 3, 4, 5, 7.
    assert [due_step(r, 30, 24) for r in range(5)] == [2, 3, 4, 5, 7]


# ---------------------------------------------------------------------------------- merges


def test_weights_are_tokens_squared_over_steps() -> None:
    assert merge_weights([10, 10], [4, 4]) == [0.5, 0.5]
    # 10²/1 = 100 against 20²/4 = 100: as many tokens at twice the tokens per step weigh the same.
    assert merge_weights([10, 20], [1, 4]) == [0.5, 0.5]
    assert merge_weights([10, 30], [1, 1]) == pytest.approx([0.1, 0.9])


def test_mean_is_weighted() -> None:
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0, -2.0, 0.0])
    assert torch.equal(mean_merge([a, b], [0.25, 0.75]), torch.tensor([4.0, -1.0, 0.75]))
    assert torch.equal(mean_merge([a, b], [1.0, 3.0]), torch.tensor([4.0, -1.0, 0.75]))


def test_rda_of_one_learner_is_its_delta() -> None:
    delta = torch.randn(33, generator=torch.Generator().manual_seed(3))
    assert torch.equal(rda_merge([delta], [1.0]), delta)
    assert torch.equal(rda_merge([delta], [0.3]), delta)


def test_rda_keeps_the_norm_where_the_mean_shrinks_it() -> None:
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 3.0])  # orthogonal, equal norms
    merged = rda_merge([a, b], [0.5, 0.5])
    torch.testing.assert_close(merged, torch.tensor([3.0, 3.0]) / math.sqrt(2))
    assert float(merged.norm()) == pytest.approx(3.0)
    assert float(mean_merge([a, b], [0.5, 0.5]).norm()) == pytest.approx(3.0 / math.sqrt(2))


def test_rda_of_parallel_deltas_is_the_weighted_norm_along_them() -> None:
    v = torch.tensor([1.0, -2.0, 2.0])  # norm 3
    merged = rda_merge([v, 4 * v], [0.75, 0.25])  # n̄ = 0.75·3 + 0.25·12 = 5.25, direction v / 3
    torch.testing.assert_close(merged, v * 5.25 / 3)


def test_rda_falls_back_to_the_mean() -> None:
    a = torch.tensor([1.0, 2.0])
    zero = torch.zeros(2)
    assert torch.equal(rda_merge([a, zero], [0.5, 0.5]), mean_merge([a, zero], [0.5, 0.5]))
    # Opposite directions of equal weight cancel (‖u‖ = 0): the mean, here zero.
    assert torch.equal(rda_merge([a, -3 * a], [0.5, 0.5]), mean_merge([a, -3 * a], [0.5, 0.5]))


# --------------------------------------------------------------------------- outer Nesterov


def test_outer_nesterov_is_two_steps_by_hand() -> None:
    lr, mu = 0.7, 0.9
    theta0, d1, d2 = [1.0, -2.0], [0.5, 0.25], [-1.0, 2.0]
    outer = OuterNesterov({"w": torch.tensor(theta0)}, [["w"]], lr, mu)
    first = outer.step(0, {"w": torch.tensor(d1)})["w"]
    second = outer.step(0, {"w": torch.tensor(d2)})["w"]
    b1 = d1  # b <- mu·0 + Δ
    theta1 = [t - lr * (d + mu * b) for t, d, b in zip(theta0, d1, b1, strict=True)]
    b2 = [mu * b + d for b, d in zip(b1, d2, strict=True)]
    theta2 = [t - lr * (d + mu * b) for t, d, b in zip(theta1, d2, b2, strict=True)]
    torch.testing.assert_close(first, torch.tensor(theta1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(second, torch.tensor(theta2), rtol=1e-6, atol=1e-7)
    assert [len(v) for v in outer.versions] == [3]  # versions 0, 1, 2


def test_outer_nesterov_keeps_fragments_apart() -> None:
    outer = OuterNesterov({"a": torch.ones(2), "b": torch.ones(2)}, [["a"], ["b"]], 0.5, 0.9)
    outer.step(0, {"a": torch.ones(2)})
    assert torch.equal(outer.fragment(1)["b"], torch.ones(2))
    torch.testing.assert_close(outer.fragment(0)["a"], torch.full((2,), 0.05))  # 1 - 0.5·(1 + 0.9)


# ------------------------------------------------------------------ DiLoCo and Streaming DiLoCo


@pytest.mark.parametrize("merge", ["mean", "rda"])
def test_streaming_with_one_fragment_and_no_overlap_is_diloco(merge: str) -> None:
    initial, rounds, sync_every = _mlp_initial(), 4, 4
    flags = Flags(fragments=1, sync_every=sync_every, overlap=0, merge=merge)
    streaming = reference_streaming(initial, _mlp_learners(), flags, rounds * sync_every)
    diloco_learners = _mlp_learners()
    diloco = reference_diloco(initial, diloco_learners, sync_every, rounds, MERGES[merge], 0.7, 0.9)
    assert [r.fragment for r in streaming.rounds] == [0] * rounds
    assert [r.step for r in streaming.rounds] == [4, 8, 12, 16]
    got = streaming.global_at([rounds])
    for name, want in diloco.items():
        assert torch.equal(got[name], want), name
    for ours, theirs in zip(streaming.learners, diloco_learners, strict=True):
        for name, value in theirs.params.items():
            assert torch.equal(ours.params[name], value), name
    assert relative_error(got["2.weight"], initial["2.weight"]) > 1e-2  # it trained


def test_streaming_snapshots_at_the_due_step_and_applies_tau_later() -> None:
    """With drifting learners, fragment p's δ counts the steps since p's anchor was applied:
    the first P rounds s_r steps (from the start), then H (tau = 0) or H - tau (tau steps pass
    between the snapshot and the overwrite, and those are dropped)."""
    initial = {f"t{i}": torch.zeros(3) for i in range(4)}
    for overlap in (0, 2, 3):
        flags = Flags(fragments=4, sync_every=8, overlap=overlap)
        run = reference_streaming(initial, [DriftLearner(initial), DriftLearner(initial)], flags, 33)
        assert [r.step for r in run.rounds] == [2 * (r + 1) for r in range(16)]
        assert [r.apply_step for r in run.rounds] == [2 * (r + 1) + overlap for r in range(16)]
        for r in run.rounds:
            since_anchor = r.step if r.index < 4 else 8 - overlap
            for delta in r.deltas:
                for value in delta.values():
                    # Θ minus whole steps of DRIFT: exact up to the rounding of Θ's own values.
                    want = torch.full((3,), DRIFT * since_anchor)
                    torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-6, msg=f"{overlap} {r.index}")
            assert r.steps == [r.step if r.index < 4 else 8] * 2  # counted since the last send
            assert r.weights == [0.5, 0.5]


def test_streaming_mix_keeps_alpha_of_the_local_fragment() -> None:
    """One drifting learner, one fragment, tau = 1, alpha = 0.25: at the apply θ = 0.25·θ +
    0.75·Θ_new, so the next δ = Θ_new - θ holds 0.25 x what separated them, plus the new steps."""
    initial = {"w": torch.zeros(2)}
    flags = Flags(fragments=1, sync_every=4, overlap=1, apply="mix", mix_alpha=0.25)
    run = reference_streaming(initial, [DriftLearner(initial)], flags, 8)
    first, second = run.rounds
    assert torch.equal(first.deltas[0]["w"], torch.full((2,), 4 * DRIFT))
    new = run.outer.versions[0][1]["w"]
    theta_at_apply = torch.full((2,), -5 * DRIFT)  # step 5: one step past the snapshot
    theta_after = 0.25 * theta_at_apply + 0.75 * new
    torch.testing.assert_close(second.deltas[0]["w"], new - (theta_after - 3 * DRIFT))


def test_the_references_tell_apart_what_the_tolerance_must() -> None:
    """On the equivalence tests' own problem, another overlap, the other merge or the other apply
    mode each move the global model by far more than the tolerance; the same run twice does not
    move it at all."""
    initial = _mlp_initial()

    def run(flags: Flags) -> dict[str, Tensor]:
        result = reference_streaming(initial, _mlp_learners(), flags, 35)
        return result.global_at([len(v) - 1 for v in result.outer.versions])

    base = Flags(fragments=4, sync_every=16, overlap=2, merge="mean")
    want = run(base)
    assert _max_error(run(base), want) == 0.0
    for other in (
        Flags(fragments=4, sync_every=16, overlap=1, merge="mean"),
        Flags(fragments=4, sync_every=16, overlap=2, merge="rda"),
        Flags(fragments=4, sync_every=16, overlap=2, merge="mean", apply="mix"),
    ):
        assert _max_error(run(other), want) > 100 * TOLERANCE, other


def test_rounds_merge_only_the_learners_named() -> None:
    """Merging learner 0 alone in every round gives the run of learner 0 alone: the other one
    trains and applies the merges but never reaches the global model."""
    initial, flags = _mlp_initial(), Flags(fragments=4, sync_every=8, overlap=2, merge="rda")
    alone = reference_streaming(initial, _mlp_learners((1,)), flags, 17)
    named = reference_streaming(initial, _mlp_learners((1, 2)), flags, 17, contributors=lambda r: [0])
    for p, history in enumerate(alone.outer.versions):
        for version, values in enumerate(history):
            for name, value in values.items():
                assert torch.equal(named.outer.versions[p][version][name], value), (p, version, name)
    assert all(r.weights == [1.0] for r in named.rounds)
