"""The leaf GEMM (:mod:`isoexec.kernels.gemm.triton`'s tree, the same bits) as a Gluon program for Hopper (sm90) that
keeps the tensor cores busy across leaf boundaries.

The Triton loops wait for a leaf's (or a pair's) last tensor-core dot before the tree addition and only then issue
the next leaf's first dot, so every leaf (pair) drains the wgmma pipeline (``results/h200/leaf_gemm/``: 36-59% of
cuBLAS at trainer shapes). Here the wgmma waits are explicit (Gluon, ``triton.experimental.gluon``): the program
alternates two fp32 accumulators between consecutive leaves, issues leaf j's first wgmma (``use_acc=False``: from
zero, as every leaf starts) and only then waits for all but that one group (``warpgroup_mma_wait(1)``), so leaf
j - 1's accumulator is complete and climbs the tree while leaf j's first step runs. The operand tiles stream
through a ring of ``STAGES`` shared-memory buffers filled by TMA (one mbarrier per buffer), across leaf
boundaries; a buffer is refilled once the wgmma that read it is waited for.

Per output element the additions are the Triton kernel's: each leaf accumulates its K steps of BK in ascending
order in fp32 on the tensor cores from zero, and the leaves climb the same adjacent-pairs tree (a binary counter
over the program's LPP leaves, unrolled: LPP is a compile-time constant). BM, BN, warps and stages move no bit;
BK and the tree do (BK is ``pik_gemm_bfloat16``'s, as for every bucket).

A Gluon kernel cannot call the Triton kernel's ``triton.jit`` helpers (Triton 3.6: their layouts have no warp count
in a Gluon module), so the program-to-tile mapping, the swizzle, the tree's binary counter and the in-kernel top are
written again here, in Gluon, with the same arithmetic.

Measured on one H100 (``results/h200/gluon_efcb779_h100/``, ``results/h200/counters_15762cc_h100/``): bitwise equal
to the Triton programs everywhere; its leaf kernel 1.15x the configured Triton one at 512-wide leaves, but 0.70-0.86x
overall at trainer shapes, where two leaves per program (its register budget at 128x128) left the tree's top to
``tree_combine``; with ``top: in_kernel`` it now adds up to two top levels itself. No config pins it.

Scope: bf16 / fp16 dense launches whose leaf width is a multiple of BK, with 16-byte aligned rows (the TMA rules);
the caller (:func:`isoexec.kernels.gemm.triton._launch_leaves`) runs the Triton ``paired`` loop at the same tiles
for anything else (grouped expert launches, other widths, fp32). Source of the pipelining pattern: the Gluon
tutorials of Triton (``python/tutorials/gluon/05-wgmma.py``, TMA ring + async wgmma), Triton 3.6.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# a CTA-wide barrier: ``gl.thread_barrier`` in Triton 3.6 (the GPU nodes' stack), renamed ``gl.barrier`` in 3.7
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.constexpr_function
def _warps_per_cta(BM, num_warps):
    """wgmma's warp grid: the [4, 1] atom doubled along M while M has rows for it (16 per warp), then along N."""
    if num_warps not in (4, 8):  # the config refuses others (isoexec.config.TritonSection)
        raise ValueError(f"gluon_pipelined: num_warps={num_warps}; allowed: 4 or 8 (whole warp groups)")
    w = [4, 1]
    while w[0] * w[1] != num_warps:
        if BM > 16 * w[0]:
            w[0] *= 2
        else:
            w[1] *= 2
    return w


