"""Batch-invariant RMSNorm, gated RMSNorm and l2norm on CPU (regions ``norm.rms``, ``gdn.norm``,
``gdn.l2norm``).

Semantics follow transformers' ``modeling_qwen3_next.py``: RMSNorm in fp32 with a ``(1 + w)``
scale, the gated RMSNorm ``w * norm(x).to(dtype) * silu(z)``, fla's l2norm. Reductions run through
:func:`~isoexec.kernels.primitives.tree_sum` and transcendental functions through the
position-invariant helpers of :mod:`isoexec.kernels.primitives`.
"""

from __future__ import annotations

import torch

from isoexec.kernels.primitives import rsqrt, silu, tree_sum


def iso_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, cast to ``x.dtype``.

    Args:
        x: ``[..., D]``. w: ``[D]``. zero_centered: scale by ``1 + w`` (Qwen3-Next) instead of ``w``.
    """
    xf = x.float()
    var = tree_sum(xf * xf, dim=-1, keepdim=True) / xf.shape[-1]
    y = xf * rsqrt(var + eps)
    scale = (1.0 + w.float()) if zero_centered else w.float()
    return (y * scale).to(x.dtype)


def iso_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of the GDN output (region ``gdn.norm``): ``w * norm(x).to(dtype) * silu(z)``.

    Args:
        x: ``[N, D]`` core output (boundary dtype). z: ``[N, D]`` gate. w: ``[D]``.
    """
    xf = x.float()
    var = tree_sum(xf * xf, dim=-1, keepdim=True) / xf.shape[-1]
    y = (xf * rsqrt(var + eps)).to(x.dtype)
    y = w * y
    return (y.float() * silu(z.float())).to(x.dtype)


def iso_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim in fp32 (region ``gdn.l2norm``, as fla)."""
    xf = x.float()
    return xf * rsqrt(tree_sum(xf * xf, dim=-1, keepdim=True) + eps)
