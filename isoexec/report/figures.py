"""Figures of the paired native-vs-IsoExec RL runs (docs/design.md, The experiments), as PNG and PDF.

- ``figures/logprob_diff``: per-step mean and max |trainer - rollout| logprob, per mode, mean over
  seeds with a min-max band. The y axis is logarithmic, so exact zeros cannot sit on it: they are
  drawn in a separate row under it, labelled ``= 0 (bitwise)``, one marker per step (filled: every
  seed is exactly 0; hollow: some seeds are). Nothing is dropped or clipped silently.
- ``figures/is_ratio``: the effect of the mismatch on training, beside ``logprob_diff``: per step, the
  spread of the importance ratio ``exp(lT - lR)`` (band from the smallest to the largest token ratio
  over seeds, line = mean ratio), the k3 KL(rollout || trainer) (log axis, exact zeros on their own
  row) and the share of tokens whose ratio lies outside the loss's clip range.
- ``figures/reward``: mean reward (accuracy) and pass@k per step, mean over seeds with a min-max band.
- ``figures/time``: seconds per step of time/generation, /score, /train, /weight_sync, /step per mode
  (mean over seeds and steps, error bar = std over steps), annotated with the paired per-step overhead.

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
from isoexec.report.tables import BASELINE_MODE, TIME_KEYS, mode_sort_key, paired_overhead, timed_steps

COLORS = {"native": "#d62728", "isoexec": "#1f77b4"}
_FALLBACK_COLORS = ["#2ca02c", "#9467bd", "#8c564b", "#e377c2"]
FORMATS = ("png", "pdf")
_RC = {"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8}


def _color(mode: str, i: int) -> str:
    return COLORS.get(mode, _FALLBACK_COLORS[i % len(_FALLBACK_COLORS)])


def _modes(df: pd.DataFrame) -> list[str]:
    return sorted(df["mode"].unique(), key=mode_sort_key)


def per_step_over_seeds(df: pd.DataFrame, key: str) -> pd.DataFrame:
    """For each (mode, step): mean, min, max of ``key`` over seeds, and ``n_zero`` (seeds exactly 0)."""
    g = df.groupby(["mode", "step"])[key]
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
    modes = _modes(df)
    positive = stats.loc[stats["max"] > 0, "max"]
    # The smallest positive value drawn: a positive per-step mean, or a positive seed minimum.
    smallest = pd.concat([stats.loc[stats["mean"] > 0, "mean"], stats.loc[stats["min"] > 0, "min"]])
    lo_val = smallest.min() if len(smallest) else 1e-7
    bottom = 10 ** math.floor(math.log10(lo_val) - 0.5)
    top = 10 ** math.ceil(math.log10(positive.max()) + 0.3) if len(positive) else 1.0
    handles = []
    for i, mode in enumerate(modes):
        s = stats[stats["mode"] == mode].sort_values("step")
        c = _color(mode, i)
        steps = s["step"].to_numpy()
        mean = s["mean"].to_numpy(dtype=float)
        mn = s["min"].to_numpy(dtype=float)
        mx = s["max"].to_numpy(dtype=float)
        n_seeds = int(s["count"].max())
        # Positive values on the log axis; a zero breaks the line instead of being clipped.
        ax.plot(steps, np.where(mean > 0, mean, np.nan), color=c, marker="o", ms=3, lw=1.5)
        band = mx > 0
        if n_seeds > 1 and band.any():
            ax.fill_between(steps, np.where(mn > 0, mn, bottom), np.where(band, mx, np.nan), color=c, alpha=0.2, lw=0)
        # Exact zeros on their own row.
        all_zero = s["n_zero"].to_numpy() == s["count"].to_numpy()
        some_zero = (s["n_zero"].to_numpy() > 0) & ~all_zero
        zax.plot(steps[all_zero], np.full(all_zero.sum(), i), ls="", marker="o", ms=5, color=c)
        zax.plot(steps[some_zero], np.full(some_zero.sum(), i), ls="", marker="o", ms=5, mfc="none", color=c)
        label = f"{mode}: = 0 at {int(all_zero.sum())}/{len(steps)} steps"
        handles.append(Line2D([], [], color=c, marker="o", ms=4, label=label))
    ax.set_yscale("log")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.tick_params(labelbottom=False)
    if not len(positive):
        ax.text(0.5, 0.5, "no nonzero difference in any step", transform=ax.transAxes, ha="center", va="center")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 1), framealpha=0.9)
    ax.set_ylim(bottom, top * 30)  # headroom for the legend
    zax.xaxis.set_major_locator(MaxNLocator(integer=True))
    zax.set_ylim(-0.7, len(modes) - 0.3)
    zax.set_yticks(range(len(modes)), [f"{m} = 0" for m in modes])
    zax.set_ylabel("bitwise", rotation=0, ha="right", va="center")
    zax.set_xlabel("RL step")
    zax.grid(True, axis="x", alpha=0.3)


def logprob_diff_figure(df: pd.DataFrame, exp: str) -> Figure:
    """Per-step mean and per-step max |trainer - rollout| logprob, both modes, exact zeros shown."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    with _rc():
        gs = fig.add_gridspec(1, 2)
        _diff_panel(fig, gs[0], df, "logprob_abs_diff_mean", "mean |logprob diff| per step")
        _diff_panel(fig, gs[1], df, "logprob_abs_diff_max", "max |logprob diff| per step")
        n = int(df.groupby("mode")["seed"].nunique().max())
        fig.suptitle(f"Pre-update logprob difference, trainer vs rollout engine ({exp})")
        fig.text(
            0.5,
            -0.02,
            f"Lines: mean over {n} seed(s); bands: min..max over seeds. Exact zeros cannot be drawn on a log "
            "axis and appear in the '= 0' row below each panel instead (filled: every seed bitwise equal; "
            "hollow: some seeds).",
            ha="center",
            va="top",
            fontsize=8,
        )
    return fig


