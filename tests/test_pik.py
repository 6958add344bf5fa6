"""Parallel-invariant kernels (docs/design.md, "Parallel invariance (pik)"): TP/SP/EP outputs are
bitwise equal across degrees 1, 2, 4, 8 on gloo process groups (forked local processes), next to the
native controls that differ.

Every case compares full output matrices with ``torch.equal`` against the single-process reference.
"""

import time

import pytest
import torch

from isoexec.kernels.collectives.gloo import run_gloo
from isoexec.kernels.collectives.pik import (
    _owned,
    native_expert_parallel_combine,
    native_row_parallel_linear,
    pik_column_linear,
    pik_column_parallel_linear,
    pik_degrees,
    pik_expert_parallel_combine,
    pik_linear,
    pik_row_parallel_linear,
    pik_row_parallel_partial,
    pik_tree_combine,
)
from isoexec.kernels.gemm.cpu import iso_linear
from isoexec.kernels.moe.cpu import iso_combine, iso_experts, iso_router, iso_shared_expert, iso_swiglu
from isoexec.kernels.primitives import tile_mm, tree_sum

DEGREES = (1, 2, 4, 8)
ROW_TILE = 16
COL_TILE, LEAVES = 16, 8  # the MoE kernels' GEMM constants (KernelSection defaults)
# Row-parallel cases: (name, N, K, M, dtype, out_dtype). N=16 so that SP slices rows for tp <= 8.
ROW_CASES = [
    ("fp32_k4096", 16, 4096, 64, torch.float32, torch.float32),
    ("bf16_k1024", 16, 1024, 48, torch.bfloat16, torch.bfloat16),
    ("fp32_k256_n5", 5, 256, 40, torch.float32, torch.float32),
]
COL = {"n": 5, "k": 256, "m": 64, "col_tile": 8}  # M/8 = 8: one column tile per rank at tp=8
MOE = {"n": 24, "h": 32, "inter": 16, "experts": 8, "top_k": 4}


# ---------------------------------------------------------------------------------------- inputs
def _row_inputs(n, k, m, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).to(dtype), (torch.randn(m, k, generator=g) / k**0.5).to(dtype)


def _col_inputs():
    g = torch.Generator().manual_seed(11)
    return torch.randn(COL["n"], COL["k"], generator=g), torch.randn(COL["m"], COL["k"], generator=g)


def _moe_inputs():
    g = torch.Generator().manual_seed(12)
    n, h, i, e = MOE["n"], MOE["h"], MOE["inter"], MOE["experts"]
    x = torch.randn(n, h, generator=g)
    router_w = torch.randn(e, h, generator=g)
    experts = [tuple(torch.randn(*s, generator=g) / 4 for s in ((i, h), (i, h), (h, i))) for _ in range(e)]
    return x, router_w, experts


def _route(x, router_w, top_k):
    """The unified model's router (same ops as ``moe.router``), giving the routing order."""
    lf = iso_linear(x, router_w, ROW_TILE, COL_TILE).float()
    ex = torch.exp(lf - lf.amax(dim=-1, keepdim=True))
    probs = ex / tree_sum(ex, dim=-1, keepdim=True)
    val, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    val, idx = val[:, :top_k], idx[:, :top_k]
    return idx, (val / tree_sum(val, dim=-1, keepdim=True)).to(x.dtype)


def _expert_fn(experts):
    return lambda eid, rows: iso_swiglu(rows, *experts[eid], ROW_TILE, COL_TILE, LEAVES)


