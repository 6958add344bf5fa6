"""Summary tables from synthetic paired runs: hand-checked aggregates, exact zeros, atomic writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from isoexec.report import tables
from isoexec.report.cli import app
from isoexec.report.data import MetricsError, atomic_write_text, load_metrics

MODES = ("native", "isoexec")
SEEDS = (0, 1)
STEPS = (0, 1, 2)
# time/step per (mode, seed) and step: overheads per step are seed0 +20/+30/+10 %, seed1 +25/+10/+30 %.
STEP_TIME = {
    ("native", 0): [10.0, 10.0, 10.0],
    ("isoexec", 0): [12.0, 13.0, 11.0],
    ("native", 1): [20.0, 20.0, 20.0],
    ("isoexec", 1): [25.0, 22.0, 28.0],
}
TOKENS = {0: 100, 1: 300}  # tokens per step, by seed


def token_diffs(mode: str, seed: int, step: int) -> np.ndarray:
    """|trainer - rollout| per token: exactly 0 for isoexec, a spread of values for native."""
    n = TOKENS.get(seed, 50)
    if mode == "isoexec":
        return np.zeros(n)
    rng = np.random.default_rng(1000 * seed + step)
    return np.abs(rng.normal(0.01 * (step + 1 + seed), 0.01, n))


def write_synthetic_runs(exp_dir: Path, modes=MODES, seeds=SEEDS, steps=STEPS) -> Path:
    """results/<exp>/rl/<mode>/seed<k>/{metrics.jsonl,provenance.json} as the RL layer writes them."""
    for mode in modes:
        for seed in seeds:
            run = exp_dir / "rl" / mode / f"seed{seed}"
            run.mkdir(parents=True, exist_ok=True)
            rows = []
            for step in steps:
                d = token_diffs(mode, seed, step)
                t_step = STEP_TIME.get((mode, seed), [10.0] * len(steps))[step % 3]
                rows.append(
                    {
                        "step": step,
                        "mode": mode,
                        "seed": seed,
                        "tokens": len(d),
                        "mismatch_count": int((d != 0).sum()),
                        "mismatch_rate": float((d != 0).mean()),
                        "logprob_abs_diff_mean": float(d.mean()),
                        "logprob_abs_diff_std": float(d.std()),
                        "logprob_abs_diff_max": float(d.max()),
                        "k3_kl": float(np.mean(np.exp(d) - d - 1)),
                        "is_ratio_mean": float(np.exp(d).mean()),
                        "is_ratio_min": float(np.exp(d).min()),
                        "is_ratio_max": float(np.exp(d).max()),
                        "is_ratio_clip_frac": float(((np.exp(d) < 0.8) | (np.exp(d) > 1.28)).mean()),
                        "seqs": 8,
                        "prompt_tokens": 8 * 70,
                        "seqs_cross_chunk": 6 + (step == 1) * (mode == "isoexec"),
                        "seqs_cross_chunk_prefill": 6,
                        "seqs_cross_chunk_decode": (step == 1) * (mode == "isoexec"),
                        "seqs_multi_kv_block": 8,
                        "seq_len_max": 100 + 10 * step,
                        "full_vocab_kl": 0.0 if mode == "isoexec" else 1e-3,
                        "reward_mean": 0.1 * (step + 1) + 0.2 * seed,
                        "pass_at_k": 0.2 * (step + 1),
                        "response_length_mean": 12.0,
                        "entropy_mean": 1.5,
                        "grad_norm": 0.7,
                        "loss": 0.05,
                        "time/generation": 0.5 * t_step,
                        "time/score": 0.1 * t_step,
                        "time/train": 0.3 * t_step,
                        "time/weight_sync": 0.1 * t_step,
                        "time/step": t_step,
                    }
                )
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (run / "provenance.json").write_text(json.dumps({"git": {"commit": "f00d", "dirty": False}, "hostname": "test"}))
    return exp_dir


@pytest.fixture
def exp_dir(tmp_path: Path) -> Path:
    return write_synthetic_runs(tmp_path / "results" / "synthetic")


def _row(summary: pd.DataFrame, mode: str) -> pd.Series:
    return summary.set_index("mode").loc[mode]


def test_diff_mean_and_std_equal_the_token_level_statistics(exp_dir):
    summary = tables.summarize(load_metrics(exp_dir))
    all_tokens = np.concatenate([token_diffs("native", s, t) for s in SEEDS for t in STEPS])
    native = _row(summary, "native")
    assert native["logprob_abs_diff_mean"] == pytest.approx(all_tokens.mean(), rel=1e-12)
    assert native["logprob_abs_diff_std"] == pytest.approx(all_tokens.std(), rel=1e-9)
    per_step_max = [token_diffs("native", s, t).max() for s in SEEDS for t in STEPS]
    assert native["logprob_abs_diff_max_mean"] == pytest.approx(np.mean(per_step_max), rel=1e-12)
    assert native["logprob_abs_diff_max"] == pytest.approx(max(per_step_max), rel=1e-12)
    assert native["tokens"] == 3 * (100 + 300)
    assert native["mismatch_count"] == int((all_tokens != 0).sum())


def test_isoexec_diffs_stay_exactly_zero(exp_dir):
    tables.write_tables(exp_dir)
    summary = pd.read_csv(exp_dir / "tables" / "summary.csv")
    iso = _row(summary, "isoexec")
    for col in ("logprob_abs_diff_mean", "logprob_abs_diff_std", "logprob_abs_diff_max_mean", "logprob_abs_diff_max", "k3_kl"):
        assert iso[col] == 0.0, col
    assert iso["mismatch_count"] == 0 and iso["tokens"] == 1200
    md = (exp_dir / "tables" / "summary.md").read_text()
    iso_line = next(line for line in md.splitlines() if line.startswith("| isoexec"))
    assert iso_line.split(" | ")[1:5] == ["0", "0", "0", "0"]


def test_negative_control_native_diffs_are_nonzero(exp_dir):
    native = _row(tables.summarize(load_metrics(exp_dir)), "native")
    assert native["logprob_abs_diff_mean"] > 0 and native["logprob_abs_diff_max_mean"] > 0


def test_overhead_is_paired_per_step_within_seed_then_averaged(exp_dir):
    summary = tables.summarize(load_metrics(exp_dir))
    per_step = [30, 10, 10, 40]  # by hand from STEP_TIME, without each run's first (warm-up) step
    iso = _row(summary, "isoexec")
    assert iso["overhead_pct"] == pytest.approx(np.mean(per_step), rel=1e-12)  # 22.5 %
    # not the ratio of the means (23.3 %): the pairing matters
    assert iso["overhead_pct"] != pytest.approx(100 * (np.mean([13, 11, 22, 28]) / 15 - 1), rel=1e-3)
    assert iso["overhead_generation_pct"] == pytest.approx(np.mean(per_step), rel=1e-12)
    assert iso["time_step_s"] == pytest.approx(np.mean([13, 11, 22, 28]))  # warm-up steps 12 and 25 left out
    assert math.isnan(_row(summary, "native")["overhead_pct"])


def test_reward_first_and_last_windows_are_means_over_steps_then_seeds(exp_dir, monkeypatch):
    native = _row(tables.summarize(load_metrics(exp_dir)), "native")
    # 3 steps < the 10-step window: both ends are the whole run (0.2 for seed 0, 0.4 for seed 1)
    assert native["reward_first10"] == pytest.approx(0.3) and native["reward_last10"] == pytest.approx(0.3)
    monkeypatch.setattr(tables, "REWARD_WINDOW", 2)
    native = _row(tables.summarize(load_metrics(exp_dir)), "native")
    assert native["reward_first10"] == pytest.approx(((0.1 + 0.2) / 2 + (0.3 + 0.4) / 2) / 2)
    assert native["reward_last10"] == pytest.approx(((0.2 + 0.3) / 2 + (0.4 + 0.5) / 2) / 2)


def test_exposure_and_ratio_columns_sit_beside_mismatch_count(exp_dir):
    summary = tables.summarize(load_metrics(exp_dir))
    cols = list(summary.columns)
    native, iso = _row(summary, "native"), _row(summary, "isoexec")
    assert native["seqs"] == 2 * 3 * 8 and native["seqs_cross_chunk"] == 2 * 3 * 6
    assert native["cross_chunk_frac_min"] == pytest.approx(6 / 8)
    assert native["seq_len_max"] == 120 and native["prompt_tokens"] == 2 * 3 * 8 * 70
    assert iso["is_ratio_min"] == iso["is_ratio_max"] == 1.0 and iso["is_ratio_clip_frac"] == 0.0
    assert native["is_ratio_max"] > 1.0
    assert cols[cols.index("mismatch_count"):cols.index("seq_len_max") + 1] == [
        "mismatch_count", "tokens", "mismatch_rate", "prompt_tokens", "seqs", "seqs_cross_chunk",
        "cross_chunk_frac_min", "seqs_multi_kv_block", "seq_len_max"]
    old = load_metrics(exp_dir).drop(columns=["seqs_cross_chunk"])  # metrics from before the counters
    assert math.isnan(_row(tables.summarize(old), "native")["seqs_cross_chunk"])


def test_per_seed_table_pairs_within_its_seed(exp_dir):
    per_seed = tables.summarize_per_seed(load_metrics(exp_dir)).set_index(["mode", "seed"])
    assert per_seed.loc[("isoexec", 0), "overhead_pct"] == pytest.approx(20.0)
    assert per_seed.loc[("isoexec", 1), "overhead_pct"] == pytest.approx(25.0)
    assert per_seed.loc[("native", 1), "tokens"] == 900


def test_written_files_exist_and_carry_provenance(exp_dir):
    paths = tables.write_tables(exp_dir)
    out = exp_dir / "tables"
    for name in ("summary.csv", "summary.md", "summary.tex", "summary.provenance.json", "per_seed.csv", "comparison.md"):
        assert (out / name) in paths and (out / name).stat().st_size > 0, name
    assert list(pd.read_csv(out / "summary.csv")["mode"]) == ["native", "isoexec"]
    prov = json.loads((out / "summary.provenance.json").read_text())
    assert len(prov["inputs"]) == 4 and all(len(i["sha256"]) == 64 for i in prov["inputs"])
    assert {p["git"]["commit"] for p in prov["runs"].values()} == {"f00d"}
    assert (out / "summary.md").read_text().startswith("<!--\n  generated by:")
    assert (out / "summary.tex").read_text().startswith("% generated by:")
    assert r"\begin{tabular}" in (out / "summary.tex").read_text()


def test_main_table_is_compact_with_readable_headers_and_units(exp_dir):
    tables.write_tables(exp_dir)
    out = exp_dir / "tables"
    main = pd.read_csv(out / "main.csv")
    assert list(main.columns) == list(tables.MAIN_HEADERS.values()) and len(main.columns) <= 10
    summary = pd.read_csv(out / "summary.csv").set_index("mode")
    for col, header in tables.MAIN_HEADERS.items():  # the same numbers as the full table
        if col != "mode":
            pd.testing.assert_series_equal(main.set_index("mode")[header], summary[col], check_names=False)
    md = (out / "main.md").read_text()
    assert "| mode | mean abs logprob diff (nats) |" in md and "logprob_abs_diff" not in md.split("-->", 1)[1]
    assert "step (s)" in (out / "main.tex").read_text()


def test_blog_number_format():
    assert tables.format_scientific(1.648e-2) == "1.648e-2"
    assert tables.format_scientific(5.073) == "5.073e0"
    assert tables.format_scientific(0.0) == "0"
    assert tables.format_value("overhead_pct", 31.3) == "+31.3%"
    assert tables.format_value("time_step_s", 1224.64) == "1224.6"
    assert tables.format_value("overhead_pct", float("nan")) == ""


def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "summary.csv"
    atomic_write_text(target, "old\n")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("isoexec.io.os.replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, "new\n")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.csv"]  # no temp file left behind


def test_failed_table_render_leaves_the_old_table(exp_dir, monkeypatch):
    tables.write_tables(exp_dir)
    tex = exp_dir / "tables" / "summary.tex"
    before = tex.read_text()

    def broken(*args, **kwargs):
        raise RuntimeError("render failed")

    monkeypatch.setattr(tables, "to_latex", broken)
    with pytest.raises(RuntimeError):
        tables.write_tables(exp_dir)
    assert tex.read_text() == before


def test_missing_key_is_named(exp_dir):
    path = exp_dir / "rl" / "native" / "seed0" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    del rows[1]["time/train"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2: missing key\(s\) time/train"):
        load_metrics(exp_dir)


def test_requested_run_that_is_missing_fails(exp_dir):
    with pytest.raises(MetricsError, match="isoexec/seed7"):
        load_metrics(exp_dir, modes=["native", "isoexec"], seeds=[0, 7])


def test_selection_ignores_stale_runs(exp_dir):
    write_synthetic_runs(exp_dir, seeds=(5,))  # a run of an older config
    summary = tables.summarize(load_metrics(exp_dir, seeds=[0, 1]))
    assert set(summary["n_seeds"]) == {2}


def test_cli_writes_tables(exp_dir):
    result = CliRunner().invoke(app, ["tables", "--exp-dir", str(exp_dir), "--seed", "0", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "summary.csv" in result.output
