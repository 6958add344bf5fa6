"""The CPU GEMM kernels of the isoexec set, built by :mod:`isoexec.kernels.native_build`; both give an
output element bits that depend on nothing but its row of ``x`` and column of ``w`` (batch-, column- and
TP-invariant; see the C files' headers):

* ``bf16_gemm.c`` (:func:`bf16_pair_gemm`): bf16 operands (the GEMM regions of a bf16 model), the fp32
  chain taken in k pairs as the AVX512-BF16 instruction ``VDPBF16PS`` defines it (two FMAs per pair,
  odd element first, subnormals flushed), 32 multiply-adds per vector instruction where the CPU has
  it, the same chain in scalar code where it does not;
* ``fma_gemm.c`` (:func:`fma_gemm`): fp32 operands (an fp32 model), one ascending fused-multiply-add
  chain over K per output element.

:func:`isoexec.kernels.primitives.tile_mm` picks one by the operands' dtype; ``isoexec bench`` times
both beside torch's bf16 linear at the model's shapes (``gemm_kernels.csv``)."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from isoexec.kernels.native_build import c_ptr, kernel_library

K_ORDER = "ascending_fmaf_chain"
"""Contract value of the GEMM's summation: ``acc = fmaf(x[i, k], w[k, j], acc)`` for k ascending from 0 (per leaf, for
the pik leaf GEMM, whose leaves then meet in the adjacent-pairs tree)."""

K_ORDER_BF16_PAIRS = "ascending_bf16_pairs_odd_first_fmaf_daz_ftz"
"""Contract value of :func:`bf16_pair_gemm`'s summation (``bf16_gemm.c``): per k pair, ascending,
``fmaf`` of the odd element then of the even one, subnormal inputs and results flushed (``VDPBF16PS``)."""


@cache
def _lib() -> ctypes.CDLL:
    lib = kernel_library(__file__, "fma_gemm.c")
    lib.isoexec_fma_panel_width.restype = ctypes.c_int64
    return lib


def _pack(w: torch.Tensor) -> torch.Tensor:
    """``w [K, M]`` fp32 as the C kernel's column panels ``[ceil(M / NR), K, NR]``, zero past column M
    (the same values, laid out so that a micro-tile streams its weights; see ``fma_gemm.c``)."""
    nr = int(_lib().isoexec_fma_panel_width())
    k, m = w.shape
    p = -(-m // nr)
    return torch.nn.functional.pad(w, (0, p * nr - m)).view(k, p, nr).transpose(0, 1).contiguous()


def _packer(w: torch.Tensor):
    """(attribute a pinned copy lives under, pack function) for ``w``'s kernel: bf16 -> ``bf16_gemm.c``,
    else ``fma_gemm.c``."""
    return ("_isoexec_bf16_panels", _pack_bf16) if w.dtype == torch.bfloat16 else ("_isoexec_fma_panels", _pack)


def pin_panels(w: torch.Tensor) -> None:
    """Pack ``w`` (``[K, M]``, float32 for :func:`fma_gemm` or bfloat16 for :func:`bf16_pair_gemm`) now
    and keep the panels on it for its lifetime: only for a tensor its owner never writes
    (:func:`isoexec.kernels.primitives.tile_linear`'s private copy of a weight). Any other ``w`` is
    packed on every call: a cache keyed on the tensor cannot see writes through ``.data`` or numpy,
    which bypass the version counter."""
    attr, pack = _packer(w)
    setattr(w, attr, pack(w))


def _panels(w: torch.Tensor) -> torch.Tensor:
    """The panels of ``w`` for its kernel: pinned ones (:func:`pin_panels`), else packed now."""
    attr, pack = _packer(w)
    pinned = getattr(w, attr, None)
    return pinned if pinned is not None else pack(w)


def _check_operands(name: str, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, row_tile: int,
                    col_tile: int | None) -> tuple[int, int, int, int]:
    """(N, K, M, col_tile with None as all M) of a CPU GEMM call, or ValueError naming what is wrong: a dtype
    other than ``dtype``, a tensor not on the CPU, shapes that do not chain, a tile < 1."""
    if x.dtype != dtype or w.dtype != dtype:
        raise ValueError(f"{name} takes {str(dtype).removeprefix('torch.')} x and w, got {x.dtype} and {w.dtype}")
    if x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError(f"{name} runs on CPU tensors, got x on {x.device} and w on {w.device}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"{name} needs x [N, K] and w [K, M], got {tuple(x.shape)} and {tuple(w.shape)}")
    col_tile = max(w.shape[1], 1) if col_tile is None else col_tile
    if row_tile < 1 or col_tile < 1:
        raise ValueError(f"{name} tiles must be >= 1, got row_tile={row_tile}, col_tile={col_tile}")
    return x.shape[0], x.shape[1], w.shape[1], col_tile


def fma_gemm(x: torch.Tensor, w: torch.Tensor, row_tile: int, col_tile: int | None = None,
             leaves: int = 1) -> torch.Tensor:
    """``x @ w`` in fp32, each output one ascending FMA chain over K, or with ``leaves`` > 1 the
    fixed adjacent-pairs tree over the chains of ``leaves`` contiguous K leaves (the pik leaf GEMM).
    Not differentiable; :func:`isoexec.kernels.primitives.tile_mm` is the autograd node.

    Args:
        x: ``[N, K]`` float32 (any N >= 0; a column stride other than 1 is copied).
        w: ``[K, M]`` float32 (any strides: packed into the kernel's column panels on every call
            unless pinned, :func:`pin_panels`).
        row_tile: rows per cache block (contract constant ``row_tile``, rounded up to a multiple of 4;
            moves no bit).
        col_tile: columns per cache block (contract constant ``col_tile``, rounded up to a multiple of
            64; moves no bit); None: all M.
        leaves: L, contiguous leaves over K (a power of two dividing K; 1: one chain over all of K).

    Returns:
        ``[N, M]`` float32; element (i, j) depends only on ``x[i]`` and ``w[:, j]``.

    Raises:
        MemoryError: the leaves' scratch (``leaves`` x 1 KB) cannot be allocated.
        ValueError: a dtype other than float32, a tensor not on the CPU, non-2-D inputs, mismatched K,
            a tile < 1, or ``leaves`` not a power of two dividing K.
    """
    n, k, m, col_tile = _check_operands("fma_gemm", x, w, torch.float32, row_tile, col_tile)
    if leaves < 1 or leaves & (leaves - 1) or k % leaves:
        raise ValueError(f"fma_gemm leaves={leaves} must be a power of two dividing K={k}")
    x = x if x.stride(1) == 1 or k <= 1 else x.contiguous()
    y = torch.empty((n, m), dtype=torch.float32)
    if n and m:
        i = ctypes.c_int64
        panels = _panels(w)  # held here: the kernel reads it after c_ptr() has returned
        if _lib().isoexec_fma_gemm(c_ptr(x), c_ptr(panels), c_ptr(y), i(n), i(k), i(m), i(x.stride(0)), i(m),
                                   i(row_tile), i(col_tile), i(leaves)):
            raise MemoryError(f"fma_gemm: no memory for the scratch of {leaves} leaves")
    return y


@cache
def _bf16_lib() -> ctypes.CDLL:
    lib = kernel_library(__file__, "bf16_gemm.c")
    lib.isoexec_bf16_panel_width.restype = ctypes.c_int64
    return lib


def bf16_simd() -> bool:
    """Whether ``bf16_gemm.c`` was built with ``VDPBF16PS`` (this CPU has AVX512_BF16); else it runs
    the same chain as scalar code."""
    return bool(_bf16_lib().isoexec_bf16_has_simd())


def _pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """``w [K, M]`` bf16 as ``bf16_gemm.c``'s panels ``[ceil(M / NR), ceil(K / 2), NR, 2]`` (k pairs of
    each column side by side), zero past column M and, for K odd, one zero feature appended."""
    nr = int(_bf16_lib().isoexec_bf16_panel_width())
    k, m = w.shape
    p, kp = -(-m // nr), k + k % 2
    w = torch.nn.functional.pad(w, (0, p * nr - m, 0, kp - k))
    return w.view(kp // 2, 2, p, nr).permute(2, 0, 3, 1).contiguous()


def bf16_pair_gemm(x: torch.Tensor, w: torch.Tensor, row_tile: int, col_tile: int | None = None,
                   leaves: int = 1, simd: bool = True) -> torch.Tensor:
    """``x @ w`` of bf16 operands in fp32, each output one chain over the k pairs as ``VDPBF16PS``
    computes it (``bf16_gemm.c``: per pair, ascending, ``fmaf`` of the odd element then of the even
    one, subnormals flushed), or with ``leaves`` > 1 the adjacent-pairs tree over the chains of
    ``leaves`` contiguous K leaves. Batch- and column-invariant like :func:`fma_gemm`; not differentiable.

    Args:
        x: ``[N, K]`` bfloat16 on the CPU (K odd: a zero feature is appended to x and w).
        w: ``[K, M]`` bfloat16 (packed into the kernel's panels on every call unless pinned, :func:`pin_panels`).
        row_tile, col_tile: cache blocks (contract constants; they move no bit). col_tile None: all M.
        leaves: L, contiguous K leaves (a power of two with K / L even).
        simd: False runs the scalar chain even where ``VDPBF16PS`` exists (same bits; the tests
            compare the two).

    Returns:
        ``[N, M]`` float32; element (i, j) depends only on ``x[i]`` and ``w[:, j]``.

    Raises:
        ValueError: dtypes other than bfloat16, tensors not on the CPU, shapes that do not chain, a tile
            < 1, ``leaves`` not a power of two or K / ``leaves`` odd.
        MemoryError: the kernel's scratch cannot be allocated.
    """
    n, k, m, col_tile = _check_operands("bf16_pair_gemm", x, w, torch.bfloat16, row_tile, col_tile)
    kp = k + k % 2
    if leaves < 1 or leaves & (leaves - 1) or (leaves > 1 and k % (2 * leaves)):
        raise ValueError(f"bf16_pair_gemm leaves={leaves} must be a power of two with K/leaves even (K={k})")
    if k % 2:
        x = torch.nn.functional.pad(x, (0, 1))
    elif x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((n, m), dtype=torch.float32)
    if n and m:
        i = ctypes.c_int64
        panels = _panels(w)  # held here while the kernel runs
        if _bf16_lib().isoexec_bf16_gemm(c_ptr(x), c_ptr(panels), c_ptr(y), i(n), i(kp), i(m), i(x.stride(0)), i(m),
                                         i(row_tile), i(col_tile), i(leaves), ctypes.c_int(int(simd))):
            raise MemoryError("bf16_pair_gemm: no memory for the kernel's scratch")
    return y
