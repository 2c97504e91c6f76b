"""The layering of dilocod's packages, checked on every import statement of every module (function
level included), not stated in prose: each top-level part of the package may import only the parts
DEPENDS_ON lists, and the rules below hold of that table itself, so loosening one fails here too.

    cli, demo  ->  syncer, learner  ->  model, ops, linkbench  ->  transport, config  ->  wire
                   syncer, learner, model  ->  outer

wire and outer import nothing of the project; transport never imports the syncer or the learner;
the syncer and the learner never import each other (what both need is in model/); nothing imports
tests.

Beside dilocod, the repository's other top-level package: devkit (what the tests and the benchmarks
share) may import dilocod and nothing else of the repository; dilocod never imports devkit; no test
module and no bench script imports another (what they share is in devkit)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dilocod"

#: Each part of the package (a subpackage, or a top-level module by its name) and the other parts
#: it may import.
DEPENDS_ON: dict[str, set[str]] = {
    "wire": set(),
    "outer": set(),
    "contract": set(),
    "examples": {"contract"},
    "config": {"wire"},
    "transport": {"wire"},
    "tuning": {"wire"},
    "model": {"contract", "outer", "wire"},
    "ops": {"config", "transport", "wire"},
    "linkbench": {"config", "ops", "transport", "tuning", "wire"},
    "learner": {"config", "contract", "model", "ops", "outer", "transport", "tuning", "wire"},
    "syncer": {"config", "contract", "model", "ops", "outer", "transport", "tuning", "wire"},
    "demo": {"config", "contract", "model", "ops", "syncer", "transport"},
    "cli": {
        "__init__",
        "config",
        "demo",
        "learner",
        "linkbench",
        "model",
        "ops",
        "syncer",
        "transport",
        "tuning",
        "wire",
    },
    "__init__": {"contract"},
    "__main__": {"cli"},
}


def part_of(path: Path) -> str:
    first = path.relative_to(PACKAGE).parts[0]
    return first.removesuffix(".py")


#: The repository's top-level packages and directories of Python, and which of them each package may
#: import (dilocod's own parts are checked against DEPENDS_ON).
REPOSITORY: dict[str, set[str]] = {"dilocod": set(), "devkit": {"dilocod"}, "tests": set(), "bench": set()}
#: The parts an import of one of the repository's other top-level names counts as.
OUTSIDE = {name for name in REPOSITORY if name != "dilocod"}


def imported_parts(path: Path) -> set[str]:
    """The parts of dilocod a module imports ("__init__" for `dilocod` itself), and the repository's
    other top-level names it imports ("tests", "devkit", "bench")."""
    parts: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: within its own part
                continue
            names = [node.module or ""]
        for name in names:
            top, _, rest = name.partition(".")
            if top == "dilocod":
                parts.add(rest.split(".")[0] if rest else "__init__")
            elif top in OUTSIDE:
                parts.add(top)
    return parts


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_part_of_the_package_has_its_place_in_the_table() -> None:
    assert {part_of(path) for path in MODULES} == set(DEPENDS_ON)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_imports_only_what_its_part_may(path: Path) -> None:
    part = part_of(path)
    beyond = imported_parts(path) - {part} - DEPENDS_ON[part]
    assert not beyond, f"dilocod/{path.relative_to(PACKAGE)} ({part}) imports {sorted(beyond)}"


def test_the_rules_hold_of_the_table() -> None:
    assert DEPENDS_ON["wire"] == set() and DEPENDS_ON["outer"] == set()
    assert not DEPENDS_ON["transport"] & {"syncer", "learner"}
    assert "learner" not in DEPENDS_ON["syncer"] and "syncer" not in DEPENDS_ON["learner"]
    assert all(not allowed & OUTSIDE for allowed in DEPENDS_ON.values())
    assert REPOSITORY["dilocod"] == set() and REPOSITORY["devkit"] == {"dilocod"}


DEVKIT_MODULES = sorted((ROOT / "devkit").rglob("*.py"))


def imported_top_level(path: Path) -> set[str]:
    """The repository's top-level names a module imports (relative imports stay in its own)."""
    parts = imported_parts(path)
    return {part for part in parts if part in OUTSIDE} | ({"dilocod"} if parts - OUTSIDE else set())


@pytest.mark.parametrize("path", DEVKIT_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_devkit_imports_dilocod_and_nothing_else_of_the_repository(path: Path) -> None:
    beyond = imported_top_level(path) - {"devkit"} - REPOSITORY["devkit"]
    assert not beyond, f"{path.relative_to(ROOT)} imports {sorted(beyond)}"


def test_what_the_table_allows_is_acyclic() -> None:
    done: set[str] = set()

    def visit(part: str, path: tuple[str, ...]) -> None:
        assert part not in path, f"a cycle: {' -> '.join((*path, part))}"
        if part in done:
            return
        for other in DEPENDS_ON[part]:
            visit(other, (*path, part))
        done.add(part)

    for part in DEPENDS_ON:
        visit(part, ())


def absolute_imports(path: Path, tree: ast.AST | None = None) -> set[str]:
    """The top-level names of every absolute import in a module (`tree`: the module, parsed)."""
    names: set[str] = set()
    for node in ast.walk(tree or ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add((node.module or "").partition(".")[0])
    return names


def test_no_test_module_or_bench_script_is_imported() -> None:
    """What tests and benchmarks share is in devkit: a test imports no other test module (nor a
    relative one), and a bench script no other script (by its bare name, as `python bench/x.py`
    would let it)."""
    scripts = {path.stem for path in (ROOT / "bench").glob("*.py")}
    wrong = []
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py")]):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        relative = any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))
        siblings = scripts if path.parent.name == "bench" else set()  # a test may import stdlib codecs
        beyond = absolute_imports(path, tree) & ({"tests", "bench"} | siblings)
        if relative or beyond:
            wrong.append(f"{path.relative_to(ROOT)}: {sorted(beyond) or 'a relative import'}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from dilocod.learner.link import Link\n    import tests.x\n    from devkit import y\n"
    )
    assert imported_parts(module) == {"learner", "tests", "devkit"}
    assert imported_top_level(module) == {"dilocod", "tests", "devkit"}
    assert absolute_imports(module) == {"dilocod", "tests", "devkit"}
