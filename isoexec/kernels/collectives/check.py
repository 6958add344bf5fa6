"""``isoexec pik-check``: the TP-invariant row-parallel GEMM over gloo against the native all-reduce."""

from __future__ import annotations

import time

import torch
import typer

from isoexec.kernels.collectives.gloo import run_gloo
from isoexec.kernels.collectives.pik import native_row_parallel_linear, pik_row_parallel_linear


def _demo_worker(rank: int, world: int, n: int, k: int, m: int, leaves: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    s = k // world
    xs, ws = x[:, rank * s : (rank + 1) * s], w[:, rank * s : (rank + 1) * s]
    t0 = time.perf_counter()
    pik = pik_row_parallel_linear(xs, ws, leaves=leaves, out_dtype=torch.float32)
    t1 = time.perf_counter()
    nat = native_row_parallel_linear(xs, ws)
    t2 = time.perf_counter()
    return {"pik": pik, "native": nat, "pik_s": t1 - t0, "native_s": t2 - t1}


def parse_degrees(tp: str, leaves: int, k: int) -> list[int]:
    """The TP degrees of ``--tp`` (comma-separated), checked against what pik is invariant over.

    Returns:
        The degrees in the order given.

    Raises:
        typer.BadParameter: a word that is not an integer, no degree at all, a degree that is not a
            power of two dividing ``leaves`` (:func:`~isoexec.kernels.collectives.pik.pik_degrees`),
            or ``k`` not divisible by ``leaves``; the message names the value and what is allowed.
    """
    import typer

    from isoexec.kernels.collectives.pik import pik_degrees

    try:
        allowed = pik_degrees(leaves)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--leaves") from None
    if k % leaves:
        raise typer.BadParameter(f"--k {k} is not divisible by --leaves {leaves} (each leaf is K/leaves features)",
                                 param_hint="--k")
    words = [w.strip() for w in tp.split(",") if w.strip()]
    bad = [w for w in words if not w.isdigit() or int(w) not in allowed]
    if not words or bad:
        raise typer.BadParameter(
            f"{tp!r}: expected comma-separated TP degrees from {', '.join(map(str, allowed))} "
            f"(powers of two dividing --leaves {leaves})" + (f"; not allowed: {', '.join(bad)}" if bad else ""),
            param_hint="--tp")
    return [int(w) for w in words]


def pik_check_command(
    tp: str = typer.Option("1,2,4", help="comma-separated TP degrees to run, each a power of two dividing --leaves; "
                                         "the first is the reference"),
    n: int = typer.Option(16, min=1, help="rows N of the input X (N x K)"),
    k: int = typer.Option(4096, min=1, help="input features K, sharded over the TP ranks; a multiple of --leaves"),
    m: int = typer.Option(64, min=1, help="output features M of the weight W (M x K)"),
    leaves: int = typer.Option(8, min=1, help="G: fixed K leaves of the pik reduction tree (a power of two)"),
    seed: int = typer.Option(0, help="seed of the random X and W"),
) -> None:
    """TP-invariant row-parallel GEMM (pik) over gloo against the native all-reduce, per TP degree.

    Exits 1 if pik is not bitwise equal across the degrees; the native control's differences are shown.
    """
    degrees = parse_degrees(tp, leaves, k)
    ref = None
    bad = 0
    for d in degrees:
        r0 = run_gloo(_demo_worker, d, n, k, m, leaves, seed)[0]
        if ref is None:
            ref = r0
        pik_eq = torch.equal(r0["pik"], ref["pik"])
        nd = int((r0["native"] != ref["native"]).sum())
        mx = float((r0["native"] - ref["native"]).abs().max())
        bad += not pik_eq
        typer.echo(
            f"tp={d}: pik bitwise equal to tp={degrees[0]}: {pik_eq}; native differs in {nd}/{n * m} elements "
            f"(max abs {mx:.3e}); time pik {r0['pik_s'] * 1e3:.1f} ms, native {r0['native_s'] * 1e3:.1f} ms"
        )
    if bad:
        raise typer.Exit(1)
