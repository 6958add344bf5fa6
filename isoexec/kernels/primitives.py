"""Batch-invariant CPU building blocks: fixed-shape GEMM tiles, fixed-tree reductions and
elementwise transcendental functions whose bits do not depend on a value's position in a tensor.

Why these exist (measured on the project's CPUs, see ``tests/test_kernels_primitives.py``):

* ``torch.matmul`` in fp32 picks a different MKL kernel for 1, 2-3 and >= 4 rows, so the bits of a
  row depend on how many rows are in the call (``tests/test_kernels_primitives.py`` keeps that as the
  negative control). :func:`tile_mm` runs the project's C GEMM instead
  (:mod:`isoexec.kernels.gemm.fma`): one ascending fused-multiply-add chain over K per output element,
  so a row's bits depend neither on the other rows nor on the other columns, nor on the cache tiles.
* ``torch.sum`` may split a long reduction across threads depending on the tensor's size;
  :func:`tree_sum` adds halves in a fixed binary tree with elementwise adds (IEEE-exact per element).
* ATen's vectorised loops run the scalar libm function on a loop's tail. For ``exp``, ``log``,
  ``sqrt``, ``tanh`` and ``cos`` the two agree; for ``sigmoid``, ``silu``, ``softplus``, ``rsqrt`` and
  ``log1p`` they do not, so a value's bits depend on its position. The functions here are composed
  only from the agreeing ones and from + - * /.
"""

from __future__ import annotations

import torch

from isoexec.kernels.gemm.fma import fma_gemm


class _TileMMs(torch.autograd.Function):
    """Forward: every pair's GEMM by the C kernel (the bits). Backward: two plain matmuls per pair in
    ``grad_dtype`` (the gradient need not be bitwise; bf16 for bf16 activations, as a native bf16
    trainer computes it; one autograd node for all pairs instead of one per pair)."""

    @staticmethod
    def forward(ctx, row_tile, col_tile, grad_dtype, *xw):  # noqa: D102
        ctx.save_for_backward(*xw)
        ctx.grad_dtype = grad_dtype
        return tuple(_tile_mm_pairs([(xw[i], xw[i + 1]) for i in range(0, len(xw), 2)], row_tile, col_tile))

    @staticmethod
    def backward(ctx, *gs):  # noqa: D102
        xw, dt = ctx.saved_tensors, ctx.grad_dtype
        grads: list[torch.Tensor | None] = [None, None, None]
        for j, g in enumerate(gs):
            x, w = xw[2 * j].to(dt), xw[2 * j + 1].to(dt)
            g = g.to(dt)
            grads.append((g @ w.t()).float() if ctx.needs_input_grad[3 + 2 * j] else None)
            grads.append((x.t() @ g).float() if ctx.needs_input_grad[4 + 2 * j] else None)
        return tuple(grads)


def _tile_mm_pairs(pairs, row_tile: int, col_tile: int | None) -> list[torch.Tensor]:
    """:func:`~isoexec.kernels.gemm.fma.fma_gemm` of every (x, w) pair."""
    return [fma_gemm(x, w, row_tile, col_tile) for x, w in pairs]


def grad_dtype_of(x: torch.Tensor) -> torch.dtype:
    """The backward matmuls' dtype for a GEMM whose activations come in as ``x``: bf16 for bf16
    activations (as a native bf16 trainer), else fp32."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32


def tile_mms(pairs: list[tuple[torch.Tensor, torch.Tensor]], row_tile: int, col_tile: int | None = None,
             grad_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """:func:`tile_mm` of every ``(x, w)`` pair, as one autograd node (a linear's fused gate/up, the
    leaves of a pik GEMM).

    Args:
        pairs: ``(x [N_j, K_j], w [K_j, M_j])`` float32.
        row_tile, col_tile: the C kernel's cache tiles (contract constants; they move no bit).
        grad_dtype: dtype of the backward matmuls: ``torch.bfloat16`` where x and w hold bf16 values
            (the model's boundary dtype), else ``torch.float32``.

    Returns:
        per pair ``[N_j, M_j]`` float32, bitwise :func:`tile_mm` of that pair. Differentiable
        (plain-matmul gradients in ``grad_dtype``, returned as float32).

    Raises:
        ValueError: ``grad_dtype`` other than bfloat16 or float32.
    """
    if grad_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"grad_dtype must be torch.bfloat16 or torch.float32, got {grad_dtype}")
    flat = [t for xw in pairs for t in xw]
    if torch.is_grad_enabled() and any(t.requires_grad for t in flat):
        return list(_TileMMs.apply(row_tile, col_tile, grad_dtype, *flat))
    return _tile_mm_pairs(pairs, row_tile, col_tile)


def tile_mm(x: torch.Tensor, w: torch.Tensor, row_tile: int, col_tile: int | None = None,
            grad_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Batch- and column-invariant ``x @ w`` in fp32 (the isoexec CPU GEMM).

    Each output element is one ascending fused-multiply-add chain over K
    (:func:`~isoexec.kernels.gemm.fma.fma_gemm`), in cache tiles of ``row_tile`` rows x ``col_tile``
    columns that do not change it.

    Args:
        x: ``[N, K]`` float32; any N >= 0.
        w: ``[K, M]`` float32, the same tensor for every row.
        row_tile, col_tile: cache tiles (contract constants); ``col_tile`` None: all M columns.
        grad_dtype: dtype of the backward matmuls (:func:`tile_mms`).

    Returns:
        ``[N, M]``; element (i, j) depends only on ``x[i]`` and ``w[:, j]`` (never on N, on the other
        rows or columns, on the row's position or on the tiles). Differentiable: the gradient is that
        of ``x @ w`` computed by two plain matmuls in ``grad_dtype`` (not bitwise; the forward is).

    Raises:
        ValueError: inputs not float32, shapes that do not chain, a tile < 1.
    """
    return tile_mms([(x, w)], row_tile, col_tile, grad_dtype)[0]


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum along ``dim`` in a fixed binary tree: zero-pad to a power of two, then add halves.

    The order of additions depends only on ``x.shape[dim]``, never on the other dimensions, the
    thread count or the element's position. Differentiable.
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    p = 1
    while p < n:
        p *= 2
    if p != n:
        shape = list(x.shape)
        shape[dim] = p - n
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    while x.shape[dim] > 1:
        h = x.shape[dim] // 2
        x = x.narrow(dim, 0, h) + x.narrow(dim, h, h)
    return x if keepdim else x.squeeze(dim)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Position-invariant logistic function ``1 / (1 + exp(-x))``."""
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """Position-invariant SiLU ``x / (1 + exp(-x))``."""
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """Position-invariant softplus ``log(1 + exp(x))`` (``x`` above ``threshold``, as torch does)."""
    return torch.where(x > threshold, x, torch.log(1.0 + torch.exp(torch.clamp(x, max=threshold))))


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """Position-invariant ``1 / sqrt(x)`` (``torch.rsqrt`` is not: its tail uses another formula)."""
    return 1.0 / torch.sqrt(x)
