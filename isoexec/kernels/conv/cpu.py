"""Batch- and mode-invariant depthwise causal conv1d + SiLU on CPU (region ``gdn.conv1d``)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from isoexec.kernels.autograd import with_ref_grad
from isoexec.kernels.primitives import silu


def iso_causal_conv1d(pieces: list[torch.Tensor], w: torch.Tensor, prefixes: list[torch.Tensor]
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Depthwise causal conv1d + SiLU for many sequence pieces at once (region ``gdn.conv1d``).

    Output position t of a piece sums ``w[:, j] * x[t - Kc + 1 + j]`` for j = 0..Kc-1 in that order,
    in fp32 (the taps before the piece come from its prefix), whatever the case (prefill, chunked
    prefill, decode) and whatever the other pieces: the same per-element operations everywhere. All
    pieces run in one pass of the C kernel ``causal_conv1d.c`` over ``[prefix_0 | x_0 | prefix_1 | x_1 | ...]``
    (only the rows that are outputs); the SiLU follows in torch. Under autograd the gradient is that of
    the same tap sum as torch expressions.

    Args:
        pieces: per sequence piece its new inputs ``[L_b, C]`` (boundary dtype).
        w: ``[C, Kc]`` conv weight (HF ``conv1d.weight.squeeze(1)``).
        prefixes: per piece the previous ``Kc-1`` inputs ``[Kc-1, C]`` (zeros at sequence start).

    Returns:
        (per piece ``[L_b, C]`` in the inputs' dtype, per piece its new prefix ``[Kc-1, C]``).
    """
    kc = w.shape[1]
    dtype = pieces[0].dtype
    channels = pieces[0].shape[-1]
    if w.dim() != 2 or w.shape[0] != channels:
        raise ValueError(f"gdn.conv1d: the weight must be [channels, taps] = [{channels}, Kc], got {tuple(w.shape)}")
    parts = [t for x, p in zip(pieces, prefixes) for t in (p if p.dtype == dtype else p.to(dtype), x)]
    ext = torch.cat(parts, dim=0).float()  # [prefix_0 | x_0 | prefix_1 | x_1 | ...]
    lens = torch.tensor([x.shape[0] for x in pieces], dtype=torch.long)
    ends = torch.cumsum(lens + (kc - 1), 0)  # end of each piece's span in ext
    starts = ends - lens - (kc - 1)
    # row of ext holding the first tap of output t of piece b: start_b + t
    first = torch.arange(int(lens.sum())) + torch.repeat_interleave(starts - (torch.cumsum(lens, 0) - lens), lens)
    wt = w.float().t().contiguous()  # [Kc, C]: tap j's weights contiguous
    acc = with_ref_grad(lambda e, ww: _taps(e, ww, first), lambda e, ww: _taps_ref(e, ww, first), ext, wt)
    ys = list(silu(acc).to(dtype).split(lens.tolist()))
    if kc == 1:
        return ys, list(prefixes)
    tail = ext[(ends[:, None] - (kc - 1)) + torch.arange(kc - 1)[None, :]].to(dtype)  # [B, Kc-1, C]
    return ys, list(tail.unbind(0))


def _taps(ext: torch.Tensor, wt: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The tap sums of rows ``first`` in the C kernel ``causal_conv1d.c``: ``[len(first), C]`` fp32."""
    import ctypes

    ext, wt, first = ext.detach().contiguous(), wt.detach().contiguous(), first.contiguous()
    out = torch.empty(first.numel(), ext.shape[1], dtype=torch.float32)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    _lib().isoexec_causal_conv1d(
        ptr(ext), ptr(wt), ptr(first), ptr(out), ctypes.c_int64(first.numel()), ctypes.c_int64(ext.shape[1]),
        ctypes.c_int64(wt.shape[0]))
    return out


@cache
def _lib():
    """The compiled ``causal_conv1d.c``."""
    from isoexec.kernels.native_build import load_c_kernel

    return load_c_kernel(str(Path(__file__).with_name("causal_conv1d.c")))


def _taps_ref(ext: torch.Tensor, wt: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The same tap sums as torch expressions over contiguous slices of ``ext`` (rows whose taps straddle
    two pieces are computed and not read), then rows ``first``: the gradient's reference."""
    rows = ext.shape[0] - (wt.shape[0] - 1)
    acc = ext[:rows] * wt[0]
    for j in range(1, wt.shape[0]):
        acc = acc + ext[j : j + rows] * wt[j]
    return acc[first]
