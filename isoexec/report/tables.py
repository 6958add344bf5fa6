"""Summary tables of the paired native-vs-IsoExec RL runs (docs/design.md, Metrics and The experiments).

``summary`` has one row per mode, aggregated over every seed and step:

=============================  =======================================================================
column                         definition
=============================  =======================================================================
mode                           ``native`` or ``isoexec``
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
time_generation_s, ...         mean seconds per step of time/generation, /score, /train, /weight_sync,
                               /step, without each run's first step (engine start-up and warm-up)
overhead_generation_pct, ...   100 * (t_mode / t_native - 1), computed per step pairwise within the
                               same seed, then averaged; empty for the native row
reward_first10, reward_last10  mean reward_mean over each seed's first / last 10 steps (fewer when
                               the run is shorter), averaged over seeds
n_seeds, n_steps               seeds and distinct steps aggregated
=============================  =======================================================================

``per_seed`` has the same columns with one row per (mode, seed). Exact zeros stay exact: a mode whose
every diff is 0.0 gets 0.0 (not 1e-30, not NaN) in every diff column. Columns whose per-step key a
run does not record (metrics written before the key existed) are empty.

Files (under ``<exp_dir>/tables/``, written atomically): ``summary.csv`` (full precision) with
``summary.provenance.json`` beside it, ``summary.md`` and ``summary.tex`` (formatted like the blog,
provenance in a comment header), the same for ``per_seed`` and for ``main`` (the compact table a paper
takes: :data:`MAIN_HEADERS`, readable headers with units), and ``comparison.md``: the summary in the
layout of the published table (docs/design.md, The problem) with the published values beside it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from isoexec.report.data import (
    atomic_write_text,
    discover_runs,
    load_metrics,
    provenance_lines,
    report_provenance,
)

BASELINE_MODE = "native"
MODE_ORDER = ("native", "isoexec")
# (metrics key, table column, overhead column) for the timing columns.
TIME_KEYS: tuple[tuple[str, str, str], ...] = (
    ("time/generation", "time_generation_s", "overhead_generation_pct"),
    ("time/score", "time_score_s", "overhead_score_pct"),
    ("time/train", "time_train_s", "overhead_train_pct"),
    ("time/weight_sync", "time_weight_sync_s", "overhead_weight_sync_pct"),
    ("time/step", "time_step_s", "overhead_pct"),
)
COLUMNS: tuple[str, ...] = (
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
    "reward_first10",
    "reward_last10",
    "n_seeds",
    "n_steps",
)
MAIN_HEADERS: dict[str, str] = {
    "mode": "mode",
    "logprob_abs_diff_mean": "mean abs logprob diff (nats)",
    "logprob_abs_diff_max": "max abs logprob diff (nats)",
    "mismatch_count": "mismatched tokens",
    "tokens": "tokens",
    "seqs_cross_chunk": "seqs crossing C",
    "reward_first10": "reward, first 10 steps",
    "reward_last10": "reward, last 10 steps",
    "time_step_s": "step (s)",
    "overhead_pct": "step overhead",
}
"""The compact main table (``tables/main.*``): summary columns and their readable headers with units."""
SCIENTIFIC = {
    "logprob_abs_diff_mean",
    "logprob_abs_diff_std",
    "logprob_abs_diff_max_mean",
    "logprob_abs_diff_max",
    "mismatch_rate",
    "k3_kl",
}
INTEGER = {"mismatch_count", "tokens", "prompt_tokens", "seqs", "seqs_cross_chunk", "seqs_multi_kv_block",
           "seq_len_max", "n_seeds", "n_steps", "seed"}
REWARD_WINDOW = 10  # steps averaged at each end of a run for reward_first10 / reward_last10


def mode_sort_key(mode: str) -> tuple[int, str]:
    """Sort key: native, isoexec, then any other mode by name."""
    return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), mode)


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


def timed_steps(df: pd.DataFrame) -> pd.DataFrame:
    """Rows that count for timing: every step but the first of each (mode, seed) run, whose time
    includes engine start-up and first-call warm-up; a run of a single step keeps it."""
    first = df.groupby(["mode", "seed"])["step"].transform("min")
    n = df.groupby(["mode", "seed"])["step"].transform("count")
    return df[(df["step"] != first) | (n == 1)]


def _optional(g: pd.DataFrame, key: str, how: str) -> float:
    """``how`` (sum, min, max) of an optional per-step key; NaN when some row lacks it."""
    if key not in g or g[key].isna().any():
        return math.nan
    return float(getattr(g[key], how)())


def _reward_window(g: pd.DataFrame, last: bool) -> float:
    """Mean over seeds of each seed's mean reward over its first (or last) ``REWARD_WINDOW`` steps."""
    per_seed = g.sort_values("step").groupby("seed")["reward_mean"]
    ends = per_seed.apply(lambda s: s.tail(REWARD_WINDOW).mean() if last else s.head(REWARD_WINDOW).mean())
    return float(ends.mean())


