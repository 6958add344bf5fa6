"""Batch-invariant Triton GEMMs for Hopper (regions ``*.proj``, ``moe.router``, ``moe.experts``,
``mlp.shared_expert``, ``lm_head``).

Column GEMMs (:func:`linear`, :func:`grouped_linear`): ``y[i] = x[i] @ w.T``; every output tile is
computed by one program with tiles ``(BM, BN, BK)`` (contract constants), the K loop runs from 0
upwards in steps of BK with fp32 accumulation, and there is no split-K. Each output element's
reduction order is therefore that of one fixed instruction sequence, whatever the number of rows, the
row's position in its tile or the other rows (masked rows load zeros and are never stored). On the
H200 the tiles do not even choose the bits: an element accumulates the same 16-wide tensor-core K steps
in ascending order whatever the program shape, BM, BN, BK (16-multiples), warps or stages (every
candidate of ``results/h200/gemm_buckets/variants_gemm.csv`` is bitwise equal to the pinned tiles), so
a GEMM of few rows runs tiles that keep more programs busy (``kernels.triton.gemm_bfloat16_by_rows``). The
grouped variant (``moe.experts``) runs the same tile program over per-expert row ranges, on a grid of a
static number of tiles built on the device from per-expert row counts (:func:`_group_tiles`; no host sync,
so an engine step can be captured in a CUDA graph); the padding tiles past the real ones are empty and run
no K step. Two program
shapes run that same tile computation: one program per tile with pointer loads (``tiled``), or a
persistent grid over tiles with TMA loads (``persistent_tma``); ``kernels.triton.gemm_kernel`` pins one.

Leaf GEMMs (:func:`linear_leaves`, :func:`grouped_linear_leaves`, :func:`linear_leaves_partial`), the
row-parallel regions (``attn.out_proj``, ``gdn.out_proj``, expert and shared-expert ``down_proj``) and
the pik kernels of :mod:`isoexec.kernels.collectives.triton` (docs/design.md, "Parallel invariance (pik)"): K
is cut into G fixed contiguous leaves over the *global* K; each leaf is the tile program above over its
K/G features, from a zero accumulator; the G fp32 leaf partials are added by the fixed binary tree that
pairs adjacent nodes, ``((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))``, and rounded once. A program either
reduces an aligned subtree of leaves in registers (a binary counter: the node finished at leaf j is
kept at level ``l`` while bit ``l`` of j is 0, and added to its left sibling when it is 1) and leaves
the levels above its subtree to :func:`tree_combine` (one leaf per program for few rows,
``kernels.triton.pik_split_rows``; at most ``kernels.triton.pik_program_leaves`` otherwise, or the bucket's of
``kernels.triton.pik_bfloat16_by_leaf_k`` by leaf width and rows, with its loop, tiles and loads: pointer or
TMA), and a launch of two or four subtrees per tile may add them in the leaf kernel itself (the bucket's ``top``); every
launch adds the same fp32
numbers in the same order, so none changes bits. A TP rank holding K/tp
features reduces its subtree of G/tp leaves with the same code, hence every TP dividing G gives the
same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from isoexec.kernels.autograd import with_ref_grad
from isoexec.kernels.gemm.native import native_linear

DOT_PRECISION = "ieee"  # bf16 x bf16 -> fp32 on the tensor cores; fp32 as a true fp32 dot (no tf32)


@triton.jit
def _swizzle(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GM: tl.constexpr):
    """(row tile, column tile) of output tile number ``tile``: groups of GM row tiles walk the columns
    together (L2 reuse of the weight tiles)."""
    n_tm = tl.cdiv(M, BM)
    width = GM * tl.cdiv(N, BN)
    first = (tile // width) * GM
    gsz = tl.minimum(n_tm - first, GM)
    return first + (tile % width) % gsz, (tile % width) // gsz


@triton.jit
def _program_tile(pid, M, N, w_ptr, stride_we, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
                  GROUPED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GM: tl.constexpr):
    """(first row, row end, column tile, weight pointer) of program ``pid``: a swizzled tile of the whole
    ``[M, N]`` output, or (``GROUPED``) row tile ``pid // n_tn`` of the per-expert table with its expert's
    weight."""
    if GROUPED:
        n_tn = tl.cdiv(N, BN)
        pid_m = pid // n_tn
        pid_n = pid % n_tn
        r0 = tl.load(tile_r0_ptr + pid_m)
        r1 = tl.load(tile_r1_ptr + pid_m)
        w_ptr = w_ptr + tl.load(tile_e_ptr + pid_m).to(tl.int64) * stride_we
    else:
        pid_m, pid_n = _swizzle(pid, M, N, BM, BN, GM)
        r0 = pid_m * BM
        r1 = M
    return r0, r1, pid_n, w_ptr


@triton.jit(do_not_specialize=["M", "n_tiles"])  # M varies with the batch; N, K are weight shapes
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_we,
                 tile_e_ptr, tile_r0_ptr, tile_r1_ptr, n_tiles,
                 GROUPED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GM: tl.constexpr, PREC: tl.constexpr):
    r0, r1, pid_n, w_ptr = _program_tile(tl.program_id(0), M, N, w_ptr, stride_we, tile_e_ptr, tile_r0_ptr,
                                         tile_r1_ptr, GROUPED, BM, BN, GM)
    rows = r0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < r1
    cmask = cols < N
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if GROUPED:  # a padding tile of the static grid (r0 == r1) runs no K step; a live one the same steps
        k_end = tl.where(r0 < r1, K, 0)
    else:
        k_end = K  # the same value bound to another name: the non-grouped kernel compiles as before
    for k0 in range(0, k_end, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < K
        a = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["M"])
def _gemm_tma_kernel(x_desc, w_desc, y_ptr, M, N, K, stride_ym,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr,
                     NUM_SMS: tl.constexpr, PREC: tl.constexpr):
    start = tl.program_id(0)
    n_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(start, n_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _swizzle(tile, M, N, BM, BN, GM)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = x_desc.load([pid_m * BM, k0])  # out-of-range rows and K columns read as zeros
            b = w_desc.load([pid_n * BN, k0])
            acc = tl.dot(a, b.T, acc, input_precision=PREC)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _tree_climb(j, acc, s0, s1, s2, LPP: tl.constexpr):
    """Leaf ``j``'s fp32 partial ``acc`` is complete: climb the adjacent-pairs tree of the program's LPP leaves
    while j's bit at that level is 1 (a binary counter). Level l's pending node is kept in ``s<l>``, the root
    in ``s0``; levels the subtree does not have are never assigned (``LPP`` is a compile-time constant), so
    with a run-time ``j`` (the flat loop) only the accumulators the subtree needs stay live: two for LPP 2,
    three for 4, four for 8. Returns the new (s0, s1, s2)."""
    if j % 2 == 0:
        s0 = acc
    else:
        n1 = s0 + acc
        if LPP == 2:
            s0 = n1  # the root of 2 leaves
        elif (j // 2) % 2 == 0:
            s1 = n1
        else:
            n2 = s1 + n1
            if LPP == 4:
                s0 = n2  # the root of 4 leaves
            elif (j // 4) % 2 == 0:
                s2 = n2
            else:
                s0 = s2 + n2  # the root of 8 leaves (s0 is free again)
    return s0, s1, s2


# Four loop shapes, the same additions in the same order (``LOOP`` is chosen by the host, not bit-relevant):
# - ``flat``: one K loop over the leaves, software-pipelined across leaf boundaries, for programs of several leaves
#   (one-step leaves included: 0.77x the unrolled time on the H200, ``results/h200/leaf_gemm/README.md``). Its
#   accumulator is read by the tree climb inside the loop, so Triton waits for every tensor-core dot before the
#   next (``warp_group_dot_wait {pendings = 0}`` in each K step: ``results/h200/leaf_gemm/sm90_compile/``);
# - ``paired``: two leaves at a time, each pair's K loop holding one dot per leaf, two chains in flight
#   (``pendings = 2``) and only dots on the accumulators, the pair's two leaves climbing the tree after its loop
#   (one drain per pair);
# - ``flat_paired``: the paired loop's two dots per K step, in one loop over every pair's K steps (the loads pipelined
#   across pairs, as flat's across leaves; the climb in the loop, so Triton waits for the dots in every step);
# - ``unrolled``: the leaf with its own K loop, for one-leaf programs (the split launch, where the flat loop took
#   1.07-1.55x the time).
# ``kpl`` (K steps per leaf) is a run-time bound on purpose: with a compile-time kpl of 1 a leaf's dot starts
# from a literal zero, and Triton's dot-combine pattern folds the next tree addition into that dot's
# accumulator (``dot(a, b, 0) + s -> dot(a, b, s)``), which changes the bits of the in-register tree against
# the one-leaf-per-program launch (seen on the H200 for leaves of one 64-wide K step). A grouped padding tile
# (r0 == r1) sets kpl to 0, so no loop shape runs a step; a live tile keeps kpl, still a run-time value.
# ``TOP`` (0, or the 2 or 4 subtrees of a launch of TOP * LPP leaves added in this kernel): programs TOP * t + s of a
# 1-D grid are output tile t's subtrees s, adjacent so that they run side by side and the fp32 partials stay in L2.
# They climb tree_combine's top levels as a binary counter: at level l, subtree s with bit l clear (a left node)
# stores its node to tile t's slot s of ``part_ptr`` (TOP - 1 BM x BN blocks per tile) and, after a CTA barrier,
# releases flag (t, s); one with bit l set acquires flag (t, s - 2^l) (spinning: a lower program id is dispatched no
# later, so the writer is resident or done), loads that node past L1 and adds ``left + right``, tree_combine's
# addition, then climbs on; subtree TOP - 1 ends with the root and rounds once. Four subtrees: s1 publishes p0 + p1,
# s3 adds (p0 + p1) + (p2 + p3). The serial split-K fix-up of CUTLASS (``Semaphore``) and Triton's stream-K example
# wait the same way.
@triton.jit
def _top_publish(part_ptr, flag_ptr, slot, node, BM: tl.constexpr, BN: tl.constexpr):
    """Store ``node`` (``[BM, BN]`` fp32) to the in-kernel top's block ``slot`` and release flag ``slot``."""
    tl.store(part_ptr + slot * (BM * BN) + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], node)
    tl.debug_barrier()  # every thread's part of the block is stored before the flag is released
    tl.atomic_xchg(flag_ptr + slot, 1, sem="release")


