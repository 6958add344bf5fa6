"""One error style for every `isoexec` command: one line `error: ...` naming the value and what is
allowed, exit status 2 for bad input (1 for an internal error), the traceback only with `--debug`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from isoexec.cli import IsoexecGroup, app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_error_line(r, *needles: str, code: int = 2) -> None:
    out = r.stderr + r.stdout
    assert r.exit_code == code, out
    assert out.startswith("error: ") and out.count("\n") == 1, out
    assert "Traceback" not in out
    for n in needles:
        assert n in out, (n, out)


@pytest.fixture
def typo_config(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text((ROOT / "experiments" / "ci-tiny.yaml").read_text().replace("engine:\n", "engine:\n  max_num_seqz: 4\n"))
    return bad


def test_missing_config_is_one_line_naming_the_file_and_the_experiments_there():
    r = invoke("gates", "--config", ROOT / "experiments" / "nope.yaml")
    there = ", ".join(sorted(p.name for p in (ROOT / "experiments").glob("*.yaml")))
    assert_one_error_line(r, "nope.yaml' does not exist", f"holds {there}")


def test_config_typo_is_one_line_naming_the_key_and_the_allowed_keys(typo_config):
    r = invoke("bench", "--config", typo_config)
    assert_one_error_line(r, "engine.max_num_seqz=4: unknown key", "max_num_seqs")


@pytest.mark.parametrize("tp, wrong", [("1,x", "not allowed: x"), ("1,3", "not allowed: 3"), ("", "'': expected")])
def test_pik_check_tp_is_checked_before_any_process_starts(tp, wrong):
    r = invoke("pik-check", "--tp", tp)
    assert_one_error_line(r, "--tp", wrong, "1, 2, 4, 8")


def test_typed_option_and_choice_errors_are_one_line():
    assert_one_error_line(invoke("bench", "--repeats", "x"), "isoexec bench", "--repeats")
    assert_one_error_line(invoke("rollout-check", "--config", "x.yaml", "--modes", "native,foo"), "--modes", "native, isoexec")
    assert_one_error_line(invoke("rl", "train", "--config", ROOT / "experiments" / "cpu-tiny.yaml", "--mode", "foo",
                                 "--seed", "0", "--init", "i", "--out", "o"),
                          "--arm 'foo' is not an arm of", "its arms: native, isoexec, native-tis")
    assert_one_error_line(invoke("nope"), "No such command 'nope'")


def test_contract_and_report_errors_share_the_style(tmp_path):
    assert_one_error_line(invoke("contract", "show", tmp_path / "none.json"), "none.json: No such file or directory")
    assert_one_error_line(invoke("report", "tables", "--exp-dir", tmp_path / "nope"), "nope")


def test_an_internal_error_names_its_type_and_exits_one():
    boom = typer.Typer(cls=IsoexecGroup)

    @boom.command()
    def explode() -> None:
        raise RuntimeError("disk on fire")

    @boom.command()
    def other() -> None:  # two commands: a group, so the command name is an argument
        pass

    r = runner.invoke(boom, ["explode"])
    assert_one_error_line(r, "internal error: RuntimeError: disk on fire", "--debug", code=1)


def test_debug_shows_the_traceback():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    plain = subprocess.run([sys.executable, "-m", "isoexec.cli", "gates", "--config", "nope.yaml"],
                           capture_output=True, text=True, env=env, cwd=ROOT)
    debug = subprocess.run([sys.executable, "-m", "isoexec.cli", "--debug", "gates", "--config", "nope.yaml"],
                           capture_output=True, text=True, env=env, cwd=ROOT)
    assert plain.returncode == 2 and plain.stderr.count("\n") == 1 and "Traceback" not in plain.stderr
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "FileNotFoundError" in debug.stderr


def _commands(cmd, path=("isoexec",)):
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_help_has_no_literal_markup_and_every_option_says_what_it_is():
    root = get_command(app)
    for path, cmd in _commands(root):
        assert "``" not in (cmd.help or ""), path
        for p in cmd.params:
            if p.name != "help" and getattr(p, "param_type_name", "") == "option":
                assert p.help, f"{' '.join(path)} {p.opts[0]} has no help text"
                assert "``" not in p.help and "[" not in p.help, (path, p.opts[0])  # rich reads [..] as markup
    r = invoke("--help")
    assert r.exit_code == 0 and "``" not in r.output and "--debug" in r.output


def test_rl_train_checks_init_driver_and_steps_before_starting_anything(tmp_path):
    """Refused at the command line, before Ray or any output folder: a missing checkpoint, a --driver the
    config's trainer cannot run under, zero steps."""
    cfg, out = ROOT / "experiments" / "cpu-tiny.yaml", tmp_path / "out"
    base = ("rl", "train", "--config", cfg, "--mode", "isoexec", "--seed", "0", "--out", out)
    assert_one_error_line(invoke(*base, "--init", tmp_path / "nothere"), "--init", "nothere", "config.json")
    assert_one_error_line(invoke(*base, "--init", tmp_path, "--driver", "loop"), "--driver loop",
                          "trainer.backend='megatron'", "rl.driver: skyrl")
    assert_one_error_line(invoke(*base, "--init", tmp_path, "--steps", "0"), "--steps=0", "at least one step")
    assert not out.exists()


