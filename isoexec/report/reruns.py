"""Reruns of an experiment's RL stage, and the interval a further run's step overhead should land in.

Layout: the committed run is ``<exp_dir>/rl/``; each rerun of the same stage (same experiment, same kind of
machine, the same arms and seeds) is ``<exp_dir>/reruns/<name>/rl/<arm>/seed<k>/metrics.jsonl``, ordered by
``<name>`` (numerically where the names are numbers).

A run's step overhead (per arm, against native) is the mean over its seeds of the per-seed paired overhead
(:func:`isoexec.report.stats.paired_times`: the arm's summed step time over native's, over the steps both
timed). The bootstrap interval of one run (:func:`isoexec.report.stats.bootstrap_interval`) covers the spread of
that run's steps and seeds, not what changes between runs of the same code an hour apart (the machine's state:
on the shared 2-core VM, a rerun's isoexec overhead landed 0.4 points outside its run's interval). Two
prediction intervals for a further run, both ``m +- t(1 - (1 - level) / 2, n - 1) * s * sqrt(1/k + 1/n)`` (t: Student's
quantile, ``scipy.stats.t``), the
interval for the mean of k future draws of a normal population whose mean and variance are estimated from n
draws (Hahn, Meeker & Escobar, *Statistical Intervals*, 2nd ed., Wiley 2017, section 4.7):

- **runs as units** (the one the tables state): the n run means, k = 1. Under the one-way random-effects model
  (a shift per run plus a spread per seed, equal seed counts) the run means are independent draws of one normal
  distribution, so it holds whatever part of the variation moves whole runs; with few runs it is wide;
- **seeds pooled**: the n (run, seed) overheads, k seeds per run. It holds only if runs do not differ as a whole
  (no run-level shift); where they do it covers less than ``level`` (its test shows it), so it is shown beside
  the first as the narrower statement of that assumption, not as the result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from isoexec.report.data import MetricsError, discover_runs, load_metrics, run_git_commit
from isoexec.report.stats import INTERVAL, arm_sort_key, bootstrap_interval, paired_times, ratio_of_sums

RERUNS = "reruns"
COLUMNS = ("run", "commit", "arm", "n_seeds", "overhead_pct", "overhead_pct_lo", "overhead_pct_hi", "per_seed_pct",
           "predicted_lo", "predicted_hi", "inside", "pooled_lo", "pooled_hi", "inside_pooled")
"""``tables/reruns.*``: one row per (run, arm): the run's overhead with its own bootstrap interval, its seeds'
overheads, the intervals the runs before it gave for it (``predicted``: runs as units, from two runs on;
``pooled``: seeds pooled) and whether it landed inside each; then one row per arm named ``further run``: the
intervals that every run so far gives for the next."""


RERUN_NOTE = ("A run's overhead: the mean over its seeds of the paired step overhead against native, with the run's "
              "own bootstrap interval. Predictions from every run before it, m +- t(0.975, n-1) s sqrt(1/k + 1/n) "
              "(isoexec/report/reruns.py): runs as units (n run means, k = 1; holds when whole runs shift), and seeds "
              "pooled (n (run, seed) overheads, k seeds; holds only if runs do not shift as a whole). "
              "'further run': from every run.")
FURTHER_NOTE = ("The last column: the mean over every run of the RL stage (tables/reruns.*) and the 95% prediction "
                "interval of a further run's overhead, the runs' means as units.")


def prediction_interval(units: Sequence[float], k: int, level: float = INTERVAL) -> tuple[float, float, float]:
    """``(m, low, high)``: the mean of ``units`` and the ``level`` prediction interval for the mean of ``k``
    further draws (module docstring).

    Raises:
        ValueError: fewer than two units, or ``k`` < 1.
    """
    x = np.asarray(units, dtype=float)
    if len(x) < 2 or k < 1:
        raise ValueError(f"prediction_interval: needs at least 2 units and k >= 1, got {len(x)} units, k={k}")
    m, s = float(x.mean()), float(x.std(ddof=1))
    from scipy.stats import t as student_t

    h = float(student_t.ppf((1 + level) / 2, len(x) - 1)) * s * math.sqrt(1 / k + 1 / len(x))
    return m, m - h, m + h


def _order(name: str) -> tuple:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def run_dirs(exp_dir: str | Path) -> list[tuple[str, Path]]:
    """``[("committed", exp_dir), (name, exp_dir/reruns/name), ...]``: the runs of the RL stage on disk, reruns
    in the order of their names (numbers numerically: 2 before 10)."""
    exp_dir = Path(exp_dir)
    reruns = sorted((p for p in (exp_dir / RERUNS).glob("*") if (p / "rl").is_dir()), key=lambda p: _order(p.name))
    return [("committed", exp_dir), *((p.name, p) for p in reruns)]


def seed_overheads(times: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]) -> dict[str, dict[int, float]]:
    """Per arm (not native) and seed: the paired step overhead in percent, from one run's
    :func:`isoexec.report.stats.paired_times`."""
    out: dict[str, dict[int, float]] = {}
    for (arm, seed), v in times.items():
        out.setdefault(arm, {})[seed] = 100.0 * (float(ratio_of_sums(*v)) - 1.0)
    return out


def _commit(run_dir: Path) -> str:
    import json

    commits = set()
    for _, _, d in discover_runs(run_dir):
        try:
            commits.add(run_git_commit(json.loads((d / "provenance.json").read_text())) or "?")
        except (OSError, ValueError):
            commits.add("?")
    return ", ".join(sorted(c[:7] for c in commits))


def rerun_table(exp_dir: str | Path, level: float = INTERVAL) -> pd.DataFrame:
    """The ``reruns`` table (:data:`COLUMNS`) of ``exp_dir``'s runs (:func:`run_dirs`).

    Raises:
        MetricsError: a run folder without readable metrics, or a rerun whose (arm, seed) runs differ from the
            committed run's (a rerun is the same stage again: pooling a partial one would bias the interval).
    """
    runs = run_dirs(exp_dir)
    expected = {(a, s) for a, s, _ in discover_runs(runs[0][1])}
    for name, d in runs[1:]:
        got = {(a, s) for a, s, _ in discover_runs(d)}
        if got != expected:
            missing = ", ".join(f"{a}/seed{s}" for a, s in sorted(expected - got)) or "none"
            extra = ", ".join(f"{a}/seed{s}" for a, s in sorted(got - expected)) or "none"
            raise MetricsError(f"{d / 'rl'}: a rerun must hold the committed run's arms and seeds; missing: {missing}; "
                               f"not in the committed run: {extra}")
    rows, means, pooled = [], {}, {}
    for name, d in runs:
        times = paired_times(load_metrics(d))
        per = seed_overheads(times)
        for arm in sorted(per, key=arm_sort_key):
            units = [per[arm][s] for s in sorted(per[arm])]
            m = float(np.mean(units))
            before, before_units = means.get(arm, []), pooled.get(arm, [])
            pred = prediction_interval(before, 1, level)[1:] if len(before) >= 2 else (math.nan, math.nan)
            pool = (prediction_interval(before_units, len(units), level)[1:] if len(before_units) >= 2
                    else (math.nan, math.nan))
            lo, hi = bootstrap_interval([v for (a, _), v in times.items() if a == arm], level=level)
            rows.append({"run": name, "commit": _commit(d), "arm": arm, "n_seeds": len(units), "overhead_pct": m,
                         "overhead_pct_lo": 100.0 * (lo - 1.0), "overhead_pct_hi": 100.0 * (hi - 1.0),
                         "per_seed_pct": ", ".join(f"{u:+.1f}" for u in units),
                         "predicted_lo": pred[0], "predicted_hi": pred[1],
                         "inside": None if math.isnan(pred[0]) else bool(pred[0] <= m <= pred[1]),
                         "pooled_lo": pool[0], "pooled_hi": pool[1],
                         "inside_pooled": None if math.isnan(pool[0]) else bool(pool[0] <= m <= pool[1])})
            means[arm], pooled[arm] = before + [m], before_units + units
    k = len({s for _, s in expected})  # seeds per run (every run has the committed run's)
    for arm in sorted(means, key=arm_sort_key):
        if len(means[arm]) >= 2:
            m, lo, hi = prediction_interval(means[arm], 1, level)
            plo, phi = prediction_interval(pooled[arm], k, level)[1:]
            rows.append({"run": "further run", "commit": "", "arm": arm, "n_seeds": k, "overhead_pct": m,
                         "overhead_pct_lo": math.nan, "overhead_pct_hi": math.nan,
                         "per_seed_pct": f"{len(means[arm])} runs of {k} seeds", "predicted_lo": lo, "predicted_hi": hi,
                         "inside": None, "pooled_lo": plo, "pooled_hi": phi, "inside_pooled": None})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def further_run(table: pd.DataFrame) -> dict[str, tuple[float, float, float]]:
    """Per arm, ``(mean of the runs' overheads, low, high)``: the ``further run`` rows of :func:`rerun_table`
    (runs as units)."""
    return {r.arm: (r.overhead_pct, r.predicted_lo, r.predicted_hi)
            for r in table[table["run"] == "further run"].itertuples()}
