"""Row-wise regions: GEMM (``*.proj``, ``moe.router``, ``lm_head``), RMSNorm, gated RMSNorm,
l2norm, RoPE, activations and the causal conv1d, for the ``isoexec`` (CPU) and ``native`` sets.

Semantics follow transformers' ``modeling_qwen3_next.py`` (the HF reference): RMSNorm in fp32 with
a ``(1 + w)`` scale, the gated RMSNorm ``w * norm(x).to(dtype) * silu(z)``, partial rotary
embeddings over the first ``rotary_dim`` channels with ``rotate_half``.

isoexec rules: every GEMM runs through :func:`~isoexec.kernels.primitives.tile_mm` in fp32 with a
fixed row tile; reductions through :func:`tree_sum`; transcendental functions through the
position-invariant helpers; activations are rounded to the boundary dtype where HF rounds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from isoexec.kernels.primitives import rsqrt, sigmoid, silu, tile_mm, tree_sum


# --------------------------------------------------------------------------------------- isoexec
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


def iso_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Output gate of gated attention (region ``attn.gate``): ``x * sigmoid(gate)``, fp32 math."""
    return (x.float() * sigmoid(gate.float())).to(x.dtype)


def iso_causal_conv1d(x: torch.Tensor, w: torch.Tensor, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU for one sequence (region ``gdn.conv1d``).

    Output position t sums ``w[:, j] * x[t - Kc + 1 + j]`` for j = 0..Kc-1 in that order, in fp32,
    whatever the case (prefill, chunked prefill, decode): the same per-position order everywhere.

    Args:
        x: ``[L, C]`` new inputs. w: ``[C, Kc]`` conv weight (HF ``conv1d.weight.squeeze(1)``).
        prefix: ``[Kc-1, C]`` the previous Kc-1 inputs (zeros at sequence start).

    Returns:
        (``[L, C]`` output in ``x.dtype``, new prefix ``[Kc-1, C]``).
    """
    kc = w.shape[1]
    full = torch.cat([prefix.to(x.dtype), x], dim=0).float()
    wf = w.float()
    n = x.shape[0]
    acc = full[0:n] * wf[:, 0]
    for j in range(1, kc):
        acc = acc + full[j : j + n] * wf[:, j]
    return silu(acc).to(x.dtype), full[-(kc - 1) :].to(x.dtype) if kc > 1 else prefix


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[N, rotary_dim]`` for absolute positions, as HF (``cat(freqs, freqs)``), cast to ``dtype``.

    Each row depends only on its position (elementwise fp32 math; ``cos``/``sin`` are position-invariant).
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary embedding (region ``attn.rope``) on ``x [N, H, D]``; the first ``cos.shape[-1]`` channels rotate.

    Elementwise only, so it is batch- and mode-invariant in both kernel sets.
    """
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos[:, None, :] + rot * sin[:, None, :]
    return torch.cat([out, xp], dim=-1)


# ---------------------------------------------------------------------------------------- native
def native_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stock ``F.linear`` in the activation dtype (MKL/oneDNN picks the kernel from the shape)."""
    y = F.linear(x, w.to(x.dtype))
    return y.to(out_dtype) if out_dtype is not None else y


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


def native_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """HF gated attention output: ``x * torch.sigmoid(gate)`` in the activation dtype."""
    return x * torch.sigmoid(gate)


def native_causal_conv1d(x: torch.Tensor, w: torch.Tensor, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style ``F.conv1d`` (depthwise, padding from the prefix) + ``F.silu`` in the activation dtype."""
    kc = w.shape[1]
    full = torch.cat([prefix.to(x.dtype), x], dim=0)  # [Kc-1+L, C]
    y = F.conv1d(full.t().unsqueeze(0), w.to(x.dtype).unsqueeze(1), groups=w.shape[0])[0].t()
    return F.silu(y), full[-(kc - 1) :] if kc > 1 else prefix
