"""Batch-invariant CPU building blocks: the GEMM (one FMA chain per output), fixed-tree reductions and
elementwise transcendental functions whose bits do not depend on a value's position in a tensor.

Why these exist (measured on the project's CPUs, see ``tests/test_kernels_primitives.py``):

* ``torch.matmul`` in fp32 picks a different MKL kernel for 1, 2-3 and >= 4 rows, so the bits of a
  row depend on how many rows are in the call (``tests/test_kernels_primitives.py`` keeps that as the
  negative control). :func:`tile_mm` runs the project's C GEMMs instead
  (:mod:`isoexec.kernels.gemm.fma`): one fixed fused-multiply-add chain over K per output element
  (in k pairs for bf16 operands), so a row's bits depend neither on the other rows nor on the other
  columns, nor on the cache tiles.
* ``torch.sum`` may split a long reduction across threads depending on the tensor's size;
  :func:`tree_sum` adds halves in a fixed binary tree with elementwise adds (IEEE-exact per element).
* ATen's vectorised loops run the scalar libm function on a loop's tail. For ``exp``, ``log``,
  ``sqrt``, ``tanh`` and ``cos`` the two agree; for ``sigmoid``, ``silu``, ``softplus``, ``rsqrt`` and
  ``log1p`` they do not, so a value's bits depend on its position. The functions here are composed
  only from the agreeing ones and from + - * /.
"""

from __future__ import annotations

import torch

from isoexec.kernels.gemm.fma import bf16_pair_gemm, fma_gemm, pin_panels
from isoexec.kernels.native_build import c_ptr, kernel_library


def _c_gemm(x, w, row_tile, col_tile, leaves):
    """The C kernel for the operands' dtype: :func:`bf16_pair_gemm` for bf16, :func:`fma_gemm` else."""
    gemm = bf16_pair_gemm if x.dtype == torch.bfloat16 else fma_gemm
    return gemm(x, w, row_tile, col_tile, leaves)


class _TileMM(torch.autograd.Function):
    """Forward: the C kernel (the bits). Backward: two plain matmuls in ``grad_dtype`` (the gradient
    need not be bitwise; bf16 for bf16 activations, as a native bf16 trainer computes it; the leaf
    tree is linear, so the leaves need no backward of their own)."""

    @staticmethod
    def forward(ctx, x, w, row_tile, col_tile, grad_dtype, leaves):  # noqa: D102
        ctx.save_for_backward(x, w)
        ctx.grad_dtype = grad_dtype
        return _c_gemm(x, w, row_tile, col_tile, leaves)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        x0, w0 = ctx.saved_tensors
        x, w, g = x0.to(ctx.grad_dtype), w0.to(ctx.grad_dtype), g.to(ctx.grad_dtype)
        gx = (g @ w.t()).to(x0.dtype) if ctx.needs_input_grad[0] else None
        gw = (x.t() @ g).to(w0.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None, None


def tile_mm(x: torch.Tensor, w: torch.Tensor, row_tile: int, col_tile: int | None = None,
            grad_dtype: torch.dtype = torch.float32, leaves: int = 1) -> torch.Tensor:
    """Batch- and column-invariant ``x @ w`` with fp32 accumulation (the isoexec CPU GEMM).

    Each output element is one fixed fused-multiply-add chain over K, or over each of ``leaves``
    contiguous K leaves added by the fixed adjacent-pairs tree (the pik leaf GEMM), in cache tiles of
    ``row_tile`` rows x ``col_tile`` columns that do not change it: for bf16 operands the chain in k
    pairs of :func:`~isoexec.kernels.gemm.fma.bf16_pair_gemm`, for fp32 ones the ascending chain of
    :func:`~isoexec.kernels.gemm.fma.fma_gemm`.

    Args:
        x: ``[N, K]`` float32 or bfloat16; any N >= 0.
        w: ``[K, M]`` of x's dtype, the same tensor for every row.
        row_tile, col_tile: cache tiles (contract constants); ``col_tile`` None: all M columns.
        grad_dtype: dtype of the backward matmuls: ``torch.bfloat16`` where x and w hold bf16 values
            (the model's boundary dtype, :func:`tile_linear`), else ``torch.float32``.
        leaves: pik leaves over K (a power of two dividing K; 1: one chain over all of K).

    Returns:
        ``[N, M]`` float32; element (i, j) depends only on ``x[i]`` and ``w[:, j]`` (never on N, on
        the other rows or columns, on the row's position or on the tiles). Differentiable: the
        gradient is that of ``x @ w`` by two plain matmuls in ``grad_dtype``, returned in the inputs'
        dtypes (not bitwise; the forward is).

    Raises:
        ValueError: inputs not both float32 or both bfloat16, shapes that do not chain, a tile < 1,
            ``leaves`` not a power of two dividing K (with K / ``leaves`` even for bf16),
            ``grad_dtype`` other than bfloat16 or float32.
    """
    if grad_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"grad_dtype must be torch.bfloat16 or torch.float32, got {grad_dtype}")
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _TileMM.apply(x, w, row_tile, col_tile, grad_dtype, leaves)
    return _c_gemm(x, w, row_tile, col_tile, leaves)


