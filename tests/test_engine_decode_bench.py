"""``isoexec.bench.engine_decode`` on the CPU (the ci-tiny model, C kernel set): trees alternate in their own
processes, the digests say whether two trees have the same bits, bad arguments get one line."""

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_digests_agree_for_the_same_code_and_differ_for_other_weights(tmp_path):
    other = tmp_path / "other"
    shutil.copytree(ROOT / "isoexec", other / "isoexec", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    src = other / "isoexec/bench/rl_step.py"
    text = src.read_text()
    assert "* cfg.model.init_std" in text
    src.write_text(text.replace("* cfg.model.init_std", "* cfg.model.init_std * 1.5"))  # negative control
    same = tmp_path / "same"
    shutil.copytree(ROOT / "isoexec", same / "isoexec", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "isoexec.bench.engine_decode", "--config", "experiments/ci-tiny.yaml",
                        "--out-dir", str(out), "--tree", f"same={same}", "--tree", f"other={other}",
                        "--batches", "3", "--steps", "4", "--reps", "1"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["tree"]: row for row in csv.DictReader((out / "decode.csv").open())}
    assert set(rows) == {"same", "other", "this"} and float(rows["this"]["ms_per_step"]) > 0
    for key in ("tokens_sha256", "last_rows_sha256"):
        assert rows["same"][key] == rows["this"][key]
    # near-uniform rows of a tiny random model may sample the same tokens; the rows themselves differ
    assert rows["other"]["last_rows_sha256"] != rows["this"]["last_rows_sha256"]
    assert (out / "profile_this.txt").read_text().startswith("# cProfile")
    import json

    trees = json.loads((out / "provenance.json").read_text())["trees"]
    assert trees["same"]["isoexec_sha256"] == trees["this"]["isoexec_sha256"] != trees["other"]["isoexec_sha256"]


@pytest.mark.parametrize("args, msg", [(["--tree", "nopath"], "expected NAME=PATH"),
                                        (["--tree", "x=/nonexistent"], "holds no isoexec package"),
                                        (["--steps", "0"], "every value must be >= 1")])
def test_bad_arguments_get_one_line(tmp_path, args, msg):
    r = subprocess.run([sys.executable, "-m", "isoexec.bench.engine_decode", "--config", "experiments/ci-tiny.yaml",
                        "--out-dir", str(tmp_path), *args], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
