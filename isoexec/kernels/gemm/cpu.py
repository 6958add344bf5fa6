"""Batch- and parallel-invariant GEMM on CPU. Every GEMM runs through
:func:`~isoexec.kernels.primitives.tile_mm`: a C kernel with one fixed fp32 fused-multiply-add chain
over K per output element (``bf16_gemm.c``'s chain in k pairs for a bf16 model, ``fma_gemm.c``'s
ascending chain for fp32), rounded once to the boundary dtype (logits stay fp32). Two forms, so that a
tensor-parallel trainer reproduces the bits:

* :func:`iso_linear` (column-parallel regions ``attn.qkv_proj``, ``gdn.in_proj``, ``lm_head``, the
  router and the MoE ``gate_proj``/``up_proj``): one GEMM over all output features. A column's bits
  depend only on its own weight column (``tests/test_kernels_primitives.py``), so a rank's shard of
  output features, in any order, has the full product's bits.
* :func:`iso_row_linear` (row-parallel regions ``attn.out_proj``, ``gdn.out_proj``, the MoE
  ``down_proj``): the pik leaf GEMMs (:mod:`isoexec.kernels.collectives.pik`): ``leaves`` fixed
  contiguous leaves over K summed by a fixed tree, which a TP rank's subtree reproduces.
"""

from __future__ import annotations

import torch

from isoexec.kernels.collectives.pik import pik_row_parallel_partial
from isoexec.kernels.primitives import tile_linear


def iso_linear(x: torch.Tensor, w: torch.Tensor, row_tile: int, col_tile: int,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T`` with fp32 accumulation, one FMA chain over K per output (:func:`tile_linear`).

    Batch-invariant (a row's bits do not depend on the other rows) and column-invariant (a column's
    bits do not depend on which other output features are computed with it).

    Args:
        x: ``[N, K]`` activations (bf16 or fp32).
        w: ``[M, K]`` weight in the Hugging Face ``nn.Linear`` layout (any M >= 0).
        row_tile, col_tile: the GEMM's cache tiles (contract constants ``row_tile``, ``col_tile``;
            they move no bit).
        out_dtype: output dtype; default ``x.dtype`` (the boundary dtype). ``torch.float32`` keeps
            the fp32 accumulator (used for logits).

    Returns:
        ``[N, M]`` in ``out_dtype``. Differentiable.
    """
    return tile_linear(x, w, row_tile, col_tile).to(out_dtype or x.dtype)


def iso_row_linear(x: torch.Tensor, w: torch.Tensor, row_tile: int, leaves: int,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T`` as the pik leaf GEMMs: bitwise equal to
    :func:`~isoexec.kernels.collectives.pik.pik_row_parallel_linear` over K shards at every TP
    dividing ``leaves``.

    Args:
        x: ``[N, K]``. w: ``[M, K]``. row_tile: rows per cache tile (moves no bit). leaves: fixed leaves over K (a
            power of two dividing K). out_dtype: default ``x.dtype``.

    Returns:
        ``[N, M]`` in ``out_dtype``. Differentiable.

    Raises:
        ValueError: K not divisible by ``leaves`` or ``leaves`` not a power of two.
    """
    return pik_row_parallel_partial(x, w, 1, leaves, row_tile).to(out_dtype or x.dtype)
