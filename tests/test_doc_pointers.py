"""Pointers from code to the docs stay valid (issue 35, "stale pointers"). Pure text scanning, no imports of flowrl.

Docstrings and comments cite the repository's documentation as ``docs/<page>.md``, optionally followed by a
quoted section title: ``(docs/algorithms.md, "Group advantages")``, more titles joined by ``and`` or a comma.
Every ``.py`` file under flowrl/, rewards/, tests/ and scripts/ is scanned (a pointer may wrap across lines,
in a docstring or in ``#`` comments): the page must exist, and a quoted title must be a heading of that page,
either its whole text or the text before a trailing parenthetical (``## Group advantages (`flowrl/credit/
group.py`, `credit.*`)`` is cited as "Group advantages").

The design notes and the algorithms spec the code once cited (ALGORITHMS.md / DESIGN.md, by numbered
section) are not part of the repository: no scanned file (nor README.md or docs/) may mention them or a bare
section-sign number.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("flowrl", "rewards", "tests", "scripts")
THIS = Path(__file__).resolve()

# docs/<page>.md, then optionally `, "Title"` (or ` ("Title"`), then further `and "Title"` / `, "Title"`.
POINTER = re.compile(r"docs/([\w./-]+?)\.md")
FIRST_TITLE = re.compile(r'(?:,\s*|\s*\()"([^"\n]+)"')
MORE_TITLES = re.compile(r'(?:,\s*|\s+and\s+)"([^"\n]+)"')
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
STALE = re.compile(r"ALGORITHMS\.md|DESIGN\.md|DESIGN invariant|\u00a7\s*\d")


def _py_files() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py") if p.resolve() != THIS)


def _joined(text: str) -> str:
    """The text with line breaks (and a continuation line's indentation and ``#``) folded into one space, so
    a pointer or a title that wraps across lines of a docstring or a comment reads as one line."""
    return re.sub(r"[ \t]*\n[ \t]*(?:#[ \t]*)?", " ", text)


def pointers(text: str) -> list[tuple[str, list[str]]]:
    """(page, [quoted section titles]) for every ``docs/<page>.md`` in ``text``."""
    text = _joined(text)
    found = []
    for m in POINTER.finditer(text):
        titles, pos = [], m.end()
        t = FIRST_TITLE.match(text, pos)
        while t:
            titles.append(t.group(1))
            pos = t.end()
            t = MORE_TITLES.match(text, pos)
        found.append((m.group(1), titles))
    return found


def headings(page: Path) -> set[str]:
    """Every heading of a markdown page (outside fenced code), whole and without a trailing parenthetical."""
    out, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            text = m.group(1)
            out.add(text)
            short = re.sub(r"\s*\([^()]*(?:\([^()]*\)[^()]*)*\)$", "", text)  # "Title (`path`, `key`)" → "Title"
            out.add(short)
    return out


def test_the_scanner_reads_the_pointer_forms():
    text = (
        'x (docs/a.md, "One") y docs/b.md z (docs/c.md,\n    "Two\n    words" and "Three").\n'
        '# see docs/d.md, "Wrapped\n# title"\n"docs/e.md", "not a title"'
    )
    assert pointers(text) == [
        ("a", ["One"]),
        ("b", []),
        ("c", ["Two words", "Three"]),
        ("d", ["Wrapped title"]),
        ("e", []),
    ]
    assert STALE.search("see ALGORITHMS.md") and STALE.search("(\u00a7 3)") and not STALE.search("docs/trees.md")


def test_headings_are_read_whole_and_without_their_trailing_parenthetical(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Top\n## Group advantages (`flowrl/credit/group.py`, `credit.*`)\n```\n# not a heading\n```\n")
    assert headings(page) == {"Top", "Group advantages (`flowrl/credit/group.py`, `credit.*`)", "Group advantages"}


def test_every_docs_pointer_names_an_existing_page_and_heading():
    bad, seen = [], 0
    cache: dict[str, set[str] | None] = {}
    for path in _py_files():
        for page, titles in pointers(path.read_text(encoding="utf-8")):
            seen += 1
            if page not in cache:
                md = ROOT / "docs" / f"{page}.md"
                cache[page] = headings(md) if md.is_file() else None
            where = path.relative_to(ROOT)
            if cache[page] is None:
                bad.append(f"{where}: docs/{page}.md does not exist")
                continue
            bad += [f'{where}: docs/{page}.md has no heading "{t}"' for t in titles if t not in cache[page]]
    assert seen > 0, "the scan found no docs/ pointer at all: the pattern is broken"
    assert not bad, "stale docs pointers:\n" + "\n".join(bad)


@pytest.mark.parametrize("where", ["code", "docs"])
def test_nothing_cites_the_external_spec_or_numbered_sections(where):
    if where == "code":
        files = _py_files()
    else:
        files = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    bad = []
    for path in files:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if STALE.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, (
        "these cite ALGORITHMS.md / DESIGN.md or a numbered section, which are not in the repository; "
        'point to the docs page and section instead, e.g. (docs/algorithms.md, "Group advantages"):\n' + "\n".join(bad)
    )