def _aggregate(g: pd.DataFrame) -> dict:
    """Every non-overhead column for one group of per-step rows (one mode, one or more seeds)."""
    tokens = g["tokens"].astype(float)
    frac = g["seqs_cross_chunk"] / g["seqs"] if {"seqs_cross_chunk", "seqs"} <= set(g) else pd.Series([math.nan])
    row = {
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
        "reward_first10": _reward_window(g, last=False),
        "reward_last10": _reward_window(g, last=True),
        "n_seeds": int(g["seed"].nunique()),
        "n_steps": int(g["step"].nunique()),
    }
    timed = timed_steps(g)
    for key, col, _ in TIME_KEYS:
        row[col] = float(timed[key].mean())
    return row


def paired_overhead(df: pd.DataFrame, key: str = "time/step", baseline: str = BASELINE_MODE) -> pd.DataFrame:
    """Per-step paired overhead of every mode against ``baseline``, in percent.

    Rows of a mode are matched to the baseline's rows of the same (seed, step); each pair gives
    ``100 * (t_mode / t_baseline - 1)``. Pairs whose baseline time is 0 or missing are dropped, and
    so are the warm-up steps (see :func:`timed_steps`).

    Returns:
        columns mode, seed, step, overhead_pct (the baseline mode itself is not included).
    """
    df = timed_steps(df)
    base = df[df["mode"] == baseline][["seed", "step", key]].rename(columns={key: "_base"})
    other = df[df["mode"] != baseline][["mode", "seed", "step", key]]
    pairs = other.merge(base, on=["seed", "step"], how="inner")
    pairs = pairs[(pairs["_base"] > 0) & pairs[key].notna()]
    pairs = pairs.assign(overhead_pct=100.0 * (pairs[key] / pairs["_base"] - 1.0))
    return pairs[["mode", "seed", "step", "overhead_pct"]].reset_index(drop=True)


