"""The MoE grouped GEMMs' host side on the CPU: the device-built tile table of
:func:`isoexec.kernels.gemm.triton._group_tiles` against the plain loop over experts and row blocks, its static
tile count, its freedom from host reads (it runs on ``meta`` tensors, which hold no data, where a ``.tolist()``
or ``torch.bincount`` fails), the routing counts of :func:`isoexec.kernels.moe.triton._expert_counts`, the
argument checks, and the grouped kernels themselves (padding tiles included) through Triton's interpreter
(``TRITON_INTERPRET=1``, in a subprocess: the interpreter is chosen when the kernels are defined).
The compiled kernels are checked on the GPU by ``tests/test_kernels_triton.py``."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from isoexec.config import TritonSection
from isoexec.kernels.gemm.triton import (
    _group_tiles,
    grouped_linear,
    grouped_linear_leaves,
)
from isoexec.kernels.moe.triton import _expert_counts


def _loop_tiles(counts: list[int], bm: int) -> list[tuple[int, int, int]]:
    """The reference: (expert, first row, end of the expert's rows) for expert e ascending, its rows in blocks
    of bm ascending (the Python loop the numpy and then the device tables replaced)."""
    tiles, r = [], 0
    for e, c in enumerate(counts):
        tiles += [(e, r + s, r + c) for s in range(0, c, bm)]
        r += c
    return tiles


def _check_table(table: torch.Tensor, counts: list[int], bm: int) -> None:
    """Assert that ``table`` is the grouped GEMM's tile table of ``counts``: [3, R // bm + min(E, R)] int32, the
    real tiles first and equal to :func:`_loop_tiles` in order, then empty padding tiles (first row = end = R)
    of an expert in range."""
    rows, E = sum(counts), len(counts)
    want = _loop_tiles(counts, bm)
    T = rows // bm + min(E, rows)
    assert table.dtype == torch.int32 and tuple(table.shape) == (3, T), (table.dtype, table.shape, T)
    assert T >= len(want), (T, len(want))
    got = [tuple(col) for col in table.T.tolist()]
    assert got[: len(want)] == want, (counts, bm)
    assert all(r0 == r1 == rows and 0 <= e < E for e, r0, r1 in got[len(want):]), (counts, bm, got[len(want):])


def _random_counts(rng: random.Random, bm: int) -> list[int]:
    pick = [0, 0, 1, bm - 1, bm, bm + 1, 2 * bm, 2 * bm + 1, rng.randint(0, 5 * bm)]
    return [rng.choice(pick) for _ in range(rng.randint(1, 40))]


@pytest.mark.parametrize("bm", [16, 32, 64, 128])
def test_device_tile_table_equals_the_expert_by_expert_loop(bm):
    """Random counts (experts with no rows, bm - 1, bm, bm + 1 rows, ...): the real tiles equal the loop's in
    order, the padding tiles are empty, the static count bounds the real one."""
    rng = random.Random(bm)
    for _ in range(200):
        counts = _random_counts(rng, bm)
        _check_table(_group_tiles(torch.tensor(counts), bm, sum(counts)), counts, bm)


@pytest.mark.parametrize("counts, bm", [
    ([300], 128),                  # all rows in one expert
    ([0, 0, 0, 257, 0], 128),      # all rows in one expert of several
    ([0, 0, 0], 64),               # R = 0: no tile at all
    ([1] * 9, 16),                 # the bound is reached: one tile per row (T = 0 + 9)
    ([17, 17, 17], 16),            # the bound is reached: T = 3 + 3 = 6 = 2 + 2 + 2
    ([16, 16, 16], 16),            # whole blocks: T = 3 + 3, 3 real, 3 padding
    ([5, 0, 0, 0, 0, 0, 0, 0], 4), # more experts than rows... bounded by min(E, R)
])
def test_device_tile_table_edge_cases(counts, bm):
    _check_table(_group_tiles(torch.tensor(counts), bm, sum(counts)), counts, bm)


def test_device_tile_table_dtypes_and_empty_expert_list():
    for dt in (torch.int32, torch.int64, torch.int16, torch.uint8):
        _check_table(_group_tiles(torch.tensor([3, 0, 40], dtype=dt), 16, 43), [3, 0, 40], 16)
    assert tuple(_group_tiles(torch.zeros(0, dtype=torch.long), 16, 0).shape) == (3, 0)


def test_tile_table_check_sees_wrong_tables_negative_control():
    """The comparison of the tests above catches a table of another bm, two real tiles swapped, a padding
    tile that is not empty, a missing padding tile and the wrong dtype."""
    counts, bm = [40, 0, 3, 17], 16
    good = _group_tiles(torch.tensor(counts), bm, sum(counts))
    _check_table(good, counts, bm)
    swapped = good.clone()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]
    live_pad = good.clone()
    live_pad[1, -1] = sum(counts) - 1
    bad = [_group_tiles(torch.tensor(counts), 32, sum(counts)), swapped, live_pad, good[:, :-1], good.long()]
    for table in bad:
        with pytest.raises(AssertionError):
            _check_table(table, counts, bm)


def test_tile_table_and_expert_counts_read_no_data_on_the_host():
    """On ``meta`` tensors (shapes only, no data) both build their outputs of static shape: no ``.item()``,
    ``.tolist()``, numpy or data-dependent shape, i.e. no device-to-host sync on CUDA."""
    table = _group_tiles(torch.empty(7, dtype=torch.long, device="meta"), 128, 300)
    assert table.device.type == "meta" and tuple(table.shape) == (3, 300 // 128 + 7) and table.dtype == torch.int32
    counts = _expert_counts(torch.empty(300, dtype=torch.long, device="meta"), 7)
    assert counts.device.type == "meta" and tuple(counts.shape) == (7,)


def test_host_reads_fail_on_meta_tensors_negative_control():
    """What the meta test would catch: the old ``bincount(...).tolist()`` and any ``.item()`` fail on meta."""
    ids = torch.empty(300, dtype=torch.long, device="meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.bincount(ids, minlength=7).tolist()
    with pytest.raises((RuntimeError, NotImplementedError)):
        ids.sum().item()


def test_expert_counts_equal_bincount():
    """Rows per expert from the sorted ids equal ``torch.bincount`` (experts without ids, no ids at all);
    unsorted ids give other counts (negative control: the search needs the sort)."""
    g = torch.Generator().manual_seed(0)
    for n, E in [(0, 4), (1, 4), (80, 8), (640, 64), (50, 200)]:
        ids = torch.randint(0, E, (n,), generator=g)
        got = _expert_counts(ids.sort().values, E)
        assert got.dtype == torch.int32 and got.tolist() == torch.bincount(ids, minlength=E).tolist(), (n, E)
    ids = torch.tensor([3, 0, 2, 0, 1, 3])
    assert _expert_counts(ids, 4).tolist() != torch.bincount(ids, minlength=4).tolist()


def test_grouped_gemms_refuse_host_counts_and_wrong_tables():
    """Counts as a host list, on another device, of the wrong length or dtype are refused before any launch."""
    cfg = TritonSection()
    x, w = torch.randn(10, 32), torch.randn(3, 16, 32)
    for counts in ([4, 0, 6], torch.tensor([4, 0, 6], device="meta"), torch.tensor([4, 6]),
                   torch.tensor([4.0, 0.0, 6.0]), torch.tensor([[4, 0, 6]])):
        with pytest.raises(ValueError):
            grouped_linear(x, w, counts, cfg)
        with pytest.raises(ValueError):
            grouped_linear_leaves(x, w, counts, cfg, 2)
    with pytest.raises(ValueError):
        _group_tiles(torch.zeros(0, dtype=torch.long), 16, 5)  # rows but no expert
    with pytest.raises(ValueError):
        _group_tiles(torch.tensor([5]), 0, 5)
    with pytest.raises(ValueError):
        _group_tiles(torch.tensor([2**31 - 1]), 128, 2**31 - 1)  # row indices past int32


_KERNEL_CASE = r"""
import json, sys, torch
from isoexec.config import TritonSection
from isoexec.kernels.gemm import triton as g
counts, N, K, leaves, split_rows = json.loads(sys.argv[1])
E, R = len(counts), sum(counts)
cfg = TritonSection(gemm_float32=(16, 16, 16, 4, 1), pik_gemm_float32=(16, 16, 16, 4, 1), pik_split_rows=split_rows)
torch.manual_seed(0)
x = torch.randint(-3, 4, (R, K)).float()  # small integers: every sum exact, whatever the order
w = torch.randint(-3, 4, (E, N, K)).float()
ref = torch.cat([x[r:r + c] @ w[e].T for e, (r, c) in enumerate(zip([0] + list(torch.tensor(counts).cumsum(0)[:-1]),
                                                                     counts))])
c = torch.tensor(counts)
y = g.grouped_linear(x, w, c, cfg)
yl = g.grouped_linear_leaves(x, w, c, cfg, leaves)
yp = g.linear_leaves_partial(x, w, cfg, leaves, counts=c)
wrong = g.grouped_linear(x, w.roll(1, 0), c, cfg)  # expert e's rows with expert e - 1's weight
print(json.dumps({"T": g._group_tiles(c, 16, R).shape[1], "grouped": torch.equal(y, ref), "leaves": torch.equal(yl, ref),
                  "partial": torch.equal(yp, ref), "wrong_differs": not torch.equal(wrong, ref)}))
"""


def _run_kernels(counts, N, K, leaves, split_rows):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _KERNEL_CASE, json.dumps([counts, N, K, leaves, split_rows])], env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("counts, split_rows", [
    ([20, 0, 3, 16, 17, 0], 0),      # in-register leaf tree (flat K loop), padding tiles after the real ones
    ([20, 0, 3, 16, 17, 0], 1000),   # one leaf per program (unrolled leaves)
    ([1, 1, 1, 1], 0),               # as many real tiles as the static bound: no padding
    ([0, 33, 0], 1000),              # all rows in one expert
])
def test_grouped_kernels_in_the_interpreter_equal_per_expert_products(counts, split_rows):
    """Column and leaf grouped GEMMs (fp32, BM 16, exact small-integer data) equal the per-expert products with
    the padding tiles of the static grid present: they run no K step and write nothing (the outputs start
    uninitialised); the rows run with the other experts' weights differ (negative control)."""
    res = _run_kernels(counts, 24, 128, 4, split_rows)
    rows = sum(counts)
    assert res["T"] == rows // 16 + min(len(counts), rows)
    assert res == {"T": res["T"], "grouped": True, "leaves": True, "partial": True, "wrong_differs": True}, res
