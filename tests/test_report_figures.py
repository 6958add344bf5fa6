"""Figures from synthetic paired runs of three arms: files written, exact zeros drawn (not lost to the log
scale), arms told apart where their lines coincide, error bars that are intervals of a mean."""

from __future__ import annotations

import numpy as np
from test_report_tables import write_synthetic_runs

from isoexec.report import figures, tables
from isoexec.report.data import load_metrics


def _zero_row_points(fig, panel: int, arm_row: int) -> list[float]:
    """x of the markers drawn on the '= 0' row of a logprob_diff panel for one arm."""
    zax = fig.axes[2 * panel + 1]
    xs = []
    for line in zax.get_lines():
        y = np.asarray(line.get_ydata(), dtype=float)
        if len(y) and np.all(y == arm_row):
            xs += list(np.asarray(line.get_xdata(), dtype=float))
    return sorted(xs)


def test_all_figures_written_as_png_and_pdf(tmp_path):
    exp = write_synthetic_runs(tmp_path / "results" / "synthetic")
    paths = figures.write_figures(exp)
    for stem in ("logprob_diff", "is_ratio", "reward", "time"):
        png, pdf = exp / "figures" / f"{stem}.png", exp / "figures" / f"{stem}.pdf"
        assert png in paths and pdf in paths
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert pdf.read_bytes()[:5] == b"%PDF-"
        assert png.stat().st_size > 10_000


def test_exact_zeros_are_drawn_on_the_bitwise_row(tmp_path):
    exp = write_synthetic_runs(tmp_path / "results" / "synthetic")
    fig = figures.logprob_diff_figure(load_metrics(exp), "synthetic")
    # arms are ordered native (row 0), isoexec (row 1), native-tis (row 2); isoexec is exactly 0 at steps 0, 1, 2
    for panel in (0, 1):
        assert _zero_row_points(fig, panel, 1) == [0.0, 1.0, 2.0]
        assert _zero_row_points(fig, panel, 0) == _zero_row_points(fig, panel, 2) == []  # the native stack never
        log_ax = fig.axes[2 * panel]
        assert log_ax.get_yscale() == "log"
        assert "= 0 at 3/3 steps" in " ".join(t.get_text() for t in log_ax.get_legend().get_texts())


def test_logprob_diff_figure_with_only_zeros(tmp_path):
    exp = write_synthetic_runs(tmp_path / "results" / "zeros", arms=("isoexec",))
    fig = figures.logprob_diff_figure(load_metrics(exp), "zeros")
    assert _zero_row_points(fig, 0, 0) == [0.0, 1.0, 2.0]
    figures.save_figure(fig, tmp_path / "out", "logprob_diff")
    assert (tmp_path / "out" / "logprob_diff.png").stat().st_size > 0


def test_time_figure_annotates_paired_overhead_with_its_interval(tmp_path):
    exp = write_synthetic_runs(tmp_path / "results" / "synthetic")
    df = load_metrics(exp)
    fig = figures.time_figure(df, "synthetic")
    labels = [t.get_text() for t in fig.axes[0].texts]
    row = tables.summarize(df).set_index("arm").loc["isoexec"]
    # as in tables.summary: overhead_pct and its interval
    assert f"+22.5%\n[{row['overhead_pct_lo']:+.1f}, {row['overhead_pct_hi']:+.1f}]" in labels
    assert fig.axes[0].get_ylabel() == "seconds per RL step"


def test_time_figure_error_bars_are_intervals_of_the_mean_or_none(tmp_path):
    exp = write_synthetic_runs(tmp_path / "results" / "synthetic")
    df = load_metrics(exp)
    ax = figures.time_figure(df, "synthetic").axes[0]
    iso = df[(df["arm"] == "isoexec") & (df["step"] > 0)]
    lo, hi = tables.bootstrap_interval([(g["time/step"].to_numpy(float),) for _, g in iso.groupby("seed")],
                                       stat=lambda t: t.mean(-1))
    spans = {round(float(seg[1, 1]), 9) - round(float(seg[0, 1]), 9) for c in ax.collections for seg in c.get_segments()}
    assert any(abs(span - (hi - lo)) < 1e-6 for span in spans) and "95% interval of the mean" in ax.get_title()
    # one seed, two steps: one timed step per run, nothing to draw an interval from (not a std of one value)
    short = write_synthetic_runs(tmp_path / "results" / "short", seeds=(0,), steps=(0, 1))
    ax = figures.time_figure(load_metrics(short), "short").axes[0]
    assert not [seg for c in ax.collections for seg in c.get_segments() if np.isfinite(seg).all()]
    assert "no error bar: one timed step" in ax.get_title()


