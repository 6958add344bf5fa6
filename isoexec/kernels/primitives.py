"""Batch-invariant CPU building blocks: fixed-shape GEMM tiles, fixed-tree reductions and
elementwise transcendental functions whose bits do not depend on a value's position in a tensor.

Why these exist (measured on the project's CPUs, see ``tests/test_kernels_primitives.py``):

* ``torch.matmul`` in fp32 picks a different MKL kernel for 1, 2-3 and >= 4 rows, so the bits of a
  row depend on how many rows are in the call. A call of one fixed shape ``[T, K] @ [K, M]`` gives
  every row the same bits wherever it sits in the tile; a ``bmm`` over a stack of such tiles does
  not (for some shapes the stack's length changes the kernel). :func:`tile_mm` therefore pads the
  rows to a multiple of the contract's ``row_tile`` and runs one ``torch.mm`` per tile.
* ``torch.sum`` may split a long reduction across threads depending on the tensor's size;
  :func:`tree_sum` adds halves in a fixed binary tree with elementwise adds (IEEE-exact per element).
* ATen's vectorised loops run the scalar libm function on a loop's tail. For ``exp``, ``log``,
  ``sqrt``, ``tanh`` and ``cos`` the two agree; for ``sigmoid``, ``silu``, ``softplus``, ``rsqrt`` and
  ``log1p`` they do not, so a value's bits depend on its position. The functions here are composed
  only from the agreeing ones and from + - * /.
"""

from __future__ import annotations

import torch


class _TileMM(torch.autograd.Function):
    """Forward: one ``torch.mm`` per row tile (the bits). Backward: two plain matmuls (the gradient
    need not be bitwise; one autograd node instead of one per tile)."""

    @staticmethod
    def forward(ctx, x, w, row_tile):  # noqa: D102
        ctx.save_for_backward(x, w)
        return _tile_mm(x, w, row_tile)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        x, w = ctx.saved_tensors
        gx = g @ w.t() if ctx.needs_input_grad[0] else None
        gw = x.t() @ g if ctx.needs_input_grad[1] else None
        return gx, gw, None


def _tile_mm(x: torch.Tensor, w: torch.Tensor, row_tile: int) -> torch.Tensor:
    n, k = x.shape
    m = w.shape[1]
    if n == 0:
        return x.new_zeros((0, m))
    pad = (-n) % row_tile
    if pad:
        x = torch.cat([x, x.new_zeros((pad, k))], dim=0)
    w = w.contiguous()
    out = torch.cat([torch.mm(t, w) for t in x.split(row_tile)], dim=0)
    return out[:n]


def tile_mm(x: torch.Tensor, w: torch.Tensor, row_tile: int) -> torch.Tensor:
    """Batch-invariant ``x @ w`` in the dtype of the inputs (fp32 in the isoexec kernel set).

    Every GEMM call has the one shape ``[T, K] @ [K, M]`` (T = ``row_tile``, rows zero-padded), one
    call per tile. (A single ``bmm`` over a stack of tiles is not enough: for some shapes, e.g.
    M = 1, ATen/MKL treat the stack differently depending on its length.)

    Args:
        x: ``[N, K]``; any N >= 0.
        w: ``[K, M]``, the same tensor for every row.
        row_tile: T, rows per GEMM tile (a contract constant).

    Returns:
        ``[N, M]``; row i depends only on ``x[i]`` and ``w`` (never on N, on the other rows or on
        the row's position in its tile). Differentiable: the gradient is that of ``x @ w`` computed
        by two plain matmuls (not bitwise; the forward is).
    """
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _TileMM.apply(x, w, row_tile)
    return _tile_mm(x, w, row_tile)


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
