"""Summary tables from synthetic paired runs of three arms: hand-checked aggregates, exact zeros, paired
overheads and their bootstrap intervals, atomic writes."""

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

ARMS = ("native", "isoexec", "native-tis")
SEEDS = (0, 1)
STEPS = (0, 1, 2)
# time/step per (arm, seed) and step (an unlisted run: 10 s per step)
STEP_TIME = {
    ("native", 0): [10.0, 10.0, 10.0],
    ("isoexec", 0): [12.0, 13.0, 11.0],
    ("native", 1): [20.0, 20.0, 20.0],
    ("isoexec", 1): [25.0, 22.0, 28.0],
}
TOKENS = {0: 100, 1: 300}  # tokens per step, by seed


def token_diffs(arm: str, seed: int, step: int) -> np.ndarray:
    """|trainer - rollout| per token: exactly 0 for isoexec, a spread of values for the native stack."""
    n = TOKENS.get(seed, 50)
    if arm == "isoexec":
        return np.zeros(n)
    rng = np.random.default_rng(1000 * seed + step + 100 * (arm != "native"))
    return np.abs(rng.normal(0.01 * (step + 1 + seed), 0.01, n))


def write_synthetic_runs(exp_dir: Path, arms=ARMS, seeds=SEEDS, steps=STEPS) -> Path:
    """results/<exp>/rl/<arm>/seed<k>/{metrics.jsonl,provenance.json} as the RL layer writes them (native-tis:
    the native stack, with its TIS statistics)."""
    for arm in arms:
        for seed in seeds:
            run = exp_dir / "rl" / arm / f"seed{seed}"
            run.mkdir(parents=True, exist_ok=True)
            rows = []
            for step in steps:
                d = token_diffs(arm, seed, step)
                t_step = STEP_TIME.get((arm, seed), [10.0] * 3)[step % 3]
                rows.append(
                    {
                        "step": step,
                        "arm": arm,
                        "mode": "isoexec" if arm == "isoexec" else "native",
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
                        "seqs_cross_chunk": 6 + (step == 1) * (arm == "isoexec"),
                        "seqs_cross_chunk_prefill": 6,
                        "seqs_cross_chunk_decode": (step == 1) * (arm == "isoexec"),
                        "seqs_multi_kv_block": 8,
                        "seq_len_max": 100 + 10 * step,
                        "full_vocab_kl": 0.0 if arm == "isoexec" else 1e-3,
                        "tis_capped_frac": 0.01 * step if arm == "native-tis" else None,
                        "correction_masked_frac": None,
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


def _row(summary: pd.DataFrame, arm: str) -> pd.Series:
    return summary.set_index("arm").loc[arm]


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
    assert iso_line.split(" | ")[1:6] == ["isoexec", "0", "0", "0", "0"]  # arm, mode, then the diffs


def test_negative_control_native_diffs_are_nonzero(exp_dir):
    native = _row(tables.summarize(load_metrics(exp_dir)), "native")
    assert native["logprob_abs_diff_mean"] > 0 and native["logprob_abs_diff_max_mean"] > 0
    tis = _row(tables.summarize(load_metrics(exp_dir)), "native-tis")
    assert tis["mode"] == "native" and tis["logprob_abs_diff_mean"] > 0 and tis["mismatch_count"] > 0


def test_overhead_is_paired_within_seed_then_averaged_over_seeds(exp_dir):
    summary = tables.summarize(load_metrics(exp_dir))
    # by hand from STEP_TIME, without each run's first (warm-up) step: seed 0 (13 + 11) / (10 + 10) = +20 %,
    # seed 1 (22 + 28) / (20 + 20) = +25 %
    iso = _row(summary, "isoexec")
    assert iso["overhead_pct"] == pytest.approx(22.5, rel=1e-12)
    # not the ratio of the means over all seeds (23.3 %): the pairing within a seed matters
    assert iso["overhead_pct"] != pytest.approx(100 * (np.mean([13, 11, 22, 28]) / 15 - 1), rel=1e-3)
    assert iso["overhead_generation_pct"] == pytest.approx(22.5, rel=1e-12)
    assert iso["time_step_s"] == pytest.approx(np.mean([13, 11, 22, 28]))  # warm-up steps 12 and 25 left out
    assert iso["overhead_pct_lo"] <= 20.0 + 1e-9 and iso["overhead_pct_hi"] >= 25.0 - 1e-9  # the seeds' spread
    assert _row(summary, "native-tis")["overhead_pct"] == pytest.approx((0.0 - 50.0) / 2)  # 10 s steps: vs 10 s, vs 20 s
    assert all(math.isnan(_row(summary, "native")[c]) for c in ("overhead_pct", "overhead_pct_lo", "overhead_pct_hi"))


def test_overhead_sums_the_seeds_steps_before_dividing():
    """A run's overhead is its summed time over native's on the same steps, not the mean of per-step
    ratios: one slow step of native (30 s) weighs by its seconds, not as one ratio in three."""
    rows = [{"arm": a, "mode": "native", "seed": 0, "step": k, "time/step": t}
            for a, times in (("native", [9, 10, 30]), ("other", [9, 20, 30])) for k, t in enumerate(times)]
    pct, lo, hi = tables.phase_overhead(pd.DataFrame(rows), "other")
    assert pct == pytest.approx(100 * (50 / 40 - 1))  # +25 %; the mean of the step ratios would be +50 %
    assert lo <= pct <= hi


def test_bootstrap_interval_spans_the_seeds_and_is_reproducible():
    # two seeds whose every step has the same ratio (1.2 and 1.4): resampling steps moves nothing, resampling
    # the seeds gives 1.2, 1.3 or 1.4 (1/4, 1/2, 1/4), so the 95% interval is exactly [1.2, 1.4]
    base = np.full(5, 10.0)
    per_seed = [(1.2 * base, base), (1.4 * base, base)]
    assert tables.bootstrap_interval(per_seed) == pytest.approx((1.2, 1.4))
    assert tables.bootstrap_interval(per_seed) == tables.bootstrap_interval(per_seed)  # a fixed seed: same tables
    # one seed: the interval comes from its steps alone; one step of one seed: none
    noisy = np.array([10.0, 12.0, 9.0, 15.0, 11.0])
    lo, hi = tables.bootstrap_interval([(noisy, base)])
    assert lo < noisy.sum() / base.sum() < hi
    assert all(math.isnan(x) for x in tables.bootstrap_interval([(noisy[:1], base[:1])]))


def test_bootstrap_resamples_step_pairs_so_a_drift_shared_by_both_arms_cancels():
    # the machine drifts step by step (both arms alike, as when they alternate step by step) and the arm is
    # exactly 1.1x native at every step: resampling (arm, native) pairs of one step index keeps 1.1 exactly
    rng = np.random.default_rng(0)
    drift = [rng.uniform(1.0, 3.0, 50) for _ in range(3)]
    paired = [(1.1 * d, d) for d in drift]
    assert tables.bootstrap_interval(paired) == pytest.approx((1.1, 1.1))
    # negative control: the same times with the pairs broken (arm's steps shuffled) give a wide interval
    broken = [(rng.permutation(a), b) for a, b in paired]
    lo, hi = tables.bootstrap_interval(broken)
    assert hi - lo > 0.1


def test_reward_window_is_ten_steps_or_half_a_short_run(exp_dir):
    native = _row(tables.summarize(load_metrics(exp_dir)), "native")
    # 3 steps: one step at each end (seed 0: 0.1 -> 0.3, seed 1: 0.3 -> 0.5), not the whole run twice
    assert native["reward_window"] == 1
    assert native["reward_first"] == pytest.approx((0.1 + 0.3) / 2) and native["reward_last"] == pytest.approx((0.3 + 0.5) / 2)
    long_runs = write_synthetic_runs(exp_dir.parent / "long", steps=range(24))
    assert tables.reward_window(load_metrics(long_runs)) == 10
    assert tables.reward_window(load_metrics(write_synthetic_runs(exp_dir.parent / "mid", steps=range(12)))) == 6
    assert tables.reward_headers(1) == {"reward_first": "reward, first step", "reward_last": "reward, last step"}


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
    per_seed = tables.summarize_per_seed(load_metrics(exp_dir)).set_index(["arm", "seed"])
    assert per_seed.loc[("isoexec", 0), "overhead_pct"] == pytest.approx(20.0)
    assert per_seed.loc[("isoexec", 1), "overhead_pct"] == pytest.approx(25.0)
    assert per_seed.loc[("native", 1), "tokens"] == 900


def test_written_files_exist_and_carry_provenance(exp_dir):
    paths = tables.write_tables(exp_dir)
    out = exp_dir / "tables"
    for name in ("summary.csv", "summary.md", "summary.tex", "summary.provenance.json", "per_seed.csv", "comparison.md",
                 "timing.csv", "timing.md"):
        assert (out / name) in paths and (out / name).stat().st_size > 0, name
    assert list(pd.read_csv(out / "summary.csv")["arm"]) == ["native", "isoexec", "native-tis"]
    prov = json.loads((out / "summary.provenance.json").read_text())
    assert len(prov["inputs"]) == 6 and all(len(i["sha256"]) == 64 for i in prov["inputs"])
    assert {p["git"]["commit"] for p in prov["runs"].values()} == {"f00d"}
    assert (out / "summary.md").read_text().startswith("<!--\n  generated by:")
    assert (out / "summary.tex").read_text().startswith("% generated by:")
    assert r"\begin{tabular}" in (out / "summary.tex").read_text()


def test_main_table_is_compact_with_readable_headers_and_units(exp_dir):
    tables.write_tables(exp_dir)
    out = exp_dir / "tables"
    main = pd.read_csv(out / "main.csv")
    headers = {**tables.MAIN_HEADERS, **tables.reward_headers(1)}  # 3-step runs: one step at each end
    assert list(main.columns) == list(headers.values())
    summary = pd.read_csv(out / "summary.csv").set_index("arm")
    for col, header in headers.items():  # the same numbers as the full table
        if col != "arm":
            pd.testing.assert_series_equal(main.set_index("arm")[header], summary[col], check_names=False)
    md = (out / "main.md").read_text()
    table = [line for line in md.split("-->", 1)[1].splitlines() if line.startswith("|")]
    assert table[0].count("|") - 1 <= 10  # compact: at most 10 columns shown
    assert table[0].startswith("| arm | mean abs logprob diff (nats) |") and "logprob_abs_diff" not in md.split("-->", 1)[1]
    assert "| reward, first step | reward, last step |" in table[0]
    iso = next(line for line in table if line.startswith("| isoexec"))
    assert "| 0 / 1200 |" in iso and f"+22.5% [{summary.loc['isoexec', 'overhead_pct_lo']:+.1f}, " in iso
    assert "step (s)" in (out / "main.tex").read_text()


def test_timing_table_gives_each_phase_its_spread_over_steps_and_seeds(exp_dir):
    timing = tables.summarize_timing(load_metrics(exp_dir)).set_index(["arm", "phase"])
    assert len(timing) == 3 * 5
    step = timing.loc[("isoexec", "step")]
    assert step["time_s"] == pytest.approx(np.mean([13, 11, 22, 28]))
    assert step["time_sd_step"] == pytest.approx(math.sqrt((np.var([13, 11], ddof=1) + np.var([22, 28], ddof=1)) / 2))
    assert step["time_sd_seed"] == pytest.approx(np.std([12, 25], ddof=1))
    assert step["overhead_pct"] == pytest.approx(22.5) and step["overhead_pct_lo"] <= 22.5 <= step["overhead_pct_hi"]
    assert math.isnan(timing.loc[("native", "step"), "overhead_pct"])


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
        load_metrics(exp_dir, arms=["native", "isoexec"], seeds=[0, 7])


def test_runs_written_before_arms_existed_are_read_by_their_mode(exp_dir):
    path = exp_dir / "rl" / "isoexec" / "seed0" / "metrics.jsonl"
    rows = [{k: v for k, v in json.loads(line).items() if k not in ("arm", "tis_capped_frac", "correction_masked_frac")}
            for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = load_metrics(exp_dir)
    assert set(df.loc[df["seed"] == 0, "arm"]) == set(ARMS)
    bad = [{**r, "mode": "native"} for r in rows]  # a row whose mode is not its folder's
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(MetricsError, match="mode='native' but the folder says 'isoexec'"):
        load_metrics(exp_dir)


def test_selection_ignores_stale_runs(exp_dir):
    write_synthetic_runs(exp_dir, seeds=(5,))  # a run of an older config
    summary = tables.summarize(load_metrics(exp_dir, seeds=[0, 1]))
    assert set(summary["n_seeds"]) == {2}


def test_cli_writes_tables(exp_dir):
    result = CliRunner().invoke(app, ["tables", "--exp-dir", str(exp_dir), "--seed", "0", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "summary.csv" in result.output


def test_runs_column_names_a_run_cut_short(exp_dir):
    """An arm whose seeds ran different numbers of steps is not reported as seeds x its longest run."""
    summary = tables.summarize(load_metrics(exp_dir))
    assert _row(summary, "native")["runs"] == "2 x 3"
    df = load_metrics(exp_dir)
    cut = df[~((df["arm"] == "isoexec") & (df["seed"] == 1) & (df["step"] == 2))]
    summary = tables.summarize(cut)
    assert _row(summary, "isoexec")["runs"] == "3 + 2 steps" and _row(summary, "isoexec")["n_steps"] == 3
    assert _row(summary, "native")["runs"] == "2 x 3"
