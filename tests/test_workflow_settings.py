"""Results are keyed by their settings: a config whose name has results made with other settings is
refused before any job (dry runs), with and without Snakemake metadata, and the record is written by
`reproduce` (results/<exp>/experiment.json)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from isoexec.config import load_config
from isoexec.settings import settings_differences, settings_record

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")
CI_TINY = (ROOT / "experiments" / "ci-tiny.yaml").read_text().replace("name: ci-tiny", "name: rec")


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SNAKEMAKE), "-s", str(ROOT / "Snakefile"), "--directory", str(workdir), *args],
        cwd=workdir, capture_output=True, text=True, timeout=300,
    )


def errors(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error: ")]


def test_differences_name_each_setting_and_ignore_new_settings_at_their_default(tmp_path):
    (tmp_path / "a.yaml").write_text(CI_TINY)
    (tmp_path / "b.yaml").write_text(CI_TINY.replace("  steps: 2\n", "  steps: 3\n").replace("  lr: 1.0e-3\n", ""))
    a, b = load_config(tmp_path / "a.yaml"), load_config(tmp_path / "b.yaml")
    assert settings_differences(settings_record(a), a) == []
    assert settings_differences(settings_record(a), b) == ["rl.lr: 0.001 -> 0.0001", "rl.steps: 2 -> 3"]
    older = settings_record(a)
    del older["rl"]["steps"], older["engine"]["max_num_seqs"]  # written before these settings existed
    assert settings_differences(older, a) == ["rl.steps: not recorded -> 2"]  # max_num_seqs is at its default
    (tmp_path / "m.yaml").write_text(re.sub(r"\n  backend: .*\n  tp: 1\n", "\n  backend: {native: hf, isoexec: unified}\n",
                                            CI_TINY))
    a = load_config(tmp_path / "m.yaml")
    assert a.trainer.backend == {"native": "hf", "isoexec": "unified"}  # a per-mode mapping
    one_value = settings_record(a)
    one_value["trainer"]["backend"] = "unified"  # the record has one value where the config has a mapping
    assert settings_differences(one_value, a) == [
        'trainer.backend: "unified" -> {"native": "hf", "isoexec": "unified"}']
    unified = a.model_copy(update={"trainer": a.trainer.model_copy(update={"backend": "unified"})})
    assert settings_differences(settings_record(a), unified) == [
        'trainer.backend: {"native": "hf", "isoexec": "unified"} -> "unified"']


@pytest.mark.skipif(not SNAKEMAKE.exists(), reason="snakemake not installed beside python")
@pytest.mark.parametrize("metadata", [False, True], ids=["fresh-clone", "snakemake-metadata"])
def test_changed_config_under_a_recorded_name_is_refused(tmp_path, metadata):
    (tmp_path / "exp.yaml").write_text(CI_TINY)
    record = tmp_path / "results" / "rec" / "experiment.json"
    if metadata:  # the pipeline's own rule writes the record and leaves .snakemake/ metadata
        r = snakemake(tmp_path, "--cores", "1", "results/rec/experiment.json", "--config", "experiment=exp.yaml")
        assert r.returncode == 0, r.stdout + r.stderr
        assert (tmp_path / ".snakemake" / "metadata").is_dir()
    else:  # as committed: the record exists, no .snakemake/
        record.parent.mkdir(parents=True)
        record.write_text(json.dumps(settings_record(load_config(tmp_path / "exp.yaml"))))
    assert json.loads(record.read_text())["rl"]["steps"] == 2

    same = snakemake(tmp_path, "-n", "reproduce", "--config", "experiment=exp.yaml")
    assert same.returncode == 0 and not errors(same), same.stdout + same.stderr

    (tmp_path / "exp.yaml").write_text(CI_TINY.replace("  steps: 2\n", "  steps: 3\n"))
    for how in (["--config", "experiment=exp.yaml"], ["--configfile", "exp.yaml"]):
        changed = snakemake(tmp_path, "-n", "reproduce", *how)
        assert changed.returncode == 2, changed.stdout + changed.stderr
        assert errors(changed) == [
            "error: exp.yaml: results/rec/ holds results of experiment 'rec' made with other settings "
            "(rl.steps: 2 -> 3); give this config a new name, or delete results/rec/ to recompute it"]
        assert "Job stats" not in changed.stdout  # nothing planned, nothing overwritten

    renamed = snakemake(tmp_path, "-n", "reproduce", "--config", "experiment=exp.yaml", "--forceall")
    assert renamed.returncode == 2  # --forceall does not bypass it either
    (tmp_path / "exp.yaml").write_text(CI_TINY.replace("  steps: 2\n", "  steps: 3\n").replace("name: rec", "name: rec3"))
    new_name = snakemake(tmp_path, "-n", "reproduce", "--config", "experiment=exp.yaml")
    assert new_name.returncode == 0, new_name.stdout + new_name.stderr
    assert "results/rec3/experiment.json" in new_name.stdout


@pytest.mark.skipif(not SNAKEMAKE.exists(), reason="snakemake not installed beside python")
def test_copy_of_the_default_with_other_steps_cannot_touch_the_committed_results(tmp_path):
    mine = tmp_path / "mine.yaml"
    steps = load_config(ROOT / "experiments" / "cpu-tiny.yaml").rl.steps
    text, n = re.subn(rf"^(  steps: ){steps}\b", r"\g<1>5", (ROOT / "experiments" / "cpu-tiny.yaml").read_text(), flags=re.M)
    assert n == 1, "the copy must differ from the default in rl.steps"
    mine.write_text(text)
    r = subprocess.run([str(SNAKEMAKE), "-s", str(ROOT / "Snakefile"), "-n", "reproduce", "--configfile", str(mine)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    [line] = errors(r)
    assert "results/cpu-tiny/ holds results of experiment 'cpu-tiny'" in line and f"rl.steps: {steps} -> 5" in line


def test_committed_record_matches_the_default_experiment():
    recorded = json.loads((ROOT / "results" / "cpu-tiny" / "experiment.json").read_text())
    assert settings_differences(recorded, load_config(ROOT / "experiments" / "cpu-tiny.yaml")) == []


@pytest.mark.skipif(not SNAKEMAKE.exists(), reason="snakemake not installed beside python")
def test_a_moved_or_copied_config_with_the_same_settings_reruns_nothing(tmp_path):
    """The YAML's path is no job parameter (jobs read it from $ISOEXEC_EXPERIMENT; their parameters are the
    settings digests): the same settings at another path find everything up to date (metadata included)."""
    (tmp_path / "a.yaml").write_text(CI_TINY)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "copy.yaml").write_text(CI_TINY)
    r = snakemake(tmp_path, "--cores", "1", "runs/rec/model/init", "--config", "experiment=a.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'isoexec rl init-model --config "$ISOEXEC_EXPERIMENT"' in r.stdout + r.stderr
    for how in (["--config", "experiment=elsewhere/copy.yaml"], ["--configfile", "elsewhere/copy.yaml"]):
        again = snakemake(tmp_path, "-n", "runs/rec/model/init", *how)
        assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, again.stdout + again.stderr
    (tmp_path / "elsewhere" / "copy.yaml").write_text(CI_TINY.replace("  hidden_size: 128\n", "  hidden_size: 256\n")
                                                      .replace("name: rec", "name: rec2"))
    other = snakemake(tmp_path, "-n", "runs/rec2/model/init", "--config", "experiment=elsewhere/copy.yaml")
    assert "init_model" in other.stdout  # negative control: other settings, other results


@pytest.mark.skipif(not SNAKEMAKE.exists(), reason="snakemake not installed beside python")
def test_zero_rl_steps_are_refused_before_any_job(tmp_path):
    (tmp_path / "z.yaml").write_text(CI_TINY.replace("  steps: 2\n", "  steps: 0\n"))
    r = snakemake(tmp_path, "-n", "reproduce", "--config", "experiment=z.yaml")
    assert r.returncode == 2 and "Job stats" not in r.stdout, r.stdout + r.stderr
    [line] = errors(r)
    assert "rl.steps=0" in line and "greater than 0" in line


def test_untracked_experiment_outputs_are_ignored_and_committed_ones_kept():
    """results/<exp>/ of an experiment a user runs (ci-tiny, a renamed copy) is ignored by git; every committed
    results folder stays visible to git (a new file there is not ignored)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")

    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0

    tracked = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    committed = sorted({p.split("/")[1] for p in tracked})
    assert committed and "cpu-tiny" in committed
    for name in committed:
        assert not ignored(f"results/{name}/new-table.csv"), name
    for name in ("ci-tiny", "my-copy-of-cpu-tiny"):
        assert ignored(f"results/{name}/tables/main.md"), name