@triton.jit
def _top_take(part_ptr, flag_ptr, slot, BM: tl.constexpr, BN: tl.constexpr):
    """Wait for flag ``slot`` (acquire), then load block ``slot`` past L1: the left node of this program's level."""
    while tl.atomic_cas(flag_ptr + slot, 1, 1, sem="acquire") != 1:
        pass
    return tl.load(part_ptr + slot * (BM * BN) + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :],
                   cache_modifier=".cg")


@triton.jit
def _leaf_step(x_ptr, w_ptr, x_desc, w_desc, rows64, cols64, rmask, cmask, stride_xm, stride_wn, r0, w_row, k_leaf, it,
               LEAF_K: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):
    """K step ``it`` of the leaf starting at feature ``k_leaf``: the ``[BM, BK]`` x tile and the ``[BK, BN]`` weight
    tile. Pointer loads mask the rows, columns and the leaf's end (zeros); TMA loads (``TMA``: the host made the
    descriptors, LEAF_K a multiple of BK) read the tiles at (``r0``, K) and (``w_row``, K), zeros past the tensor's
    end. Rows past a grouped tile's end and columns past N then hold other rows' and experts' values, whose outputs
    are never stored: an output element depends only on its own x row and weight row, so the stored bits are the
    same."""
    if TMA:
        k0 = k_leaf + it * BK
        a = x_desc.load([r0, k0])
        b = w_desc.load([w_row, k0]).T
    else:
        kl = it * BK + tl.arange(0, BK)  # K offset within the leaf
        ks = k_leaf + kl
        kmask = kl < LEAF_K
        a = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptr + cols64[None, :] * stride_wn + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
    return a, b