def _with_overheads(table: pd.DataFrame, df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    for key, _, col in TIME_KEYS:
        ov = paired_overhead(df, key)
        means = ov.groupby(by)["overhead_pct"].mean().rename(col).reset_index()
        table = table.merge(means, on=by, how="left")
    return table


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """The ``summary`` table (one row per mode) from :func:`isoexec.report.data.load_metrics` rows."""
    rows = [{"mode": mode, **_aggregate(g)} for mode, g in df.groupby("mode", sort=False)]
    table = _with_overheads(pd.DataFrame(rows), df, ["mode"])
    table = table.sort_values("mode", key=lambda s: s.map(mode_sort_key), kind="stable")
    return table[list(COLUMNS)].reset_index(drop=True)


def summarize_per_seed(df: pd.DataFrame) -> pd.DataFrame:
    """The ``per_seed`` table (one row per (mode, seed)); same columns as :func:`summarize` plus seed."""
    rows = [{"mode": mode, "seed": int(seed), **_aggregate(g)} for (mode, seed), g in df.groupby(["mode", "seed"], sort=False)]
    table = _with_overheads(pd.DataFrame(rows), df, ["mode", "seed"])
    table = table.sort_values(["mode", "seed"], key=lambda s: s.map(mode_sort_key) if s.name == "mode" else s, kind="stable")
    cols = ["mode", "seed", *COLUMNS[1:]]
    return table[cols].reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------------


def format_scientific(x: float) -> str:
    """``1.648e-2`` as in the blog's table; an exact zero stays ``0``."""
    if x == 0:
        return "0"
    mantissa, exponent = f"{x:.3e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def format_value(col: str, x) -> str:
    """One cell as shown in md/tex; ``""`` for a missing value (e.g. the native row's overhead)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if col == "mode":
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


def _formatted(table: pd.DataFrame) -> list[list[str]]:
    return [[format_value(c, v) for c, v in zip(table.columns, row, strict=True)] for row in table.itertuples(index=False)]


def to_markdown(table: pd.DataFrame, prov: dict, title: str, headers: dict[str, str] | None = None) -> str:
    """A GitHub-markdown table with the provenance in an HTML comment header; ``headers`` renames columns
    for display (cells are formatted by their column's name)."""
    lines = ["<!--", *(f"  {line}" for line in provenance_lines(prov)), "-->", f"**{title}**", ""]
    lines.append("| " + " | ".join((headers or {}).get(c, c) for c in table.columns) + " |")
    lines.append("|" + "|".join("---" if c == "mode" else "---:" for c in table.columns) + "|")
    lines += ["| " + " | ".join(cells) + " |" for cells in _formatted(table)]
    lines += [
        "",
        "Diffs are |trainer - rollout| logprob per response token; 0 means bitwise identical. "
        "Times are seconds per step without each run's first (warm-up) step; overheads are paired per step "
        "within each seed, then averaged.",
        "",
    ]
    return "\n".join(lines)


def _tex_escape(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("#", r"\#"), ("_", r"\_"), ("$", r"\$")):
        s = s.replace(a, b)
    return s


def to_latex(table: pd.DataFrame, prov: dict, title: str, headers: dict[str, str] | None = None) -> str:
    """A booktabs ``tabular`` with the provenance in ``%`` comments; ``headers`` as in :func:`to_markdown`."""
    lines = [f"% {line}" for line in provenance_lines(prov)]
    lines.append(f"% {title}")
    lines.append(r"\begin{tabular}{" + "".join("l" if c == "mode" else "r" for c in table.columns) + "}")
    lines.append(r"\toprule")
    lines.append(" & ".join(_tex_escape((headers or {}).get(c, c)) for c in table.columns) + r" \\")
    lines.append(r"\midrule")
    lines += [" & ".join(_tex_escape(x) for x in cells) + r" \\" for cells in _formatted(table)]
    lines += [r"\bottomrule", r"\end{tabular}", ""]
    return "\n".join(lines)


def write_table(table: pd.DataFrame, out_dir: Path, stem: str, prov: dict, title: str,
                headers: dict[str, str] | None = None) -> list[Path]:
    """``<stem>.csv`` + ``<stem>.provenance.json`` + ``<stem>.md`` + ``<stem>.tex``, each atomically;
    ``headers`` renames the columns in all three tables."""
    files = [
        atomic_write_text(out_dir / f"{stem}.csv", table.rename(columns=headers or {}).to_csv(index=False)),
        atomic_write_text(out_dir / f"{stem}.provenance.json", json.dumps(prov, indent=2, sort_keys=True) + "\n"),
        atomic_write_text(out_dir / f"{stem}.md", to_markdown(table, prov, title, headers)),
        atomic_write_text(out_dir / f"{stem}.tex", to_latex(table, prov, title, headers)),
    ]
    return files


def write_tables(
    exp_dir: str | Path, modes: Sequence[str] | None = None, seeds: Sequence[int] | None = None
) -> list[Path]:
    """Compute and write ``<exp_dir>/tables/{summary,per_seed}.{csv,provenance.json,md,tex}``.

    Args:
        exp_dir: ``results/<exp>``; metrics are read from ``rl/<mode>/seed<k>/metrics.jsonl``.
        modes, seeds: restrict to these runs (default: every run on disk).

    Returns:
        the paths written.
    """
    exp_dir = Path(exp_dir)
    runs = discover_runs(exp_dir, modes, seeds)
    df = load_metrics(exp_dir, modes, seeds)
    prov = report_provenance(exp_dir, [d / "metrics.jsonl" for _, _, d in runs], [d for _, _, d in runs])
    out = exp_dir / "tables"
    name = exp_dir.name
    summary = summarize(df)
    files = write_table(summary, out, "summary", prov, f"{name}: native vs IsoExec, all seeds and steps")
    files.append(
        atomic_write_text(out / "comparison.md", to_comparison_markdown(summary, prov, f"{name} vs the published result"))
    )
    files += write_table(summary[list(MAIN_HEADERS)], out, "main", prov,
                         f"{name}: native vs IsoExec (means over seeds; the full table is summary.*)", MAIN_HEADERS)
    files += write_table(summarize_per_seed(df), out, "per_seed", prov, f"{name}: per seed")
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
    ("mean reward, first 10 -> last 10 steps", "reward_first10", "reward_last10"),
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
    elif extra == "reward_last10":
        v += f" -> {format_value(extra, row[extra])}"
    return v


def to_comparison_markdown(summary: pd.DataFrame, prov: dict, title: str) -> str:
    """The summary in the published table's layout (metric rows, mode columns) beside the blog's values."""
    rows = {r["mode"]: r for r in summary.to_dict("records")}
    modes = sorted(rows, key=mode_sort_key)
    lines = ["<!--", *(f"  {line}" for line in provenance_lines(prov)), "-->", f"**{title}**", ""]
    head = ["metric", *modes, *(f"published {m}" for m in PUBLISHED)]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|---" + "|---:" * (len(head) - 1) + "|")
    for label, col, extra in _COMPARISON_ROWS:
        cells = [_comparison_cell(rows[m], col, extra) for m in modes]
        cells += [_comparison_cell(PUBLISHED[m], col, extra) for m in PUBLISHED]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    n = {m: f"{int(rows[m]['n_seeds'])} x {int(rows[m]['n_steps'])}" for m in modes}
    lines.append("| " + " | ".join(["seeds x steps", *(n[m] for m in modes), "1 x 50", "1 x 50"]) + " |")
    lines += [
        "",
        "Published: vLLM blog (2026-08-21), SkyRL + vLLM + Megatron, Qwen3.5-35B-A3B, DAPO-Math-17k, "
        "one 8xH100 node. Overheads in parentheses are relative to native.",
        "",
    ]
    return "\n".join(lines)