# --------------------------------------------------------------------------------------------------
# importance ratio
# --------------------------------------------------------------------------------------------------


def ratio_figure(df: pd.DataFrame, exp: str) -> Figure:
    """Per step and mode: the importance ratio's spread, the k3 KL and the ratio's clip fraction."""
    has_clip = "is_ratio_clip_frac" in df and df["is_ratio_clip_frac"].notna().any()
    fig = Figure(figsize=(5.0 * (3 if has_clip else 2), 4.2), layout="constrained")
    with _rc():
        gs = fig.add_gridspec(1, 3 if has_clip else 2)
        ax = fig.add_subplot(gs[0])
        lo = df.groupby(["mode", "step"])["is_ratio_min"].min()
        hi = df.groupby(["mode", "step"])["is_ratio_max"].max()
        mean = df.groupby(["mode", "step"])["is_ratio_mean"].mean()
        for i, mode in enumerate(_modes(df)):
            c = _color(mode, i)
            steps = mean.loc[mode].index.to_numpy()
            ax.fill_between(steps, lo.loc[mode].to_numpy(), hi.loc[mode].to_numpy(), color=c, alpha=0.25, lw=0)
            ax.plot(steps, mean.loc[mode].to_numpy(), color=c, marker="o", ms=3,
                    label=f"{mode}: min..max {lo.loc[mode].min():.6g}..{hi.loc[mode].max():.6g}")
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
            for i, mode in enumerate(_modes(df)):
                s = stats[stats["mode"] == mode].sort_values("step")
                c = _color(mode, i)
                cax.plot(s["step"], s["mean"], color=c, marker="o", ms=3, label=mode)
                if int(s["count"].max()) > 1:
                    cax.fill_between(s["step"], s["min"], s["max"], color=c, alpha=0.2, lw=0)
            cax.set_title("tokens whose ratio is outside the clip range")
            cax.set_ylabel("fraction of response tokens")
            cax.set_xlabel("RL step")
            cax.xaxis.set_major_locator(MaxNLocator(integer=True))
            cax.grid(True, alpha=0.3)
            cax.legend(loc="best")
        n = int(df.groupby("mode")["seed"].nunique().max())
        fig.suptitle(f"Effect of the mismatch on the policy-gradient ratio ({exp})")
        fig.text(0.5, -0.02, f"Band (left): smallest to largest token ratio over {n} seed(s); line: mean ratio. "
                 "Middle and right: mean over seeds, band min..max over seeds; exact zeros of the KL in the "
                 "'= 0' row.", ha="center", va="top", fontsize=8)
    return fig


# --------------------------------------------------------------------------------------------------
# reward
# --------------------------------------------------------------------------------------------------


