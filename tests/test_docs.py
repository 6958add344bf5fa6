"""The repository's documents: nothing cites a document the repository does not hold, references to
docs/design.md name its sections, and the README's table is the committed run's."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"


def tracked_text_files() -> list[Path]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    out = []
    for n in names:
        p = ROOT / n
        if p.is_file() and p.suffix not in (".png", ".pdf", ".safetensors"):
            out.append(p)
    return out


def test_no_file_cites_a_document_outside_the_repository():
    """The design lives in docs/design.md: no DESIGN.md, no ../shared, no briefs from outside."""
    outside = re.compile(r"DESIGN(\.md| ?§| section)|\.\./shared|ENVIRONMENT\.md|STYLE\.md|design brief")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in tracked_text_files() if p != DESIGN
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(line)]
    assert not hits, hits


def test_references_to_the_design_name_its_sections():
    headings = [h.strip() for h in re.findall(r"^#+ (.+)$", DESIGN.read_text(), re.M)]
    bad = []
    for p in tracked_text_files():
        for m in re.finditer(r"docs/design\.md(?:, | \()\"?([^\"):;\n\\]+)", p.read_text(errors="replace")):
            name = m.group(1).strip().rstrip(".,")
            if not any(name.startswith(h) or h.startswith(name) for h in headings):
                bad.append(f"{p.relative_to(ROOT)}: {name!r}")
    assert not bad, (bad, headings)
