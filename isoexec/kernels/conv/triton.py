"""Depthwise causal conv1d + SiLU in Triton (region ``gdn.conv1d``).

Output position t sums ``w[:, j] * x[t - Kc + 1 + j]`` for j = 0..Kc-1 in that order, in fp32 (taps
before the piece come from the cached prefix). One compiled code path for every position and case,
so prefill, chunked prefill and decode agree bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from isoexec.kernels.autograd import with_ref_grad
from isoexec.kernels.conv.native import native_causal_conv1d


@triton.jit(do_not_specialize=["n", "CH"])
def _conv_kernel(x_ptr, p_ptr, w_ptr, y_ptr, n, CH, KC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < CH
    acc = tl.zeros((BT, BC), tl.float32)
    for j in tl.static_range(KC):
        src = t - (KC - 1) + j  # position in the piece; < 0 reads the prefix row KC-1+src
        in_x = (src >= 0) & (t < n)
        in_p = (src < 0) & (t < n)
        xv = tl.load(x_ptr + tl.maximum(src, 0).to(tl.int64)[:, None] * CH + c[None, :], mask=in_x[:, None] & cm[None, :], other=0.0)
        pv = tl.load(p_ptr + tl.maximum(src + KC - 1, 0)[:, None] * CH + c[None, :], mask=in_p[:, None] & cm[None, :], other=0.0)
        xf = tl.where(in_x[:, None], xv, pv).to(tl.float32)
        wj = tl.load(w_ptr + c * KC + j, mask=cm, other=0.0).to(tl.float32)
        if j == 0:
            acc = xf * wj[None, :]
        else:
            acc = acc + xf * wj[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + t.to(tl.int64)[:, None] * CH + c[None, :], y.to(y_ptr.dtype.element_ty), mask=(t < n)[:, None] & cm[None, :])


def causal_conv1d(x: torch.Tensor, w: torch.Tensor, prefix: torch.Tensor, block_t: int, block_c: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv1d + SiLU of one piece. x ``[L, C]``; w ``[C, Kc]``; prefix ``[Kc-1, C]`` (previous inputs);
    block_t / block_c: positions / channels per program (``kernels.triton.conv_block_t/_c``).

    Returns (``[L, C]`` in ``x.dtype``, new prefix ``[Kc-1, C]``)."""
    n, ch = x.shape
    kc = w.shape[1]
    x = x.contiguous()
    prefix = prefix.to(x.dtype).contiguous()
    y = torch.empty_like(x)
    if n:
        _conv_kernel[(triton.cdiv(n, block_t), triton.cdiv(ch, block_c))](x, prefix, w.contiguous(), y, n, ch, KC=kc,
                                                                          BT=block_t, BC=block_c, num_warps=4)
    if kc == 1:
        return y, prefix
    new_prefix = x[-(kc - 1):] if n >= kc - 1 else torch.cat([prefix, x])[-(kc - 1):]
    return y, new_prefix.clone()


def causal_conv1d_autograd(x: torch.Tensor, w: torch.Tensor, prefix: torch.Tensor, block_t: int, block_c: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d` whose gradient is transformers' ``F.conv1d`` path; the new prefix is detached."""
    y = with_ref_grad(lambda a, b, p: causal_conv1d(a, b, p, block_t, block_c)[0],
                      lambda a, b, p: native_causal_conv1d(a, b, p)[0], x, w, prefix)
    kc = w.shape[1]
    new_prefix = torch.cat([prefix.to(x.dtype), x.detach()])[-(kc - 1):] if kc > 1 else prefix
    return y, new_prefix


def causal_conv1d_pieces(pieces: list[torch.Tensor], w: torch.Tensor, prefixes: list[torch.Tensor], block_t: int,
                         block_c: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`causal_conv1d_autograd` piece by piece (the region's batched signature)."""
    out = [causal_conv1d_autograd(x, w, p, block_t, block_c) for x, p in zip(pieces, prefixes)]
    return [y for y, _ in out], [p for _, p in out]