def test_a_union_setting_is_one_problem_without_pydantic_type_names(tmp_path):
    bad = tmp_path / "be.yaml"
    bad.write_text("name: t\ntrainer: {backend: megatronx}\n")
    r = invoke("config", "--config", bad)
    assert_one_error_line(r, "trainer.backend='megatronx': Input should be 'hf', 'unified' or 'megatron'")
    out = r.stdout + r.stderr
    assert "literal[" not in out and out.count("trainer.backend") == 1, out


@pytest.mark.parametrize("command, wrong", [
    ("sft", ("--steps", "-5")),  # was: exit 0, an untrained checkpoint and a bare NaN in sft_metrics.json
    ("sft", ("--threads", "0")),  # was: an internal error, exit 1
    ("train", ("--mode", "native", "--seed", "0", "--threads", "0")),
    ("init-model", ("--threads", "0")),
])
def test_counts_below_one_are_refused_before_anything_runs(tmp_path, command, wrong):
    out = tmp_path / "out"
    init = () if command == "init-model" else ("--init", tmp_path)
    r = invoke("rl", command, "--config", ROOT / "experiments" / "ci-tiny.yaml", *init, "--out", out, *wrong)
    assert_one_error_line(r, f"isoexec rl {command}", f"'{wrong[-2]}' ('{wrong[-1]}')", "greater than or equal to 1")
    assert not out.exists()


def test_a_folder_given_as_config_is_one_line_naming_a_file_there():
    r = invoke("config", "--config", ROOT / "experiments")
    assert_one_error_line(r, "is a folder; pass one YAML file", "experiments/ holds", "cpu-tiny.yaml")


@pytest.mark.parametrize("command", ["gates", "bench", "rollout-check", "config"])
def test_every_experiment_command_requires_config_alike(command):
    """No command falls back to a default experiment: the same --config, required everywhere."""
    assert_one_error_line(invoke(command), f"isoexec {command}", "Missing option '--config'")


