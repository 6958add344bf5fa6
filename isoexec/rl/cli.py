"""``isoexec rl ...``: the tiny checkpoint, the SFT warm start and the paired RL runs.

One-liners for the workflow rules::

    isoexec rl data  --config X.yaml --out runs/data       # the embedded task as DAPO-schema parquet
    isoexec rl init-model --config X.yaml --out runs/model/init
    isoexec rl sft   --config X.yaml --init runs/model/init --out runs/model/sft
    isoexec rl train --config X.yaml --arm native --seed 0 --init runs/model/sft \\
        --out results/<exp>/rl/native/seed0 [--steps N] [--driver loop|skyrl] [--threads 1]
    isoexec rl paired --config X.yaml --init runs/model/sft --out results/<exp>/rl   # every arm and seed, interleaved

The trainer and engine backends come from the experiment's ``trainer.backend`` / ``engine.backend``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Tiny checkpoint, SFT warm start and the paired RL runs of every arm.")

_THREADS = typer.Option(1, min=1, help="torch intra-op threads; 1 is the most robust on a shared 2-core machine")


def _setup(threads: int) -> None:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(threads)


@app.command("init-model")
def init_model(config: Path = typer.Option(..., help="experiment YAML"),
               out: Path = typer.Option(..., help="checkpoint directory to write"),
               seed: int = typer.Option(0, help="initialization seed"),
               threads: int = _THREADS) -> None:
    """Initialize the tiny Qwen3-Next of the config (+ task tokenizer) and save it as an HF checkpoint."""
    from isoexec.config import load_config
    from isoexec.rl.sft import init_checkpoint

    _setup(threads)
    init_checkpoint(load_config(config).model, out, seed=seed)
    typer.echo(f"wrote {out}")


@app.command("data")
def data(config: Path = typer.Option(..., help="experiment YAML"),
         out: Path = typer.Option(..., help="folder for train.parquet and eval.parquet")) -> None:
    """Write the embedded task as parquet in DAPO-Math-17k's schema (e.g. for SkyRL's dataset)."""
    from isoexec.config import load_config
    from isoexec.rl.data import embedded_rows, write_parquet

    train, eval_ = embedded_rows(load_config(config).task)
    for name, rows in (("train", train), ("eval", eval_)):
        typer.echo(f"wrote {write_parquet(rows, out / f'{name}.parquet')} ({len(rows)} rows)")


def _checkpoint(path: Path, option: str, made_by: str) -> Path:
    """``path`` if it is a Hugging Face checkpoint folder, else a BadParameter naming ``option``."""
    if not (path / "config.json").is_file():
        raise typer.BadParameter(f"{option} {path}: no checkpoint there (expected a Hugging Face checkpoint folder "
                                 f"with config.json, as {made_by} writes)")
    return path


@app.command("sft")
def sft(config: Path = typer.Option(..., help="experiment YAML"),
        init: Path = typer.Option(..., help="checkpoint from init-model"),
        out: Path = typer.Option(..., help="checkpoint directory to write (+ sft_metrics.json)"),
        steps: int | None = typer.Option(None, min=1, help="override sft.steps"),
        threads: int = _THREADS) -> None:
    """SFT warm start until the expected eval accuracy is inside sft.target_accuracy."""
    from isoexec.config import load_config
    from isoexec.rl.sft import run_sft

    cfg = load_config(config)
    _checkpoint(init, "--init", "`isoexec rl init-model`")
    _setup(threads)
    m = run_sft(cfg, init, out, steps=steps)
    typer.echo(f"sft: expected accuracy {m['expected_accuracy']:.3f}, sampled {m['accuracy']:.3f} "
               f"(greedy {m['greedy_accuracy']:.3f}) after {m['steps']} steps, "
               f"in band: {m['in_band']}; wrote {out}")


def _run_config(config: Path, init: Path, steps: int | None, driver: str | None, arm: str | None = None):
    """The experiment of ``config`` with ``--driver`` applied, after the checks every RL command makes (its
    device is here, ``arm`` is one of its arms, ``init`` is a checkpoint of its model section)."""
    from pydantic import ValidationError

    from isoexec.config import check_device, load_config, validation_summary
    from isoexec.rl.arms import arm_names

    if driver not in (None, "loop", "skyrl"):
        raise typer.BadParameter(f"--driver must be loop or skyrl, got {driver!r}")
    cfg = load_config(config)
    check_device(cfg, config)
    if driver is not None and driver != cfg.rl.driver:
        try:
            cfg = type(cfg).model_validate({**cfg.model_dump(), "rl": {**cfg.rl.model_dump(), "driver": driver}})
        except ValidationError as e:
            raise typer.BadParameter(f"--driver {driver} with {config}: {validation_summary(e)}") from None
    if arm is not None and arm not in arm_names(cfg):
        raise typer.BadParameter(f"--arm {arm!r} is not an arm of {config}; its arms: {', '.join(arm_names(cfg))}")
    if (steps if steps is not None else cfg.rl.steps) < 1:
        raise typer.BadParameter(f"{'--steps' if steps is not None else f'rl.steps of {config}'}="
                                 f"{steps if steps is not None else cfg.rl.steps}: RL training needs at least one step")
    _checkpoint(init, "--init", "`isoexec rl sft` (or `isoexec rl init-model`)")
    from isoexec.model.hf import section_mismatches

    differ = section_mismatches(cfg.model, init)
    if differ:
        raise typer.BadParameter(f"--init {init} is not the model of {config}: {'; '.join(differ)} (train from a "
                                 "checkpoint made with this experiment's model section)")
    return cfg


_STEPS = typer.Option(None, help="override rl.steps")
_DRIVER = typer.Option(None, help="override rl.driver: skyrl (SkyRL's RayPPOTrainer, Ray started locally; needs "
                                  "the skyrl extra) | loop (in-process)")


@app.command("train")
def train(config: Path = typer.Option(..., help="experiment YAML"),
          arm: str = typer.Option(..., "--arm", "--mode", help="native | isoexec | an arm of the experiment's "
                                  "arms section (e.g. native-tis)"),
          seed: int = typer.Option(..., help="run seed (data order, sampling seeds)"),
          init: Path = typer.Option(..., help="the SFT checkpoint"),
          out: Path = typer.Option(..., help="results/<exp>/rl/<arm>/seed<k>"),
          steps: int | None = _STEPS,
          driver: str | None = _DRIVER,
          threads: int = _THREADS) -> None:
    """One run of a paired experiment: GRPO/DAPO steps of ARM from INIT; writes metrics.jsonl + provenance.json."""
    cfg = _run_config(config, init, steps, driver, arm)
    _setup(threads)
    if cfg.rl.driver == "skyrl":
        from isoexec.rl.skyrl.driver import run_skyrl

        rows = run_skyrl(cfg, arm, seed, init, out, steps=steps, threads=threads)
    else:
        from isoexec.rl.loop import run_rl

        rows = run_rl(cfg, arm, seed, init, out, steps=steps)
    _summary(arm, seed, rows, out)


@app.command("paired")
def paired(config: Path = typer.Option(..., help="experiment YAML"),
           init: Path = typer.Option(..., help="the SFT checkpoint"),
           out: Path = typer.Option(..., help="results/<exp>/rl: each run goes to <arm>/seed<k>/ below it"),
           steps: int | None = _STEPS,
           driver: str | None = _DRIVER,
           threads: int = _THREADS) -> None:
    """Every arm and seed of the experiment in one process, interleaved: seed after seed, each seed's arms
    alternating step by step (rl.interleave: step, SkyRL only) or run after run (run), their order turned
    by one place per seed (isoexec.rl.arms.seed_rounds), so that machine drift lands on every arm of a seed
    alike. Under SkyRL the runs share Ray; each arm keeps its engines and trainer workers across seeds."""
    from isoexec.rl.arms import schedule

    cfg = _run_config(config, init, steps, driver)
    _setup(threads)
    if cfg.rl.driver == "skyrl":
        from isoexec.rl.skyrl.driver import run_paired

        runs = run_paired(cfg, init, out, steps=steps, threads=threads)
    else:
        from isoexec.rl.loop import run_rl

        runs = {(a.name, s): run_rl(cfg, a.name, s, init, out / a.name / f"seed{s}", steps=steps)
                for a, s in schedule(cfg)}
    for (arm, seed), rows in runs.items():
        _summary(arm, seed, rows, out / arm / f"seed{seed}")


def _summary(arm: str, seed: int, rows: list[dict], out: Path) -> None:
    t = sum(r["time/step"] for r in rows) / max(1, len(rows))
    typer.echo(f"{arm} seed {seed}: {len(rows)} steps, mean step {t:.2f}s, final reward "
               f"{rows[-1]['reward_mean'] if rows else float('nan'):.3f}; wrote {out}/metrics.jsonl")


@app.command("skyrl-config")
def skyrl_config(config: Path = typer.Option(..., help="experiment YAML with a skyrl section"),
                 mode: str = typer.Option(..., help="native | isoexec"),
                 out: Path = typer.Option(..., help="YAML file of SkyRL overrides to write")) -> None:
    """Render the GPU-node SkyRL configuration (SkyRL's dot-path overrides) of one mode, validated by SkyRL."""
    import yaml

    from isoexec.config import load_config
    from isoexec.rl.skyrl import check_recipe_inputs, compat

    exp = load_config(config)
    check_recipe_inputs(exp, mode)  # before SkyRL's imports, which print a line of their own
    compat.install()
    from isoexec.rl.skyrl.render import build, recipe_overrides

    overrides = recipe_overrides(exp, mode)
    build(overrides)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(overrides, sort_keys=True))
    typer.echo(f"wrote {out}")


