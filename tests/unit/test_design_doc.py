"""Citations of the design document stay resolvable.

Code, tests, benchmarks and the protocol cite the design by path and section
("docs/design.md §3.4 step 2"). This fails when a file cites a design document other than
docs/design.md (a copy kept elsewhere, a bare "DESIGN §3.6"), a section that is not a heading of
docs/design.md, or a numbered step that its section does not have.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
CITED_AS = "docs/design.md"
#: Where citations live (systemd/ and the README cite it too).
SCANNED = ("dilocod", "devkit", "tests", "bench", "protocol", "systemd", "README.md")
SUFFIXES = {".py", ".md", ".toml", ".txt", ".example", ".conf", ".service", ".sh", ".json"}
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis"}

#: A heading that opens a numbered section: "## 3. The algorithm", "### 3.4 Syncer side".
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)
#: Any file name ending in design.md (any case), with whatever path leads to it.
ANY_DESIGN_PATH = re.compile(r"[\w./-]*design\.md", re.IGNORECASE)
#: The old bare form "DESIGN §3.6" (no file name at all).
BARE_DESIGN = re.compile(r"\bDESIGN\s*§")
#: The sections right after a citation: "§3.2 and §3.4", "§2, §3.5", "§3.2-§3.4" (also with an
#: en dash), "§4.1",
#: optionally followed by "step N".
SECTION = r"§?\s?(\d+(?:\.\d+)*)"
CITATION = re.compile(
    re.escape(CITED_AS)
    + r"((?:(?:\s*(?:,|and|-|\u2013)\s*|\s+)"
    + SECTION
    + r"(?:'s)?)+)(?:\s+step\s+(\d+))?"
)


def _sections(text: str) -> dict[str, str]:
    """Section number -> the text of that section (up to the next numbered heading)."""
    matches = list(HEADING.finditer(text))
    return {
        m.group(1): text[m.end() : matches[i + 1].start() if i + 1 < len(matches) else len(text)]
        for i, m in enumerate(matches)
    }


def _scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        top = ROOT / name
        if top.is_file():
            files.append(top)
            continue
        for path in sorted(top.rglob("*")):
            if SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts) or not path.is_file():
                continue
            if path.suffix in SUFFIXES and path.resolve() != Path(__file__).resolve():
                files.append(path)
    return files


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _citations() -> list[tuple[str, int, str, list[str], str | None]]:
    """(file, line, citation text, sections, step) for every citation with a section."""
    found = []
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in CITATION.finditer(text):
            sections = re.findall(r"\d+(?:\.\d+)*", m.group(1))
            found.append(
                (str(path.relative_to(ROOT)), _line(text, m.start()), m.group(0), sections, m.group(3))
            )
    return found


def test_the_design_document_has_numbered_sections() -> None:
    sections = _sections(DESIGN.read_text(encoding="utf-8"))
    # The sections code relies on: roles, every part of the algorithm, the measured facts, the user.
    for number in ("1", "2", "3", "3.1", "3.2", "3.3", "3.4", "3.5", "3.6", "3.7", "4", "4.1", "5", "6"):
        assert number in sections, f"docs/design.md has no heading for section {number}"


def test_no_other_design_document_is_cited() -> None:
    wrong = []
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in ANY_DESIGN_PATH.finditer(text):
            if m.group(0) != CITED_AS:
                wrong.append(f"{path.relative_to(ROOT)}:{_line(text, m.start())}: {m.group(0)}")
        for m in BARE_DESIGN.finditer(text):
            wrong.append(f"{path.relative_to(ROOT)}:{_line(text, m.start())}: {m.group(0)}")
    assert not wrong, "cite the design as docs/design.md:\n" + "\n".join(wrong)


def test_every_cited_section_exists() -> None:
    sections = _sections(DESIGN.read_text(encoding="utf-8"))
    citations = _citations()
    assert citations, "no citation of docs/design.md found: is the scan looking in the right place?"
    missing = []
    for where, line, cited, numbers, step in citations:
        for number in numbers:
            if number not in sections:
                missing.append(f"{where}:{line}: {cited!r} (no section {number})")
        if step is not None and numbers:
            body = sections.get(numbers[-1], "")
            if not re.search(rf"^\s*{step}\.\s", body, re.MULTILINE):
                missing.append(f"{where}:{line}: {cited!r} (section {numbers[-1]} has no step {step})")
    assert not missing, "citations of sections docs/design.md does not have:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    ("text", "sections", "step"),
    [
        ("(docs/design.md §3.4 step 2).", ["3.4"], "2"),
        ("(docs/design.md §2, §3.5).", ["2", "3.5"], None),
        ("(docs/design.md §3.2 and §3.4) as", ["3.2", "3.4"], None),
        ("# The schedule (docs/design.md §3.2\u2013§3.4): P", ["3.2", "3.4"], None),
        ("docs/design.md §3.2-§3.4", ["3.2", "3.4"], None),
        ("what docs/design.md §3.1's balanced plan", ["3.1"], None),
        ("window (docs/design.md §4.1).", ["4.1"], None),
    ],
)
def test_the_citation_pattern_reads_every_form_in_use(
    text: str, sections: list[str], step: str | None
) -> None:
    m = CITATION.search(text)
    assert m is not None
    assert re.findall(r"\d+(?:\.\d+)*", m.group(1)) == sections
    assert m.group(3) == step


def test_the_scan_catches_a_missing_section_and_a_foreign_design_file() -> None:
    sections = _sections("## 1. One\n### 1.1 Sub\n1. first\n")
    assert set(sections) == {"1", "1.1"}
    m = CITATION.search("see docs/design.md §9.9")
    assert m is not None and m.group(2) == "9.9" and "9.9" not in sections
    assert [p.group(0) for p in ANY_DESIGN_PATH.finditer("notes/DESIGN.md and docs/design.md")] == [
        "notes/DESIGN.md",
        "docs/design.md",
    ]
    assert BARE_DESIGN.search("(DESIGN §3.6)")
