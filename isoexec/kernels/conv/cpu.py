"""Batch- and mode-invariant depthwise causal conv1d + SiLU on CPU (region ``gdn.conv1d``)."""

from __future__ import annotations

import torch

from isoexec.kernels.primitives import silu


def iso_causal_conv1d(pieces: list[torch.Tensor], w: torch.Tensor, prefixes: list[torch.Tensor]
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Depthwise causal conv1d + SiLU for many sequence pieces at once (region ``gdn.conv1d``).

    Output position t of a piece sums ``w[:, j] * x[t - Kc + 1 + j]`` for j = 0..Kc-1 in that order,
    in fp32 (the taps before the piece come from its prefix), whatever the case (prefill, chunked
    prefill, decode) and whatever the other pieces: the same per-element operations everywhere. All
    pieces run in one vectorised pass over ``[prefix_0 | x_0 | prefix_1 | x_1 | ...]``.

    Args:
        pieces: per sequence piece its new inputs ``[L_b, C]`` (boundary dtype).
        w: ``[C, Kc]`` conv weight (HF ``conv1d.weight.squeeze(1)``).
        prefixes: per piece the previous ``Kc-1`` inputs ``[Kc-1, C]`` (zeros at sequence start).

    Returns:
        (per piece ``[L_b, C]`` in the inputs' dtype, per piece its new prefix ``[Kc-1, C]``).
    """
    kc = w.shape[1]
    dtype = pieces[0].dtype
    parts, rows, ends, off = [], [], [], 0
    for x, p in zip(pieces, prefixes):
        parts += [p.to(dtype), x]
        rows.append(torch.arange(off, off + x.shape[0]))
        off += x.shape[0] + kc - 1
        ends.append(off)
    ext = torch.cat(parts, dim=0).float()
    idx = torch.cat(rows)
    wf = w.float()
    acc = ext[idx] * wf[:, 0]
    for j in range(1, kc):
        acc = acc + ext[idx + j] * wf[:, j]
    ys = list(silu(acc).to(dtype).split([x.shape[0] for x in pieces]))
    new_prefixes = [ext[e - (kc - 1) : e].to(dtype) if kc > 1 else p for e, p in zip(ends, prefixes)]
    return ys, new_prefixes
