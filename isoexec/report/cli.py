"""``isoexec report tables|figures|notebook``: summary tables, figures and the analysis notebook of an
experiment's paired RL runs (one row or line per arm)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Summary tables, figures and the analysis notebook of an experiment's paired RL runs.")

ExpDir = Annotated[
    Path,
    typer.Option("--exp-dir", help="experiment results folder, e.g. results/cpu-tiny", file_okay=False),
]
Arms = Annotated[
    list[str] | None,
    typer.Option("--arm", "--mode", help="only this arm (repeatable; default: every rl/<arm>/ found)"),
]
Seeds = Annotated[
    list[int] | None,
    typer.Option("--seed", help="only this seed (repeatable; default: every seed<k>/ found)"),
]


def _run(kind: str, exp_dir: Path, arms: list[str] | None, seeds: list[int] | None) -> None:
    """Write the tables or figures; a missing folder or bad metrics (``MetricsError``) propagate to the
    top-level CLI, which prints one ``error:`` line and exits 2."""
    if kind == "tables":
        from isoexec.report.tables import write_tables as write
    else:
        from isoexec.report.figures import write_figures as write
    paths = write(exp_dir, arms or None, seeds or None)
    for p in paths:
        typer.echo(f"wrote {p}")


@app.command("tables")
def tables_command(exp_dir: ExpDir, arm: Arms = None, seed: Seeds = None) -> None:
    """Write tables/{summary,main,per_seed,timing}.{csv,md,tex} (one row per arm) and comparison.md, with provenance;
    with reruns of the RL stage under EXP_DIR/reruns/<name>/rl/, also tables/reruns.* and a further run's interval."""
    _run("tables", exp_dir, arm, seed)


@app.command("figures")
def figures_command(exp_dir: ExpDir, arm: Arms = None, seed: Seeds = None) -> None:
    """Write figures/{logprob_diff,is_ratio,reward,time}.{png,pdf}."""
    _run("figures", exp_dir, arm, seed)


@app.command("side-by-side")
def side_by_side_command(
    exp_dir: Annotated[list[Path], typer.Option("--exp-dir", help="an experiment's results folder (two or more, in "
                                                "display order), e.g. results/cpu-tiny", file_okay=False)],
    out_dir: Annotated[Path, typer.Option(help="folder that receives tables/ and figures/ (e.g. the last --exp-dir)",
                                          file_okay=False)],
) -> None:
    """Write tables/side_by_side.* and figures/side_by_side.{png,pdf}: experiments on the same axes, e.g. the
    GPU run beside its CPU twin (one row per experiment and arm)."""
    from isoexec.report.side_by_side import write_side_by_side

    for p in write_side_by_side(exp_dir, out_dir):
        typer.echo(f"wrote {p}")


@app.command("notebook")
def notebook_command(
    exp_dir: ExpDir,
    notebook: Annotated[Path, typer.Option(help="the analysis notebook to execute")] = Path("notebooks/analysis.ipynb"),
    out_dir: Annotated[Path, typer.Option(help="folder for the executed .ipynb and .html (default: EXP_DIR/notebooks)")] = None,
) -> None:
    """Execute the analysis notebook for an experiment and export it to HTML (stable bytes for the same results)."""
    from isoexec.report.notebook import run_notebook

    for p in run_notebook(notebook, exp_dir, out_dir or exp_dir / "notebooks"):
        typer.echo(f"wrote {p}")