def reward_figure(df: pd.DataFrame, exp: str, pass_k: int | None = None) -> Figure:
    """Mean reward (and pass@k when recorded) per step, mean over seeds with a min-max band.

    Args:
        pass_k: the k of the ``pass_at_k`` metric (``rl.pass_k``), named in its panel; None: "pass@k".
    """
    k = "k" if pass_k is None else str(pass_k)
    panels = [("reward_mean", "mean reward", "accuracy (fraction of responses)")]
    if "pass_at_k" in df and df["pass_at_k"].notna().any():
        panels.append(("pass_at_k", f"pass@{k}", f"pass@{k} (fraction of prompts)"))
    fig = Figure(figsize=(5.5 * len(panels), 3.6), layout="constrained")
    with _rc():
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, (key, title, ylabel) in zip(axes, panels, strict=True):
            stats = per_step_over_seeds(df, key)
            for i, mode in enumerate(_modes(df)):
                s = stats[stats["mode"] == mode].sort_values("step")
                c = _color(mode, i)
                n = int(s["count"].max())
                ax.plot(s["step"], s["mean"], color=c, marker="o", ms=3, label=f"{mode} (mean of {n} seed{'s' * (n > 1)})")
                if n > 1:
                    ax.fill_between(s["step"], s["min"], s["max"], color=c, alpha=0.2, lw=0)
            ax.set_xlabel("RL step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title} per step")
            ax.grid(True, alpha=0.3)
            ax.legend(loc="best")
        fig.suptitle(f"RL quality, native vs IsoExec ({exp}); band = min..max over seeds")
    return fig


# --------------------------------------------------------------------------------------------------
# time
# --------------------------------------------------------------------------------------------------


def time_figure(df: pd.DataFrame, exp: str) -> Figure:
    """Grouped bars of seconds per step per timing key and mode, with paired overheads annotated."""
    modes = _modes(df)
    keys = [k for k, _, _ in TIME_KEYS]
    width = 0.8 / len(modes)
    x = np.arange(len(keys))
    fig = Figure(figsize=(7.5, 4.0), layout="constrained")
    with _rc():
        ax = fig.subplots()
        timed = timed_steps(df)
        for i, mode in enumerate(modes):
            g = timed[timed["mode"] == mode]
            means = [float(g[k].mean()) for k in keys]
            stds = [float(g[k].std(ddof=0)) for k in keys]
            pos = x - 0.4 + width * (i + 0.5)
            bars = ax.bar(pos, means, width, yerr=stds, capsize=3, color=_color(mode, i), label=mode)
            if mode == BASELINE_MODE:
                continue
            for bar, key, std in zip(bars, keys, stds, strict=True):
                ov = paired_overhead(df, key)
                ov = ov.loc[ov["mode"] == mode, "overhead_pct"]
                if len(ov):
                    ax.annotate(  # above the error bar's cap
                        f"{ov.mean():+.1f}%",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height() + std),
                        xytext=(0, 4),
                        textcoords="offset points",
                        ha="center",
                        va="bottom",
                        fontsize=8,
                    )
        ax.set_xticks(x, [k.removeprefix("time/").replace("_", " ") for k in keys])
        ax.set_ylabel("seconds per RL step")
        ax.set_xlabel("phase")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(title="mode", loc="upper left")
        ax.set_title(
            f"Time per RL step ({exp}): mean over seeds and steps (first step left out), error bar = std;\n"
            f"labels: overhead vs {BASELINE_MODE}, paired per step within each seed"
        )
    return fig


def _rc():
    import matplotlib

    return matplotlib.rc_context(_RC)


def write_figures(
    exp_dir: str | Path, modes: Sequence[str] | None = None, seeds: Sequence[int] | None = None
) -> list[Path]:
    """Write ``<exp_dir>/figures/{logprob_diff,is_ratio,reward,time}.{png,pdf}`` from the RL metrics
    (and ``rl.pass_k`` from the settings record ``experiment.json`` when there is one)."""
    exp_dir = Path(exp_dir)
    df = load_metrics(exp_dir, modes, seeds)
    out = exp_dir / "figures"
    exp = exp_dir.name
    record = exp_dir / "experiment.json"
    pass_k = json.loads(record.read_text()).get("rl", {}).get("pass_k") if record.exists() else None
    paths = []
    for stem, build in (("logprob_diff", logprob_diff_figure), ("is_ratio", ratio_figure),
                        ("reward", partial(reward_figure, pass_k=pass_k)), ("time", time_figure)):
        paths += save_figure(build(df, exp), out, stem)
    return paths
