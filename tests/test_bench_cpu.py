"""`isoexec bench` writes under runs/<exp>/bench/ (not committed) unless an output folder is given."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from isoexec.cli import app

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--repeats", "1", "--batch", "1", "--seq-len", "8", "--decode-seqs", "1", "--decode-steps", "1"]


def test_bench_leaves_committed_results_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["bench", "--config", str(ROOT / "experiments" / "ci-tiny.yaml"), *TINY])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "runs" / "ci-tiny" / "bench" / "model_throughput.csv").is_file()
    assert (tmp_path / "runs" / "ci-tiny" / "bench" / "model_throughput.provenance.json").is_file()
    assert not (tmp_path / "results").exists()
    on_purpose = CliRunner().invoke(app, ["bench", "--config", str(ROOT / "experiments" / "ci-tiny.yaml"), *TINY,
                                          "--out-dir", "results/ci-tiny/bench"])
    assert on_purpose.exit_code == 0, on_purpose.output
    assert (tmp_path / "results" / "ci-tiny" / "bench" / "model_throughput.csv").is_file()
