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


class _TileMMs(torch.autograd.Function):
    """Forward: every pair's GEMM, one ``torch.mm`` per row tile (the bits). Backward: two plain
    matmuls per pair (the gradient need not be bitwise; one autograd node for all pairs instead of
    one per tile)."""

    @staticmethod
    def forward(ctx, row_tile, *xw):  # noqa: D102
        ctx.save_for_backward(*xw)
        return tuple(_tile_mm_pairs([(xw[i], xw[i + 1]) for i in range(0, len(xw), 2)], row_tile))

    @staticmethod
    def backward(ctx, *gs):  # noqa: D102
        xw = ctx.saved_tensors
        grads: list[torch.Tensor | None] = [None]
        for j, g in enumerate(gs):
            x, w = xw[2 * j], xw[2 * j + 1]
            grads.append(g @ w.t() if ctx.needs_input_grad[1 + 2 * j] else None)
            grads.append(x.t() @ g if ctx.needs_input_grad[2 + 2 * j] else None)
        return tuple(grads)


def _row_tiles(x: torch.Tensor, row_tile: int) -> list[torch.Tensor]:
    """``x`` zero-padded to a multiple of ``row_tile`` rows, as its row tiles (views)."""
    pad = (-x.shape[0]) % row_tile
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return list(x.split(row_tile))


def _tile_mm_pairs(pairs, row_tile: int) -> list[torch.Tensor]:
    """One ``torch.mm`` per (pair, row tile); an ``x`` shared by several pairs is padded and split once."""
    tiles: dict[int, list[torch.Tensor]] = {}
    out = []
    for x, w in pairs:
        n, m = x.shape[0], w.shape[1]
        if n == 0:
            out.append(x.new_zeros((0, m)))
            continue
        ts = tiles.get(id(x))
        if ts is None:
            ts = tiles[id(x)] = _row_tiles(x, row_tile)
        w = w.contiguous()
        out.append(torch.mm(ts[0], w)[:n] if len(ts) == 1 else torch.cat([torch.mm(t, w) for t in ts])[:n])
    return out


def tile_mms(pairs: list[tuple[torch.Tensor, torch.Tensor]], row_tile: int) -> list[torch.Tensor]:
    """:func:`tile_mm` of every ``(x, w)`` pair, as one autograd node (the column tiles of one
    linear, the leaves of a pik GEMM).

    Args:
        pairs: ``(x [N_j, K_j], w [K_j, M_j])`` in the dtype of the computation (fp32 here).
        row_tile: T, rows per GEMM tile (a contract constant).

    Returns:
        per pair ``[N_j, M_j]``, bitwise :func:`tile_mm` of that pair. Differentiable (plain-matmul
        gradients).
    """
    flat = [t for xw in pairs for t in xw]
    if torch.is_grad_enabled() and any(t.requires_grad for t in flat):
        return list(_TileMMs.apply(row_tile, *flat))
    return _tile_mm_pairs(pairs, row_tile)


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
    return tile_mms([(x, w)], row_tile)[0]


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
