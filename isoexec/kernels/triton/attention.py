"""Causal GQA attention in Triton (region ``attn.core``), one kernel for prefill, chunked prefill,
decode and the trainer.

Same contract as :func:`isoexec.kernels.attention.iso_attention`: a tile holds ``BM`` rows of one
(sequence, kv head) (row r = query ``r // group``, head ``h * group + r % group``, so decode packs a
GQA group into one tile), keys are visited in fixed blocks of ``BN = kv_block`` absolute positions
from block 0 upwards, with one online-softmax update (fp32 m, l, acc; ``p`` rounded to the input
dtype for the PV product). A block wholly after a row's position is an exact no-op for that row, so
the same query gets the same bits whatever the case, the tile it lands in, or the other sequences.
No split-KV.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

ATTN_BM = 64  # query rows per tile (contract constant)


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, meta_ptr, sm_scale,
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
    max_pos = start + tl.minimum((r0 + BM - 1) // GROUP, n - 1)
    n_blocks = max_pos // BN + 1
    m = tl.full((BM,), float("-inf"), tl.float32)
    l = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    for blk in range(0, n_blocks):
        kpos = blk * BN + tl.arange(0, BN)
        kmask = kpos < kv_len
        kv_offs = (kv_off + kpos).to(tl.int64)[:, None] * stride_kn + h * stride_kh + d[None, :]
        kb = tl.load(k_ptr + kv_offs, mask=kmask[:, None], other=0.0)
        vb = tl.load(v_ptr + kv_offs, mask=kmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kb), input_precision=PREC) * sm_scale
        s = tl.where(kpos[None, :] > pos[:, None], float("-inf"), s)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PREC)
        m = m_new
    out = acc / l[:, None]
    o_offs = (q_row0 + qi).to(tl.int64)[:, None] * stride_on + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


def attention(q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], starts: list[int], lengths: list[int],
              kv_block: int) -> torch.Tensor:
    """Blockwise causal attention over per-sequence caches.

    Args:
        q: ``[N, Hq, D]`` queries of all pieces, concatenated in order (after norm and RoPE).
        kv: per piece ``(K, V)``, each ``[start_b + n_b, Hkv, D]`` (cache + new keys).
        starts: absolute position of each piece's first query. lengths: queries per piece (sum N).
        kv_block: keys per block (absolute positions; contract ``kv_block``).

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
        for r0 in range(0, n * group, ATTN_BM):
            meta.append((q_row0, n, kv_off, s, r0))
        q_row0 += n
        kv_off += k.shape[0]
    meta_t = torch.tensor(meta, dtype=torch.int32).to(q.device, non_blocking=True)
    prec = "ieee"
    _attn_kernel[(len(meta), hkv)](q, K, V, out, meta_t, 1.0 / math.sqrt(d),
                                   q.stride(0), q.stride(1), K.stride(0), K.stride(1), out.stride(0), out.stride(1),
                                   GROUP=group, D=d, BM=ATTN_BM, BN=kv_block, PREC=prec,
                                   num_warps=4 if d <= 64 else 8, num_stages=2)
    return out