# ---------------------------------------------------------------------------------------- worker
def _worker(rank, world):
    """All pik cases on one rank of a gloo group of size ``world``."""
    out = {}
    for name, n, k, m, dtype, odt in ROW_CASES:
        x, w = _row_inputs(n, k, m, dtype, seed=len(name))
        s = k // world
        xs, ws = x[:, rank * s : (rank + 1) * s], w[:, rank * s : (rank + 1) * s]
        out[f"row/{name}/pik"] = pik_row_parallel_linear(xs, ws, leaves=8, row_tile=ROW_TILE, out_dtype=odt)
        out[f"row/{name}/native"] = native_row_parallel_linear(xs, ws)
        if n % world == 0:
            out[f"row/{name}/sp"] = pik_row_parallel_linear(
                xs, ws, leaves=8, row_tile=ROW_TILE, out_dtype=odt, sequence_parallel=True
            )
    x, w = _col_inputs()
    s = COL["m"] // world
    ws = w[rank * s : (rank + 1) * s]
    out["col/pik"] = pik_column_parallel_linear(x, ws, col_tile=COL["col_tile"], row_tile=ROW_TILE)
    out["col/tile_mm_slice"] = tile_mm(x, ws.t(), ROW_TILE)  # a plain column shard of our GEMM
    out["col/mm_slice"] = torch.mm(x, ws.t())  # the same shard with MKL's GEMM: the negative control
    x, router_w, experts = _moe_inputs()
    idx, val = _route(x, router_w, MOE["top_k"])
    fn = _expert_fn(experts)
    out["ep/pik"] = pik_expert_parallel_combine(x, idx, val, fn, MOE["experts"])
    out["ep/native"] = native_expert_parallel_combine(x, idx, val, fn, MOE["experts"])
    return out


@pytest.fixture(scope="module")
def runs():
    """{degree: [per-rank result dict]} for gloo groups of 1, 2, 4 and 8 processes."""
    res, secs = {}, {}
    for d in DEGREES:
        t0 = time.perf_counter()
        res[d] = run_gloo(_worker, d)
        secs[d] = time.perf_counter() - t0
    print("gloo run seconds per degree:", {d: round(s, 2) for d, s in secs.items()})
    return res


