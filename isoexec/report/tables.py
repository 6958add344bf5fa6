"""Summary tables of the paired RL runs, one row per arm (docs/design.md, Metrics and The experiments).

An arm (:mod:`isoexec.rl.arms`) is a mode (``native``, ``isoexec``) or a mode's stack with SkyRL's
off-policy correction (e.g. ``native-tis``). Every overhead is against the ``native`` arm.

``summary`` has one row per arm, aggregated over every seed and step:

=============================  =======================================================================
column                         definition
=============================  =======================================================================
arm                            the arm (its runs are ``rl/<arm>/seed<k>/``)
mode                           the stack it runs: ``native`` or ``isoexec``
logprob_abs_diff_mean          mean |lT - lR| over all response tokens (token-weighted over steps)
logprob_abs_diff_std           std of |lT - lR| over all response tokens (pooled from per-step std)
logprob_abs_diff_max_mean      per-step max |lT - lR|, averaged over steps (and seeds)
logprob_abs_diff_max           largest |lT - lR| seen in any step
mismatch_count                 tokens whose fp32 logprob bits differ (sum)
tokens                         token exposure N (sum)
mismatch_rate                  mismatch_count / tokens
prompt_tokens                  prompt tokens of every sequence (sum)
seqs                           sequences (sum)
seqs_cross_chunk               sequences crossing a GDN chunk boundary in prefill or decode (sum)
cross_chunk_frac_min           the smallest per-step share seqs_cross_chunk / seqs
seqs_multi_kv_block            sequences whose attention reads more than one KV block (sum)
seq_len_max                    the longest sequence (prompt + response tokens)
k3_kl                          mean of exp(d) - d - 1 (token-weighted)
is_ratio_min, is_ratio_max     extremes of exp(d) = pi_trainer / mu_rollout over all tokens
is_ratio_clip_frac             share of tokens with exp(d) outside the loss's clip range (token-weighted)
tis_capped_frac                share of tokens (token TIS) or sequences whose TIS weight hit its cap
                               (step mean; empty for an arm without TIS)
correction_masked_frac         share of sequences dropped by the arm's sequence mask (empty without one)
time_generation_s, ...         mean seconds per step of time/generation, /score, /train, /weight_sync,
                               /step, without each run's first step (start-up and warm-up)
overhead_generation_pct, ...   paired overhead against native: for each seed, 100 * (the arm's summed
                               time / native's summed time - 1) over the steps timed in both, then the
                               mean over seeds; empty for the native row
overhead_pct_lo, _hi           95% interval of overhead_pct: hierarchical bootstrap (seeds resampled,
                               then each seed's steps, pairs kept together; :func:`bootstrap_interval`)
reward_first, reward_last      mean reward_mean over each seed's first / last reward_window steps,
                               averaged over seeds
reward_window                  steps at each end: 10, or half the shortest run when it has fewer than 20
n_seeds, n_steps               seeds and distinct steps aggregated
runs                           the runs as "seeds x steps" ("3 x 50"), or each seed's steps where they
                               differ ("50 + 50 + 40 steps": a run cut short)
=============================  =======================================================================

``per_seed`` has the same columns with one row per (arm, seed) (its intervals bootstrap the steps of
that seed). ``timing`` has one row per (arm, phase): seconds per step, their spread over steps (the
standard deviation of a timed step within a run, pooled over runs) and over seeds (of the per-seed
means), and the overhead with its interval. Exact zeros stay exact: an arm whose every diff is 0.0
gets 0.0 (not 1e-30, not NaN) in every diff column. Columns whose per-step key a run does not record
(metrics written before the key existed) are empty.

Files (under ``<exp_dir>/tables/``, written atomically): ``summary.csv`` (full precision) with
``summary.provenance.json`` beside it, ``summary.md`` and ``summary.tex`` (formatted like the blog,
provenance in a comment header), the same for ``per_seed``, ``timing`` and ``main`` (the compact table
a paper takes: :data:`MAIN_HEADERS`, readable headers with units; its md/tex show the overhead with its
interval in one cell), and ``comparison.md``: the summary in the layout of the published table
(docs/design.md, The problem) with the published values beside it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from isoexec.report.data import (
    atomic_write_text,
    discover_runs,
    load_metrics,
    provenance_lines,
    report_provenance,
)
from isoexec.report.reruns import FURTHER_NOTE, RERUN_NOTE, further_run, rerun_table, run_dirs
from isoexec.report.stats import arm_sort_key, bootstrap_interval, paired_times, ratio_of_sums, timed_steps

# (metrics key, table column, overhead column) for the timing columns.
TIME_KEYS: tuple[tuple[str, str, str], ...] = (
    ("time/generation", "time_generation_s", "overhead_generation_pct"),
    ("time/score", "time_score_s", "overhead_score_pct"),
    ("time/train", "time_train_s", "overhead_train_pct"),
    ("time/weight_sync", "time_weight_sync_s", "overhead_weight_sync_pct"),
    ("time/step", "time_step_s", "overhead_pct"),
)
COLUMNS: tuple[str, ...] = (
    "arm",
    "mode",
    "logprob_abs_diff_mean",
    "logprob_abs_diff_std",
    "logprob_abs_diff_max_mean",
    "logprob_abs_diff_max",
    "mismatch_count",
    "tokens",
    "mismatch_rate",
    "prompt_tokens",
    "seqs",
    "seqs_cross_chunk",
    "cross_chunk_frac_min",
    "seqs_multi_kv_block",
    "seq_len_max",
    "k3_kl",
    "is_ratio_min",
    "is_ratio_max",
    "is_ratio_clip_frac",
    "tis_capped_frac",
    "correction_masked_frac",
    "time_generation_s",
    "time_score_s",
    "time_train_s",
    "time_weight_sync_s",
    "time_step_s",
    "overhead_generation_pct",
    "overhead_score_pct",
    "overhead_train_pct",
    "overhead_weight_sync_pct",
    "overhead_pct",
    "overhead_pct_lo",
    "overhead_pct_hi",
    "reward_first",
    "reward_last",
    "reward_window",
    "n_seeds",
    "n_steps",
    "runs",
)
MAIN_HEADERS: dict[str, str] = {
    "arm": "arm",
    "logprob_abs_diff_mean": "mean abs logprob diff (nats)",
    "logprob_abs_diff_max": "max abs logprob diff (nats)",
    "mismatch_count": "mismatched tokens",
    "tokens": "tokens",
    "seqs_cross_chunk": "seqs crossing C",
    "reward_first": "reward, first steps",
    "reward_last": "reward, last steps",
    "time_step_s": "step (s)",
    "overhead_pct": "step overhead vs native",
    "overhead_pct_lo": "step overhead, 95% low",
    "overhead_pct_hi": "step overhead, 95% high",
}
"""The compact main table (``tables/main.*``): summary columns and their readable headers with units. The
md/tex show mismatched tokens as ``count / tokens`` and the overhead as ``+x% [lo, hi]``; the reward
headers name the window (:func:`reward_headers`)."""
TIMING_COLUMNS: tuple[str, ...] = ("arm", "phase", "time_s", "time_sd_step", "time_sd_seed", "overhead_pct",
                                   "overhead_pct_lo", "overhead_pct_hi", "n_seeds", "n_steps")
TIMING_HEADERS: dict[str, str] = {"time_s": "s per step", "time_sd_step": "sd over steps",
                                  "time_sd_seed": "sd over seed means", "overhead_pct": "overhead vs native",
                                  "overhead_pct_lo": "95% low", "overhead_pct_hi": "95% high"}
"""Readable headers of the timing table's md/tex (its csv keeps the column names)."""
SCIENTIFIC = {
    "logprob_abs_diff_mean",
    "logprob_abs_diff_std",
    "logprob_abs_diff_max_mean",
    "logprob_abs_diff_max",
    "mismatch_rate",
    "k3_kl",
}
INTEGER = {"mismatch_count", "tokens", "prompt_tokens", "seqs", "seqs_cross_chunk", "seqs_multi_kv_block",
           "seq_len_max", "n_seeds", "n_steps", "seed", "reward_window"}
