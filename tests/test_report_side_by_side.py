"""Experiments side by side (isoexec report side-by-side): each experiment's main-table rows under its name
and device, one figure with a column per experiment on shared axes, refusals."""

from __future__ import annotations

import json

import pandas as pd
from typer.testing import CliRunner

from isoexec.report import tables
from isoexec.report.cli import app
from isoexec.report.data import load_metrics
from isoexec.report.side_by_side import HEADERS, side_by_side_figure, write_side_by_side
from test_report_tables import write_synthetic_runs


def _experiments(tmp_path):
    cpu = write_synthetic_runs(tmp_path / "cpu-x")
    gpu = write_synthetic_runs(tmp_path / "gpu-x", arms=("native", "isoexec"), seeds=(0,), steps=(0, 1))
    (cpu / "experiment.json").write_text(json.dumps({"device": "cpu"}))
    (gpu / "experiment.json").write_text(json.dumps({"device": "cuda"}))
    return cpu, gpu


def test_rows_are_each_experiments_main_table_under_its_name_and_device(tmp_path):
    cpu, gpu = _experiments(tmp_path)
    files = write_side_by_side([cpu, gpu], gpu)
    assert {p.name for p in files} >= {"side_by_side.csv", "side_by_side.md", "side_by_side.png", "side_by_side.pdf"}
    got = pd.read_csv(gpu / "tables" / "side_by_side.csv", dtype=str, keep_default_na=False)
    assert list(zip(got["experiment"], got["device"], got["arm"])) == [
        ("cpu-x", "cpu", "native"), ("cpu-x", "cpu", "isoexec"), ("cpu-x", "cpu", "native-tis"),
        ("gpu-x", "cuda", "native"), ("gpu-x", "cuda", "isoexec")]
    assert list(got["seeds x steps"]) == ["2 x 3"] * 3 + ["1 x 2"] * 2
    for exp, rows in ((cpu, got[got["experiment"] == "cpu-x"]), (gpu, got[got["experiment"] == "gpu-x"])):
        shown, _ = tables.main_display(tables.summarize(load_metrics(exp)))
        for col in ("mismatched", "overhead", "reward_first", "time_step_s"):
            assert list(rows[HEADERS[col]]) == list(shown[col]), col
    assert list(got["reward window (steps)"]) == ["1"] * 5  # half the shortest run of each experiment
    assert got.loc[got["arm"] == "isoexec", "mismatched tokens / tokens"].str.startswith("0 / ").all()


def test_figure_has_a_column_per_experiment_on_one_step_axis(tmp_path):
    cpu, gpu = _experiments(tmp_path)
    fig = side_by_side_figure({"cpu-x": load_metrics(cpu), "gpu-x": load_metrics(gpu)}, {"cpu-x": "cpu", "gpu-x": "cuda"})
    axes = fig.axes
    assert len(axes) == 4
    assert axes[0].get_title() == "cpu-x (cpu)" and axes[1].get_title() == "gpu-x (cuda)"
    assert axes[0].get_xlim() == axes[1].get_xlim() == axes[3].get_xlim()  # shared step axis
    assert axes[0].get_ylim() == axes[1].get_ylim()
    assert [len(ax.get_lines()) for ax in axes] == [3, 2, 3, 2]


def test_one_experiment_or_one_named_twice_is_refused(tmp_path):
    cpu, _ = _experiments(tmp_path)
    r = CliRunner().invoke(app, ["side-by-side", "--exp-dir", str(cpu), "--out-dir", str(tmp_path)])
    assert r.exit_code != 0 and "two or more different experiments" in str(r.exception)
    r = CliRunner().invoke(app, ["side-by-side", "--exp-dir", str(cpu), "--exp-dir", str(cpu), "--out-dir", str(tmp_path)])
    assert r.exit_code != 0 and "two or more different experiments" in str(r.exception)
