"""Causal GQA attention in Triton (region ``attn.core``), one kernel for prefill, chunked prefill,
decode and the trainer.

Same contract as :func:`isoexec.kernels.attention.cpu.iso_attention`: a tile holds ``BM`` rows of one
(sequence, kv head) (row r = query ``r // group``, head ``h * group + r % group``, so decode packs a
GQA group into one tile), keys are visited in fixed blocks of ``BN = kv_block`` absolute positions
from block 0 upwards, with one online-softmax update (fp32 m, l, acc; ``p`` rounded to the input
dtype for the PV product; ``p = exp2((s - m) * log2(e)/sqrt(D))`` with the running max ``m`` of the
raw scores). A block wholly after a row's position is an exact no-op for that row, so the same query
gets the same bits whatever the case, the tile it lands in, or the other sequences. Blocks that every
row of a tile sees whole skip the causal mask (a mask that removes nothing changes no value; the kernel
is compiled without FMA contraction so both loops round alike). No split-KV.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from isoexec.kernels.attention.native import native_attention
from isoexec.kernels.autograd import with_ref_grad

DOT_PRECISION = "ieee"
LOG2E = 1.4426950408889634


@triton.jit
def _attn_block(q, k_ptr, v_ptr, kv_off, h, stride_kn, stride_kh, d, blk, kv_len, pos, m, l, acc, qk_scale,
                BN: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    kpos = blk * BN + tl.arange(0, BN)
    kv_offs = (kv_off + kpos).to(tl.int64)[:, None] * stride_kn + h * stride_kh + d[None, :]
    if MASKED:
        kmask = kpos < kv_len
        kb = tl.load(k_ptr + kv_offs, mask=kmask[:, None], other=0.0)
        vb = tl.load(v_ptr + kv_offs, mask=kmask[:, None], other=0.0)
    else:
        kb = tl.load(k_ptr + kv_offs)
        vb = tl.load(v_ptr + kv_offs)
    s = tl.dot(q, tl.trans(kb), input_precision=PREC)  # raw scores; the scale enters after the max
    if MASKED:
        s = tl.where(kpos[None, :] > pos[:, None], float("-inf"), s)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp2((s - m_new[:, None]) * qk_scale)
    alpha = tl.exp2((m - m_new) * qk_scale)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PREC)
    return m_new, l, acc


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, meta_ptr, qk_scale,
                 stride_qn, stride_qh, stride_kn, stride_kh, stride_on, stride_oh,
                 GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    q_row0 = tl.load(meta_ptr + tile * 5 + 0)
    n = tl.load(meta_ptr + tile * 5 + 1)
    kv_off = tl.load(meta_ptr + tile * 5 + 2)
    start = tl.load(meta_ptr + tile * 5 + 3)
    r0 = tl.load(meta_ptr + tile * 5 + 4)
    r = r0 + tl.arange(0, BM)
    rmask = r < n * GROUP
    qi = tl.minimum(r // GROUP, n - 1)  # pad rows re-run the last query (never stored)
    head = h * GROUP + r % GROUP
    pos = start + qi
    d = tl.arange(0, D)
    q_offs = (q_row0 + qi).to(tl.int64)[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs)
    kv_len = start + n
    min_pos = start + r0 // GROUP
    max_pos = start + tl.minimum((r0 + BM - 1) // GROUP, n - 1)
    n_full = (min_pos + 1) // BN  # blocks every row of the tile sees whole: no mask needed
    n_blocks = max_pos // BN + 1
    m = tl.full((BM,), float("-inf"), tl.float32)
    l = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    for blk in range(0, n_full):
        m, l, acc = _attn_block(q, k_ptr, v_ptr, kv_off, h, stride_kn, stride_kh, d, blk, kv_len, pos, m, l, acc,
                                qk_scale, BN, False, PREC)
    for blk in range(n_full, n_blocks):
        m, l, acc = _attn_block(q, k_ptr, v_ptr, kv_off, h, stride_kn, stride_kh, d, blk, kv_len, pos, m, l, acc,
                                qk_scale, BN, True, PREC)
    out = acc / l[:, None]
    o_offs = (q_row0 + qi).to(tl.int64)[:, None] * stride_on + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


def attention(q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], starts: list[int], lengths: list[int],
              kv_block: int, block_m: int, num_warps: int = 8, num_stages: int = 2) -> torch.Tensor:
    """Blockwise causal attention over per-sequence caches.

    Args:
        q: ``[N, Hq, D]`` queries of all pieces, concatenated in order (after norm and RoPE).
        kv: per piece ``(K, V)``, each ``[start_b + n_b, Hkv, D]`` (cache + new keys).
        starts: absolute position of each piece's first query. lengths: queries per piece (sum N).
        kv_block: keys per block (absolute positions; contract ``kv_block``).
        block_m: query rows per tile (``kernels.triton.attn_block_m``).
        num_warps, num_stages: launch constants (``kernels.triton.attn_num_warps`` / ``attn_num_stages``;
            the warps fix the row reductions' layout, so they are contract constants).

    Returns:
        ``[N, Hq, D]`` in ``q.dtype``; scale ``1/sqrt(D)``.
    """
    N, hq, d = q.shape
    out = torch.empty_like(q)
    if N == 0:
        return out
    hkv = kv[0][0].shape[1]
    group = hq // hkv
    K = torch.cat([k for k, _ in kv]).to(q.dtype).contiguous()
    V = torch.cat([v for _, v in kv]).to(q.dtype).contiguous()
    q = q.contiguous()
    meta = []
    q_row0, kv_off = 0, 0
    for (k, _), s, n in zip(kv, starts, lengths):
        for r0 in range(0, n * group, block_m):
            meta.append((q_row0, n, kv_off, s, r0))
        q_row0 += n
        kv_off += k.shape[0]
    meta_t = torch.tensor(meta, dtype=torch.int32).to(q.device, non_blocking=True)
    # no FMA contraction: the unmasked and the masked block loops must round every step alike
    _attn_kernel[(len(meta), hkv)](q, K, V, out, meta_t, LOG2E / math.sqrt(d),
                                   q.stride(0), q.stride(1), K.stride(0), K.stride(1), out.stride(0), out.stride(1),
                                   GROUP=group, D=d, BM=block_m, BN=kv_block, PREC=DOT_PRECISION,
                                   num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False)
    return out


def attention_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                    slots: torch.Tensor, positions: torch.Tensor, kv_block: int, block_m: int, num_warps: int = 8,
                    num_stages: int = 2) -> torch.Tensor:
    """One decode token per sequence over slot-addressed caches, with no host work that depends on the values (CUDA
    graph safe): the new keys and values go to ``pool_k/pool_v[slots, positions]``, then :func:`attention`'s kernel
    runs with its tile table built on the device.

    Args:
        q: ``[B, Hq, D]`` queries (after norm and RoPE). k, v: ``[B, Hkv, D]`` the tokens' keys and values.
        pool_k, pool_v: ``[S, cap, Hkv, D]`` in ``q.dtype``: slot s holds its sequence's keys at rows 0..position-1.
        slots: ``[B]`` int64, each sequence's slot (distinct, but pad rows may share one). positions: ``[B]`` int64,
            each token's absolute position (``< cap``).
        kv_block, block_m, num_warps, num_stages: as :func:`attention`.

    Returns:
        ``[B, Hq, D]``: the bits :func:`attention` gives the same sequences (the same kernel; a decode token is one
        tile per (sequence, kv head) there too, and the rows of a slot past the position are masked).

    Raises:
        ValueError: a GQA group larger than ``block_m`` (a decode token would span two tiles), or a pool whose dtype
            is not ``q``'s.
    """
    B, hq, d = q.shape
    S, cap, hkv, _ = pool_k.shape
    group = hq // hkv
    if group > block_m:
        raise ValueError(f"attention_slots: GQA group {group} > block_m {block_m}")
    if pool_k.dtype != q.dtype or pool_v.dtype != q.dtype:
        raise ValueError(f"attention_slots: pools of {pool_k.dtype}/{pool_v.dtype} for queries of {q.dtype}")
    pool_k[slots, positions] = k.to(q.dtype)
    pool_v[slots, positions] = v.to(q.dtype)
    rows = torch.arange(B, device=q.device)
    meta = torch.stack([rows, torch.ones_like(rows), slots * cap, positions, torch.zeros_like(rows)], 1).to(torch.int32)
    out = torch.empty_like(q)
    qc = q.contiguous()
    K, V = pool_k.view(S * cap, hkv, d), pool_v.view(S * cap, hkv, d)
    _attn_kernel[(B, hkv)](qc, K, V, out, meta, LOG2E / math.sqrt(d),
                           qc.stride(0), qc.stride(1), K.stride(0), K.stride(1), out.stride(0), out.stride(1),
                           GROUP=group, D=d, BM=block_m, BN=kv_block, PREC=DOT_PRECISION,
                           num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False)
    return out


def attention_autograd(q, kv, starts, lengths, kv_block: int, block_m: int, num_warps: int = 8,
                       num_stages: int = 2) -> torch.Tensor:
    """:func:`attention` whose gradient is the native stack's: that of SDPA in the activation dtype
    (:func:`isoexec.kernels.attention.native.native_attention`, whichever backend SDPA picks) on each piece's keys up to
    its last query's position (``start + n``: the keys the kernel reads; SDPA's one-row case reads all it is given)."""
    flat = [t for pair in kv for t in pair]
    upto = [s + n for s, n in zip(starts, lengths)]
    return with_ref_grad(lambda qq, *f: attention(qq, list(zip(f[0::2], f[1::2])), starts, lengths, kv_block, block_m,
                                                  num_warps, num_stages),
                         lambda qq, *f: native_attention(qq, [(kk[:u], vv[:u]) for kk, vv, u in zip(f[0::2], f[1::2], upto)],
                                                         starts, lengths), q, *flat)
