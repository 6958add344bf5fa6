"""The paired step overheads' statistics that the report's tables and figures share: the arms' order, the steps
that count for timing, each (arm, seed)'s step times paired with the baseline's, the ratio of their sums, and the
two-level bootstrap interval of the mean of that ratio over seeds (docs/design.md, Metrics)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

BASELINE_ARM = "native"
ARM_ORDER = ("native", "isoexec")
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0  # the tables are a pure function of the metrics: the resamples are drawn from a fixed seed
INTERVAL = 0.95


def arm_sort_key(arm: str) -> tuple[int, str]:
    """Sort key: native, isoexec, then any other arm by name."""
    return (ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER), arm)


def timed_steps(df: pd.DataFrame) -> pd.DataFrame:
    """Rows that count for timing: every step but the first of each (arm, seed) run, whose time
    includes the run's start-up and first-call warm-up; a run of a single step keeps it."""
    first = df.groupby(["arm", "seed"])["step"].transform("min")
    n = df.groupby(["arm", "seed"])["step"].transform("count")
    return df[(df["step"] != first) | (n == 1)]


def paired_times(df: pd.DataFrame, key: str = "time/step", baseline: str = BASELINE_ARM
                 ) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """Per (arm, seed) of every arm but ``baseline``: its and the baseline's ``key`` seconds over the
    steps both timed (:func:`timed_steps`; steps whose baseline time is 0 or missing left out), in step
    order: ``(t_arm [S], t_baseline [S])``."""
    df = timed_steps(df)
    base = df[df["arm"] == baseline][["seed", "step", key]].rename(columns={key: "_base"})
    other = df[df["arm"] != baseline][["arm", "seed", "step", key]]
    pairs = other.merge(base, on=["seed", "step"], how="inner")
    pairs = pairs[(pairs["_base"] > 0) & pairs[key].notna()].sort_values(["arm", "seed", "step"])
    return {(arm, int(seed)): (g[key].to_numpy(float), g["_base"].to_numpy(float))
            for (arm, seed), g in pairs.groupby(["arm", "seed"], sort=False)}


def ratio_of_sums(t_arm: np.ndarray, t_base: np.ndarray) -> np.ndarray:
    return t_arm.sum(-1) / t_base.sum(-1)


def bootstrap_interval(per_seed: Sequence[tuple[np.ndarray, ...]],
                       stat: Callable[..., np.ndarray] = ratio_of_sums,
                       resamples: int = BOOTSTRAP_RESAMPLES, level: float = INTERVAL) -> tuple[float, float]:
    """Percentile interval of ``mean over seeds of stat(seed's steps)`` by a two-level bootstrap.

    Each resample draws the seeds with replacement, then, for every drawn seed independently, its steps
    with replacement (the arrays of a seed share the step draw, so paired times stay paired), and
    averages ``stat`` over the drawn seeds. The spread of a run's steps and the spread between seeds
    (which carries what drifts between runs) both enter. Draws come from ``BOOTSTRAP_SEED``.

    Args:
        per_seed: per seed, arrays of equal length ``[S_i]`` (e.g. the arm's and the baseline's step
            times, :func:`paired_times`).
        stat: maps the drawn arrays, each ``[R, S_i]``, to ``[R]`` (default: ratio of the sums).
        resamples, level: the number of resamples R and the central coverage.

    Returns:
        ``(low, high)``; NaN, NaN when nothing varies (one seed with fewer than two steps).
    """
    n = len(per_seed)
    if n == 0 or (n == 1 and len(per_seed[0][0]) < 2):
        return math.nan, math.nan
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    seeds = rng.integers(0, n, (resamples, n))  # [R, n]: the seed in each slot of each resample
    slots = np.empty((n, resamples))
    for j in range(n):
        by_seed = np.empty((n, resamples))  # a fresh step draw of every seed for slot j
        for i, arrays in enumerate(per_seed):
            steps = rng.integers(0, len(arrays[0]), (resamples, len(arrays[0])))  # one draw for all arrays of the seed
            by_seed[i] = stat(*(a[steps] for a in arrays))
        slots[j] = by_seed[seeds[:, j], np.arange(resamples)]
    lo, hi = np.quantile(slots.mean(0), [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