@triton.jit(do_not_specialize=["M", "n_tiles", "kpl"])
def _leaf_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, flag_ptr, M, N, stride_xm, stride_wn, stride_ym, stride_we,
                      stride_ys, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, n_tiles, kpl, x_desc, w_desc,
                      LEAF_K: tl.constexpr, LPP: tl.constexpr, LOOP: tl.constexpr, GROUPED: tl.constexpr,
                      TOP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr,
                      PREC: tl.constexpr, TMA: tl.constexpr = False):
    # program (tile, s): output tile ``tile`` summed over the subtree s of LPP leaves (K offset s*LPP*LEAF_K)
    if TOP > 0:
        tile = tl.program_id(0) // TOP
        sub = tl.program_id(0) % TOP
    else:
        tile = tl.program_id(0)
        sub = tl.program_id(1)
    r0, r1, pid_n, w_ptr = _program_tile(tile, M, N, w_ptr, stride_we, tile_e_ptr, tile_r0_ptr,
                                         tile_r1_ptr, GROUPED, BM, BN, GM)
    rows = r0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < r1
    cmask = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    k_base = sub * (LPP * LEAF_K)
    w_row = pid_n * BN  # the weight tile's first row for TMA loads: [N, K], or the experts' [E * N, K]
    if TMA and GROUPED:
        w_row += tl.load(tile_e_ptr + tile // tl.cdiv(N, BN)) * N
    if GROUPED:
        kpl = tl.where(r0 < r1, kpl, 0)
    s0 = tl.zeros((BM, BN), dtype=tl.float32)
    s1 = tl.zeros((BM, BN), dtype=tl.float32)
    s2 = tl.zeros((BM, BN), dtype=tl.float32)
    if LOOP == "flat":  # one K loop over all LPP leaves, pipelined across leaf boundaries (iteration t = j * kpl + it)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for t in range(0, LPP * kpl):
            j = t // kpl
            it = t - j * kpl
            a, b = _leaf_step(x_ptr, w_ptr, x_desc, w_desc, rows64, cols64, rmask, cmask, stride_xm, stride_wn, r0,
                              w_row, k_base + j * LEAF_K, it, LEAF_K, BK, TMA)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            if it == kpl - 1:
                s0, s1, s2 = _tree_climb(j, acc, s0, s1, s2, LPP)
                acc = tl.zeros((BM, BN), dtype=tl.float32)  # the next leaf starts from zero
    elif LOOP == "paired":  # leaves 2p and 2p + 1 side by side in one K loop, then both climb the tree
        for p in range(0, LPP // 2):
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc2 = tl.zeros((BM, BN), dtype=tl.float32)
            for it in range(0, kpl):
                k_leaf = k_base + 2 * p * LEAF_K
                a, b = _leaf_step(x_ptr, w_ptr, x_desc, w_desc, rows64, cols64, rmask, cmask, stride_xm, stride_wn,
                                  r0, w_row, k_leaf, it, LEAF_K, BK, TMA)
                a2, b2 = _leaf_step(x_ptr, w_ptr, x_desc, w_desc, rows64, cols64, rmask, cmask, stride_xm, stride_wn,
                                    r0, w_row, k_leaf + LEAF_K, it, LEAF_K, BK, TMA)
                acc = tl.dot(a, b, acc, input_precision=PREC)
                acc2 = tl.dot(a2, b2, acc2, input_precision=PREC)
            # leaf 2p's partial is the pending level-0 node when leaf 2p + 1 climbs (what climbing 2p would leave)
            s0, s1, s2 = _tree_climb(2 * p + 1, acc2, acc, s1, s2, LPP)
    elif LOOP == "flat_paired":  # the paired loop's two dots per K step in one loop over every pair's K steps
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
        for t in range(0, (LPP // 2) * kpl):
            p = t // kpl
            it = t - p * kpl
            k_leaf = k_base + 2 * p * LEAF_K
            a, b = _leaf_step(x_ptr, w_ptr, x_desc, w_desc, rows64, cols64, rmask, cmask, stride_xm, stride_wn, r0,
                              w_row, k_leaf, it, LEAF_K, BK, TMA)
            a2, b2 = _leaf_step(x_ptr, w_ptr, x_desc, w_desc, rows64, cols64, rmask, cmask, stride_xm, stride_wn, r0,
                                w_row, k_leaf + LEAF_K, it, LEAF_K, BK, TMA)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            acc2 = tl.dot(a2, b2, acc2, input_precision=PREC)
            if it == kpl - 1:  # as the paired loop's climb after a pair
                s0, s1, s2 = _tree_climb(2 * p + 1, acc2, acc, s1, s2, LPP)
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    else:
        for j in tl.static_range(LPP):  # leaves unrolled: each leaf is one plain (pipelined) K loop
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for it in range(0, kpl):
                a, b = _leaf_step(x_ptr, w_ptr, x_desc, w_desc, rows64, cols64, rmask, cmask, stride_xm, stride_wn,
                                  r0, w_row, k_base + j * LEAF_K, it, LEAF_K, BK, TMA)
                acc = tl.dot(a, b, acc, input_precision=PREC)
            s0, s1, s2 = _tree_climb(j, acc, s0, s1, s2, LPP)
    ys = y_ptr + rows64[:, None] * stride_ym + cols64[None, :]
    if TOP > 0:
        slot = tile.to(tl.int64) * (TOP - 1)  # the tile's first block and flag
        if sub % 2 == 0:  # a left node at level 0
            _top_publish(part_ptr, flag_ptr, slot + sub, s0, BM, BN)
        else:
            s0 = _top_take(part_ptr, flag_ptr, slot + sub - 1, BM, BN) + s0
            if TOP == 4:
                if sub == 1:  # p0 + p1, the left node at level 1
                    _top_publish(part_ptr, flag_ptr, slot + 1, s0, BM, BN)
                else:  # (p0 + p1) + (p2 + p3)
                    s0 = _top_take(part_ptr, flag_ptr, slot + 1, BM, BN) + s0
                    tl.store(ys, s0.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
            else:
                tl.store(ys, s0.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
    else:
        tl.store(ys + sub.to(tl.int64) * stride_ys, s0.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _tree_combine_kernel(p_ptr, y_ptr, n, stride_s, S: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p0 = tl.load(p_ptr + offs, mask=mask, other=0.0)
    if S == 1:
        r = p0
    else:
        p1 = tl.load(p_ptr + stride_s + offs, mask=mask, other=0.0)
        r = p0 + p1
        if S >= 4:
            p2 = tl.load(p_ptr + 2 * stride_s + offs, mask=mask, other=0.0)
            p3 = tl.load(p_ptr + 3 * stride_s + offs, mask=mask, other=0.0)
            r = r + (p2 + p3)
        if S == 8:
            p4 = tl.load(p_ptr + 4 * stride_s + offs, mask=mask, other=0.0)
            p5 = tl.load(p_ptr + 5 * stride_s + offs, mask=mask, other=0.0)
            p6 = tl.load(p_ptr + 6 * stride_s + offs, mask=mask, other=0.0)
            p7 = tl.load(p_ptr + 7 * stride_s + offs, mask=mask, other=0.0)
            r = r + ((p4 + p5) + (p6 + p7))
    tl.store(y_ptr + offs, r.to(y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------- constants
def tiles_for(cfg, dtype: torch.dtype, leaf: bool = False) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) pinned by ``cfg`` (``isoexec.config.TritonSection``) for inputs
    of ``dtype``; ``leaf`` selects the leaf GEMM's tiles (``pik_gemm_*``).

    Raises:
        ValueError: no tiles are pinned for ``dtype`` (allowed: bfloat16, float16, float32).
    """
    pre = "pik_gemm_" if leaf else "gemm_"
    if dtype in (torch.bfloat16, torch.float16):
        return tuple(getattr(cfg, pre + "bfloat16"))
    if dtype == torch.float32:
        return tuple(getattr(cfg, pre + "float32"))
    raise ValueError(f"no GEMM tiles pinned for {dtype}; allowed: bfloat16, float16, float32")


def constants(cfg, dtype: torch.dtype) -> dict:
    """The column GEMM's contract constants for inputs of ``dtype`` (recorded in the composition; the
    row buckets only when some are pinned, so that a contract without them keeps its digest)."""
    bm, bn, bk, nw, ns = tiles_for(cfg, dtype)
    c = {"tile_m": bm, "tile_n": bn, "tile_k": bk, "num_warps": nw, "num_stages": ns, "group_m": cfg.gemm_group_m,
         "dot_precision": DOT_PRECISION, "split_k": 1, "k_order": "ascending", "autotune": False,
         "program": cfg.gemm_kernel if dtype != torch.float32 else "tiled"}
    if dtype != torch.float32 and cfg.gemm_bfloat16_by_rows:
        c["row_buckets"] = ";".join(f"rows<={b.max_rows}:{b.program}:{'x'.join(map(str, b.tiles[:3]))}"
                                    f":{b.tiles[3]}w:{b.tiles[4]}s" for b in cfg.gemm_bfloat16_by_rows)
    return c


def program_for(cfg, dtype: torch.dtype, rows: int) -> tuple[str, tuple[int, int, int, int, int]]:
    """(program, tiles) of a column GEMM of ``rows`` rows: fp32 always the tiled program with
    ``gemm_float32``; bf16/fp16 the first ``gemm_bfloat16_by_rows`` bucket with ``rows <= max_rows``,
    else ``gemm_kernel`` with ``gemm_bfloat16``."""
    if dtype == torch.float32:
        return "tiled", tiles_for(cfg, dtype)
    for b in cfg.gemm_bfloat16_by_rows:
        if rows <= b.max_rows:
            return b.program, tuple(b.tiles)
    return cfg.gemm_kernel, tiles_for(cfg, dtype)


def leaf_constants(cfg, dtype: torch.dtype, leaves: int) -> dict:
    """The leaf GEMM's contract constants for inputs of ``dtype`` with ``leaves`` leaves. The launch
    (``pik_split_rows``) is left out: it moves no bit (the test named in the composition proves it); the leaf-width
    buckets are recorded only when some are pinned, so that a contract without them keeps its digest."""
    bm, bn, bk, nw, ns = tiles_for(cfg, dtype, leaf=True)
    c = {"tile_m": bm, "tile_n": bn, "tile_k": bk, "num_warps": nw, "num_stages": ns, "group_m": cfg.gemm_group_m,
         "dot_precision": DOT_PRECISION, "leaves": leaves, "leaf_tree": "adjacent_pairs", "leaf_acc": "float32",
         "k_order": "ascending_within_leaf", "autotune": False}
    if dtype in (torch.bfloat16, torch.float16) and cfg.pik_bfloat16_by_leaf_k:  # tiles, as the fields above
        c["leaf_k_buckets"] = ";".join(_bucket_str(b) for b in cfg.pik_bfloat16_by_leaf_k)
    return c


def _bucket_str(b) -> str:
    """A leaf bucket in the contract, as the fields of :func:`leaf_constants`: its rows and leaf width and its tiles (the
    loop, leaves per program and top are left out, as ``pik_loop`` and ``pik_program_leaves``); ``rows<=`` only where
    set, so that the digest of a config without it stays."""
    rows = f"rows<={b.max_rows}:" if b.max_rows is not None else ""
    return f"{rows}leaf_k<={b.max_leaf_k}:{'x'.join(map(str, b.tiles[:3]))}:{b.tiles[3]}w:{b.tiles[4]}s"


def leaf_program_for(cfg, dtype: torch.dtype, leaf_k: int, rows: int, split: bool | None = None,
                     grouped: bool = False) -> tuple[str, tuple[int, int, int, int, int], int, str, str]:
    """(loop, tiles, most leaves per program, top, load) of a leaf GEMM launch of ``rows`` rows with leaves of
    ``leaf_k`` features. bf16/fp16, ``split`` None: the first ``pik_bfloat16_by_leaf_k`` bucket with ``max_rows`` that
    holds ``rows`` and ``leaf_k`` (dense launches only: ``grouped`` expert launches, whose rows are tokens x top-k over
    many experts' tiles, were not timed with them), else for ``rows > pik_split_rows`` the first bucket without
    ``max_rows`` that holds ``leaf_k``. ``split`` False (the in-register tree forced): only the latter. No bucket (fp32,
    ``split`` True, or none holds the launch): ``pik_loop``, the ``pik_gemm_*`` tiles, one leaf per program for
    ``split`` or ``rows <= pik_split_rows`` else ``pik_program_leaves``, ``"combine"`` and ``"pointer"``."""
    if split is not True and dtype in (torch.bfloat16, torch.float16):
        buckets = cfg.pik_bfloat16_by_leaf_k
        hit = [b for b in buckets if b.max_rows is not None and rows <= b.max_rows and leaf_k <= b.max_leaf_k
               and not grouped]
        if split is None and hit:
            b = hit[0]
        else:
            tree = split is False or rows > cfg.pik_split_rows
            b = next((b for b in buckets if b.max_rows is None and leaf_k <= b.max_leaf_k), None) if tree else None
        if b is not None:
            return b.loop, tuple(b.tiles), b.program_leaves, b.top, b.load
    one = split is True or (split is None and rows <= cfg.pik_split_rows)
    return cfg.pik_loop, tiles_for(cfg, dtype, leaf=True), 1 if one else cfg.pik_program_leaves, "combine", "pointer"


def _contig_k(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


_NUM_SMS: dict = {}


def _num_sms(device) -> int:
    idx = torch.device(device).index or 0
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


# ------------------------------------------------------------------------------------ column GEMM
def linear(x: torch.Tensor, w: torch.Tensor, cfg, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T``, batch-invariant.

    Args:
        x: ``[M, K]`` (bf16 / fp16 / fp32, CUDA). w: ``[N, K]`` (``nn.Linear`` layout; cast to x's dtype).
        cfg: ``isoexec.config.TritonSection`` (program and tiles by the number of rows,
            :func:`program_for`; fp32 inputs always run the tiled program).
        out_dtype: output dtype (default ``x.dtype``; fp32 keeps the accumulator, e.g. for logits).

    Returns:
        ``[M, N]``; row i depends only on ``x[i]`` and ``w``.
    """
    x = _contig_k(x)
    w = _contig_k(w.to(x.dtype))
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=out_dtype or x.dtype)
    if M == 0:
        return y
    program, (BM, BN, BK, nw, ns) = program_for(cfg, x.dtype, M)
    if program == "persistent_tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        if (K * x.element_size()) % 16 or x.data_ptr() % 16 or w.data_ptr() % 16:
            raise ValueError(f"persistent_tma GEMM needs 16-byte aligned rows and bases, got K={K} ({x.dtype})")
        n_tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
        sms = _num_sms(x.device)
        _gemm_tma_kernel[(min(sms, n_tiles),)](
            TensorDescriptor.from_tensor(x, [BM, BK]), TensorDescriptor.from_tensor(w, [BN, BK]), y, M, N, K, y.stride(0),
            BM=BM, BN=BN, BK=BK, GM=cfg.gemm_group_m, NUM_SMS=sms, PREC=DOT_PRECISION, num_warps=nw, num_stages=ns)
        return y
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _gemm_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), 0, x, x, x, 0,
                       GROUPED=False, BM=BM, BN=BN, BK=BK, GM=cfg.gemm_group_m, PREC=DOT_PRECISION,
                       num_warps=nw, num_stages=ns)
    return y


def _group_tiles(counts: torch.Tensor, bm: int, rows: int) -> torch.Tensor:
    """The grouped GEMM's tile table, built on ``counts``' device by a dozen small torch ops of static shapes with no
    host read (CUDA-graph capturable; no ``.item()``, ``.tolist()`` or data-dependent shape).

    Args:
        counts: ``[E]`` integer tensor (any device), rows per expert (each >= 0, sum ``rows``; not checked,
            which would sync). bm: rows per tile (BM). rows: R, the number of rows (host int, ``x.shape[0]``).

    Returns:
        ``[3, T]`` int32 on ``counts.device``, columns (expert, first row, end of that expert's rows), with the
        static ``T = rows // bm + min(E, rows)``. The real tiles come first: for expert e ascending, its rows in
        blocks of ``bm`` ascending (an expert with no rows has none). The ``T - n_real`` padding tiles after
        them are empty: first row = end = ``rows``, expert ``E - 1`` (a weight pointer in range).

        T bounds the real count: expert e has ``n_e = ceil(c_e / bm) <= floor(c_e / bm) + [c_e > 0]`` tiles;
        ``sum_e floor(c_e / bm) <= floor(sum_e c_e / bm) = rows // bm`` (floor is superadditive), and at most
        ``min(E, rows)`` experts have a row, so ``n_real <= rows // bm + min(E, rows) = T``.

        How: pad each expert's rows to ``n_e * bm`` with ``p_e = (-c_e) mod bm`` rows; tile t covers the padded
        rows from ``s = t * bm``, which belong to the first expert whose padded end ``end_e + P_e`` (``P``: the
        inclusive sum of p) exceeds s, whose real first row is ``s - (P_e - p_e)``. Tiles past the last padded
        end search only the first E - 1 ends, so they get expert E - 1 and a first row at or past its end
        ``rows``, clipped to it.

    Raises:
        ValueError: ``counts`` not a 1-D integer tensor, no expert for ``rows > 0``, ``bm < 1``, or row
            indices past int32.
    """
    if counts.dim() != 1 or counts.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        raise ValueError(f"counts must be a 1-D integer tensor of rows per expert, got {counts.dtype} {tuple(counts.shape)}")
    E = counts.shape[0]
    if bm < 1 or (rows > 0 and E == 0) or rows + min(E, rows) * bm >= 2**31:  # the last bounds T * bm
        raise ValueError(f"grouped GEMM tiles need bm >= 1, an expert for the rows and int32 rows, got bm={bm}, "
                         f"E={E}, rows={rows}")
    T = rows // bm + min(E, rows)
    i32 = dict(dtype=torch.int32, device=counts.device)
    c = counts.to(torch.int32)
    pad = c.neg().remainder_(bm)  # [E] rows that fill each expert's last tile
    ends = c.cumsum(0, dtype=torch.int32)  # [E] end row of each expert
    skip = pad.cumsum(0, dtype=torch.int32)  # [E] padding rows up to each expert's end
    table = torch.empty((3, T), **i32)
    s = torch.arange(0, T * bm, bm, **i32)  # [T] first padded row of each tile
    torch.searchsorted((ends + skip)[:-1], s, right=True, out_int32=True, out=table[0])
    torch.index_select(ends, 0, table[0], out=table[2])
    torch.sub(s, (skip - pad).index_select(0, table[0]), out=table[1])
    torch.minimum(table[1], table[2], out=table[1])
    return table


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, cfg,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-expert ``x[rows_e] @ w[e].T`` for rows grouped by expert (``moe.experts``), one launch, no host sync.

    Args:
        x: ``[R, K]`` (bf16 / fp16 / fp32, CUDA) rows sorted by expert. w: ``[E, N, K]`` stacked expert weights.
        counts: ``[E]`` integer tensor on x's device, rows per expert (sum R; not checked, which would sync).
        cfg: ``isoexec.config.TritonSection``. out_dtype: output dtype (default ``x.dtype``).

    Returns:
        ``[R, N]``; each row depends only on itself and its expert's weight (same tile program as
        the tiled :func:`linear`, so the same per-row order whatever the expert's row count). The grid is
        ``T * cdiv(N, BN)`` programs for the static T of :func:`_group_tiles`.

    Raises:
        ValueError: counts not an ``[E]`` integer tensor on x's device (:func:`_check_counts`, :func:`_group_tiles`).
    """
    x = _contig_k(x)
    w = w.to(x.dtype).contiguous()
    R, K = x.shape
    E, N, _ = w.shape
    y = torch.empty((R, N), device=x.device, dtype=out_dtype or x.dtype)
    BM, BN, BK, nw, ns = tiles_for(cfg, x.dtype)
    counts = _check_counts(counts, x, w)
    if not R:
        return y
    meta = _group_tiles(counts, BM, R)
    n_t = meta.shape[1]
    grid = (n_t * triton.cdiv(N, BN),)
    _gemm_kernel[grid](x, w, y, R, N, K, x.stride(0), w.stride(1), y.stride(0), w.stride(0), meta[0], meta[1], meta[2],
                       n_t, GROUPED=True, BM=BM, BN=BN, BK=BK, GM=cfg.gemm_group_m, PREC=DOT_PRECISION,
                       num_warps=nw, num_stages=ns)
    return y


def _check_counts(counts: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``counts`` itself, checked (host metadata only, no sync) to be a ``[E]`` tensor on x's device for
    the ``[E, N, K]`` weight ``w`` (a host list or a tensor elsewhere would need a copy).

    Raises:
        ValueError: counts is not a tensor on ``x.device`` of ``w.shape[0]`` elements.
    """
    if not isinstance(counts, torch.Tensor) or counts.device != x.device or counts.shape != w.shape[:1]:
        got = f"{tuple(counts.shape)} on {counts.device}" if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"grouped GEMM counts must be a [{w.shape[0]}] integer tensor on {x.device}, got {got}")
    return counts


# -------------------------------------------------------------------------------------- leaf GEMM
def _check_leaves(K: int, leaves: int) -> int:
    if leaves < 1 or leaves & (leaves - 1) or leaves > 8:
        raise ValueError(f"leaves must be a power of two in 1..8 (fixed binary tree of the leaf GEMM), got leaves={leaves}")
    if K % leaves:
        raise ValueError(f"K={K} is not divisible by leaves={leaves}: the leaves are equal contiguous K ranges")
    return K // leaves


def tree_combine(parts: torch.Tensor, out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum ``parts[0..S)`` by the fixed adjacent-pairs binary tree in fp32 and round once to ``out_dtype``.

    Args:
        parts: ``[S, ...]`` fp32 partials (S in {1, 2, 4, 8}), contiguous.
        out_dtype: output dtype. out: optional preallocated output of shape ``parts.shape[1:]``.

    Returns:
        ``parts.shape[1:]`` in ``out_dtype``: ``((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))`` for S = 8, the same
        tree truncated for S < 8.

    Raises:
        ValueError: S not in {1, 2, 4, 8} or parts not fp32.
    """
    S = parts.shape[0]
    if S not in (1, 2, 4, 8) or parts.dtype != torch.float32:
        raise ValueError(f"tree_combine needs fp32 parts [S, ...] with S in 1, 2, 4, 8; got {S} parts of {parts.dtype}")
    parts = parts.contiguous()
    y = out if out is not None else torch.empty(parts.shape[1:], device=parts.device, dtype=out_dtype)
    n = y.numel()
    if n:
        block = 2048
        _tree_combine_kernel[(triton.cdiv(n, block),)](parts, y, n, parts[0].numel(), S=S, BLOCK=block, num_warps=8)
    return y


def tma_readable(leaf_k: int, BK: int, *ts: torch.Tensor) -> bool:
    """Whether TMA reads the leaves of the 2-D operands ``ts`` as the pointer loads do: a leaf width that is a multiple
    of BK (else a step would read the next leaf), and rows and bases 16-byte aligned (TMA's rule). The one check of
    the Triton and the Gluon leaf programs' TMA loads."""
    return not leaf_k % BK and not any(t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16 for t in ts)


def _tma_descriptors(x, w, leaf_k: int, BM: int, BN: int, BK: int):
    """(x, weight) host TMA descriptors of the leaf GEMM's ``[BM, BK]`` and ``[BN, BK]`` tiles, over x ``[R, K]`` and
    w ``[N, K]`` (or ``[E, N, K]`` seen as ``[E * N, K]``), or None where :func:`tma_readable` says no."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    w2 = w.reshape(-1, w.shape[-1]) if w.dim() == 3 else w
    if not tma_readable(leaf_k, BK, x, w2):
        return None
    return TensorDescriptor.from_tensor(x, [BM, BK]), TensorDescriptor.from_tensor(w2, [BN, BK])


def _launch_leaves(x, w, y, counts, cfg, leaf_k: int, lpp: int, n_sub: int, loop: str, tiles, top: bool = False,
                   load: str = "pointer"):
    """One leaf-GEMM launch: programs (tile, subtree) over ``n_sub`` subtrees of ``lpp`` leaves, with ``loop``,
    ``tiles`` and ``load`` of :func:`leaf_program_for` (``"tma"``: pointer loads where :func:`_tma_descriptors` gives
    none; loop ``"gluon_pipelined"``: :func:`isoexec.kernels.gemm.gluon_leaf.launch` where it applies, else the paired
    loop, with TMA loads for bf16 / fp16); y is ``[n_sub, R, N]`` (or ``[R, N]`` when n_sub == 1 or ``top``: the
    n_sub = 2 or 4 subtrees added in the kernel). ``counts``: None (w ``[N, K]``), or the ``[E]`` integer rows per
    expert on x's device (w ``[E, N, K]``), whose grid has the static T of :func:`_group_tiles`."""
    BM, BN, BK, nw, ns = tiles
    R = x.shape[0]
    N = w.shape[-2]
    kpl = triton.cdiv(leaf_k, BK)
    loop = loop if lpp > 1 else "unrolled"
    if counts is None:
        n_t, meta, stride_w, stride_we = 0, (x, x, x), w.stride(0), 0
        n_tiles = triton.cdiv(R, BM) * triton.cdiv(N, BN)
    else:
        meta = _group_tiles(_check_counts(counts, x, w), BM, R)
        n_t, stride_w, stride_we = meta.shape[1], w.stride(1), w.stride(0)
        n_tiles = n_t * triton.cdiv(N, BN)
    if top:  # tile t's n_sub subtrees are programs n_sub * t + s; the left nodes go through part, their flags say when
        if n_sub not in (2, 4):
            raise ValueError(f"leaf GEMM: the in-kernel top adds 2 or 4 subtrees per tile, got {n_sub}")
        part = torch.empty((n_tiles, n_sub - 1, BM, BN), device=x.device, dtype=torch.float32)
        flag = torch.zeros((n_tiles * (n_sub - 1),), device=x.device, dtype=torch.int32)
        grid = (n_sub * n_tiles,)
    else:
        part, flag, grid = x, x, (n_tiles, n_sub)
    if loop == "gluon_pipelined":  # dense bf16 / fp16 TMA launches; else the paired loop (same bits)
        from isoexec.kernels.gemm import gluon_leaf

        if counts is None and gluon_leaf.launch(x, w, y, part, flag, leaf_k, lpp, grid, n_sub if top else 0, tiles,
                                                cfg.gemm_group_m):
            return
        loop, load = "paired", "tma" if x.dtype in (torch.bfloat16, torch.float16) else "pointer"
    descs = _tma_descriptors(x, w, leaf_k, BM, BN, BK) if load == "tma" else None
    _leaf_gemm_kernel[grid](x, w, y, part, flag, R, N, x.stride(0), stride_w, N, stride_we, R * N, meta[0], meta[1],
                            meta[2], n_t, kpl, *(descs or (None, None)), LEAF_K=leaf_k, LPP=lpp, LOOP=loop,
                            GROUPED=counts is not None, TOP=n_sub if top else 0, BM=BM, BN=BN, BK=BK, GM=cfg.gemm_group_m,
                            PREC=DOT_PRECISION, TMA=descs is not None, num_warps=nw, num_stages=ns)


def _launch_all(x, w, counts, cfg, leaf_k: int, leaves: int, split: bool | None, alloc, out_dtype, out=None):
    """The leaf sums of ``leaves`` leaves with :func:`leaf_program_for`'s program (``split``: True one leaf per program,
    False the in-register tree, None by the rows); subtree sums of fewer than ``leaves`` through an fp32 buffer, the
    upper levels by :func:`tree_combine` (into ``out`` if given), or, for two or four subtrees with ``top``
    ``"in_kernel"``, in the leaf kernel."""
    R, N = x.shape[0], w.shape[-2]
    loop, tiles, cap, top, load = leaf_program_for(cfg, x.dtype, leaf_k, R, True if leaves == 1 else split,
                                                   counts is not None)
    lpp = min(leaves, cap)
    if lpp < leaves and not (top == "in_kernel" and leaves in (2 * lpp, 4 * lpp)):
        parts = alloc((leaves // lpp, R, N), device=x.device, dtype=torch.float32)
        _launch_leaves(x, w, parts, counts, cfg, leaf_k, lpp, leaves // lpp, loop, tiles, load=load)
        return tree_combine(parts, out_dtype, out=out)
    y = out if out is not None else alloc((R, N), device=x.device, dtype=out_dtype)
    _launch_leaves(x, w, y, counts, cfg, leaf_k, lpp, leaves // lpp, loop, tiles, top=lpp < leaves, load=load)
    return y


def _leaves(x, w, counts, cfg, leaves, out_dtype, split: bool | None):
    """:func:`linear_leaves` (``counts`` None) or :func:`grouped_linear_leaves` (``counts`` the ``[E]`` rows per
    expert on x's device)."""
    x = _contig_k(x)
    w = w.to(x.dtype).contiguous()
    R, K = x.shape
    N = w.shape[-2]
    leaf_k = _check_leaves(K, leaves)
    od = out_dtype or x.dtype
    if R == 0:
        return torch.empty((R, N), device=x.device, dtype=od)
    alloc = torch.zeros if counts is not None else torch.empty  # grouped tiles may leave rows of empty experts
    return _launch_all(x, w, counts, cfg, leaf_k, leaves, split, alloc, od)


def linear_leaves(x: torch.Tensor, w: torch.Tensor, cfg, leaves: int, out_dtype: torch.dtype | None = None,
                  split: bool | None = None) -> torch.Tensor:
    """``x @ w.T`` of a row-parallel region as ``leaves`` leaf GEMMs added by the fixed tree (pik at TP=1).

    Bitwise equal to :func:`isoexec.kernels.collectives.triton.pik_row_parallel_linear` over K shards at
    every TP dividing ``leaves``; batch-invariant (row i depends only on ``x[i]`` and ``w``).

    Args:
        x: ``[M, K]`` (bf16 / fp16 / fp32, CUDA). w: ``[N, K]`` (``nn.Linear`` layout; cast to x's dtype).
        cfg: ``isoexec.config.TritonSection`` (``pik_gemm_*`` tiles, ``pik_split_rows``).
        leaves: G, a power of two in 1..8 dividing K (contract constant ``kernels.leaves``).
        out_dtype: output dtype (default ``x.dtype``); the fp32 tree sum is rounded once.
        split: force the one-leaf-per-program launch (True) or the in-register tree (False); None lets the rows
            pick (:func:`leaf_program_for`). The bits are the same either way.

    Returns:
        ``[M, N]`` in ``out_dtype``.

    Raises:
        ValueError: ``leaves`` not a power of two in 1..8, or K not divisible by ``leaves``.
    """
    return _leaves(x, w, None, cfg, leaves, out_dtype, split)


def grouped_linear_leaves(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, cfg, leaves: int,
                          out_dtype: torch.dtype | None = None, split: bool | None = None) -> torch.Tensor:
    """:func:`grouped_linear` of a row-parallel region (expert ``down_proj``) as leaf GEMMs, no host sync.

    Args:
        x: ``[R, K]`` rows sorted by expert. w: ``[E, N, K]``. counts: ``[E]`` integer tensor on x's device,
            rows per expert (sum R), as :func:`grouped_linear`.
        cfg, leaves, out_dtype, split: as in :func:`linear_leaves`.

    Returns:
        ``[R, N]``; each row bitwise equal to :func:`linear_leaves` of that row with its expert's weight.

    Raises:
        ValueError: as :func:`linear_leaves` and :func:`grouped_linear`.
    """
    return _leaves(x, w, counts, cfg, leaves, out_dtype, split)


def linear_leaves_partial(x_shard: torch.Tensor, w_shard: torch.Tensor, cfg, leaves_local: int,
                          out: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """One TP rank's subtree sum of a row-parallel GEMM, fp32, in one launch (no communication).

    Args:
        x_shard: ``[M, K/tp]`` the rank's contiguous K slice. w_shard: ``[N, K/tp]`` the same slice of the
            weight, or ``[E, N, K/tp]`` with ``counts`` (the grouped expert ``down_proj`` of an expert-TP rank).
        cfg: ``isoexec.config.TritonSection``. leaves_local: G/tp, the leaves this rank owns.
        out: optional fp32 ``[M, N]`` to write into (e.g. this rank's slot of the all-gather buffer).
        counts: ``[E]`` integer rows per expert on x's device (sum M; rows sorted by expert), as
            :func:`grouped_linear_leaves`.

    Returns:
        ``[M, N]`` fp32: the rank's ``leaves_local`` leaf partials added in the tree order (grouped: each
        row with its expert's weight).
    """
    x = _contig_k(x_shard)
    w = w_shard.to(x.dtype).contiguous()
    leaf_k = _check_leaves(x.shape[1], leaves_local)
    alloc = torch.zeros if counts is not None else torch.empty
    y = out if out is not None else alloc((x.shape[0], w.shape[-2]), device=x.device, dtype=torch.float32)
    if x.shape[0]:
        _launch_all(x, w, counts, cfg, leaf_k, leaves_local, None, alloc, torch.float32, out=y)
    return y


# ---------------------------------------------------------------------------------------- autograd
def _ref_linear(od):
    """The native stack's linear (:func:`isoexec.kernels.gemm.native.native_linear`: cuBLAS in the activation dtype,
    then cast to ``od``), whose gradient the isoexec GEMMs take. With ``od`` fp32 (``lm_head``) the gradient is the
    native one (the output gradient rounded to the activation dtype, two tensor-core GEMMs), not fp32 GEMMs of the
    upcast operands, which ran on the CUDA cores and took 487 of ``trainer_fwd_bwd``'s 995 ms at h200-rlstep
    (results/h200/subtrees_fc369b6_h100/, results/h200/native_grads_scan_da592ec_h100/)."""
    return lambda a, b: native_linear(a, b, out_dtype=od)


def linear_autograd(x: torch.Tensor, w: torch.Tensor, cfg, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`linear` with a gradient (``trainer_fwd``): the forward is the Triton kernel's bits, the
    backward that of the native ``F.linear`` (cuBLAS) on the same inputs (:func:`_ref_linear`,
    :func:`~isoexec.kernels.autograd.with_ref_grad`)."""
    od = out_dtype or x.dtype
    return with_ref_grad(lambda a, b: linear(a, b, cfg, od), _ref_linear(od), x, w)


def linear_leaves_autograd(x: torch.Tensor, w: torch.Tensor, cfg, leaves: int,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`linear_leaves` with the gradient of the native ``F.linear`` (the forward bits are the leaf GEMM's)."""
    od = out_dtype or x.dtype
    return with_ref_grad(lambda a, b: linear_leaves(a, b, cfg, leaves, od), _ref_linear(od), x, w)
