"""Batch-invariant Triton GEMM for Hopper (regions ``*.proj``, ``moe.router``, ``moe.experts``,
``mlp.shared_expert``, ``lm_head``).

``y[i] = x[i] @ w.T``: every output tile is computed by one program with fixed tiles
``(BM, BN, BK)`` (contract constants, never chosen from M), the K loop runs from 0 upwards with
fp32 accumulation, and there is no split-K. Each output element's reduction order is therefore that
of one fixed instruction sequence, whatever the number of rows, the row's position in its tile or
the other rows (masked rows load zeros and are never stored). The grouped variant (``moe.experts``)
runs the same tile program over per-expert row ranges.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from isoexec.kernels.autograd import with_ref_grad

DOT_PRECISION = "ieee"  # bf16 x bf16 -> fp32 on the tensor cores; fp32 as a true fp32 dot (no tf32)


@triton.jit(do_not_specialize=["M", "n_tiles"])  # M varies with the batch; N, K are weight shapes
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_we,
                 tile_e_ptr, tile_r0_ptr, tile_r1_ptr, n_tiles,
                 GROUPED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GM: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    n_tn = tl.cdiv(N, BN)
    if GROUPED:
        pid_m = pid // n_tn
        pid_n = pid % n_tn
        e = tl.load(tile_e_ptr + pid_m).to(tl.int64)
        r0 = tl.load(tile_r0_ptr + pid_m)
        r1 = tl.load(tile_r1_ptr + pid_m)
        w_ptr = w_ptr + e * stride_we
    else:
        n_tm = tl.cdiv(M, BM)
        width = GM * n_tn
        gid = pid // width
        first = gid * GM
        gsz = tl.minimum(n_tm - first, GM)
        pid_m = first + (pid % width) % gsz
        pid_n = (pid % width) // gsz
        r0 = pid_m * BM
        r1 = M
    rows = r0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < r1
    cmask = cols < N
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < K
        a = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


def tiles_for(cfg, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) pinned by ``cfg`` (``isoexec.config.TritonSection``) for inputs of ``dtype``.

    Raises:
        ValueError: no tiles are pinned for ``dtype`` (allowed: bfloat16, float16, float32).
    """
    if dtype in (torch.bfloat16, torch.float16):
        return tuple(cfg.gemm_bfloat16)
    if dtype == torch.float32:
        return tuple(cfg.gemm_float32)
    raise ValueError(f"no GEMM tiles pinned for {dtype}; allowed: bfloat16, float16, float32")


def constants(cfg, dtype: torch.dtype) -> dict:
    """The GEMM's contract constants for inputs of ``dtype`` (recorded in the composition)."""
    bm, bn, bk, nw, ns = tiles_for(cfg, dtype)
    return {"tile_m": bm, "tile_n": bn, "tile_k": bk, "num_warps": nw, "num_stages": ns, "group_m": cfg.gemm_group_m,
            "dot_precision": DOT_PRECISION, "split_k": 1, "k_order": "ascending", "autotune": False}


def _contig_k(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def linear(x: torch.Tensor, w: torch.Tensor, cfg, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T``, batch-invariant.

    Args:
        x: ``[M, K]`` (bf16 / fp16 / fp32, CUDA). w: ``[N, K]`` (``nn.Linear`` layout; cast to x's dtype).
        cfg: ``isoexec.config.TritonSection`` (the tiles, :func:`tiles_for`).
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
    BM, BN, BK, nw, ns = tiles_for(cfg, x.dtype)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _gemm_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), 0, x, x, x, 0,
                       GROUPED=False, BM=BM, BN=BN, BK=BK, GM=cfg.gemm_group_m, PREC=DOT_PRECISION,
                       num_warps=nw, num_stages=ns)
    return y


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: list[int], cfg,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-expert ``x[rows_e] @ w[e].T`` for rows grouped by expert (``moe.experts``), one launch.

    Args:
        x: ``[R, K]`` rows sorted by expert. w: ``[E, N, K]`` stacked expert weights.
        counts: rows per expert (host ints, sum R). cfg: ``isoexec.config.TritonSection``.

    Returns:
        ``[R, N]``; each row depends only on itself and its expert's weight (same tile program as
        :func:`linear`, so the same per-row order whatever the expert's row count).
    """
    x = _contig_k(x)
    w = w.to(x.dtype).contiguous()
    R, K = x.shape
    E, N, _ = w.shape
    y = torch.empty((R, N), device=x.device, dtype=out_dtype or x.dtype)
    BM, BN, BK, nw, ns = tiles_for(cfg, x.dtype)
    te, t0, t1 = [], [], []
    r = 0
    for e, c in enumerate(counts):
        for s in range(0, c, BM):
            te.append(e)
            t0.append(r + s)
            t1.append(r + c)
        r += c
    if not te:
        return y
    meta = torch.tensor([te, t0, t1], dtype=torch.int32).to(x.device, non_blocking=True)
    grid = (len(te) * triton.cdiv(N, BN),)
    _gemm_kernel[grid](x, w, y, R, N, K, x.stride(0), w.stride(1), y.stride(0), w.stride(0), meta[0], meta[1], meta[2],
                       len(te), GROUPED=True, BM=BM, BN=BN, BK=BK, GM=cfg.gemm_group_m, PREC=DOT_PRECISION,
                       num_warps=nw, num_stages=ns)
    return y


def linear_autograd(x: torch.Tensor, w: torch.Tensor, cfg, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`linear` with a gradient (``trainer_fwd``): the forward is the Triton kernel's bits, the
    backward that of ``F.linear`` (cuBLAS) on the same inputs (:func:`~isoexec.kernels.autograd.with_ref_grad`)."""
    od = out_dtype or x.dtype

    def ref(a, b):
        if od == torch.float32:
            return F.linear(a.float(), b.float())
        return F.linear(a, b.to(a.dtype)).to(od)

    return with_ref_grad(lambda a, b: linear(a, b, cfg, od), ref, x, w)