def test_time_figure_overhead_labels_sit_above_the_error_bars(tmp_path):
    exp = write_synthetic_runs(tmp_path / "results" / "synthetic")
    fig = figures.time_figure(load_metrics(exp), "synthetic")
    ax = fig.axes[0]
    tops = {round(float(seg[0, 0]), 6): float(seg[:, 1].max()) for coll in ax.collections for seg in coll.get_segments()}
    assert ax.texts and tops
    for t in ax.texts:
        x, y = t.xy
        assert y >= tops[round(float(x), 6)]  # the label's anchor is at the top of its bar's error bar


def test_arms_whose_values_coincide_stay_visible(tmp_path):
    """At the first steps every arm samples the same tokens: equal values must not hide a line."""
    exp = write_synthetic_runs(tmp_path / "results" / "synthetic")
    fig = figures.reward_figure(load_metrics(exp), "synthetic", pass_k=4)
    for ax in fig.axes:
        lines = {ln.get_label().split(" ")[0]: ln for ln in ax.get_lines()}
        assert set(lines) == {"native", "isoexec", "native-tis"}
        styles = {(ln.get_linestyle(), ln.get_marker(), ln.get_markerfacecolor() == "none") for ln in lines.values()}
        assert len(styles) == 3  # line style, marker and fill differ between arms
        assert np.array_equal(lines["native"].get_ydata(), lines["isoexec"].get_ydata())  # the synthetic values coincide


def test_ratio_text_rounds_sensibly_but_never_to_one():
    assert figures.ratio_text(0.607485) == "0.607" and figures.ratio_text(1.05059) == "1.05"
    assert figures.ratio_text(0.9999951) == "0.999995" and figures.ratio_text(1.0) == "1"


def test_reward_figure_names_k_and_its_units(tmp_path):
    exp = write_synthetic_runs(tmp_path / "results" / "synthetic")
    fig = figures.reward_figure(load_metrics(exp), "synthetic", pass_k=4)
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels[0] == "accuracy (fraction of responses)"
    assert "pass@4" in labels[1] and "(fraction) (fraction)" not in " ".join(labels)


def test_ratio_figure_shows_isoexec_at_exactly_one_and_native_spread(tmp_path):
    exp = write_synthetic_runs(tmp_path / "results" / "synthetic")
    fig = figures.ratio_figure(load_metrics(exp), "synthetic")
    band_ax = fig.axes[0]
    native_label, iso_label, tis_label = [t.get_text() for t in band_ax.get_legend().get_texts()]
    assert iso_label == "isoexec: every ratio exactly 1"
    lo, hi = native_label.removeprefix("native: min..max ").split("..")
    assert 1.0 <= float(lo) < float(hi)  # synthetic native diffs are |d| > 0: every ratio above 1
    assert len(hi.split(".")[1]) <= 3 and tis_label.startswith("native-tis: min..max ")  # three digits, not 0.607485
    iso_mean = band_ax.get_lines()[1].get_ydata()
    assert np.all(np.asarray(iso_mean) == 1.0)
    # k3 KL panel: isoexec exactly 0 at every step, on its own row; native never
    zax = fig.axes[2]
    rows = {int(np.asarray(line.get_ydata())[0]): list(line.get_xdata()) for line in zax.get_lines() if len(line.get_ydata())}
    assert rows == {1: [0, 1, 2]}
    assert fig.axes[3].get_ylabel() == "fraction of response tokens"