@app.command("skyrl-launch")
def skyrl_launch(rendered: Path = typer.Option(..., help="overrides written by skyrl-config"),
                 logical_gpus: int = typer.Option(0, min=0, help="GPUs to declare to SkyRL's local Ray node (0: what "
                                                  "Ray detects); on a CPU host, or one GPU shared by the trainer and "
                                                  "the vLLM server: their sum (compat item 3)"),
                 dry_run: bool = typer.Option(False, help="print the command and environment only")) -> None:
    """Launch SkyRL's entry point with rendered overrides (GPU node; with --logical-gpus also a CPU host).

    SkyRL's vLLM servers generate (isoexec mode: with the isoexec plugin); the trainer is isoexec's
    policy worker in isoexec mode and SkyRL's Megatron worker in native mode.
    """
    import os
    import shlex

    import yaml

    from isoexec.rl.skyrl import compat

    compat.install()
    from isoexec.rl.skyrl.render import RECIPE_ENV, launch_command

    cmd = launch_command(yaml.safe_load(rendered.read_text()), python=sys.executable)
    env = {**RECIPE_ENV, **compat.launch_env(os.environ.get("PYTHONPATH")),
           **(compat.logical_gpus_env(logical_gpus) if logical_gpus else {})}
    typer.echo(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd))
    if not dry_run:
        os.execvpe(cmd[0], cmd, {**os.environ, **env})
