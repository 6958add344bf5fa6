"""Native causal conv1d: transformers' ``F.conv1d`` (depthwise) + ``F.silu`` in the activation dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def native_causal_conv1d(x: torch.Tensor, w: torch.Tensor, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style ``F.conv1d`` (depthwise, padding from the prefix) + ``F.silu`` in the activation dtype."""
    kc = w.shape[1]
    full = torch.cat([prefix.to(x.dtype), x], dim=0)  # [Kc-1+L, C]
    return native_conv_span(full, w), full[-(kc - 1) :] if kc > 1 else prefix


def native_conv_span(full: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.conv1d`` + ``F.silu`` of one piece's prefix and inputs ``full`` (``[Kc-1+L, C]``): ``[L, C]``."""
    y = F.conv1d(full.t().unsqueeze(0), w.to(full.dtype).unsqueeze(1), groups=w.shape[0])[0].t()
    return F.silu(y)


def native_causal_conv1d_pieces(pieces: list[torch.Tensor], w: torch.Tensor, prefixes: list[torch.Tensor]
                                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`native_causal_conv1d` piece by piece (the region's batched signature, see
    :func:`isoexec.kernels.conv.cpu.iso_causal_conv1d`)."""
    out = [native_causal_conv1d(x, w, p) for x, p in zip(pieces, prefixes)]
    return [y for y, _ in out], [p for _, p in out]
