"""The whole `reproduce` DAG executed with stand-in stage commands (the report stages are real).

A fake `isoexec` first on PATH writes what each stage promises (a model folder, contract, gates,
rollout check, synthetic RL metrics) and hands `isoexec report ...` to the real CLI. This checks the
wiring: inputs/outputs, logs, benchmarks, the papermill notebook and its HTML, and that finished
stages are not rerun while a changed config section reruns only the stages that read it.
tests/test_workflow_real.py runs the same DAG with the real commands on experiments/ci-tiny.yaml;
this one stays because it checks the rerun logic in seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")
pytestmark = pytest.mark.skipif(not SNAKEMAKE.exists(), reason="snakemake not installed beside python")

FAKE = f"""#!{sys.executable}
import json, os, sys, yaml
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
argv = sys.argv[1:]
if argv[0] in ("report", "config"):
    os.execv(sys.executable, [sys.executable, "-m", "isoexec.cli", *argv])
opt = {{argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}}
cfg = yaml.safe_load(open(opt["--config"]))
res = Path("results") / cfg["name"]
print("fake isoexec", *argv)
if argv[:2] in (["rl", "init-model"], ["rl", "sft"]):
    Path(opt["--out"]).mkdir(parents=True)
    (Path(opt["--out"]) / "model.safetensors").write_text("weights")
    sft = {{"steps": 1, "loss": 1.0, "expected_accuracy": 0.2, "accuracy": 0.25, "greedy_accuracy": 0.5,
           "target_accuracy": [0.1, 0.6], "in_band": True, "time_s": 1.0,
           "history": [{{"step": 1, "loss": 1.0, "expected_accuracy": 0.2}}]}}
    (Path(opt["--out"]) / "sft_metrics.json").write_text(json.dumps(sft))
elif argv[0] == "gates":
    (res / "contract.json").write_text(json.dumps({{"numerical_policy": "ab" * 32}}))
    (res / "gates.csv").write_text("region,case_a,case_b,mode,bitwise_equal\\nlm_head,trainer_score,engine_decode,isoexec,True\\n")
elif argv[0] == "rollout-check":
    (res / "rollout_check.json").write_text(json.dumps({{"isoexec": {{"mismatch_count": 0}}}}))
elif argv[:2] == ["rl", "paired"]:
    from test_report_tables import write_synthetic_runs
    arms = cfg["rl"]["modes"] + [a["name"] for a in cfg.get("arms", [])]
    write_synthetic_runs(Path(opt["--out"]).parent, arms=arms, seeds=cfg["rl"]["seeds"], steps=range(cfg["rl"]["steps"]))
else:
    sys.exit(f"fake isoexec: unexpected {{argv}}")
"""


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=os.pathsep.join([str(workdir / "bin"), str(SNAKEMAKE.parent), os.environ["PATH"]]))
    return subprocess.run(
        [str(SNAKEMAKE), "-s", str(ROOT / "Snakefile"), *args, "--directory", str(workdir), "--configfile", "exp.yaml"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )


def job_counts(output: str) -> dict[str, int]:
    if "Job stats:" not in output:
        return {}
    stats = output.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", stats, re.M)}


def test_reproduce_runs_end_to_end_and_does_not_rerun_finished_stages(tmp_path):
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "isoexec"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    config = (ROOT / "experiments" / "ci-tiny.yaml").read_text().replace("name: ci-tiny", "name: e2e")
    config = config.replace("  steps: 2\n", "  steps: 3\n").replace("  seeds: [0]\n", "  seeds: [0, 1]\n")
    (tmp_path / "exp.yaml").write_text(config)

    r = snakemake(tmp_path, "reproduce")
    assert r.returncode == 0, r.stdout + r.stderr
    res = tmp_path / "results" / "e2e"
    for rel in (
        "contract.json",
        "gates.csv",
        "rollout_check.json",
        "rl/isoexec/seed1/metrics.jsonl",
        "tables/summary.csv",
        "tables/summary.md",
        "tables/summary.tex",
        "figures/logprob_diff.png",
        "figures/time.pdf",
        "notebooks/analysis.ipynb",
        "notebooks/analysis.html",
        "benchmarks/rl_paired.tsv",
        "experiment.json",
    ):
        assert (res / rel).stat().st_size > 0, rel
    assert (tmp_path / "runs" / "e2e" / "model" / "sft" / "model.safetensors").exists()
    assert "fake isoexec rl paired" in (tmp_path / "logs" / "e2e" / "rl" / "paired.log").read_text()
    html = (res / "notebooks" / "analysis.html").read_text()
    assert "bitwise identical at 6/6" in html and "lm_head" in html  # metrics check and gate matrix

    report = snakemake(tmp_path, "--report", "report.html")
    assert report.returncode == 0, report.stdout + report.stderr
    assert (tmp_path / "report.html").stat().st_size > 0

    again = snakemake(tmp_path, "-n", "reproduce")
    assert again.returncode == 0 and job_counts(again.stdout) == {}, again.stdout

    # A changed rl section under the same name is refused (results/e2e/experiment.json records the
    # settings); once the results are deleted, only the stages that read the changed section rerun
    # beside them: the model and SFT checkpoints in runs/ are kept.
    (tmp_path / "exp.yaml").write_text(config.replace("  steps: 3\n", "  steps: 4\n"))
    changed = snakemake(tmp_path, "-n", "reproduce")
    assert changed.returncode == 2 and "rl.steps: 3 -> 4" in changed.stderr, changed.stdout + changed.stderr
    shutil.rmtree(res)
    redo = snakemake(tmp_path, "-n", "reproduce")
    counts = job_counts(redo.stdout)
    assert counts.get("rl_paired") == 1 and counts.get("notebook") == 1, redo.stdout
    assert not {"init_model", "sft"} & set(counts), counts
