"""Fragment plan: every row of every parameter exactly once, balanced at any shape, deterministic."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dilocod.examples.charlm.model import CharLM, CharLMConfig
from dilocod.model.plan import FragmentPlan, module_sizes, plan_fragments, plan_module

REPO = Path(__file__).resolve().parents[3]

names = st.text("abcdefgh._", min_size=1, max_size=6)
shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 40), min_size=1, max_size=3).map(tuple),
)
#: Ordered (name, shape) lists: the plan reads the order (registration order of a module).
named_shapes = st.dictionaries(names, shapes, min_size=1, max_size=30).map(lambda d: list(d.items()))


def transformer_sizes(layers: int = 24, width: int = 64) -> list[tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True)
        model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return module_sizes(model)


def rows_of(shape: tuple[int, ...]) -> int:
    return shape[0] if shape and shape[0] else 1


def test_hand_computed_example() -> None:
    # 17 elements in order: a (4 rows of 1), b (3), c (2 rows of 2), d (5), e (1). P = 2: the cut
    # nearest 8.5 is the boundary at 9 (after row 0 of c), not the one at 7 (after b).
    plan = plan_fragments([("a", 4), ("b", 3), ("c", (2, 2)), ("d", 5), ("e", [1])], 2)
    assert [f.pieces for f in plan.fragments] == [
        (("a", 0, 4), ("b", 0, 3), ("c", 0, 1)),
        (("c", 1, 2), ("d", 0, 5), ("e", 0, 1)),
    ]
    assert [f.numel for f in plan.fragments] == [9, 8]
    assert plan.imbalance == pytest.approx(9 / 8.5)
    assert plan.fragments_of("c") == [0, 1]
    assert plan.fragments_of("d") == [1]
    assert plan.to_lists() == [
        [["a", 0, 4], ["b", 0, 3], ["c", 0, 1]],
        [["c", 1, 2], ["d", 0, 5], ["e", 0, 1]],
    ]


def test_fragments_capped_at_row_count() -> None:
    plan = plan_fragments([("x", (2, 5)), ("y", ()), ("z", (0, 3))], 24)
    assert plan.num_fragments == 4  # two rows of x, y and z whole (no rows: one piece [0, 1))
    assert [f.pieces for f in plan.fragments] == [
        (("x", 0, 1),),
        (("x", 1, 2),),
        (("y", 0, 1),),
        (("z", 0, 1),),
    ]
    assert [f.numel for f in plan.fragments] == [5, 5, 1, 0]


@pytest.mark.parametrize(
    ("sizes", "count"),
    [([], 2), ([("a", 1), ("a", 2)], 2), ([("a", -1)], 1), ([("a", (2, -1))], 1), ([("a", 1)], 0)],
)
def test_bad_input_raises(sizes: list[tuple[str, object]], count: int) -> None:
    with pytest.raises(ValueError):
        plan_fragments(sizes, count)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(named_shapes, st.integers(1, 30))
def test_properties(sizes: list[tuple[str, tuple[int, ...]]], count: int) -> None:
    plan = plan_fragments(sizes, count)
    by_name = dict(sizes)
    total_rows = sum(rows_of(s) for _, s in sizes)
    assert plan.num_fragments == min(count, total_rows)
    # Every row of every parameter in exactly one piece; the pieces are consecutive in model order
    # (fragment by fragment, the next piece starts where the previous one stopped).
    flat = [p for f in plan.fragments for p in f.pieces]
    expected = [(name, 0) for name, _ in sizes]
    position = 0
    for name, start, stop in flat:
        while expected[position][0] != name:
            assert expected[position][1] == rows_of(by_name[expected[position][0]])
            position += 1
        assert start == expected[position][1] < stop <= rows_of(by_name[name])
        expected[position] = (name, stop)
    assert position == len(sizes) - 1 and expected[-1][1] == rows_of(sizes[-1][1])
    for f in plan.fragments:
        assert f.pieces, "no fragment is empty"
        assert len(set(f.names)) == len(f.names), "at most one piece of a parameter per fragment"
        per_row = [math.prod(by_name[n]) // rows_of(by_name[n]) for n in f.names]
        assert f.numel == sum(r * (p.stop - p.start) for r, p in zip(per_row, f.pieces, strict=True))
    assert plan.total_numel == sum(math.prod(s) for _, s in sizes)
    # Each cut is within half a row of its ideal place unless it had to move to leave every
    # fragment a row, so a fragment exceeds the mean by at most one row (the largest).
    largest_row = max(math.prod(s) // rows_of(s) for _, s in sizes)
    mean = plan.total_numel / plan.num_fragments
    assert max(f.numel for f in plan.fragments) <= mean + largest_row + 1e-9
    # Deterministic: the same list, planned again, gives the same plan.
    assert plan_fragments(list(sizes), count) == plan


@pytest.mark.parametrize("count", [8, 12, 24])
def test_transformer_imbalance(count: int) -> None:
    plan = plan_fragments(transformer_sizes(), count)
    assert plan.num_fragments == count
    assert plan.imbalance <= 1.10, plan.imbalance


def test_large_square_layers_balance_at_24() -> None:
    # 15 tensors of 4096 x 4096, each far above model / 24: the old whole-tensor plan made 15
    # fragments; row slices make 24, within one row (4096 of 10.5M elements) of the mean.
    plan = plan_fragments([(f"layers.{i}.weight", (4096, 4096)) for i in range(15)], 24)
    assert plan.num_fragments == 24
    assert plan.imbalance <= 1.10, plan.imbalance
    assert max(f.numel for f in plan.fragments) - plan.total_numel / 24 <= 4096


def test_charlm_balances_at_24() -> None:
    with torch.device("meta"):
        model = CharLM(CharLMConfig())
    plan = plan_module(model, 24)
    assert plan.num_fragments == 24
    assert plan.imbalance <= 1.10, plan.imbalance


def test_deterministic_across_processes() -> None:
    sizes = transformer_sizes(layers=6) + [(f"extra.{i}", 4096) for i in range(30)]
    here = plan_fragments(sizes, 24).to_lists()
    script = (
        "import json, sys\n"
        "from dilocod.model.plan import plan_fragments\n"
        "sizes = [(n, s if isinstance(s, int) else tuple(s)) for n, s in json.load(sys.stdin)]\n"
        "print(json.dumps(plan_fragments(sizes, 24).to_lists()))\n"
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
    pieces = [p for f in plan.fragments for p in f.pieces]
    assert {p.name for p in pieces} == {"embed.weight", "body.weight", "body.bias"}
