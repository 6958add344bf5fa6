"""The Snakemake workflow: dry runs of `reproduce`, lint, config validation, no --config overrides."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from isoexec.config import load_config
from isoexec.rl.arms import arm_names

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")
pytestmark = pytest.mark.skipif(not SNAKEMAKE.exists(), reason="snakemake not installed beside python")


def snakemake(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SNAKEMAKE), "-s", str(ROOT / "Snakefile"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def job_counts(output: str) -> dict[str, int]:
    stats = output.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", stats, re.M)}


def test_dry_run_reproduce_covers_every_stage_for_the_default_experiment():
    # --forceall: the committed reference results must not hide stages from the plan
    r = snakemake("-n", "--forceall", "reproduce")
    assert r.returncode == 0, r.stdout + r.stderr
    counts = job_counts(r.stdout)
    cfg = load_config(ROOT / "experiments" / "cpu-tiny.yaml")
    assert arm_names(cfg) == ["native", "isoexec", "native-tis"] and cfg.rl.seeds == [0, 1, 2]  # 3 arms x 3 seeds
    for rule in ("experiment_settings", "init_model", "sft", "gates", "rollout_check", "rl_paired", "report_tables",
                 "report_figures", "notebook"):
        assert counts[rule] == 1, rule  # one job runs every RL run, interleaved (isoexec rl paired)
    assert "kernel_bench" not in counts and "rl_train" not in counts
    for arm in arm_names(cfg):
        assert f"results/cpu-tiny/rl/{arm}/seed2/metrics.jsonl" in r.stdout
    assert "results/cpu-tiny/sft_metrics.json" in r.stdout
    assert "runs/cpu-tiny/model/sft" in r.stdout


def test_dry_run_ci_tiny_config_selects_fewer_runs():
    r = snakemake("-n", "--forceall", "reproduce", "--config", "experiment=experiments/ci-tiny.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert job_counts(r.stdout)["rl_paired"] == 1
    assert "results/ci-tiny/rl/native-tis/seed0/metrics.jsonl" in r.stdout


def test_kernel_bench_runs_only_when_asked():
    r = snakemake("-n", "kernel_bench")
    assert r.returncode == 0, r.stdout + r.stderr
    assert job_counts(r.stdout) == {"kernel_bench": 1, "total": 1}
    assert "output: runs/cpu-tiny/bench" in r.stdout  # not the committed results/cpu-tiny/bench
    assert "runs/cpu-tiny/benchmarks/kernel_bench.tsv" in r.stdout


def test_lint_is_clean():
    r = snakemake("--lint")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Congratulations" in r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("snakefmt", path=str(SNAKEMAKE.parent)) is None, reason="snakefmt not installed")
def test_snakefiles_are_snakefmt_formatted():
    files = [ROOT / "Snakefile", *sorted((ROOT / "workflow" / "rules").glob("*.smk"))]
    r = subprocess.run([str(SNAKEMAKE.with_name("snakefmt")), "--check", *map(str, files)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def error_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("how", ["--config", "--configfile"])
def test_config_typo_fails_before_any_job_with_one_line_naming_the_key(tmp_path, how):
    bad = tmp_path / "typo.yaml"
    bad.write_text((ROOT / "experiments" / "ci-tiny.yaml").read_text().replace("engine:\n", "engine:\n  max_num_seqz: 4\n"))
    r = snakemake("-n", "reproduce", *([how, f"experiment={bad}"] if how == "--config" else [how, str(bad)]))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "File " not in r.stderr
    [line] = error_lines(r)
    assert "engine.max_num_seqz=4: unknown key" in line and "max_num_seqs" in line


def test_missing_experiment_is_one_line_naming_the_experiments_there():
    r = snakemake("-n", "reproduce", "--config", "experiment=experiments/nope.yaml")
    assert r.returncode == 2, r.stdout + r.stderr
    there = ", ".join(sorted(p.name for p in (ROOT / "experiments").glob("*.yaml")))
    assert error_lines(r) == [f"error: experiment config 'experiments/nope.yaml' does not exist; experiments/ holds {there}"]


def test_config_overrides_are_refused():
    r = snakemake("-n", "reproduce", "--config", "name=other")
    assert r.returncode == 2
    [line] = error_lines(r)
    assert "--config name=..." in line and "experiment=" in line
