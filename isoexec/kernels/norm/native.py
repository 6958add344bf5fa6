"""Native norms: transformers' ``Qwen3NextRMSNorm`` / ``Qwen3NextRMSNormGated`` and fla's l2norm with
stock torch reductions (``mean``, ``sum``, ``torch.rsqrt``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def native_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    """HF ``Qwen3NextRMSNorm`` (``torch.rsqrt``, ``mean``)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * ((1.0 + w.float()) if zero_centered else w.float())).type_as(x)


def native_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``Qwen3NextRMSNormGated``."""
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = w * y.to(dtype)
    return (y * F.silu(z.float())).to(dtype)


def native_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF/fla ``l2norm`` in fp32."""
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(dim=-1, keepdim=True) + eps)
