"""``isoexec contract show|diff|verify``: inspect, compare and verify saved contract files.

Exit codes: 2 and one ``error:`` line when a file cannot be loaded (missing, malformed, invalid; the
top-level CLI prints it). ``show`` 0; ``diff`` 0 if the ``numerical_policy`` identities are equal
(deployment differences are printed but allowed), 1 if they differ, 2 if a file's content no longer
matches its identities; ``verify`` 0 and ``OK`` with the digests, or 1 naming the identity and the
edited field(s).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from .errors import ContractTampered
from .handshake import diff as diff_contracts
from .handshake import render
from .schema import ExecutionContract
from .store import load

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Inspect, compare and verify execution contracts.")


def _identities(c: ExecutionContract) -> list[str]:
    i = c.identities
    return [
        f"semantic         {i.semantic}",
        f"numerical_policy {i.numerical_policy}",
        f"deployment       {i.deployment}",
    ]


@app.command()
def show(path: Path = typer.Argument(..., help="contract file written by isoexec.contract.save")) -> None:
    """Print a summary: identities, cases, composition (with constants) and claims."""
    c = load(path)
    con = Console(width=max(Console().width, 160), highlight=False, markup=False)
    con.print(str(path), style="bold")
    for line in _identities(c):
        con.print("  " + line)
    con.print(f"cases: {', '.join(sorted(c.cases))}")
    con.print(f"model: {render(c.model)}")

    t = Table(title="composition", show_lines=True)
    for col in ("region", "cases", "impl", "version", "arch", "constants", "proof"):
        t.add_column(col, no_wrap=col != "constants", overflow="fold")
    for e in sorted(c.composition, key=lambda e: (e.region, sorted(e.cases))):
        consts = "\n".join(f"{k}={render(v)}" for k, v in sorted(e.constants.items()))
        t.add_row(e.region, "\n".join(sorted(e.cases)), e.impl, e.version, e.arch, consts, e.proof)
    con.print(t)

    cl = c.claims
    con.print("claims", style="bold")
    for dim, tc in sorted(cl.topology.items()):
        what = f"pinned {tc.pinned}" if tc.pinned is not None else f"in {{{', '.join(map(str, sorted(tc.domain)))}}}"
        con.print(f"  topology {dim}: {what}")
    for ev, states in sorted(cl.state.items()):
        con.print(f"  state {ev} invalidates: {', '.join(sorted(states))}")
    for k, v in sorted(cl.tolerances.items()):
        con.print(f"  tolerance {k} <= {render(float(v))}")
    for k, v in sorted(cl.engine.items()):
        con.print(f"  engine {k} = {render(v)}")
    con.print(f"deployment: {render(c.deployment)}")


@app.command()
def diff(
    a: Path = typer.Argument(..., help="first contract file"),
    b: Path = typer.Argument(..., help="second contract file"),
) -> None:
    """Print the differences between two contracts; exit 1 if their numerical_policy differs."""
    ca, cb = load(a), load(b)
    lines = diff_contracts(ca, cb)
    pa, pb = ca.identities.numerical_policy, cb.identities.numerical_policy
    for line in lines:
        typer.echo(line)
    if pa != pb:
        typer.echo(f"numerical_policy differs: {pa} != {pb}")
        raise typer.Exit(1)
    if lines:
        typer.echo(f"numerical_policy identical ({pa}); only deployment differs (allowed)")
    else:
        typer.echo(f"identical ({pa})")


@app.command()
def verify(path: Path = typer.Argument(..., help="contract file to verify")) -> None:
    """Re-verify a contract file's identities; exit 1 naming the edited field(s) if they no longer match."""
    from isoexec.cli import error_line

    try:
        c = load(path)
    except ContractTampered as e:
        typer.echo(error_line(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"OK {path}")
    for line in _identities(c):
        typer.echo("  " + line)
