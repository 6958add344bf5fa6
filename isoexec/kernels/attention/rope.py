"""Partial rotary position embedding (region ``attn.rope``), shared by every kernel set: elementwise
only, so each row depends on its own position alone (``cos``/``sin`` are position-invariant)."""

from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, partial_rotary_factor: float, theta: float) -> torch.Tensor:
    """fp32 inverse frequencies ``[rotary_dim / 2]`` of a partial rotary embedding, as transformers:
    ``rotary_dim = int(head_dim * partial_rotary_factor)``, ``1 / theta ** (arange(0, rotary_dim, 2) / rotary_dim)``."""
    rot = int(head_dim * partial_rotary_factor)
    return 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[N, rotary_dim]`` for absolute positions, as HF (``cat(freqs, freqs)``), cast to ``dtype``.

    Each row depends only on its position (elementwise fp32 math; ``cos``/``sin`` are position-invariant).
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary embedding (region ``attn.rope``) on ``x [N, H, D]``; the first ``cos.shape[-1]`` channels rotate.

    Elementwise only, so it is batch- and mode-invariant in both kernel sets.
    """
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos[:, None, :] + rot * sin[:, None, :]
    return torch.cat([out, xp], dim=-1)
