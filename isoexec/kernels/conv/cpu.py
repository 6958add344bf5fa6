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
    parts = [t for x, p in zip(pieces, prefixes) for t in (p if p.dtype == dtype else p.to(dtype), x)]
    ext = torch.cat(parts, dim=0).float()  # [prefix_0 | x_0 | prefix_1 | x_1 | ...]
    lens = torch.tensor([x.shape[0] for x in pieces], dtype=torch.long)
    ends = torch.cumsum(lens + (kc - 1), 0)  # end of each piece's span in ext
    starts = ends - lens - (kc - 1)
    # the taps of every row r of ext with r + kc - 1 inside it, as contiguous slices (no gathers); rows
    # whose taps straddle two pieces are computed and never read
    rows = ext.shape[0] - (kc - 1)
    wt = w.float().t().contiguous()  # [Kc, C]: tap j's weights contiguous (a strided column slows every multiply)
    acc = ext[:rows] * wt[0]
    if torch.is_grad_enabled() and (ext.requires_grad or wt.requires_grad):
        for j in range(1, kc):
            acc = acc + ext[j : j + rows] * wt[j]
    else:  # the same operations in one reused temporary (a fresh large temporary per tap costs page faults)
        tmp = torch.empty_like(acc)
        for j in range(1, kc):
            acc.add_(torch.mul(ext[j : j + rows], wt[j], out=tmp))
    # row of output t of piece b: its first tap, ext[start_b + t]
    idx = torch.arange(int(lens.sum())) + torch.repeat_interleave(starts - (torch.cumsum(lens, 0) - lens), lens)
    ys = list(silu(acc[idx]).to(dtype).split(lens.tolist()))
    if kc == 1:
        return ys, list(prefixes)
    tail = ext[(ends[:, None] - (kc - 1)) + torch.arange(kc - 1)[None, :]].to(dtype)  # [B, Kc-1, C]
    return ys, list(tail.unbind(0))