REWARD_WINDOW = 10  # steps averaged at each end of a run for reward_first / reward_last (at most half the run)


def _token_weighted_mean(values: pd.Series, tokens: pd.Series) -> float:
    n = float(tokens.sum())
    if n <= 0 or values.isna().any():
        return math.nan
    return float((values * tokens).sum() / n)


def _pooled_std(mean: pd.Series, std: pd.Series, tokens: pd.Series) -> float:
    """Std over all tokens from per-step (mean, std, count): sqrt(sum n_i (s_i^2 + (m_i - m)^2) / N)."""
    m = _token_weighted_mean(mean, tokens)
    if math.isnan(m) or std.isna().any():
        return math.nan
    var = float((tokens * (std**2 + (mean - m) ** 2)).sum() / tokens.sum())
    return math.sqrt(max(var, 0.0))


def _optional(g: pd.DataFrame, key: str, how: str) -> float:
    """``how`` (sum, min, max) of an optional per-step key; NaN when some row lacks it."""
    if key not in g or g[key].isna().any():
        return math.nan
    return float(getattr(g[key], how)())


def reward_window(df: pd.DataFrame) -> int:
    """Steps averaged at each end for reward_first / reward_last: ``REWARD_WINDOW``, or half the shortest
    run when it has fewer than ``2 * REWARD_WINDOW`` steps (at least 1: a one-step run's ends are that step)."""
    shortest = int(df.groupby(["arm", "seed"])["step"].count().min())
    return max(1, min(REWARD_WINDOW, shortest // 2))


def reward_headers(window: int) -> dict[str, str]:
    """The main table's reward headers for ``window`` steps at each end."""
    steps = "step" if window == 1 else f"{window} steps"
    return {"reward_first": f"reward, first {steps}", "reward_last": f"reward, last {steps}"}


def _reward_end(g: pd.DataFrame, window: int, last: bool) -> float:
    """Mean over seeds of each seed's mean reward over its first (or last) ``window`` steps."""
    per_seed = g.sort_values("step").groupby("seed")["reward_mean"]
    ends = per_seed.apply(lambda s: s.tail(window).mean() if last else s.head(window).mean())
    return float(ends.mean())


def _aggregate(g: pd.DataFrame, window: int) -> dict:
    """Every column but the overheads for one group of per-step rows (one arm, one or more seeds)."""
    tokens = g["tokens"].astype(float)
    frac = g["seqs_cross_chunk"] / g["seqs"] if {"seqs_cross_chunk", "seqs"} <= set(g) else pd.Series([math.nan])
    row = {
        "mode": str(g["mode"].iloc[0]) if "mode" in g else str(g["arm"].iloc[0]),
        "logprob_abs_diff_mean": _token_weighted_mean(g["logprob_abs_diff_mean"], tokens),
        "logprob_abs_diff_std": _pooled_std(g["logprob_abs_diff_mean"], g["logprob_abs_diff_std"], tokens),
        "logprob_abs_diff_max_mean": float(g["logprob_abs_diff_max"].mean()),
        "logprob_abs_diff_max": float(g["logprob_abs_diff_max"].max()),
        "mismatch_count": int(g["mismatch_count"].sum()),
        "tokens": int(g["tokens"].sum()),
        "mismatch_rate": float(g["mismatch_count"].sum() / tokens.sum()) if tokens.sum() > 0 else math.nan,
        "prompt_tokens": _optional(g, "prompt_tokens", "sum"),
        "seqs": _optional(g, "seqs", "sum"),
        "seqs_cross_chunk": _optional(g, "seqs_cross_chunk", "sum"),
        "cross_chunk_frac_min": float(frac.min()) if frac.notna().all() else math.nan,
        "seqs_multi_kv_block": _optional(g, "seqs_multi_kv_block", "sum"),
        "seq_len_max": _optional(g, "seq_len_max", "max"),
        "k3_kl": _token_weighted_mean(g["k3_kl"], tokens) if "k3_kl" in g else math.nan,
        "is_ratio_min": _optional(g, "is_ratio_min", "min"),
        "is_ratio_max": _optional(g, "is_ratio_max", "max"),
        "is_ratio_clip_frac": (_token_weighted_mean(g["is_ratio_clip_frac"], tokens)
                               if "is_ratio_clip_frac" in g else math.nan),
        "tis_capped_frac": _optional(g, "tis_capped_frac", "mean"),
        "correction_masked_frac": _optional(g, "correction_masked_frac", "mean"),
        "reward_first": _reward_end(g, window, last=False),
        "reward_last": _reward_end(g, window, last=True),
        "reward_window": window,
        "n_seeds": int(g["seed"].nunique()),
        "n_steps": int(g["step"].nunique()),
        "runs": runs_label(g),
    }
    timed = timed_steps(g)
    for key, col, _ in TIME_KEYS:
        row[col] = float(timed[key].mean())
    return row


def runs_label(g: pd.DataFrame) -> str:
    """An arm's runs as "seeds x steps" ("3 x 50"), or each seed's step count in seed order where they
    differ ("50 + 50 + 40 steps"), from its per-step rows (columns ``seed``, ``step``)."""
    per_seed = g.groupby("seed")["step"].nunique().sort_index()
    if per_seed.nunique() == 1:
        return f"{len(per_seed)} x {int(per_seed.iloc[0])}"
    return " + ".join(str(int(n)) for n in per_seed) + " steps"


# --------------------------------------------------------------------------------------------------
# paired overheads and their intervals
# --------------------------------------------------------------------------------------------------


def phase_overhead(df: pd.DataFrame, arm: str, key: str = "time/step",
                   seeds: Sequence[int] | None = None) -> tuple[float, float, float]:
    """``(overhead, low, high)`` in percent of ``arm``'s ``key`` time against native's: for each of ``seeds``
    (default all) the ratio of the summed times over the steps both timed, the mean of those ratios minus
    one, and the :func:`bootstrap_interval` of it. NaN for native itself or an arm without a paired run."""
    runs = [v for (a, s), v in paired_times(df, key).items() if a == arm and (seeds is None or s in seeds)]
    if not runs:
        return math.nan, math.nan, math.nan
    lo, hi = bootstrap_interval(runs)
    return tuple(100.0 * (x - 1.0) for x in (float(np.mean([ratio_of_sums(*v) for v in runs])), lo, hi))


def _overheads(df: pd.DataFrame, arm: str, seeds: Sequence[int] | None = None) -> dict[str, float]:
    """Every overhead column of ``arm`` against native (over ``seeds``, default all), with the step
    overhead's interval."""
    out: dict[str, float] = {}
    for key, _, col in TIME_KEYS:
        out[col], lo, hi = phase_overhead(df, arm, key, seeds)
        if key == "time/step":
            out["overhead_pct_lo"], out["overhead_pct_hi"] = lo, hi
    return out


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """The ``summary`` table (one row per arm) from :func:`isoexec.report.data.load_metrics` rows."""
    window = reward_window(df)
    rows = [{"arm": arm, **_aggregate(g, window), **_overheads(df, arm)} for arm, g in df.groupby("arm", sort=False)]
    table = pd.DataFrame(rows).sort_values("arm", key=lambda s: s.map(arm_sort_key), kind="stable")
    return table[list(COLUMNS)].reset_index(drop=True)


def summarize_per_seed(df: pd.DataFrame) -> pd.DataFrame:
    """The ``per_seed`` table (one row per (arm, seed)); same columns as :func:`summarize` plus seed."""
    window = reward_window(df)
    rows = [{"arm": arm, "seed": int(seed), **_aggregate(g, window), **_overheads(df, arm, [int(seed)])}
            for (arm, seed), g in df.groupby(["arm", "seed"], sort=False)]
    table = pd.DataFrame(rows)
    table = table.sort_values(["arm", "seed"], key=lambda s: s.map(arm_sort_key) if s.name == "arm" else s, kind="stable")
    return table[["arm", "seed", *COLUMNS[1:]]].reset_index(drop=True)


def summarize_timing(df: pd.DataFrame) -> pd.DataFrame:
    """The ``timing`` table: one row per (arm, phase), see the module docstring."""
    timed = timed_steps(df)
    rows = []
    for arm, g in timed.groupby("arm", sort=False):
        for key, _, _ in TIME_KEYS:
            runs = g.groupby("seed")[key]
            pct, lo, hi = phase_overhead(df, arm, key)
            rows.append({
                "arm": arm,
                "phase": key.removeprefix("time/"),
                "time_s": float(g[key].mean()),
                "time_sd_step": math.sqrt(float(runs.var(ddof=1).mean())) if runs.count().min() > 1 else math.nan,
                "time_sd_seed": float(runs.mean().std(ddof=1)) if g["seed"].nunique() > 1 else math.nan,
                "overhead_pct": pct,
                "overhead_pct_lo": lo,
                "overhead_pct_hi": hi,
                "n_seeds": int(g["seed"].nunique()),
                "n_steps": int(g["step"].nunique()),
            })
    table = pd.DataFrame(rows).sort_values("arm", key=lambda s: s.map(arm_sort_key), kind="stable")
    return table[list(TIMING_COLUMNS)].reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------------


def format_scientific(x: float) -> str:
    """``1.648e-2`` as in the blog's table; an exact zero stays ``0``."""
    if x == 0:
        return "0"
    mantissa, exponent = f"{x:.3e}".split("e")
    return f"{mantissa}e{int(exponent)}"


TEXT_COLUMNS = {"arm", "mode", "phase", "experiment", "device", "runs", "run", "commit", "per_seed_pct", "inside",
                "inside_pooled"}
NOTE = ("Diffs are |trainer - rollout| logprob per response token; 0 means bitwise identical. Times are seconds "
        "per step without each run's first step (start-up, warm-up). Overheads are against native, paired within "
        "each seed (the arm's summed time over native's, over the same steps), then averaged over seeds; "
        "[low, high]: 95% interval, a bootstrap that resamples the seeds, then each seed's steps.")


def format_value(col: str, x) -> str:
    """One cell as shown in md/tex; ``""`` for a missing value (e.g. the native row's overhead); a string
    (a cell composed for display) as it is."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if isinstance(x, str) or col in TEXT_COLUMNS:
        return str(x)
    if col in INTEGER:
        return str(int(x))
    if col in SCIENTIFIC:
        return format_scientific(float(x))
    if col.startswith("overhead"):
        return f"{float(x):+.1f}%"
    if col.startswith("time_"):
        return f"{x:.1f}" if abs(x) >= 1 else f"{x:.3g}"
    if col.startswith("reward") or col == "cross_chunk_frac_min":
        return f"{x:.3f}"
    if col.startswith("is_ratio_m"):
        return f"{x:.6g}"
    return f"{x:.4g}"


def overhead_cell(pct: float, lo: float, hi: float) -> str:
    """``+9.7% [+3.1, +16.2]`` (the interval left out where there is none; empty for the baseline)."""
    if math.isnan(pct):
        return ""
    cell = format_value("overhead_pct", pct)
    return cell if math.isnan(lo) else f"{cell} [{lo:+.1f}, {hi:+.1f}]"


def main_display(summary: pd.DataFrame, further: dict[str, tuple[float, float, float]] | None = None
                 ) -> tuple[pd.DataFrame, dict[str, str]]:
    """The main table as shown in md/tex: cells formatted, ``mismatched / tokens`` and the overhead with its
    interval in one cell each; returns the table and its headers. ``further`` (an experiment with reruns,
    :func:`isoexec.report.reruns.further_run`): per arm the overhead over every run and the 95% prediction
    interval of a further run's, one more column."""
    window = int(summary["reward_window"].min())
    shown = pd.DataFrame({
        "arm": summary["arm"],
        "logprob_abs_diff_mean": summary["logprob_abs_diff_mean"].map(lambda x: format_value("logprob_abs_diff_mean", x)),
        "logprob_abs_diff_max": summary["logprob_abs_diff_max"].map(lambda x: format_value("logprob_abs_diff_max", x)),
        "mismatched": [f"{int(m)} / {int(t)}" for m, t in zip(summary["mismatch_count"], summary["tokens"], strict=True)],
        "seqs_cross_chunk": summary["seqs_cross_chunk"].map(lambda x: format_value("seqs_cross_chunk", x)),
        "reward_first": summary["reward_first"].map(lambda x: format_value("reward_first", x)),
        "reward_last": summary["reward_last"].map(lambda x: format_value("reward_last", x)),
        "time_step_s": summary["time_step_s"].map(lambda x: format_value("time_step_s", x)),
        "overhead": [overhead_cell(*v) for v in zip(summary["overhead_pct"], summary["overhead_pct_lo"],
                                                     summary["overhead_pct_hi"], strict=True)],
    })
    headers = {**MAIN_HEADERS, **reward_headers(window), "mismatched": "mismatched tokens / tokens",
               "overhead": "step overhead vs native [95% interval]"}
    if further:
        shown["further"] = [overhead_cell(*further.get(a, (math.nan,) * 3)) for a in summary["arm"]]
        headers["further"] = "over every run: a further run's step overhead [95% prediction, runs as units]"
    return shown, headers


def rerun_display(table: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, str]]:
    """The reruns table as shown in md/tex (overheads with their intervals in one cell each) and its headers."""

    def interval(lo: float, hi: float) -> str:
        return "" if math.isnan(lo) else f"[{lo:+.1f}, {hi:+.1f}]"

    def inside(v: object) -> str:
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else ("yes" if v else "no")

    shown = pd.DataFrame({
        "run": table["run"], "commit": table["commit"], "arm": table["arm"],
        "overhead": [overhead_cell(*v) for v in zip(table["overhead_pct"], table["overhead_pct_lo"],
                                                     table["overhead_pct_hi"], strict=True)],
        "per_seed_pct": table["per_seed_pct"],
        "predicted": [interval(*v) for v in zip(table["predicted_lo"], table["predicted_hi"], strict=True)],
        "inside": [inside(v) for v in table["inside"]],
        "pooled": [interval(*v) for v in zip(table["pooled_lo"], table["pooled_hi"], strict=True)],
        "inside_pooled": [inside(v) for v in table["inside_pooled"]],
    })
    headers = {"overhead": "step overhead vs native [the run's own 95% interval]",
               "per_seed_pct": "per seed (%)",
               "predicted": "95% prediction from the runs before it (runs as units)",
               "inside": "inside?",
               "pooled": "95% prediction, seeds pooled (no run-level shift assumed)",
               "inside_pooled": "inside?"}
    return shown, headers


def _formatted(table: pd.DataFrame) -> list[list[str]]:
    return [[format_value(c, v) for c, v in zip(table.columns, row, strict=True)] for row in table.itertuples(index=False)]


def to_markdown(table: pd.DataFrame, prov: dict, title: str, headers: dict[str, str] | None = None,
                note: str = NOTE) -> str:
    """A GitHub-markdown table with the provenance in an HTML comment header; ``headers`` renames columns
    for display (cells are formatted by their column's name); ``note`` follows the table."""
    lines = ["<!--", *(f"  {line}" for line in provenance_lines(prov)), "-->", f"**{title}**", ""]
    lines.append("| " + " | ".join((headers or {}).get(c, c) for c in table.columns) + " |")
    lines.append("|" + "|".join("---" if c in TEXT_COLUMNS else "---:" for c in table.columns) + "|")
    lines += ["| " + " | ".join(cells) + " |" for cells in _formatted(table)]
    lines += ["", note, ""]
    return "\n".join(lines)


def _tex_escape(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("#", r"\#"), ("_", r"\_"), ("$", r"\$")):
        s = s.replace(a, b)
    return s


def to_latex(table: pd.DataFrame, prov: dict, title: str, headers: dict[str, str] | None = None) -> str:
    """A booktabs ``tabular`` with the provenance in ``%`` comments; ``headers`` as in :func:`to_markdown`."""
    lines = [f"% {line}" for line in provenance_lines(prov)]
    lines.append(f"% {title}")
    lines.append(r"\begin{tabular}{" + "".join("l" if c in TEXT_COLUMNS else "r" for c in table.columns) + "}")
    lines.append(r"\toprule")
    lines.append(" & ".join(_tex_escape((headers or {}).get(c, c)) for c in table.columns) + r" \\")
    lines.append(r"\midrule")
    lines += [" & ".join(_tex_escape(x) for x in cells) + r" \\" for cells in _formatted(table)]
    lines += [r"\bottomrule", r"\end{tabular}", ""]
    return "\n".join(lines)


def write_table(table: pd.DataFrame, out_dir: Path, stem: str, prov: dict, title: str,
                headers: dict[str, str] | None = None,
                shown: tuple[pd.DataFrame, dict[str, str]] | None = None, note: str = NOTE) -> list[Path]:
    """``<stem>.csv`` + ``<stem>.provenance.json`` + ``<stem>.md`` + ``<stem>.tex``, each atomically.

    ``headers`` renames the columns of the csv (and of md/tex); ``shown``: another table and its headers
    for md/tex (cells composed for display, e.g. :func:`main_display`); ``note`` follows the md table."""
    md_table, md_headers = shown or (table, headers)
    files = [
        atomic_write_text(out_dir / f"{stem}.csv", table.rename(columns=headers or {}).to_csv(index=False)),
        atomic_write_text(out_dir / f"{stem}.provenance.json", json.dumps(prov, indent=2, sort_keys=True) + "\n"),
        atomic_write_text(out_dir / f"{stem}.md", to_markdown(md_table, prov, title, md_headers, note)),
        atomic_write_text(out_dir / f"{stem}.tex", to_latex(md_table, prov, title, md_headers)),
    ]
    return files


def write_tables(
    exp_dir: str | Path, arms: Sequence[str] | None = None, seeds: Sequence[int] | None = None
) -> list[Path]:
    """Compute and write ``<exp_dir>/tables/{summary,per_seed,timing,main}.{csv,provenance.json,md,tex}`` and
    ``comparison.md``; where the experiment has reruns of its RL stage (``reruns/<name>/rl/``) and the selection
    is every run on disk, also ``reruns.*`` and the main table's column of a further run's interval
    (:mod:`isoexec.report.reruns`).

    Args:
        exp_dir: ``results/<exp>``; metrics are read from ``rl/<arm>/seed<k>/metrics.jsonl``.
        arms, seeds: restrict to these runs (default: every run on disk).

    Returns:
        the paths written.
    """
    exp_dir = Path(exp_dir)
    runs = discover_runs(exp_dir, arms, seeds)
    df = load_metrics(exp_dir, arms, seeds)
    prov = report_provenance(exp_dir, [d / "metrics.jsonl" for _, _, d in runs], [d for _, _, d in runs])
    out = exp_dir / "tables"
    name = exp_dir.name
    arms_named = ", ".join(sorted(df["arm"].unique(), key=arm_sort_key))
    summary = summarize(df)
    further, main, reruns = {}, summary[list(MAIN_HEADERS)].copy(), None
    every_run = {(a, s) for a, s, _ in runs} == {(a, s) for a, s, _ in discover_runs(exp_dir)}
    if every_run and len(run_dirs(exp_dir)) > 1:  # reruns/: a further run's interval (computed before any write)
        reruns = rerun_table(exp_dir)
        further = further_run(reruns)
        for i, col in enumerate(("further_run_overhead_pct", "further_run_pct_lo", "further_run_pct_hi")):
            main[col] = [further.get(a, (math.nan,) * 3)[i] for a in main["arm"]]
    files = write_table(summary, out, "summary", prov, f"{name}: {arms_named}, all seeds and steps")
    files.append(
        atomic_write_text(out / "comparison.md", to_comparison_markdown(summary, prov, f"{name} vs the published result"))
    )
    if reruns is not None:
        rerun_runs = [r for _, d in run_dirs(exp_dir) for r in discover_runs(d)]
        files += write_table(reruns, out, "reruns",
                             report_provenance(exp_dir, [d / "metrics.jsonl" for _, _, d in rerun_runs],
                                               [d for _, _, d in rerun_runs]),
                             f"{name}: the RL stage's runs, each one's step overhead and the intervals the runs before it gave",
                             shown=rerun_display(reruns), note=RERUN_NOTE)
    files += write_table(main, out, "main", prov,
                         f"{name}: {arms_named} (means over seeds; the full table is summary.*)",
                         {**MAIN_HEADERS, **reward_headers(int(summary["reward_window"].min()))},
                         shown=main_display(summary, further), note=NOTE + (" " + FURTHER_NOTE if further else ""))
    files += write_table(summarize_per_seed(df), out, "per_seed", prov, f"{name}: per seed")
    timing = summarize_timing(df)
    files += write_table(timing, out, "timing", prov,
                         f"{name}: seconds per step by phase, their spread over steps and seeds, overheads vs native",
                         shown=(timing, TIMING_HEADERS))
    return files


# The published reference (docs/design.md, The problem: vLLM blog, Qwen3.5-35B-A3B, 8xH100, 50 steps).
PUBLISHED = {
    "native": {
        "logprob_abs_diff_mean": 1.648e-2,
        "logprob_abs_diff_std": 4.035e-2,
        "logprob_abs_diff_max_mean": 5.073,
        "time_generation_s": 591.3,
        "time_train_s": 498.6,
        "time_step_s": 1224.6,
    },
    "isoexec": {
        "logprob_abs_diff_mean": 6.744e-7,
        "logprob_abs_diff_std": 6.821e-7,
        "logprob_abs_diff_max_mean": 7.358e-6,
        "time_generation_s": 776.6,
        "time_train_s": 591.3,
        "time_step_s": 1534.0,
        "overhead_generation_pct": 31.3,
        "overhead_train_pct": 18.6,
        "overhead_pct": 25.3,
    },
}
_COMPARISON_ROWS = (
    ("mean pre-update abs logprob diff", "logprob_abs_diff_mean", None),
    ("std of that diff", "logprob_abs_diff_std", None),
    ("mean per-step max diff", "logprob_abs_diff_max_mean", None),
    ("max diff over all steps", "logprob_abs_diff_max", None),
    ("mismatched tokens / tokens", "mismatch_count", "tokens"),
    ("generation time / step", "time_generation_s", "overhead_generation_pct"),
    ("trainer_score time / step", "time_score_s", "overhead_score_pct"),
    ("policy training time / step", "time_train_s", "overhead_train_pct"),
    ("weight sync time / step", "time_weight_sync_s", "overhead_weight_sync_pct"),
    ("full RL step", "time_step_s", "overhead_pct"),
    ("mean reward, first {w} -> last {w} steps", "reward_first", "reward_last"),
    ("sequences crossing GDN chunks / sequences", "seqs_cross_chunk", "seqs"),
)


def _comparison_cell(row: dict | None, col: str, extra: str | None) -> str:
    if row is None or col not in row:
        return ""
    v = format_value(col, row[col])
    if col.startswith("time_"):
        v += " s"
        ov = row.get(extra)
        if ov is not None and not (isinstance(ov, float) and math.isnan(ov)):
            v += f" ({format_value(extra, ov)})"
    elif extra in ("tokens", "seqs"):
        v += f" / {format_value(extra, row[extra])}"
    elif extra == "reward_last":
        v += f" -> {format_value(extra, row[extra])}"
    return v


def to_comparison_markdown(summary: pd.DataFrame, prov: dict, title: str) -> str:
    """The summary in the published table's layout (metric rows, arm columns) beside the blog's values."""
    rows = {r["arm"]: r for r in summary.to_dict("records")}
    modes = sorted(rows, key=arm_sort_key)
    lines = ["<!--", *(f"  {line}" for line in provenance_lines(prov)), "-->", f"**{title}**", ""]
    head = ["metric", *modes, *(f"published {m}" for m in PUBLISHED)]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|---" + "|---:" * (len(head) - 1) + "|")
    window = int(summary["reward_window"].min())
    for label, col, extra in _COMPARISON_ROWS:
        cells = [_comparison_cell(rows[m], col, extra) for m in modes]
        cells += [_comparison_cell(PUBLISHED[m], col, extra) for m in PUBLISHED]
        lines.append("| " + " | ".join([label.format(w=window), *cells]) + " |")
    lines.append("| " + " | ".join(["seeds x steps", *(rows[m]["runs"] for m in modes), "1 x 50", "1 x 50"]) + " |")
    lines += [
        "",
        "Published: vLLM blog (2026-08-21), SkyRL + vLLM + Megatron, Qwen3.5-35B-A3B, DAPO-Math-17k, "
        "one 8xH100 node. Overheads in parentheses are relative to native.",
        "",
    ]
    return "\n".join(lines)