def test_gates_and_rollout_check_write_outside_the_committed_results_unless_asked(tmp_path, monkeypatch):
    """`isoexec gates --config experiments/cpu-tiny.yaml` as a user types it: runs/<exp>/, not results/<exp>/."""
    import isoexec.engines.rollout_check as rc
    import isoexec.model.gates as gates

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(gates, "gate_matrix", lambda cfg, echo: ([], None))
    monkeypatch.setattr(rc, "run_mode", lambda cfg, mode, ckpt, model_factory=None: {"mode": mode})
    cfg = ROOT / "experiments" / "cpu-tiny.yaml"
    assert invoke("gates", "--config", cfg).exit_code == 0
    assert invoke("rollout-check", "--config", cfg, "--checkpoint", tmp_path).exit_code == 0
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        "runs/cpu-tiny/gates/gates.csv", "runs/cpu-tiny/gates/gates.provenance.json", "runs/cpu-tiny/rollout_check.json"]
    assert invoke("gates", "--config", cfg, "--out-dir", "results/cpu-tiny").exit_code == 0  # asked for
    assert (tmp_path / "results" / "cpu-tiny" / "gates.csv").is_file()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_cuda_experiment_is_refused_where_there_is_no_cuda_before_anything_runs(tmp_path):
    """device: cuda without a CUDA device: every command that runs on the experiment's device says so in one
    line (it used to train on the CPU, or fail deep in a kernel), and the workflow stops before any job, so
    the committed outputs its jobs would delete first stay (a dry run still plans it)."""
    cfg = "experiments/h200-rl.yaml"
    sft = tmp_path / "sft"
    sft.mkdir()
    for args in (["gates", "--config", cfg, "--out-dir", tmp_path], ["rollout-check", "--config", cfg],
                 ["rl", "train", "--config", cfg, "--arm", "isoexec", "--seed", 0, "--init", sft, "--out", tmp_path],
                 ["rl", "paired", "--config", cfg, "--init", sft, "--out", tmp_path]):
        assert_one_error_line(invoke(*args), "device: cuda", "no CUDA device")
    work = tmp_path / "work"  # a copy of the experiment and of one committed output, the workflow run there
    (work / "experiments").mkdir(parents=True)
    (work / "experiments" / "h200-rl.yaml").write_text((ROOT / cfg).read_text())
    kept = work / "results" / "h200-rl" / "rl" / "isoexec" / "seed0" / "metrics.jsonl"
    kept.parent.mkdir(parents=True)
    kept.write_text((ROOT / "results" / "h200-rl" / "rl" / "isoexec" / "seed0" / "metrics.jsonl").read_text())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    snake = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(work), "--cores", "1",
             "reproduce", "--config", "experiment=experiments/h200-rl.yaml"]
    dry = subprocess.run([*snake, "-n"], cwd=work, env=env, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr[-2000:]
    real = subprocess.run(snake, cwd=work, env=env, capture_output=True, text=True)
    assert real.returncode == 2 and "device: cuda, but this machine has no CUDA device" in real.stderr, real.stderr[-2000:]
    assert kept.read_text() == (ROOT / "results" / "h200-rl" / "rl" / "isoexec" / "seed0" / "metrics.jsonl").read_text()
    assert not (work / "runs").exists()


def test_an_init_checkpoint_of_another_model_is_refused_naming_the_settings(tmp_path):
    """rl train / rl paired compare the experiment's model section with the --init checkpoint's config: a
    checkpoint of another shape used to train under the experiment's name (the checkpoint's model won)."""
    from isoexec.config import load_config
    from isoexec.model.hf import hf_config

    cfg = load_config(ROOT / "experiments" / "ci-tiny.yaml")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    hf_config(cfg.model, vocab_size=128).save_pretrained(ckpt)  # the config alone: the check reads no weights
    other = tmp_path / "other.yaml"
    other.write_text((ROOT / "experiments" / "ci-tiny.yaml").read_text().replace("name: ci-tiny", "name: ci-other")
                     .replace("  hidden_size: 128", "  hidden_size: 64"))
    assert "hidden_size: 64" in other.read_text()
    out = tmp_path / "out"
    for cmd in (["train", "--arm", "isoexec", "--seed", "0"], ["paired"]):
        assert_one_error_line(invoke("rl", *cmd, "--config", other, "--init", ckpt, "--out", out),
                              f"--init {ckpt} is not the model of {other}", "hidden_size: experiment 64, checkpoint 128")
    from isoexec.model.hf import section_mismatches

    assert section_mismatches(cfg.model, ckpt) == []  # the negative control: its own section agrees
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is of a GPU experiment on a machine without one")
@pytest.mark.parametrize("argv, needle", [
    (["isoexec.bench.rl_step", "--config", "experiments/h200-rlstep.yaml"], "device: cuda, but this machine has no CUDA"),
    (["isoexec.bench.vllm_gpu", "--config", "experiments/h200-rlstep.yaml", "--out-dir", "OUT"], "device: cuda, but this machine"),
    (["isoexec.bench.gpu", "variants", "--config", "experiments/h200.yaml"], "device: cuda, but this machine has no CUDA"),
    (["isoexec.bench.gpu", "variants", "--config", "experiments/ci-tiny.yaml"], "device: cpu; the GPU benchmarks need"),
    (["isoexec.bench.rl_step", "--config", "experiments/ci-tiny.yaml", "--steps", "0"], "--steps 0: must be >= 1"),
    (["isoexec.bench.rl_step", "--config", "experiments/nope.yaml"], "'experiments/nope.yaml' does not exist"),
    (["isoexec.bench.vllm_gpu", "--config", "experiments/nope.yaml", "--out-dir", "OUT"], "'experiments/nope.yaml' does not exist"),
    (["isoexec.bench.gpu", "variants", "--config", "experiments/nope.yaml", "--out-dir", "OUT"],
     "'experiments/nope.yaml' does not exist"),
    (["isoexec.bench.gpu", "gates", "--config", "experiments/h200.yaml", "--extra-config", "experiments/nope.yaml",
      "--out-dir", "OUT"], "'experiments/nope.yaml' does not exist"),
    (["isoexec.bench.engine_decode", "--config", "experiments/h200.yaml", "--out-dir", "OUT"],
     "device: cuda, but this machine has no CUDA"),
    (["isoexec.bench.engine_decode", "--config", "experiments/nope.yaml", "--out-dir", "OUT"],
     "'experiments/nope.yaml' does not exist"),
    (["isoexec.bench.pik_gpu", "--config", "experiments/h200.yaml", "--out", "OUT"], "start it with torchrun"),
])
def test_gpu_benchmarks_refuse_a_config_this_machine_cannot_run_in_one_line(tmp_path, argv, needle):
    """The GPU benchmarks' modules refuse like the CLI: one `error:` line, exit 2, before they write anything."""
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, mode, needle", [
    ("experiments/ci-tiny.yaml", "isoexec", "experiment 'ci-tiny' has no skyrl section"),
    ("experiments/qwen35-35b-a3b-8xh100.yaml", "both", "mode must be 'native' or 'isoexec', got 'both'"),
])
def test_skyrl_config_refuses_in_one_line_before_skyrl_imports(tmp_path, config, mode, needle):
    """``isoexec rl skyrl-config`` checks the experiment and the mode before SkyRL's imports, whose own line ("Triton
    is installed, but doesn't include CPU backend") used to come first: stderr is the one ``error:`` line, exit 2."""
    out = tmp_path / "o.yaml"
    r = subprocess.run([sys.executable, "-c", "import sys; from isoexec.cli import app; sys.argv[0] = 'isoexec'; app()",
                        "rl", "skyrl-config", "--config", config, "--mode", mode, "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
    assert not out.exists()
