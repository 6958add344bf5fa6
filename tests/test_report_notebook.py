"""The executed analysis notebook and its HTML export have stable bytes: executing it again on the
same results rewrites nothing (no timestamps, durations or random cell ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("papermill", reason="the analysis extra (papermill, nbconvert) is not installed")

from isoexec.config import load_config  # noqa: E402
from isoexec.report.figures import write_figures  # noqa: E402
from isoexec.report.notebook import INJECTED_ID, run_notebook  # noqa: E402
from isoexec.report.tables import write_tables  # noqa: E402
from isoexec.settings import settings_record  # noqa: E402
from test_report_tables import write_synthetic_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_executing_twice_gives_the_same_bytes(tmp_path):
    exp = tmp_path / "results" / "nb"
    write_synthetic_runs(exp)
    write_tables(exp)
    write_figures(exp)
    (exp / "gates.csv").write_text("region,case_a,case_b,kernel_set,bitwise_equal\nlm_head,trainer_score,engine_decode,isoexec,True\n")
    (exp / "rollout_check.json").write_text(json.dumps({"results": [{"mode": "isoexec", "mismatch_count": 0}]}))
    (exp / "experiment.json").write_text(json.dumps(settings_record(load_config(ROOT / "experiments" / "ci-tiny.yaml"))))
    first = run_notebook(ROOT / "notebooks" / "analysis.ipynb", exp, tmp_path / "a")
    second = run_notebook(ROOT / "notebooks" / "analysis.ipynb", exp, tmp_path / "b")
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes(), a.name
    nb = json.loads(first[0].read_text())
    text = first[0].read_text()
    assert "start_time" not in text and "iopub" not in text and "duration" not in text
    assert INJECTED_ID in [c["id"] for c in nb["cells"]]
    assert nb["metadata"]["papermill"]["parameters"] == {"exp_dir": str(exp)}


def test_stream_outputs_split_by_flush_timing_are_joined():
    import nbformat

    from isoexec.report.notebook import stable_notebook

    def nb(*texts):
        cell = nbformat.v4.new_code_cell("print(1)", id="c")
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=t) for t in texts]
        cell.outputs.append(nbformat.v4.new_output("stream", name="stderr", text="w\n"))
        return nbformat.v4.new_notebook(cells=[cell])

    one, two = stable_notebook(nb("a\nb\n")), stable_notebook(nb("a", "\nb\n"))  # the same output, split elsewhere
    assert nbformat.writes(one) == nbformat.writes(two)
    assert [o["name"] for o in two.cells[0].outputs] == ["stdout", "stderr"]  # other streams stay apart
