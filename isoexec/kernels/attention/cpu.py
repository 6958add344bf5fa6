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
    if not lengths or n_total == 0:
        return q.new_zeros(q.shape)
    hkv = kv[0][0].shape[1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d)
    Q, P, dest, tile_seq, tile_head = _query_tiles(q.float() * scale, starts, lengths, hkv, group, row_tile)
    nt = Q.shape[0]
    n_blocks = max(math.ceil((s + n) / kv_block) for s, n in zip(starts, lengths))
    Kt, Vt = _key_tiles(kv, tile_seq, tile_head, n_blocks * kv_block)  # [nt, Lpad, D] each
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
    keep = dest >= 0
    out = out_t.new_zeros((n_total * hq, d)).index_copy(0, dest[keep], out_t[keep])
    return out.reshape(n_total, hq, d).to(q.dtype)


def _query_tiles(qf: torch.Tensor, starts: list[int], lengths: list[int], hkv: int, group: int, row_tile: int):
    """The query tiles of :func:`iso_attention`, in (sequence, kv head, tile) order.

    Row r of the (sequence b, kv head h) group is query ``r // group`` of b, head ``h * group + r % group``;
    the group's rows are cut into tiles of ``row_tile``, the last one zero-padded (pad rows sit at
    position 0 and are discarded).

    Args:
        qf: ``[N, Hq, D]`` fp32 scaled queries. starts, lengths: per sequence. hkv, group: KV heads and
            query heads per KV head. row_tile: rows per tile.

    Returns:
        (Q ``[nt, T, D]``, positions ``[nt, T]`` int64, dest ``[nt * T]`` int64: each tile row's index in
        ``qf.view(N * Hq, D)`` or -1 for a pad row, per tile its sequence ``[nt]`` and kv head ``[nt]``).
    """
    n_total, hq, d = qf.shape
    n = torch.tensor(lengths, dtype=torch.long)
    row0 = torch.cumsum(n, 0) - n
    pair_seq = torch.arange(len(lengths)).repeat_interleave(hkv)  # (sequence, kv head) pairs, sequence-major
    pair_head = torch.arange(hkv).repeat(len(lengths))
    rows = n[pair_seq] * group
    tiles = (rows + row_tile - 1) // row_tile
    tile_pair = torch.arange(pair_seq.numel()).repeat_interleave(tiles)
    tile_in_pair = torch.arange(tile_pair.numel()) - (torch.cumsum(tiles, 0) - tiles)[tile_pair]
    r = tile_in_pair[:, None] * row_tile + torch.arange(row_tile)[None, :]  # [nt, T] row within its group
    seq, head = pair_seq[tile_pair][:, None], pair_head[tile_pair][:, None]
    valid = r < rows[tile_pair][:, None]
    token = row0[seq] + r // group
    dest = torch.where(valid, token * hq + head * group + r % group, -1)
    flat = torch.cat([qf.reshape(n_total * hq, d), qf.new_zeros(1, d)])
    Q = flat[torch.where(valid, dest, n_total * hq)]
    P = torch.where(valid, torch.tensor(starts, dtype=torch.long)[seq] + r // group, 0)
    return Q, P, dest.reshape(-1), pair_seq[tile_pair], pair_head[tile_pair]


def _key_tiles(kv: list[tuple[torch.Tensor, torch.Tensor]], tile_seq: torch.Tensor, tile_head: torch.Tensor,
               length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile its sequence's keys and values of its kv head, fp32, zero-padded to ``length``
    positions: (K ``[nt, length, D]``, V ``[nt, length, D]``)."""
    sizes = torch.tensor([k.shape[0] for k, _ in kv], dtype=torch.long)
    base = torch.cumsum(sizes, 0) - sizes
    pos = torch.arange(length)
    hkv, d = kv[0][0].shape[1:]
    # row of (sequence, position, head) in the stacked caches, or the zero row past a sequence's end
    src = torch.where(pos[None, :] < sizes[tile_seq][:, None], (base[tile_seq][:, None] + pos[None, :]) * hkv
                      + tile_head[:, None], int(sizes.sum()) * hkv)
    out = []
    for which in (0, 1):
        flat = torch.cat([t[which].reshape(-1, d) for t in kv]).float()
        out.append(torch.cat([flat, flat.new_zeros(1, d)])[src])
    return out[0], out[1]


def iso_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Output gate of gated attention (region ``attn.gate``): ``x * sigmoid(gate)``, fp32 math."""
    return (x.float() * sigmoid(gate.float())).to(x.dtype)