# ---------------------------------------------------------------------------------- row-parallel
@pytest.mark.parametrize("case", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_pik_row_parallel_linear_is_bitwise_equal_across_tp_and_to_reference(runs, case):
    name, n, k, m, dtype, odt = case
    x, w = _row_inputs(n, k, m, dtype, seed=len(name))
    ref = pik_linear(x, w, leaves=8, row_tile=ROW_TILE, out_dtype=odt)
    assert ref.shape == (n, m) and ref.dtype == odt
    for d in DEGREES:
        for rank, r in enumerate(runs[d]):
            assert torch.equal(r[f"row/{name}/pik"], ref), f"tp={d} rank={rank} differs from the reference"


def test_native_row_parallel_all_reduce_differs_across_tp(runs):
    """Negative control: local GEMM + all_reduce SUM changes bits with TP (fp32, K=4096)."""
    ref = runs[1][0]["row/fp32_k4096/native"]
    diffs = {d: int((runs[d][0]["row/fp32_k4096/native"] != ref).sum()) for d in DEGREES[1:]}
    print("native row-parallel elements differing from tp=1 (of 1024):", diffs)
    assert all(v > 0 for v in diffs.values()), diffs


def test_pik_subtrees_compose_to_the_full_tree():
    """The rank-local subtree sums, combined in rank order, are the TP=1 tree (no process group)."""
    x, w = _row_inputs(3, 512, 24, torch.float32, seed=5)
    ref = pik_linear(x, w)
    for tp in DEGREES:
        s = 512 // tp
        parts = [pik_row_parallel_partial(x[:, r * s : (r + 1) * s], w[:, r * s : (r + 1) * s], tp) for r in range(tp)]
        assert torch.equal(pik_tree_combine(parts), ref)


# -------------------------------------------------------------------------------- sequence-parallel
@pytest.mark.parametrize("name", [c[0] for c in ROW_CASES if c[1] % max(DEGREES) == 0])
def test_pik_reduce_scatter_equals_all_reduce_then_slice(runs, name):
    for d in DEGREES:
        full = runs[d][0][f"row/{name}/pik"]
        rows = full.shape[0] // d
        for rank, r in enumerate(runs[d]):
            assert torch.equal(r[f"row/{name}/sp"], full[rank * rows : (rank + 1) * rows]), f"sp={d} rank={rank}"


# ---------------------------------------------------------------------------------- column-parallel
def test_pik_column_parallel_linear_is_bitwise_equal_across_tp(runs):
    x, w = _col_inputs()
    ref = pik_column_linear(x, w, col_tile=COL["col_tile"], row_tile=ROW_TILE)
    for d in DEGREES:
        for rank, r in enumerate(runs[d]):
            assert torch.equal(r["col/pik"], ref), f"tp={d} rank={rank}"


def test_tile_mm_on_a_column_slice_is_the_slice_of_the_full_product_and_mkl_is_not(runs):
    """Why the column-parallel shards are free to be any whole ``col_tile`` blocks: ``tile_mm`` on a
    rank's column slice of W has the bits of those columns of the full product at every TP (one FMA
    chain per output). Negative control: MKL's ``torch.mm`` on the same slices (measured on the
    project's CPUs: 8-column slices, tp=8 of M=64, take another kernel and differ)."""
    x, w = _col_inputs()
    full = tile_mm(x, w.t(), ROW_TILE)
    full_mm = runs[1][0]["col/mm_slice"]  # MKL's full product in a worker (its bits depend on the threads too)
    for d in DEGREES:
        assert torch.equal(torch.cat([r["col/tile_mm_slice"] for r in runs[d]], dim=1), full), f"tp={d}"
    diffs = {d: int((torch.cat([r["col/mm_slice"] for r in runs[d]], dim=1) != full_mm).sum()) for d in DEGREES}
    print(f"torch.mm column-slice elements differing from the full product (of {full.numel()}):", diffs)
    if not any(diffs.values()):
        pytest.skip("torch.mm column slices are bitwise equal on this CPU: the negative control shows nothing here")


# ---------------------------------------------------------------------------------- expert-parallel
def test_pik_expert_parallel_combine_is_routing_order_and_equal_across_ep(runs):
    x, router_w, experts = _moe_inputs()
    idx, val = _route(x, router_w, MOE["top_k"])
    ref = pik_expert_parallel_combine(x, idx, val, _expert_fn(experts), MOE["experts"])
    # The unified model's MoE with a zero shared expert is exactly the routed sum.
    h, i = MOE["h"], MOE["inter"]
    zero_shared = (torch.zeros(i, h), torch.zeros(i, h), torch.zeros(h, i))
    val_r, idx_r = iso_router(x, router_w, MOE["top_k"], True, ROW_TILE, COL_TILE)
    y = iso_experts(x, idx_r, experts, ROW_TILE, COL_TILE, LEAVES)
    shared = iso_shared_expert(x, zero_shared, torch.zeros(1, h), ROW_TILE, COL_TILE, LEAVES)
    moe = iso_combine(y, val_r, idx_r, shared, torch.float32)
    assert torch.equal(moe, ref)
    for d in DEGREES:
        for rank, r in enumerate(runs[d]):
            assert torch.equal(r["ep/pik"], ref), f"ep={d} rank={rank}"


def test_native_expert_parallel_combine_differs_across_ep(runs):
    """Negative control: per-rank partial sums (expert order) + all_reduce change bits with EP."""
    ref = runs[1][0]["ep/native"]
    diffs = {d: int((runs[d][0]["ep/native"] != ref).sum()) for d in DEGREES[1:]}
    print(f"native EP combine elements differing from ep=1 (of {ref.numel()}):", diffs)
    assert any(v > 0 for v in diffs.values()), diffs


# ------------------------------------------------------------------------------------------ errors
def test_pik_rejects_layouts_outside_the_tree():
    x, w = _row_inputs(2, 96, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"leaves=8 is not divisible by the TP degree tp=3"):
        pik_row_parallel_partial(x[:, :32], w[:, :32], tp=3)
    with pytest.raises(ValueError, match=r"power of two.*leaves=6"):
        pik_linear(x, w, leaves=6)
    with pytest.raises(ValueError, match=r"local K=18 is not divisible by leaves/tp=4"):
        pik_row_parallel_partial(x[:, :18], w[:, :18], tp=2)
    with pytest.raises(ValueError, match=r"M=8 are not divisible by col_tile=16"):
        pik_column_linear(x, w, col_tile=16)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the EP degree"):
        _owned(num_experts=6, ep=4, rank=0)  # the check pik_expert_parallel_combine runs first
    assert pik_degrees(8) == (1, 2, 4, 8)

