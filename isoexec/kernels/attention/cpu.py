"""Batch- and mode-invariant causal GQA attention on CPU (region ``attn.core``).

One call serves every case: sequence b contributes ``n_b`` queries at absolute positions
``start_b .. start_b + n_b - 1`` and attends to its keys ``0 .. start_b + n_b - 1`` (the cache plus
the new keys). ``trainer_fwd`` / ``engine_prefill`` have ``start_b = 0``; chunked prefill and
``engine_decode`` have ``start_b`` = tokens already cached.

isoexec (batch- and mode-invariant by construction): query rows are cut into tiles of ``row_tile``
rows of one (sequence, kv head); keys are visited in fixed blocks of ``kv_block`` absolute positions,
always from block 0 upwards, with one online-softmax update order (flash-attention style, fp32
accumulators). A block that lies wholly after a query's position is an exact no-op for that row
(``exp(-inf) = 0``, rescale by ``exp(0) = 1``), so the same query gets the same bits in prefill,
chunked prefill and decode, alone or in any batch. Online softmax: Milakov & Gimelshein (2018);
Dao et al., FlashAttention (2022).

The output gate of gated attention (region ``attn.gate``) is here too: ``x * sigmoid(gate)`` in fp32
with the position-invariant sigmoid.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from isoexec.kernels.primitives import sigmoid, tree_sum


def iso_attention(
    q: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    starts: list[int],
    lengths: list[int],
    row_tile: int,
    kv_block: int,
) -> torch.Tensor:
    """Blockwise causal attention with a fixed KV block size and one online-softmax order.

    Args:
        q: ``[N, Hq, D]`` queries (after norm and RoPE) of all sequences, concatenated in order.
        kv: per sequence ``(K, V)``, each ``[start_b + n_b, Hkv, D]`` (cache + new keys).
        starts: per sequence, absolute position of its first query.
        lengths: per sequence, number of queries ``n_b`` (sum = N).
        row_tile: query rows per tile. kv_block: keys per block (absolute positions).

    Returns:
        ``[N, Hq, D]`` in ``q.dtype``; scale ``1/sqrt(D)``. Differentiable.
    """
    n_total, hq, d = q.shape
    hkv = kv[0][0].shape[1] if kv else 1
    group = hq // hkv
    scale = 1.0 / math.sqrt(d)
    qf = q.float() * scale
    # Tiles: T rows of one (sequence, kv head). Row r of a (sequence, kv head) group is query r // group
    # of that sequence, head h * group + r % group; ``dest`` is its index in ``out.view(N * Hq, D)``.
    tiles_q, tiles_pos, tiles_seq, tiles_head, dest = [], [], [], [], []
    row0 = 0
    for b, (start, n) in enumerate(zip(starts, lengths)):
        r = torch.arange(n * group)
        pos = start + r // group
        for h in range(hkv):
            rows = qf[row0 : row0 + n, h * group : (h + 1) * group].reshape(n * group, d)
            flat = (row0 + r // group) * hq + h * group + r % group
            for t0 in range(0, n * group, row_tile):
                t1 = min(t0 + row_tile, n * group)
                pad = row_tile - (t1 - t0)
                tiles_q.append(F.pad(rows[t0:t1], (0, 0, 0, pad)))
                tiles_pos.append(F.pad(pos[t0:t1], (0, pad)))  # pad rows attend key 0; discarded
                tiles_seq.append(b)
                tiles_head.append(h)
                dest.append(F.pad(flat[t0:t1], (0, pad), value=-1))
        row0 += n
    if not tiles_q:
        return q.new_zeros(q.shape)
    Q = torch.stack(tiles_q)  # [nt, T, D]
    P = torch.stack(tiles_pos)  # [nt, T]
    nt = Q.shape[0]
    n_blocks = max(math.ceil((s + n) / kv_block) for s, n in zip(starts, lengths))
    Lpad = n_blocks * kv_block
    Kpad = torch.stack([F.pad(k.float(), (0, 0, 0, 0, 0, Lpad - k.shape[0])) for k, _ in kv])  # [B, Lpad, Hkv, D]
    Vpad = torch.stack([F.pad(v.float(), (0, 0, 0, 0, 0, Lpad - v.shape[0])) for _, v in kv])
    seq_idx = torch.tensor(tiles_seq)
    head_idx = torch.tensor(tiles_head)
    Kt = Kpad[seq_idx, :, head_idx]  # [nt, Lpad, D]
    Vt = Vpad[seq_idx, :, head_idx]
    m = Q.new_full((nt, row_tile, 1), float("-inf"))
    l = Q.new_zeros((nt, row_tile, 1))
    acc = Q.new_zeros((nt, row_tile, d))
    for blk in range(n_blocks):
        k0 = blk * kv_block
        kb = Kt[:, k0 : k0 + kv_block]  # [nt, Bk, D]
        vb = Vt[:, k0 : k0 + kv_block].contiguous()
        s = torch.bmm(Q, kb.transpose(1, 2).contiguous())  # [nt, T, Bk]
        mask = torch.arange(k0, k0 + kv_block)[None, None, :] > P[:, :, None]
        s = s.masked_fill(mask, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new)
        l = l * alpha + tree_sum(p, dim=-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, vb)
        m = m_new
    out_t = (acc / l).reshape(nt * row_tile, d)
    dest_idx = torch.cat(dest)
    keep = dest_idx >= 0
    out = out_t.new_zeros((n_total * hq, d)).index_copy(0, dest_idx[keep], out_t[keep])
    return out.reshape(n_total, hq, d).to(q.dtype)


def iso_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Output gate of gated attention (region ``attn.gate``): ``x * sigmoid(gate)``, fp32 math."""
    return (x.float() * sigmoid(gate.float())).to(x.dtype)
