"""Batch- and mode-invariant depthwise causal conv1d + SiLU on CPU (region ``gdn.conv1d``)."""

from __future__ import annotations

import ctypes

import torch

from isoexec.kernels.conv.layout import check_inputs, pack
from isoexec.kernels.native_build import c_ptr, kernel_library
from isoexec.kernels.primitives import silu


def iso_causal_conv1d(pieces: list[torch.Tensor], w: torch.Tensor, prefixes: list[torch.Tensor]
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Depthwise causal conv1d + SiLU for many sequence pieces at once (region ``gdn.conv1d``).

    Output position t of a piece sums ``w[:, j] * x[t - Kc + 1 + j]`` for j = 0..Kc-1 in that order,
    in fp32 (the taps before the piece come from its prefix), whatever the case (prefill, chunked
    prefill, decode) and whatever the other pieces: the same per-element operations everywhere. All
    pieces run in one pass of the C kernel ``causal_conv1d.c`` over their packed layout
    (:mod:`isoexec.kernels.conv.layout`; only the rows that are outputs); the SiLU follows in torch. Under autograd the tap sums' gradient
    comes from the same C file (fp32, not bitwise).

    Args:
        pieces: per sequence piece its new inputs ``[L_b, C]`` (boundary dtype).
        w: ``[C, Kc]`` conv weight (HF ``conv1d.weight.squeeze(1)``).
        prefixes: per piece the previous ``Kc-1`` inputs ``[Kc-1, C]`` (zeros at sequence start).

    Returns:
        (per piece ``[L_b, C]`` in the inputs' dtype, per piece its new prefix ``[Kc-1, C]``).

    Raises:
        ValueError: see :func:`~isoexec.kernels.conv.layout.check_inputs`.
    """
    dtype, channels, kc = check_inputs(pieces, w, prefixes)
    if (kc > 1 and all(x.shape[0] == 1 for x in pieces) and not torch.is_grad_enabled()
            and all(p.dtype == dtype for p in prefixes)):
        # decode: every piece one token; [prefix_b | x_b] as rows of one [B, Kc, C] tensor (the same tap sums)
        ext = torch.cat([torch.stack(prefixes), torch.stack(pieces)], dim=1)
        b = len(pieces)
        acc = _tap_sums(ext.float().view(b * kc, channels), w.float().t(), torch.arange(b) * kc)
        return list(silu(acc).to(dtype).split(1)), list(ext[:, 1:].unbind(0))
    packed = pack(pieces, prefixes, dtype, kc)
    ext = packed.ext.float()
    wt = w.float().t().contiguous()  # [Kc, C]: tap j's weights contiguous
    ys = list(silu(_Taps.apply(ext, wt, packed.first)).to(dtype).split(packed.lengths))
    if kc == 1:
        return ys, list(prefixes)
    return ys, list(packed.ext.detach()[packed.tail].unbind(0))


class _Taps(torch.autograd.Function):
    """The tap sums of rows ``first`` of ``ext`` (``[R, C]`` fp32) with ``wt`` (``[Kc, C]`` fp32) in the C
    kernel ``causal_conv1d.c``: ``[len(first), C]`` fp32; backward in the same file (fp32, not bitwise)."""

    @staticmethod
    def forward(ctx, ext, wt, first):  # noqa: D102
        ext, wt, first = ext.contiguous(), wt.contiguous(), first.contiguous()
        ctx.save_for_backward(ext, wt, first)
        return _tap_sums(ext, wt, first)

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        ext, wt, first = ctx.saved_tensors
        dout = dout.float().contiguous()
        dext, dwt = torch.empty_like(ext), torch.empty_like(wt)
        kernel_library(__file__, "causal_conv1d.c").isoexec_causal_conv1d_bwd(
            c_ptr(ext), c_ptr(wt), c_ptr(first), c_ptr(dout), c_ptr(dext), c_ptr(dwt), _i(ext.shape[0]), _i(first.numel()),
            _i(ext.shape[1]), _i(wt.shape[0]))
        return dext, dwt, None


def _tap_sums(ext: torch.Tensor, wt: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``causal_conv1d.c``'s tap sums of rows ``first`` of ``ext`` (``[R, C]`` fp32) with ``wt`` (``[Kc, C]``
    fp32): ``[len(first), C]`` fp32."""
    ext, wt, first = ext.contiguous(), wt.contiguous(), first.contiguous()
    out = torch.empty(first.numel(), ext.shape[1], dtype=torch.float32)
    kernel_library(__file__, "causal_conv1d.c").isoexec_causal_conv1d(
        c_ptr(ext), c_ptr(wt), c_ptr(first), c_ptr(out), _i(first.numel()), _i(ext.shape[1]), _i(wt.shape[0]))
    return out


def _i(n: int) -> ctypes.c_int64:
    return ctypes.c_int64(n)
