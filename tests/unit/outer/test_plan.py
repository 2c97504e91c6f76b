"""Fragment plan: every parameter exactly once, balanced, independent of input order and process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dilocod.outer import FragmentPlan, module_sizes, plan_fragments, plan_module

REPO = Path(__file__).resolve().parents[3]

named_sizes = st.dictionaries(
    st.text("abcdefgh._", min_size=1, max_size=6), st.integers(0, 10_000), min_size=1, max_size=40
).map(lambda d: sorted(d.items()))


def transformer_sizes(layers: int = 24, width: int = 64) -> list[tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True)
        model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return module_sizes(model)


def test_hand_computed_example() -> None:
    # Largest first, ties by name: d(5) -> 0; a(4) -> 1 (empty); c(4) -> 1 (4 < 5); b(3) -> 0
    # (5 < 8); e(1): both hold 8, the tie goes to the lowest index, 0.
    plan = plan_fragments([("a", 4), ("b", 3), ("c", (2, 2)), ("d", 5), ("e", [1])], 2)
    assert [f.names for f in plan.fragments] == [("d", "b", "e"), ("a", "c")]
    assert [f.numel for f in plan.fragments] == [9, 8]
    assert plan.imbalance == pytest.approx(9 / 8.5)
    assert plan.fragment_of("c") == 1
    assert plan.to_lists() == [["d", "b", "e"], ["a", "c"]]


def test_fragments_capped_at_tensor_count() -> None:
    plan = plan_fragments([("x", 10), ("y", 1)], 24)
    assert plan.num_fragments == 2
    assert [f.names for f in plan.fragments] == [("x",), ("y",)]


@pytest.mark.parametrize(
    ("sizes", "count"),
    [([], 2), ([("a", 1), ("a", 2)], 2), ([("a", -1)], 1), ([("a", (2, -1))], 1), ([("a", 1)], 0)],
)
def test_bad_input_raises(sizes: list[tuple[str, object]], count: int) -> None:
    with pytest.raises(ValueError):
        plan_fragments(sizes, count)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(named_sizes, st.integers(1, 12), st.randoms(use_true_random=False))
def test_properties(sizes: list[tuple[str, int]], count: int, rnd: object) -> None:
    plan = plan_fragments(sizes, count)
    names = [n for f in plan.fragments for n in f.names]
    # Every parameter exactly once.
    assert sorted(names) == sorted(n for n, _ in sizes)
    assert plan.num_fragments == min(count, len(sizes))
    by_name = dict(sizes)
    for f in plan.fragments:
        assert f.numel == sum(by_name[n] for n in f.names)
        # Placed largest first, ties by name.
        assert list(f.names) == sorted(f.names, key=lambda n: (-by_name[n], n))
    # Independent of input order.
    shuffled = list(sizes)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert plan_fragments(shuffled, count) == plan
    # The greedy (LPT) bound: the heaviest fragment got its last, smallest tensor while it was the
    # lightest, so it exceeds the mean of the rest by at most that tensor.
    heaviest = max(plan.fragments, key=lambda f: f.numel)
    total = plan.total_numel
    if heaviest.names:
        last = by_name[heaviest.names[-1]]
        assert heaviest.numel <= (total - last) / plan.num_fragments + last + 1e-9


@pytest.mark.parametrize("count", [8, 12, 24])
def test_transformer_imbalance(count: int) -> None:
    sizes = transformer_sizes()
    similar = sum(1 for _, shape in sizes if len(shape) == 2)
    assert similar >= 24
    plan = plan_fragments(sizes, count)
    assert plan.imbalance <= 4 / 3, plan.imbalance


def test_deterministic_across_processes() -> None:
    sizes = transformer_sizes(layers=6) + [(f"extra.{i}", 4096) for i in range(30)]
    here = plan_fragments(sizes, 24).to_lists()
    script = (
        "import json, sys\n"
        "from dilocod.outer.plan import plan_fragments\n"
        "sizes = [(n, s if isinstance(s, int) else tuple(s)) for n, s in json.load(sys.stdin)]\n"
        "print(json.dumps(plan_fragments(reversed(sizes), 24).to_lists()))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script],
        input=json.dumps(sizes),
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == here


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight


def test_module_plan_counts_tied_parameter_once() -> None:
    model = Tied()
    sizes = module_sizes(model)
    assert [n for n, _ in sizes] == ["embed.weight", "body.weight", "body.bias"]
    plan = plan_module(model, 2)
    assert isinstance(plan, FragmentPlan)
    assert plan.total_numel == sum(p.numel() for p in model.parameters())  # parameters() dedups too
    assert plan.total_numel == 50 * 8 + 8 * 8 + 8
