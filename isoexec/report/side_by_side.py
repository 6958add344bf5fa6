"""Experiments side by side on the same axes, e.g. the GPU run (``results/h200-rl``) beside its CPU twin
(``results/cpu-tiny``: the same model, task, SFT and RL settings), one row per (experiment, arm).

- ``tables/side_by_side.{csv,md,tex,provenance.json}``: each experiment's main-table cells (:func:`isoexec.report.
  tables.main_display`: mismatched / tokens, max diff, reward at both ends, seconds per step, step overhead
  against native with its interval) under the experiment's name and device, with its seeds x steps and the
  reward window of each row (runs of different lengths average different windows).
- ``figures/side_by_side.{png,pdf}``: one column per experiment, every panel on one step axis and each row on
  one y axis: mean reward per step and the share of response tokens whose trainer logprob differs from the
  rollout's, per arm (mean over seeds, min-max band), in each arm's style of :mod:`isoexec.report.figures`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from isoexec.report.data import discover_runs, load_metrics, report_provenance
from isoexec.report.figures import _rc, arm_lines, save_figure
from isoexec.report.tables import main_display, summarize, write_table

STEM = "side_by_side"
HEADERS = {"experiment": "experiment", "device": "device", "arm": "arm", "runs": "seeds x steps",
           "mismatched": "mismatched tokens / tokens", "logprob_abs_diff_max": "max abs logprob diff (nats)",
           "reward_first": "reward, first steps", "reward_last": "reward, last steps",
           "reward_window": "reward window (steps)", "time_step_s": "step (s)",
           "overhead": "step overhead vs native [95% interval]"}
PANELS = (("reward_mean", "mean reward", (0.0, 1.0)), ("mismatch_rate", "tokens with trainer != rollout logprob", (-0.03, 1.03)))


def _device(exp_dir: Path) -> str:
    """The experiment's ``device`` from its settings record ``experiment.json`` ("?" without one)."""
    record = exp_dir / "experiment.json"
    return json.loads(record.read_text()).get("device", "?") if record.exists() else "?"


def side_by_side_table(frames: dict[str, pd.DataFrame], devices: dict[str, str]) -> pd.DataFrame:
    """The rows of every experiment (in the given order), cells formatted as in the main table.

    Args:
        frames: experiment name -> its per-step metrics (:func:`isoexec.report.data.load_metrics`).
        devices: experiment name -> device.
    """
    parts = []
    for name, df in frames.items():
        summary = summarize(df)
        shown, _ = main_display(summary)
        parts.append(pd.DataFrame({
            "experiment": name, "device": devices[name], "arm": shown["arm"],
            "runs": summary["runs"],
            "mismatched": shown["mismatched"], "logprob_abs_diff_max": shown["logprob_abs_diff_max"],
            "reward_first": shown["reward_first"], "reward_last": shown["reward_last"],
            "reward_window": summary["reward_window"].astype(int).astype(str),
            "time_step_s": shown["time_step_s"], "overhead": shown["overhead"],
        }))
    return pd.concat(parts, ignore_index=True)


def side_by_side_figure(frames: dict[str, pd.DataFrame], devices: dict[str, str]) -> Figure:
    """Reward and mismatch rate per step, one column per experiment, each row on one y axis."""
    fig = Figure(figsize=(4.6 * len(frames), 6.2), layout="constrained")
    with _rc():
        axes = fig.subplots(len(PANELS), len(frames), squeeze=False, sharex=True, sharey="row")
        for col, (name, df) in enumerate(frames.items()):
            for row, (key, label, ylim) in enumerate(PANELS):
                ax = axes[row][col]
                arm_lines(ax, df, key)
                ax.set_ylim(*ylim)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.grid(True, alpha=0.3)
                if col == 0:
                    ax.set_ylabel(label)
                if row == 0:
                    ax.set_title(f"{name} ({devices[name]})")
                    ax.legend(loc="lower right")
                else:
                    ax.set_xlabel("RL step")
        fig.suptitle("Paired RL runs side by side: reward and logprob mismatch per step (band: min..max over seeds)")
    return fig


def write_side_by_side(exp_dirs: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write ``<out_dir>/tables/side_by_side.*`` and ``<out_dir>/figures/side_by_side.{png,pdf}``.

    Args:
        exp_dirs: two or more ``results/<exp>`` folders, shown in this order.
        out_dir: the folder that receives ``tables/`` and ``figures/`` (e.g. one of ``exp_dirs``).

    Raises:
        ValueError: fewer than two experiments, or one named twice.
        FileNotFoundError, isoexec.report.data.MetricsError: as :func:`isoexec.report.data.load_metrics`.
    """
    dirs = [Path(d) for d in exp_dirs]
    names = [d.name for d in dirs]
    if len(dirs) < 2 or len(set(names)) < len(names):
        raise ValueError(f"--exp-dir: give two or more different experiments, got {', '.join(map(str, dirs)) or 'none'}")
    frames = {d.name: load_metrics(d) for d in dirs}
    devices = {d.name: _device(d) for d in dirs}
    runs = [r for d in dirs for _, _, r in discover_runs(d)]
    prov = report_provenance(", ".join(map(str, dirs)), [r / "metrics.jsonl" for r in runs], runs)
    out = Path(out_dir)
    table = side_by_side_table(frames, devices)
    files = write_table(table, out / "tables", STEM, prov, f"{' beside '.join(names)}: paired RL runs side by side",
                        HEADERS)
    files += save_figure(side_by_side_figure(frames, devices), out / "figures", STEM)
    return files