def _kxm(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w.t()`` as a contiguous ``[K, M]`` tensor of ``dtype``, the same values whichever way it is obtained.

    Without autograd the converted copy, with the GEMM's packed panels pinned on it, is kept on ``w``
    itself and reused while ``w`` holds the same storage at the same version: an engine converts and
    packs each weight once per weight sync instead of once per step. The project writes weights
    through the parameter (a weight sync's or the optimizer's ``copy_`` under ``no_grad``), which bumps
    its version counter and ends the reuse; a write through ``.data`` or numpy bypasses the counter
    (as it bypasses autograd's own checks) and would not be seen."""
    if torch.is_grad_enabled() and w.requires_grad:
        return w.t().to(dtype, memory_format=torch.contiguous_format)
    try:
        key = (w._version, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype)
    except RuntimeError:  # an inference-mode tensor has no version counter: nothing to key a cache on
        return w.t().to(dtype, memory_format=torch.contiguous_format)
    attr = f"_isoexec_kxm_{str(dtype).removeprefix('torch.')}"
    hit = getattr(w, attr, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    wt = w.t().to(dtype, memory_format=torch.contiguous_format)
    pin_panels(wt)  # a private copy, never written
    setattr(w, attr, (key, wt))
    return wt


def tile_linear(x: torch.Tensor, w: torch.Tensor, row_tile: int, col_tile: int | None = None,
                leaves: int = 1) -> torch.Tensor:
    """``x @ w.T`` for a weight in the Hugging Face ``nn.Linear`` layout, by :func:`tile_mm` (the one
    place that picks the GEMM's operand dtype and the backward's: bf16 activations and weights run the
    bf16 pair chain with a bf16 backward, as a native bf16 trainer; any other dtype is cast to fp32 for
    the fp32 chain with an fp32 backward).

    Args:
        x: ``[N, K]`` (bf16 or fp32). w: ``[M, K]`` (bf16 where x is bf16).
        row_tile, col_tile, leaves: as in :func:`tile_mm`.

    Returns:
        ``[N, M]`` float32 (the accumulator; the caller rounds to its boundary dtype). Differentiable.

    Raises:
        ValueError: shapes that do not chain (named as given), bf16 activations with a weight of
            another dtype (its values would be rounded silently), and what :func:`tile_mm` raises.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"tile_linear needs x [N, K] and w [M, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype == torch.bfloat16:
        if w.dtype != torch.bfloat16:
            raise ValueError(f"tile_linear: bfloat16 activations need a bfloat16 weight, got {w.dtype} "
                             f"{tuple(w.shape)}")
        return tile_mm(x, _kxm(w, torch.bfloat16), row_tile, col_tile, torch.bfloat16, leaves)
    return tile_mm(x.float(), _kxm(w, torch.float32), row_tile, col_tile, torch.float32, leaves)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): the padded length of :func:`tree_sum`'s tree."""
    p = 1
    while p < n:
        p *= 2
    return p


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum along ``dim`` in a fixed binary tree: zero-pad to a power of two, then add halves.

    The order of additions depends only on ``x.shape[dim]``, never on the other dimensions, the
    thread count or the element's position. Differentiable. Without autograd, an fp32 sum over the
    last dimension runs in the C kernel ``reduce/tree_sum.c`` (the same adds, one call instead of
    ``log2(n)`` torch ops); a sum that comes out NaN is recomputed by the torch tree, whose add keeps
    another operand's NaN sign and payload than C's when two NaNs meet.
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    p = pow2_at_least(n)
    if (dim == x.dim() - 1 and x.dtype == torch.float32 and x.device.type == "cpu" and n > 0
            and not (torch.is_grad_enabled() and x.requires_grad)):
        out = _c_tree_sum(x, p, keepdim)
        if not torch.isnan(out).any():
            return out
        # two NaNs meeting in one add: the C add and torch's keep different operands' sign and payload,
        # so a NaN sum takes the torch tree below (its bits are the definition)
    if p != n:
        shape = list(x.shape)
        shape[dim] = p - n
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    while x.shape[dim] > 1:
        h = x.shape[dim] // 2
        x = x.narrow(dim, 0, h) + x.narrow(dim, h, h)
    return x if keepdim else x.squeeze(dim)


def _c_tree_sum(x: torch.Tensor, p: int, keepdim: bool) -> torch.Tensor:
    """:func:`tree_sum` over the last dimension of an fp32 CPU tensor, padded length ``p``, in C."""
    import ctypes

    n = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty(x.shape[:-1] + ((1,) if keepdim else ()), dtype=torch.float32)
    work = torch.empty(p, dtype=torch.float32)
    kernel_library(__file__, "reduce/tree_sum.c").isoexec_tree_sum(
        c_ptr(xc), c_ptr(out), ctypes.c_int64(xc.numel() // n), ctypes.c_int64(n), ctypes.c_int64(p), c_ptr(work))
    return out


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Position-invariant logistic function ``1 / (1 + exp(-x))``."""
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """Position-invariant SiLU ``x / (1 + exp(-x))``.

    Without autograd the four elementwise steps run in one temporary (the same IEEE operations on every
    element, so the same bits; a large fresh temporary per step costs its page faults on CPU)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return x / (1.0 + torch.exp(-x))
    t = torch.neg(x)
    torch.exp(t, out=t)
    t.add_(1.0)
    return torch.div(x, t, out=t)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """Position-invariant softplus ``log(1 + exp(x))`` (``x`` above ``threshold``, as torch does)."""
    return torch.where(x > threshold, x, torch.log(1.0 + torch.exp(torch.clamp(x, max=threshold))))


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """Position-invariant ``1 / sqrt(x)`` (``torch.rsqrt`` is not: its tail uses another formula)."""
    return 1.0 / torch.sqrt(x)
