"""Loading the user's entry: real modules written to a temporary directory on sys.path, and a real
installed entry point (a dist-info directory importlib.metadata discovers), each failure a clear
EntryError naming the entry."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import dilocod
from dilocod import LearnerContext, StepResult, Trainer
from dilocod.model.entry import (
    ENTRY_POINT_GROUP,
    EntryError,
    check_step_result,
    load_trainer,
    resolve_factory,
)

LEARNER = LearnerContext("m0", "learner", "cpu", 0, 1, None, 7)
SYNCER = LearnerContext("syncer", "syncer", "cpu", 0, 1, None, 0)

GOOD = """
import torch
import dilocod

def make_trainer(ctx):
    torch.manual_seed(ctx.seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters()) if ctx.role == "learner" else None
    def step(i):
        return dilocod.StepResult(tokens=8, loss=0.5)
    return dilocod.Trainer(model=model, optimizer=optimizer, step=step)

not_callable = 42
"""


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path; each test writes its own uniquely named modules there."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    # Forget only the test's own modules: torch and friends, first imported inside a test, stay.
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def write(directory: Path, name: str, source: str) -> str:
    (directory / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def test_the_contract_is_exported_from_dilocod() -> None:
    assert dilocod.Trainer is Trainer and dilocod.StepResult is StepResult
    assert dilocod.LearnerContext is LearnerContext


def test_a_good_factory_for_both_roles(modules: Path) -> None:
    name = write(modules, "good_entry", GOOD)
    trainer = load_trainer(f"{name}:make_trainer", LEARNER)
    assert trainer.step(0) == StepResult(8, 0.5)
    assert trainer.optimizer is not None
    assert load_trainer(f"{name}:make_trainer", SYNCER).optimizer is None


def test_missing_module(modules: Path) -> None:
    with pytest.raises(EntryError, match=r"'nowhere_pkg\.train:make'.*no module named 'nowhere_pkg'"):
        load_trainer("nowhere_pkg.train:make", LEARNER)


def test_a_module_whose_own_import_fails(modules: Path) -> None:
    name = write(modules, "broken_dep_entry", "import not_installed_dependency_xyz\n")
    with pytest.raises(EntryError, match="importing 'broken_dep_entry' failed") as caught:
        resolve_factory(f"{name}:make")
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_a_module_that_raises_at_import(modules: Path) -> None:
    name = write(modules, "raising_entry", "raise RuntimeError('bad config at import')\n")
    with pytest.raises(EntryError, match="raised RuntimeError: bad config at import") as caught:
        resolve_factory(f"{name}:make")
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_missing_attribute_lists_what_the_module_has(modules: Path) -> None:
    name = write(modules, "attr_entry", GOOD)
    with pytest.raises(EntryError, match=r"has no attribute 'make_trainr'.*make_trainer"):
        resolve_factory(f"{name}:make_trainr")


def test_not_callable(modules: Path) -> None:
    name = write(modules, "notcall_entry", GOOD)
    with pytest.raises(EntryError, match="names a int, not a callable"):
        resolve_factory(f"{name}:not_callable")


@pytest.mark.parametrize("spec", ["", " mod:f", "mod:", ":f"])
def test_malformed_specs(spec: str) -> None:
    with pytest.raises(EntryError, match="--entry"):
        resolve_factory(spec)


def test_a_factory_that_raises_keeps_the_users_traceback(modules: Path) -> None:
    name = write(
        modules,
        "factory_raises_entry",
        """
        def make(ctx):
            raise FileNotFoundError("dataset not found")
        """,
    )
    with pytest.raises(
        EntryError, match=r"factory raised FileNotFoundError: dataset not found.*'learner'"
    ) as caught:
        load_trainer(f"{name}:make", LEARNER)
    assert isinstance(caught.value.__cause__, FileNotFoundError)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("return {'model': None}", "returned a dict, not a dilocod.Trainer"),
        ("return dilocod.Trainer(model=object(), optimizer=None, step=print)", "not a torch.nn.Module"),
        (
            "return dilocod.Trainer(model=torch.nn.ReLU(), optimizer=None, step=print)",
            "has no parameters",
        ),
        (
            "m = torch.nn.Linear(1, 1)\n    return dilocod.Trainer(model=m, optimizer=None, step=print)",
            "not a torch.optim.Optimizer",
        ),
        (
            "m = torch.nn.Linear(1, 1)\n"
            "    return dilocod.Trainer(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), step=3)",
            "Trainer.step is not callable",
        ),
        (
            "m = torch.nn.Linear(1, 1)\n"
            "    opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "    return dilocod.Trainer(model=m, optimizer=opt, step=print, state_dict=dict)",
            "both Trainer.state_dict and Trainer.load_state_dict",
        ),
    ],
)
def test_what_the_factory_returns_is_checked(modules: Path, body: str, message: str) -> None:
    name = write(
        modules,
        f"returns_entry_{abs(hash(body))}",
        f"import torch\nimport dilocod\n\ndef make(ctx):\n    {body}\n",
    )
    with pytest.raises(EntryError, match=message):
        load_trainer(f"{name}:make", LEARNER)


def test_an_installed_entry_point_by_name(modules: Path) -> None:
    write(modules, "plugin_entry_mod", GOOD)
    dist = modules / "dilocod_test_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dilocod-test-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntiny = plugin_entry_mod:make_trainer\n")
    trainer = load_trainer("tiny", LEARNER)
    assert trainer.step(3) == StepResult(8, 0.5)
    with pytest.raises(EntryError, match=r"neither module:function nor an installed entry point.*tiny"):
        resolve_factory("huge")


def test_step_results_are_checked() -> None:
    assert check_step_result("e", 0, StepResult(5, None)) == StepResult(5, None)
    assert check_step_result("e", 0, StepResult(5, float("nan"))).tokens == 5  # divergence is reported
    with pytest.raises(EntryError, match=r"step\(3\) returned a tuple"):
        check_step_result("e", 3, (5, 0.1))
    for tokens in (-1, True, 2.5):
        with pytest.raises(EntryError, match="tokens="):
            check_step_result("e", 0, StepResult(tokens, None))  # type: ignore[arg-type]
    with pytest.raises(EntryError, match="loss="):
        check_step_result("e", 0, StepResult(1, "0.3"))  # type: ignore[arg-type]
