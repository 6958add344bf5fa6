"""``isoexec contract show|diff|verify``: inspect, compare and verify saved contract files.

Exit codes: 2 and one ``error:`` line when a file cannot be loaded (missing, malformed, invalid, or
edited by hand so that its content no longer matches its identities: the line names the identity and
the edited field(s); the top-level CLI prints it), the same for every command. ``show`` 0; ``diff`` 0
if the ``numerical_policy`` identities are equal (deployment differences are printed but allowed), 1
if they differ; ``verify`` 0 and ``OK`` with the digests.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import typer

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


def _wrapped(label: str, text: str, width: int, indent: int = 2) -> list[str]:
    """``label`` then ``text`` wrapped to ``width`` columns under it (long words are never split)."""
    head = " " * indent + f"{label:<10} "
    return textwrap.wrap(text, width, initial_indent=head, subsequent_indent=" " * len(head),
                         break_long_words=False, break_on_hyphens=False) or [head.rstrip()]


@app.command()
def show(path: Path = typer.Argument(..., metavar="FILE", help="contract file written by isoexec.contract.save")) -> None:
    """Print a contract: identities, cases, composition (with constants) and claims.

    One block per composition entry (region and cases, then impl/version/arch, constants, proof),
    wrapped to the terminal width (80 columns when piped): nothing is cut at any width.
    """
    c = load(path)
    width = max(shutil.get_terminal_size((80, 24)).columns, 40)
    out = [str(path), *("  " + line for line in _identities(c))]
    out += _wrapped("cases:", ", ".join(sorted(c.cases)), width, 0)
    out += _wrapped("model:", render(c.model), width, 0)
    out.append(f"composition ({len(c.composition)} entries)")
    for e in sorted(c.composition, key=lambda e: (e.region, sorted(e.cases))):
        out.append(f"  {e.region}")
        out += _wrapped("cases", ", ".join(sorted(e.cases)), width, 4)
        out += _wrapped("impl", f"{e.impl} version {e.version} arch {e.arch}", width, 4)
        out += _wrapped("constants", ", ".join(f"{k}={render(v)}" for k, v in sorted(e.constants.items())) or "-",
                        width, 4)
        out += _wrapped("proof", e.proof, width, 4)
    cl = c.claims
    out.append("claims")
    for dim, tc in sorted(cl.topology.items()):
        what = f"pinned {tc.pinned}" if tc.pinned is not None else f"in {{{', '.join(map(str, sorted(tc.domain)))}}}"
        out.append(f"  topology {dim}: {what}")
    for ev, states in sorted(cl.state.items()):
        out += _wrapped(f"state {ev} invalidates:", ", ".join(sorted(states)), width)
    for k, v in sorted(cl.tolerances.items()):
        out.append(f"  tolerance {k} <= {render(float(v))}")
    for k, v in sorted(cl.engine.items()):
        out.append(f"  engine {k} = {render(v)}")
    out += _wrapped("deployment:", render(c.deployment), width, 0)
    typer.echo("\n".join(out))


@app.command()
def diff(
    a: Path = typer.Argument(..., metavar="FILE_A", help="first contract file"),
    b: Path = typer.Argument(..., metavar="FILE_B", help="second contract file"),
) -> None:
    """Print the differences between two contracts.

    Exit status 1 if their numerical_policy differs, 0 if only the deployment does (or nothing).
    """
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
def verify(path: Path = typer.Argument(..., metavar="FILE", help="contract file to verify")) -> None:
    """Re-verify a contract file's identities.

    A file whose content no longer matches its identities is refused as every command refuses it: one
    line naming the identity and the edited field(s), exit status 2.
    """
    c = load(path)
    typer.echo(f"OK {path}")
    for line in _identities(c):
        typer.echo("  " + line)
