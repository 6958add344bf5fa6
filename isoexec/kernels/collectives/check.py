"""``isoexec pik-check``: the TP-invariant row-parallel GEMM over gloo against the native all-reduce."""

from __future__ import annotations

import time

import torch

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


def pik_check_command(
    tp: str = "1,2,4", n: int = 16, k: int = 4096, m: int = 64, leaves: int = 8, seed: int = 0
) -> None:
    """Row-parallel linear on gloo for each TP degree: pik must be bitwise equal across TP, the native
    all-reduce control is reported (max abs diff and differing elements vs TP 1). Exits 1 if pik differs."""
    import typer

    degrees = [int(t) for t in tp.split(",")]
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
