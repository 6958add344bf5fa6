"""Batch-invariant RMSNorm, gated RMSNorm and l2norm on CPU (regions ``norm.rms``, ``gdn.norm``,
``gdn.l2norm``).

Semantics follow transformers' ``modeling_qwen3_next.py``: RMSNorm in fp32 with a ``(1 + w)``
scale, the gated RMSNorm ``w * norm(x).to(dtype) * silu(z)``, fla's l2norm. The forward of every case
(trainer, engine; with or without autograd) runs the C kernel ``norms.c``: per row a fixed binary-tree
sum of squares and IEEE fp32 operations with a correctly rounded ``sqrtf`` (``torch.sqrt`` on CPU is not
correctly rounded, so these are the kernel's own bits, recorded in the contract); the gated norm's
SiLU runs in torch (:func:`~isoexec.kernels.primitives.silu`) and comes in as an operand. Under
autograd the gradient is that of the torch expression of the same function
(:func:`~isoexec.kernels.autograd.with_ref_grad`).
"""

from __future__ import annotations

import ctypes

import torch

from isoexec.kernels.autograd import with_ref_grad
from isoexec.kernels.native_build import c_ptr, kernel_library
from isoexec.kernels.primitives import pow2_at_least, rsqrt, silu, tree_sum

SQRT = "libm_sqrtf_ieee"
"""Contract value of the norms' square root (``norms.c``'s ``1.0f / sqrtf(v)``, correctly rounded)."""


def _c_norm(fn: str, x: torch.Tensor, eps: float, *extra, tensors=()) -> torch.Tensor:
    """Run ``norms.c``'s ``fn`` over the rows of ``x`` ([..., D]; fp32 copies of ``x`` and ``tensors``, then
    ``extra`` ints): ``[..., D]`` fp32.

    Raises:
        ValueError: an empty last dimension or a tensor not on the CPU.
    """
    d = x.shape[-1]
    if d == 0:
        raise ValueError(f"{fn}: needs a non-empty last dimension, got x of shape {tuple(x.shape)}")
    off = [t.device for t in (x, *tensors) if t.device.type != "cpu"]
    if off:
        raise ValueError(f"{fn}: runs on CPU tensors, got one on {off[0]}")
    p = pow2_at_least(d)
    xf = x.detach().float().contiguous()
    ts = [t.detach().float().contiguous() for t in tensors]
    out = torch.empty_like(xf)
    work = torch.empty(p, dtype=torch.float32)
    ints = [ctypes.c_int(int(e)) for e in extra]
    getattr(kernel_library(__file__, "norms.c"), fn)(
        c_ptr(xf), *map(c_ptr, ts), c_ptr(out), ctypes.c_int64(xf.numel() // d), ctypes.c_int64(d), ctypes.c_int64(p),
        ctypes.c_float(eps), *ints, c_ptr(work))
    return out


def iso_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, cast to ``x.dtype``.

    Args:
        x: ``[..., D]``. w: ``[D]``. zero_centered: scale by ``1 + w`` (Qwen3-Next) instead of ``w``.

    Raises:
        ValueError: ``w`` not ``[D]``, an empty D, a tensor not on the CPU.
    """
    if w.shape != x.shape[-1:]:
        raise ValueError(f"norm.rms: weight {tuple(w.shape)} for rows of {x.shape[-1]} features")
    return with_ref_grad(lambda a, b: _c_norm("isoexec_rms_norm", a, eps, zero_centered, tensors=(b,)).to(x.dtype),
                         lambda a, b: _rms_ref(a, b, eps, zero_centered), x, w)


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """The torch expression of :func:`iso_rms_norm` (its gradient's reference)."""
    xf = x.float()
    var = tree_sum(xf * xf, dim=-1, keepdim=True) / xf.shape[-1]
    y = xf * rsqrt(var + eps)
    scale = (1.0 + w.float()) if zero_centered else w.float()
    return (y * scale).to(x.dtype)


def iso_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of the GDN output (region ``gdn.norm``): ``w * norm(x).to(dtype) * silu(z)``.

    Args:
        x: ``[N, D]`` core output (boundary dtype). z: ``[N, D]`` gate. w: ``[D]``.

    Raises:
        ValueError: z not of x's shape, ``w`` not ``[D]``, an empty D, a tensor not on the CPU.
    """
    if w.shape != x.shape[-1:] or z.shape != x.shape:
        raise ValueError(f"gdn.norm: x {tuple(x.shape)}, z {tuple(z.shape)}, w {tuple(w.shape)}: z must have x's "
                         "shape and w the feature dim")
    rounds = (x.dtype == torch.bfloat16, torch.promote_types(w.dtype, x.dtype) == torch.bfloat16)

    def fwd(a, b, c):
        return _c_norm("isoexec_gated_rms_norm", a, eps, *rounds, tensors=(silu(b.detach().float()), c)).to(x.dtype)

    return with_ref_grad(fwd, lambda a, b, c: _gated_ref(a, b, c, eps), x, z, w)


def _gated_ref(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch expression of :func:`iso_gated_rms_norm` (its gradient's reference)."""
    xf = x.float()
    var = tree_sum(xf * xf, dim=-1, keepdim=True) / xf.shape[-1]
    y = (xf * rsqrt(var + eps)).to(x.dtype)
    y = w * y
    return (y.float() * silu(z.float())).to(x.dtype)


def iso_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim in fp32 (region ``gdn.l2norm``, as fla)."""
    return with_ref_grad(lambda a: _c_norm("isoexec_l2norm", a, eps), lambda a: _l2_ref(a, eps), x)


def _l2_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch expression of :func:`iso_l2norm` (its gradient's reference)."""
    xf = x.float()
    return xf * rsqrt(tree_sum(xf * xf, dim=-1, keepdim=True) + eps)
