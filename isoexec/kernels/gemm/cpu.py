"""Batch-invariant GEMM on CPU (regions ``attn.qkv_proj``, ``attn.out_proj``, ``gdn.in_proj``,
``gdn.out_proj``, ``lm_head`` and the MoE GEMMs): every call runs through
:func:`~isoexec.kernels.primitives.tile_mm` in fp32 with a fixed row tile, rounded once to the
boundary dtype (logits stay fp32)."""

from __future__ import annotations

import torch

from isoexec.kernels.primitives import tile_mm


def iso_linear(x: torch.Tensor, w: torch.Tensor, row_tile: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T`` with fp32 accumulation, batch-invariant.

    Args:
        x: ``[N, K]`` activations (bf16 or fp32).
        w: ``[M, K]`` weight in the Hugging Face ``nn.Linear`` layout.
        row_tile: rows per GEMM tile (contract constant ``row_tile``).
        out_dtype: output dtype; default ``x.dtype`` (the boundary dtype). ``torch.float32`` keeps
            the fp32 accumulator (used for logits).

    Returns:
        ``[N, M]`` in ``out_dtype``.
    """
    y = tile_mm(x.float(), w.float().t(), row_tile)
    return y.to(out_dtype or x.dtype)
