"""Every citation of the design docs resolves: `docs/<page>.md` followed by a section
sign and a section number, anywhere in the repository's .py/.md/.toml/.yaml files, names
a page in docs/ with a heading of that number. Inside docs/ a bare section number means
the same page and `[page.md](page.md)` before one means that page. No citation of the
old, out-of-repository design file is left.

Plain text scanning, no imports of the code under test; this file itself is not scanned
(it spells the patterns it looks for).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml"}
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "node_modules",
             ".cache", ".whl", ".gl", "shared"}
SECTION = "\N{SECTION SIGN}"
NUMBER = r"\d+(?:\.\d+)*"
SECTION_REF = re.compile(rf"{SECTION}\s*({NUMBER})")
PATH_BEFORE = re.compile(r"docs/([\w-]+\.md) $")  # `docs/router.md ` right before the sign
LINK_BEFORE = re.compile(r"\]\(([\w-]+\.md)\) $")  # `[router.md](router.md) ` inside docs/
HEADING = re.compile(rf"^#{{1,6}}\s+({NUMBER})\.?\s", re.MULTILINE)
MD_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
OLD_DESIGN = re.compile(r"\bDESIGN\b")
MIN_CITATIONS = 20  # the code cites the docs about this often; far fewer means the scan broke


def scanned_files() -> list[Path]:
    files = []
    for directory, subdirs, names in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in names:
            path = Path(directory) / name
            if path.suffix in SUFFIXES and path.resolve() != Path(__file__).resolve():
                files.append(path)
    return sorted(files)


def sections(page: Path) -> set[str]:
    return set(HEADING.findall(page.read_text(encoding="utf-8")))


def citations() -> tuple[list[tuple[str, int, str, str]], list[str]]:
    """(where, line, page, section) of every citation, and the section signs that are no
    citation (outside docs/, a section number with no `docs/<page>.md` before it)."""
    found, orphans = [], []
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        in_docs = path.parent == DOCS
        for match in SECTION_REF.finditer(text):
            before = text[max(0, match.start() - 80):match.start()]
            line = text.count("\n", 0, match.start()) + 1
            where = str(path.relative_to(ROOT))
            page = PATH_BEFORE.search(before) or (LINK_BEFORE.search(before) if in_docs else None)
            if page is not None:
                found.append((where, line, page.group(1), match.group(1)))
            elif in_docs:
                found.append((where, line, path.name, match.group(1)))
            else:
                orphans.append(f"{where}:{line}: {match.group(0)!r} names no docs/<page>.md")
    return found, orphans


def test_every_citation_names_an_existing_page_and_section():
    found, _ = citations()
    assert len(found) >= MIN_CITATIONS, f"only {len(found)} citations found under {ROOT}"
    known: dict[str, set[str] | None] = {}
    broken = []
    for where, line, page, section in found:
        if page not in known:
            known[page] = sections(DOCS / page) if (DOCS / page).is_file() else None
        if known[page] is None:
            broken.append(f"{where}:{line}: docs/{page} does not exist")
        elif section not in known[page]:
            broken.append(f"{where}:{line}: docs/{page} has no section {section} "
                          f"(it has {', '.join(sorted(known[page], key=_key))})")
    assert not broken, "\n".join(broken)


def test_no_section_sign_outside_a_citation():
    _, orphans = citations()
    assert not orphans, "\n".join(orphans)


def test_no_citation_of_the_old_design_file_is_left():
    left = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for path in scanned_files()
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if OLD_DESIGN.search(line)]
    assert not left, "cite docs/<page>.md and a section instead:\n" + "\n".join(left)


def test_docs_pages_have_unique_sections_and_working_links():
    pages = sorted(DOCS.glob("*.md"))
    assert pages, f"no pages in {DOCS}"
    problems = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        numbers = HEADING.findall(text)
        problems += [f"{page.name}: section {n} appears twice" for n in sorted(set(numbers)) if numbers.count(n) > 1]
        problems += [f"{page.name}: link to {target}, which does not exist"
                     for target in MD_LINK.findall(text) if not (page.parent / target).is_file()]
    assert not problems, "\n".join(problems)


def _key(section: str) -> tuple[int, ...]:
    return tuple(int(part) for part in section.split("."))