@gluon.constexpr_function
def _instr_n(BM, BN, num_warps):
    """The widest wgmma N (a multiple of 8, at most 256) that divides BN and each warp column's share of it."""
    n_reps = triton.cdiv(num_warps, triton.cdiv(BM, 16))
    max_n = max(BN // n_reps, 8)
    n = 256
    while n > max_n or BN % n:
        n -= 8
    return n


@gluon.jit
def _load_step(x_desc, w_desc, bars, a_bufs, b_bufs, t, kpl, k_base, off_m, off_n,
               LEAF_K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """TMA the x and weight tiles of the program's K step ``t`` (leaf ``t // kpl``) into ring buffer ``t % STAGES``."""
    s = t % STAGES
    j = t // kpl
    k = k_base + j * LEAF_K + (t - j * kpl) * BK
    bar = bars.index(s)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, a_bufs.index(s))
    tma.async_copy_global_to_shared(w_desc, [off_n, k], bar, b_bufs.index(s))


@gluon.jit
def _leaf(acc, x_desc, w_desc, bars, a_bufs, b_bufs, t0, total, kpl, k_base, off_m, off_n,
          LEAF_K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """Issue the K steps ``t0 + 1 .. t0 + kpl - 1`` of the leaf whose first step ``t0`` the caller issued into
    ``acc``, each after its buffer's TMA arrived, keeping one wgmma group in flight and refilling the buffer the
    previous step read. Returns the accumulator, its last wgmma still in flight."""
    for t in range(t0 + 1, t0 + kpl):
        s = t % STAGES
        mbarrier.wait(bars.index(s), (t // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=True, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if t + STAGES - 1 < total:
            _load_step(x_desc, w_desc, bars, a_bufs, b_bufs, t + STAGES - 1, kpl, k_base, off_m, off_n, LEAF_K, BK,
                       STAGES)
    return acc


@gluon.jit
def _first_step(acc, other, x_desc, w_desc, bars, a_bufs, b_bufs, t, total, kpl, k_base, off_m, off_n,
                LEAF_K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """Issue a leaf's first K step ``t`` into ``acc`` from zero (``use_acc=False``), then wait for every wgmma group
    but this one, so ``other`` (the previous leaf's accumulator, passed through the wait) is complete. Refill the
    buffer step t - 1 read. Returns (acc, its wgmma in flight; other, complete)."""
    s = t % STAGES
    mbarrier.wait(bars.index(s), (t // STAGES) & 1)
    acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=False, is_async=True)
    acc, other = warpgroup_mma_wait(num_outstanding=1, deps=(acc, other))
    if t + STAGES - 1 < total:
        _load_step(x_desc, w_desc, bars, a_bufs, b_bufs, t + STAGES - 1, kpl, k_base, off_m, off_n, LEAF_K, BK, STAGES)
    return acc, other


@gluon.jit
def _top_publish(blk, flag_ptr, slot, node, BLOCK: gl.constexpr):
    """Store ``node`` to the in-kernel top's block ``slot`` (``blk``: block 0's element pointers) and release flag
    ``slot``, as the Triton kernel's ``_top_publish``."""
    gl.store(blk + slot * BLOCK, node)
    _cta_barrier()  # every thread's part of the block is stored before the flag is released
    gl.atomic_xchg(flag_ptr + slot, 1, sem="release")


@gluon.jit
def _top_take(blk, flag_ptr, slot, BLOCK: gl.constexpr):
    """Wait for flag ``slot`` (acquire), then load block ``slot`` past L1, as the Triton kernel's ``_top_take``."""
    while gl.atomic_cas(flag_ptr + slot, 1, 1, sem="acquire") != 1:
        pass
    return gl.load(blk + slot * BLOCK, cache_modifier=".cg")


@gluon.jit
def _leaf_gemm_gluon_kernel(x_desc, w_desc, y_ptr, part_ptr, flag_ptr, M, N, stride_ym, stride_ys, kpl,
                            LEAF_K: gl.constexpr, LPP: gl.constexpr, TOP: gl.constexpr, GM: gl.constexpr,
                            STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Program (tile, s): output tile ``tile`` (swizzled as the Triton kernel's) summed over subtree s of LPP leaves
    (K offset ``s * LPP * LEAF_K``), stored in fp32 or rounded to y's dtype in plane s of y (``stride_ys``); with
    ``TOP`` 2 or 4 the Triton kernel's in-kernel top (programs TOP * t + s of a 1-D grid are tile t's subtrees; each
    left node's fp32 sum goes through ``part_ptr``, released by its flag, and its right sibling adds ``left + right``:
    :mod:`isoexec.kernels.gemm.triton`, ``_top_publish``)."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    if TOP > 0:
        tile = gl.program_id(0) // TOP
        sub = gl.program_id(0) % TOP
    else:
        tile = gl.program_id(0)
        sub = gl.program_id(1)
    n_tm = gl.cdiv(M, BM)
    width = GM * gl.cdiv(N, BN)
    first = (tile // width) * GM
    gsz = gl.minimum(n_tm - first, GM)
    off_m = (first + (tile % width) % gsz) * BM
    off_n = ((tile % width) // gsz) * BN
    k_base = sub * (LPP * LEAF_K)
    total = LPP * kpl

    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=_warps_per_cta(BM, num_warps),
                                                     instr_shape=[16, _instr_n(BM, BN, num_warps), 16])
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        if i < total:
            _load_step(x_desc, w_desc, bars, a_bufs, b_bufs, i, kpl, k_base, off_m, off_n, LEAF_K, BK, STAGES)

    # leaves 2p (acc0) and 2p + 1 (acc1); a leaf's partial climbs once the next leaf's first wgmma is issued:
    # level-0 node n0 = l(2p) + l(2p+1), level 1 n1 = n0(p even) + n0(p odd), level 2 the sum of two level-1 nodes
    acc0 = gl.zeros([BM, BN], gl.float32, layout)
    acc1 = gl.zeros([BM, BN], gl.float32, layout)
    s1 = gl.zeros([BM, BN], gl.float32, layout)
    s2 = gl.zeros([BM, BN], gl.float32, layout)
    root = gl.zeros([BM, BN], gl.float32, layout)
    for p in gl.static_range(LPP // 2):
        t = 2 * p * kpl
        acc0, acc1 = _first_step(acc0, acc1, x_desc, w_desc, bars, a_bufs, b_bufs, t, total, kpl, k_base, off_m,
                                 off_n, LEAF_K, BK, STAGES)
        if p > 0:  # leaf 2p - 1 (acc1) is complete: the previous pair's node climbs
            n0 = pending + acc1  # noqa: F821 (pending: leaf 2p - 2's partial, set below in the previous pair)
            if LPP == 2:
                root = n0
            elif (p - 1) % 2 == 0:
                s1 = n0
            else:
                n1 = s1 + n0
                if LPP == 4:
                    root = n1
                elif (p - 1) // 2 % 2 == 0:
                    s2 = n1
                else:
                    root = s2 + n1
        acc0 = _leaf(acc0, x_desc, w_desc, bars, a_bufs, b_bufs, t, total, kpl, k_base, off_m, off_n,
                     LEAF_K, BK, STAGES)
        acc1, acc0 = _first_step(acc1, acc0, x_desc, w_desc, bars, a_bufs, b_bufs, t + kpl, total, kpl, k_base,
                                 off_m, off_n, LEAF_K, BK, STAGES)
        pending = acc0  # leaf 2p is complete; it waits for leaf 2p + 1
        acc1 = _leaf(acc1, x_desc, w_desc, bars, a_bufs, b_bufs, t + kpl, total, kpl, k_base, off_m, off_n,
                     LEAF_K, BK, STAGES)
    acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1,))
    n0 = pending + acc1  # the last pair
    p_last: gl.constexpr = LPP // 2 - 1
    if LPP == 2:
        root = n0
    elif p_last % 2 == 0:
        s1 = n0
    else:
        n1 = s1 + n0
        if LPP == 4:
            root = n1
        else:
            root = s2 + n1
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    r = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    rows = off_m + r
    cols = off_n + c
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    ys = y_ptr + rows.to(gl.int64)[:, None] * stride_ym + cols[None, :]
    if TOP > 0:
        blk = part_ptr + r[:, None] * BN + c[None, :]
        slot = tile.to(gl.int64) * (TOP - 1)  # the tile's first block and flag
        if sub % 2 == 0:  # a left node at level 0
            _top_publish(blk, flag_ptr, slot + sub, root, BM * BN)
        else:
            root = _top_take(blk, flag_ptr, slot + sub - 1, BM * BN) + root
            if TOP == 4:
                if sub == 1:  # p0 + p1, the left node at level 1
                    _top_publish(blk, flag_ptr, slot + 1, root, BM * BN)
                else:  # (p0 + p1) + (p2 + p3)
                    root = _top_take(blk, flag_ptr, slot + 1, BM * BN) + root
                    gl.store(ys, root.to(y_ptr.dtype.element_ty), mask=mask)
            else:
                gl.store(ys, root.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        gl.store(ys + sub.to(gl.int64) * stride_ys, root.to(y_ptr.dtype.element_ty), mask=mask)


def launch(x, w, y, part, flag, leaf_k: int, lpp: int, grid: tuple, top: int, tiles, group_m: int) -> bool:
    """Run a dense leaf GEMM launch of :func:`isoexec.kernels.gemm.triton._launch_leaves` with this program, if it
    applies: bf16 / fp16 on a Hopper GPU (compute capability 9.x: wgmma), at least two leaves per program, BM >= 64,
    4 or 8 warps, at least two stages, a leaf width that is a multiple of BK and 16-byte aligned rows and bases
    (TMA). Returns False, launching nothing, otherwise.

    Args:
        x: ``[R, K]``. w: ``[N, K]``. y: ``[n_sub, R, N]`` (or ``[R, N]``), fp32 planes or the output dtype.
        part, flag: the in-kernel top's fp32 tile partials and int32 flags (zeroed) when ``top``, else unused.
        leaf_k: features per leaf. lpp: leaves per program. grid: ``_launch_leaves``' grid ((top * tiles,) with
        ``top``, else (tiles, n_sub)). top: 0, or the 2 or 4 subtrees per tile added in the kernel.
        tiles: (BM, BN, BK, num_warps, num_stages): the stages are the TMA ring's buffers. group_m: the tile
        swizzle's group (``gemm_group_m``).
    """
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from isoexec.kernels.gemm.triton import tma_readable

    BM, BN, BK, nw, ns = tiles
    if (x.dtype not in (torch.bfloat16, torch.float16) or not x.is_cuda or lpp < 2 or ns < 2 or BM < 64
            or nw not in (4, 8) or torch.cuda.get_device_capability(x.device)[0] != 9
            or not tma_readable(leaf_k, BK, x, w)):
        return False
    g = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, gl.NVMMASharedLayout.get_default_for(block, g))

    xd, wd = desc(x, [BM, BK]), desc(w, [BN, BK])
    R, N = x.shape[0], w.shape[0]
    _leaf_gemm_gluon_kernel[grid](xd, wd, y, part, flag, R, N, N, R * N, triton.cdiv(leaf_k, BK), LEAF_K=leaf_k,
                                  LPP=lpp, TOP=top, GM=group_m, STAGES=ns, num_warps=nw)
    return True
