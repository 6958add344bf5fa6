"""Figures of the paired RL runs, one line per arm (docs/design.md, The experiments), as PNG and PDF.

Each arm (:mod:`isoexec.rl.arms`: native, isoexec, and e.g. native-tis) has its own colour, line style and
marker, so that arms whose values coincide (every arm samples the same tokens at the first step) stay
visible on top of each other.

- ``figures/logprob_diff``: per-step mean and max |trainer - rollout| logprob, per arm, mean over
  seeds with a min-max band. The y axis is logarithmic, so exact zeros cannot sit on it: they are
  drawn in a separate row under it, labelled ``= 0 (bitwise)``, one marker per step (filled: every
  seed is exactly 0; hollow: some seeds are). Nothing is dropped or clipped silently.
- ``figures/is_ratio``: the effect of the mismatch on training, beside ``logprob_diff``: per step, the
  spread of the importance ratio ``exp(lT - lR)`` (band from the smallest to the largest token ratio
  over seeds, line = mean ratio; the legend gives the extremes to three significant digits, more where
  three would round a ratio that is not 1 to 1), the k3 KL(rollout || trainer) (log axis, exact zeros
  on their own row) and the share of tokens whose ratio lies outside the loss's clip range.
- ``figures/reward``: mean reward (accuracy) and pass@k per step, mean over seeds with a min-max band.
- ``figures/time``: seconds per step of time/generation, /score, /train, /weight_sync, /step per arm
  (mean over seeds and timed steps; error bar: the 95% bootstrap interval of that mean, seeds then steps
  resampled, none where nothing varies), annotated with the paired overhead against native and its
  interval (:func:`isoexec.report.tables.phase_overhead`).

Figures are built on ``matplotlib.figure.Figure`` (no pyplot state, Agg canvas) and written
atomically.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from isoexec.report.data import atomic_write_bytes, load_metrics
from isoexec.report.stats import BASELINE_ARM, arm_sort_key, bootstrap_interval, timed_steps
from isoexec.report.tables import TIME_KEYS, overhead_cell, phase_overhead

# (colour, line style, marker, filled marker) per arm; other arms take the fallbacks in turn
STYLES = {"native": ("#d62728", "-", "o", True), "isoexec": ("#1f77b4", "--", "s", False),
          "native-tis": ("#ff7f0e", ":", "^", True)}
_FALLBACK_STYLES = [("#2ca02c", "-.", "D", False), ("#9467bd", ":", "v", True), ("#8c564b", "--", "P", False)]
FORMATS = ("png", "pdf")
_RC = {"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8}


def _style(arm: str, i: int) -> tuple[str, str, str, bool]:
    return STYLES.get(arm, _FALLBACK_STYLES[i % len(_FALLBACK_STYLES)])


def _line(arm: str, i: int, ms: float = 4) -> dict:
    """Keyword arguments of ``Axes.plot`` for ``arm``'s line (colour, style, marker; hollow markers let a
    line underneath show through)."""
    c, ls, marker, filled = _style(arm, i)
    return {"color": c, "ls": ls, "marker": marker, "ms": ms, "lw": 1.5, "mfc": c if filled else "none"}


def _arms(df: pd.DataFrame) -> list[str]:
    return sorted(df["arm"].unique(), key=arm_sort_key)


def ratio_text(x: float) -> str:
    """A ratio to three significant digits, more where three would round a ratio that is not 1 to 1
    (``0.607485`` -> ``0.607``, ``0.9999951`` -> ``0.999995``); exactly 1 is ``1``."""
    if x == 1.0:
        return "1"
    for digits in range(3, 18):
        text = f"{x:.{digits}g}"
        if float(text) != 1.0:
            return text
    return repr(x)


def per_step_over_seeds(df: pd.DataFrame, key: str) -> pd.DataFrame:
    """For each (arm, step): mean, min, max of ``key`` over seeds, and ``n_zero`` (seeds exactly 0)."""
    g = df.groupby(["arm", "step"])[key]
    out = g.agg(["mean", "min", "max", "count"])
    out["n_zero"] = g.apply(lambda s: int((s == 0).sum()))
    return out.reset_index()


def save_figure(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    """``<stem>.png`` (150 dpi) and ``<stem>.pdf``, each written atomically."""
    paths = []
    for fmt in FORMATS:
        buf = io.BytesIO()
        meta = {"Software": None} if fmt == "png" else {"Creator": None, "Producer": None, "CreationDate": None}
        fig.savefig(buf, format=fmt, dpi=150, bbox_inches="tight", metadata=meta)
        paths.append(atomic_write_bytes(out_dir / f"{stem}.{fmt}", buf.getvalue()))
    return paths


# --------------------------------------------------------------------------------------------------
# logprob diff
# --------------------------------------------------------------------------------------------------


def _diff_panel(fig: Figure, spec, df: pd.DataFrame, key: str, title: str,
                ylabel: str = "|logprob diff| (nats)") -> None:
    """A log-scale axis for the positive values over a '= 0 (bitwise)' row for the exact zeros."""
    sub = spec.subgridspec(2, 1, height_ratios=[5, 1], hspace=0.05)
    ax = fig.add_subplot(sub[0])
    zax = fig.add_subplot(sub[1], sharex=ax)
    stats = per_step_over_seeds(df, key)
    arms = _arms(df)
    positive = stats.loc[stats["max"] > 0, "max"]
    # The smallest positive value drawn: a positive per-step mean, or a positive seed minimum.
    smallest = pd.concat([stats.loc[stats["mean"] > 0, "mean"], stats.loc[stats["min"] > 0, "min"]])
    lo_val = smallest.min() if len(smallest) else 1e-7
    bottom = 10 ** math.floor(math.log10(lo_val) - 0.5)
    top = 10 ** math.ceil(math.log10(positive.max()) + 0.3) if len(positive) else 1.0
    handles = []
    for i, arm in enumerate(arms):
        s = stats[stats["arm"] == arm].sort_values("step")
        line = _line(arm, i, ms=3)
        c = line["color"]
        steps = s["step"].to_numpy()
        mean = s["mean"].to_numpy(dtype=float)
        mn = s["min"].to_numpy(dtype=float)
        mx = s["max"].to_numpy(dtype=float)
        n_seeds = int(s["count"].max())
        # Positive values on the log axis; a zero breaks the line instead of being clipped.
        ax.plot(steps, np.where(mean > 0, mean, np.nan), **line)
        band = mx > 0
        if n_seeds > 1 and band.any():
            ax.fill_between(steps, np.where(mn > 0, mn, bottom), np.where(band, mx, np.nan), color=c, alpha=0.15, lw=0)
        # Exact zeros on their own row.
        all_zero = s["n_zero"].to_numpy() == s["count"].to_numpy()
        some_zero = (s["n_zero"].to_numpy() > 0) & ~all_zero
        zax.plot(steps[all_zero], np.full(all_zero.sum(), i), ls="", marker=line["marker"], ms=5, color=c)
        zax.plot(steps[some_zero], np.full(some_zero.sum(), i), ls="", marker=line["marker"], ms=5, mfc="none", color=c)
        label = f"{arm}: = 0 at {int(all_zero.sum())}/{len(steps)} steps"
        handles.append(Line2D([], [], **{**line, "ms": 4}, label=label))
    ax.set_yscale("log")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.tick_params(labelbottom=False)
    if not len(positive):
        ax.text(0.5, 0.5, "no nonzero difference in any step", transform=ax.transAxes, ha="center", va="center")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 1), framealpha=0.9)
    ax.set_ylim(bottom, top * 30 ** (1 + len(arms) / 3))  # headroom for the legend
    zax.xaxis.set_major_locator(MaxNLocator(integer=True))
    zax.set_ylim(-0.7, len(arms) - 0.3)
    zax.set_yticks(range(len(arms)), [f"{a} = 0" for a in arms])
    zax.set_ylabel("bitwise", rotation=0, ha="right", va="center")
    zax.set_xlabel("RL step")
    zax.grid(True, axis="x", alpha=0.3)


def _n_seeds(df: pd.DataFrame) -> int:
    return int(df.groupby("arm")["seed"].nunique().max())


def logprob_diff_figure(df: pd.DataFrame, exp: str) -> Figure:
    """Per-step mean and per-step max |trainer - rollout| logprob, every arm, exact zeros shown."""
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    with _rc():
        gs = fig.add_gridspec(1, 2)
        _diff_panel(fig, gs[0], df, "logprob_abs_diff_mean", "mean |logprob diff| per step")
        _diff_panel(fig, gs[1], df, "logprob_abs_diff_max", "max |logprob diff| per step")
        fig.suptitle(f"Pre-update logprob difference, trainer vs rollout engine ({exp})")
        fig.text(
            0.5,
            -0.02,
            f"Lines: mean over {_n_seeds(df)} seed(s); bands: min..max over seeds. Exact zeros cannot be drawn on a "
            "log axis and appear in the '= 0' row below each panel instead (filled: every seed bitwise equal; "
            "hollow: some seeds).",
            ha="center",
            va="top",
            fontsize=8,
        )
    return fig


# --------------------------------------------------------------------------------------------------
# importance ratio
# --------------------------------------------------------------------------------------------------


def _ratio_label(arm: str, lo: float, hi: float) -> str:
    if lo == hi == 1.0:
        return f"{arm}: every ratio exactly 1"
    return f"{arm}: min..max {ratio_text(lo)}..{ratio_text(hi)}"


def ratio_figure(df: pd.DataFrame, exp: str) -> Figure:
    """Per step and arm: the importance ratio's spread, the k3 KL and the ratio's clip fraction."""
    has_clip = "is_ratio_clip_frac" in df and df["is_ratio_clip_frac"].notna().any()
    fig = Figure(figsize=(5.0 * (3 if has_clip else 2), 4.4), layout="constrained")
    with _rc():
        gs = fig.add_gridspec(1, 3 if has_clip else 2)
        ax = fig.add_subplot(gs[0])
        lo = df.groupby(["arm", "step"])["is_ratio_min"].min()
        hi = df.groupby(["arm", "step"])["is_ratio_max"].max()
        mean = df.groupby(["arm", "step"])["is_ratio_mean"].mean()
        for i, arm in enumerate(_arms(df)):
            line = _line(arm, i, ms=3)
            steps = mean.loc[arm].index.to_numpy()
            ax.fill_between(steps, lo.loc[arm].to_numpy(), hi.loc[arm].to_numpy(), color=line["color"], alpha=0.15, lw=0)
            ax.plot(steps, mean.loc[arm].to_numpy(), **line,
                    label=_ratio_label(arm, float(lo.loc[arm].min()), float(hi.loc[arm].max())))
        ax.axhline(1.0, color="black", lw=0.8, ls=":")
        ax.set_title("importance ratio exp(lT - lR) per step")
        ax.set_ylabel("pi_trainer / mu_rollout per token")
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left")
        _diff_panel(fig, gs[1], df, "k3_kl", "k3 KL(rollout || trainer) per step", ylabel="k3 KL (nats)")
        if has_clip:
            cax = fig.add_subplot(gs[2])
            stats = per_step_over_seeds(df, "is_ratio_clip_frac")
            for i, arm in enumerate(_arms(df)):
                s = stats[stats["arm"] == arm].sort_values("step")
                line = _line(arm, i, ms=3)
                cax.plot(s["step"], s["mean"], **line, label=arm)
                if int(s["count"].max()) > 1:
                    cax.fill_between(s["step"], s["min"], s["max"], color=line["color"], alpha=0.15, lw=0)
            cax.set_title("tokens whose ratio is outside the clip range")
            cax.set_ylabel("fraction of response tokens")
            cax.set_xlabel("RL step")
            cax.xaxis.set_major_locator(MaxNLocator(integer=True))
            cax.grid(True, alpha=0.3)
            cax.legend(loc="best")
        fig.suptitle(f"Effect of the mismatch on the policy-gradient ratio ({exp})")
        fig.text(0.5, -0.02, f"Band (left): smallest to largest token ratio over {_n_seeds(df)} seed(s); line: mean "
                 "ratio. Middle and right: mean over seeds, band min..max over seeds; exact zeros of the KL in the "
                 "'= 0' row.", ha="center", va="top", fontsize=8)
    return fig


# --------------------------------------------------------------------------------------------------
# reward
# --------------------------------------------------------------------------------------------------


def arm_lines(ax, df: pd.DataFrame, key: str) -> None:
    """One line per arm on ``ax``: ``key``'s mean over seeds per step, with a min-max band over seeds where
    there are several, labelled with the number of seeds."""
    stats = per_step_over_seeds(df, key)
    for i, arm in enumerate(_arms(df)):
        s = stats[stats["arm"] == arm].sort_values("step")
        line = _line(arm, i, ms=3)
        n = int(s["count"].max())
        ax.plot(s["step"], s["mean"], **line, label=f"{arm} (mean of {n} seed{'s' * (n > 1)})")
        if n > 1:
            ax.fill_between(s["step"], s["min"], s["max"], color=line["color"], alpha=0.12, lw=0)


def reward_figure(df: pd.DataFrame, exp: str, pass_k: int | None = None) -> Figure:
    """Mean reward (and pass@k when recorded) per step, mean over seeds with a min-max band.

    Args:
        pass_k: the k of the ``pass_at_k`` metric (``rl.pass_k``), named in its panel; None: "pass@k".
    """
    k = "k" if pass_k is None else str(pass_k)
    panels = [("reward_mean", "mean reward", "accuracy (fraction of responses)")]
    if "pass_at_k" in df and df["pass_at_k"].notna().any():
        panels.append(("pass_at_k", f"pass@{k}", f"pass@{k} (fraction of prompts)"))
    fig = Figure(figsize=(5.5 * len(panels), 3.8), layout="constrained")
    with _rc():
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, (key, title, ylabel) in zip(axes, panels, strict=True):
            arm_lines(ax, df, key)
            ax.set_xlabel("RL step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title} per step")
            ax.grid(True, alpha=0.3)
            ax.legend(loc="best")
        fig.suptitle(f"RL quality per arm ({exp}); band = min..max over seeds")
    return fig


# --------------------------------------------------------------------------------------------------
# time
# --------------------------------------------------------------------------------------------------


def time_figure(df: pd.DataFrame, exp: str) -> Figure:
    """Grouped bars of seconds per step per phase and arm (error bar: 95% bootstrap interval of the mean),
    with the paired overheads against native and their intervals annotated."""
    arms = _arms(df)
    keys = [k for k, _, _ in TIME_KEYS]
    width = 0.8 / len(arms)
    x = np.arange(len(keys))
    fig = Figure(figsize=(2.0 + 0.7 * len(keys) * len(arms), 4.4), layout="constrained")
    drawn = False
    with _rc():
        ax = fig.subplots()
        timed = timed_steps(df)
        for i, arm in enumerate(arms):
            g = timed[timed["arm"] == arm]
            means = np.array([float(g[k].mean()) for k in keys])
            bounds = np.array([bootstrap_interval([(r[k].to_numpy(float),) for _, r in g.groupby("seed")],
                                                  stat=lambda t: t.mean(-1)) for k in keys])  # [K, 2]
            err = np.vstack([means - bounds[:, 0], bounds[:, 1] - means])  # NaN where nothing varies: not drawn
            has_err = bool(np.isfinite(err).any())
            drawn |= has_err
            pos = x - 0.4 + width * (i + 0.5)
            c, _, _, filled = _style(arm, i)
            bars = ax.bar(pos, means, width, yerr=err if has_err else None, capsize=3, color=c if filled else "white",
                          edgecolor=c, hatch=None if filled else "//", label=arm)
            if arm == BASELINE_ARM:
                continue
            for bar, key, top in zip(bars, keys, np.fmax(bounds[:, 1], means), strict=True):
                cell = overhead_cell(*phase_overhead(df, arm, key))
                if cell:
                    ax.annotate(cell.replace(" [", "\n["), (bar.get_x() + bar.get_width() / 2, top), xytext=(0, 3),
                                textcoords="offset points", ha="center", va="bottom", fontsize=6.5)
        ax.set_xticks(x, [k.removeprefix("time/").replace("_", " ") for k in keys])
        ax.set_ylabel("seconds per RL step")
        ax.set_xlabel("phase")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(title="arm", loc="upper left")
        bar_text = ("error bar: 95% interval of the mean (bootstrap: seeds, then steps)" if drawn
                    else "no error bar: one timed step of one seed per arm")
        ax.set_title(
            f"Time per RL step ({exp}): mean over seeds and steps (first step left out); {bar_text};\n"
            f"labels: overhead vs {BASELINE_ARM} [95% interval], paired within each seed"
        )
    return fig


def _rc():
    import matplotlib

    return matplotlib.rc_context(_RC)


def write_figures(
    exp_dir: str | Path, arms: Sequence[str] | None = None, seeds: Sequence[int] | None = None
) -> list[Path]:
    """Write ``<exp_dir>/figures/{logprob_diff,is_ratio,reward,time}.{png,pdf}`` from the RL metrics
    (and ``rl.pass_k`` from the settings record ``experiment.json`` when there is one)."""
    exp_dir = Path(exp_dir)
    df = load_metrics(exp_dir, arms, seeds)
    out = exp_dir / "figures"
    exp = exp_dir.name
    record = exp_dir / "experiment.json"
    pass_k = json.loads(record.read_text()).get("rl", {}).get("pass_k") if record.exists() else None
    paths = []
    for stem, build in (("logprob_diff", logprob_diff_figure), ("is_ratio", ratio_figure),
                        ("reward", partial(reward_figure, pass_k=pass_k)), ("time", time_figure)):
        paths += save_figure(build(df, exp), out, stem)
    return paths
