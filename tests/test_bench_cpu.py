"""`isoexec bench` writes under runs/<exp>/bench/ (not committed) unless an output folder is given."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from isoexec.cli import app

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--repeats", "1", "--batch", "1", "--seq-len", "8", "--decode-seqs", "1", "--decode-steps", "1"]


def test_bench_leaves_committed_results_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["bench", "--config", str(ROOT / "experiments" / "ci-tiny.yaml"), *TINY])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "runs" / "ci-tiny" / "bench" / "model_throughput.csv").is_file()
    assert (tmp_path / "runs" / "ci-tiny" / "bench" / "model_throughput.provenance.json").is_file()
    assert (tmp_path / "runs" / "ci-tiny" / "bench" / "region_times.provenance.json").is_file()
    regions = (tmp_path / "runs" / "ci-tiny" / "bench" / "region_times.csv").read_text().splitlines()
    assert regions[0].startswith("case,region,native_ms,isoexec_ms"), regions[0]
    for case in ("trainer_score", "engine_prefill", "engine_decode"):
        for region in ("gdn.core", "attn.core", "moe.experts", "(outside regions)", "(case)"):
            assert any(r.startswith(f"{case},{region},") for r in regions), (case, region)
    assert not (tmp_path / "results").exists()
    on_purpose = CliRunner().invoke(app, ["bench", "--config", str(ROOT / "experiments" / "ci-tiny.yaml"), *TINY,
                                          "--out-dir", "results/ci-tiny/bench"])
    assert on_purpose.exit_code == 0, on_purpose.output
    assert (tmp_path / "results" / "ci-tiny" / "bench" / "model_throughput.csv").is_file()


def test_pik_row_parallel_bench_checks_bits_beside_the_times():
    """The row-parallel table of a Megatron experiment's bench: pik at TP=2 equals pik on the full
    tensors; Megatron's GEMM + all_reduce differs from the full GEMM (the negative control)."""
    import torch

    from isoexec.bench.megatron_cpu import row_parallel_shapes, row_parallel_times
    from isoexec.config import load_config

    model = load_config(ROOT / "experiments" / "cpu-tiny.yaml").model
    shapes = row_parallel_shapes(model, trainer_rows=64, decode_rows=4)
    assert [s[0] for s in shapes[::2]] == ["attn.out_proj", "gdn.out_proj", "mlp.shared_expert(down)"]
    rows = row_parallel_times(shapes, leaves=8, row_tile=16, dtype=torch.bfloat16, tp=2, repeats=2)
    assert len(rows) == len(shapes)
    assert all(r["pik_tp_equal_tp1"] for r in rows), rows
    assert not all(r["native_tp_equal_tp1"] for r in rows), rows
    assert all(r["pik_ms"] > 0 and r["native_ms"] > 0 for r in rows)


def test_layout_names():
    from isoexec.trainer.megatron.config import Layout

    assert [lay.name for lay in (Layout(), Layout(tp=2, sp=True), Layout(ep=2), Layout(tp=2, sp=True, ep=2),
                                 Layout(cp=2), Layout(tp=2, sp=True, cp=4))] == [
        "tp1", "tp2_sp", "ep2", "tp2_sp_ep2", "tp1_cp2", "tp2_sp_cp4"]


def test_cp_step_bench_checks_the_cp_rows_against_cp1_beside_the_times():
    """The CP step table (tiny sizes here): CP 2 against CP 1 in alternating launches, the CP rows
    torch.equal to CP 1's, the ratios formed from the two medians."""
    from isoexec.bench.megatron_cpu import bench_model, cp_step_times
    from isoexec.config import load_config

    cfg = load_config(ROOT / "experiments" / "cpu-cp2.yaml")
    hf_cfg, state = bench_model(cfg)
    rows = cp_step_times(hf_cfg, state, cfg.trainer.layout(), cfg.kernels, sizes=(100,), repeats=1)
    assert [(r["layout"], r["world_size"]) for r in rows] == [("tp1", 1), ("tp1_cp2", 2)]
    assert all(r["rows_equal_cp1"] for r in rows), rows
    assert rows[0]["step_ratio_over_cp1"] == 1.0 and rows[1]["step_s"] > 0


