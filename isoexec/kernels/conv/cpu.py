"""Batch- and mode-invariant depthwise causal conv1d + SiLU on CPU (region ``gdn.conv1d``)."""

from __future__ import annotations

import torch

from isoexec.kernels.primitives import silu


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
