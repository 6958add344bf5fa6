"""Native attention (regions ``attn.core``, ``attn.gate``): ``F.scaled_dot_product_attention`` per
sequence (causal for prefill, a 1-query call over the cache for decode, an explicit mask for a
chunk after a cached prefix), whose kernel choice depends on the shapes; the output gate in the
activation dtype. The negative control on CPU and CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def native_attention(
    q: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    starts: list[int],
    lengths: list[int],
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` per sequence with GQA (``enable_gqa``), in ``q.dtype``.

    Same arguments as :func:`isoexec.kernels.attention.cpu.iso_attention` (no tile/block constants);
    SDPA picks its kernel from the shapes (math/flash on CPU, flash/cuDNN/efficient on CUDA).
    """
    outs = []
    row0 = 0
    for (k, v), start, n in zip(kv, starts, lengths):
        qb = q[row0 : row0 + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        kb = k.to(q.dtype).transpose(0, 1).unsqueeze(0)
        vb = v.to(q.dtype).transpose(0, 1).unsqueeze(0)
        L = k.shape[0]
        if n == 1:
            o = F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)
        elif start == 0:
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        else:
            qpos = torch.arange(start, start + n, device=q.device)[:, None]
            mask = torch.arange(L, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
        row0 += n
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def native_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """HF gated attention output: ``x * torch.sigmoid(gate)`` in the activation dtype."""
    return x * torch.sigmoid(gate)