def test_timed_kernel_set_times_every_region_call_and_keeps_the_bits():
    """The breakdown's kernel set is the same set (fingerprint, outputs) with a timer per region."""
    import torch

    from isoexec.bench.cpu import timed_kernel_set
    from isoexec.config import load_config
    from isoexec.model.build import random_model

    cfg = load_config(ROOT / "experiments" / "ci-tiny.yaml")
    model = random_model(cfg.model, cfg.kernels, "isoexec", vocab_size=64)
    ids = torch.randint(0, 64, (70,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 30, 70])
    ref = model.trainer_logprobs(ids, cu)
    ks = model.kernels
    model.kernels, totals = timed_kernel_set(ks)
    assert model.kernels.fingerprint == ks.fingerprint
    out = model.trainer_logprobs(ids, cu)
    model.kernels = ks
    assert torch.equal(out, ref)
    assert set(totals) >= {"gdn.core", "attn.core", "moe.experts", "lm_head", "logprob"}, sorted(totals)
    assert all(t > 0 for t in totals.values())


def test_counters_summary_reads_an_ncu_export_per_launch_in_microseconds(tmp_path):
    """isoexec.bench.counters_gpu.summary: one row per launch, ncu's Duration in us whatever its unit, and a file that
    is not an ncu details export refused in one line."""
    import csv

    import pytest

    from isoexec.bench.counters_gpu import summary

    cols = ["ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value", "Rule Name", "Rule Description"]
    rows = [[1, "a/_scan", "Duration", "ms", "1.48", "", ""], [1, "a/_scan", "Registers Per Thread", "register/thread", "168", "", ""],
            [1, "a/_scan", "", "", "", "SOLBottleneck", "Compute and Memory are well-balanced: To reduce runtime, both"],
            [2, "b/gemm", "Duration", "us", "218.08", "", ""], [2, "b/gemm", "Grid Size", "", "2,560", "", ""],
            [2, "b/gemm", "", "", "", "SOLBottleneck", "This workload is utilizing greater than 80.0% of the device. Start"]]
    with open(tmp_path / "x.csv", "w", newline="") as f:
        csv.writer(f).writerows([cols, *rows])
    got = summary(str(tmp_path / "x.csv"))
    assert [r["launch"] for r in got] == ["a/_scan", "b/gemm"]
    assert got[0]["duration_us"] == pytest.approx(1480.0) and got[0]["registers"] == 168.0
    assert got[1]["duration_us"] == pytest.approx(218.08) and got[1]["grid_blocks"] == 2560.0
    assert got[0]["bottleneck"] == "Compute and Memory are well-balanced"
    assert got[1]["bottleneck"] == "This workload is utilizing greater than 80.0% of the device"
    (tmp_path / "y.csv").write_text("ID,Kernel Name\n1,a\n")
    with pytest.raises(ValueError, match=r"y.csv: not an ncu details export"):
        summary(str(tmp_path / "y.csv"))
    rows[0][3] = "fortnight"
    with open(tmp_path / "z.csv", "w", newline="") as f:
        csv.writer(f).writerows([cols, *rows])
    with pytest.raises(ValueError, match=r"z.csv: launch a/_scan: Duration in 'fortnight'; allowed: ns, nsecond"):
        summary(str(tmp_path / "z.csv"))


def test_model_profile_names_the_top_ops_of_both_kernel_sets_per_trainer_case():
    """isoexec.bench.model_gpu.model_profile (a CPU smoke run of the GPU table): rows for native and isoexec,
    trainer_score and trainer_fwd_bwd, sorted by self CPU time here; the backward shows autograd's ops, which the
    no-grad score does not run."""
    from isoexec.bench.model_gpu import model_profile
    from isoexec.config import load_config

    rows = model_profile(load_config(str(ROOT / "experiments" / "ci-tiny.yaml")), log=lambda s: None, batch=1,
                         seq_len=8, top=40)
    assert {(r["set"], r["case"]) for r in rows} == {(s, c) for s in ("native", "isoexec")
                                                      for c in ("trainer_score", "trainer_fwd_bwd")}
    for (s, c) in {(r["set"], r["case"]) for r in rows}:
        mine = [r for r in rows if (r["set"], r["case"]) == (s, c)]
        cpu = [r["self_cpu_ms"] for r in mine]
        assert cpu == sorted(cpu, reverse=True) and cpu[0] > 0 and mine[0]["wall_ms"] > 0, (s, c)
        backward = any("Backward" in r["op"] or "autograd" in r["op"] for r in mine)
        assert backward == (c == "trainer_fwd_bwd"), (s, c, [r["op"] for r in mine])
