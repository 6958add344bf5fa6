"""Reruns of the RL stage and the interval a further run's step overhead lands in: the
prediction interval (its coverage, with the confidence interval of the mean as the negative control), and the
reruns table and main-table column on synthetic runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from isoexec.report import reruns, tables
from isoexec.report.data import load_metrics
from tests.test_report_tables import write_synthetic_runs


def test_prediction_interval_by_hand():
    m, lo, hi = reruns.prediction_interval([1.0, 2.0, 3.0, 4.0], k=2)
    h = 3.18245 * np.std([1, 2, 3, 4], ddof=1) * math.sqrt(1 / 2 + 1 / 4)
    assert (m, lo, hi) == pytest.approx((2.5, 2.5 - h, 2.5 + h), abs=1e-3)
    with pytest.raises(ValueError, match="at least 2 units and k >= 1, got 1 units"):
        reruns.prediction_interval([1.0], k=3)


def test_a_further_runs_mean_lands_in_the_prediction_interval_95_percent_of_the_time_and_not_in_the_mean_s():
    rng = np.random.default_rng(0)
    n, k, trials = 6, 3, 4000
    t = 2.5706  # t(0.975, 5) from the tables
    pred = conf = 0
    for _ in range(trials):
        units, further = rng.normal(5.0, 2.0, n), rng.normal(5.0, 2.0, k).mean()
        m, lo, hi = reruns.prediction_interval(units, k)
        pred += lo <= further <= hi
        half = t * units.std(ddof=1) / math.sqrt(n)  # negative control: the interval of the mean alone
        conf += m - half <= further <= m + half
    assert 0.935 < pred / trials < 0.965
    assert conf / trials < 0.85


def _scale_isoexec(run_root: Path, factors: dict[int, float]) -> None:
    """Multiply the isoexec runs' step times by a factor per seed (a run whose overhead differs)."""
    for seed, f in factors.items():
        path = run_root / "rl" / "isoexec" / f"seed{seed}" / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for r in rows:
            for key in ("time/generation", "time/score", "time/train", "time/weight_sync", "time/step"):
                r[key] *= f
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def exp_with_reruns(tmp_path: Path) -> Path:
    exp = write_synthetic_runs(tmp_path / "results" / "synthetic", arms=("native", "isoexec"))
    for name, factors in (("1", {0: 1.05, 1: 0.97}), ("2", {0: 1.5, 1: 1.6})):
        write_synthetic_runs(exp / "reruns" / name, arms=("native", "isoexec"))
        _scale_isoexec(exp / "reruns" / name, factors)
    return exp


def test_rerun_table_predicts_each_run_from_the_runs_before_it(exp_with_reruns):
    table = reruns.rerun_table(exp_with_reruns)
    assert list(table["run"]) == ["committed", "1", "2", "further run"]
    per_run = {r: list(reruns.seed_overheads(tables.paired_times(load_metrics(d)))["isoexec"].values())
               for r, d in reruns.run_dirs(exp_with_reruns)}
    means = {r: float(np.mean(u)) for r, u in per_run.items()}
    row = table.set_index("run").loc
    assert math.isnan(row["committed", "predicted_lo"]) and row["committed", "inside"] is None
    assert math.isnan(row["1", "predicted_lo"])  # one run before it: no spread between runs to go by
    _, lo, hi = reruns.prediction_interval([means["committed"], means["1"]], k=1)  # runs as units
    assert (row["2", "predicted_lo"], row["2", "predicted_hi"]) == pytest.approx((lo, hi))
    _, plo, phi = reruns.prediction_interval(per_run["committed"] + per_run["1"], k=2)  # seeds pooled
    assert (row["2", "pooled_lo"], row["2", "pooled_hi"]) == pytest.approx((plo, phi))
    assert row["2", "overhead_pct"] == pytest.approx(means["2"])
    assert row["2", "inside_pooled"] is False  # the 1.5x / 1.6x run is far outside what the pooled seeds predicted
    m, lo, hi = reruns.prediction_interval(list(means.values()), k=1)
    assert (row["further run", "overhead_pct"], row["further run", "predicted_lo"]) == pytest.approx((m, lo))


def test_with_a_shift_per_run_the_runs_as_units_interval_keeps_its_coverage_and_pooled_seeds_do_not():
    rng = np.random.default_rng(1)
    runs, k, trials = 3, 3, 4000
    by_runs = pooled = 0
    for _ in range(trials):
        shifts = rng.normal(0.0, 2.0, runs + 1)  # one shift per run (the hour), seeds spread 1 around it
        seeds = shifts[:, None] + rng.normal(5.0, 1.0, (runs + 1, k))
        further = seeds[-1].mean()
        _, lo, hi = reruns.prediction_interval(seeds[:-1].mean(1), k=1)
        by_runs += lo <= further <= hi
        _, lo, hi = reruns.prediction_interval(seeds[:-1].ravel(), k=k)  # negative control
        pooled += lo <= further <= hi
    assert 0.935 < by_runs / trials < 0.965
    assert pooled / trials < 0.85


def test_a_partial_rerun_is_refused_and_no_table_is_rewritten(exp_with_reruns):
    import shutil

    from isoexec.report.data import MetricsError

    tables.write_tables(exp_with_reruns)
    before = (exp_with_reruns / "tables" / "summary.md").read_text()
    shutil.rmtree(exp_with_reruns / "reruns" / "2" / "rl" / "native" / "seed1")
    with pytest.raises(MetricsError, match=r"must hold the committed run's arms and seeds; missing: native/seed1; "
                                           r"not in the committed run: none"):
        tables.write_tables(exp_with_reruns)
    assert (exp_with_reruns / "tables" / "summary.md").read_text() == before


def test_reruns_are_ordered_by_number(exp_with_reruns):
    (exp_with_reruns / "reruns" / "2").rename(exp_with_reruns / "reruns" / "10")
    write_synthetic_runs(exp_with_reruns / "reruns" / "3", arms=("native", "isoexec"))
    assert [n for n, _ in reruns.run_dirs(exp_with_reruns)] == ["committed", "1", "3", "10"]


def test_tables_gain_the_reruns_table_and_a_main_column_only_where_reruns_exist(exp_with_reruns, tmp_path):
    tables.write_tables(exp_with_reruns)
    main = (exp_with_reruns / "tables" / "main.md").read_text()
    assert "a further run's step overhead [95% prediction, runs as units]" in main
    assert "| committed | f00d |" in (exp_with_reruns / "tables" / "reruns.md").read_text()
    plain = write_synthetic_runs(tmp_path / "results" / "plain", arms=("native", "isoexec"))
    tables.write_tables(plain)
    assert not (plain / "tables" / "reruns.md").exists()
    assert "prediction" not in (plain / "tables" / "main.md").read_text()
    tables.write_tables(exp_with_reruns, arms=["native", "isoexec"], seeds=[0, 1])  # every run, named (snakemake)
    assert "prediction" in (exp_with_reruns / "tables" / "main.md").read_text()
    tables.write_tables(exp_with_reruns, seeds=[0])  # a selection of runs: no rerun statement
    assert "prediction" not in (exp_with_reruns / "tables" / "main.md").read_text()
